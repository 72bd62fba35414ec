//! `zerorun estimate`: rows for every stage, the config's row marked, the model description read, bad input named.
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

#[test]
fn json_rows_cover_every_stage_with_deepspeed_numbers() {
    let (ok, out, err) = zerorun(&["estimate", "--params", "1e9", "--nodes", "1", "--gpus-per-node", "8", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let stages: std::collections::BTreeSet<u64> = rows.iter().map(|r| r["stage"].as_u64().unwrap()).collect();
    assert_eq!(stages.into_iter().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    let row = |s: u64, oo: &str| {
        rows.iter().find(|r| r["stage"] == s && r["offload_optimizer"] == oo && r["offload_param"] == "none").unwrap()
    };
    // ZeRO-2 without offload: 2P + 18P/N; with CPU offload: 2P on the device, P * max(4N, 16) * 1.5 on the host.
    assert_eq!(row(2, "none")["per_device_bytes"], 2_000_000_000u64 + 18_000_000_000 / 8);
    assert_eq!(row(2, "cpu")["per_host_bytes"], 48_000_000_000u64);
    // Stage 0, mixed-precision Adam: 16 bytes per parameter.
    assert_eq!(row(0, "none")["model_states_bytes"], 16_000_000_000u64);
}

#[test]
fn config_and_model_description() {
    let dir = std::env::temp_dir().join(format!("zerorun-est-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("gpt.json");
    std::fs::write(&model, r#"{"layers": 2, "hidden": 64, "vocab": 65, "seq_len": 64}"#).unwrap();
    let (ok, out, err) = zerorun(&[
        "estimate",
        "--config",
        "configs/zero2.json",
        "--model",
        model.to_str().unwrap(),
        "--gpus-per-node",
        "2",
    ]);
    assert!(ok, "{err}");
    assert!(out.starts_with("Model states for 112577 parameters (Fp32, 2 optimizer values per parameter)"), "{out}");
    let marked: Vec<&str> = out.lines().filter(|l| l.ends_with("<- this config")).collect();
    assert_eq!(marked.len(), 1, "{out}");
    assert!(marked[0].contains("stage 2, offload_optimizer none, offload_param none"), "{}", marked[0]);
    std::fs::write(&model, r#"{"layers": 2, "hidden": 64}"#).unwrap();
    let (ok, _, err) = zerorun(&["estimate", "--model", model.to_str().unwrap()]);
    assert!(!ok);
    assert_eq!(
        err.trim(),
        format!("error: {}: give \"params\", or \"layers\", \"hidden\" and \"vocab\"", model.display())
    );
    let (ok, _, err) = zerorun(&["estimate"]);
    assert!(!ok);
    assert_eq!(err.trim(), "error: give --params P (>= 1) or --model MODEL_DESC.json");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn activations_of_a_transformer_micro_batch() {
    let dir = std::env::temp_dir().join(format!("zerorun-est-act-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("gpt.json");
    std::fs::write(&model, r#"{"layers": 8, "hidden": 512, "heads": 8, "vocab": 65, "seq_len": 64}"#).unwrap();
    let m = model.to_str().unwrap();
    // The demo's GPT at micro-batch 12 in fp32 keeps L (64 s b h + 4 a s^2 b) + 8 s b h + 4 s b V bytes (PyTorch's
    // saved-tensor hooks on its twin count 217,398,788: bench/activations/saved_tensors.py).
    let (s, b, h, a, v, l) = (64u64, 12, 512, 8, 65, 8);
    let kept = l * (64 * s * b * h + 4 * a * s * s * b) + 8 * s * b * h + 4 * s * b * v;
    let (ok, out, err) = zerorun(&["estimate", "--model", m, "--micro-batch", "12", "--json"]);
    assert!(ok, "{err}");
    let v_: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v_["activations"]["end_of_forward_bytes"], kept);
    assert_eq!(v_["activations"]["peak_bytes"], kept);
    // Recomputing every layer: each keeps its input (4 s b h bytes); backward rebuilds one layer on top.
    let (ok, out, err) =
        zerorun(&["estimate", "--model", m, "--micro-batch", "12", "--activation-checkpointing", "--json"]);
    assert!(ok, "{err}");
    let v_: serde_json::Value = serde_json::from_str(&out).unwrap();
    let inputs = l * 4 * s * b * h + 8 * s * b * h + 4 * s * b * v;
    assert_eq!(v_["activations"]["end_of_forward_bytes"], inputs);
    assert_eq!(v_["activations"]["peak_bytes"], inputs + 64 * s * b * h + 4 * a * s * s * b);
    // The text names what it is.
    let (ok, out, _) = zerorun(&["estimate", "--model", m, "--micro-batch", "12"]);
    assert!(ok && out.contains("Activations per rank, micro-batch 12, without recomputation"), "{out}");
    // Each sequence split over 2 ranks (Ulysses): every term halves (the tokens; the attention's heads), by the
    // flag or by the config's sequence_parallel_size; a split that does not divide the sequence is refused.
    let config = dir.join("sp.json");
    std::fs::write(&config, r#"{"train_batch_size": 8, "sequence_parallel_size": 2}"#).unwrap();
    for how in [["--sequence-parallel", "2"], ["--config", config.to_str().unwrap()]] {
        let (ok, out, err) =
            zerorun(&[&["estimate", "--model", m, "--micro-batch", "12", "--json"][..], &how].concat());
        assert!(ok, "{err}");
        let v_: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v_["activations"]["peak_bytes"], kept / 2, "{how:?}");
        assert_eq!(v_["activations"]["sequence_parallel"], 2);
    }
    let (ok, _, err) = zerorun(&["estimate", "--model", m, "--micro-batch", "12", "--sequence-parallel", "3"]);
    assert!(!ok && err.contains("the sequence of 64 tokens does not split into 3 slices"), "{err}");
    // Without heads, or without a model: named.
    std::fs::write(&model, r#"{"layers": 8, "hidden": 512, "vocab": 65, "seq_len": 64}"#).unwrap();
    let (ok, _, err) = zerorun(&["estimate", "--model", m, "--micro-batch", "12"]);
    assert!(
        !ok && err.contains("--micro-batch needs a transformer description with \"layers\", \"hidden\", \"heads\""),
        "{err}"
    );
    let (ok, _, err) = zerorun(&["estimate", "--params", "1e9", "--micro-batch", "12"]);
    assert!(!ok && err.contains("--micro-batch needs --model MODEL_DESC.json"), "{err}");
}

/// The planner's transformer keys: Mixtral 8x7B (every expert counted: 46.7B parameters; stage 3 gathers a block
/// with its 8 experts), and its keys without heads and a sequence length refused by name.
#[test]
fn a_mixture_of_experts_counts_every_expert() {
    let dir = std::env::temp_dir().join(format!("zerorun-est-moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("mixtral.json");
    std::fs::write(
        &model,
        r#"{"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 32000, "seq_len": 4096,
            "gated": true, "flash_attention": true, "experts": 8, "top_k": 2}"#,
    )
    .unwrap();
    let (ok, out, err) = zerorun(&["estimate", "--model", model.to_str().unwrap(), "--gpus-per-node", "8", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"], 46_702_792_704u64);
    // Stage 3, nothing offloaded: DeepSpeed's estimator, 18 bytes a parameter over the 8 ranks plus 4 bytes a value
    // of the largest layer, a block: attention, its 8 experts, the router and two norms.
    let block: u64 = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096;
    let row = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["stage"] == 3 && r["offload_param"] == "none" && r["offload_optimizer"] == "none")
        .unwrap();
    assert_eq!(row["per_device_bytes"], 18 * 46_702_792_704u64 / 8 + 4 * block, "{row}");
    // With expert_parallel 8 at stages 1-2 a rank keeps the values of its position's experts only: 1/8 of them (at
    // stage 1 their gradients too).
    let ds = dir.join("ds.json");
    std::fs::write(
        &ds,
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}, "zero_optimization": {"stage": 2},
            "expert_parallel": {"enabled": true, "autoep_size": 8}}"#,
    )
    .unwrap();
    let args = ["estimate", "--model", model.to_str().unwrap(), "--gpus-per-node", "8", "--json", "--config"];
    let (ok, out, err) = zerorun(&[&args[..], &[ds.to_str().unwrap()]].concat());
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let states = |stage: u64| {
        let rows = v["rows"].as_array().unwrap();
        let none = |r: &&serde_json::Value| r["offload_param"] == "none" && r["offload_optimizer"] == "none";
        rows.iter().filter(none).find(|r| r["stage"] == stage).unwrap()["model_states_bytes"].as_u64().unwrap()
    };
    let (all, experts) = (46_702_792_704u64, 32 * 8 * 3 * 4096 * 14336u64);
    assert_eq!(states(2), 2 * (all - experts / 8 * 7) + 14 * all / 8);
    assert_eq!(states(1), 4 * (all - experts / 8 * 7) + 16 * all / 8, "stage 1 keeps its position's experts");
    assert_eq!(states(0), 16 * all, "stage 0 keeps every expert");
    std::fs::write(&model, r#"{"layers": 2, "hidden": 64, "vocab": 65, "experts": 4, "gated": true}"#).unwrap();
    let (ok, _, err) = zerorun(&["estimate", "--model", model.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("experts and top_k describe a transformer with \"layers\", \"hidden\", \"heads\""), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
