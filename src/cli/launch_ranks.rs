//! One round of this node's ranks: started as child processes with torchrun's variables, their output prefixed
//! with the rank, the cores shared among them, SIGINT/SIGTERM forwarded, and, when one fails (or another node says
//! one of its own did), the others stopped within 5 seconds; the failure named with the rank, how it ended and its
//! last lines.
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::launch::LaunchArgs;
use super::CliError;

/// Where this node's ranks sit in one round of the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    /// Restarts before this round (the ranks' ZERORUN_RESTART_COUNT).
    pub restart: usize,
    /// This node's index among the round's nodes (its ranks are index*N..index*N+N).
    pub node: usize,
    /// Nodes in the round.
    pub nodes: usize,
    /// Where the ranks meet (node 0's address, this port).
    pub port: u16,
}

/// A failure another node reported: the rank (in the job), its node, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFailure {
    /// The rank, in the round's numbering.
    pub rank: usize,
    /// Its node's index in the round.
    pub node: usize,
    /// Its node's host name.
    pub host: String,
    /// How it ended (`was killed by signal 9 (SIGKILL)`, `'s launcher is gone`, ...).
    pub how: String,
}

impl RemoteFailure {
    /// `rank 3 (node 1, host gpu-b)`.
    pub fn rank_name(&self) -> String {
        format!("rank {} (node {}, host {})", self.rank, self.node, self.host)
    }
}

/// This machine's host name, as the failures of a job of several nodes name it.
pub fn this_host() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok && end > 0 {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown".into()
    }
}

/// The other launchers of a job of several nodes, as one round of ranks sees them.
pub trait Peers: Sync {
    /// Tells the others that `rank` of this node failed, and how.
    fn report(&self, rank: usize, how: &str);
    /// The first failure another node reported in this round, if any: this node's ranks are stopped.
    fn remote_failure(&self) -> Option<RemoteFailure>;
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

pub fn describe(status: ExitStatus) -> String {
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

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29500)
}

