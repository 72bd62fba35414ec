//! `zerorun launch --hostfile FILE [--include|--exclude H] [--num_nodes N] [--num_gpus N] -- PROGRAM ARGS...`:
//! DeepSpeed's multi-host launch. One command on the first host reads the hostfile, chooses the hosts and slots,
//! and starts every host's `zerorun launch` over ssh (OpenSSH's client, so ~/.ssh/config holds), each as a node of
//! one job (`launch_nodes.rs`: node 0 the rendezvous, the elastic protocol on top). Every host's lines come back
//! prefixed `[host]` (the ranks' own `[rank R]` after it). The remote launchers stop their ranks when their ssh
//! connection closes (`--until-stdin-closes`), so stopping this command, or losing it, leaves nothing running.
use std::collections::VecDeque;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::launch::{LaunchArgs, NodeCount};
use super::launch_ranks::pump;
use super::CliError;

/// How long ssh may take to reach a host before the host counts as unreachable.
const CONNECT_TIMEOUT_S: u64 = 10;
/// After the job ended (node 0's launcher exited) or was stopped, how long the hosts get to end on their own
/// before their ssh clients are killed (the remote launchers stop their ranks within 5 s).
const WIND_DOWN: Duration = Duration::from_secs(8);
/// How long node 0 gets to end a fixed job itself (naming the rank) after another host's ssh failed.
const NODE0_VERDICT: Duration = Duration::from_secs(3);
/// Lines of each host's output kept for the error.
const TAIL: usize = 20;
/// Variables forwarded to every host, by prefix (and RUST_LOG), as DeepSpeed forwards NCCL_*, PYTHON*, UCX_*.
const FORWARDED_PREFIXES: [&str; 3] = ["ZERORUN_", "NCCL_", "GLOO_"];

/// A host of the job and the slots it gives (slot numbers: GPU indices on a GPU host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSlots {
    pub host: String,
    pub slots: Vec<usize>,
}

/// Reads DeepSpeed's hostfile: `HOST slots=N` per line, `#` comments, blank lines.
pub fn parse_hostfile(path: &Path, text: &str) -> Result<Vec<HostSlots>, String> {
    let mut hosts: Vec<HostSlots> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), i + 1);
        let mut words = line.split_whitespace();
        let host = words.next().expect("not empty");
        let slots = match (words.next().and_then(|w| w.strip_prefix("slots=")), words.next()) {
            (Some(n), None) => n.parse::<usize>().ok().filter(|&n| n > 0),
            _ => None,
        };
        let Some(slots) = slots else {
            return Err(format!("{at}: {line:?} is not `HOST slots=N` (N >= 1)"));
        };
        if hosts.iter().any(|h| h.host == host) {
            return Err(format!("{at}: host {host:?} is listed twice"));
        }
        hosts.push(HostSlots { host: host.to_string(), slots: (0..slots).collect() });
    }
    if hosts.is_empty() {
        return Err(format!("{}: no host in it (lines are `HOST slots=N`)", path.display()));
    }
    Ok(hosts)
}

/// A host an `--include` / `--exclude` names, and its slots (None: all).
type Filter = (String, Option<Vec<usize>>);

/// DeepSpeed's `--include` / `--exclude` syntax: `host1:0,1@host2` (a host alone: all its slots).
fn parse_filter(flag: &str, text: &str, hosts: &[HostSlots]) -> Result<Vec<Filter>, String> {
    let mut out = Vec::new();
    for part in text.split('@').filter(|p| !p.is_empty()) {
        let (host, slots) = match part.split_once(':') {
            Some((h, s)) => {
                let slots = s
                    .split(',')
                    .map(|n| n.trim().parse::<usize>().map_err(|_| format!("{flag} {text:?}: {n:?} is not a slot")))
                    .collect::<Result<Vec<_>, _>>()?;
                (h, Some(slots))
            }
            None => (part, None),
        };
        let Some(known) = hosts.iter().find(|h| h.host == host) else {
            return Err(format!("{flag} {text:?}: host {host:?} is not in the hostfile"));
        };
        if let Some(bad) = slots.iter().flatten().find(|s| !known.slots.contains(s)) {
            return Err(format!("{flag} {text:?}: host {host:?} has no slot {bad} (it has {})", known.slots.len()));
        }
        out.push((host.to_string(), slots));
    }
    Ok(out)
}

