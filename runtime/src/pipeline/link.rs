//! Tensors between neighbouring stages: activations forward, their gradients backward. Each direction has its own
//! communicator on its own communication thread, so sends never block the schedule (they are queued in order and
//! waited on at the end of the step, as [`super::schedule::validate`] models them) and receives on one channel never
//! wait behind the other's.
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

pub struct StageLink {
    stage: usize,
    stages: usize,
    activations: CommThread,
    gradients: CommThread,
    /// Sends queued and not yet known to be received.
    pending: Vec<Handle<()>>,
    /// Time the schedule spent blocked in receives since the last `take_wait`.
    waited: Duration,
}

impl StageLink {
    /// `activations` and `gradients`: two communicators over the pipeline's stages (rank = stage).
    pub fn new(activations: Box<dyn Communicator>, gradients: Box<dyn Communicator>) -> StageLink {
        StageLink {
            stage: activations.rank(),
            stages: activations.world_size(),
            activations: CommThread::spawn(activations),
            gradients: CommThread::spawn(gradients),
            pending: Vec::new(),
            waited: Duration::ZERO,
        }
    }

    /// Queues `output` for the next stage.
    pub fn send_activation(&mut self, output: &Tensor) -> CommResult<()> {
        let dst = self.stage + 1;
        self.queue(true, output, dst)
    }

    /// Queues `grad` (of this stage's input) for the previous stage.
    pub fn send_gradient(&mut self, grad: &Tensor) -> CommResult<()> {
        let dst = self.stage - 1;
        self.queue(false, grad, dst)
    }

    /// The previous stage's next activation.
    pub fn recv_activation(&mut self) -> CommResult<Tensor> {
        let src = self.stage - 1;
        let started = Instant::now();
        let t = self.activations.submit("recv activation", move |c| recv_tensor(c, src)).wait();
        self.waited += started.elapsed();
        t
    }

    /// The next stage's next gradient.
    pub fn recv_gradient(&mut self) -> CommResult<Tensor> {
        let src = self.stage + 1;
        let started = Instant::now();
        let t = self.gradients.submit("recv gradient", move |c| recv_tensor(c, src)).wait();
        self.waited += started.elapsed();
        t
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

    pub fn stages(&self) -> usize {
        self.stages
    }

    fn queue(&mut self, forward: bool, t: &Tensor, dst: usize) -> CommResult<()> {
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
        let thread = if forward { &self.activations } else { &self.gradients };
        let op = if forward { "send activation" } else { "send gradient" };
        self.pending.push(thread.submit(op, move |c| send_tensor(c, &t, dst)));
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
