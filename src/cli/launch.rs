//! `zerorun launch --nproc-per-node N [--nnodes M|MIN:MAX --node-rank R] [--master-addr A] [--master-port P]
//! [--backend B] [--memory-report [DIR]] [--max-restarts R] [--heartbeat-timeout S] -- PROGRAM ARGS...`
//!
//! `zerorun launch --hostfile FILE [--include H|--exclude H] [--num_nodes N] [--num_gpus N] -- PROGRAM ARGS...`
//! starts every host's launcher over ssh (`launch_ssh.rs`); inside a Slurm allocation the launcher starts one
//! launcher per node through srun, or takes its node's place from Slurm (`launch_slurm.rs`).
//!
//! Starts N ranks (this node's, of M nodes: ranks R*N..R*N+N of M*N) as child processes with torchrun's variables
//! (`launch_ranks.rs`); when one rank fails the others stop within 5 seconds, and then, up to R times, the job starts
//! again (the program resumes from its latest checkpoint), else the launcher exits non-zero naming the rank, how it
//! ended and its last lines (every start's). Across nodes the launchers meet at node 0 (`launch_nodes.rs`), which
//! decides each round's membership: with MIN:MAX, a lost node's ranks are dropped and the job restarts on the nodes
//! left while at least MIN remain. A rank whose heartbeat says it is hung (outside every collective for S seconds
//! while its peers wait, or not answering at all) is killed and named like a rank that failed.
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::Args;

use super::launch_ranks::{free_port, run_round, Failure, Round};
use super::CliError;

/// `--nnodes`: a fixed number of nodes, or torchrun's elastic `MIN:MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeCount {
    /// Fewest nodes the job runs on.
    pub min: usize,
    /// Most nodes the job takes.
    pub max: usize,
}

fn parse_nnodes(text: &str) -> Result<NodeCount, String> {
    let number = |s: &str| s.trim().parse::<usize>().map_err(|_| format!("{s:?} is not a number of nodes"));
    let (min, max) = match text.split_once(':') {
        Some((a, b)) => (number(a)?, number(b)?),
        None => (number(text)?, number(text)?),
    };
    if min == 0 || min > max {
        return Err(format!("{text:?}: give N, or MIN:MAX with 1 <= MIN <= MAX"));
    }
    Ok(NodeCount { min, max })
}

