//! Where this process sits in the job, from the environment: `zerorun launch` and torchrun set RANK, LOCAL_RANK,
//! WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; mpirun sets OMPI_COMM_WORLD_*; `srun` sets SLURM_*
//! (`slurm.rs`: the first host of the step meets the others, at a port from the job id); ZERORUN_BACKEND picks
//! the backend. Read here, used by the backend factory (`env.rs`) and the backends' rendezvous.
use super::slurm::{port_of_job, SlurmStep};
use super::{CommError, CommResult};

/// The backends a process of a multi-process job can use (thread ranks live inside one process instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Shared memory among the processes of one host (`zerorun launch`'s default).
    Shm,
    /// MPI (feature `mpi`), under mpirun.
    Mpi,
    /// NCCL (feature `nccl`), on GPUs.
    Nccl,
    /// libtorch's ProcessGroupGloo over TCP, with a TCPStore rendezvous: ranks on several hosts (zerorun-runtime).
    Gloo,
}

impl Backend {
    /// The backend `ZERORUN_BACKEND` names.
    pub fn from_name(name: &str) -> Option<Backend> {
        match name {
            "shm" => Some(Backend::Shm),
            "mpi" => Some(Backend::Mpi),
            "nccl" => Some(Backend::Nccl),
            "gloo" => Some(Backend::Gloo),
            _ => None,
        }
    }

    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Shm => "shm",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
            Backend::Gloo => "gloo",
        }
    }
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    /// This process's rank in the job (RANK).
    pub rank: usize,
    /// Its rank on this host (LOCAL_RANK).
    pub local_rank: usize,
    /// Ranks in the job (WORLD_SIZE).
    pub world_size: usize,
    /// Ranks on this host (LOCAL_WORLD_SIZE).
    pub local_world_size: usize,
    /// The rendezvous host (MASTER_ADDR).
    pub master_addr: String,
    /// The rendezvous port (MASTER_PORT).
    pub master_port: u16,
    /// Names this job's shared-memory segment; set by `zerorun launch` (else derived from the master address).
    pub run_id: String,
    /// `ZERORUN_BACKEND` (default: mpi under mpirun, gloo when ranks span hosts, shm on one host).
    pub backend: Backend,
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
        // torchrun's variables (also what `zerorun launch` gives its ranks inside a Slurm job) and mpirun's come
        // first; a process that `srun` started with neither reads Slurm's.
        if var(&["RANK", "OMPI_COMM_WORLD_RANK"]).is_none() {
            let step = SlurmStep::from_env().map_err(|what| CommError::Rendezvous {
                rank: 0,
                world_size: 0,
                place: "Slurm's variables".into(),
                what,
            })?;
            if let Some(step) = step {
                return RankInfo::from_slurm(step);
            }
        }
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
        RankInfo::with_backend(rank, local_rank, world_size, local_world_size, master_addr, master_port)
    }

    /// A rank of a Slurm job step: the step's first host is the master unless MASTER_ADDR says otherwise, the port
    /// comes from the job id unless MASTER_PORT says otherwise.
    fn from_slurm(step: SlurmStep) -> CommResult<RankInfo> {
        let master_addr = var(&["MASTER_ADDR"]).unwrap_or_else(|| step.hosts[0].clone());
        let master_port = match var(&["MASTER_PORT"]) {
            Some(p) => parse("MASTER_PORT", Some(p), 29500)? as u16,
            None => port_of_job(step.job_id),
        };
        RankInfo::with_backend(
            step.rank,
            step.local_rank,
            step.world_size,
            step.local_world_size,
            master_addr,
            master_port,
        )
    }

    fn with_backend(
        rank: usize,
        local_rank: usize,
        world_size: usize,
        local_world_size: usize,
        master_addr: String,
        master_port: u16,
    ) -> CommResult<RankInfo> {
        let run_id = var(&["ZERORUN_RUN_ID"]).unwrap_or_else(|| format!("{master_addr}-{master_port}"));
        // Under mpirun the MPI backend is the natural choice; elsewhere shared memory.
        let under_mpirun = std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some();
        let backend = match var(&["ZERORUN_BACKEND"]) {
            None if under_mpirun => Backend::Mpi,
            // Ranks on several hosts (torchrun --nnodes, or launchers without --backend): TCP, not shared memory.
            None if local_world_size != world_size => Backend::Gloo,
            None => Backend::Shm,
            Some(name) => Backend::from_name(&name).ok_or_else(|| CommError::Rendezvous {
                rank,
                world_size,
                place: "the environment".into(),
                what: format!("ZERORUN_BACKEND={name:?} is not a backend: one of \"shm\", \"mpi\", \"nccl\", \"gloo\""),
            })?,
        };
        Ok(RankInfo { rank, local_rank, world_size, local_world_size, master_addr, master_port, run_id, backend })
    }

    /// Whether this process was started as one rank of several.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}