/// The hosts and slots the job runs on: the hostfile's, filtered as DeepSpeed's runner does (include or exclude,
/// then the first `num_nodes` hosts, then the first `per_host` slots of each), every host with as many slots.
pub fn choose_hosts(
    mut hosts: Vec<HostSlots>,
    include: Option<&str>,
    exclude: Option<&str>,
    num_nodes: Option<usize>,
    per_host: Option<(&str, usize)>,
) -> Result<Vec<HostSlots>, String> {
    if let Some(text) = include {
        let chosen = parse_filter("--include", text, &hosts)?;
        hosts = chosen
            .into_iter()
            .map(|(host, slots)| {
                let all = &hosts.iter().find(|h| h.host == host).expect("checked").slots;
                HostSlots { slots: slots.unwrap_or_else(|| all.clone()), host }
            })
            .collect();
    }
    if let Some(text) = exclude {
        for (host, slots) in parse_filter("--exclude", text, &hosts)? {
            match slots {
                None => hosts.retain(|h| h.host != host),
                Some(gone) => {
                    let h = hosts.iter_mut().find(|h| h.host == host).expect("checked");
                    h.slots.retain(|s| !gone.contains(s));
                }
            }
        }
        hosts.retain(|h| !h.slots.is_empty());
    }
    if let Some(n) = num_nodes {
        if n == 0 || n > hosts.len() {
            return Err(format!("--num_nodes {n}: the hostfile (as filtered) has {} hosts", hosts.len()));
        }
        hosts.truncate(n);
    }
    if let Some((flag, n)) = per_host {
        if let Some(short) = hosts.iter().find(|h| h.slots.len() < n) {
            return Err(format!(
                "{flag} {n}: more ranks asked than slots: host {:?} has {} slot{}",
                short.host,
                short.slots.len(),
                if short.slots.len() == 1 { "" } else { "s" }
            ));
        }
        if n == 0 {
            return Err(format!("{flag} must be >= 1"));
        }
        for h in &mut hosts {
            h.slots.truncate(n);
        }
    }
    if hosts.is_empty() {
        return Err("no host is left after --include/--exclude".into());
    }
    // Every node of a job runs as many ranks (rank = node x ranks per node + local rank).
    if let Some(other) = hosts.iter().find(|h| h.slots.len() != hosts[0].slots.len()) {
        return Err(format!(
            "host {:?} has {} slots but {:?} has {}: every host runs as many ranks (choose with --num_gpus or --include)",
            hosts[0].host,
            hosts[0].slots.len(),
            other.host,
            other.slots.len()
        ));
    }
    Ok(hosts)
}

/// Quotes a word for the remote shell.
fn quote(word: &str) -> String {
    if !word.is_empty() && word.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&b)) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// What every host's launcher gets in its environment: the forwarded variables of this one, then the lines of
/// DeepSpeed's `.deepspeed_env` files (home, then the working directory; DS_ENV_FILE names another file).
fn forwarded_env() -> Result<Vec<(String, String)>, String> {
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k == "RUST_LOG" || FORWARDED_PREFIXES.iter().any(|p| k.starts_with(p)))
        .collect();
    let name = std::env::var("DS_ENV_FILE").unwrap_or_else(|_| ".deepspeed_env".into());
    let home = std::env::var_os("HOME").map(std::path::PathBuf::from);
    for dir in home.into_iter().chain([std::path::PathBuf::from(".")]) {
        let path = dir.join(&name);
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((k, v)) = line.split_once('=') else {
                return Err(format!("{}:{}: {line:?} is not KEY=VALUE", path.display(), i + 1));
            };
            env.retain(|(key, _)| key != k.trim());
            env.push((k.trim().to_string(), v.to_string()));
        }
    }
    Ok(env)
}

