//! A replica group restarted by its launcher (`zerorun launch --fault-tolerant --max-restarts N`) rejoins a job
//! that went on without it: its ranks see `ZERORUN_FT_REJOIN` = k (the node's k-th restart), never meet the other
//! groups' ranks in a world group (they are mid-run), and make their shard group on the job's store instead. What
//! they have of the world is its size and their place in it ([`RejoiningWorld`]).
use crate::comm::groups::Split;
use crate::comm::{BufMut, BufRef, CommError, CommResult, Communicator, ReduceOp};

/// The environment variable the launcher sets on a restarted group's ranks: its incarnation (1 for the first
/// restart).
pub const REJOIN_ENV: &str = crate::comm::env::FAULT_TOLERANT_REJOIN_ENV;

/// This process's incarnation when its replica group was restarted to rejoin (None on the job's first start).
pub fn incarnation() -> Option<u64> {
    std::env::var(REJOIN_ENV).ok().and_then(|v| v.trim().parse().ok()).filter(|&k| k > 0)
}

/// The job's world as a rejoining rank has it: a place and a size, no collective (its peers are mid-run). The
/// engine builds the rank's groups from the store instead (`engine/fault_tolerant.rs`).
pub struct RejoiningWorld {
    /// This rank in the job.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
}

impl RejoiningWorld {
    fn refuse(&self, op: &'static str) -> CommError {
        CommError::BadArgument {
            op,
            rank: self.rank,
            what: format!(
                "this rank rejoins a fault-tolerant job ({REJOIN_ENV} is set): it has no world group, only its replica group's (a config with `fault_tolerance.enabled` builds those)"
            ),
        }
    }
}

impl Communicator for RejoiningWorld {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_buf(&self, _buf: BufMut<'_>, _op: ReduceOp) -> CommResult<()> {
        Err(self.refuse("all-reduce"))
    }

    fn reduce_scatter_buf(&self, _input: BufRef<'_>, _output: BufMut<'_>, _op: ReduceOp) -> CommResult<()> {
        Err(self.refuse("reduce-scatter"))
    }

    fn all_gather_buf(&self, _buf: BufMut<'_>) -> CommResult<()> {
        Err(self.refuse("all-gather"))
    }

    fn broadcast_buf(&self, _buf: BufMut<'_>, _root: usize) -> CommResult<()> {
        Err(self.refuse("broadcast"))
    }

    fn barrier(&self) -> CommResult<()> {
        Err(self.refuse("barrier"))
    }

    fn send_buf(&self, _buf: BufRef<'_>, _dst: usize) -> CommResult<()> {
        Err(self.refuse("send"))
    }

    fn recv_buf(&self, _buf: BufMut<'_>, _src: usize) -> CommResult<()> {
        Err(self.refuse("recv"))
    }

    fn split_group(&self, _split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        Err(self.refuse("split"))
    }
}
