//! Collectives for one data-parallel group, behind one trait so the engine does not care which backend runs them.
//!
//! Backends: [`threads`] (ranks as threads of one process), [`shm`] (ranks as processes on one host, through
//! shared memory), `mpi` and `nccl` (cargo features); [`hierarchical`] runs a job that spans hosts in two levels. [`env`](mod@env) reads the rank and world size from the
//! variables `zerorun launch`, torchrun or mpirun set. Every blocking wait has a timeout (`comms_timeout`), and a
//! departed peer is an error on every surviving rank, never a hang. Reductions of f32, bf16 and f16 run through
//! the vector sums of `pair_sum`.
#![warn(missing_docs)]
pub mod agreement;
pub mod all_to_all;
pub mod async_comm;
pub mod buffer;
mod cma;
pub mod coding;
pub mod env;
pub mod groups;
pub mod heartbeat;
pub mod hierarchical;
pub mod logged;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod observed;
mod pair_sum;
pub mod quantized;
pub mod rank_info;
pub mod region;
pub mod shm;
pub mod signs;
pub mod slurm;
pub mod threads;
pub mod topology;

use std::time::Duration;

pub use buffer::reduce_into;
pub use buffer::{BufMut, BufRef, DeviceBuf, Dtype, Element};

/// How values from the ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The sum divided by the number of ranks.
    Avg,
    /// The largest value.
    Max,
}

/// A failed collective: which operation, on which rank, and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    #[error("{op} on rank {rank}: buffer sizes differ between ranks ({sizes:?} elements by rank)")]
    /// The ranks passed buffers of different lengths.
    SizeMismatch {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// Each rank's length.
        sizes: Vec<usize>,
    },
    #[error("{op} on rank {rank}: element types differ between ranks ({dtypes:?} by rank)")]
    /// The ranks passed different element types.
    DtypeMismatch {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// Each rank's type.
        dtypes: Vec<Dtype>,
    },
    #[error("{op} on rank {rank}: {what}")]
    /// An argument is wrong on this rank (a root that is no rank, a buffer not divisible into parts).
    BadArgument {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// What is wrong.
        what: String,
    },
    #[error("{op} on rank {rank}: rank {dead} left the group after {waited:?} of waiting")]
    /// A rank left the group while this one waited.
    PeerGone {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank that left.
        dead: usize,
        /// How long this rank waited.
        waited: Duration,
    },
    #[error("{op} on rank {rank} of group {group}: rank {dead} (pid {pid}) {how}; waited {waited:?}", how = departure(*.exited))]
    /// A rank's process ended while this one waited: it died, or exited without this collective.
    PeerDied {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The group's name.
        group: String,
        /// The rank that died.
        dead: usize,
        /// Its process id.
        pid: u32,
        /// How long this rank waited.
        waited: Duration,
        /// It left the group cleanly (its communicator was dropped: the program ended or gave up on its own error)
        /// rather than being killed.
        exited: bool,
    },
    #[error("{op} on rank {rank}: timed out after {waited:?} waiting for ranks {missing:?} (comms_timeout)")]
    /// Ranks did not arrive within `comms_timeout`.
    Timeout {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The ranks that never came.
        missing: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
    },
    #[error("{op} on rank {rank}: ranks called different collectives ({ops:?} by rank)")]
    /// The ranks called different collectives at the same point.
    OpMismatch {
        /// This rank's collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// Each rank's.
        ops: Vec<&'static str>,
    },
    #[error("rendezvous of rank {rank} of {world_size} at {place}: {what}")]
    /// The ranks could not meet to form the group.
    Rendezvous {
        /// This rank.
        rank: usize,
        /// Ranks expected.
        world_size: usize,
        /// Where they meet (address, segment).
        place: String,
        /// What failed.
        what: String,
    },
    #[error(
        "{op} from rank {src} to rank {dst}: the send has {} {:?} elements and the receive expects {} {:?} elements",
        sent.0, sent.1, expected.0, expected.1
    )]
    /// A send and its receive disagree on length or type.
    P2pMismatch {
        /// The transfer.
        op: &'static str,
        /// The sender.
        src: usize,
        /// The receiver.
        dst: usize,
        /// What was sent (elements, type).
        sent: (usize, Dtype),
        /// What the receive expects.
        expected: (usize, Dtype),
    },
    /// An error of a group made by `split` or `new_group`, with the group's name.
    #[error("group {group}: {error}")]
    InGroup {
        /// The group's name.
        group: String,
        /// The error inside it.
        error: Box<CommError>,
    },
}

/// Results of collectives.
pub type CommResult<T> = std::result::Result<T, CommError>;

