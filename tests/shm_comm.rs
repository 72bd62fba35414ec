//! The shm backend with real processes under `zerorun launch`: conformance against a local reference at world
//! sizes 1-4, and a rank killed with SIGKILL in the middle of an all-reduce loop.
//!
//! The ranks are this test binary run again in worker mode (ZERORUN_TEST_WORKER names the worker).
use std::process::Command;
use std::time::{Duration, Instant};

use zerorun::runtime::comm::env::communicator_from_env;
use zerorun::runtime::comm::{Collectives, Communicator, Element, ReduceOp};

fn input(rank: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 13 + salt) % 17) as f32 - 8.0 + rank as f32 * 0.25).collect()
}

/// Worker: every op at several sizes (0, 1, non-divisible, larger than a staging slot), checked on every rank.
fn conformance_worker() {
    let c = communicator_from_env(Duration::from_secs(60)).unwrap();
    let (rank, world) = (c.rank(), c.world_size());
    for n in [0usize, 1, 7, 1000, 5_000_003] {
        for (salt, op) in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max].into_iter().enumerate() {
            let mut b = input(rank, n, salt);
            c.all_reduce(&mut b, op).unwrap();
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, n, salt)).collect();
            for i in 0..n {
                let vals = inputs.iter().map(|x| x[i]);
                let e = match op {
                    ReduceOp::Sum => vals.sum::<f32>(),
                    ReduceOp::Avg => vals.sum::<f32>() / world as f32,
                    ReduceOp::Max => vals.fold(f32::NEG_INFINITY, f32::max),
                };
                assert_eq!(b[i], e, "all_reduce {op:?} n {n} at {i}");
            }
        }
        let full = n - n % world;
        let part = full / world;
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, full, 5)).collect();
        let mut shard = vec![0f32; part];
        c.reduce_scatter(&inputs[rank], &mut shard, ReduceOp::Sum).unwrap();
        for i in 0..part {
            let e: f32 = inputs.iter().map(|x| x[rank * part + i]).sum();
            assert_eq!(shard[i], e, "reduce_scatter n {full} at {i}");
        }
        let mut gathered = vec![-1f32; full];
        gathered[rank * part..(rank + 1) * part].copy_from_slice(&inputs[rank][rank * part..(rank + 1) * part]);
        c.all_gather_in_place(&mut gathered).unwrap();
        for k in 0..world {
            assert_eq!(&gathered[k * part..(k + 1) * part], &inputs[k][k * part..(k + 1) * part], "all_gather part {k}");
        }
        let mut b = if rank == world - 1 { input(99, n, 1) } else { vec![0f32; n] };
        c.broadcast(&mut b, world - 1).unwrap();
        assert_eq!(b, input(99, n, 1), "broadcast n {n}");
    }
    check_dtype::<half::bf16>(c.as_ref(), half::bf16::from_f32);
    check_dtype::<half::f16>(c.as_ref(), half::f16::from_f32);
    check_dtype::<i64>(c.as_ref(), |x| (x * 4.0) as i64);
    // A size mismatch is an error on every rank, and the group stays usable.
    let mut b = vec![1f32; 4 + rank];
    let e = c.all_reduce(&mut b, ReduceOp::Sum);
    if world > 1 {
        assert!(e.unwrap_err().to_string().contains("buffer sizes differ between ranks"));
    }
    c.barrier().unwrap();
    println!("conformance ok on rank {rank}");
}

/// All-reduce and reduce-scatter of another element type, over more elements than a staging slot holds.
fn check_dtype<T: Element + PartialEq + std::fmt::Debug>(c: &dyn Communicator, make: fn(f32) -> T) {
    let (rank, world) = (c.rank(), c.world_size());
    let n = 9_000_000 - 9_000_000 % world;
    let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, n, 3).into_iter().map(make).collect()).collect();
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        let fold = |i: usize| {
            let mut acc = inputs[0][i];
            for x in &inputs[1..] {
                acc = if op == ReduceOp::Max { T::max(acc, x[i]) } else { T::add(acc, x[i]) };
            }
            if op == ReduceOp::Avg {
                T::div(acc, world)
            } else {
                acc
            }
        };
        let mut b = inputs[rank].clone();
        c.all_reduce(&mut b, op).unwrap();
        for (i, v) in b.iter().enumerate() {
            assert_eq!(*v, fold(i), "{:?} all_reduce {op:?} at {i}", T::DTYPE);
        }
        let part = n / world;
        let mut shard = vec![make(0.0); part];
        c.reduce_scatter(&inputs[rank], &mut shard, op).unwrap();
        for (i, v) in shard.iter().enumerate() {
            assert_eq!(*v, fold(rank * part + i), "{:?} reduce_scatter {op:?} at {i}", T::DTYPE);
        }
    }
}

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

#[test]
fn worker_entry() {
    match std::env::var("ZERORUN_TEST_WORKER").as_deref() {
        Ok("conformance") => conformance_worker(),
        Ok("loop") => loop_worker(),
        _ => {}
    }
}

fn launch(n: usize, worker: &str, dir: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
    cmd.args(["launch", "--nproc-per-node", &n.to_string(), "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "worker_entry", "--nocapture", "--test-threads", "1"])
        .env("ZERORUN_TEST_WORKER", worker)
        .env("ZERORUN_TEST_DIR", dir);
    cmd
}

fn segments() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with("zerorun-")).collect())
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
        assert!(out.status.success(), "world size {n} (staged {staged}):\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        for r in 0..n {
            assert!(text.contains(&format!("conformance ok on rank {r}")), "world size {n}, rank {r}:\n{text}");
        }
    }
}

#[test]
fn a_killed_rank_stops_the_job_with_its_name_and_leaves_nothing() {
    let dir = std::env::temp_dir().join(format!("zerorun-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let before = segments();
    let start = Instant::now();
    let child = launch(3, "loop", &dir).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    // Wait for every rank to be in the loop, then kill rank 1.
    let pid_of = |r: usize| std::fs::read_to_string(dir.join(format!("pid{r}"))).ok().and_then(|s| s.parse::<i32>().ok());
    while (0..3).any(|r| pid_of(r).is_none()) {
        assert!(start.elapsed() < Duration::from_secs(60), "ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let pids: Vec<i32> = (0..3).map(|r| pid_of(r).unwrap()).collect();
    let killed_at = Instant::now();
    unsafe { libc::kill(pids[1], libc::SIGKILL) };
    let out = child.wait_with_output().unwrap();
    let elapsed = killed_at.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(elapsed < Duration::from_secs(6), "took {elapsed:?}");
    assert!(stderr.contains("error: rank 1 was killed by signal 9 (SIGKILL)"), "{stderr}");
    for r in [0, 2] {
        let want = format!("[rank {r}] error: all_reduce on rank {r} of group");
        let line = stderr.lines().find(|l| l.starts_with(&want)).unwrap_or_else(|| panic!("rank {r} did not report the dead peer:\n{stderr}"));
        assert!(line.contains(&format!("rank 1 (pid {}) died; waited", pids[1])), "{line}");
    }
    for pid in pids {
        assert!(unsafe { libc::kill(pid, 0) } != 0, "process {pid} is still alive");
    }
    let after: Vec<String> = segments().into_iter().filter(|s| !before.contains(s)).collect();
    assert!(after.is_empty(), "left in /dev/shm: {after:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
