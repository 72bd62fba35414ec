//! `zerorun launch --nproc-per-node N [--nnodes M --node-rank R] [--master-addr A] [--master-port P] [--backend B]
//! [--memory-report [DIR]] [--max-restarts R] -- PROGRAM ARGS...`
//!
//! Starts N ranks (this node's, of M nodes: ranks R*N..R*N+N of M*N) as child processes with torchrun's variables,
//! prefixes their output with the rank, shares the cores among them, forwards SIGINT/SIGTERM, and when one rank fails
//! stops the others within 5 seconds; then, up to R times, starts them all again (the program resumes from its
//! latest checkpoint), else exits non-zero naming the rank, how it ended and its last lines (every start's).
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;

use super::CliError;

#[derive(Args)]
pub struct LaunchArgs {
    /// Ranks to start on this host.
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Hosts (nodes) in the job; each runs one `zerorun launch` with its own --node-rank.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's place among the nodes (0 hosts the rendezvous at --master-addr).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// The address of node 0, where every rank meets (the gloo backend's TCPStore).
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Default: a free port (one node only: with several, every node must give the same).
    #[arg(long)]
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
    /// ZERORUN_RESTART_COUNT (and torchrun's TORCHELASTIC_RESTART_COUNT). One node only for now.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Lines of each rank's output kept for the failure report.
const TAIL: usize = 10;
/// After one rank fails, the others get this long to fail on their own (they detect the dead peer), then SIGTERM,
/// then SIGKILL after as long again: at most 5 seconds in all.
const GRACE: Duration = Duration::from_millis(1500);

struct Rank {
    child: Child,
    tail: Arc<Mutex<VecDeque<String>>>,
    status: Option<ExitStatus>,
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s} ({})", signal_name(s)),
        _ => "ended".into(),
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        _ => "signal",
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29500)
}

/// Copies a child's stream to ours line by line with a `[rank R]` prefix, keeping the last lines.
fn pump(rank: usize, stream: impl std::io::Read + Send + 'static, to_stderr: bool, tail: Arc<Mutex<VecDeque<String>>>) {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            let text = format!("[rank {rank}] {line}");
            if to_stderr {
                let _ = writeln!(std::io::stderr().lock(), "{text}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "{text}");
            }
            let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
            if t.len() == TAIL {
                t.pop_front();
            }
            t.push_back(line);
        }
    });
}

fn signal_group(child: &Child, sig: i32) {
    // Each rank leads its own process group, so its children (a shell's `sleep`, say) get the signal too.
    // SAFETY: plain kill(2) on a pid we started.
    unsafe { libc::kill(-(child.id() as libc::pid_t), sig) };
}

