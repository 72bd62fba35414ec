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

/// Reads a variable: the process's environment, or a test's.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

fn var_of(get: Lookup, names: &[&str]) -> Option<String> {
    names.iter().find_map(|n| get(n))
}

fn environment(name: &str) -> Option<String> {
    std::env::var(name).ok()
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

/// Whether `addr` names this host by its loopback (where one-host jobs meet).
fn is_loopback(addr: &str) -> bool {
    addr == "localhost" || addr.parse::<std::net::IpAddr>().is_ok_and(|a| a.is_loopback())
}

impl RankInfo {
    /// Reads the variables; a single process with none set is rank 0 of 1.
    pub fn from_env() -> CommResult<RankInfo> {
        RankInfo::from_vars(&environment)
    }

    /// `from_env` over the variables `get` gives.
    pub fn from_vars(get: Lookup) -> CommResult<RankInfo> {
        let var = |names: &[&str]| var_of(get, names);
        // torchrun's variables (also what `zerorun launch` gives its ranks inside a Slurm job) and mpirun's come
        // first; a process that `srun` started with neither reads Slurm's.
        if var(&["RANK", "OMPI_COMM_WORLD_RANK"]).is_none() {
            let step = SlurmStep::from_vars(get).map_err(|what| CommError::Rendezvous {
                rank: 0,
                world_size: 0,
                place: "Slurm's variables".into(),
                what,
            })?;
            if let Some(step) = step {
                return RankInfo::from_slurm(get, step);
            }
        }
        let rank = parse("RANK", var(&["RANK", "OMPI_COMM_WORLD_RANK"]), 0)?;
        let world_size = parse("WORLD_SIZE", var(&["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"]), 1)?;
        let master_addr = var(&["MASTER_ADDR"]).unwrap_or_else(|| "127.0.0.1".into());
        // Without LOCAL_WORLD_SIZE (a Kubernetes pod spec that sets only RANK and WORLD_SIZE, one rank per pod) the
        // ranks are on one host only when they meet on this one.
        let local_default = if is_loopback(&master_addr) { world_size } else { 1 };
        let local_world_size =
            parse("LOCAL_WORLD_SIZE", var(&["LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"]), local_default)?;
        let local_rank = parse(
            "LOCAL_RANK",
            var(&["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"]),
            if local_world_size == 1 { 0 } else { rank },
        )?;
        let master_port = parse("MASTER_PORT", var(&["MASTER_PORT"]), 29500)? as u16;
        if rank >= world_size || world_size == 0 {
            return Err(CommError::Rendezvous {
                rank,
                world_size,
                place: "the environment".into(),
                what: "RANK must be below WORLD_SIZE".into(),
            });
        }
        RankInfo::with_backend(get, rank, local_rank, world_size, local_world_size, master_addr, master_port)
    }

    /// A rank of a Slurm job step: the step's first host is the master unless MASTER_ADDR says otherwise, the port
    /// comes from the job id unless MASTER_PORT says otherwise.
    fn from_slurm(get: Lookup, step: SlurmStep) -> CommResult<RankInfo> {
        let var = |names: &[&str]| var_of(get, names);
        let master_addr = var(&["MASTER_ADDR"]).unwrap_or_else(|| step.hosts[0].clone());
        let master_port = match var(&["MASTER_PORT"]) {
            Some(p) => parse("MASTER_PORT", Some(p), 29500)? as u16,
            None => port_of_job(step.job_id),
        };
        RankInfo::with_backend(
            get,
            step.rank,
            step.local_rank,
            step.world_size,
            step.local_world_size,
            master_addr,
            master_port,
        )
    }

    fn with_backend(
        get: Lookup,
        rank: usize,
        local_rank: usize,
        world_size: usize,
        local_world_size: usize,
        master_addr: String,
        master_port: u16,
    ) -> CommResult<RankInfo> {
        let var = |names: &[&str]| var_of(get, names);
        let run_id = var(&["ZERORUN_RUN_ID"]).unwrap_or_else(|| format!("{master_addr}-{master_port}"));
        // Under mpirun the MPI backend is the natural choice; elsewhere shared memory.
        let under_mpirun = get("OMPI_COMM_WORLD_SIZE").is_some();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn info(vars: &[(&str, &str)]) -> CommResult<RankInfo> {
        let owned: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        RankInfo::from_vars(&move |name: &str| owned.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    const STEP: [(&str, &str); 8] = [
        ("SLURM_JOB_ID", "41"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_PROCID", "3"),
        ("SLURM_STEP_NUM_TASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_STEP_NODELIST", "gpu[07-08]"),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
    ];

    #[test]
    fn a_task_of_an_srun_step_finds_its_place() {
        let i = info(&STEP).unwrap();
        assert_eq!((i.rank, i.world_size, i.local_rank, i.local_world_size), (3, 4, 1, 2));
        assert_eq!((i.master_addr.as_str(), i.master_port, i.backend), ("gpu07", port_of_job(41), Backend::Gloo));
        // MASTER_ADDR / MASTER_PORT win; torchrun's variables (a launcher's ranks inside the job) come first.
        let mut given = STEP.to_vec();
        given.extend([("MASTER_ADDR", "10.1.1.1"), ("MASTER_PORT", "6000")]);
        let i = info(&given).unwrap();
        assert_eq!((i.master_addr.as_str(), i.master_port), ("10.1.1.1", 6000));
        given.extend([("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")]);
        assert_eq!(info(&given).unwrap().world_size, 2);
    }

    #[test]
    fn a_batch_script_is_one_process_not_rank_0_of_the_allocation() {
        let batch: Vec<_> = STEP.iter().filter(|(k, _)| *k != "SLURM_STEP_ID").copied().collect();
        let i = info(&batch).unwrap();
        assert_eq!((i.rank, i.world_size), (0, 1));
    }

    #[test]
    fn ranks_without_local_world_size_meet_across_hosts_unless_on_loopback() {
        let pod = info(&[("RANK", "2"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "job-master-0")]).unwrap();
        assert_eq!((pod.local_rank, pod.local_world_size, pod.backend), (0, 1, Backend::Gloo));
        let local = info(&[("RANK", "2"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1")]).unwrap();
        assert_eq!((local.local_rank, local.local_world_size, local.backend), (2, 4, Backend::Shm));
    }

    #[test]
    fn bad_slurm_variables_are_named() {
        let mut bad = STEP.to_vec();
        bad[2] = ("SLURM_PROCID", "x");
        let e = info(&bad).unwrap_err().to_string();
        assert!(e.contains("SLURM_PROCID=\"x\" is not a number"), "{e}");
        bad[2] = ("SLURM_PROCID", "9");
        let e = info(&bad).unwrap_err().to_string();
        assert!(e.contains("do not fit 4 tasks"), "{e}");
    }
}
