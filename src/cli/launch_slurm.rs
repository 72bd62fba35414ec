//! `zerorun launch` inside a Slurm allocation, as torchrun runs there: in a batch script (`sbatch`) it starts one
//! launcher per node through `srun` (one task per node, the allocation's CPUs each) and waits for them; each of
//! those (a task of a step, one per node) takes its node's place from Slurm: node rank SLURM_NODEID, nodes the
//! step's, node 0 the step's first host, the port from the job id. A program started by `srun` itself (one task
//! per rank) needs no launcher at all: `RankInfo::from_env` reads Slurm's variables (`zerorun_comm::slurm`).
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use zerorun_comm::slurm::{expand_counts, expand_hostlist, port_of_job};

use super::launch::{LaunchArgs, NodeCount};
use super::CliError;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn number(name: &str) -> Result<Option<usize>, CliError> {
    match var(name) {
        None => Ok(None),
        Some(v) => {
            v.trim().parse().map(Some).map_err(|_| CliError::Usage(format!("Slurm's {name}={v:?} is not a number")))
        }
    }
}

fn hosts(name: &str) -> Result<Vec<String>, CliError> {
    let list = var(name).ok_or_else(|| CliError::Usage(format!("Slurm set no {name}")))?;
    expand_hostlist(&list).map_err(|e| CliError::Usage(format!("Slurm's {name}={list:?}: {e}")))
}

/// A batch script's allocation of several nodes: `run` starts a launcher on each through srun.
pub struct BatchJob {
    nodes: usize,
    ranks_per_node: usize,
    cpus_per_node: Option<usize>,
}

