//! SIGKILL of a rank while checkpoints are being written, ten times: `latest` always names a complete checkpoint
//! (every file present, every checksum right), and the launcher reports the dead rank.
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
    let cfg = dir.join("c.json");
    std::fs::write(&cfg, r#"{"train_batch_size": 12, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "zero_optimization": {"stage": 2}}"#).unwrap();
    let ck = dir.join("ck");
    let mut completed = 0;
    for round in 0..10u64 {
        let child = Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args(["launch", "--nproc-per-node", "2", "--"])
            .arg(&mlp)
            .args([
                "--config",
                cfg.to_str().unwrap(),
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
