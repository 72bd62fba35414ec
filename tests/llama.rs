//! The Llama example against transformers (the project venv's, from `make setup`): the same logits on tiny random
//! models, the same weights after training with ZeRO-3 on 2 ranks as `torch.optim.AdamW` in one process, a saved
//! model transformers loads with the loss the example measures, sharded files that round-trip bitwise, and bad
//! input named.
#[path = "common/examples.rs"]
mod examples;
#[path = "../examples/support/llama_model/mod.rs"]
mod llama_model;

use std::path::{Path, PathBuf};
use std::process::Command;

use tch::{nn, Tensor};

/// Tensors by name, as safetensors files hold them.
type Named = Vec<(String, Tensor)>;

fn python() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python")
}

/// Runs tests/llama/reference.py with `args`; returns its output, asserting success.
fn reference(args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/llama/reference.py");
    let out = Command::new(python()).arg(script).args(args).output().expect("the project venv (make setup)");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "reference.py {args:?}:\n{text}");
    text
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zerorun-llama-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs the example (under `zerorun launch` with `ranks` processes); returns (success, stdout + stderr).
fn llama(ranks: usize, args: &[&str]) -> (bool, String) {
    let example = examples::example("llama");
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["launch", "--nproc-per-node", &ranks.to_string(), "--"])
        .arg(example)
        .args(args)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn config(dir: &Path, stage: u8, batch: u64, micro: u64, lr: f64) -> PathBuf {
    let path = dir.join("ds_config.json");
    let text = format!(
        r#"{{"train_batch_size": {batch}, "train_micro_batch_size_per_gpu": {micro}, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": {lr}, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}}}}}"#
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// The losses rank 0 printed (`[rank 0] step N loss X` under the launcher).
fn losses(text: &str) -> Vec<f64> {
    text.lines()
        .map(|l| l.strip_prefix("[rank 0] ").unwrap_or(l))
        .filter_map(|l| l.strip_prefix("step ").and_then(|r| r.split(" loss ").nth(1)))
        .map(|v| v.split_whitespace().next().unwrap().parse().unwrap())
        .collect()
}

/// transformers' losses step by step, from reference.py's `train` output.
fn reference_losses(text: &str) -> Vec<f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("reference step ").and_then(|r| r.split(" loss ").nth(1)))
        .map(|v| v.trim().parse().unwrap())
        .collect()
}

/// Runs the example on `ranks` ranks with `args` (which train `theirs.len()` steps and --save-hf `trained`):
/// transformers' losses step by step (1e-5), and weights within 1e-4 of transformers' trained folder `expected`.
fn trains_as_transformers(ranks: usize, args: &[&str], theirs: &[f64], expected: &Path, trained: &Path, what: &str) {
    let (ok, text) = llama(ranks, &[args, &["--save-hf", s(trained)]].concat());
    assert!(ok, "{what}: {text}");
    let ours = losses(&text);
    assert_eq!(ours.len(), theirs.len(), "{what}: {text}");
    for (step, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{what} step {}: {a} vs transformers {b}", step + 1);
    }
    eprintln!("{}", reference(&["compare", s(expected), s(trained), "1e-4"]));
}

