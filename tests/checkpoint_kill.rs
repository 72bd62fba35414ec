//! SIGKILL of a rank while checkpoints are being written, ten times, every other round with `checkpoint.async_save`
//! (the files written by a thread while training goes on): `latest` always names a complete checkpoint (every file
//! present, every checksum right), and the launcher reports the dead rank. An asynchronous checkpoint holds what a
//! synchronous one does, byte for byte, and a run resumed from it ends where an uninterrupted one does.
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common/examples.rs"]
mod examples;
#[path = "common/processes.rs"]
mod processes;
use processes::children_running;

fn mlp_example() -> std::path::PathBuf {
    examples::example("mlp")
}

#[test]
fn killing_a_rank_during_saves_never_breaks_latest() {
    let mlp = mlp_example();
    assert!(mlp.exists(), "{} is missing after building it", mlp.display());
    let dir = std::env::temp_dir().join(format!("zerorun-ckpt-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = |async_save: bool| {
        let cfg = dir.join(format!("c{async_save}.json"));
        let text = format!(
            r#"{{"train_batch_size": 12, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.003}}}}, "zero_optimization": {{"stage": 2}}, "checkpoint": {{"async_save": {async_save}}}}}"#
        );
        std::fs::write(&cfg, text).unwrap();
        cfg
    };
    let ck = dir.join("ck");
    let mut completed = 0;
    for round in 0..10u64 {
        let child = Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args(["launch", "--nproc-per-node", "2", "--"])
            .arg(&mlp)
            .args([
                "--config",
                config(round % 2 == 1).to_str().unwrap(),
                "--steps",
                "100000",
                "--in",
                "64",
                "--hidden",
                "256",
                "--layers",
                "4",
                "--out",
                "8",
            ])
            .args(["--checkpoint-dir", ck.to_str().unwrap(), "--save-every", "1"])
            .args(if round > 0 { vec!["--resume"] } else { vec![] })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until this round has saved a new checkpoint, then kill one rank (a direct child of the launcher,
        // after its exec) at a moment that varies from round to round.
        let before = std::fs::read_to_string(ck.join("latest")).ok();
        let start = Instant::now();
        while std::fs::read_to_string(ck.join("latest")).ok() == before {
            assert!(start.elapsed() < Duration::from_secs(60), "round {round}: no checkpoint saved");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(20 + 23 * round));
        let ranks = children_running(child.id() as i32, "examples/mlp");
        assert_eq!(ranks.len(), 2, "round {round}: ranks {ranks:?}");
        unsafe { libc::kill(ranks[(round % 2) as usize], libc::SIGKILL) };
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success(), "round {round}: the launcher must fail");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("was killed by signal 9 (SIGKILL)"),
            "round {round}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // `latest` names a checkpoint that consolidates (all files present, checksums right).
        let out_file = dir.join("full.safetensors");
        let c = Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args(["consolidate", ck.to_str().unwrap(), out_file.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(c.status.success(), "round {round}: latest is broken: {}", String::from_utf8_lossy(&c.stderr));
        completed += 1;
    }
    assert_eq!(completed, 10);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Saved asynchronously at steps 3 and 6 (2 ranks, stage 2): the step-6 checkpoint's rank files are byte for byte a
/// synchronous save's, and 4 more steps from it end at the uninterrupted 10-step run's weights.
#[test]
fn an_asynchronous_checkpoint_is_the_synchronous_one() {
    let mlp = mlp_example();
    let dir = std::env::temp_dir().join(format!("zerorun-ckpt-async-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let run = |async_save: bool, steps: &str, ck: &str, resume: bool, out: &str| {
        let cfg = dir.join(format!("a{async_save}.json"));
        let text = format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.003}}}}, "zero_optimization": {{"stage": 2}}, "checkpoint": {{"async_save": {async_save}}}}}"#
        );
        std::fs::write(&cfg, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args(["launch", "--nproc-per-node", "2", "--"])
            .arg(&mlp)
            .args(["--config", cfg.to_str().unwrap(), "--steps", steps, "--in", "32", "--hidden", "128"])
            .args(["--layers", "3", "--out", "4", "--save-every", "3", "--save-final"])
            .arg(dir.join(out))
            .args(["--checkpoint-dir", dir.join(ck).to_str().unwrap()])
            .args(if resume { vec!["--resume"] } else { vec![] })
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    run(false, "6", "sync", false, "sync6.safetensors");
    run(true, "6", "async", false, "async6.safetensors");
    assert_eq!(std::fs::read_to_string(dir.join("async/latest")).unwrap(), "global_step6");
    for file in ["rank0.safetensors", "rank1.safetensors", "model.safetensors"] {
        let (a, b) = (dir.join("sync/global_step6").join(file), dir.join("async/global_step6").join(file));
        assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), "{file}");
    }
    let leftovers: Vec<_> =
        std::fs::read_dir(dir.join("async/global_step6")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(leftovers.iter().all(|n| !n.to_string_lossy().starts_with('.')), "{leftovers:?}");
    run(false, "10", "whole", false, "whole10.safetensors");
    run(true, "10", "async", true, "resumed10.safetensors");
    let read = |f: &str| {
        let mut w = tch::Tensor::read_safetensors(dir.join(f)).unwrap();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        w
    };
    for ((name, a), (_, b)) in read("whole10.safetensors").iter().zip(&read("resumed10.safetensors")) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= 1e-6, "{name} differs by {d:e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
