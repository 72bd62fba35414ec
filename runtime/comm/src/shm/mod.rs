//! Ranks as processes on one host, exchanging through shared memory: a job segment in /dev/shm for rendezvous,
//! barriers and staging (segment.rs), direct reads of peers' buffers (peers.rs), and the collectives over both
//! (collectives.rs).
//!
//! Every blocking wait has a timeout (`comms_timeout`) and checks that the ranks it waits for are alive, so a dead
//! peer is an error naming it on every surviving rank, never a hang; nothing is left in /dev/shm however the job
//! ends.
mod collectives;
mod p2p;
mod peers;
mod segment;

use std::time::Duration;

pub use segment::segment_path;

use super::groups::Split;
use super::rank_info::RankInfo;
use super::{BufMut, BufRef, CommResult, Communicator, ReduceOp};
use peers::PeerAccess;
use segment::Segment;

/// One rank's handle on a shared-memory group.
pub struct ShmComm {
    seg: Segment,
    peers: PeerAccess,
    /// Scratch of the direct reduction: an accumulator and a landing buffer, reused (u64 words keep every element
    /// type aligned).
    scratch: std::cell::RefCell<Vec<u64>>,
    /// Where this rank sits, kept to derive the segments of groups split from this one.
    info: RankInfo,
    timeout: Duration,
    /// Per source rank: the number of the last transfer received from it (p2p.rs).
    received: Vec<std::cell::Cell<u64>>,
}

impl ShmComm {
    /// Creates (rank 0) or attaches to (other ranks) the job's segment, waits until every rank is there, and
    /// settles how ranks read each other.
    pub fn join(info: &RankInfo, timeout: Duration) -> CommResult<ShmComm> {
        super::cma::allow_peers_to_read();
        let seg = Segment::join(info, timeout)?;
        let peers = PeerAccess::probe(&seg)?;
        let received = (0..info.world_size).map(|_| std::cell::Cell::new(0)).collect();
        Ok(ShmComm { seg, peers, scratch: std::cell::RefCell::new(Vec::new()), info: info.clone(), timeout, received })
    }

    /// Whether collectives read peers' buffers directly (one copy) rather than through the staging slots.
    pub fn is_direct(&self) -> bool {
        self.peers.direct()
    }
}

/// Any failed collective flags this rank before returning, whatever the cause, so that if it exits, peers name the
/// rank whose death started it rather than this one.
impl Communicator for ShmComm {
    fn rank(&self) -> usize {
        self.seg.rank
    }

    fn world_size(&self) -> usize {
        self.seg.world_size
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.seg.flag_failure(self.all_reduce_buf_impl(buf, op))
    }

    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.seg.flag_failure(self.reduce_scatter_buf_impl(input, output, op))
    }

    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        self.seg.flag_failure(self.all_gather_buf_impl(buf))
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        self.seg.flag_failure(self.broadcast_buf_impl(buf, root))
    }

    fn prefers_shared_buffers(&self) -> bool {
        self.peers.shared_buffers()
    }

    fn window(&self, local: &mut [u8]) -> CommResult<Option<Vec<usize>>> {
        let (rank, n) = (self.seg.rank, self.seg.world_size);
        let addr = local.as_mut_ptr() as usize;
        let mut words = vec![0i64; 2 * n];
        (words[2 * rank], words[2 * rank + 1]) = (addr as i64, local.len() as i64);
        super::Collectives::all_gather_in_place(self, &mut words)?;
        let ptrs: Vec<Option<usize>> = (0..n)
            .map(|k| {
                if k == rank {
                    Some(addr)
                } else {
                    self.peers.mapped(k, words[2 * k] as usize, words[2 * k + 1] as usize)
                }
            })
            .collect();
        // Every rank reaches every other's bytes, or nobody uses the window.
        let mut missing = [if ptrs.iter().any(Option::is_none) { 1f32 } else { 0.0 }];
        super::Collectives::all_reduce(self, &mut missing, ReduceOp::Max)?;
        Ok((missing[0] == 0.0).then(|| ptrs.into_iter().flatten().collect()))
    }

    fn forget_gathered_pages(&self) {
        self.peers.forget_gathered_pages()
    }

    fn barrier(&self) -> CommResult<()> {
        self.seg.flag_failure(self.seg.barrier("barrier"))
    }

    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        self.seg.flag_failure(self.send_impl(buf, dst))
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        self.seg.flag_failure(self.recv_impl(buf, src))
    }

    fn send_recv_buf(&self, send: BufRef<'_>, dst: usize, recv: BufMut<'_>, src: usize) -> CommResult<()> {
        self.seg.flag_failure(self.send_recv_impl(send, dst, recv, src))
    }

    /// A group of its own segment, named after this one's, the split and the color; its members meet there.
    fn split_group(&self, split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        let Some(color) = split.color(self.seg.rank) else { return Ok(None) };
        let info = RankInfo {
            rank: split.rank,
            local_rank: split.rank,
            world_size: split.members.len(),
            local_world_size: split.members.len(),
            run_id: format!("{}.g{:x}c{color}", self.info.run_id, split.id),
            ..self.info.clone()
        };
        Ok(Some(Box::new(ShmComm::join(&info, self.timeout)?)))
    }
}
