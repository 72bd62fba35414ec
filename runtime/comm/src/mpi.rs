//! Ranks as MPI processes (rsmpi over OpenMPI), for CPU clusters: `mpirun -np N PROGRAM` with the `mpi` feature.
//!
//! Every reduction is an all-to-all of the ranks' segments, a fold in rank order on the segment's owner, and an
//! all-gather: the same arithmetic, in the same order, as the threads and shm backends, so results are bitwise
//! the same whichever backend runs. A handshake (one all-gather of op, length and type) turns mismatched calls
//! into errors on every rank.
//!
//! Blocking MPI calls cannot be cancelled, so `comms_timeout` is enforced by a watchdog thread: a collective
//! still running when it expires is logged (operation, rank, time waited) and the process exits with status 124;
//! mpirun then stops the other ranks. A dead peer is handled by the MPI runtime, which aborts the job.
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::*;

use super::agreement::{self, Call};
use super::groups::{self, Split};
use super::{all_to_all, reduce_into, BufMut, BufRef, CommError, CommResult, Communicator, Dtype, ReduceOp};

/// One rank's MPI communicator: MPI_COMM_WORLD, or a group split from it (MPI_Comm_split).
pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    world_size: usize,
    /// The collective in progress and when it started (ms since `epoch`); 0 when idle.
    current: Arc<(Mutex<&'static str>, AtomicU64)>,
    epoch: Instant,
    /// Reused staging: the blocks sent, the blocks received, this rank's block. They only grow, so a training loop
    /// allocates (and page-faults) nothing per collective. u64 words keep every element type aligned.
    staging: RefCell<[Vec<u64>; 3]>,
    /// MPI stays initialised while any of the job's communicators lives (dropped after `world`, which is freed
    /// first: fields drop in order).
    _universe: std::sync::Arc<mpi::environment::Universe>,
}

/// The first `bytes` bytes of `v`, grown (zeroed) if shorter.
fn bytes_of(v: &mut Vec<u64>, bytes: usize) -> &mut [u8] {
    if v.len() * 8 < bytes {
        v.resize(bytes.div_ceil(8), 0);
    }
    &mut bytemuck::cast_slice_mut(v)[..bytes]
}