/// Reads the Slurm job this launcher runs in, if any, and settles `args` from it: the ranks per node (the
/// allocation's tasks per node unless given, which must then agree), and for a task of an `srun` step its node's
/// place. Returns the batch job when this launcher runs in a batch script of several nodes.
pub fn settle(args: &mut LaunchArgs) -> Result<Option<BatchJob>, CliError> {
    if var("SLURM_JOB_ID").is_none() {
        return Ok(None);
    }
    if var("SLURM_STEP_ID").is_some() {
        return settle_step(args).map(|()| None);
    }
    // A batch script (or salloc's shell): tasks per node as sbatch --ntasks-per-node gave them.
    let per_node = number("SLURM_NTASKS_PER_NODE")?;
    let ranks_per_node = match (args.nproc_per_node, per_node) {
        (Some(n), Some(k)) if n != k => {
            return Err(CliError::Usage(format!(
                "--nproc-per-node {n} does not match the Slurm allocation's {k} tasks per node (SLURM_NTASKS_PER_NODE): give the same, or leave --nproc-per-node out"
            )))
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => {
            return Err(CliError::Usage(
                "--nproc-per-node: the Slurm allocation does not say its tasks per node (sbatch --ntasks-per-node)"
                    .into(),
            ))
        }
    };
    args.nproc_per_node = Some(ranks_per_node);
    let nodes = number("SLURM_JOB_NUM_NODES")?.or(number("SLURM_NNODES")?).unwrap_or(1);
    if nodes == 1 {
        return Ok(None); // this node is the allocation: run here
    }
    if args.nnodes.max > 1 || args.node_rank != 0 {
        return Err(CliError::Usage(format!(
            "--nnodes/--node-rank inside a Slurm allocation of {nodes} nodes: zerorun launch starts one launcher per node through srun itself; leave them out"
        )));
    }
    let cpus_per_node = match var("SLURM_JOB_CPUS_PER_NODE") {
        Some(text) => expand_counts(&text).ok().and_then(|c| c.into_iter().min()),
        None => None,
    };
    Ok(Some(BatchJob { nodes, ranks_per_node, cpus_per_node }))
}

/// A task of an `srun` step: one launcher per node, its place from Slurm.
fn settle_step(args: &mut LaunchArgs) -> Result<(), CliError> {
    let tasks = number("SLURM_STEP_NUM_TASKS")?.or(number("SLURM_NTASKS")?).unwrap_or(1);
    let nodes = number("SLURM_STEP_NUM_NODES")?.or(number("SLURM_NNODES")?).unwrap_or(1);
    if tasks != nodes {
        return Err(CliError::Usage(format!(
            "zerorun launch under srun runs as one task per node (srun --ntasks-per-node=1); this step has {tasks} tasks on {nodes} nodes. To start one task per rank, run the program itself with srun: it reads Slurm's variables"
        )));
    }
    if args.nproc_per_node.is_none() {
        return Err(CliError::Usage("--nproc-per-node: how many ranks each node's launcher starts".into()));
    }
    if nodes == 1 {
        return Ok(());
    }
    let node = number("SLURM_NODEID")?.unwrap_or(0);
    let hosts = hosts("SLURM_STEP_NODELIST").or_else(|_| hosts("SLURM_JOB_NODELIST"))?;
    let job = number("SLURM_JOB_ID")?.unwrap_or(0) as u64;
    match args.nnodes {
        NodeCount { min: 1, max: 1 } => args.nnodes = NodeCount { min: nodes, max: nodes },
        NodeCount { max, .. } if max == nodes => {}
        NodeCount { min, max } => {
            return Err(CliError::Usage(format!("--nnodes {min}:{max}: the srun step has {nodes} nodes")));
        }
    }
    args.node_rank = node;
    args.master_addr.get_or_insert_with(|| hosts[0].clone());
    args.master_port.get_or_insert(port_of_job(job));
    tracing::info!(node, nodes, master = %args.master(), "one launcher per node of the Slurm step");
    Ok(())
}

impl BatchJob {
    /// `srun` one launcher per node (this binary, these arguments, with the ranks per node settled) and wait.
    pub fn run(&self, args: &LaunchArgs) -> Result<(), CliError> {
        let exe = std::env::current_exe()
            .map_err(|e| CliError::Io { context: "finding zerorun itself".into(), source: e })?;
        let mut cmd = Command::new("srun");
        cmd.arg(format!("--nodes={}", self.nodes))
            .arg(format!("--ntasks={}", self.nodes))
            .arg("--ntasks-per-node=1")
            // One task holds the node's ranks: it gets the node's CPUs, not one.
            .args(self.cpus_per_node.map(|c| format!("--cpus-per-task={c}")))
            // A launcher that fails ends the step (the others stop their ranks on the signal).
            .arg("--kill-on-bad-exit=1")
            .arg(&exe)
            .arg("launch")
            .arg(format!("--nproc-per-node={}", self.ranks_per_node))
            .arg(format!("--max-restarts={}", args.max_restarts))
            .arg(format!("--heartbeat-timeout={}", args.heartbeat_timeout));
        if let Some(b) = &args.backend {
            cmd.arg(format!("--backend={b}"));
        }
        if let Some(p) = args.master_port {
            cmd.arg(format!("--master-port={p}"));
        }
        if let Some(d) = &args.memory_report {
            cmd.arg(format!("--memory-report={}", d.display()));
        }
        cmd.arg("--").args(&args.command);
        let stop = super::launch::stop_flag()?;
        let mut child = cmd.spawn().map_err(|e| CliError::Io {
            context: "running srun (Slurm's client, from PATH) for one launcher per node".into(),
            source: e,
        })?;
        tracing::info!(nodes = self.nodes, ranks_per_node = self.ranks_per_node, "srun: one launcher per node");
        let mut signalled = false;
        let status = loop {
            if let Some(s) =
                child.try_wait().map_err(|e| CliError::Io { context: "waiting for srun".into(), source: e })?
            {
                break s;
            }
            if stop.load(Ordering::Relaxed) && !signalled {
                // srun passes SIGTERM to every task: each node's launcher stops its ranks.
                signalled = true;
                // SAFETY: kill(2) on the srun we started.
                unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if status.success() {
            Ok(())
        } else {
            Err(CliError::Usage(format!(
                "the job failed: srun {} (each node's launcher named its failure above)",
                super::launch_ranks::describe(status)
            )))
        }
    }
}
