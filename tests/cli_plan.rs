//! `zerorun plan`: the documented JSON rows, ready configs that load, the enumeration's refusals, bad input named.
use std::path::Path;
use std::process::Command;

fn zerorun(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zerorun-plan-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const LLAMA_7B: &str =
    r#"{"layers": 32, "hidden": 4096, "heads": 32, "ffn": 11008, "vocab": 32000, "seq_len": 4096, "gated": true}"#;
const H100_NODES: &str = r#"{"hosts": 2, "ranks_per_host": 8, "memory_per_rank_bytes": 80e9, "host_memory_bytes": 1e12, "flops_per_rank": 3e14, "links": {"intra": {"latency_s": 5e-6, "bandwidth_bytes_per_s": 2e11}, "inter": {"latency_s": 2e-5, "bandwidth_bytes_per_s": 2.5e10}}}"#;

fn files(dir: &Path, model: &str, cluster: &str) -> (String, String) {
    let (m, c) = (dir.join("model.json"), dir.join("cluster.json"));
    std::fs::write(&m, model).unwrap();
    std::fs::write(&c, cluster).unwrap();
    (m.display().to_string(), c.display().to_string())
}

#[test]
fn json_rows_rank_what_fits_and_configs_load() {
    let dir = scratch("json");
    let (m, c) = files(&dir, LLAMA_7B, H100_NODES);
    let out_dir = dir.join("configs");
    let (ok, out, err) = zerorun(&[
        "plan",
        "--model",
        &m,
        "--cluster",
        &c,
        "--global-batch",
        "64",
        "--top",
        "5",
        "--json",
        "--write-config",
        &out_dir.display().to_string(),
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"], 6_738_415_616u64);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 5);
    let keys = [
        "stage",
        "offload",
        "pipeline",
        "tensor",
        "sequence",
        "data",
        "micro_batch",
        "activation_checkpointing",
        "peak_bytes_per_rank",
        "activation_bytes_per_rank",
        "model_state_bytes_per_rank",
        "step_seconds",
        "fits",
    ];
    for r in rows {
        for k in keys {
            assert!(r.get(k).is_some(), "row without {k}: {r}");
        }
        assert_eq!(r["fits"], true);
        assert!(r["peak_bytes_per_rank"].as_f64().unwrap() <= 80e9);
        let (p, t, d) = (r["pipeline"].as_u64().unwrap(), r["tensor"].as_u64().unwrap(), r["data"].as_u64().unwrap());
        let sp = r["sequence"].as_u64().unwrap();
        assert_eq!(p * t * sp * d, 16);
        assert!(sp == 1 || (p == 1 && t == 1), "sequence parallelism beside tensor or pipeline parallelism: {r}");
        assert!(!(r["stage"] == 3 && p > 1), "stage 3 under a pipeline: {r}");
        // A stated cluster (a data sheet's figures, not `plan measure`'s): every part at least 25% unsure.
        let c = &r["confidence"];
        let relative = c["relative"].as_f64().unwrap();
        assert!((0.25..=0.5 + 1e-9).contains(&relative), "{r}");
        assert!(c["least_sure_part"].is_string() && c["shared_cores"] == false, "{r}");
    }
    let steps: Vec<f64> = rows.iter().map(|r| r["step_seconds"].as_f64().unwrap()).collect();
    assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
    // One config per row shown, each with the row's batch arithmetic, accepted by `zerorun config show` at the
    // row's ranks.
    for (i, r) in rows.iter().enumerate() {
        let path = out_dir.join(format!("plan-{:02}.json", i + 1));
        let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(config["zero_optimization"]["stage"], r["stage"]);
        assert_eq!(config["train_micro_batch_size_per_gpu"], r["micro_batch"]);
        assert_eq!(config["train_batch_size"], 64);
        // The engine's ranks: the data-parallel ones times each sequence group's.
        let ranks = (r["data"].as_u64().unwrap() * r["sequence"].as_u64().unwrap()).to_string();
        let (ok, _, err) = zerorun(&["config", "show", &path.display().to_string(), "--world-size", &ranks]);
        assert!(ok, "{}: {err}", path.display());
    }
}

#[test]
fn a_model_too_big_for_the_cluster_shows_the_smallest_peaks() {
    let dir = scratch("big");
    let tiny = r#"{"hosts": 1, "ranks_per_host": 2, "memory_per_rank_bytes": 1e9, "host_memory_bytes": 4e9, "flops_per_rank": 1e12, "links": {"intra": {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e10}}}"#;
    let (m, c) = files(&dir, LLAMA_7B, tiny);
    let (ok, out, err) = zerorun(&["plan", "--model", &m, "--cluster", &c, "--global-batch", "8"]);
    assert!(ok, "{err}");
    assert!(out.contains("0 fit"), "{out}");
    assert!(out.contains("nothing fits; the smallest peaks:"), "{out}");
    // Stated figures: the table's +-% column and the rows the planner is least sure of, named with their part.
    assert!(out.lines().nth(2).is_some_and(|l| l.contains("+-%")), "{out}");
    let least = out.lines().find(|l| l.starts_with("least sure: ")).unwrap_or_else(|| panic!("{out}"));
    assert!(least.contains("+-50% (compute)") && least.contains("zerorun plan measure"), "{least}");
}

#[test]
fn bad_input_is_named() {
    let dir = scratch("bad");
    let (m, c) = files(&dir, r#"{"layers": 2, "hidden": 64, "heads": 3, "vocab": 10, "seq_len": 8}"#, H100_NODES);
    let (ok, _, err) = zerorun(&["plan", "--model", &m, "--cluster", &c, "--global-batch", "8"]);
    assert!(!ok);
    assert!(err.contains("model.json: \"heads\" (3) must divide \"hidden\" (64)"), "{err}");
    let (m, c) = files(
        &dir,
        LLAMA_7B,
        r#"{"hosts": 2, "ranks_per_host": 8, "memory_per_rank_bytes": 8e10, "host_memory_bytes": 1e12, "links": {"intra": {"latency_s": 1e-6, "bandwidth_bytes_per_s": 1e11}}}"#,
    );
    let (ok, _, err) = zerorun(&["plan", "--model", &m, "--cluster", &c, "--global-batch", "8"]);
    assert!(!ok);
    assert!(err.contains("cluster.json: \"links.inter\" is needed when \"hosts\" is more than 1"), "{err}");
    let (ok, _, err) = zerorun(&["plan", "--model", &m]);
    assert!(!ok);
    assert!(err.contains("plan needs --model MODEL.json, --cluster CLUSTER.json and --global-batch B"), "{err}");
}

#[path = "common/examples.rs"]
mod examples;

#[test]
fn validate_predicts_every_rows_peak_memory_within_ten_percent() {
    // The runs use the GPT example from beside the zerorun binary (target/<profile>/examples). Step times are
    // printed, not asserted here: they are the README's, measured by `zerorun plan validate` in release.
    examples::example("gpt");
    let (ok, out, err) = zerorun(&["plan", "validate", "--json", "--steps", "3"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 10);
    for r in rows {
        let (pred, meas) = (r["predicted_peak_bytes"].as_f64().unwrap(), r["measured_peak_bytes"].as_f64().unwrap());
        assert!((pred / meas - 1.0).abs() < 0.10, "{}: predicted {pred}, measured {meas}", r["name"]);
        assert!(r["predicted_step_s"].as_f64().unwrap() > 0.0 && r["measured_step_s"].as_f64().unwrap() > 0.0);
        // This machine measured: compute priced at 15%, NVMe at 40%, and the 4 ranks share 2 cores.
        let u = r["step_uncertainty"].as_f64().unwrap();
        assert!((0.1..=0.7).contains(&u), "{}: +-{u}", r["name"]);
        let shared = r["ranks"].as_u64().unwrap() as usize > std::thread::available_parallelism().unwrap().get();
        assert_eq!(r["predicted"]["confidence"]["shared_cores"], shared, "{}", r["name"]);
    }
    // The NVMe row is less sure than the same stage in memory: its disk traffic is priced at 40%.
    let u = |name: &str| rows.iter().find(|r| r["name"] == name).unwrap()["step_uncertainty"].as_f64().unwrap();
    assert!(u("stage 3 + NVMe, 2 ranks") > u("stage 3, 2 ranks"));
    assert!(v["within_uncertainty"].as_u64().unwrap() <= 10);
    let published = v["published"].as_array().unwrap();
    assert!(published.iter().all(|p| p["error"].as_f64().unwrap().abs() < 0.01 || p["rounds_to_published"] == true));
}