#[derive(Args)]
pub struct LaunchArgs {
    /// Ranks to start on this host (with --hostfile: on every host, at most its slots; default its slots; inside a
    /// Slurm allocation: default its tasks per node). (Each two-word flag also takes torchrun's spelling, e.g.
    /// --nproc_per_node.)
    #[arg(long, alias = "nproc_per_node")]
    pub nproc_per_node: Option<usize>,
    /// Hosts (nodes) in the job, each running one `zerorun launch` with its own --node-rank: N, or MIN:MAX for an
    /// elastic job (torchrun's spelling) that goes on with the nodes left when one is lost, while at least MIN
    /// remain (with --max-restarts), and takes in a node that joins late at the next restart.
    #[arg(long, default_value = "1", value_parser = parse_nnodes)]
    pub nnodes: NodeCount,
    /// This node's id: 0 hosts the rendezvous at --master-addr; the others any distinct numbers (below N for a
    /// fixed N). Each round numbers the nodes present in the order of their ids.
    #[arg(long, alias = "node_rank", default_value_t = 0)]
    pub node_rank: usize,
    /// The address of node 0, where every rank meets (the gloo backend's TCPStore). Default: 127.0.0.1; with
    /// --hostfile the first host's address (its `hostname -I`, as DeepSpeed asks it); under Slurm the first host
    /// of the allocation.
    #[arg(long, alias = "master_addr")]
    pub master_addr: Option<String>,
    /// Default: a free port (one node only: with several, every node must give the same); with --hostfile 29500;
    /// under Slurm a port from the job id.
    #[arg(long, alias = "master_port")]
    pub master_port: Option<u16>,
    /// DeepSpeed's hostfile (`HOST slots=N` per line, `#` comments): one command here starts every host's launcher
    /// over ssh (OpenSSH's client, your ~/.ssh/config; extra options in ZERORUN_SSH_OPTIONS), each host's output
    /// prefixed by host and rank, everything stopped on Ctrl-C or a failure. zerorun, the program and the working
    /// directory must be at the same paths on every host. Forwarded: ZERORUN_*, NCCL_*, GLOO_*, RUST_LOG and the
    /// lines of ~/.deepspeed_env and ./.deepspeed_env (DS_ENV_FILE names another file).
    #[arg(short = 'H', long, value_name = "FILE")]
    pub hostfile: Option<std::path::PathBuf>,
    /// With --hostfile: only these hosts, or slots of them: `host1:0,1@host2` (DeepSpeed's syntax).
    #[arg(short = 'i', long, value_name = "HOSTS", conflicts_with = "exclude")]
    pub include: Option<String>,
    /// With --hostfile: not these hosts, or slots of them: `host1:0,1@host2`.
    #[arg(short = 'e', long, value_name = "HOSTS")]
    pub exclude: Option<String>,
    /// With --hostfile: the first N hosts only.
    #[arg(long, alias = "num_nodes", value_name = "N")]
    pub num_nodes: Option<usize>,
    /// With --hostfile: the first N slots of each host only (DeepSpeed's spelling of --nproc-per-node).
    #[arg(long, alias = "num_gpus", value_name = "N")]
    pub num_gpus: Option<usize>,
    /// With --hostfile: the port every host's sshd listens on (default: ssh's, from ~/.ssh/config or 22).
    #[arg(long, alias = "ssh_port", value_name = "PORT")]
    pub ssh_port: Option<u16>,
    /// Started over ssh by --hostfile: stop the ranks when standard input closes (the ssh connection ended).
    #[arg(long, hide = true)]
    pub until_stdin_closes: bool,
    /// How the ranks communicate: shm (shared memory; the default on one node), gloo (libtorch's TCP backend; the
    /// default across nodes) or nccl (GPUs).
    #[arg(long)]
    pub backend: Option<String>,
    /// Each rank writes memory_rank{r}.json here at the end of the run, and rank 0 draws memory.svg/png and
    /// prints the table (the program must call `Engine::finish_memory_report`, as the examples do).
    /// Without DIR: the working directory.
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = ".")]
    pub memory_report: Option<std::path::PathBuf>,
    /// When a rank fails, stop the others and start the job again (same program and arguments) up to this many
    /// times; the program resumes from its latest checkpoint (the examples' `--resume`). The ranks see
    /// ZERORUN_RESTART_COUNT (and torchrun's TORCHELASTIC_RESTART_COUNT). Across nodes every launcher gives the
    /// same value; node 0's counts.
    #[arg(long, alias = "max_restarts", default_value_t = 0)]
    pub max_restarts: usize,
    /// A rank that spends this many seconds outside every collective after its first one (its peers waiting for
    /// it), or whose process stops answering, counts as hung: the launcher kills it and names it, as a failure.
    /// 0 turns the heartbeat off. Default: 1800, as `comms_timeout`.
    #[arg(long, value_name = "SECONDS", default_value_t = 1800.0)]
    pub heartbeat_timeout: f64,
    /// For a program whose config enables `fault_tolerance`: a failed rank (or a lost node) does not stop the
    /// others, which go on without its replica group (a rank whose group broke ends on its own). The job succeeds
    /// when the ranks of node 0 (which hosts the store) do; the failures are reported. With --max-restarts, a
    /// node other than 0 whose rank fails stops its others and starts them again (its ranks are one replica
    /// group, `mics_shard_size` = --nproc-per-node), up to that many times: they rejoin the running job and heal
    /// from a live group's state (ZERORUN_FT_REJOIN tells them).
    #[arg(long)]
    pub fault_tolerant: bool,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

impl LaunchArgs {
    /// Ranks on this host (`run` resolves it first).
    pub fn ranks_per_node(&self) -> usize {
        self.nproc_per_node.unwrap_or(1)
    }

    /// Node 0's address (`run` resolves it first).
    pub fn master(&self) -> &str {
        self.master_addr.as_deref().unwrap_or("127.0.0.1")
    }
}