/// The ssh command that runs `remote` on `host`.
fn ssh(host: &str, port: Option<u16>, remote: &str) -> Command {
    let mut cmd = Command::new("ssh");
    if let Some(p) = port {
        cmd.args(["-p", &p.to_string()]);
    }
    // Extra options, as DeepSpeed's PDSH_SSH_ARGS_APPEND: e.g. `-F cluster_ssh_config`.
    if let Ok(extra) = std::env::var("ZERORUN_SSH_OPTIONS") {
        cmd.args(extra.split_whitespace());
    }
    cmd.args(["-o", "BatchMode=yes", "-o", &format!("ConnectTimeout={CONNECT_TIMEOUT_S}")]);
    cmd.arg(host).arg(remote);
    cmd
}

/// The first address `host` gives for itself (`hostname -I`, as DeepSpeed's runner asks it): where the other
/// hosts reach node 0.
fn address_of(host: &str, port: Option<u16>) -> Result<String, CliError> {
    let out = ssh(host, port, "hostname -I")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| CliError::Io { context: "running ssh (OpenSSH's client, from PATH)".into(), source: e })?;
    let text = String::from_utf8_lossy(&out.stdout);
    match (out.status.success(), text.split_whitespace().next()) {
        (true, Some(addr)) => Ok(addr.to_string()),
        _ => Err(CliError::Usage(format!(
            "host {host:?} is unreachable over ssh (within {CONNECT_TIMEOUT_S} s): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
    }
}

/// One host's ssh client and what came back from it.
struct Remote {
    host: String,
    child: Child,
    /// Held open: the remote launcher stops its ranks when it closes.
    stdin: Option<ChildStdin>,
    tail: Arc<Mutex<VecDeque<String>>>,
    status: Option<ExitStatus>,
}

/// The launcher's own error in a host's last lines (from its `error: ` line on), else its last lines.
fn error_of(r: &Remote) -> String {
    let tail = r.tail.lock().unwrap_or_else(|p| p.into_inner());
    let lines: Vec<&String> = tail.iter().collect();
    match lines.iter().rposition(|l| l.starts_with("error: ")) {
        Some(i) => {
            let mut text = lines[i..].iter().map(|l| l.as_str()).collect::<Vec<_>>().join("\n");
            text.replace_range(..7, "");
            text
        }
        None => lines.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n"),
    }
}

/// Where every host's launcher meets node 0's, and how many nodes the job takes.
struct Node0 {
    addr: String,
    port: u16,
    nnodes: NodeCount,
}

/// The shell command that runs host `node`'s launcher: in this working directory, with the forwarded environment,
/// as node `node` of the job, holding its ssh connection as its lifeline.
fn remote_command(
    args: &LaunchArgs,
    node0: &Node0,
    node: usize,
    h: &HostSlots,
    env: &[(String, String)],
    exe: &Path,
    cwd: &Path,
) -> String {
    let mut words: Vec<String> = vec!["cd".into(), quote(&cwd.to_string_lossy()), "&&".into(), "exec".into()];
    words.push("env".into());
    words.extend(env.iter().map(|(k, v)| quote(&format!("{k}={v}"))));
    // Slots other than the first N: the GPUs this host's ranks use, as DeepSpeed sets them.
    if h.slots.iter().enumerate().any(|(i, &s)| i != s) {
        let list: Vec<String> = h.slots.iter().map(|s| s.to_string()).collect();
        words.push(quote(&format!("CUDA_VISIBLE_DEVICES={}", list.join(","))));
    }
    words.push(quote(&exe.to_string_lossy()));
    let NodeCount { min, max } = node0.nnodes;
    let nnodes = if min == max { max.to_string() } else { format!("{min}:{max}") };
    words.extend(["launch".into(), "--until-stdin-closes".into()]);
    for (flag, value) in [
        ("--nproc-per-node", h.slots.len().to_string()),
        ("--nnodes", nnodes),
        ("--node-rank", node.to_string()),
        ("--master-addr", node0.addr.clone()),
        ("--master-port", node0.port.to_string()),
        ("--max-restarts", args.max_restarts.to_string()),
        ("--heartbeat-timeout", args.heartbeat_timeout.to_string()),
    ] {
        words.extend([flag.to_string(), quote(&value)]);
    }
    if let Some(b) = &args.backend {
        words.extend(["--backend".into(), quote(b)]);
    }
    if let Some(d) = &args.memory_report {
        let d = if d.is_absolute() { d.clone() } else { cwd.join(d) };
        words.extend(["--memory-report".into(), quote(&d.to_string_lossy())]);
    }
    words.push("--".into());
    words.extend(args.command.iter().map(|w| quote(w)));
    words.join(" ")
}

/// Runs the job on the hostfile's hosts.
pub fn run(args: LaunchArgs, hostfile: &Path) -> Result<(), CliError> {
    let text = std::fs::read_to_string(hostfile)
        .map_err(|e| CliError::Io { context: format!("reading the hostfile {}", hostfile.display()), source: e })?;
    let per_host = match (args.nproc_per_node, args.num_gpus) {
        (Some(a), Some(b)) if a != b => {
            return Err(CliError::Usage(format!("--nproc-per-node {a} and --num_gpus {b}: give one")));
        }
        (Some(n), _) => Some(("--nproc-per-node", n)),
        (None, Some(n)) => Some(("--num_gpus", n)),
        (None, None) => None,
    };
    let hosts = parse_hostfile(hostfile, &text)
        .and_then(|h| choose_hosts(h, args.include.as_deref(), args.exclude.as_deref(), args.num_nodes, per_host))
        .map_err(CliError::Usage)?;
    let nodes = hosts.len();
    // A fixed job on the hostfile's hosts, or `--nnodes MIN:MAX` with MAX the hosts: elastic on top.
    let nnodes = match args.nnodes {
        NodeCount { min: 1, max: 1 } => NodeCount { min: nodes, max: nodes },
        NodeCount { min, max } if max == nodes && min < max => NodeCount { min, max },
        NodeCount { min, max } => {
            return Err(CliError::Usage(format!(
                "--nnodes {min}:{max} with --hostfile: the hostfile gives {nodes} hosts (use --nnodes MIN:{nodes} for an elastic job, --num_nodes to take fewer hosts)"
            )))
        }
    };
    if args.node_rank != 0 {
        return Err(CliError::Usage("--node-rank: with --hostfile each host's place is its line in the file".into()));
    }
    let master_addr = match &args.master_addr {
        Some(a) => a.clone(),
        None => address_of(&hosts[0].host, args.ssh_port)?,
    };
    let master_port = args.master_port.unwrap_or(29500);
    let env = forwarded_env().map_err(CliError::Usage)?;
    let exe =
        std::env::current_exe().map_err(|e| CliError::Io { context: "finding zerorun itself".into(), source: e })?;
    let cwd =
        std::env::current_dir().map_err(|e| CliError::Io { context: "the working directory".into(), source: e })?;
    let stop = super::launch::stop_flag()?;

    let node0 = Node0 { addr: master_addr.clone(), port: master_port, nnodes };
    let mut remotes: Vec<Remote> = Vec::with_capacity(nodes);
    for (node, h) in hosts.iter().enumerate() {
        let remote = remote_command(&args, &node0, node, h, &env, &exe, &cwd);
        let mut cmd = ssh(&h.host, args.ssh_port, &remote);
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                teardown(&mut remotes);
                return Err(CliError::Io { context: "running ssh (OpenSSH's client, from PATH)".into(), source: e });
            }
        };
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let prefix = format!("[{}]", h.host);
        pump(prefix.clone(), child.stdout.take().expect("piped"), false, tail.clone(), TAIL);
        pump(prefix, child.stderr.take().expect("piped"), true, tail.clone(), TAIL);
        let stdin = child.stdin.take();
        remotes.push(Remote { host: h.host.clone(), child, stdin, tail, status: None });
    }
    tracing::info!(hosts = nodes, master = %master_addr, port = master_port, "started every host's launcher over ssh");
    watch(remotes, nnodes.min < nnodes.max, &stop)
}

