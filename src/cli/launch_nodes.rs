//! The launchers of a job of several nodes meet at node 0's launcher (`--master-addr`, `--master-port` + 1), which
//! runs the job as rounds: it waits for the nodes (all N, or for `MIN:MAX` at least MIN and then up to MAX for a
//! few seconds), numbers them in the order of their ids, and tells each its place; every launcher starts its ranks
//! (`launch_ranks.rs`) and reports how they ended. When a rank fails, or a node's launcher disappears (its host
//! lost), every node's ranks are stopped; node 0 then starts the next round, up to `--max-restarts` times, on the
//! nodes still there and those that joined meanwhile, if at least MIN; else every launcher exits naming why.
//!
//! One line per message over plain TCP from std (the launcher links no libtorch; the ranks' own rendezvous, gloo's
//! TCPStore, stays theirs):
//! - a node to node 0: `JOIN <id>` first, then `FAIL <round> <rank> <node> <how>` when one of its ranks failed and
//!   `DONE <round> ok|fail <summary>` when its ranks have all ended;
//! - node 0 to a node: `START <round> <node> <nodes> <port>`, the `FAIL` lines of the others (relayed), and
//!   `EXIT 0` or `EXIT 1 <why>` at the end.
//!
//! Node 0 is the rendezvous: if its host is lost the job ends (as torchrun's c10d rendezvous does).
use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::launch::{gave_up, LaunchArgs};
use super::launch_ranks::{free_port, run_round, this_host, Failure, Peers, RemoteFailure, Round};
use super::CliError;

/// How long the nodes have to find each other at the start.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(600);
/// Once MIN nodes of an elastic job are there, how long node 0 waits for more before the first round.
const LAST_CALL: Duration = Duration::from_secs(3);
/// After its own ranks ended, how long node 0 waits for the other nodes' reports before counting a node lost.
const REPORT_TIMEOUT: Duration = Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn send(stream: &mut TcpStream, line: &str) {
    let _ = stream.write_all(format!("{}\n", line.replace('\n', " ")).as_bytes());
}

fn fail_line(round: usize, f: &RemoteFailure) -> String {
    format!("FAIL {round} {} {} {} {}", f.rank, f.node, f.host, f.how.replace('\n', " "))
}

fn parse_fail(line: &str) -> Option<(usize, RemoteFailure)> {
    let mut it = line.strip_prefix("FAIL ")?.splitn(5, ' ');
    let round = it.next()?.parse().ok()?;
    let rank = it.next()?.parse().ok()?;
    let node = it.next()?.parse().ok()?;
    let host = it.next()?.to_string();
    Some((round, RemoteFailure { rank, node, host, how: it.next()?.to_string() }))
}

/// Runs this node's part of a job of several nodes.
pub fn run_job(args: &LaunchArgs, backend: &str, stop: &Arc<AtomicBool>) -> Result<(), CliError> {
    let port = args.master_port.expect("checked: several nodes give --master-port");
    if args.node_rank == 0 {
        Coordinator::start(args, port)?.run(args, backend, stop)
    } else {
        run_node(args, backend, stop, port)
    }
}

/// A node other than node 0, as node 0 sees it.
struct Member {
    writer: TcpStream,
    /// Its place in the current round.
    index: usize,
    /// How its ranks ended this round (None: not yet said).
    report: Option<Result<(), String>>,
}

#[derive(Default)]
struct Hub {
    round: usize,
    /// The current round's nodes but node 0, by id.
    members: BTreeMap<usize, Member>,
    /// Nodes that joined and wait for the next round.
    waiting: BTreeMap<usize, TcpStream>,
    /// Ids of the nodes lost in the current round.
    lost: Vec<usize>,
    /// The first failure elsewhere in the current round: node 0's ranks are stopped.
    remote: Option<RemoteFailure>,
}

impl Hub {
    /// Sends `line` to every member but `except`.
    fn relay(&mut self, line: &str, except: Option<usize>) {
        for (id, m) in self.members.iter_mut() {
            if Some(*id) != except {
                send(&mut m.writer, line);
            }
        }
    }
}

