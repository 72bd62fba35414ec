//! Replica groups that survive one another (`fault_tolerance`): the MLP example on four ranks, two shard groups of
//! two (`mics_shard_size` 2). Two `zerorun launch --fault-tolerant` launchers on loopback as two hosts of two
//! ranks: host 1 (its launcher and ranks) is SIGKILLed after step 4 of 12, and host 0's ranks (the same
//! processes) discard the step the loss broke, redo it with the whole global batch split over themselves, and end
//! with the weights of the elastic reference (4 ranks to step 4, then 2 ranks from that checkpoint). Without a
//! failure the run (four rank processes started by hand) equals the plain one.
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tch::Tensor;

#[path = "common/examples.rs"]
mod examples;
#[path = "common/ports.rs"]
mod ports;
use ports::free_port;
#[path = "common/processes.rs"]
mod processes;
use processes::children_running;

const STEPS: &str = "12";

/// The runs of four rank processes take turns: heartbeats of 40 ms on two cores shared by two such jobs could go
/// unanswered long enough to count a live group lost.
static JOBS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_job_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    JOBS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
const BASE: &str = r#""train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "zero_optimization": {"stage": 3, "mics_shard_size": 2}"#;

/// The fault-tolerant config: [`BASE`] with the section, heartbeats every 40 ms (a group silent for 0.2 s is lost).
const FT_CONFIG: &str = r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "zero_optimization": {"stage": 3, "mics_shard_size": 2}, "fault_tolerance": {"enabled": true, "heartbeat_ms": 40, "quorum_timeout": 20}}"#;

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zerorun-ft-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("ft.json"),
        format!(r#"{{{BASE}, "fault_tolerance": {{"enabled": true, "heartbeat_ms": 40, "quorum_timeout": 20}}}}"#),
    )
    .unwrap();
    std::fs::write(dir.join("plain.json"), format!("{{{BASE}}}")).unwrap();
    dir
}

fn mlp(cmd: &mut Command, dir: &std::path::Path, config: &str, steps: &str, out: &str) {
    cmd.arg(examples::example("mlp"));
    mlp_args(cmd, dir, config, steps, out);
}

fn mlp_args(cmd: &mut Command, dir: &std::path::Path, config: &str, steps: &str, out: &str) {
    cmd.args(["--config", dir.join(config).to_str().unwrap(), "--steps", steps, "--seed", "5"])
        .args(["--in", "32", "--hidden", "64", "--layers", "3", "--out", "4"])
        .args(["--save-final", dir.join(out).to_str().unwrap()]);
}

