//! Elastic jobs across hosts: two `zerorun launch --nnodes 1:2` launchers on loopback as two hosts of two ranks.
//! A host lost mid-run (its launcher and ranks SIGKILLed) shrinks the job to the host left, which resumes from the
//! latest checkpoint at world size 2 and ends with the weights of a reference run that trained the same samples in
//! the same order at those world sizes; a host that joins late is taken in at the next restart; a fixed
//! `--nnodes 2` that loses a host says so.
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

const STEPS: &str = "24";
const CONFIG: &str = r#"{"train_batch_size": 8, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "zero_optimization": {"stage": 2}}"#;

/// The MLP example's arguments: seeded data, `steps` steps, final weights into `out`.
fn mlp_args(cmd: &mut Command, dir: &std::path::Path, steps: &str, out: &str) {
    cmd.arg(examples::example("mlp"))
        .args(["--config", dir.join("c.json").to_str().unwrap(), "--steps", steps, "--seed", "5"])
        .args(["--in", "32", "--hidden", "128", "--layers", "3", "--out", "4"])
        .args(["--save-final", dir.join(out).to_str().unwrap()]);
}

/// One host of an elastic job: `zerorun launch --nnodes 1:2 --node-rank node`, checkpointing every 2 steps into
/// `dir/ck` and resuming from it; rank 0 sleeps 60 ms a micro-batch so that the run lasts a few seconds.
fn host(dir: &std::path::Path, node: usize, port: u16) -> Child {
    host_of(dir, "1:2", node, port)
}

