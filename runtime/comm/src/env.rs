//! The communicator the environment asks for: the backend factory over [`RankInfo`] (`rank_info.rs`). Each
//! backend does its own rendezvous; this only picks one.
use std::time::Duration;

pub use super::rank_info::{Backend, RankInfo};
use super::{shm, threads, CommError, CommResult, Communicator};

/// Set by `zerorun launch --fault-tolerant --max-restarts N` on the ranks of a replica group it restarted: k for
/// the k-th restart. Such ranks rejoin the running job (its `fault_tolerance` section) instead of starting one.
pub const FAULT_TOLERANT_REJOIN_ENV: &str = "ZERORUN_FT_REJOIN";

/// Set by `zerorun launch --memory-report DIR` for its ranks: where the memory report goes.
pub const MEMORY_REPORT_ENV: &str = "ZERORUN_MEMORY_REPORT";

/// A backend this build was compiled without.
#[allow(dead_code)]
fn not_built(info: &RankInfo, backend: Backend, feature: &str) -> CommError {
    CommError::Rendezvous {
        rank: info.rank,
        world_size: info.world_size,
        place: backend.name().to_uppercase(),
        what: format!("this build has no {} backend: build with `--features {feature}`", backend.name()),
    }
}

/// The communicator for this process, as the environment says (`timeout` is the config's comms_timeout).
pub fn communicator_from_env(timeout: Duration) -> CommResult<Box<dyn Communicator>> {
    let info = RankInfo::from_env()?;
    match info.backend {
        #[cfg(feature = "mpi")]
        Backend::Mpi => Ok(Box::new(super::mpi::MpiComm::init(timeout)?)),
        #[cfg(not(feature = "mpi"))]
        Backend::Mpi => Err(not_built(&info, Backend::Mpi, "mpi")),
        #[cfg(feature = "nccl")]
        Backend::Nccl if info.local_world_size != info.world_size => Err(CommError::Rendezvous {
            rank: info.rank,
            world_size: info.world_size,
            place: "NCCL".into(),
            what: "ranks span several hosts: NCCL's id goes out through gloo's TCPStore, which zerorun-runtime's factory does (zerorun::communicator_from_env)".into(),
        }),
        #[cfg(feature = "nccl")]
        Backend::Nccl => Ok(Box::new(super::nccl::NcclComm::from_env(&info, timeout)?)),
        #[cfg(not(feature = "nccl"))]
        Backend::Nccl => Err(not_built(&info, Backend::Nccl, "nccl")),
        Backend::Shm if info.world_size == 1 => Ok(Box::new(threads::group(1, timeout).pop().expect("one rank"))),
        Backend::Shm if info.local_world_size != info.world_size => Err(CommError::Rendezvous {
            rank: info.rank,
            world_size: info.world_size,
            place: info.run_id.clone(),
            what: "ranks span several hosts; the shm backend needs them all on one (use the MPI backend under mpirun)"
                .into(),
        }),
        Backend::Shm => Ok(Box::new(shm::ShmComm::join(&info, timeout)?)),
        // It links libtorch (c10d), so it lives in zerorun-runtime, whose factory handles it first.
        Backend::Gloo => Err(CommError::Rendezvous {
            rank: info.rank,
            world_size: info.world_size,
            place: "gloo".into(),
            what: "the gloo backend is zerorun-runtime's: use zerorun::communicator_from_env".into(),
        }),
    }
}
