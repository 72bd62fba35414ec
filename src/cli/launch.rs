//! `zerorun launch --nproc-per-node N [--nnodes M|MIN:MAX --node-rank R] [--master-addr A] [--master-port P]
//! [--backend B] [--memory-report [DIR]] [--max-restarts R] [--heartbeat-timeout S] -- PROGRAM ARGS...`
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
    /// Ranks to start on this host. (Each two-word flag also takes torchrun's spelling, e.g. --nproc_per_node.)
    #[arg(long, alias = "nproc_per_node")]
    pub nproc_per_node: usize,
    /// Hosts (nodes) in the job, each running one `zerorun launch` with its own --node-rank: N, or MIN:MAX for an
    /// elastic job (torchrun's spelling) that goes on with the nodes left when one is lost, while at least MIN
    /// remain (with --max-restarts), and takes in a node that joins late at the next restart.
    #[arg(long, default_value = "1", value_parser = parse_nnodes)]
    pub nnodes: NodeCount,
    /// This node's id: 0 hosts the rendezvous at --master-addr; the others any distinct numbers (below N for a
    /// fixed N). Each round numbers the nodes present in the order of their ids.
    #[arg(long, alias = "node_rank", default_value_t = 0)]
    pub node_rank: usize,
    /// The address of node 0, where every rank meets (the gloo backend's TCPStore).
    #[arg(long, alias = "master_addr", default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Default: a free port (one node only: with several, every node must give the same).
    #[arg(long, alias = "master_port")]
    pub master_port: Option<u16>,
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
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

pub fn run(args: LaunchArgs) -> Result<(), CliError> {
    let n = args.nproc_per_node;
    if n == 0 {
        return Err(CliError::Usage("--nproc-per-node must be >= 1".into()));
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
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())
            .map_err(|e| CliError::Io { context: "installing signal handlers".into(), source: e })?;
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
        assert_eq!((a.nproc_per_node, a.node_rank, a.master_addr.as_str()), (2, 1, "10.0.0.1"));
        assert_eq!((a.master_port, a.max_restarts, a.command), (Some(29500), 3, vec!["prog".to_string()]));
        assert!(Launch::try_parse_from(["launch", "--nproc_per_nod", "2", "--", "prog"]).is_err());
    }
}