/// The example's model (built whole, loaded by name from transformers' files: one file tied, four shards and an
/// index untied) gives transformers' logits on the same tokens.
#[test]
fn the_models_logits_are_transformers_logits() {
    let dir = scratch("logits");
    for (tied, shard) in [("untied", "100000"), ("tied", "")] {
        let model_dir = dir.join(tied);
        reference(&["make", s(&model_dir), tied, shard]);
        let c = llama_model::LlamaConfig::from_dir(&model_dir).unwrap();
        assert_eq!(c.tie_word_embeddings, tied == "tied");
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let model = llama_model::Llama::new(&vs.root(), &c);
        zerorun::runtime::engine::load_mapped(&vs, &model_dir).unwrap();
        let expected: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(model_dir.join("reference_logits.safetensors")).unwrap().into_iter().collect();
        let logits = tch::no_grad(|| model.forward(&expected["ids"]));
        let d = (&logits - &expected["logits"]).abs().max().double_value(&[]);
        let scale = expected["logits"].abs().max().double_value(&[]);
        assert!(d <= 1e-5 * scale.max(1.0), "{tied}: logits differ by {d:e} (largest {scale})");
        // Tied: the file holds no lm_head.weight and the model made none.
        assert_eq!(vs.variables().contains_key("lm_head.weight"), tied == "untied");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Mixtral and Qwen3-MoE folders (4 experts, top 2; the Qwen3-MoE with a dense layer, without renormalised top-k
/// weights, with its per-head query and key norms): the example's model gives transformers' logits; trained 5 steps
/// (each part's loss its cross-entropy plus 0.02 times its load-balancing loss, AdamW, clipping) on 2 ranks at
/// stages 2 and 3 (2 micro-batches each), with the experts split over both (expert parallel 2, stage 2), and on 4
/// ranks as expert parallel 2 x data 2 (stage 3), it has transformers' losses step by step and ends within 1e-4 of
/// transformers trained on the same 4 parts in one process; the saved folder loads with no missing or unexpected key.
#[test]
fn mixtral_and_qwen3_moe_give_transformers_logits_and_train_as_it_does() {
    let dir = scratch("moe");
    let data = dir.join("tokens.safetensors");
    reference(&["tokens", s(&data), "12", "17", "128", "int64"]);
    for kind in ["mixtral", "qwen3_moe"] {
        let source = dir.join(kind);
        reference(&["make", s(&source), kind, ""]);
        let c = llama_model::LlamaConfig::from_dir(&source).unwrap();
        assert_eq!((c.model_type.as_str(), c.experts(), c.aux_loss_coef()), (kind, Some(4), 0.02));
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let model = llama_model::Llama::new(&vs.root(), &c);
        zerorun::runtime::engine::load_mapped(&vs, &source).unwrap();
        let expected: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(source.join("reference_logits.safetensors")).unwrap().into_iter().collect();
        let logits = tch::no_grad(|| model.forward(&expected["ids"]));
        let d = (&logits - &expected["logits"]).abs().max().double_value(&[]);
        let scale = expected["logits"].abs().max().double_value(&[]);
        assert!(d <= 1e-5 * scale.max(1.0), "{kind}: logits differ by {d:e} (largest {scale})");
        assert_eq!(vs.variables().values().map(|v| v.numel() as i64).sum::<i64>(), c.parameters(), "{kind}");

        let expected = dir.join(format!("{kind}-expected"));
        let ds = config(&dir, 2, 8, 2, 1e-3);
        let theirs = reference_losses(&reference(&["train", s(&source), s(&data), s(&ds), "5", s(&expected), "4"]));
        // (ranks, stage, expert-parallel degree, by ds_config's block, activation checkpointing): E = 1 at stages 2
        // and 3; E = 2 on 2 ranks (--expert-parallel); E = 2 x data 2 on 4 ranks (the `expert_parallel` block, its
        // preset checked). Checkpointed layers recompute with their experts' unit inside and keep the router's
        // gradient from the load-balancing loss: E = 2 x data 2 at stage 3, E = 1 at stage 2. Stage 1 at E = 2 x data
        // 2 keeps each position's experts on its ranks and reduces them there after backward.
        for (ranks, stage, e, by_key, checkpointed) in [
            (2usize, 2u8, 1, false, false),
            (4, 1, 2, false, false),
            (2, 3, 1, false, false),
            (2, 2, 2, false, false),
            (4, 3, 2, true, false),
            (4, 3, 2, false, true),
            (2, 2, 1, false, true),
        ] {
            let mut ds_json: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(config(&dir, stage, 8, 2, 1e-3)).unwrap()).unwrap();
            let e_text = e.to_string();
            let mut flag = vec![];
            if by_key {
                ds_json["expert_parallel"] =
                    serde_json::json!({"enabled": true, "autoep_size": e, "preset_model": kind});
            } else if e > 1 {
                flag = vec!["--expert-parallel", e_text.as_str()];
            }
            if checkpointed {
                flag.push("--activation-checkpointing");
            }
            let ds = dir.join(format!("ds_{kind}_{ranks}_{stage}_{e}.json"));
            std::fs::write(&ds, ds_json.to_string()).unwrap();
            let what =
                format!("{kind} on {ranks} ranks, stage {stage}, expert parallel {e}, checkpointed {checkpointed}");
            let trained = dir.join(format!("{kind}-{ranks}-{stage}-{e}-{checkpointed}"));
            let args = ["--config", s(&ds), "--hf", s(&source), "--data", s(&data), "--steps", "5"];
            trains_as_transformers(ranks, &[&args[..], &flag].concat(), &theirs, &expected, &trained, &what);
        }
        if kind == "mixtral" {
            resumes_across_expert_parallel_degrees(&dir, &source, &data, &theirs, &expected);
            model_states_at_every_expert_parallel_degree_are_the_estimate(&dir, &source, &data);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Mixtral run stopped and resumed at other expert-parallel degrees, world sizes and stages: steps 1-2 on 4
/// ranks at E = 2 (stage 3), 3-4 on 2 ranks at E = 1 (stage 2), 5 on 2 ranks at E = 2 (stage 3). The experts keep
/// their index in the checkpoint, so the run is the uninterrupted one: transformers' losses step by step and weights.
fn resumes_across_expert_parallel_degrees(dir: &Path, source: &Path, data: &Path, theirs: &[f64], expected: &Path) {
    let checkpoints = dir.join("ep-checkpoints");
    let mut ours = Vec::new();
    let trained = dir.join("ep-resumed");
    for (ranks, stage, e, steps) in [(4usize, 3u8, "2", "2"), (2, 2, "1", "4"), (2, 3, "2", "5")] {
        let ds = config(dir, stage, 8, 2, 1e-3);
        let args = [
            "--config",
            s(&ds),
            "--hf",
            s(source),
            "--data",
            s(data),
            "--steps",
            steps,
            "--expert-parallel",
            e,
            "--checkpoint-dir",
            s(&checkpoints),
            "--save-every",
            "2",
            "--resume",
            "--save-hf",
            s(&trained),
        ];
        let (ok, text) = llama(ranks, &args);
        assert!(ok, "{ranks} ranks, E = {e}, to step {steps}: {text}");
        if steps != "2" {
            assert!(text.contains("resumed from step"), "{ranks} ranks, E = {e}: {text}");
        }
        ours.extend(losses(&text));
    }
    assert_eq!(ours.len(), theirs.len(), "{ours:?}");
    for (step, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "resumed across E, step {}: {a} vs transformers {b}", step + 1);
    }
    eprintln!("{}", reference(&["compare", s(expected), s(&trained), "1e-4"]));
}

/// The memory report's model states per rank (what the engine keeps between steps, measured) against
/// `zerorun estimate`'s formula for the run, within 1%, and the experts' part of them named (over the ranks, the
/// experts' share of the parameters), at stages 1-3 with the 4 experts over 4 ranks at E = 1, 2 and 4. At stages 1-2
/// a rank keeps the values (and at stage 1 the gradients) of its position's experts only, so its states are below
/// E = 1's by (1 - 1/E) of the experts' values (and gradients).
fn model_states_at_every_expert_parallel_degree_are_the_estimate(dir: &Path, source: &Path, data: &Path) {
    // What stage 2's report at E = 1 says E = 4 would hold on rank 0 ("what would help").
    let mut foretold = None;
    for (stage, e) in [1u8, 2, 3].into_iter().flat_map(|stage| [1u32, 2, 4].map(|e| (stage, e))) {
        let ds = config(dir, stage, 8, 2, 1e-3);
        let report = dir.join(format!("memory-e{e}-stage{stage}"));
        let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args(["launch", "--nproc-per-node", "4", "--memory-report", s(&report), "--"])
            .arg(examples::example("llama"))
            .args(["--config", s(&ds), "--hf", s(source), "--data", s(data), "--steps", "1"])
            .args(["--expert-parallel", &e.to_string()])
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "stage {stage}, E = {e}: {text}");
        let (mut all, mut experts, mut share) = (0.0, 0.0, 0.0);
        for r in 0..4 {
            let json: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(report.join(format!("memory_rank{r}.json"))).unwrap())
                    .unwrap();
            let states = &json["model_states"];
            let (measured, estimated) =
                (states["measured_bytes"].as_f64().unwrap(), states["estimated_bytes"].as_f64().unwrap());
            let off = (measured - estimated).abs() / estimated;
            assert!(off <= 0.01, "stage {stage}, E = {e}, rank {r}: measured {measured} vs estimate {estimated}");
            // The report names the experts' part: summed over the ranks, the experts' share of the parameters.
            let part = &json["experts"];
            let bytes: f64 = part["categories"].as_object().unwrap().values().map(|b| b.as_f64().unwrap()).sum();
            let (x, m) = (part["parameters"].as_f64().unwrap(), part["model_parameters"].as_f64().unwrap());
            share = x / m;
            (all, experts) = (all + measured, experts + bytes);
            if (stage, e, r) == (2, 1, 0) {
                let alternatives = json["alternatives"].as_array().unwrap();
                let wider = alternatives.iter().find(|a| a["change"] == "expert_parallel.autoep_size: 4");
                foretold = Some(wider.expect("E = 4 among the alternatives")["model_states_bytes"].as_f64().unwrap());
            }
            if (stage, e, r) == (2, 4, 0) {
                let said = foretold.expect("the E = 1 run came first");
                assert!((measured - said).abs() <= 0.01 * said, "stage 2, E = 4: {measured} bytes, foretold {said}");
            }
            if stage <= 2 {
                // A rank keeps the values of its position's experts only: 1 / E of them beside the dense ones.
                let values = json["categories"]["parameters"]["current_bytes"].as_f64().unwrap();
                let theirs = part["categories"]["parameters"].as_f64().unwrap() / values;
                let own = x / e as f64 / (m - x + x / e as f64);
                assert!(
                    (theirs - own).abs() <= 0.01,
                    "stage {stage}, E = {e}, rank {r}: experts {theirs} of the values, not {own}"
                );
            }
        }
        // Stage 3 holds every part of the model alike; stages 1-2 hold fewer experts above E = 1.
        assert!(
            share > 0.5 && ((stage <= 2 && e > 1) || (experts / all - share).abs() <= 0.01),
            "stage {stage}, E = {e}: experts {experts} of {all}, {share}"
        );
    }
}

/// Sequence parallelism (DeepSpeed-Ulysses; grouped-query attention, 4 heads over 2 key/value heads): each row's
/// 16 tokens split over 2 ranks at stage 3 (`--sequence-parallel 2`, the batch's 8 rows in 4 micro-batches of the
/// one data-parallel rank), and over 2 x data 2 = 4 ranks at stage 2 (ds_config's `sequence_parallel_size`), train 5
/// steps with transformers' losses step by step and end within 1e-4 of transformers trained on the whole batches.
/// Ring attention the same, on a model of 3 heads over 2 ranks.
#[test]
fn sequence_parallel_trains_as_transformers_on_the_whole_sequences() {
    let dir = scratch("sequence");
    let source = dir.join("source");
    reference(&["make", s(&source), "untied", ""]);
    let data = dir.join("tokens.safetensors");
    reference(&["tokens", s(&data), "12", "17", "128", "int64"]);
    let ds = config(&dir, 3, 8, 2, 1e-3);
    let expected = dir.join("expected");
    let theirs = reference_losses(&reference(&["train", s(&source), s(&data), s(&ds), "5", s(&expected)]));
    for (ranks, stage, by_key) in [(2usize, 3u8, false), (4, 2, true)] {
        let mut ds_json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(config(&dir, stage, 8, 2, 1e-3)).unwrap()).unwrap();
        let mut flag = vec!["--sequence-parallel", "2"];
        if by_key {
            ds_json["sequence_parallel_size"] = 2.into();
            flag.clear();
        }
        let ds = dir.join(format!("ds_sp_{ranks}.json"));
        std::fs::write(&ds, ds_json.to_string()).unwrap();
        let args = ["--config", s(&ds), "--hf", s(&source), "--data", s(&data), "--steps", "5"];
        let trained = dir.join(format!("trained-{ranks}"));
        trains_as_transformers(
            ranks,
            &[&args[..], &flag].concat(),
            &theirs,
            &expected,
            &trained,
            &format!("{ranks} ranks"),
        );
    }
    // Ring attention: three heads, which do not split over 2 ranks, take the ring by themselves (2 ranks, stage 3);
    // asked for by name on 2 x data 2 (stage 2). Each rank holds a head and a tail chunk of every row.
    let heads3 = dir.join("heads3");
    reference(&["make", s(&heads3), "heads3", ""]);
    let expected = dir.join("expected3");
    let theirs = reference_losses(&reference(&["train", s(&heads3), s(&data), s(&ds), "5", s(&expected)]));
    for (ranks, stage, flag) in [(2usize, 3u8, &[][..]), (4, 2, &["--ring-attention"][..])] {
        let ds = config(&dir, stage, 8, 2, 1e-3);
        let args =
            ["--config", s(&ds), "--hf", s(&heads3), "--data", s(&data), "--steps", "5", "--sequence-parallel", "2"];
        let trained = dir.join(format!("ring-{ranks}"));
        trains_as_transformers(
            ranks,
            &[&args[..], flag].concat(),
            &theirs,
            &expected,
            &trained,
            &format!("ring, {ranks} ranks"),
        );
    }
    // A degree that does not divide the ranks, and the ring without a sequence group, are refused by name.
    let base = ["--config", s(&ds), "--hf", s(&source), "--data", s(&data), "--steps", "1"];
    let (ok, text) = llama(2, &[&base[..], &["--sequence-parallel", "4"]].concat());
    assert!(!ok && text.contains("sequence_parallel_size"), "{text}");
    let (ok, text) = llama(1, &[&base[..], &["--ring-attention"]].concat());
    assert!(!ok && text.contains("--ring-attention: needs --sequence-parallel"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// ZeRO-3 on 2 ranks (2 micro-batches each, clipping, AdamW) from transformers' sharded files on an int32 token
/// file has transformers' losses step by step (1e-5) and ends within 1e-4 (every element; training moved them by
/// 5e-3) of transformers' model trained by torch.optim.AdamW on the full batches in one process;
/// the saved model loads in transformers without missing or unexpected keys, and its loss on a batch is the one
/// the example measures on it; `zerorun consolidate --hf-config` makes the same model of its checkpoint.
#[test]
fn zero3_on_two_ranks_trains_as_torch_adamw_and_saves_what_transformers_loads() {
    let dir = scratch("train");
    let source = dir.join("source");
    reference(&["make", s(&source), "untied", "100000"]);
    let data = dir.join("tokens.safetensors");
    reference(&["tokens", s(&data), "12", "17", "128", "int32"]);
    let ds = config(&dir, 3, 8, 2, 1e-3);
    let trained = dir.join("trained");
    let checkpoints = dir.join("checkpoints");
    let args = ["--config", s(&ds), "--hf", s(&source), "--data", s(&data), "--steps", "5", "--save-hf", s(&trained)];
    let more = ["--max-shard-size", "100KB", "--checkpoint-dir", s(&checkpoints), "--save-every", "5"];
    let (ok, text) = llama(2, &[&args[..], &more].concat());
    assert!(ok, "{text}");
    assert_eq!(losses(&text).len(), 5, "{text}");
    assert!(trained.join("model.safetensors.index.json").exists(), "sharded past 100KB: {text}");
    let expected = dir.join("expected");
    let reference_text = reference(&["train", s(&source), s(&data), s(&ds), "5", s(&expected)]);
    // The same losses step by step (the first before any update).
    let theirs = reference_losses(&reference_text);
    for (step, (a, b)) in losses(&text).iter().zip(&theirs).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "step {}: example {a} vs transformers {b}", step + 1);
    }
    eprintln!("{}", reference(&["compare", s(&expected), s(&trained), "1e-4"]));
    // The step-5 checkpoint, consolidated for transformers: the same tensors, bitwise.
    let consolidated = dir.join("consolidated");
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["consolidate", s(&checkpoints), s(&consolidated), "--hf-config", s(&source)])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    reference(&["equal", s(&trained), s(&consolidated)]);
    // The saved model's loss on step 1's batch: transformers' and the example's (lr 0, one step from it).
    let theirs = reference(&["evaluate", s(&trained), s(&data), "8"]);
    let theirs: f64 = theirs.lines().find_map(|l| l.strip_prefix("loss ")).unwrap().trim().parse().unwrap();
    let frozen = config(&dir, 0, 8, 4, 0.0);
    let (ok, text) = llama(2, &["--config", s(&frozen), "--hf", s(&trained), "--data", s(&data), "--steps", "1"]);
    assert!(ok, "{text}");
    let ours = losses(&text)[0];
    assert!((ours - theirs).abs() <= 1e-5 * theirs, "the saved model's loss: example {ours} vs transformers {theirs}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every ZeRO stage, stage 3 with activation checkpointing and the optimizer offloaded, trains the same model (the
/// same losses step by step); bf16 trains and saves bf16 weights with config.json saying so.
#[test]
fn every_stage_offload_checkpointing_and_bf16_train_the_model() {
    let dir = scratch("stages");
    let source = dir.join("source");
    reference(&["make", s(&source), "untied", ""]);
    let data = dir.join("tokens.safetensors");
    reference(&["tokens", s(&data), "16", "17", "128", "int64"]);
    // `top`: keys beside zero_optimization; `zero`: keys inside it after the stage.
    let run = |tag: &str, stage: u8, top: &str, zero: &str, flags: &[&str]| {
        let text = std::fs::read_to_string(config(&dir, stage, 8, 2, 1e-3)).unwrap();
        let section = format!(r#""zero_optimization": {{"stage": {stage}"#);
        let text = text.replace(&section, &format!("{top} {section}{zero}"));
        let path = dir.join(format!("{tag}.json"));
        std::fs::write(&path, text).unwrap();
        let out = dir.join(tag);
        let args = ["--config", s(&path), "--hf", s(&source), "--data", s(&data), "--steps", "3", "--save-hf", s(&out)];
        let (ok, text) = llama(2, &[&args[..], flags].concat());
        assert!(ok, "{tag}: {text}");
        (losses(&text), out)
    };
    let (zero0, _) = run("stage0", 0, "", "", &[]);
    assert_eq!(zero0.len(), 3);
    let offload = r#", "offload_optimizer": {"device": "cpu"}"#;
    for (tag, stage, zero, flags) in [
        ("stage1", 1, "", &[][..]),
        ("stage2", 2, "", &[][..]),
        ("stage3-ac-offload", 3, offload, &["--activation-checkpointing"][..]),
    ] {
        let (l, _) = run(tag, stage, "", zero, flags);
        assert_eq!(l.len(), 3, "{tag}");
        for (a, b) in l.iter().zip(&zero0) {
            assert!((a - b).abs() <= 1e-5 * b, "{tag}: {l:?} vs stage 0 {zero0:?}");
        }
    }
    let (bf16, out) = run("bf16", 3, r#""bf16": {"enabled": true},"#, "", &[]);
    assert!(bf16.len() == 3 && (bf16[0] - zero0[0]).abs() < 0.05, "bf16 {bf16:?} vs {zero0:?}");
    let saved = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(saved.contains(r#""torch_dtype": "bfloat16""#), "{saved}");
    let weights = Tensor::read_safetensors(out.join("model.safetensors")).unwrap();
    assert!(weights.iter().all(|(_, t)| t.kind() == tch::Kind::BFloat16), "bf16 weights");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Pipeline stages, tensor parallelism (with ZeRO-3 over the data ranks) and both together, from transformers'
/// shards, have one rank's losses and save its model (the vocabulary-parallel head and embedding made whole);
/// a degree that does not divide the key/value heads is refused by name.
#[test]
fn pipeline_and_tensor_parallel_train_the_same_model() {
    let dir = scratch("parallel");
    let source = dir.join("source");
    reference(&["make", s(&source), "untied", "100000"]);
    let data = dir.join("tokens.safetensors");
    reference(&["tokens", s(&data), "16", "17", "128", "int64"]);
    let run = |tag: &str, ranks: usize, stage: u8, flags: &[&str]| {
        let ds = config(&dir, stage, 8, 2, 1e-3);
        let out = dir.join(tag);
        let args = ["--config", s(&ds), "--hf", s(&source), "--data", s(&data), "--steps", "3", "--save-hf", s(&out)];
        let (ok, text) = llama(ranks, &[&args[..], flags].concat());
        assert!(ok, "{tag}: {text}");
        (losses(&text), out)
    };
    let (one, whole) = run("one", 1, 1, &[]);
    assert_eq!(one.len(), 3);
    for (tag, ranks, stage, flags, bound) in [
        ("tp2-zero3", 2, 3, &["--tensor-parallel", "2"][..], "1e-4"),
        ("pipe2", 2, 1, &["--pipeline-stages", "2"][..], "1e-6"),
        ("pipe2-tp2", 4, 1, &["--pipeline-stages", "2", "--tensor-parallel", "2"][..], "1e-4"),
    ] {
        let (l, out) = run(tag, ranks, stage, flags);
        assert_eq!(l.len(), 3, "{tag}");
        for (a, b) in l.iter().zip(&one) {
            assert!((a - b).abs() <= 1e-5 * b, "{tag}: {l:?} vs one rank {one:?}");
        }
        // Tensor parallelism's sums in another order move Adam's near-zero updates by ~1e-5.
        reference(&["compare", s(&whole), s(&out), bound]);
    }
    let ds = config(&dir, 1, 8, 2, 1e-3);
    let (ok, text) = llama(
        4,
        &["--config", s(&ds), "--hf", s(&source), "--steps", "1", "--data", s(&data), "--tensor-parallel", "4"],
    );
    assert!(!ok && text.contains("--tensor-parallel 4 must divide num_key_value_heads (2)"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Transformers' shards in, zerorun's shards out, read back in and written again: the same bytes, and every
/// tensor bitwise transformers' own.
#[test]
fn sharded_weights_round_trip_bitwise() {
    let dir = scratch("roundtrip");
    let source = dir.join("source");
    reference(&["make", s(&source), "untied", "100000"]);
    let ds = config(&dir, 3, 4, 2, 1e-3);
    let (a, b) = (dir.join("a"), dir.join("b"));
    for (from, to) in [(&source, &a), (&a, &b)] {
        let args =
            ["--config", s(&ds), "--hf", s(from), "--steps", "0", "--save-hf", s(to), "--max-shard-size", "100KB"];
        let (ok, text) = llama(2, &args);
        assert!(ok, "{text}");
    }
    let mut names: Vec<String> =
        std::fs::read_dir(&a).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert!(names.contains(&"model.safetensors.index.json".to_string()), "{names:?}");
    for name in &names {
        assert_eq!(std::fs::read(a.join(name)).unwrap(), std::fs::read(b.join(name)).unwrap(), "{name}");
    }
    reference(&["equal", s(&source), s(&a)]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Bad input is named: another architecture's config.json, a weights file missing a layer's tensor, a tensor of
/// another shape, token ids outside the vocabulary.
#[test]
fn bad_models_and_data_are_refused_by_name() {
    let dir = scratch("bad");
    let source = dir.join("source");
    reference(&["make", s(&source), "tied", ""]);
    let ds = config(&dir, 3, 4, 2, 1e-3);
    let good = dir.join("good.safetensors");
    reference(&["tokens", s(&good), "4", "9", "128", "int64"]);
    let run = |hf: &Path, data: Option<&Path>| {
        let data = data.unwrap_or(&good);
        let (ok, text) = llama(1, &["--config", s(&ds), "--hf", s(hf), "--steps", "1", "--data", s(data)]);
        assert!(!ok, "{text}");
        text
    };
    let copy = |tag: &str| {
        let to = dir.join(tag);
        std::fs::create_dir_all(&to).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(source.join(f), to.join(f)).unwrap();
        }
        to
    };
    let other = copy("gpt2");
    let text = std::fs::read_to_string(other.join("config.json")).unwrap().replace("\"llama\"", "\"gpt2\"");
    std::fs::write(other.join("config.json"), text).unwrap();
    let err = run(&other, None);
    assert!(err.contains("gpt2/config.json") && err.contains("model_type \"gpt2\" is not supported"), "{err}");

    let weights = |to: &Path, edit: &dyn Fn(&mut Named)| {
        let mut tensors = Tensor::read_safetensors(source.join("model.safetensors")).unwrap();
        edit(&mut tensors);
        Tensor::write_safetensors(&tensors, to.join("model.safetensors")).unwrap();
    };
    let missing = copy("missing");
    weights(&missing, &|t| t.retain(|(n, _)| n != "model.layers.1.mlp.up_proj.weight"));
    let err = run(&missing, None);
    assert!(
        err.contains("missing/model.safetensors") && err.contains("tensor `model.layers.1.mlp.up_proj.weight`"),
        "{err}"
    );

    let shape = copy("shape");
    weights(&shape, &|t| {
        let (_, w) = t.iter_mut().find(|(n, _)| n == "model.layers.0.self_attn.k_proj.weight").unwrap();
        *w = w.narrow(0, 0, 16).contiguous();
    });
    let err = run(&shape, None);
    assert!(
        err.contains("shape/model.safetensors")
            && err
                .contains("`model.layers.0.self_attn.k_proj.weight` is [16, 64] in the file and [32, 64] in the model"),
        "{err}"
    );

    let data = dir.join("tokens.safetensors");
    reference(&["tokens", s(&data), "4", "9", "130", "int64"]);
    let err = run(&source, Some(&data));
    assert!(
        err.contains("tokens.safetensors")
            && err.contains("tensor `tokens` holds id")
            && err.contains("not in the vocabulary 0..128"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