pub fn run(mut args: LaunchArgs) -> Result<(), CliError> {
    if let Some(hostfile) = args.hostfile.clone() {
        if args.fault_tolerant {
            return Err(CliError::Usage(
                "--fault-tolerant with --hostfile: the ssh driver stops every host when one fails; start one `zerorun launch --fault-tolerant --nnodes N --node-rank I` per host instead".into(),
            ));
        }
        return super::launch_ssh::run(args, &hostfile);
    }
    for (flag, given) in [
        ("--include", args.include.is_some()),
        ("--exclude", args.exclude.is_some()),
        ("--num_nodes", args.num_nodes.is_some()),
        ("--num_gpus", args.num_gpus.is_some()),
        ("--ssh-port", args.ssh_port.is_some()),
    ] {
        if given {
            return Err(CliError::Usage(format!("{flag} chooses among the hosts of a --hostfile; give one")));
        }
    }
    // Inside a Slurm job: in a batch script, one launcher per node through srun; as one of srun's tasks (one per
    // node), this node's place from Slurm.
    if let Some(job) = super::launch_slurm::settle(&mut args)? {
        if args.fault_tolerant {
            return Err(CliError::Usage(
                "--fault-tolerant in a batch script: srun's --kill-on-bad-exit stops every node when one fails; run one `srun --ntasks-per-node=1 zerorun launch --fault-tolerant ...` step yourself, without --kill-on-bad-exit".into(),
            ));
        }
        return job.run(&args);
    }
    let Some(n) = args.nproc_per_node else {
        return Err(CliError::Usage("--nproc-per-node: how many ranks to start on this host".into()));
    };
    if n == 0 {
        return Err(CliError::Usage("--nproc-per-node must be >= 1".into()));
    }
    if args.fault_tolerant && args.max_restarts > 0 && args.nnodes.max == 1 {
        return Err(CliError::Usage(
            "--fault-tolerant with --max-restarts restarts a node's ranks as one replica group: with one node its ranks are every group; start one launcher per group (--nnodes N --node-rank I)".into(),
        ));
    }
    let elastic = args.nnodes.min < args.nnodes.max;
    if !elastic && args.node_rank >= args.nnodes.max {
        return Err(CliError::Usage(format!(
            "--node-rank {} is not a node of --nnodes {}",
            args.node_rank, args.nnodes.max
        )));
    }
    use zerorun_comm::rank_info::Backend;
    let multi_node = args.nnodes.max > 1;
    let backend = args.backend.clone().unwrap_or_else(|| if multi_node { "gloo" } else { "shm" }.into());
    // The ranks read it back as ZERORUN_BACKEND (rank_info.rs): the same names, checked here first.
    match Backend::from_name(&backend) {
        Some(Backend::Shm) if multi_node => {
            return Err(CliError::Usage(
                "--backend shm: shared memory reaches one host's ranks only; with --nnodes above 1 use gloo (the default) or nccl".into(),
            ))
        }
        Some(Backend::Shm | Backend::Nccl | Backend::Gloo) => {}
        _ => {
            return Err(CliError::Usage(format!(
                "--backend {backend:?}: `zerorun launch` starts shm, gloo or nccl ranks (run MPI jobs with mpirun)"
            )))
        }
    }
    if multi_node && args.master_port.is_none() {
        return Err(CliError::Usage("--master-port: with --nnodes above 1 every node must give the same port".into()));
    }
    let stop = stop_flag()?;
    if args.until_stdin_closes {
        // The ssh connection that started this launcher is its lifeline: when it closes (the driver stopped or
        // was killed, its host lost), stop the ranks as a signal would.
        let stop = stop.clone();
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    }
    if multi_node {
        return super::launch_nodes::run_job(&args, &backend, &stop);
    }
    let mut failures: Vec<String> = Vec::new();
    for attempt in 0..=args.max_restarts {
        let round = Round { restart: attempt, node: 0, nodes: 1, port: args.master_port.unwrap_or_else(free_port) };
        match run_round(&args, &backend, round, &stop, None) {
            Ok(()) => return Ok(()),
            // Stopped by the user (a signal), or nothing left to try: the failure as it is.
            Err(Failure { message, stopped: true }) => return Err(CliError::Usage(message)),
            Err(Failure { message, .. }) if args.max_restarts == 0 => return Err(CliError::Usage(message)),
            Err(Failure { message, .. }) => {
                let first_line = message.lines().next().unwrap_or_default().to_string();
                if attempt < args.max_restarts {
                    eprintln!(
                        "zerorun launch: {first_line}; restarting ({} of {}) from the latest checkpoint",
                        attempt + 1,
                        args.max_restarts
                    );
                }
                failures.push(format!("start {}: {message}", attempt + 1));
            }
        }
    }
    Err(gave_up(args.max_restarts, &failures))
}

/// A flag that SIGINT and SIGTERM set: the launcher stops its ranks (or hosts) and ends.
pub(super) fn stop_flag() -> Result<Arc<AtomicBool>, CliError> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())
            .map_err(|e| CliError::Io { context: "installing signal handlers".into(), source: e })?;
    }
    Ok(stop)
}

/// The error after the last allowed restart failed: every start's failure.
pub(super) fn gave_up(max_restarts: usize, failures: &[String]) -> CliError {
    CliError::Usage(format!(
        "gave up after {max_restarts} restart{}, every start failed:\n{}",
        if max_restarts == 1 { "" } else { "s" },
        failures.join("\n")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Launch {
        #[command(flatten)]
        args: LaunchArgs,
    }

    #[test]
    fn torchrun_spellings_are_accepted() {
        let argv =
            ["launch", "--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1"];
        let tail = ["--master_port", "29500", "--max_restarts", "3", "--", "prog"];
        let a = Launch::try_parse_from(argv.iter().chain(&tail)).unwrap().args;
        assert_eq!((a.nproc_per_node, a.node_rank, a.master()), (Some(2), 1, "10.0.0.1"));
        assert_eq!((a.master_port, a.max_restarts, a.command), (Some(29500), 3, vec!["prog".to_string()]));
        assert!(Launch::try_parse_from(["launch", "--nproc_per_nod", "2", "--", "prog"]).is_err());
    }
}
