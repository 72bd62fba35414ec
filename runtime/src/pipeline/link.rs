//! Tensors between neighbouring stages: activations forward, their gradients backward.
//!
//! Sends never block the schedule: each is queued on a send thread and waited on at the end of the step, as
//! [`super::schedule::validate`] models them. A send returns only once its receive took it (the backends'
//! point-to-point is a rendezvous), so sends and receives cannot share a thread (or a communicator): with an interleaved schedule two
//! ranks send to each other, and a receive queued behind a send that waits for the other rank's receive, itself
//! queued behind that rank's send, would never run. So each direction has a send thread, receives run on the schedule's
//! thread, and each has its own communicator: the messages rank `r` sends travel on the group of its colour, which its
//! receiving neighbour's receive thread holds (colours alternate around the ring of stages: two, or three for an
//! odd number of stages, whose last and first stages are neighbours).
//!
//! Every message is a header (dtype, rank, shape) and then the data: a stage whose output shape or dtype changes
//! (a shorter last batch, another precision) needs no agreement beforehand, and a receive never reuses a buffer of
//! another shape.
use std::time::{Duration, Instant};

use half::{bf16, f16};
use tch::{Kind, Tensor};

use crate::comm::async_comm::{CommThread, Handle};
use crate::comm::{Collectives, CommError, CommResult, Communicator, Element};

/// Header length: dtype code, number of dimensions, up to 8 dimensions.
const HEADER: usize = 10;

/// One direction: where this rank's sends go (on their thread) and where its receives come from (on the schedule's
/// thread, which waits for them anyway: no hand-off to another thread on the critical path).
struct Channel {
    send: CommThread,
    recv: Box<dyn Communicator>,
    to: usize,
    from: usize,
}

/// Sends and receives between neighbouring stages, each message carrying its shape and dtype.
pub struct StageLink {
    /// None with a single stage.
    channels: Option<[Channel; 2]>,
    /// The groups of colours this rank neither sends nor receives on (kept: the other ranks use theirs).
    _unused: Vec<Box<dyn Communicator>>,
    /// Sends queued and not yet known to be received.
    pending: Vec<Handle<()>>,
    /// Time the schedule spent blocked in receives since the last `take_wait`.
    waited: Duration,
}

const ACTIVATIONS: usize = 0;
const GRADIENTS: usize = 1;

impl StageLink {
    /// The links of this rank over `pipe`, a communicator over the pipeline's stages (rank = stage). Collective over
    /// `pipe`.
    pub fn new(pipe: Box<dyn Communicator>) -> CommResult<StageLink> {
        let (stage, p) = (pipe.rank(), pipe.world_size());
        if p == 1 {
            return Ok(StageLink { channels: None, _unused: Vec::new(), pending: Vec::new(), waited: Duration::ZERO });
        }
        let colours = if p % 2 == 1 { 3 } else { 2 };
        let colour = |r: usize| if p % 2 == 1 && r == p - 1 { 2 } else { r % 2 };
        let (next, prev) = ((stage + 1) % p, (stage + p - 1) % p);
        let mut unused = Vec::new();
        let mut make = |to: usize, from: usize| -> CommResult<Channel> {
            let mut groups: Vec<Option<Box<dyn Communicator>>> = Vec::with_capacity(colours);
            for _ in 0..colours {
                groups.push(Some(pipe.as_ref().split(Some(0), stage as i64)?.expect("every stage joins")));
            }
            let send = groups[colour(stage)].take().expect("one thread per group");
            let recv = groups[colour(from)].take().expect("a neighbour's colour is not this rank's");
            unused.extend(groups.into_iter().flatten());
            Ok(Channel { send: CommThread::spawn(send), recv, to, from })
        };
        let activations = make(next, prev)?;
        let gradients = make(prev, next)?;
        unused.push(pipe);
        Ok(StageLink {
            channels: Some([activations, gradients]),
            _unused: unused,
            pending: Vec::new(),
            waited: Duration::ZERO,
        })
    }

    /// Queues `output` for the next stage (the last stage's goes to the first: its next chunk, when interleaved).
    pub fn send_activation(&mut self, output: &Tensor) -> CommResult<()> {
        self.queue(ACTIVATIONS, output)
    }

    /// Queues `grad` (of this stage's input) for the previous stage.
    pub fn send_gradient(&mut self, grad: &Tensor) -> CommResult<()> {
        self.queue(GRADIENTS, grad)
    }

    /// The previous stage's next activation, in host memory (the stage moves it to its device).
    pub fn recv_activation(&mut self) -> CommResult<Tensor> {
        self.receive(ACTIVATIONS)
    }

    /// The next stage's next gradient.
    pub fn recv_gradient(&mut self) -> CommResult<Tensor> {
        self.receive(GRADIENTS)
    }

    /// Waits until every queued send was received (the end of a step).
    pub fn finish_sends(&mut self) -> CommResult<()> {
        let started = Instant::now();
        let mut first = None;
        for h in self.pending.drain(..) {
            if let Err(e) = h.wait() {
                first.get_or_insert(e);
            }
        }
        self.waited += started.elapsed();
        first.map_or(Ok(()), Err)
    }

    /// Time blocked on the neighbours since the last call.
    pub fn take_wait(&mut self) -> Duration {
        std::mem::take(&mut self.waited)
    }

