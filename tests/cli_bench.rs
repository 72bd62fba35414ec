//! `zerorun bench adam|comm|async --json`: one object per case with the documented keys. Shape only:
//! performance is judged from the benchmark's numbers, never by a test.
use std::process::Command;

#[path = "common/examples.rs"]
mod examples;

#[test]
fn bench_adam_json_lines_have_the_documented_keys() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["bench", "adam", "--params", "65536", "--repeats", "1", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    for (row, grads) in rows.iter().zip(["f32", "bf16"]) {
        assert_eq!(row["params"], 65536);
        assert_eq!(row["grads"], grads);
        for key in [
            "zerorun_params_per_s",
            "torch_params_per_s",
            "torch_fused_params_per_s",
            "torch_cpp_params_per_s",
            "limit_params_per_s",
        ] {
            assert!(row[key].as_f64().is_some_and(|v| v > 0.0), "{key} in {row}");
        }
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_zerorun")).args(["bench", "adam", "--params", "0"]).output().unwrap();
    assert!(!bad.status.success());
    assert_eq!(String::from_utf8_lossy(&bad.stderr).trim(), "error: --params must be >= 1");
}

#[test]
fn bench_comm_json_lines_cover_every_op_and_memcpy() {
    for (backend, dtype) in [("shm", "f32"), ("threads", "f32"), ("shm", "bf16")] {
        let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args([
                "bench",
                "comm",
                "--backend",
                backend,
                "--dtype",
                dtype,
                "--max-bytes",
                "65536",
                "--repeats",
                "1",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{backend}: {}", String::from_utf8_lossy(&out.stderr));
        let rows: Vec<serde_json::Value> =
            String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        for op in ["all_reduce", "reduce_scatter", "all_gather"] {
            let sizes: Vec<u64> = rows.iter().filter(|r| r["op"] == op).map(|r| r["bytes"].as_u64().unwrap()).collect();
            assert_eq!(sizes, vec![4096, 16384, 65536], "{backend} {op}");
            assert!(rows
                .iter()
                .filter(|r| r["op"] == op)
                .all(|r| r["ranks"] == 2 && r["dtype"] == dtype && r["busbw_gbps"].as_f64().unwrap() > 0.0));
        }
        assert!(rows.last().unwrap()["memcpy_gbps"].as_f64().unwrap() > 0.0);
        assert!(
            rows.iter().any(|r| r["memcpy_all_ranks_gbps"].as_f64().is_some_and(|g| g > 0.0) && r["ranks"] == 2),
            "{backend}: no all-ranks memcpy line"
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun")).args(["bench", "comm", "--dtype", "f64"]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--dtype \"f64\": choose f32, bf16 or f16"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bench_async_json_lines_have_the_documented_keys() {
    // The benchmark runs the MLP example from beside the zerorun binary (target/<profile>/examples).
    examples::example("mlp");
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["bench", "async", "--ranks", "2", "--steps", "4", "--slow-factor", "1,2", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    // 4 modes with no slow rank, then with a fixed and a rotating one.
    assert_eq!(rows.len(), 12);
    let modes: Vec<&str> = rows.iter().take(4).map(|r| r["mode"].as_str().unwrap()).collect();
    assert_eq!(modes, ["off", "bounded_staleness", "local_sgd", "diloco"]);
    for row in &rows {
        assert_eq!((&row["ranks"], &row["backend"]), (&serde_json::json!(2), &serde_json::json!("shm")));
        for key in ["samples_per_s", "loss", "slow_factor", "vs_no_slow", "vs_sync"] {
            assert!(row[key].as_f64().is_some_and(|v| v > 0.0 && v.is_finite()), "{key} in {row}");
        }
    }
    let slows: Vec<&str> = rows.iter().map(|r| r["slow"].as_str().unwrap()).step_by(4).collect();
    assert_eq!(slows, ["none", "fixed", "rotating"]);
    // The synchronous run's model does not depend on the straggler: the same loss with and without one.
    assert_eq!(rows[0]["loss"], rows[4]["loss"]);
    // Over gloo (messages only, as across hosts) every mode runs, bounded staleness through its relay.
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["bench", "async", "--ranks", "2", "--steps", "4", "--slow-factor", "1", "--json", "--backend", "gloo"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 4);
    assert!(rows.iter().all(|r| r["backend"] == "gloo" && r["samples_per_s"].as_f64().is_some_and(|v| v > 0.0)));
    let bad = Command::new(env!("CARGO_BIN_EXE_zerorun")).args(["bench", "async", "--ranks", "1"]).output().unwrap();
    assert!(!bad.status.success());
    assert_eq!(
        String::from_utf8_lossy(&bad.stderr).trim(),
        "error: bench async: --ranks at least 2, --slow-factor at least 1, --steps at least 1"
    );
}

/// `bench cluster` on two simulated hosts (network namespaces, 1 Gbit/s links): the MLP at stage 2 sends, per rank
/// and step, what the bandwidth-optimal reduce-scatter and all-gather move. One rank per host: half the gradient
/// buffer each ((N-1)/N at N = 2), so 4 bytes x P across the link (the second host; the first adds the start's
/// broadcast of the weights); gloo's own reduce-scatter, an all-reduce, sent 1.5 x that. Two ranks per host, flat:
/// each rank sends 2 of its 4 parts to the other host in each collective, 4P again. Two ranks per host in two
/// levels: each rank carries half its host's cross-host parts, 2P, and nothing goes over loopback (shm inside the
/// host). Shard groups of a host (`mics_shard_size` 2): the reduced half of each rank's buckets is all-reduced with
/// its replica on the other host, 2P again, and the parameters' all-gather stays inside the host. The namespaces are
/// gone afterwards. Needs root, as CI and `make test` run.
#[test]
fn bench_cluster_counts_the_bytes_that_cross_hosts_and_removes_its_namespaces() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["bench", "cluster", "--hosts", "1", "--", "true"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--hosts at least 2"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if unsafe { libc::geteuid() } != 0 {
        let out =
            Command::new(env!("CARGO_BIN_EXE_zerorun")).args(["bench", "cluster", "--", "true"]).output().unwrap();
        assert!(String::from_utf8_lossy(&out.stderr).contains("needs root (CAP_NET_ADMIN)"));
        return;
    }
    let dir = std::env::temp_dir().join(format!("zerorun-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("c.json"), r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2}}"#).unwrap();
    let mics = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "mics_shard_size": 2}}"#;
    std::fs::write(dir.join("mics.json"), mics).unwrap();
    let (input, hidden, layers, out_dim) = (256i64, 1024i64, 4i64, 16i64);
    let params = input * hidden + hidden + (layers - 2) * (hidden * hidden + hidden) + hidden * out_dim + out_dim;
    let cases = [(1, "auto", "c", 1.0), (2, "flat", "c", 1.0), (2, "auto", "c", 0.5), (2, "auto", "mics", 0.5)];
    for (per_host, hierarchy, config, times_4p) in cases {
        let case = format!("2 hosts x {per_host} ranks, {hierarchy}, {config}.json");
        let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args(["bench", "cluster", "--hosts", "2", "--ranks-per-host", &per_host.to_string()])
            .args(["--link", "1gbit", "--json", "--"])
            .arg(examples::example("mlp"))
            .args(["--config", dir.join(format!("{config}.json")).to_str().unwrap(), "--steps", "6"])
            .args(["--in", &input.to_string(), "--hidden", &hidden.to_string(), "--layers", &layers.to_string()])
            .args(["--out", &out_dim.to_string()])
            .env("ZERORUN_HIERARCHY", hierarchy)
            .output()
            .unwrap();
        assert!(out.status.success(), "{case}: {}", String::from_utf8_lossy(&out.stderr));
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["steps"], 6);
        let expected = times_4p * 4.0 * params as f64;
        let second = r["cross_host_bytes_per_rank_per_step"][1].as_f64().unwrap();
        assert!(
            (second / expected - 1.0).abs() < 0.05,
            "{case}: host 1 sent {second} bytes a step, the formula {expected}"
        );
        let inside = r["inside_host_bytes_per_rank_per_step"][1].as_f64().unwrap();
        if per_host == 2 {
            let flat = hierarchy == "flat";
            assert!(flat == (inside > 0.25 * expected), "{case}: {inside} bytes a step over loopback");
        }
        let floor = r["link_floor_s"].as_f64().unwrap();
        assert!(floor > 0.0 && r["median_step_s"].as_f64().unwrap() >= floor, "{case}: {r}");
    }
    let left =
        String::from_utf8_lossy(&Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).into_owned();
    assert!(!left.lines().any(|l| l.starts_with("zr")), "namespaces left behind: {left}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_swap_training_pattern_reads_back_what_two_ranks_wrote() {
    let dir = std::env::temp_dir().join(format!("zerorun-bench-swap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["bench", "swap", "--pattern", "training", "--ranks", "2", "--size", "8388608", "--chunk", "1048576"])
        .args(["--repeats", "1", "--json", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let row: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert_eq!((row["pattern"].as_str(), row["ranks"].as_u64()), (Some("training"), Some(2)), "{row}");
    assert_eq!((row["chunk_bytes"].as_u64(), row["size_bytes_per_rank"].as_u64()), (Some(1 << 20), Some(8 << 20)));
    for key in ["read_write_gibps_per_rank", "read_seconds_median", "read_seconds_p90"] {
        assert!(row[key].as_f64().is_some_and(|v| v > 0.0), "{key} in {row}");
    }
    assert!(row["read_seconds_p90"].as_f64() >= row["read_seconds_median"].as_f64());
    // Every rank's files are gone with its swapper.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}
