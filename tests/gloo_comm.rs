//! The gloo backend (libtorch's TCPStore and ProcessGroupGloo) with real processes: the collective, group and
//! point-to-point suites under `zerorun launch --backend gloo` at world sizes 1-4, and the same ranks started by
//! two launchers as two nodes (`--nnodes 2`) on the loopback address.
use std::process::Command;
use std::time::{Duration, Instant};

use zerorun::runtime::comm::{Collectives, ReduceOp};

#[path = "common/conformance.rs"]
mod conformance;
#[path = "common/groups.rs"]
mod groups;
#[path = "common/ports.rs"]
mod ports;
use ports::free_port;

#[test]
#[ignore = "the ranks' entry point, run by the tests below in child processes"]
fn worker_entry() {
    match std::env::var("ZERORUN_TEST_WORKER").as_deref() {
        Ok("gloo") => {
            let c = zerorun::communicator_from_env(Duration::from_secs(120)).unwrap();
            conformance::run(c.as_ref());
            groups::point_to_point(c.as_ref());
            groups::groups(c.as_ref());
            if let Some(layout) = c.host_layout() {
                // A group of whole hosts (an expert-parallel group across them) runs in two levels too.
                let g = c.split(Some(0), c.rank() as i64).unwrap().expect("every rank has a color");
                assert_eq!(g.host_layout(), Some(layout), "a group of whole hosts is two-level");
                conformance::run(g.as_ref());
                println!("whole hosts ok on rank {}", c.rank());
            }
        }
        Ok("exit-or-sleep") => {
            // Rank 0 fails after the rendezvous; rank 1 sleeps outside any collective, so only its launcher,
            // told by node 0's, can stop it.
            let c = zerorun::communicator_from_env(Duration::from_secs(60)).unwrap();
            c.barrier().unwrap();
            if c.rank() == 0 {
                std::process::exit(3);
            }
            std::thread::sleep(Duration::from_secs(60));
        }
        Ok("loop") => {
            // All-reduces until a peer dies; writes its pid where the test finds it.
            let c = zerorun::communicator_from_env(Duration::from_secs(20)).unwrap();
            let dir = std::env::var("ZERORUN_TEST_DIR").unwrap();
            std::fs::write(format!("{dir}/pid{}", c.rank()), std::process::id().to_string()).unwrap();
            let mut b = vec![1f32; 1 << 16];
            loop {
                if let Err(e) = c.all_reduce(&mut b, ReduceOp::Avg) {
                    eprintln!("error: {e}");
                    std::process::exit(2);
                }
            }
        }
        _ => {}
    }
}

fn worker(cmd: &mut Command) -> &mut Command {
    cmd.arg("--")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "worker_entry", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("ZERORUN_TEST_WORKER", "gloo")
}

#[test]
fn gloo_conformance_groups_and_point_to_point_at_world_sizes_1_to_4() {
    for n in 1..=4 {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
        cmd.args(["launch", "--nproc-per-node", &n.to_string(), "--backend", "gloo"]);
        let out = worker(&mut cmd).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "world size {n}:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        for r in 0..n {
            assert!(text.contains(&format!("conformance ok on rank {r}")), "world size {n}, rank {r}:\n{text}");
            assert!(text.contains(&format!("groups ok on rank {r}")), "world size {n}, rank {r}:\n{text}");
        }
    }
}

#[test]
fn two_launchers_as_two_nodes_run_the_suites() {
    let port = free_port().to_string();
    let launchers: Vec<_> = (0..2)
        .map(|node| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
            cmd.args(["launch", "--nnodes", "2", "--node-rank", &node.to_string(), "--nproc-per-node", "2"]).args([
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
            ]);
            worker(&mut cmd).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap()
        })
        .collect();
    for (node, l) in launchers.into_iter().enumerate() {
        let out = l.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "node {node}:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        for r in [2 * node, 2 * node + 1] {
            assert!(text.contains(&format!("[rank {r}] groups ok on rank {r}")), "node {node}, rank {r}:\n{text}");
            assert!(text.contains(&format!("[rank {r}] whole hosts ok on rank {r}")), "node {node}, rank {r}:\n{text}");
        }
    }
}