pub fn run(args: LaunchArgs) -> Result<(), CliError> {
    let n = args.nproc_per_node;
    if n == 0 {
        return Err(CliError::Usage("--nproc-per-node must be >= 1".into()));
    }
    if args.nnodes == 0 || args.node_rank >= args.nnodes {
        return Err(CliError::Usage(format!(
            "--node-rank {} is not a node of --nnodes {}",
            args.node_rank, args.nnodes
        )));
    }
    use zerorun_comm::rank_info::Backend;
    let multi_node = args.nnodes > 1;
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
    if multi_node && args.max_restarts > 0 {
        return Err(CliError::Usage(
            "--max-restarts restarts the ranks of one node; across nodes it needs elastic membership, which is not there yet".into(),
        ));
    }
    if multi_node && args.master_port.is_none() {
        return Err(CliError::Usage("--master-port: with --nnodes above 1 every node must give the same port".into()));
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())
            .map_err(|e| CliError::Io { context: "installing signal handlers".into(), source: e })?;
    }
    let mut failures: Vec<String> = Vec::new();
    for attempt in 0..=args.max_restarts {
        match run_attempt(&args, &backend, attempt, &stop) {
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
    Err(CliError::Usage(format!(
        "gave up after {} restart{}, every start failed:\n{}",
        args.max_restarts,
        if args.max_restarts == 1 { "" } else { "s" },
        failures.join("\n")
    )))
}

/// Why a start of the job ended badly: its report, and whether a signal to the launcher stopped it (no restart).
struct Failure {
    message: String,
    stopped: bool,
}

impl Failure {
    fn of(message: String) -> Failure {
        Failure { message, stopped: false }
    }
}

/// One start of this node's ranks, watched until all have ended. `attempt`: how many restarts came before.
fn run_attempt(args: &LaunchArgs, backend: &str, attempt: usize, stop: &Arc<AtomicBool>) -> Result<(), Failure> {
    let n = args.nproc_per_node;
    let multi_node = args.nnodes > 1;
    let io = |context: String, source: std::io::Error| Failure::of(CliError::Io { context, source }.to_string());
    let port = args.master_port.unwrap_or_else(free_port);
    let world = n * args.nnodes;
    let first_rank = args.node_rank * n;
    let memory_report = match &args.memory_report {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| io(format!("--memory-report {}", d.display()), e))?;
            Some(std::fs::canonicalize(d).map_err(|e| io(format!("--memory-report {}", d.display()), e))?)
        }
        None => None,
    };
    // One id for the whole job: nodes agree on the master's address and port.
    let run_id = if multi_node {
        format!("{}-{port}", args.master_addr)
    } else {
        format!(
            "{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
        )
    };
    // Several nodes: the launchers tell each other of a failed rank (launch_nodes.rs).
    let links = if multi_node {
        Some(
            super::launch_nodes::NodeLinks::start(args.node_rank, &args.master_addr, port)
                .map_err(|e| io(format!("listening for the other launchers on port {}", port as u32 + 1), e))?,
        )
    } else {
        None
    };
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = (cores / n).max(1).to_string();

    let mut ranks = Vec::with_capacity(n);
    for local in 0..n {
        let rank = first_rank + local;
        let mut cmd = Command::new(&args.command[0]);
        cmd.args(&args.command[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("ZERORUN_BACKEND", backend)
            .env("ZERORUN_RUN_ID", &run_id)
            .env("ZERORUN_RESTART_COUNT", attempt.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", attempt.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        if let Some(d) = &memory_report {
            cmd.env(zerorun_comm::env::MEMORY_REPORT_ENV, d);
        }
        // Share the cores among the ranks unless the user chose.
        for var in ["OMP_NUM_THREADS", "RAYON_NUM_THREADS", "MKL_NUM_THREADS"] {
            if std::env::var_os(var).is_none() {
                cmd.env(var, &threads);
            }
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for r in &ranks {
                    let r: &Rank = r;
                    signal_group(&r.child, libc::SIGKILL);
                }
                return Err(io(format!("starting rank {rank} ({})", args.command[0]), e));
            }
        };
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        pump(rank, child.stdout.take().expect("piped"), false, tail.clone());
        pump(rank, child.stderr.take().expect("piped"), true, tail.clone());
        ranks.push(Rank { child, tail, status: None });
    }

    let mut failed: Option<(usize, ExitStatus, Instant)> = None;
    // When another node's launcher reported a failed rank first: this node's ranks are stopped too.
    let mut remote_stop: Option<Instant> = None;
    let mut forwarded = false;
    let mut termed = false;
    loop {
        // Among ranks that ended since the last poll, one killed by a signal is the likelier first cause (the
        // others may just have noticed it and exited with an error).
        let mut ended = Vec::new();
        for (i, r) in ranks.iter_mut().enumerate() {
            if r.status.is_none() {
                if let Ok(Some(s)) = r.child.try_wait() {
                    r.status = Some(s);
                    ended.push((i, s));
                }
            }
        }
        if failed.is_none() {
            let bad = ended.iter().filter(|(_, s)| !s.success());
            if let Some(&(i, s)) = bad.clone().find(|(_, s)| s.signal().is_some()).or(bad.clone().next()) {
                failed = Some((i, s, Instant::now()));
                if let (Some(links), None) = (&links, remote_stop) {
                    links.report(first_rank + i, &describe(s));
                }
            }
        }
        if failed.is_none() && remote_stop.is_none() && links.as_ref().is_some_and(|l| l.remote_failure().is_some()) {
            remote_stop = Some(Instant::now());
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        if stop.load(Ordering::Relaxed) && !forwarded {
            forwarded = true;
            for r in ranks.iter().filter(|r| r.status.is_none()) {
                signal_group(&r.child, libc::SIGTERM);
            }
        }
        if let Some(at) = failed.map(|f| f.2).or(remote_stop) {
            if !termed && at.elapsed() >= GRACE {
                termed = true;
                for r in ranks.iter().filter(|r| r.status.is_none()) {
                    signal_group(&r.child, libc::SIGTERM);
                }
            }
            if at.elapsed() >= 2 * GRACE {
                for r in ranks.iter().filter(|r| r.status.is_none()) {
                    signal_group(&r.child, libc::SIGKILL);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // A rank killed before the rendezvous finished can leave its segment behind; nothing else can.
    let segment = zerorun_comm::shm::segment_path(&run_id);
    let _ = std::fs::remove_file(&segment);
    if let Ok(entries) = std::fs::read_dir("/dev/shm") {
        let prefix =
            format!("{}.tmp-", segment.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default());
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    std::thread::sleep(Duration::from_millis(50)); // let the pumps flush the last lines
                                                   // A rank here that exited with an error may have seen a peer on another node die: give that node's report a
                                                   // moment to arrive, and name the failure that came first.
    if let (Some(links), Some((_, status, _))) = (&links, failed) {
        let start = Instant::now();
        while status.signal().is_none() && links.remote_failure().is_none() && start.elapsed() < GRACE {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let remote = links.as_ref().and_then(super::launch_nodes::NodeLinks::remote_failure);
    if let (None, Some(r)) = (failed, &remote) {
        return Err(Failure::of(format!(
            "rank {} (node {}) {}; this node's ranks were stopped",
            r.rank, r.node, r.how
        )));
    }
    if let Some((local, status, _)) = failed {
        // Ranks by their place in the job; with several nodes, which node's.
        let name = |i: usize| {
            if multi_node {
                format!("rank {} (node {})", first_rank + i, args.node_rank)
            } else {
                format!("rank {}", first_rank + i)
            }
        };
        let tail = ranks[local].tail.lock().unwrap_or_else(|p| p.into_inner());
        let last: Vec<String> = tail.iter().map(|l| format!("  {l}")).collect();
        let mut others: Vec<String> = ranks
            .iter()
            .enumerate()
            .filter(|(i, r)| *i != local && r.status.is_some_and(|s| !s.success()))
            .map(|(i, r)| format!("{} {}", name(i), describe(r.status.expect("reaped"))))
            .collect();
        let mut msg = format!("{} {}", name(local), describe(status));
        // Another node's rank killed by a signal is the likelier first cause than an error here.
        if let Some(r) =
            remote.filter(|r| remote_stop.is_some() || (status.signal().is_none() && r.how.contains("signal")))
        {
            others.insert(0, msg);
            msg = format!("rank {} (node {}) {}", r.rank, r.node, r.how);
        }
        if !others.is_empty() {
            msg += &format!("; then {}", others.join(", "));
        }
        if !last.is_empty() {
            msg += &format!("\nlast lines of {}:\n{}", name(local), last.join("\n"));
        }
        // Ranks that failed after the launcher was signalled were stopping as asked: no restart.
        return Err(Failure { message: msg, stopped: forwarded });
    }
    if forwarded {
        return Err(Failure { message: "stopped by a signal; every rank was asked to stop".into(), stopped: true });
    }
    Ok(())
}