// SAFETY: MPI is initialised with MPI_THREAD_SERIALIZED, and the communicator is used by one thread at a time
// (`&self` methods are never called concurrently: the trait is Send, not Sync).
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// Initialises MPI and starts the watchdog.
    pub fn init(timeout: Duration) -> CommResult<MpiComm> {
        let fail =
            |what: String| CommError::Rendezvous { rank: 0, world_size: 0, place: "MPI_COMM_WORLD".into(), what };
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| fail("MPI is already initialised".into()))?;
        if threading < mpi::Threading::Serialized {
            return Err(fail(format!("the MPI library offers only {threading:?} threading; zerorun needs Serialized")));
        }
        let world = universe.world();
        let (rank, world_size) = (world.rank() as usize, world.size() as usize);
        let current = Arc::new((Mutex::new(""), AtomicU64::new(0)));
        let epoch = Instant::now();
        let watched = current.clone();
        std::thread::Builder::new()
            .name("zerorun-mpi-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(100));
                let started = watched.1.load(Ordering::Acquire);
                if started == 0 {
                    continue;
                }
                let waited = epoch.elapsed().saturating_sub(Duration::from_millis(started - 1));
                if waited > timeout {
                    let op = *watched.0.lock().unwrap_or_else(|p| p.into_inner());
                    let e = CommError::Timeout { op, rank, missing: Vec::new(), waited };
                    // Logged through tracing (the library never prints); the exit status 124 tells the launcher.
                    tracing::error!("{e}; MPI collectives cannot be cancelled, so this rank exits with status 124");
                    std::process::exit(124);
                }
            })
            .map_err(|e| fail(format!("starting the watchdog: {e}")))?;
        Ok(MpiComm {
            world,
            rank,
            world_size,
            current,
            epoch,
            staging: RefCell::new([Vec::new(), Vec::new(), Vec::new()]),
            _universe: std::sync::Arc::new(universe),
        })
    }

    fn watch<R>(&self, op: &'static str, f: impl FnOnce() -> R) -> R {
        *self.current.0.lock().unwrap_or_else(|p| p.into_inner()) = op;
        self.current.1.store(self.epoch.elapsed().as_millis() as u64 + 1, Ordering::Release);
        let r = f();
        self.current.1.store(0, Ordering::Release);
        r
    }

    /// Every rank shares (op, length, type); any difference is an error on every rank.
    fn handshake(&self, op: &'static str, len: usize, dtype: Dtype) -> CommResult<()> {
        let mine = Call::new(op, len, dtype).words();
        let mut all = vec![0u64; 3 * self.world_size];
        self.watch(op, || self.world.all_gather_into(&mine[..], &mut all[..]));
        let calls: Vec<Call> = all.chunks(3).map(Call::from_words).collect();
        agreement::check(op, self.rank, &calls)
    }

    /// A transfer's header handshake with `peer` (both ends fail on a mismatch); returns the peer for the payload.
    fn p2p_header(
        &self,
        op: &'static str,
        peer: usize,
        sending: bool,
        len: usize,
        dtype: Dtype,
    ) -> CommResult<mpi::topology::Process<'_>> {
        groups::check_peer(op, self.rank, self.world_size, peer)?;
        let process = self.world.process_at_rank(peer as i32);
        let transfer = groups::Transfer { op, rank: self.rank, peer, sending, len, dtype };
        groups::header_handshake(
            &transfer,
            |w| {
                self.watch(op, || process.send(w));
                Ok(())
            },
            |w| {
                self.watch(op, || process.receive_into(w));
                Ok(())
            },
        )?;
        Ok(process)
    }

    /// `blocks` holds `world_size` blocks of `out.len()` bytes; writes into `out` this rank's block combined over
    /// all ranks' blocks (all-to-all into `landing`, then a fold in rank order).
    fn reduce_blocks(
        &self,
        op: &'static str,
        blocks: &[u8],
        landing: &mut Vec<u64>,
        out: &mut [u8],
        dtype: Dtype,
        how: ReduceOp,
    ) {
        let seg = out.len();
        let recv = bytes_of(landing, blocks.len());
        self.watch(op, || self.world.all_to_all_into(blocks, &mut recv[..]));
        let parts: Vec<&[u8]> = recv.chunks(seg).collect();
        reduce_into(dtype, out, &parts, how);
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        const OP: &str = "all_reduce";
        let (dtype, es, len, n) = (buf.dtype, buf.dtype.size(), buf.len(), self.world_size);
        self.handshake(OP, len, dtype)?;
        if len == 0 {
            return Ok(()); // every rank agreed on the length: nothing to move (and MPI rejects aliased empty buffers)
        }
        // Equal blocks for the all-to-all: segments of ceil(len / n) elements, the last padded.
        let seg = len.div_ceil(n) * es;
        let total = buf.bytes.len();
        let mut staging = self.staging.borrow_mut();
        let [send, landing, mine] = &mut *staging;
        let blocks = bytes_of(send, seg * n);
        blocks[..total].copy_from_slice(buf.bytes);
        let mine = bytes_of(mine, seg);
        self.reduce_blocks(OP, blocks, landing, mine, dtype, op);
        self.watch(OP, || self.world.all_gather_into(&mine[..], &mut blocks[..]));
        buf.bytes.copy_from_slice(&blocks[..total]);
        Ok(())
    }

    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        const OP: &str = "reduce_scatter";
        agreement::scatter_output(OP, self.rank, self.world_size, &input, &output)?;
        self.handshake(OP, input.len(), input.dtype)?;
        if input.is_empty() {
            return Ok(());
        }
        let mut staging = self.staging.borrow_mut();
        self.reduce_blocks(OP, input.bytes, &mut staging[1], output.bytes, input.dtype, op);
        Ok(())
    }

    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        const OP: &str = "all_gather";
        let n = self.world_size;
        agreement::equal_parts(OP, self.rank, n, buf.len())?;
        self.handshake(OP, buf.len(), buf.dtype)?;
        if buf.is_empty() {
            return Ok(());
        }
        let pb = buf.bytes.len() / n;
        let mut staging = self.staging.borrow_mut();
        let mine = bytes_of(&mut staging[2], pb);
        mine.copy_from_slice(&buf.bytes[self.rank * pb..(self.rank + 1) * pb]);
        self.watch(OP, || self.world.all_gather_into(&mine[..], &mut buf.bytes[..]));
        Ok(())
    }

    /// MPI's alltoallv, after an exchange of the counts (MPI cannot tell a part of the wrong size: a disagreement
    /// is an error on every rank here, not an MPI abort).
    fn all_to_all_v_buf(
        &self,
        input: BufRef<'_>,
        send: &[usize],
        output: BufMut<'_>,
        recv: &[usize],
    ) -> CommResult<()> {
        const OP: &str = "all_to_all";
        let (n, es) = (self.world_size, input.dtype.size());
        let (sends, recvs) = all_to_all::offsets(OP, self.rank, n, &input, send, &output, recv)?;
        all_to_all::agree(self, OP, send, recv, input.dtype)?;
        // MPI counts are ints: bytes per part and offsets must fit.
        let ints = |v: &[usize]| -> CommResult<Vec<i32>> {
            v.iter()
                .map(|x| {
                    i32::try_from(x * es).map_err(|_| CommError::BadArgument {
                        op: OP,
                        rank: self.rank,
                        what: format!("{} bytes exceed MPI's int counts", x * es),
                    })
                })
                .collect()
        };
        let (sc, sd, rc, rd) = (ints(send)?, ints(&sends[..n])?, ints(recv)?, ints(&recvs[..n])?);
        let outgoing = mpi::datatype::Partition::new(input.bytes, &sc[..], &sd[..]);
        let mut incoming = mpi::datatype::PartitionMut::new(output.bytes, &rc[..], &rd[..]);
        self.watch(OP, || self.world.all_to_all_varcount_into(&outgoing, &mut incoming));
        Ok(())
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        const OP: &str = "broadcast";
        agreement::root(OP, self.rank, self.world_size, root)?;
        self.handshake(OP, buf.len(), buf.dtype)?;
        if !buf.bytes.is_empty() {
            self.watch(OP, || self.world.process_at_rank(root as i32).broadcast_into(&mut buf.bytes[..]));
        }
        Ok(())
    }

    fn barrier(&self) -> CommResult<()> {
        self.watch("barrier", || self.world.barrier());
        Ok(())
    }

    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        let peer = self.p2p_header("send", dst, true, buf.len(), buf.dtype)?;
        if !buf.bytes.is_empty() {
            self.watch("send", || peer.send(buf.bytes));
        }
        Ok(())
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        let peer = self.p2p_header("recv", src, false, buf.len(), buf.dtype)?;
        if !buf.bytes.is_empty() {
            self.watch("recv", || peer.receive_into(&mut buf.bytes[..]));
        }
        Ok(())
    }

    /// MPI_Comm_split with the agreed order as the key; the group shares this one's watchdog.
    fn split_group(&self, split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        let color = match split.color(self.rank) {
            Some(c) => mpi::topology::Color::with_value(c as i32),
            None => mpi::topology::Color::undefined(),
        };
        let made = self.watch("split", || self.world.split_by_color_with_key(color, split.key() as i32));
        Ok(made.map(|world| {
            Box::new(MpiComm {
                rank: world.rank() as usize,
                world_size: world.size() as usize,
                world,
                current: self.current.clone(),
                epoch: self.epoch,
                staging: RefCell::new([Vec::new(), Vec::new(), Vec::new()]),
                _universe: self._universe.clone(),
            }) as Box<dyn Communicator>
        }))
    }
}
