//! Where this process sits in the job, from the environment: `zerorun launch` and torchrun set RANK, LOCAL_RANK,
//! WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; mpirun sets OMPI_COMM_WORLD_*.

use std::time::Duration;

use super::{shm, threads, CommError, CommResult, Communicator};

/// Set by `zerorun launch --memory-report DIR` for its ranks: where the memory report goes.
pub const MEMORY_REPORT_ENV: &str = "ZERORUN_MEMORY_REPORT";

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Names this job's shared-memory segment; set by `zerorun launch` (else derived from the master address).
    pub run_id: String,
    /// `ZERORUN_BACKEND`: threads, shm or mpi (default shm).
    pub backend: String,
}

fn var(names: &[&str]) -> Option<String> {
    names.iter().find_map(|n| std::env::var(n).ok())
}

fn parse(name: &str, value: Option<String>, default: usize) -> CommResult<usize> {
    match value {
        None => Ok(default),
        Some(v) => v.trim().parse().map_err(|_| CommError::Rendezvous {
            rank: 0,
            world_size: 0,
            place: "the environment".into(),
            what: format!("{name}={v:?} is not a number"),
        }),
    }
}

impl RankInfo {
    /// Reads the variables; a single process with none set is rank 0 of 1.
    pub fn from_env() -> CommResult<RankInfo> {
        let rank = parse("RANK", var(&["RANK", "OMPI_COMM_WORLD_RANK"]), 0)?;
        let world_size = parse("WORLD_SIZE", var(&["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"]), 1)?;
        let local_rank = parse("LOCAL_RANK", var(&["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"]), rank)?;
        let local_world_size =
            parse("LOCAL_WORLD_SIZE", var(&["LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"]), world_size)?;
        let master_addr = var(&["MASTER_ADDR"]).unwrap_or_else(|| "127.0.0.1".into());
        let master_port = parse("MASTER_PORT", var(&["MASTER_PORT"]), 29500)? as u16;
        if rank >= world_size || world_size == 0 {
            return Err(CommError::Rendezvous {
                rank,
                world_size,
                place: "the environment".into(),
                what: "RANK must be below WORLD_SIZE".into(),
            });
        }
        let run_id = var(&["ZERORUN_RUN_ID"]).unwrap_or_else(|| format!("{master_addr}-{master_port}"));
        // Under mpirun the MPI backend is the natural choice; elsewhere shared memory.
        let under_mpirun = std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some();
        let backend = var(&["ZERORUN_BACKEND"]).unwrap_or_else(|| if under_mpirun { "mpi" } else { "shm" }.into());
        Ok(RankInfo { rank, local_rank, world_size, local_world_size, master_addr, master_port, run_id, backend })
    }

    /// Whether this process was started as one rank of several.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}

/// The communicator for this process, as the environment says (`timeout` is the config's comms_timeout).
pub fn communicator_from_env(timeout: Duration) -> CommResult<Box<dyn Communicator>> {
    let info = RankInfo::from_env()?;
    if info.backend == "mpi" {
        #[cfg(feature = "mpi")]
        return Ok(Box::new(super::mpi::MpiComm::init(timeout)?));
        #[cfg(not(feature = "mpi"))]
        return Err(CommError::Rendezvous {
            rank: info.rank,
            world_size: info.world_size,
            place: "MPI".into(),
            what: "this build has no MPI backend: build with `--features mpi`".into(),
        });
    }
    if info.backend == "nccl" {
        #[cfg(feature = "nccl")]
        {
            // Rank 0 makes the NCCL id; the others get it through a shared-memory rendezvous.
            super::nccl::preflight(info.rank, info.world_size)?;
            let mut id = [0i64; 16];
            if info.rank == 0 {
                let bytes = super::nccl::unique_id()?;
                for (w, c) in id.iter_mut().zip(bytes.chunks(8)) {
                    *w = i64::from_ne_bytes(c.try_into().expect("8 bytes"));
                }
            }
            if info.world_size > 1 {
                use super::Collectives;
                let boot =
                    shm::ShmComm::join(&RankInfo { run_id: format!("{}-nccl", info.run_id), ..info.clone() }, timeout)?;
                boot.broadcast(&mut id, 0)?;
            }
            let mut bytes = [0u8; 128];
            for (c, w) in bytes.chunks_mut(8).zip(id) {
                c.copy_from_slice(&w.to_ne_bytes());
            }
            return Ok(Box::new(super::nccl::NcclComm::new(info.local_rank, info.rank, info.world_size, bytes)?));
        }
        #[cfg(not(feature = "nccl"))]
        return Err(CommError::Rendezvous {
            rank: info.rank,
            world_size: info.world_size,
            place: "NCCL".into(),
            what: "this build has no NCCL backend: build with `--features nccl`".into(),
        });
    }
    if info.world_size == 1 {
        return Ok(Box::new(threads::group(1, timeout).pop().expect("one rank")));
    }
    if info.local_world_size != info.world_size {
        return Err(CommError::Rendezvous {
            rank: info.rank,
            world_size: info.world_size,
            place: info.run_id.clone(),
            what:
                "ranks span several hosts; the shm backend needs them all on one (the MPI backend is not in this build)"
                    .into(),
        });
    }
    match info.backend.as_str() {
        "shm" => Ok(Box::new(shm::ShmComm::join(&info, timeout)?)),
        other => Err(CommError::Rendezvous {
            rank: info.rank,
            world_size: info.world_size,
            place: info.run_id.clone(),
            what: format!("ZERORUN_BACKEND={other:?}: this build has the shm backend for processes (threads only within one process)"),
        }),
    }
}