/// Copies a child's stream to ours line by line behind `prefix` (`[rank R]`, `[host]`), keeping its last `keep`
/// lines (unprefixed) for the failure report.
pub fn pump(
    prefix: String,
    stream: impl std::io::Read + Send + 'static,
    to_stderr: bool,
    tail: Arc<Mutex<VecDeque<String>>>,
    keep: usize,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            let text = format!("{prefix} {line}");
            let _ = if to_stderr {
                writeln!(std::io::stderr().lock(), "{text}")
            } else {
                writeln!(std::io::stdout().lock(), "{text}")
            };
            let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
            if t.len() == keep {
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

/// Why a round of the job ended badly: its report, and whether a signal to the launcher stopped it (no restart).
pub struct Failure {
    /// The report: which rank, how it ended, its last lines.
    pub message: String,
    /// A signal to the launcher stopped it: no restart.
    pub stopped: bool,
}

impl Failure {
    pub fn of(message: String) -> Failure {
        Failure { message, stopped: false }
    }
}

/// One round of this node's ranks, watched until all have ended. `peers`: the other nodes' launchers, in a job of
/// several nodes.
pub fn run_round(
    args: &LaunchArgs,
    backend: &str,
    round: Round,
    stop: &Arc<AtomicBool>,
    peers: Option<&dyn Peers>,
) -> Result<(), Failure> {
    let n = args.ranks_per_node();
    let multi_node = peers.is_some();
    let io = |context: String, source: std::io::Error| Failure::of(CliError::Io { context, source }.to_string());
    let port = round.port;
    let world = n * round.nodes;
    let first_rank = round.node * n;
    let attempt = round.restart;
    let memory_report = match &args.memory_report {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| io(format!("--memory-report {}", d.display()), e))?;
            Some(std::fs::canonicalize(d).map_err(|e| io(format!("--memory-report {}", d.display()), e))?)
        }
        None => None,
    };
    // One id for the whole job: nodes agree on the master's address and port.
    let run_id = if multi_node {
        format!("{}-{port}", args.master())
    } else {
        format!(
            "{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
        )
    };
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = (cores / n).max(1).to_string();

    // Each rank's heartbeat file (`zerorun_comm::heartbeat`), in a folder of this round's.
    let heartbeats = (args.heartbeat_timeout > 0.0)
        .then(|| std::env::temp_dir().join(format!("zerorun-heartbeat-{}-{}", std::process::id(), round.restart)));
    if let Some(dir) = &heartbeats {
        // A launcher that was killed leaves its folder behind; one that reuses its pid must not read the old
        // ranks' beats (hours old: every rank would count as hung at once).
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).map_err(|e| io(format!("creating {}", dir.display()), e))?;
    }
    // This node's ranks; `rejoin` = k for the k-th restart of a fault-tolerant node's replica group.
    let spawn = |rejoin: usize| -> Result<Vec<Rank>, Failure> {
        let mut ranks = Vec::with_capacity(n);
        for local in 0..n {
            let rank = first_rank + local;
            let mut cmd = Command::new(&args.command[0]);
            cmd.args(&args.command[1..])
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", local.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("GROUP_RANK", round.node.to_string())
                .env("MASTER_ADDR", args.master())
                .env("MASTER_PORT", port.to_string())
                .env("ZERORUN_BACKEND", backend)
                .env("ZERORUN_RUN_ID", &run_id)
                .env("ZERORUN_RESTART_COUNT", attempt.to_string())
                .env("TORCHELASTIC_RESTART_COUNT", attempt.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            if rejoin > 0 {
                cmd.env(zerorun_comm::env::FAULT_TOLERANT_REJOIN_ENV, rejoin.to_string());
            }
            if let Some(d) = &memory_report {
                cmd.env(zerorun_comm::env::MEMORY_REPORT_ENV, d);
            }
            if let Some(dir) = &heartbeats {
                cmd.env(zerorun_comm::heartbeat::HEARTBEAT_ENV, dir.join(format!("rank{rank}")));
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
            pump(format!("[rank {rank}]"), child.stdout.take().expect("piped"), false, tail.clone(), TAIL);
            pump(format!("[rank {rank}]"), child.stderr.take().expect("piped"), true, tail.clone(), TAIL);
            ranks.push(Rank { child, tail, status: None });
        }
        Ok(ranks)
    };
    let mut ranks = spawn(0)?;
    // A fault-tolerant node's restarts of its ranks so far, and when its group broke (its other ranks stop).
    let (mut rejoins, mut group_broke): (usize, Option<Instant>) = (0, None);

    let mut failed: Option<(usize, ExitStatus, Instant)> = None;
    // Ranks the heartbeat found hung (and the launcher killed): how, instead of "killed by signal 9".
    let mut hung: Vec<Option<String>> = vec![None; n];
    let mut heartbeat_checked = Instant::now();
    let describe_rank =
        |hung: &[Option<String>], i: usize, s: ExitStatus| hung[i].clone().unwrap_or_else(|| describe(s));
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
        if args.fault_tolerant {
            // The replica groups go on without the rank's: nothing is stopped, nothing reported as a failure.
            for &(i, s) in ended.iter().filter(|(_, s)| !s.success()) {
                let name = if multi_node {
                    format!("rank {} (node {}, host {})", first_rank + i, round.node, this_host())
                } else {
                    format!("rank {}", first_rank + i)
                };
                eprintln!(
                    "zerorun launch: {name} {}: its replica group leaves; the other ranks go on (--fault-tolerant)",
                    describe_rank(&hung, i, s)
                );
                // A node of its own replica group (not node 0, which holds the store): its other ranks stop,
                // and all restart to rejoin, while restarts are left.
                if multi_node && round.node != 0 && rejoins < args.max_restarts && group_broke.is_none() {
                    group_broke = Some(Instant::now());
                }
            }
        } else if failed.is_none() {
            let bad = ended.iter().filter(|(_, s)| !s.success());
            if let Some(&(i, s)) = bad.clone().find(|(_, s)| s.signal().is_some()).or(bad.clone().next()) {
                failed = Some((i, s, Instant::now()));
                if let (Some(peers), None) = (peers, remote_stop) {
                    peers.report(first_rank + i, &describe_rank(&hung, i, s));
                }
            }
        }
        if !args.fault_tolerant
            && failed.is_none()
            && remote_stop.is_none()
            && peers.is_some_and(|l| l.remote_failure().is_some())
        {
            remote_stop = Some(Instant::now());
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            if group_broke.take().is_some() {
                rejoins += 1;
                eprintln!(
                    "zerorun launch: restarting node {}'s ranks ({rejoins} of {}) to rejoin the job (--fault-tolerant)",
                    round.node, args.max_restarts
                );
                if let Some(dir) = &heartbeats {
                    let _ = std::fs::remove_dir_all(dir);
                    let _ = std::fs::create_dir_all(dir);
                }
                ranks = spawn(rejoins)?;
                hung = vec![None; n];
                termed = false;
                continue;
            }
            break;
        }
        if let (Some(dir), true) = (&heartbeats, heartbeat_checked.elapsed() >= Duration::from_millis(500)) {
            heartbeat_checked = Instant::now();
            for (i, r) in ranks.iter().enumerate() {
                if r.status.is_some() || hung[i].is_some() {
                    continue;
                }
                if let Some(why) =
                    hung_by_heartbeat(&dir.join(format!("rank{}", first_rank + i)), args.heartbeat_timeout)
                {
                    hung[i] = Some(format!("hung: {why}; the launcher killed it (--heartbeat-timeout)"));
                    signal_group(&r.child, libc::SIGKILL);
                }
            }
        }
        if stop.load(Ordering::Relaxed) && !forwarded {
            forwarded = true;
            for r in ranks.iter().filter(|r| r.status.is_none()) {
                signal_group(&r.child, libc::SIGTERM);
            }
        }
        if let Some(at) = failed.map(|f| f.2).or(remote_stop).or(group_broke) {
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
    if let Some(dir) = &heartbeats {
        let _ = std::fs::remove_dir_all(dir);
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
    if args.fault_tolerant && !forwarded {
        // The node's part succeeded if any of its ranks did (node 0's rank 0 decides the job's, at node 0).
        let failed: Vec<String> = ranks
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                r.status
                    .filter(|s| !s.success())
                    .map(|s| format!("rank {} {}", first_rank + i, describe_rank(&hung, i, s)))
            })
            .collect();
        let done = ranks.iter().any(|r| r.status.is_some_and(|s| s.success()))
            && (round.node != 0 || ranks[0].status.is_some_and(|s| s.success()));
        return if done { Ok(()) } else { Err(Failure::of(failed.join("; "))) };
    }
    // A rank here that exited with an error may have seen a peer on another node die: give that node's report a
    // moment to arrive, and name the failure that came first.
    if let (Some(peers), Some((_, status, _))) = (peers, failed) {
        let start = Instant::now();
        while status.signal().is_none() && peers.remote_failure().is_none() && start.elapsed() < GRACE {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let remote = peers.and_then(|l| l.remote_failure());
    if let (None, Some(r)) = (failed, &remote) {
        return Err(Failure::of(format!("{} {}; this node's ranks were stopped", r.rank_name(), r.how)));
    }
    if let Some((local, status, _)) = failed {
        // Ranks by their place in the job; with several nodes, which node's.
        let host = this_host();
        let name = |i: usize| {
            if multi_node {
                format!("rank {} (node {}, host {host})", first_rank + i, round.node)
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
            .map(|(i, r)| format!("{} {}", name(i), describe_rank(&hung, i, r.status.expect("reaped"))))
            .collect();
        let mut msg = format!("{} {}", name(local), describe_rank(&hung, local, status));
        // Another node's rank killed by a signal is the likelier first cause than an error here.
        if let Some(r) =
            remote.filter(|r| remote_stop.is_some() || (status.signal().is_none() && r.how.contains("signal")))
        {
            others.insert(0, msg);
            msg = format!("{} {}", r.rank_name(), r.how);
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

/// Why the rank whose heartbeat file is `path` counts as hung after `timeout` seconds, if it does: its process
/// stopped writing (frozen), or it has been outside every collective that long since its first one (its peers
/// cannot go on without it). Before its first collective (start-up, loading) it is never hung.
fn hung_by_heartbeat(path: &std::path::Path, timeout: f64) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let beat = zerorun_comm::heartbeat::Beat::parse(&text)?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as u64;
    let silent = now.saturating_sub(beat.at_ms) as f64 / 1e3;
    if silent > timeout {
        return Some(format!("its process stopped responding (no heartbeat for {silent:.0} s)"));
    }
    let outside = now.saturating_sub(beat.since_ms) as f64 / 1e3;
    (!beat.waiting && beat.since_ms > 0 && outside > timeout)
        .then(|| format!("outside every collective for {outside:.0} s, while its peers cannot go on without it"))
}