/// Node 0: the rendezvous and the rounds.
struct Coordinator {
    hub: Arc<Mutex<Hub>>,
    ranks_per_node: usize,
}

impl Coordinator {
    /// Listens for the other nodes' launchers (in the background).
    fn start(args: &LaunchArgs, port: u16) -> Result<Coordinator, CliError> {
        let side = port.checked_add(1).unwrap_or(port);
        let listener = TcpListener::bind(("0.0.0.0", side)).map_err(|e| CliError::Io {
            context: format!("listening for the other launchers on port {side} (--master-port + 1)"),
            source: e,
        })?;
        let hub = Arc::new(Mutex::new(Hub::default()));
        let (ranks_per_node, fault_tolerant) = (args.ranks_per_node(), args.fault_tolerant);
        let accepting = hub.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let hub = accepting.clone();
                std::thread::spawn(move || Coordinator::welcome(hub, stream, ranks_per_node, fault_tolerant));
            }
        });
        Ok(Coordinator { hub, ranks_per_node })
    }

    /// Reads a node's `JOIN`, queues it for the next round, then reads its lines until it goes.
    fn welcome(hub: Arc<Mutex<Hub>>, mut stream: TcpStream, ranks_per_node: usize, fault_tolerant: bool) {
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let Ok(reader) = stream.try_clone() else { return };
        let mut lines = BufReader::new(reader).lines();
        let Some((id, host)) = lines.next().and_then(Result::ok).and_then(|l| {
            let mut words = l.strip_prefix("JOIN ")?.split_whitespace();
            let id: usize = words.next()?.parse().ok()?;
            Some((id, words.next().unwrap_or("unknown").to_string()))
        }) else {
            return;
        };
        let _ = stream.set_read_timeout(None);
        {
            let mut h = lock(&hub);
            if id == 0 || h.members.contains_key(&id) || h.waiting.contains_key(&id) {
                send(&mut stream, &format!("EXIT 1 --node-rank {id} is taken by another node of this job"));
                return;
            }
            let Ok(writer) = stream.try_clone() else { return };
            h.waiting.insert(id, writer);
        }
        for line in lines.map_while(Result::ok) {
            let mut h = lock(&hub);
            if let Some((round, failure)) = parse_fail(&line) {
                if round == h.round && h.members.contains_key(&id) {
                    h.remote.get_or_insert(failure);
                    h.relay(&line, Some(id));
                }
            } else if let Some(rest) = line.strip_prefix("DONE ") {
                let mut it = rest.splitn(3, ' ');
                let round: Option<usize> = it.next().and_then(|r| r.parse().ok());
                let ok = it.next() == Some("ok");
                let summary = it.next().unwrap_or_default().to_string();
                let current = h.round;
                if let (Some(m), Some(true)) = (h.members.get_mut(&id), round.map(|r| r == current)) {
                    m.report = Some(if ok { Ok(()) } else { Err(summary) });
                }
            }
        }
        // The link closed: the node's launcher is gone, and its host with it as far as the job can tell.
        let mut h = lock(&hub);
        h.waiting.remove(&id);
        if let Some(m) = h.members.remove(&id) {
            if m.report.is_none() && fault_tolerant {
                eprintln!(
                    "zerorun launch: node {} ({host}) was lost (its launcher disconnected); the other nodes go on (--fault-tolerant)",
                    m.index
                );
                h.lost.push(id);
            } else if m.report.is_none() {
                let failure = RemoteFailure {
                    rank: m.index * ranks_per_node,
                    node: m.index,
                    how: format!("was lost with its node (the launcher of node {} on {host} disconnected)", m.index),
                    host,
                };
                let line = fail_line(h.round, &failure);
                h.remote.get_or_insert(failure);
                h.lost.push(id);
                h.relay(&line, None);
            }
        }
    }

    /// Waits for the first round's nodes: all of `--nnodes N`, or of MIN:MAX at least MIN, then up to MAX for a
    /// few seconds more.
    fn gather(&self, args: &LaunchArgs, stop: &Arc<AtomicBool>) -> Result<(), CliError> {
        let started = Instant::now();
        let mut enough_since: Option<Instant> = None;
        loop {
            let present = lock(&self.hub).waiting.len() + 1;
            if present >= args.nnodes.max {
                return Ok(());
            }
            if present >= args.nnodes.min {
                if enough_since.get_or_insert_with(Instant::now).elapsed() >= LAST_CALL {
                    return Ok(());
                }
            } else {
                enough_since = None;
            }
            if stop.load(Ordering::Relaxed) {
                return Err(CliError::Usage("stopped by a signal while waiting for the other nodes".into()));
            }
            if started.elapsed() >= RENDEZVOUS_TIMEOUT {
                return Err(CliError::Usage(format!(
                    "only {present} of the {} nodes needed joined within {} s at {}:{} (each node runs `zerorun launch` with the same --master-addr and --master-port)",
                    args.nnodes.min,
                    RENDEZVOUS_TIMEOUT.as_secs(),
                    args.master(),
                    args.master_port.unwrap_or_default() as u32 + 1
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts a round on the members and the waiting nodes; returns the number of nodes.
    fn begin_round(&self, restart: usize, port: u16) -> usize {
        let mut h = lock(&self.hub);
        let waiting = std::mem::take(&mut h.waiting);
        for (id, writer) in waiting {
            h.members.insert(id, Member { writer, index: 0, report: None });
        }
        h.round = restart;
        h.remote = None;
        h.lost.clear();
        let nodes = h.members.len() + 1;
        for (index, m) in h.members.values_mut().enumerate() {
            m.index = index + 1;
            m.report = None;
            send(&mut m.writer, &format!("START {restart} {} {nodes} {port}", m.index));
        }
        nodes
    }

    /// After node 0's ranks ended: every member's report (or its loss), and whether all succeeded.
    fn reports(&self) -> Vec<String> {
        let started = Instant::now();
        loop {
            let mut h = lock(&self.hub);
            let pending: Vec<usize> = h.members.iter().filter(|(_, m)| m.report.is_none()).map(|(id, _)| *id).collect();
            if pending.is_empty() || started.elapsed() >= REPORT_TIMEOUT {
                let mut out = Vec::new();
                for id in pending {
                    let m = h.members.remove(&id).expect("pending is a member");
                    out.push(format!("node {} sent no report within {} s", m.index, REPORT_TIMEOUT.as_secs()));
                    h.lost.push(id);
                }
                for m in h.members.values() {
                    if let Some(Err(summary)) = &m.report {
                        out.push(format!("node {}: {summary}", m.index));
                    }
                }
                return out;
            }
            drop(h);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn exit_all(&self, line: &str) {
        lock(&self.hub).relay(line, None);
    }

    fn run(self, args: &LaunchArgs, backend: &str, stop: &Arc<AtomicBool>) -> Result<(), CliError> {
        self.gather(args, stop)?;
        let mut failures: Vec<String> = Vec::new();
        let mut port = args.master_port.expect("checked");
        for restart in 0..=args.max_restarts {
            let nodes = self.begin_round(restart, port);
            if restart > 0 {
                eprintln!(
                    "zerorun launch: start {} on {nodes} node{} ({} ranks)",
                    restart + 1,
                    if nodes == 1 { "" } else { "s" },
                    nodes * self.ranks_per_node
                );
            }
            let round = Round { restart, node: 0, nodes, port };
            let peers = CoordinatorPeers { hub: &self.hub };
            let own = run_round(args, backend, round, stop, Some(&peers));
            let others = self.reports();
            let message = match (own, others.is_empty()) {
                (Ok(()), false) if args.fault_tolerant => {
                    // The job went on without them: what they said, not a failure of the job.
                    eprintln!("zerorun launch: the job ended without some replica groups: {}", others.join("; "));
                    self.exit_all("EXIT 0");
                    return Ok(());
                }
                (Ok(()), true) => {
                    self.exit_all("EXIT 0");
                    return Ok(());
                }
                (Err(Failure { message, stopped: true }), _) => {
                    self.exit_all("EXIT 1 node 0's launcher was stopped by a signal");
                    return Err(CliError::Usage(message));
                }
                (Err(Failure { message, .. }), _) => message,
                (Ok(()), false) => others.join("; "),
            };
            let lost = lock(&self.hub).lost.len();
            let first_line = message.lines().next().unwrap_or_default().to_string();
            // Fault-tolerant: nodes restart their own ranks; node 0's failing ends the job (it holds the store).
            if args.max_restarts == 0 || args.fault_tolerant {
                self.exit_all(&format!("EXIT 1 {first_line}"));
                return Err(CliError::Usage(message));
            }
            failures.push(format!("start {}: {message}", restart + 1));
            if restart == args.max_restarts {
                break;
            }
            let remaining = {
                let h = lock(&self.hub);
                h.members.len() + h.waiting.len() + 1
            };
            if remaining < args.nnodes.min {
                let why = format!(
                    "{lost} node{} lost: {remaining} remain{}, fewer than the {} --nnodes asks for",
                    if lost == 1 { "" } else { "s" },
                    if remaining == 1 { "s" } else { "" },
                    args.nnodes.min
                );
                self.exit_all(&format!("EXIT 1 {why}"));
                return Err(CliError::Usage(format!("{why}; every start failed:\n{}", failures.join("\n"))));
            }
            eprintln!(
                "zerorun launch: {first_line}; restarting ({} of {}) on {remaining} node{} from the latest checkpoint",
                restart + 1,
                args.max_restarts,
                if remaining == 1 { "" } else { "s" }
            );
            // A fresh port for the ranks' rendezvous: the last round's may linger in TIME_WAIT.
            port = free_port();
        }
        self.exit_all(&format!("EXIT 1 gave up after {} restarts", args.max_restarts));
        Err(gave_up(args.max_restarts, &failures))
    }
}

struct CoordinatorPeers<'a> {
    hub: &'a Arc<Mutex<Hub>>,
}

impl Peers for CoordinatorPeers<'_> {
    fn report(&self, rank: usize, how: &str) {
        let mut h = lock(self.hub);
        let line = fail_line(h.round, &RemoteFailure { rank, node: 0, host: this_host(), how: how.to_string() });
        h.relay(&line, None);
    }

    fn remote_failure(&self) -> Option<RemoteFailure> {
        lock(self.hub).remote.clone()
    }
}

/// What a node's link to node 0 brought.
#[derive(Default)]
struct Inbox {
    /// The round this node's ranks are running (FAIL lines of other rounds are stale).
    round: Option<usize>,
    remote: Option<RemoteFailure>,
    /// START and EXIT lines, in order.
    lines: VecDeque<String>,
    /// Node 0's launcher is gone.
    gone: bool,
}

struct NodePeers<'a> {
    inbox: &'a Arc<Mutex<Inbox>>,
    writer: &'a Mutex<TcpStream>,
    round: usize,
    node: usize,
}

impl Peers for NodePeers<'_> {
    fn report(&self, rank: usize, how: &str) {
        let line =
            fail_line(self.round, &RemoteFailure { rank, node: self.node, host: this_host(), how: how.to_string() });
        send(&mut lock(self.writer), &line);
    }

    fn remote_failure(&self) -> Option<RemoteFailure> {
        lock(self.inbox).remote.clone()
    }
}

/// A node other than node 0: joins, then runs the rounds node 0 starts until it says the job is over.
fn run_node(args: &LaunchArgs, backend: &str, stop: &Arc<AtomicBool>, port: u16) -> Result<(), CliError> {
    let side = port as u32 + 1;
    let address = format!("{}:{side}", args.master());
    let started = Instant::now();
    let stream = loop {
        match TcpStream::connect(&address) {
            Ok(s) => break s,
            Err(e) if started.elapsed() >= RENDEZVOUS_TIMEOUT => {
                return Err(CliError::Io {
                    context: format!("reaching node 0's launcher at {address} (--master-addr, --master-port + 1)"),
                    source: e,
                })
            }
            Err(_) if stop.load(Ordering::Relaxed) => {
                return Err(CliError::Usage("stopped by a signal while waiting for node 0".into()))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    let io =
        |e: std::io::Error| CliError::Io { context: format!("the link to node 0's launcher at {address}"), source: e };
    let writer = Mutex::new(stream.try_clone().map_err(io)?);
    send(&mut lock(&writer), &format!("JOIN {} {}", args.node_rank, this_host()));
    let inbox = Arc::new(Mutex::new(Inbox::default()));
    {
        let inbox = inbox.clone();
        let args_master = args.master().to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let mut b = lock(&inbox);
                match parse_fail(&line) {
                    Some((round, failure)) if Some(round) == b.round => {
                        b.remote.get_or_insert(failure);
                    }
                    Some(_) => {}
                    None => b.lines.push_back(line),
                }
            }
            let mut b = lock(&inbox);
            b.gone = true;
            if b.round.is_some() {
                b.remote.get_or_insert(RemoteFailure {
                    rank: 0,
                    node: 0,
                    host: args_master.clone(),
                    how: "was lost with its node (node 0's launcher, the rendezvous, disconnected)".into(),
                });
            }
        });
    }
    let mut failures: Vec<String> = Vec::new();
    let mut last: Option<String> = None;
    loop {
        let line = loop {
            let mut b = lock(&inbox);
            if let Some(line) = b.lines.pop_front() {
                break line;
            }
            if b.gone {
                let why =
                    format!("node 0's launcher at {address} is gone: the job cannot go on without its rendezvous");
                return Err(CliError::Usage(match &last {
                    Some(message) => format!("{message}\n{why}"),
                    None => why,
                }));
            }
            drop(b);
            if stop.load(Ordering::Relaxed) {
                return Err(CliError::Usage("stopped by a signal between rounds".into()));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if let Some(rest) = line.strip_prefix("START ") {
            let numbers: Vec<usize> = rest.split(' ').filter_map(|w| w.parse().ok()).collect();
            let [restart, node, nodes, port] = numbers[..] else { continue };
            {
                let mut b = lock(&inbox);
                b.round = Some(restart);
                b.remote = None;
            }
            let round = Round { restart, node, nodes, port: port as u16 };
            let peers = NodePeers { inbox: &inbox, writer: &writer, round: restart, node };
            let result = run_round(args, backend, round, stop, Some(&peers));
            lock(&inbox).round = None;
            match result {
                Ok(()) => send(&mut lock(&writer), &format!("DONE {restart} ok")),
                Err(Failure { message, stopped }) => {
                    let first = message.lines().next().unwrap_or_default();
                    send(&mut lock(&writer), &format!("DONE {restart} fail {first}"));
                    if stopped {
                        return Err(CliError::Usage(message));
                    }
                    failures.push(format!("start {}: {message}", restart + 1));
                    last = Some(message);
                }
            }
        } else if let Some(rest) = line.strip_prefix("EXIT ") {
            let (code, why) = rest.split_once(' ').unwrap_or((rest, ""));
            if code == "0" {
                return Ok(());
            }
            return Err(CliError::Usage(match (args.max_restarts, last) {
                // No restarts: this node's own account, as a one-node launch gives it.
                (0, Some(message)) => message,
                (_, None) => format!("node 0 ended the job: {why}"),
                (_, Some(_)) => format!("node 0 ended the job: {why}; this node's starts:\n{}", failures.join("\n")),
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_line_round_trips() {
        let f =
            RemoteFailure { rank: 5, node: 1, host: "gpu-b".into(), how: "was killed by signal 9 (SIGKILL)".into() };
        assert_eq!(parse_fail(&fail_line(3, &f)), Some((3, f)));
        assert_eq!(parse_fail("hello"), None);
    }
}