    fn channel(&self, direction: usize) -> &Channel {
        &self.channels.as_ref().expect("a pipeline of one stage sends nothing")[direction]
    }

    fn receive(&mut self, direction: usize) -> CommResult<Tensor> {
        let channel = self.channel(direction);
        let started = Instant::now();
        let t = recv_tensor(channel.recv.as_ref(), channel.from);
        self.waited += started.elapsed();
        t
    }

    fn queue(&mut self, direction: usize, t: &Tensor) -> CommResult<()> {
        // Sends that finished give their errors now rather than at the end of the step.
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].is_done() {
                self.pending.swap_remove(i).wait()?;
            } else {
                i += 1;
            }
        }
        let t = t.detach().contiguous();
        let channel = self.channel(direction);
        let to = channel.to;
        let op = if direction == ACTIVATIONS { "send activation" } else { "send gradient" };
        let handle = channel.send.submit(op, move |c| send_tensor(c, &t, to));
        self.pending.push(handle);
        Ok(())
    }
}

fn dtype_code(kind: Kind) -> Option<i64> {
    Some(match kind {
        Kind::Float => 0,
        Kind::BFloat16 => 1,
        Kind::Half => 2,
        Kind::Int64 => 3,
        _ => return None,
    })
}

fn bad(rank: usize, what: String) -> CommError {
    CommError::BadArgument { op: "pipeline send", rank, what }
}

/// Sends the header, then the values.
pub fn send_tensor(c: &dyn Communicator, t: &Tensor, dst: usize) -> CommResult<()> {
    let rank = c.rank();
    let code = dtype_code(t.kind())
        .ok_or_else(|| bad(rank, format!("a stage's output is {:?}; stages send f32, bf16, f16 or i64", t.kind())))?;
    let size = t.size();
    if size.len() > HEADER - 2 {
        return Err(bad(
            rank,
            format!("a stage's output has {} dimensions; at most {} are sent", size.len(), HEADER - 2),
        ));
    }
    let mut header = [0i64; HEADER];
    header[0] = code;
    header[1] = size.len() as i64;
    header[2..2 + size.len()].copy_from_slice(&size);
    c.send(&header, dst)?;
    // Through bytes: tch's `Element` for bf16 claims to be Half.
    fn values<T: Element + Default>(t: &Tensor, rank: usize) -> CommResult<Vec<T>> {
        let n = t.numel();
        let mut v = vec![T::default(); n];
        t.f_copy_data_u8(bytemuck::cast_slice_mut(&mut v), n)
            .map_err(|e| bad(rank, format!("reading the tensor to send: {e}")))?;
        Ok(v)
    }
    match t.kind() {
        Kind::Float => c.send(&values::<f32>(t, rank)?, dst),
        Kind::BFloat16 => c.send(&values::<bf16>(t, rank)?, dst),
        Kind::Half => c.send(&values::<f16>(t, rank)?, dst),
        _ => c.send(&values::<i64>(t, rank)?, dst),
    }
}

/// Receives a header, then values of the shape and dtype it gives.
pub fn recv_tensor(c: &dyn Communicator, src: usize) -> CommResult<Tensor> {
    let mut header = [0i64; HEADER];
    c.recv(&mut header, src)?;
    let ndim = header[1].clamp(0, (HEADER - 2) as i64) as usize;
    let shape: Vec<i64> = header[2..2 + ndim].to_vec();
    fn values<T: Element + Default>(c: &dyn Communicator, src: usize, shape: &[i64], kind: Kind) -> CommResult<Tensor> {
        let n = shape.iter().product::<i64>().max(0) as usize;
        let mut v = vec![T::default(); n];
        c.recv(&mut v, src)?;
        Tensor::f_from_data_size(bytemuck::cast_slice(&v), shape, kind).map_err(|e| CommError::BadArgument {
            op: "pipeline recv",
            rank: c.rank(),
            what: format!("making a tensor of what rank {src} sent: {e}"),
        })
    }
    match header[0] {
        0 => values::<f32>(c, src, &shape, Kind::Float),
        1 => values::<bf16>(c, src, &shape, Kind::BFloat16),
        2 => values::<f16>(c, src, &shape, Kind::Half),
        3 => values::<i64>(c, src, &shape, Kind::Int64),
        code => Err(CommError::BadArgument {
            op: "pipeline recv",
            rank: c.rank(),
            what: format!("rank {src} sent a header with dtype code {code}: the stages run different builds"),
        }),
    }
}

/// Sends bytes (a manifest, a name): their length, then the bytes packed eight to a word.
pub fn send_bytes(c: &dyn Communicator, bytes: &[u8], dst: usize) -> CommResult<()> {
    c.send(&[bytes.len() as i64], dst)?;
    let mut words = vec![0i64; bytes.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<i64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
    c.send(&words, dst)
}

/// Receives what [`send_bytes`] sent.
pub fn recv_bytes(c: &dyn Communicator, src: usize) -> CommResult<Vec<u8>> {
    let mut len = [0i64];
    c.recv(&mut len, src)?;
    let len = len[0].max(0) as usize;
    let mut words = vec![0i64; len.div_ceil(8)];
    c.recv(&mut words, src)?;
    Ok(bytemuck::cast_slice::<i64, u8>(&words)[..len].to_vec())
}