/// A process group of `world_size` ranks. Calls are collective: every rank makes the same calls in the same
/// order with buffers of the same sizes and element type. Use the typed methods of [`Collectives`].
pub trait Communicator: Send {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// Combines `buf` over all ranks; every rank ends with the result.
    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()>;
    /// `input` is `world_size` equal parts; rank r ends with the combination of every rank's part r in `output`.
    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()>;
    /// `buf` is `world_size` equal parts; rank r contributes its part r, and every rank ends with all parts.
    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()>;
    /// Every rank ends with `root`'s `buf`.
    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()>;
    /// `input` and `output` are `world_size` equal parts: rank r's part q goes to rank q, landing in its part r.
    /// The default sends each part straight to its rank ([`all_to_all::pairwise`]); gloo has every transfer in
    /// flight at once.
    fn all_to_all_buf(&self, input: BufRef<'_>, output: BufMut<'_>) -> CommResult<()> {
        all_to_all::equal_parts(self, input, output)
    }
    /// All-to-all of parts of any length (MPI's alltoallv): part q of `input` (`send[q]` elements, in rank order)
    /// goes to rank q, and part r of `output` (`recv[r]` elements) comes from rank r. What rank r sends rank q must be
    /// what q expects from r (exchange the counts first where they are not known: an all-to-all of one count per
    /// rank); counts that disagree are an error on every rank. The default moves each part once, point to point
    /// ([`all_to_all::pairwise`]); gloo and MPI run their own.
    fn all_to_all_v_buf(
        &self,
        input: BufRef<'_>,
        send: &[usize],
        output: BufMut<'_>,
        recv: &[usize],
    ) -> CommResult<()> {
        all_to_all::pairwise(self, input, send, output, recv)
    }
    /// [`Communicator::reduce_scatter_buf`] of floats with the parts that travel quantized to int8 in blocks of
    /// `block` values (ZeRO++ qgZ), summed in f32 after dequantizing. The default quantizes every part a peer
    /// receives; the two-level communicator only what crosses hosts.
    fn reduce_scatter_quantized_buf(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        block: usize,
    ) -> CommResult<()> {
        quantized::reduce_scatter(self, input, output, op, block)
    }
    /// Returns once every rank has called it.
    fn barrier(&self) -> CommResult<()>;
    /// Sends `buf` to rank `dst` of this group and returns once `dst` has it (a rendezvous: the receive checks the
    /// size and element type, and a mismatch is an error on both ends).
    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()>;
    /// Receives into `buf` what rank `src` of this group sends.
    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()>;
    /// Sends `send` to `dst` and receives `recv` from `src` (MPI's sendrecv; a ring shift when every rank calls it
    /// with its neighbours). Backends that can have both in flight at once do (gloo); this default sends first on
    /// even ranks and receives first on odd ones, which cannot deadlock on a ring.
    fn send_recv_buf(&self, send: BufRef<'_>, dst: usize, recv: BufMut<'_>, src: usize) -> CommResult<()> {
        if self.rank() % 2 == 0 {
            self.send_buf(send, dst)?;
            self.recv_buf(recv, src)
        } else {
            self.recv_buf(recv, src)?;
            self.send_buf(send, dst)
        }
    }
    /// This rank's communicator of the group `split` (agreed by every rank of this group, see
    /// [`groups::Split`]) makes, or None when this rank is in no group. Collective over this group; use
    /// [`Collectives::split`] or [`Collectives::new_group`].
    fn split_group(&self, split: &groups::Split) -> CommResult<Option<Box<dyn Communicator>>>;
    /// The group's name, as its errors give it: "world" for the job's group.
    fn group_name(&self) -> String {
        "world".into()
    }
    /// Whether peers read buffers in this process's [`region::SharedRegion`] through their own mapping (one
    /// memcpy), so the engine should allocate the buffers it hands to collectives there.
    fn prefers_shared_buffers(&self) -> bool {
        false
    }
    /// Lets go of the peers' pages this rank's last all-gather read through its own mapping of their regions
    /// (shm: `MADV_DONTNEED` on them; the memory stays the peer's, and a later read maps it again). For a buffer
    /// the peer frees soon, as a stage-3 unit's: until then its pages count in this process's resident set as
    /// well as in the peer's. Backends that copy hold nothing of the peers': nothing to do.
    fn forget_gathered_pages(&self) {}
    /// One-sided access to every rank's `local` bytes: where each rank's lies in this process's address space, by
    /// rank (this rank's is `local` itself), for reads and writes with no collective. Some where ranks share memory:
    /// the threads backend (one address space) and shm (each peer's shared region mapped here; `local` must be in
    /// this process's region, e.g. a `region::SharedBuffer`); None on backends that only exchange messages (MPI,
    /// gloo, NCCL) or when some rank's `local` is not reachable. Collective: every rank passes the same length and
    /// all get Some or all None. Ordering between ranks is the caller's (atomics in the shared bytes).
    fn window(&self, _local: &mut [u8]) -> CommResult<Option<Vec<usize>>> {
        Ok(None)
    }
    /// When the collectives run in two levels ([`hierarchical`]): this rank's place on its host and the host's
    /// ranks, for what may stay inside a host (hpZ's secondary partition); None otherwise.
    fn host_layout(&self) -> Option<(usize, usize)> {
        None
    }
    /// An all-gather among this host's ranks only (`buf` is [`Communicator::host_layout`]'s ranks-per-host parts).
    /// An error where there is no host level.
    fn host_all_gather_buf(&self, _buf: BufMut<'_>) -> CommResult<()> {
        Err(CommError::BadArgument {
            op: "host all_gather",
            rank: self.rank(),
            what: "this group's collectives have no host level".into(),
        })
    }
    /// Whether the groups `split` and `new_group` make from this one may be used from different threads at once
    /// (each group by one thread): gloo's (each its own process group), not MPI's (initialised serialized).
    fn independent_groups(&self) -> bool {
        false
    }
    /// The collectives on device memory, for backends that reduce it where it is (NCCL). Each returns Ok(false)
    /// when this backend has none (the default), and the caller stages the values through host memory; Ok(true)
    /// once done (blocking, as the host collectives). Every rank of the group makes the same choice: the backend
    /// decides, not the buffer.
    ///
    /// # Safety
    /// The buffers are live device memory of `count` elements of `dtype` on `device`, which nothing else uses
    /// until the call returns; `reduce_scatter_device`'s two do not overlap.
    unsafe fn all_reduce_device(&self, _buf: DeviceBuf, _op: ReduceOp) -> CommResult<bool> {
        Ok(false)
    }
    /// See [`Communicator::all_reduce_device`]; `input` is `world_size` equal parts, `output` one.
    ///
    /// # Safety
    /// As for [`Communicator::all_reduce_device`].
    unsafe fn reduce_scatter_device(&self, _input: DeviceBuf, _output: DeviceBuf, _op: ReduceOp) -> CommResult<bool> {
        Ok(false)
    }
    /// See [`Communicator::all_reduce_device`]; in place, rank r's part r contributed.
    ///
    /// # Safety
    /// As for [`Communicator::all_reduce_device`].
    unsafe fn all_gather_device(&self, _buf: DeviceBuf) -> CommResult<bool> {
        Ok(false)
    }
    /// See [`Communicator::all_reduce_device`].
    ///
    /// # Safety
    /// As for [`Communicator::all_reduce_device`].
    unsafe fn broadcast_device(&self, _buf: DeviceBuf, _root: usize) -> CommResult<bool> {
        Ok(false)
    }
}