/// Waits for the job: node 0's launcher ends it (it reports every node's failures); a host whose ssh fails
/// (unreachable, or lost) ends a fixed job at once; a stop (Ctrl-C) stops every host.
fn watch(mut remotes: Vec<Remote>, elastic: bool, stop: &Arc<std::sync::atomic::AtomicBool>) -> Result<(), CliError> {
    let mut lost_since: Option<Instant> = None;
    let result = loop {
        for r in remotes.iter_mut().filter(|r| r.status.is_none()) {
            if let Ok(Some(s)) = r.child.try_wait() {
                r.status = Some(s);
            }
        }
        if stop.load(Ordering::Relaxed) {
            break Err(CliError::Usage("stopped by a signal; every host's ranks were asked to stop".into()));
        }
        if let Some(s) = remotes[0].status {
            std::thread::sleep(Duration::from_millis(100)); // the pumps' last lines
            break if s.success() {
                Ok(())
            } else {
                Err(CliError::Usage(format!(
                    "the job failed (node 0, host {}, ended it): {}",
                    remotes[0].host,
                    error_of(&remotes[0])
                )))
            };
        }
        // Another host's launcher ended first, badly: ssh's own failure (255, also how ssh reports a remote
        // launcher killed by a signal: the host unreachable, or lost), or the launcher could not start there.
        // Node 0 notices a lost node at once and names it with its rank; a host that never joined leaves node 0
        // waiting, so after a moment a fixed job ends here, naming the host.
        if let Some(r) = remotes.iter().skip(1).find(|r| r.status.is_some_and(|s| !s.success())) {
            let since = *lost_since.get_or_insert_with(Instant::now);
            if !elastic && since.elapsed() >= NODE0_VERDICT {
                let status = r.status.expect("ended");
                let why = if status.code() == Some(255) {
                    format!("host {} failed over ssh (unreachable, or its connection lost)", r.host)
                } else {
                    format!("host {}'s launcher {} before the job ended", r.host, super::launch_ranks::describe(status))
                };
                break Err(CliError::Usage(format!("{why}: {}", error_of(r))));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    teardown(&mut remotes);
    result
}

/// Closes every host's lifeline (its launcher stops its ranks), waits for the ssh clients to end, and kills those
/// that do not within the wind-down.
fn teardown(remotes: &mut [Remote]) {
    for r in remotes.iter_mut() {
        r.stdin.take();
    }
    let start = Instant::now();
    while start.elapsed() < WIND_DOWN {
        if remotes.iter_mut().all(|r| r.status.is_some() || matches!(r.child.try_wait(), Ok(Some(_)))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for r in remotes.iter_mut() {
        if !matches!(r.child.try_wait(), Ok(Some(_))) {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(text: &str) -> Result<Vec<HostSlots>, String> {
        parse_hostfile(Path::new("hosts"), text)
    }

    fn slots(h: &[HostSlots]) -> Vec<(String, Vec<usize>)> {
        h.iter().map(|h| (h.host.clone(), h.slots.clone())).collect()
    }

    #[test]
    fn hostfiles_read_as_deepspeed_writes_them() {
        let h = hosts("# two hosts\nworker-1 slots=4\n\n  worker-2   slots=4 # the second\n").unwrap();
        assert_eq!(slots(&h), [("worker-1".into(), vec![0, 1, 2, 3]), ("worker-2".into(), vec![0, 1, 2, 3])]);
        assert_eq!(
            hosts("a slots=2\nb slots=x\n").unwrap_err(),
            "hosts:2: \"b slots=x\" is not `HOST slots=N` (N >= 1)"
        );
        assert_eq!(hosts("a slots=2\nb\n").unwrap_err(), "hosts:2: \"b\" is not `HOST slots=N` (N >= 1)");
        assert_eq!(hosts("a slots=2\na slots=2\n").unwrap_err(), "hosts:2: host \"a\" is listed twice");
        assert_eq!(hosts("# nothing\n").unwrap_err(), "hosts: no host in it (lines are `HOST slots=N`)");
    }

    #[test]
    fn include_exclude_and_counts_choose_as_deepspeed_does() {
        let all = hosts("a slots=4\nb slots=4\nc slots=4\n").unwrap();
        let pick = |i, e, n, g| choose_hosts(all.clone(), i, e, n, g);
        assert_eq!(
            slots(&pick(Some("a:0,1@c:2,3"), None, None, None).unwrap()),
            [("a".into(), vec![0, 1]), ("c".into(), vec![2, 3])]
        );
        assert_eq!(
            slots(&pick(None, Some("b"), None, None).unwrap()),
            [("a".into(), vec![0, 1, 2, 3]), ("c".into(), vec![0, 1, 2, 3])]
        );
        assert_eq!(
            slots(&pick(None, None, Some(2), Some(("--num_gpus", 2))).unwrap()),
            [("a".into(), vec![0, 1]), ("b".into(), vec![0, 1])]
        );
        assert_eq!(
            pick(None, None, None, Some(("--nproc-per-node", 5))).unwrap_err(),
            "--nproc-per-node 5: more ranks asked than slots: host \"a\" has 4 slots"
        );
        assert_eq!(
            pick(Some("d"), None, None, None).unwrap_err(),
            "--include \"d\": host \"d\" is not in the hostfile"
        );
        assert_eq!(
            pick(None, Some("a:7"), None, None).unwrap_err(),
            "--exclude \"a:7\": host \"a\" has no slot 7 (it has 4)"
        );
        assert!(pick(None, Some("a:0"), None, None).unwrap_err().contains("every host runs as many ranks"));
        assert_eq!(
            pick(None, None, Some(4), None).unwrap_err(),
            "--num_nodes 4: the hostfile (as filtered) has 3 hosts"
        );
    }

    #[test]
    fn each_host_gets_its_place_its_slots_and_the_environment() {
        use clap::Parser;
        #[derive(Parser)]
        struct Launch {
            #[command(flatten)]
            args: LaunchArgs,
        }
        let argv = ["launch", "--hostfile", "h", "--max-restarts", "1", "--memory-report", "rep", "--", "./t", "a b"];
        let args = Launch::try_parse_from(argv).unwrap().args;
        let node0 = Node0 { addr: "10.0.0.1".into(), port: 29500, nnodes: NodeCount { min: 1, max: 2 } };
        let host = HostSlots { host: "gpu-b".into(), slots: vec![2, 3] };
        let env = [("ZERORUN_X".to_string(), "it's".to_string())];
        let cmd = remote_command(&args, &node0, 1, &host, &env, Path::new("/opt/zerorun"), Path::new("/work dir"));
        assert_eq!(
            cmd,
            "cd '/work dir' && exec env 'ZERORUN_X=it'\\''s' CUDA_VISIBLE_DEVICES=2,3 /opt/zerorun launch \
             --until-stdin-closes --nproc-per-node 2 --nnodes 1:2 --node-rank 1 --master-addr 10.0.0.1 \
             --master-port 29500 --max-restarts 1 --heartbeat-timeout 1800 --memory-report '/work dir/rep' -- ./t 'a b'"
        );
    }

    #[test]
    fn remote_words_are_quoted_for_the_shell() {
        assert_eq!(quote("--steps"), "--steps");
        assert_eq!(quote("/a b/it's"), r"'/a b/it'\''s'");
        assert_eq!(quote(""), "''");
    }
}
