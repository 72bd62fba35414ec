//! `zerorun launch --max-restarts`: a rank SIGKILLed mid-run, the job started again from its latest checkpoint
//! (the examples' `--resume`, which starts from step 0 on an empty folder) ends with the uninterrupted run's
//! weights; the ranks see their restart count; a job that keeps failing gives up with every failure listed.
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tch::Tensor;

#[path = "common/examples.rs"]
mod examples;
#[path = "common/processes.rs"]
mod processes;
use processes::children_running;

const STEPS: &str = "24";

/// The MLP example for `steps` steps under `zerorun launch --max-restarts restarts`, saving its final weights as
/// `tag`.
fn mlp_command(dir: &std::path::Path, tag: &str, restarts: &str, steps: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
    cmd.args(["launch", "--nproc-per-node", "2", "--max-restarts", restarts, "--"])
        .arg(examples::example("mlp"))
        .args(["--config", dir.join("c.json").to_str().unwrap(), "--steps", steps, "--seed", "5"])
        .args(["--in", "32", "--hidden", "128", "--layers", "3", "--out", "4"])
        .args(["--save-final", dir.join(format!("{tag}.safetensors")).to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn weights(path: &std::path::Path) -> Vec<(String, Tensor)> {
    let mut w = Tensor::read_safetensors(path).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// Killed after the checkpoint of step 4, then after step 10 in another run (the other rank): each run completes
/// after one restart, with the uninterrupted run's weights within 1e-6, saying where it resumed.
#[test]
fn a_killed_rank_is_restarted_from_the_latest_checkpoint_and_loses_nothing() {
    let dir = std::env::temp_dir().join(format!("zerorun-restarts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("c.json"),
        r#"{"train_batch_size": 8, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "zero_optimization": {"stage": 2}}"#,
    )
    .unwrap();
    let out = mlp_command(&dir, "reference", "0", STEPS).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reference = weights(&dir.join("reference.safetensors"));
    for (round, kill_after) in [(0usize, 4u64), (1, 10)] {
        let ck = dir.join(format!("ck{round}"));
        let tag = format!("restarted{round}");
        let mut cmd = mlp_command(&dir, &tag, "1", STEPS);
        // One command line for the first start and the restart: --resume on an empty folder starts at step 0.
        cmd.args(["--checkpoint-dir", ck.to_str().unwrap(), "--save-every", "2", "--resume"]);
        let child = cmd.spawn().unwrap();
        let start = Instant::now();
        let wanted = format!("global_step{kill_after}");
        loop {
            // One read per poll: a second read could see the checkpoint after the one the loop condition saw.
            let now = std::fs::read_to_string(ck.join("latest")).unwrap_or_default();
            if now == wanted {
                break;
            }
            let reached = now.trim_start_matches("global_step").parse::<u64>().unwrap_or(0);
            assert!(reached < kill_after, "round {round}: the run passed step {kill_after} before the kill ({now})");
            assert!(start.elapsed() < Duration::from_secs(120), "round {round}: no checkpoint of step {kill_after}");
            std::thread::sleep(Duration::from_millis(2));
        }
        let ranks = children_running(child.id() as i32, "examples/mlp");
        assert_eq!(ranks.len(), 2, "round {round}: ranks {ranks:?}");
        unsafe { libc::kill(ranks[round % 2], libc::SIGKILL) };
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "round {round}: {stdout}\n{stderr}");
        let restart = stderr.lines().find(|l| l.contains("restarting (1 of 1) from the latest checkpoint"));
        assert!(restart.is_some_and(|l| l.contains("was killed by signal 9 (SIGKILL)")), "{stderr}");
        assert!(stdout.contains("[rank 0] no checkpoint in"), "the first start: {stdout}");
        // The kill lands at step `kill_after` or a little later: the restart resumes from the latest checkpoint.
        let resumed = stdout.lines().find_map(|l| l.strip_prefix("[rank 0] resumed from step "));
        let resumed = resumed.unwrap_or_else(|| panic!("round {round}: no resume line in {stdout}"));
        let (step, world) = resumed.split_once(" at world size ").unwrap();
        assert!(step.parse::<u64>().unwrap() >= kill_after && world == "2", "round {round}: {resumed}");
        let restarted = weights(&dir.join(format!("{tag}.safetensors")));
        assert_eq!(restarted.len(), reference.len());
        for ((name, a), (_, b)) in reference.iter().zip(&restarted) {
            let d = (a - b).abs().max().double_value(&[]);
            assert!(d <= 1e-6, "round {round}: {name} differs by {d:e} from the uninterrupted run");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every start sees its restart count; when the restarts are used up the launcher exits non-zero listing each
/// start's failure.
#[test]
fn a_job_that_keeps_failing_gives_up_after_its_restarts_listing_every_failure() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["launch", "--nproc-per-node", "2", "--max-restarts", "2", "--"])
        .args([
            "sh",
            "-c",
            "echo count=$ZERORUN_RESTART_COUNT torch=$TORCHELASTIC_RESTART_COUNT; [ $RANK = 1 ] && exit 3; sleep 30",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success());
    for count in 0..3 {
        assert!(stdout.contains(&format!("[rank 1] count={count} torch={count}")), "{stdout}");
    }
    assert!(stderr.contains("gave up after 2 restarts, every start failed:"), "{stderr}");
    for start in 1..=3 {
        assert!(stderr.contains(&format!("start {start}: rank 1 exited with status 3")), "{stderr}");
    }
}

/// A checkpoint damaged on disk (one byte of a rank file) is refused by its checksum, and `--resume` falls back to
/// the one before it: the run ends with the uninterrupted run's weights.
#[test]
fn a_damaged_latest_checkpoint_falls_back_to_the_previous_one() {
    let dir = std::env::temp_dir().join(format!("zerorun-fallback-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("c.json"),
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "zero_optimization": {"stage": 2}}"#,
    )
    .unwrap();
    let out = mlp_command(&dir, "reference", "0", STEPS).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ck = dir.join("ck");
    let saved = |steps: &str, tag: &str| {
        let mut cmd = mlp_command(&dir, tag, "0", steps);
        cmd.args(["--checkpoint-dir", ck.to_str().unwrap(), "--save-every", "4", "--resume"]);
        cmd.output().unwrap()
    };
    let first = saved("12", "part");
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    assert_eq!(std::fs::read_to_string(ck.join("latest")).unwrap(), "global_step12");
    // One byte of rank 1's file of the newest checkpoint flipped.
    let file = std::fs::read_dir(ck.join("global_step12"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().unwrap().to_string_lossy().contains("rank1"))
        .expect("rank 1's file");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let out = saved(STEPS, "resumed");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("checkpoint not loaded") && stderr.contains("checksum mismatch"), "{stderr}");
    assert!(stdout.contains("[rank 0] resumed from step 8 at world size 2"), "{stdout}");
    let (reference, resumed) = (weights(&dir.join("reference.safetensors")), weights(&dir.join("resumed.safetensors")));
    for ((name, a), (_, b)) in reference.iter().zip(&resumed) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= 1e-6, "{name} differs by {d:e} from the uninterrupted run");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The data cursor: 2 epochs of a 48-sample dataset in global batches of 8, the first 5 steps on 4 thread ranks,
/// a checkpoint, the rest on 2 ranks (2 micro-batches each) from it, every rank taking its micro-batches from
/// `engine.sampler(..).next_micro_batches(engine.global_samples())`: every sample is trained on exactly once per
/// epoch, none lost or repeated across the restart at the other world size.
#[test]
fn every_sample_is_consumed_once_per_epoch_across_a_restart_at_another_world_size() {
    use std::sync::Mutex;
    use zerorun::runtime::comm::threads;
    const SAMPLES: usize = 48;
    let dir = std::env::temp_dir().join(format!("zerorun-cursor-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let consumed: Mutex<Vec<(u64, usize)>> = Mutex::new(Vec::new());
    let train = |world: usize, until: u64, resume: bool| {
        let config = zerorun::Config::from_value(serde_json::json!({
            "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1}
        }))
        .unwrap();
        std::thread::scope(|s| {
            for comm in threads::group(world, Duration::from_secs(30)) {
                let (config, consumed, dir) = (config.clone(), &consumed, &dir);
                s.spawn(move || {
                    let data = Tensor::arange(SAMPLES as i64 * 4, (tch::Kind::Float, tch::Device::Cpu))
                        .view([SAMPLES as i64, 4])
                        / 100.0;
                    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
                    let layer = tch::nn::linear(vs.root() / "w", 4, 1, Default::default());
                    let mut engine = zerorun::Engine::new(&vs, config, Box::new(comm), Default::default()).unwrap();
                    if resume {
                        engine.load_checkpoint(dir, None).unwrap();
                    }
                    let sampler = engine.sampler(SAMPLES, 7, true);
                    while engine.global_steps() < until {
                        let (epoch, _) = sampler.position(engine.global_samples());
                        for micro in sampler.next_micro_batches(engine.global_samples()) {
                            consumed.lock().unwrap().extend(micro.iter().map(|&i| (epoch, i)));
                            let index = Tensor::from_slice(&micro.iter().map(|&i| i as i64).collect::<Vec<_>>());
                            let loss = tch::nn::Module::forward(&layer, &data.index_select(0, &index))
                                .pow_tensor_scalar(2)
                                .mean(None);
                            engine.backward(&loss).unwrap();
                            engine.step().unwrap();
                        }
                    }
                    if !resume {
                        engine.save_checkpoint(dir, None).unwrap();
                    }
                });
            }
        });
    };
    train(4, 5, false);
    train(2, 12, true);
    let consumed = consumed.into_inner().unwrap();
    assert_eq!(consumed.len(), 2 * SAMPLES, "12 steps of 8");
    for epoch in 0..2 {
        let mut seen: Vec<usize> = consumed.iter().filter(|(e, _)| *e == epoch).map(|(_, i)| *i).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..SAMPLES).collect::<Vec<_>>(), "epoch {epoch}: every sample once");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rank that hangs (alive, but outside every collective while its peer waits: a 60 s sleep in its first step; or
/// its process stopped with SIGSTOP) is found by its heartbeat within `--heartbeat-timeout`, killed and named, long
/// before `comms_timeout`; with `--max-restarts` the job then goes on as after any failure.
#[test]
fn a_hung_rank_is_found_by_its_heartbeat_and_named() {
    let dir = std::env::temp_dir().join(format!("zerorun-heartbeat-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("c.json"), r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2}}"#).unwrap();
    let launch = |extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
        cmd.args(["launch", "--nproc-per-node", "2", "--heartbeat-timeout", "3", "--"])
            .arg(examples::example("mlp"))
            .args(["--config", dir.join("c.json").to_str().unwrap(), "--steps", "400"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    };
    let started = Instant::now();
    let out = launch(&["--slow-rank", "1", "--slow-ms", "60000"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("error: rank 1 hung: outside every collective for 3 s, while its peers cannot go on without it; the launcher killed it (--heartbeat-timeout)"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());

    let child = launch(&["--slow-rank", "0", "--slow-ms", "20"]).spawn().unwrap();
    let start = Instant::now();
    let ranks = loop {
        let ranks = children_running(child.id() as i32, "examples/mlp");
        if ranks.len() == 2 {
            break ranks;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_secs(2));
    unsafe { libc::kill(ranks[1], libc::SIGSTOP) };
    let stopped_at = Instant::now();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("error: rank 1 hung: its process stopped responding (no heartbeat for 3 s)")
            || err.contains("error: rank 1 hung: its process stopped responding (no heartbeat for 4 s)"),
        "{err}"
    );
    assert!(stopped_at.elapsed() < Duration::from_secs(20), "took {:?}", stopped_at.elapsed());
    std::fs::remove_dir_all(&dir).unwrap();
}