/// The collectives on typed slices (f32, bf16, f16, i64), for any communicator.
pub trait Collectives: Communicator {
    /// [`all_reduce_buf`](Communicator::all_reduce_buf) of a typed slice.
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        self.all_reduce_buf(BufMut::new(buf), op)
    }
    /// [`reduce_scatter_buf`](Communicator::reduce_scatter_buf) of typed slices.
    fn reduce_scatter<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> CommResult<()> {
        self.reduce_scatter_buf(BufRef::new(input), BufMut::new(output), op)
    }
    /// [`all_gather_buf`](Communicator::all_gather_buf) of a typed slice.
    fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> CommResult<()> {
        self.all_gather_buf(BufMut::new(buf))
    }
    /// [`broadcast_buf`](Communicator::broadcast_buf) of a typed slice.
    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        self.broadcast_buf(BufMut::new(buf), root)
    }
    /// [`Communicator::send_buf`] of a typed slice.
    fn send<T: Element>(&self, buf: &[T], dst: usize) -> CommResult<()> {
        self.send_buf(BufRef::new(buf), dst)
    }
    /// [`Communicator::recv_buf`] into a typed slice.
    fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> CommResult<()> {
        self.recv_buf(BufMut::new(buf), src)
    }
    /// [`Communicator::send_recv_buf`] of typed slices.
    fn send_recv<T: Element>(&self, send: &[T], dst: usize, recv: &mut [T], src: usize) -> CommResult<()> {
        self.send_recv_buf(BufRef::new(send), dst, BufMut::new(recv), src)
    }
    /// [`Communicator::all_to_all_v_buf`].
    fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
    ) -> CommResult<()> {
        self.all_to_all_v_buf(BufRef::new(input), send, BufMut::new(output), recv)
    }
    /// MPI_Comm_split: ranks that pass the same `color` form a group, ranked by `key` and then by their rank here;
    /// `None` joins no group (and gets None). Collective over this group.
    fn split(&self, color: Option<u32>, key: i64) -> CommResult<Option<Box<dyn Communicator>>> {
        groups::split(self, color, key, None, None)
    }
    /// The group of `ranks` (of this group, in the new group's rank order), named by them; None on the other
    /// ranks. Collective over this group: every rank calls it with the same list.
    fn new_group(&self, ranks: &[usize]) -> CommResult<Option<Box<dyn Communicator>>> {
        groups::new_group(self, ranks)
    }
}

impl<C: Communicator + ?Sized> Collectives for C {}

/// How a rank that is gone left, for [`CommError::PeerDied`].
fn departure(exited: bool) -> &'static str {
    if exited {
        "exited before this collective (its program ended or dropped its communicator; its own output says why)"
    } else {
        "died"
    }
}
