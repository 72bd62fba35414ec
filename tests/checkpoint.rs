//! Checkpoints: bitwise resume at the same world size and stage; resharding across world sizes and stages;
//! damaged, missing and newer-format checkpoints give errors naming the file; consolidation gives the full weights.
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;
use tch::{Kind, Tensor};
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions};

#[path = "common/compare.rs"]
mod compare;
use compare::full_parameters;

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

/// The generator test seeds, saves, draws, loads and draws again: no other test of this file may seed or restore
/// the process's generator meanwhile, so it runs alone and the others beside each other.
static ALONE: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn beside_others() -> std::sync::RwLockReadGuard<'static, ()> {
    ALONE.read().unwrap_or_else(|p| p.into_inner())
}

fn config(stage: u8, gas: u64, bf16: bool) -> Config {
    Config::from_value(json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": LR, "warmup_num_steps": 5, "warmup_type": "linear"}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}
    }))
    .unwrap()
}

enum Ckpt<'a> {
    None,
    SaveAt(u64, &'a Path),
    Resume(&'a Path),
    /// Resume from the folder's latest checkpoint and save into it again at the given step.
    ResumeSaveAt(&'a Path, u64),
}

/// Trains on `world` thread ranks up to global step `until`; saves or resumes as asked. Returns the full params.
fn train(world: usize, config: Config, until: i64, ckpt: Ckpt) -> Vec<(String, Vec<f32>)> {
    let (xv, yv) = data();
    let comms = threads::group(world, Duration::from_secs(60));
    let bf16 = config.bf16.enabled;
    let mut results: Vec<Vec<(String, Vec<f32>)>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (config, xv, yv, ckpt) = (config.clone(), &xv, &yv, &ckpt);
                s.spawn(move || {
                    let (x, y) =
                        (Tensor::from_slice(xv).view([SAMPLES, IN]), Tensor::from_slice(yv).view([SAMPLES, OUT]));
                    // One unit per layer: stage 3 gathers them one by one; other stages just run them in order.
                    let (mut vs, model) = init_layers(&[IN, HIDDEN, HIDDEN, OUT]);
                    if bf16 {
                        vs.bfloat16();
                    }
                    let x = if bf16 { x.to_kind(Kind::BFloat16) } else { x };
                    let mut engine =
                        Engine::new(&vs, config, Box::new(comm), EngineOptions::default().units_of(&model)).unwrap();
                    if let Ckpt::Resume(dir) | Ckpt::ResumeSaveAt(dir, _) = ckpt {
                        engine.load_checkpoint(dir, None).unwrap();
                    }
                    let b = engine.batch_sizes();
                    let (rank, micro) = (engine.rank() as i64, b.train_micro_batch_size_per_gpu as i64);
                    for step in engine.global_steps() as i64..until {
                        let order = batch_indices(step);
                        for m in 0..b.gradient_accumulation_steps as i64 {
                            let first = ((m * world as i64 + rank) * micro) as usize;
                            let idx = Tensor::from_slice(&order[first..first + micro as usize]);
                            let pred = engine.forward(&model, &x.index_select(0, &idx)).unwrap().to_kind(Kind::Float);
                            engine
                                .backward_units(&model, &pred.mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean))
                                .unwrap();
                            engine.step().unwrap();
                        }
                        if let Ckpt::SaveAt(at, dir) | Ckpt::ResumeSaveAt(dir, at) = ckpt {
                            if engine.global_steps() == *at {
                                engine.save_checkpoint(dir, None).unwrap();
                            }
                        }
                    }
                    full_parameters(&mut engine)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    results.remove(0)
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("zerorun-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn rel(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f64 {
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| {
            x.iter().zip(y).map(|(p, q)| (p - q).abs() as f64).fold(0.0, f64::max)
                / y.iter().map(|q| q.abs() as f64).fold(1e-6, f64::max)
        })
        .fold(0.0, f64::max)
}

#[test]
fn resume_at_the_same_world_size_and_stage_is_bitwise() {
    let _beside = beside_others();
    for (stage, bf16) in [(0, false), (1, false), (2, false), (2, true), (3, false), (3, true)] {
        let dir = tmp(&format!("bitwise{stage}{bf16}"));
        let straight = train(2, config(stage, 2, bf16), 12, Ckpt::SaveAt(6, &dir));
        assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), "global_step6");
        let resumed = train(2, config(stage, 2, bf16), 12, Ckpt::Resume(&dir));
        assert_eq!(resumed, straight, "stage {stage}, bf16 {bf16}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn resharding_across_world_sizes_and_stages() {
    let _beside = beside_others();
    let reference = train(1, config(0, 1, false), 12, Ckpt::None);
    // 4 ranks at stage 2 -> 2 ranks at stage 1 -> 3 ranks at stage 3 -> 3 ranks at stage 0 (3 ranks: uneven
    // partitions; stage 3: a chunk of every unit per rank, laid out by unit).
    let dir = tmp("reshard");
    train(4, config(2, 1, false), 4, Ckpt::SaveAt(4, &dir));
    train(2, config(1, 1, false), 6, Ckpt::ResumeSaveAt(&dir, 6));
    train(3, config(3, 1, false), 8, Ckpt::ResumeSaveAt(&dir, 8));
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), "global_step8");
    let end = train(3, config(0, 1, false), 12, Ckpt::Resume(&dir));
    let d = rel(&end, &reference);
    assert!(d <= 1e-6, "resharded run vs uninterrupted: {d:e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn load_err(dir: &Path) -> String {
    let comm = threads::group(1, Duration::from_secs(5)).pop().unwrap();
    let (vs, _m) = init_store();
    let mut engine = Engine::new(&vs, config(0, 1, false), Box::new(comm), EngineOptions::default()).unwrap();
    engine.load_checkpoint(dir, None).unwrap_err().to_string()
}

#[test]
fn damaged_missing_and_newer_checkpoints_are_named() {
    let _beside = beside_others();
    let dir = tmp("damaged");
    train(1, config(0, 1, false), 2, Ckpt::SaveAt(2, &dir));
    let file = dir.join("global_step2/rank0.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 5] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
    let e = load_err(&dir);
    assert!(e.starts_with(&format!("{}: checksum mismatch", file.display())), "{e}");
    std::fs::remove_file(&file).unwrap();
    let e = load_err(&dir);
    assert!(e.starts_with(&format!("{}: no checkpoint here", file.display())), "{e}");
    let manifest = dir.join("global_step2/manifest.json");
    let text =
        std::fs::read_to_string(&manifest).unwrap().replacen("\"format_version\": 3", "\"format_version\": 99", 1);
    std::fs::write(&manifest, text).unwrap();
    assert_eq!(
        load_err(&dir),
        format!("{}: format version 99 is newer than this zerorun reads (3)", manifest.display())
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(load_err(&dir).starts_with(&format!("{}: no checkpoint here", dir.join("latest").display())));
}

#[test]
fn consolidate_gives_the_full_weights_by_name() {
    let _beside = beside_others();
    let dir = tmp("consolidate");
    // Stage 3 on 3 ranks: every rank file holds a chunk of every unit.
    let params = train(3, config(3, 1, false), 3, Ckpt::SaveAt(3, &dir));
    let out = dir.join("full.safetensors");
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["consolidate", dir.to_str().unwrap(), out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let loaded = Tensor::read_safetensors(&out).unwrap();
    let mut got: Vec<(String, Vec<f32>)> =
        loaded.into_iter().map(|(n, t)| (n, Vec::<f32>::try_from(t.reshape([-1])).unwrap())).collect();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got, params);
    // Python's safetensors + torch read it too (the project venv has both).
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let script = "import sys, torch\nfrom safetensors.torch import load_file\nt = load_file(sys.argv[1])\nfor k in sorted(t): print(k, tuple(t[k].shape), repr(float(t[k].double().sum())))";
    let py = std::process::Command::new(&python)
        .args(["-c", script, out.to_str().unwrap()])
        .output()
        .expect("the project venv (make setup)");
    assert!(py.status.success(), "{}", String::from_utf8_lossy(&py.stderr));
    let lines: Vec<String> = String::from_utf8_lossy(&py.stdout).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), params.len());
    for ((name, values), line) in params.iter().zip(&lines) {
        let sum: f64 = values.iter().map(|v| *v as f64).sum();
        let mut parts = line.rsplitn(2, ' ');
        let py_sum: f64 = parts.next().unwrap().parse().unwrap();
        assert!(parts.next().unwrap().starts_with(&format!("{name} (")), "{line}");
        assert!((py_sum - sum).abs() <= 1e-9 * sum.abs().max(1.0), "{name}: python {py_sum} vs {sum}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn checkpoints_carry_the_rng_state_and_the_model_weights() {
    let _alone = ALONE.write().unwrap_or_else(|p| p.into_inner());
    for (stage, gather) in [(2u8, false), (3, false), (3, true)] {
        let dir = tmp(&format!("rng{stage}{gather}"));
        let comm = threads::group(1, Duration::from_secs(10)).pop().unwrap();
        let (vs, model) = init_layers(&[IN, HIDDEN, HIDDEN, OUT]);
        let cfg = Config::from_value(json!({
            "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": gather}
        }))
        .unwrap();
        let mut engine = Engine::new(&vs, cfg, Box::new(comm), EngineOptions::default().units_of(&model)).unwrap();
        tch::manual_seed(1234);
        let tag = engine.save_checkpoint(&dir, None).unwrap();
        let after_save = Tensor::randn([8], (Kind::Float, tch::Device::Cpu));
        let _ = Tensor::randn([100], (Kind::Float, tch::Device::Cpu));
        engine.load_checkpoint(&dir, None).unwrap();
        let after_load = Tensor::randn([8], (Kind::Float, tch::Device::Cpu));
        assert_eq!(
            Vec::<f32>::try_from(after_load).unwrap(),
            Vec::<f32>::try_from(after_save).unwrap(),
            "stage {stage}: the generator resumes where it was saved"
        );
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(tag.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(manifest["rng_states"].as_array().unwrap().len(), 1);
        assert_eq!(manifest["params"][0]["dtype"], "F32");
        let weights = tag.join("model.safetensors");
        if stage < 3 || gather {
            assert_eq!(manifest["model_weights"], "model.safetensors");
            let mut saved: Vec<(String, Vec<f32>)> = Tensor::read_safetensors(&weights)
                .unwrap()
                .into_iter()
                .map(|(n, t)| (n, Vec::<f32>::try_from(t.reshape([-1])).unwrap()))
                .collect();
            saved.sort_by(|a, b| a.0.cmp(&b.0));
            let full = full_parameters(&mut engine);
            assert_eq!(saved, full, "stage {stage}: model.safetensors holds the full weights");
        } else {
            assert!(!weights.exists());
            assert!(
                manifest["model_weights"].as_str().unwrap().starts_with("absent: stage 3 without"),
                "{}",
                manifest["model_weights"]
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
