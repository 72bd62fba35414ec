//! The MPI backend under `mpirun -np 2/3/4` (as root: --allow-run-as-root; on small machines: --oversubscribe):
//! the same conformance suite as the other backends, and a rank killed in the middle of an all-reduce loop ends the
//! whole job (OpenMPI's runtime aborts it) with no process left. Built with `--features mpi` (make test does).
#![cfg(feature = "mpi")]
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use zerorun::runtime::comm::{Collectives, ReduceOp};

use zerorun::runtime::comm::env::communicator_from_env;

#[path = "common/conformance.rs"]
mod conformance;
#[path = "common/groups.rs"]
mod groups;

#[test]
#[ignore = "the ranks' entry point, run by the tests below under mpirun"]
fn worker_entry() {
    match std::env::var("ZERORUN_TEST_WORKER").as_deref() {
        Ok("mpi-conformance") => {
            let c = communicator_from_env(Duration::from_secs(120)).unwrap();
            conformance::run(c.as_ref());
        }
        Ok("mpi-groups") => {
            let c = communicator_from_env(Duration::from_secs(120)).unwrap();
            groups::point_to_point(c.as_ref());
            groups::groups(c.as_ref());
        }
        Ok("mpi-staleness") => {
            // Bounded staleness needs shared memory or groups that run from threads of their own: MPI has neither.
            let c = communicator_from_env(Duration::from_secs(60)).unwrap();
            let rank = c.rank();
            let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            let _layer = tch::nn::linear(vs.root() / "l", 4, 4, Default::default());
            let config = zerorun::Config::from_json_str(
                r#"{"train_batch_size": 2, "gradient_clipping": 0, "optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 1}, "async_training": {"mode": "bounded_staleness", "staleness": 1}}"#,
            )
            .unwrap();
            let err = zerorun::initialize_with(&vs, config, c, Default::default()).expect_err("refused");
            let text = err.to_string();
            assert!(text.contains("async_training.mode") && text.contains("MPI runs serialized"), "{text}");
            println!("refused ok on rank {rank}");
        }
        Ok("mpi-loop") => {
            let c = communicator_from_env(Duration::from_secs(60)).unwrap();
            let mut buf = vec![1.0f32; 1 << 16];
            c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            println!("looping rank {} pid {}", c.rank(), std::process::id());
            let _ = std::io::stdout().flush();
            loop {
                c.all_reduce(&mut buf, ReduceOp::Avg).unwrap();
            }
        }
        _ => {}
    }
}

fn alive(pid: i32) -> bool {
    // Signal 0 checks existence; a zombie is as good as gone.
    let exists = unsafe { libc::kill(pid, 0) } == 0;
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')));
    exists && !zombie
}

#[test]
fn a_rank_killed_during_all_reduce_ends_the_job_and_leaves_no_process() {
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "ZERORUN_TEST_WORKER"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "worker_entry", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("ZERORUN_TEST_WORKER", "mpi-loop")
        .env_remove("ZERORUN_BACKEND")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("mpirun (make setup installs openmpi-bin)");
    let (tx, rx) = std::sync::mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("looping rank ").nth(1) {
                let mut it = rest.split(" pid ");
                let (r, p) = (
                    it.next().unwrap().trim().parse::<usize>().unwrap(),
                    it.next().unwrap().trim().parse::<i32>().unwrap(),
                );
                let _ = tx.send((r, p));
            }
        }
    });
    let mut pids = [0i32; 2];
    for _ in 0..2 {
        let (r, p) = rx.recv_timeout(Duration::from_secs(60)).expect("both ranks reach the loop");
        pids[r] = p;
    }
    std::thread::sleep(Duration::from_millis(300));
    unsafe { libc::kill(pids[1], libc::SIGKILL) };
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "mpirun still running 30 s after rank 1 was killed");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success(), "the job must fail when a rank dies");
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pids[0]) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!alive(pids[0]), "rank 0 (pid {}) outlived the job", pids[0]);
}

#[test]
fn mpi_conformance_at_world_sizes_2_to_4() {
    for n in 2..=4 {
        let out = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string(), "-x", "ZERORUN_TEST_WORKER"])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "worker_entry", "--ignored", "--nocapture", "--test-threads", "1"])
            .env("ZERORUN_TEST_WORKER", "mpi-conformance")
            .env_remove("ZERORUN_BACKEND")
            .output()
            .expect("mpirun (make setup installs openmpi-bin)");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "mpirun -np {n}:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        for r in 0..n {
            assert!(text.contains(&format!("conformance ok on rank {r}")), "-np {n}, rank {r}:\n{text}");
        }
    }
}

#[test]
fn mpi_point_to_point_and_groups_at_world_sizes_2_to_4() {
    for n in 2..=4 {
        let out = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string(), "-x", "ZERORUN_TEST_WORKER"])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "worker_entry", "--ignored", "--nocapture", "--test-threads", "1"])
            .env("ZERORUN_TEST_WORKER", "mpi-groups")
            .env_remove("ZERORUN_BACKEND")
            .output()
            .expect("mpirun (make setup installs openmpi-bin)");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "mpirun -np {n}:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        for r in 0..n {
            assert!(text.contains(&format!("groups ok on rank {r}")), "-np {n}, rank {r}:\n{text}");
        }
    }
}

#[test]
fn bounded_staleness_over_mpi_is_refused_naming_the_key() {
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "ZERORUN_TEST_WORKER"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "worker_entry", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("ZERORUN_TEST_WORKER", "mpi-staleness")
        .env_remove("ZERORUN_BACKEND")
        .output()
        .expect("mpirun (make setup installs openmpi-bin)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for r in 0..2 {
        assert!(text.contains(&format!("refused ok on rank {r}")), "rank {r}:\n{text}");
    }
}
