//! The shm backend with real processes under `zerorun launch`: conformance against a local reference at world
//! sizes 1-4 (heap buffers read through process_vm_readv, shared-region buffers read through the peers' mappings),
//! and a rank killed with SIGKILL in the middle of an all-reduce loop; a unit gather lets go of the peers' pages.
//!
//! The ranks are this test binary run again in worker mode (ZERORUN_TEST_WORKER names the worker).
use std::process::Command;
use std::time::{Duration, Instant};

use zerorun::runtime::comm::env::communicator_from_env;
use zerorun::runtime::comm::{Collectives, ReduceOp};

#[path = "common/conformance.rs"]
mod conformance;
#[path = "common/groups.rs"]
mod groups;

/// Worker: all-reduces for up to a minute; writes its pid where the test can find it.
fn loop_worker() {
    let c = communicator_from_env(Duration::from_secs(120)).unwrap();
    let dir = std::env::var("ZERORUN_TEST_DIR").unwrap();
    std::fs::write(format!("{dir}/pid{}", c.rank()), std::process::id().to_string()).unwrap();
    let mut b = vec![1f32; 1 << 18];
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        if let Err(e) = c.all_reduce(&mut b, ReduceOp::Avg) {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

/// Worker: rank 1 takes part in one all-reduce and ends normally; the others wait in a second one.
fn early_exit_worker() {
    let c = communicator_from_env(Duration::from_secs(60)).unwrap();
    let mut b = vec![1f32; 1024];
    c.all_reduce(&mut b, ReduceOp::Sum).unwrap();
    if c.rank() == 1 {
        return;
    }
    if let Err(e) = c.all_reduce(&mut b, ReduceOp::Sum) {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

/// Worker: all-gathers 16 MiB per rank in the shared region, then lets go of the peers' pages it read: they leave this
/// process's resident set (RssShmem) and the gathered values stay.
fn forget_worker() {
    use zerorun::runtime::comm::region::SharedBuffer;
    let c = communicator_from_env(Duration::from_secs(60)).unwrap();
    let (rank, n) = (c.rank(), c.world_size());
    let part = 4 << 20;
    let mut buf = SharedBuffer::zeroed(n * part * 4);
    assert!(buf.in_region());
    let values = buf.as_slice_mut::<f32>();
    values[rank * part..(rank + 1) * part].fill(rank as f32 + 1.0);
    c.all_gather_in_place(values).unwrap();
    let shmem_kib = || {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("RssShmem:")).unwrap().to_string();
        line.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap()
    };
    let before = shmem_kib();
    c.forget_gathered_pages();
    let after = shmem_kib();
    // The peers' parts were mapped by the reads; all but a page at each edge go.
    let peers_kib = (n - 1) * part * 4 / 1024;
    assert!(
        before - after >= peers_kib - 64,
        "rank {rank}: RssShmem {before} -> {after} KiB, peers' parts {peers_kib} KiB"
    );
    for k in 0..n {
        assert!(values[k * part..(k + 1) * part].iter().all(|&v| v == k as f32 + 1.0), "rank {rank}: part {k}");
    }
    // The peers keep their buffers until everyone has measured.
    c.barrier().unwrap();
    println!("forget ok on rank {rank}: RssShmem {before} -> {after} KiB");
}

/// Worker: rank 0 sends round after round to rank 1 and then to rank 2, which is already waiting for it; every
/// value must arrive in its round, and a lost answer is a hang the short timeout turns into an error.
fn alternating_worker() {
    let c = communicator_from_env(Duration::from_secs(20)).unwrap();
    let rank = c.rank();
    for round in 0..ALTERNATING_ROUNDS {
        let mut v = [round as f32; 4];
        let result = match rank {
            0 => c.send(&v, 1).and_then(|_| c.send(&v, 2)),
            _ => c.recv(&mut v, 0),
        };
        if let Err(e) = result {
            eprintln!("error: rank {rank} in round {round}: {e}");
            std::process::exit(2);
        }
        assert_eq!(v, [round as f32; 4], "rank {rank}, round {round}");
    }
    println!("alternating ok on rank {rank}");
}

const ALTERNATING_ROUNDS: usize = 20_000;

#[test]
#[ignore = "the ranks' entry point, run by the tests below in child processes"]
fn worker_entry() {
    match std::env::var("ZERORUN_TEST_WORKER").as_deref() {
        Ok("conformance") => conformance::run(communicator_from_env(Duration::from_secs(60)).unwrap().as_ref()),
        Ok("groups") => {
            let c = communicator_from_env(Duration::from_secs(60)).unwrap();
            groups::point_to_point(c.as_ref());
            groups::groups(c.as_ref());
        }
        Ok("loop") => loop_worker(),
        Ok("forget") => forget_worker(),
        Ok("early_exit") => early_exit_worker(),
        Ok("alternating") => alternating_worker(),
        _ => {}
    }
}

fn launch(n: usize, worker: &str, dir: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
    cmd.args(["launch", "--nproc-per-node", &n.to_string(), "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "worker_entry", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("ZERORUN_TEST_WORKER", worker)
        .env("ZERORUN_TEST_DIR", dir);
    cmd
}

fn segments() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("zerorun-"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn shm_conformance_at_world_sizes_1_to_4_direct_and_staged() {
    let dir = std::env::temp_dir();
    for (n, staged) in [(1, false), (2, false), (3, false), (4, false), (2, true), (3, true)] {
        let mut cmd = launch(n, "conformance", &dir);
        if staged {
            cmd.env("ZERORUN_SHM_STAGING", "1");
        }
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "world size {n} (staged {staged}):\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for r in 0..n {
            assert!(text.contains(&format!("conformance ok on rank {r}")), "world size {n}, rank {r}:\n{text}");
            // Direct runs map each other's buffer regions (and run the shared-buffer section); staged ones do not.
            let shared = n > 1 && !staged;
            assert!(
                text.contains(&format!("conformance ok on rank {r} (shared buffers {shared})")),
                "world size {n}, rank {r}:\n{text}"
            );
        }
    }
}

#[test]
fn shm_point_to_point_and_groups_direct_and_staged() {
    let dir = std::env::temp_dir();
    let before = segments();
    // Each job's segments are named by its launcher's pid (`zerorun-<pid>-<nanos>`, groups with a suffix); the
    // other tests of this file run jobs at the same time, whose segments come and go meanwhile.
    let mut ours = Vec::new();
    for (n, staged) in [(2, false), (3, false), (4, false), (2, true), (4, true)] {
        let mut cmd = launch(n, "groups", &dir);
        if staged {
            cmd.env("ZERORUN_SHM_STAGING", "1");
        }
        let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
        ours.push(format!("zerorun-{}-", child.id()));
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "world size {n} (staged {staged}):\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for r in 0..n {
            assert!(text.contains(&format!("groups ok on rank {r}")), "world size {n}, rank {r}:\n{text}");
        }
    }
    // Every group's segment is gone too.
    let after: Vec<String> =
        segments().into_iter().filter(|s| !before.contains(s) && ours.iter().any(|o| s.starts_with(o))).collect();
    assert!(after.is_empty(), "left in /dev/shm: {after:?}");
}

#[test]
fn a_unit_gather_lets_go_of_the_peers_pages() {
    for n in [2, 3] {
        let out = launch(n, "forget", &std::env::temp_dir()).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "world size {n}:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        for r in 0..n {
            assert!(text.contains(&format!("forget ok on rank {r}")), "world size {n}, rank {r}:\n{text}");
        }
    }
}

#[test]
fn a_killed_rank_stops_the_job_with_its_name_and_leaves_nothing() {
    let dir = std::env::temp_dir().join(format!("zerorun-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let before = segments();
    let start = Instant::now();
    let child = launch(3, "loop", &dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for every rank to be in the loop, then kill rank 1.
    let pid_of =
        |r: usize| std::fs::read_to_string(dir.join(format!("pid{r}"))).ok().and_then(|s| s.parse::<i32>().ok());
    while (0..3).any(|r| pid_of(r).is_none()) {
        assert!(start.elapsed() < Duration::from_secs(60), "ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let pids: Vec<i32> = (0..3).map(|r| pid_of(r).unwrap()).collect();
    let killed_at = Instant::now();
    unsafe { libc::kill(pids[1], libc::SIGKILL) };
    // This job's segments are named by its launcher's pid (`zerorun-<pid>-<nanos>`, groups with a suffix); the
    // other tests of this file run jobs at the same time, whose segments come and go meanwhile.
    let ours = format!("zerorun-{}-", child.id());
    let out = child.wait_with_output().unwrap();
    let elapsed = killed_at.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(elapsed < Duration::from_secs(6), "took {elapsed:?}");
    assert!(stderr.contains("error: rank 1 was killed by signal 9 (SIGKILL)"), "{stderr}");
    for r in [0, 2] {
        let want = format!("[rank {r}] error: all_reduce on rank {r} of group");
        let line = stderr
            .lines()
            .find(|l| l.starts_with(&want))
            .unwrap_or_else(|| panic!("rank {r} did not report the dead peer:\n{stderr}"));
        assert!(line.contains(&format!("rank 1 (pid {}) died; waited", pids[1])), "{line}");
    }
    for pid in pids {
        assert!(unsafe { libc::kill(pid, 0) } != 0, "process {pid} is still alive");
    }
    let after: Vec<String> = segments().into_iter().filter(|s| !before.contains(s) && s.starts_with(&ours)).collect();
    assert!(after.is_empty(), "left in /dev/shm: {after:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rank_that_ends_normally_is_named_as_exited_not_dead() {
    let out = launch(2, "early_exit", &std::env::temp_dir()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("[rank 0] error: all_reduce on rank 0 of group"))
        .unwrap_or_else(|| panic!("rank 0 did not report its peer:\n{stderr}"));
    assert!(line.contains("rank 1 (pid ") && line.contains(") exited before this collective"), "{line}");
    assert!(!line.contains("died"), "{line}");
}

/// A sender that finishes a transfer to one rank and posts the next to another while that one is looking: the
/// receiver must take the new transfer under its own number (it once took it under the old one, and the sender
/// waited forever for an answer to the new).
#[test]
fn sends_to_one_rank_after_another_are_each_answered() {
    let out = launch(3, "alternating", &std::env::temp_dir()).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for r in 0..3 {
        assert!(text.contains(&format!("alternating ok on rank {r}")), "rank {r}:\n{text}");
    }
}