/// Rank `rank` of 4 of the MLP example `exe`, on gloo over loopback, its stdout and stderr piped.
fn rank(exe: &std::path::Path, dir: &std::path::Path, rank: usize, port: u16, slow_ms: u64) -> Child {
    let mut cmd = Command::new(exe);
    cmd.envs([
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", "4".into()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", "4".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("ZERORUN_BACKEND", "gloo".into()),
        ("ZERORUN_RUN_ID", format!("ft-{port}")),
        ("RUST_LOG", "zerorun=info".into()),
    ]);
    mlp_args(&mut cmd, dir, "ft.json", STEPS, "ft.safetensors");
    cmd.args(["--slow-rank", "0", "--slow-ms", &slow_ms.to_string()]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

fn single(dir: &std::path::Path, ranks: &str, steps: &str, out: &str, extra: &[&str]) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
    cmd.args(["launch", "--nproc-per-node", ranks, "--"]);
    mlp(&mut cmd, dir, "plain.json", steps, out);
    let out = cmd.args(extra).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn weights(path: &std::path::Path) -> Vec<(String, Tensor)> {
    let mut w = Tensor::read_safetensors(path).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

fn assert_close(a: &std::path::Path, b: &std::path::Path, tol: f64) {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        let d = (x - y).abs().max().double_value(&[]);
        assert!(d <= tol, "{name} differs by {d:e} from the reference run");
    }
}

/// Node `node` of `nodes` (`zerorun launch --fault-tolerant`, 2 ranks each, gloo across the "hosts" on loopback),
/// rank 0 sleeping `slow_ms` per micro-batch so that the run lasts a few seconds.
fn node(dir: &std::path::Path, config: &str, nodes: usize, node: usize, port: u16, slow_ms: u64) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
    cmd.args(["launch", "--fault-tolerant", "--nnodes", &nodes.to_string(), "--node-rank", &node.to_string()]).args([
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port.to_string(),
        "--",
    ]);
    mlp(&mut cmd, dir, config, STEPS, "ft.safetensors");
    cmd.args(["--slow-rank", "0", "--slow-ms", &slow_ms.to_string(), "--log-samples"]).env("RUST_LOG", "zerorun=info");
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

/// The data cursor's log (`samples step N: P,..` from every rank, after each step it committed): every step from
/// 1 to `steps` trained on each place of its global batch of `batch` exactly once, whichever groups took it.
fn assert_every_sample_once(lines: &[String], steps: u64, batch: usize) {
    let mut seen = vec![vec![0usize; batch]; steps as usize];
    for line in lines {
        let Some(rest) = line.split("samples step ").nth(1) else { continue };
        let (step, places) = rest.split_once(": ").unwrap();
        let step: usize = step.parse().unwrap();
        for p in places.split(',') {
            seen[step - 1][p.parse::<usize>().unwrap()] += 1;
        }
    }
    for (s, counts) in seen.iter().enumerate() {
        assert!(counts.iter().all(|&c| c == 1), "step {}: each place's count {counts:?}", s + 1);
    }
}

/// Every line a launcher's stdout gave so far, with when it came (read by a thread of its own).
#[derive(Clone, Default)]
struct Lines(std::sync::Arc<std::sync::Mutex<Vec<(Instant, String)>>>);

impl Lines {
    fn read(child: &mut Child) -> Lines {
        let lines = Lines::default();
        let (out, sink) = (child.stdout.take().unwrap(), lines.0.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push((Instant::now(), line));
            }
        });
        lines
    }

    /// When the first line containing `text` came, waiting up to 2 minutes for it.
    fn wait_for(&self, text: &str) -> Instant {
        let started = Instant::now();
        loop {
            if let Some((at, _)) = self.0.lock().unwrap().iter().find(|(_, l)| l.contains(text)) {
                return *at;
            }
            assert!(started.elapsed() < Duration::from_secs(120), "no line with {text:?}: {}", self.text());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().iter().map(|(_, l)| l.clone()).collect()
    }

    fn text(&self) -> String {
        self.all().join("\n")
    }
}

/// `nodes` hosts of 2 ranks, one replica group each; host `lost` (its launcher and ranks) SIGKILLed once its
/// ranks have logged step 4's samples. Host 0's stderr, how long from the kill to step 5's line, and every host's
/// stdout lines.
fn lose_a_host(dir: &std::path::Path, config: &str, nodes: usize, lost: usize) -> (String, Duration, Vec<String>) {
    let port = free_port();
    let mut hosts: Vec<Child> = (0..nodes).map(|n| node(dir, config, nodes, n, port, 60)).collect();
    let out: Vec<Lines> = hosts.iter_mut().map(Lines::read).collect();
    out[0].wait_for("[rank 0] step 4 ");
    for r in [2 * lost, 2 * lost + 1] {
        out[lost].wait_for(&format!("[rank {r}] samples step 4:"));
    }
    let survivors = children_running(hosts[0].id() as i32, "examples/mlp");
    let doomed = children_running(hosts[lost].id() as i32, "examples/mlp");
    assert_eq!((survivors.len(), doomed.len()), (2, 2), "{survivors:?} {doomed:?}");
    let killed_at = Instant::now();
    for pid in doomed.iter().copied().chain([hosts[lost].id() as i32]) {
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let next_step_at = out[0].wait_for("[rank 0] step 5 ").duration_since(killed_at);
    out[0].wait_for("[rank 0] step 8 ");
    // The same processes, not restarted ones.
    assert_eq!(children_running(hosts[0].id() as i32, "examples/mlp"), survivors);
    let mut err = String::new();
    for (n, host) in hosts.into_iter().enumerate() {
        let done = host.wait_with_output().unwrap();
        if n == 0 {
            err = String::from_utf8_lossy(&done.stderr).into_owned();
            assert!(done.status.success(), "node 0: {err}\n{}", out[0].text());
        } else if n != lost {
            assert!(done.status.success(), "node {n}: {}", String::from_utf8_lossy(&done.stderr));
        }
    }
    std::thread::sleep(Duration::from_millis(100)); // the readers' last lines
    assert!(out[0].text().contains("] step 12 "), "{}", out[0].text());
    (err, next_step_at, out.iter().flat_map(Lines::all).collect())
}

/// The elastic reference of a run at `before` ranks to step 4 and `after` ranks from there, into `reference`.
fn elastic_reference(dir: &std::path::Path, before: &str, after: &str) {
    let ck = dir.join("reference-ck");
    let ck_args = ["--checkpoint-dir", ck.to_str().unwrap(), "--save-every", "4"];
    single(dir, before, "4", "first.safetensors", &ck_args);
    single(dir, after, STEPS, "reference.safetensors", &["--checkpoint-dir", ck.to_str().unwrap(), "--resume"]);
}

#[test]
fn a_lost_host_leaves_and_the_other_goes_on_to_the_elastic_reference_without_a_restart() {
    let _turn = one_job_at_a_time();
    let dir = temp_dir("lost");
    let (err, next_step_at, every) = lose_a_host(&dir, "ft.json", 2, 1);
    assert_every_sample_once(&every, 12, 8);
    assert!(err.contains("replica group 1 lost at step 5"), "{err}");
    assert!(err.contains("continuing with 1 of 2 replica groups"), "{err}");
    assert!(
        err.contains("node 1 (") && err.contains("was lost (its launcher disconnected); the other nodes go on"),
        "{err}"
    );
    eprintln!("2 hosts, host 1 lost: from the kill to step 5 committed: {next_step_at:?}");
    elastic_reference(&dir, "4", "2");
    assert_close(&dir.join("ft.safetensors"), &dir.join("reference.safetensors"), 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn three_hosts_lose_the_middle_one_and_the_two_left_go_on_to_the_elastic_reference() {
    let _turn = one_job_at_a_time();
    let dir = temp_dir("three");
    // 12 rows a step: 2 ranks of 6 micro-batches, 4 of 3, 6 of 2.
    std::fs::write(
        dir.join("ft3.json"),
        FT_CONFIG.replace(
            r#""train_batch_size": 8, "train_micro_batch_size_per_gpu": 2"#,
            r#""train_batch_size": 12, "train_micro_batch_size_per_gpu": 1"#,
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("plain.json"),
        format!(
            "{{{}}}",
            BASE.replace(
                r#""train_batch_size": 8, "train_micro_batch_size_per_gpu": 2"#,
                r#""train_batch_size": 12, "train_micro_batch_size_per_gpu": 1"#
            )
        ),
    )
    .unwrap();
    let (err, next_step_at, every) = lose_a_host(&dir, "ft3.json", 3, 1);
    assert_every_sample_once(&every, 12, 12);
    assert!(err.contains("replica group 1 lost at step 5"), "{err}");
    assert!(err.contains("continuing with 2 of 3 replica groups"), "{err}");
    eprintln!("3 hosts, host 1 lost: from the kill to step 5 committed: {next_step_at:?}");
    elastic_reference(&dir, "6", "4");
    assert_close(&dir.join("ft.safetensors"), &dir.join("reference.safetensors"), 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn below_min_replicas_the_groups_left_stop_naming_the_key_instead_of_hanging() {
    let _turn = one_job_at_a_time();
    let dir = temp_dir("min");
    std::fs::write(
        dir.join("ft-min.json"),
        FT_CONFIG.replace(r#""quorum_timeout": 20"#, r#""quorum_timeout": 2, "min_replicas": 2"#),
    )
    .unwrap();
    let port = free_port();
    let mut hosts: Vec<Child> = (0..2).map(|n| node(&dir, "ft-min.json", 2, n, port, 60)).collect();
    let mut lines = BufReader::new(hosts[0].stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line.unwrap().contains("] step 3 ") {
            break;
        }
    }
    let doomed = children_running(hosts[1].id() as i32, "examples/mlp");
    for pid in doomed.iter().copied().chain([hosts[1].id() as i32]) {
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let started = Instant::now();
    let out = hosts.remove(0).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("no quorum for step 4") && err.contains("`fault_tolerance.min_replicas` is 2"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30), "stopped after {:?}", started.elapsed());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_restarted_group_heals_from_a_live_one_and_rejoins_with_nothing_lost() {
    let _turn = one_job_at_a_time();
    let dir = temp_dir("heal");
    let port = free_port();
    let start = |n: usize| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
        cmd.args(["launch", "--fault-tolerant", "--max-restarts", "1", "--nnodes", "2", "--node-rank", &n.to_string()])
            .args(["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", &port.to_string(), "--"]);
        mlp(&mut cmd, &dir, "ft.json", "16", "ft.safetensors");
        cmd.args(["--slow-rank", "0", "--slow-ms", "100", "--log-samples"]).env("RUST_LOG", "zerorun=info");
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let (mut node0, mut node1) = (start(0), start(1));
    let (out0, out1) = (Lines::read(&mut node0), Lines::read(&mut node1));
    out0.wait_for("[rank 0] step 4 ");
    out1.wait_for("[rank 2] samples step 4:");
    out1.wait_for("[rank 3] samples step 4:");
    // Host 1's ranks die; its launcher lives and starts them again.
    let doomed = children_running(node1.id() as i32, "examples/mlp");
    assert_eq!(doomed.len(), 2, "node 1's ranks: {doomed:?}");
    for pid in doomed {
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let (done0, done1) = (node0.wait_with_output().unwrap(), node1.wait_with_output().unwrap());
    std::thread::sleep(Duration::from_millis(100)); // the readers' last lines
    let (err0, err1) = (String::from_utf8_lossy(&done0.stderr), String::from_utf8_lossy(&done1.stderr));
    assert!(done0.status.success(), "node 0: {err0}\n{}", out0.text());
    assert!(done1.status.success(), "node 1: {err1}");
    assert!(err1.contains("restarting node 1's ranks (1 of 1) to rejoin the job"), "{err1}");
    assert_every_sample_once(&[out0.all(), out1.all()].concat(), 16, 8);
    assert!(err0.contains("replica group 1 lost at step 5"), "{err0}");
    // The step the restarted group took part in first: the survivors say when it rejoined.
    let rejoined: u64 = err0
        .split("replica group 1 rejoins at step ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|k| k.parse().ok())
        .unwrap_or_else(|| panic!("no rejoin in node 0's log: {err0}"));
    assert!(err0.contains("group 1 healed from group 0 at step"), "{err0}");
    assert!((6..=16).contains(&rejoined), "rejoined at step {rejoined}");
    eprintln!("the restarted group rejoined at step {rejoined}");
    for l in err0.lines().chain(err1.lines()).filter(|l| {
        l.contains("heal")
            || l.contains("rejoin")
            || l.contains("lost")
            || l.contains("restarting")
            || l.contains("continuing")
    }) {
        eprintln!("{l}");
    }

    // The reference: 4 ranks to step 4, 2 ranks to the step before the rejoin, 4 ranks from there.
    let ck = dir.join("reference-ck");
    let ck = ck.to_str().unwrap();
    let last_alone = (rejoined - 1).to_string();
    single(&dir, "4", "4", "first.safetensors", &["--checkpoint-dir", ck, "--save-every", "4"]);
    single(
        &dir,
        "2",
        &last_alone,
        "second.safetensors",
        &["--checkpoint-dir", ck, "--resume", "--save-every", &last_alone],
    );
    single(&dir, "4", "16", "reference.safetensors", &["--checkpoint-dir", ck, "--resume"]);
    assert_close(&dir.join("ft.safetensors"), &dir.join("reference.safetensors"), 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_launcher_refuses_what_would_stop_the_survivors() {
    let refused = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args(["launch", "--fault-tolerant", "--nproc-per-node", "2"])
            .args(extra)
            .args(["--", "true"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(refused(&["--max-restarts", "1"]).contains("--fault-tolerant with --max-restarts restarts a node's ranks"));
}

#[test]
fn with_no_failure_the_fault_tolerant_run_equals_the_plain_one() {
    let _turn = one_job_at_a_time();
    let dir = temp_dir("none");
    let (port, exe) = (free_port(), examples::example("mlp"));
    let ranks: Vec<Child> = (0..4).map(|r| rank(&exe, &dir, r, port, 0)).collect();
    for (r, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "rank {r}: {}", String::from_utf8_lossy(&out.stderr));
    }
    single(&dir, "4", STEPS, "plain.safetensors", &[]);
    assert_close(&dir.join("ft.safetensors"), &dir.join("plain.safetensors"), 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_section_is_refused_by_name_where_it_cannot_work() {
    use zerorun::Config;
    let refused = |json: &str| json.parse::<Config>().unwrap_err().to_string();
    let ft = |extra: &str| {
        format!(
            r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": 3{extra}}}, "fault_tolerance": {{"enabled": true}}}}"#
        )
    };
    // The replica groups are the failure domain: no shard groups, no fault tolerance.
    assert!(refused(&ft("")).contains("`fault_tolerance.enabled`"), "{}", refused(&ft("")));
    assert!(refused(&ft("")).contains("mics_shard_size"));
    let bad = |section: &str| refused(&format!(r#"{{"train_batch_size": 8, "fault_tolerance": {section}}}"#));
    assert!(bad(r#"{"min_replicas": 0}"#).contains("fault_tolerance.min_replicas"));
    assert!(bad(r#"{"quorum_timeout": -1}"#).contains("fault_tolerance.quorum_timeout"));
    // Five missed beats must fit in the quorum's timeout.
    assert!(bad(r#"{"heartbeat_ms": 500, "quorum_timeout": 2}"#).contains("fault_tolerance.heartbeat_ms"));
    assert!(bad(r#"{"lighthouse": "x"}"#).contains("fault_tolerance.lighthouse"));
    let c: Config = ft(r#", "mics_shard_size": 2"#).parse().unwrap();
    assert_eq!((c.fault_tolerance.min_replicas, c.fault_tolerance.heartbeat_ms), (1, 100));
    assert_eq!(c.fault_tolerance.quorum_timeout, 60.0);
}
