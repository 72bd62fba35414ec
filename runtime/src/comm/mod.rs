//! Collectives for one data-parallel group, behind one trait so the engine does not care which backend runs them.
//!
//! Backends: [`threads`] (ranks as threads of one process) and [`shm`] (ranks as processes on one host, through
//! shared memory). [`env`] reads the rank and world size from the variables `zerorun launch` or torchrun set. Every blocking wait has a timeout
//! (`comms_timeout`), and a departed peer is an error on every surviving rank, never a hang.
mod cma;
pub mod env;
pub mod shm;
pub mod threads;

use std::time::Duration;

/// How values from the ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
}

/// A failed collective: which operation, on which rank, and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    #[error("{op} on rank {rank}: buffer sizes differ between ranks ({sizes:?} elements by rank)")]
    SizeMismatch { op: &'static str, rank: usize, sizes: Vec<usize> },
    #[error("{op} on rank {rank}: {what}")]
    BadArgument { op: &'static str, rank: usize, what: String },
    #[error("{op} on rank {rank}: rank {dead} left the group after {waited:?} of waiting")]
    PeerGone { op: &'static str, rank: usize, dead: usize, waited: Duration },
    #[error("{op} on rank {rank} of group {group}: rank {dead} (pid {pid}) died; waited {waited:?}")]
    PeerDied { op: &'static str, rank: usize, group: String, dead: usize, pid: u32, waited: Duration },
    #[error("{op} on rank {rank}: timed out after {waited:?} waiting for ranks {missing:?} (comms_timeout)")]
    Timeout { op: &'static str, rank: usize, missing: Vec<usize>, waited: Duration },
    #[error("{op} on rank {rank}: ranks called different collectives ({ops:?} by rank)")]
    OpMismatch { op: &'static str, rank: usize, ops: Vec<&'static str> },
    #[error("rendezvous of rank {rank} of {world_size} at {place}: {what}")]
    Rendezvous { rank: usize, world_size: usize, place: String, what: String },
}

pub type CommResult<T> = std::result::Result<T, CommError>;

/// A process group of `world_size` ranks. Calls are collective: every rank makes the same calls in the same
/// order with buffers of the same sizes.
pub trait Communicator: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Combines `buf` over all ranks; every rank ends with the result.
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> CommResult<()>;
    /// `input` is `world_size` equal parts; rank r ends with the combination of every rank's part r in `output`.
    fn reduce_scatter(&self, input: &[f32], output: &mut [f32], op: ReduceOp) -> CommResult<()>;
    /// `buf` is `world_size` equal parts; rank r contributes its part r, and every rank ends with all parts.
    fn all_gather_in_place(&self, buf: &mut [f32]) -> CommResult<()>;
    /// Every rank ends with `root`'s `buf`.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> CommResult<()>;
    fn barrier(&self) -> CommResult<()>;
}

/// Writes the combination of `parts` under `op` into `dst` (all the same length), in rank order, with loops that
/// vectorize (`Avg` divides the sum by the number of parts).
pub(crate) fn reduce_into(dst: &mut [f32], parts: &[&[f32]], op: ReduceOp) {
    let n = dst.len();
    dst.copy_from_slice(&parts[0][..n]);
    for p in &parts[1..] {
        let p = &p[..n];
        match op {
            ReduceOp::Sum | ReduceOp::Avg => dst.iter_mut().zip(p).for_each(|(d, x)| *d += x),
            ReduceOp::Max => dst.iter_mut().zip(p).for_each(|(d, x)| *d = d.max(*x)),
        }
    }
    if op == ReduceOp::Avg {
        let k = parts.len() as f32;
        dst.iter_mut().for_each(|d| *d /= k);
    }
}