/// Two `zerorun launch --nnodes 2` launchers of one rank each running the test worker `kind` (with `dir` as its
/// ZERORUN_TEST_DIR), output piped.
fn two_launchers(port: &str, kind: &str, dir: Option<&std::path::Path>) -> Vec<std::process::Child> {
    (0..2)
        .map(|node| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
            cmd.args(["launch", "--nnodes", "2", "--node-rank", &node.to_string(), "--nproc-per-node", "1"]).args([
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ]);
            worker(&mut cmd).env("ZERORUN_TEST_WORKER", kind);
            if let Some(dir) = dir {
                cmd.env("ZERORUN_TEST_DIR", dir);
            }
            cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap()
        })
        .collect()
}

#[test]
fn a_rank_killed_on_one_node_stops_both_launchers_naming_it() {
    let dir = std::env::temp_dir().join(format!("zerorun-gloo-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port().to_string();
    let launchers = two_launchers(&port, "loop", Some(&dir));
    let pid_of =
        |r: usize| std::fs::read_to_string(dir.join(format!("pid{r}"))).ok().and_then(|s| s.parse::<i32>().ok());
    let start = Instant::now();
    while pid_of(0).is_none() || pid_of(1).is_none() {
        assert!(start.elapsed() < Duration::from_secs(60), "ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let killed_at = Instant::now();
    unsafe { libc::kill(pid_of(1).unwrap(), libc::SIGKILL) };
    let outs: Vec<_> = launchers.into_iter().map(|l| l.wait_with_output().unwrap()).collect();
    let elapsed = killed_at.elapsed();
    let err: Vec<String> = outs.iter().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).collect();
    assert!(outs.iter().all(|o| !o.status.success()), "both launchers fail:\n{}\n{}", err[0], err[1]);
    assert!(elapsed < Duration::from_secs(20 + 6), "took {elapsed:?}");
    assert!(
        err[1].contains(
            format!("error: rank 1 (node 1, host {h}) was killed by signal 9 (SIGKILL)", h = host_name()).as_str()
        ),
        "{}",
        err[1]
    );
    // Node 0's rank only saw the connection close; its launcher names the rank that died on node 1 first.
    assert!(
        err[0].contains(
            format!("error: rank 1 (node 1, host {h}) was killed by signal 9 (SIGKILL); then rank 0 (node 0, host {h}) exited with status 2", h = host_name()).as_str()
        ),
        "{}",
        err[0]
    );
    for r in 0..2 {
        assert!(unsafe { libc::kill(pid_of(r).unwrap(), 0) } != 0, "rank {r} is still alive");
    }
    eprintln!("node 0 said:\n{}", err[0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failure_on_one_node_stops_the_ranks_of_the_other() {
    let port = free_port().to_string();
    let start = Instant::now();
    let launchers = two_launchers(&port, "exit-or-sleep", None);
    let outs: Vec<_> = launchers.into_iter().map(|l| l.wait_with_output().unwrap()).collect();
    let err: Vec<String> = outs.iter().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).collect();
    assert!(start.elapsed() < Duration::from_secs(40), "the sleeping rank was not stopped: {:?}", start.elapsed());
    assert!(
        err[0].contains(format!("error: rank 0 (node 0, host {h}) exited with status 3", h = host_name()).as_str()),
        "{}",
        err[0]
    );
    assert!(
        err[1].contains(
            format!("error: rank 0 (node 0, host {h}) exited with status 3; then rank 1 (node 1, host {h}) was killed by signal 15 (SIGTERM)", h = host_name()).as_str()
        ),
        "{}",
        err[1]
    );
}

/// This machine's name, as the launchers name each node's host.
fn host_name() -> String {
    let o = std::process::Command::new("hostname").output().unwrap();
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}