/// [`host`] of a job of `nnodes` (N or MIN:MAX).
fn host_of(dir: &std::path::Path, nnodes: &str, node: usize, port: u16) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
    cmd.args(["launch", "--nnodes", nnodes, "--node-rank", &node.to_string(), "--nproc-per-node", "2"]).args([
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port.to_string(),
        "--max-restarts",
        "1",
        "--",
    ]);
    mlp_args(&mut cmd, dir, STEPS, "elastic.safetensors");
    cmd.args(["--checkpoint-dir", dir.join("ck").to_str().unwrap(), "--save-every", "2", "--resume"])
        .args(["--slow-rank", "0", "--slow-ms", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().unwrap()
}

fn latest_step(ck: &std::path::Path) -> u64 {
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap_or_default();
    latest.trim_start_matches("global_step").parse().unwrap_or(0)
}

fn wait_for_step(ck: &std::path::Path, step: u64) {
    let start = Instant::now();
    while latest_step(ck) < step {
        assert!(start.elapsed() < Duration::from_secs(180), "no checkpoint of step {step} in {}", ck.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn weights(path: &std::path::Path) -> Vec<(String, Tensor)> {
    let mut w = Tensor::read_safetensors(path).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// `[rank 0] resumed from step K at world size W` of a launcher's output: (K, W).
fn resumed(stdout: &str) -> (u64, usize) {
    let line = stdout.lines().find_map(|l| l.strip_prefix("[rank 0] resumed from step ")).expect("a resume line");
    let (step, world) = line.split_once(" at world size ").unwrap();
    (step.parse().unwrap(), world.trim().parse().unwrap())
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zerorun-elastic-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("c.json"), CONFIG).unwrap();
    dir
}

/// One launcher on this host running the MLP on `ranks` ranks (the reference runs).
fn single(dir: &std::path::Path, ranks: &str, steps: &str, out: &str, checkpoint: &[&str]) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
    cmd.args(["launch", "--nproc-per-node", ranks, "--"]);
    mlp_args(&mut cmd, dir, steps, out);
    let out = cmd.args(checkpoint).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_lost_host_shrinks_the_job_which_ends_as_the_reference_run_at_the_smaller_size() {
    let dir = temp_dir("shrink");
    let port = free_port();
    let (node0, node1) = (host(&dir, 0, port), host(&dir, 1, port));
    let ck = dir.join("ck");
    wait_for_step(&ck, 4);
    // The host goes: its launcher and its ranks at once.
    let ranks = children_running(node1.id() as i32, "examples/mlp");
    assert_eq!(ranks.len(), 2, "node 1's ranks: {ranks:?}");
    let killed_at = Instant::now();
    for pid in ranks.iter().copied().chain([node1.id() as i32]) {
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let _ = node1.wait_with_output();
    let out = node0.wait_with_output().unwrap();
    let elapsed = killed_at.elapsed();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "node 0: {stdout}\n{stderr}");
    let restart = stderr.lines().find(|l| l.contains("restarting (1 of 1) on 1 node from the latest checkpoint"));
    assert!(
        restart.is_some_and(|l| l.contains(format!("(node 1, host {h}) was lost with its node", h = host_name()).as_str())),
        "{stderr}"
    );
    assert!(stderr.contains("zerorun launch: start 2 on 1 node (2 ranks)"), "{stderr}");
    let (step, world) = resumed(&stdout);
    assert!(step >= 4 && world == 2, "resumed from step {step} at world size {world}");
    eprintln!("from the kill to the end of the run at world size 2: {elapsed:?} (resumed from step {step})");

    // The reference: the same samples in the same order, at 4 ranks up to step K, then at 2 ranks from its
    // checkpoint to the end.
    let reference_ck = dir.join("reference-ck");
    let k = step.to_string();
    let ck_args = ["--checkpoint-dir", reference_ck.to_str().unwrap(), "--save-every", &k];
    single(&dir, "4", &k, "first-part.safetensors", &ck_args);
    single(
        &dir,
        "2",
        STEPS,
        "reference.safetensors",
        &["--checkpoint-dir", reference_ck.to_str().unwrap(), "--resume"],
    );
    let (elastic, reference) = (weights(&dir.join("elastic.safetensors")), weights(&dir.join("reference.safetensors")));
    assert_eq!(elastic.len(), reference.len());
    for ((name, a), (_, b)) in reference.iter().zip(&elastic) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= 1e-5, "{name} differs by {d:e} from the reference run");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_host_that_joins_late_is_taken_in_at_the_next_restart() {
    let dir = temp_dir("grow");
    let port = free_port();
    // Node 0 alone: after MIN (1) node and a few seconds' last call, it starts at world size 2.
    let node0 = host(&dir, 0, port);
    let ck = dir.join("ck");
    wait_for_step(&ck, 2);
    let node1 = host(&dir, 1, port);
    std::thread::sleep(Duration::from_millis(500));
    // A rank of node 0 fails: the restart takes node 1 in.
    let ranks = children_running(node0.id() as i32, "examples/mlp");
    assert_eq!(ranks.len(), 2, "node 0's ranks: {ranks:?}");
    unsafe { libc::kill(ranks[1], libc::SIGKILL) };
    let outs: Vec<_> = [node0, node1].into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let text = |i: usize| {
        format!("{}\n{}", String::from_utf8_lossy(&outs[i].stdout), String::from_utf8_lossy(&outs[i].stderr))
    };
    assert!(outs[0].status.success() && outs[1].status.success(), "node 0:\n{}\nnode 1:\n{}", text(0), text(1));
    assert!(text(0).contains("zerorun launch: start 2 on 2 nodes (4 ranks)"), "{}", text(0));
    let (step, world) = resumed(&String::from_utf8_lossy(&outs[0].stdout));
    assert!(step >= 2 && world == 4, "resumed from step {step} at world size {world}");
    // Node 1's ranks are ranks 2 and 3 of the second start.
    assert!(String::from_utf8_lossy(&outs[1].stdout).contains("[rank 3] "), "{}", text(1));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rank (not its host) that fails in a fixed `--nnodes 2` job: every node's ranks stop, and the next start runs
/// on both nodes again from the latest checkpoint, at the same world size.
#[test]
fn a_failed_rank_restarts_every_node_of_a_fixed_job() {
    let dir = temp_dir("fixed");
    let port = free_port();
    let (node0, node1) = (host_of(&dir, "2", 0, port), host_of(&dir, "2", 1, port));
    wait_for_step(&dir.join("ck"), 4);
    let ranks = children_running(node1.id() as i32, "examples/mlp");
    assert_eq!(ranks.len(), 2, "node 1's ranks: {ranks:?}");
    unsafe { libc::kill(ranks[0], libc::SIGKILL) };
    let outs: Vec<_> = [node0, node1].into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let text = |i: usize| {
        format!("{}\n{}", String::from_utf8_lossy(&outs[i].stdout), String::from_utf8_lossy(&outs[i].stderr))
    };
    assert!(outs[0].status.success() && outs[1].status.success(), "node 0:\n{}\nnode 1:\n{}", text(0), text(1));
    let restart = text(0);
    let line = restart.lines().find(|l| l.contains("restarting (1 of 1) on 2 nodes from the latest checkpoint"));
    assert!(
        line.is_some_and(
            |l| l.contains(format!("(node 1, host {h}) was killed by signal 9 (SIGKILL)", h = host_name()).as_str())
        ),
        "{restart}"
    );
    let (step, world) = resumed(&String::from_utf8_lossy(&outs[0].stdout));
    assert!(step >= 4 && world == 4, "resumed from step {step} at world size {world}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_fixed_job_that_loses_a_host_says_how_many_remain_and_bad_node_counts_are_refused() {
    let port = free_port().to_string();
    let launcher = |node: &str| {
        Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args(["launch", "--nnodes", "2", "--node-rank", node, "--nproc-per-node", "1", "--master-port", &port])
            .args(["--max-restarts", "3", "--", "sleep", "60"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (node0, node1) = (launcher("0"), launcher("1"));
    let start = Instant::now();
    while children_running(node1.id() as i32, "sleep").is_empty() {
        assert!(start.elapsed() < Duration::from_secs(30), "node 1's rank did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    for pid in children_running(node1.id() as i32, "sleep").into_iter().chain([node1.id() as i32]) {
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let out = node0.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("error: 1 node lost: 1 remains, fewer than the 2 --nnodes asks for"), "{err}");
    assert!(
        err.contains(format!("start 1: rank 1 (node 1, host {h}) was lost with its node", h = host_name()).as_str()),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());

    for (nnodes, why) in
        [("3:2", "give N, or MIN:MAX with 1 <= MIN <= MAX"), ("0", "give N, or MIN:MAX"), ("x", "not a number")]
    {
        let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args(["launch", "--nnodes", nnodes, "--nproc-per-node", "1", "--master-port", "1", "--", "true"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "--nnodes {nnodes}: {err}");
    }
}

/// This machine's name, as the launchers name each node's host.
fn host_name() -> String {
    let o = std::process::Command::new("hostname").output().unwrap();
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}
