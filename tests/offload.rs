//! Optimizer states off the process's working memory: `offload_optimizer.device = cpu` and `nvme` give the
//! parameters of the in-memory run bitwise (stages 1-3, fp32 and bf16, many sub-groups), as do parameters on NVMe
//! (`offload_param`, stage 3: read ahead, `max_in_cpu`, `buffer_size`), checkpoints of an NVMe
//! run resume bitwise, a full filesystem fails at start-up by name, a swap file removed mid-run is an error
//! naming it, no swap file outlives its engine, and NVMe offload lowers the peak RSS of a real run.
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use tch::{Kind, Tensor};
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions};

#[path = "common/compare.rs"]
mod compare;
use compare::full_parameters;

#[path = "common/mlp.rs"]
mod mlp;

#[path = "common/examples.rs"]
mod examples;
use mlp::*;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("zerorun-offload-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(stage: u8, bf16: bool, offload: Value) -> Config {
    zero_config(stage, bf16, json!({"offload_optimizer": offload}))
}

/// The test's config with `extra` keys added to `zero_optimization`.
fn zero_config(stage: u8, bf16: bool, extra: Value) -> Config {
    let mut zero = json!({"stage": stage, "stage3_param_persistence_threshold": 0, "sub_group_size": 37});
    for (k, v) in extra.as_object().unwrap() {
        zero[k] = v.clone();
    }
    Config::from_value(json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 2, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "bf16": {"enabled": bf16},
        "aio": {"block_size": 8192, "queue_depth": 2, "intra_op_parallelism": 2},
        "zero_optimization": zero
    }))
    .unwrap()
}

type Params = Vec<(String, Vec<f32>)>;

/// Trains 2 thread ranks for `steps` (saving or resuming a checkpoint in `ckpt` when given) and returns rank 0's
/// full parameters.
fn train(config: Config, steps: i64, save_at: Option<(&Path, i64)>, resume: Option<&Path>) -> Result<Params, String> {
    let (xv, yv) = data();
    let comms = threads::group(2, Duration::from_secs(60));
    let bf16 = config.bf16.enabled;
    let mut out: Vec<Result<Params, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (config, xv, yv) = (config.clone(), &xv, &yv);
                s.spawn(move || -> Result<Params, String> {
                    let (mut vs, model) = init_layers(&[IN, HIDDEN, HIDDEN, OUT]);
                    if bf16 {
                        vs.bfloat16();
                    }
                    let x = Tensor::from_slice(xv).view([SAMPLES, IN]).to_kind(if bf16 {
                        Kind::BFloat16
                    } else {
                        Kind::Float
                    });
                    let y = Tensor::from_slice(yv).view([SAMPLES, OUT]);
                    let mut engine =
                        Engine::new(&vs, config, Box::new(comm), EngineOptions::default().units_of(&model))
                            .map_err(|e| e.to_string())?;
                    if let Some(dir) = resume {
                        engine.load_checkpoint(dir, None).map_err(|e| e.to_string())?;
                    }
                    let rank = engine.rank();
                    for step in engine.global_steps() as i64..steps {
                        let order = batch_indices(step);
                        for m in 0..2usize {
                            let first = (m * 2 + rank) * 3;
                            let idx = Tensor::from_slice(&order[first..first + 3]);
                            let pred = engine
                                .forward(&model, &x.index_select(0, &idx))
                                .map_err(|e| e.to_string())?
                                .to_kind(Kind::Float);
                            let loss = pred.mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
                            engine.backward_units(&model, &loss).map_err(|e| e.to_string())?;
                            engine.step().map_err(|e| e.to_string())?;
                        }
                        if let Some((dir, at)) = save_at {
                            if engine.global_steps() as i64 == at {
                                engine.save_checkpoint(dir, None).map_err(|e| e.to_string())?;
                            }
                        }
                    }
                    Ok(full_parameters(&mut engine))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    out.remove(0)
}

fn files_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
}

#[test]
fn offloaded_runs_are_bitwise_the_in_memory_run() {
    let swap = tmp("bitwise");
    for stage in [1u8, 2, 3] {
        for bf16 in [false, true] {
            let memory = train(config(stage, bf16, json!({})), 6, None, None).unwrap();
            let cpu = train(config(stage, bf16, json!({"device": "cpu"})), 6, None, None).unwrap();
            assert_eq!(cpu, memory, "cpu offload, stage {stage}, bf16 {bf16}");
            let nvme = train(
                config(stage, bf16, json!({"device": "nvme", "nvme_path": swap, "buffer_count": 3})),
                6,
                None,
                None,
            )
            .unwrap();
            assert_eq!(nvme, memory, "nvme offload, stage {stage}, bf16 {bf16}");
            assert!(files_in(&swap).is_empty(), "swap files are removed with the engine: {:?}", files_in(&swap));
        }
    }
    // Without pipelining the result is the same.
    let plain = train(
        config(2, false, json!({"device": "nvme", "nvme_path": swap, "pipeline_read": false, "pipeline_write": false})),
        6,
        None,
        None,
    )
    .unwrap();
    assert_eq!(plain, train(config(2, false, json!({})), 6, None, None).unwrap());
    std::fs::remove_dir_all(&swap).unwrap();
}

#[test]
fn an_nvme_run_checkpoints_and_resumes_bitwise() {
    let (swap, ck) = (tmp("ckswap"), tmp("ck"));
    let nvme = || config(2, false, json!({"device": "nvme", "nvme_path": swap}));
    let straight = train(nvme(), 8, Some((&ck, 4)), None).unwrap();
    let resumed = train(nvme(), 8, None, Some(&ck)).unwrap();
    assert_eq!(resumed, straight);
    // The checkpoint loads into an in-memory run too (same format).
    assert_eq!(train(config(2, false, json!({})), 8, None, Some(&ck)).unwrap(), straight);
    assert!(files_in(&swap).is_empty());
    std::fs::remove_dir_all(&swap).unwrap();
    std::fs::remove_dir_all(&ck).unwrap();
}

#[test]
fn parameters_on_nvme_train_bitwise_like_in_memory() {
    let swap = tmp("params");
    for bf16 in [false, true] {
        let memory = train(zero_config(3, bf16, json!({})), 6, None, None).unwrap();
        // Every unit on NVMe; two buffers (a read-ahead window of one unit) and five; with the comm thread
        // prefetching all-gathers (which take their chunks from the reads started ahead) and without.
        for (buffers, overlap) in [(2, false), (5, false), (2, true), (5, true)] {
            let offload = json!({"device": "nvme", "nvme_path": swap, "max_in_cpu": 0, "buffer_count": buffers});
            let nvme =
                train(zero_config(3, bf16, json!({"offload_param": offload, "overlap_comm": overlap})), 6, None, None)
                    .unwrap();
            assert_eq!(nvme, memory, "parameters on NVMe, bf16 {bf16}, {buffers} buffers, overlap_comm {overlap}");
            assert!(files_in(&swap).is_empty(), "swap files are removed with the engine: {:?}", files_in(&swap));
        }
        // Units 0 and 2 in host memory (max_in_cpu: their chunks are 72 and 26 elements), unit 1 on NVMe, with
        // the optimizer states on NVMe too.
        let both = json!({
            "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 100},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap}
        });
        assert_eq!(
            train(zero_config(3, bf16, both), 6, None, None).unwrap(),
            memory,
            "parameters and optimizer on NVMe, bf16 {bf16}"
        );
        assert!(files_in(&swap).is_empty());
    }
    std::fs::remove_dir_all(&swap).unwrap();
}

#[test]
fn a_run_with_parameters_on_nvme_checkpoints_and_resumes_bitwise() {
    let (swap, ck) = (tmp("pckswap"), tmp("pck"));
    for bf16 in [false, true] {
        let nvme =
            || zero_config(3, bf16, json!({"offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0}}));
        let straight = train(nvme(), 8, Some((&ck, 4)), None).unwrap();
        assert_eq!(train(nvme(), 8, None, Some(&ck)).unwrap(), straight, "bf16 {bf16}");
        // The same checkpoint resumes in memory.
        assert_eq!(train(zero_config(3, bf16, json!({})), 8, None, Some(&ck)).unwrap(), straight, "bf16 {bf16}");
        std::fs::remove_dir_all(&ck).unwrap();
        std::fs::create_dir_all(&ck).unwrap();
    }
    assert!(files_in(&swap).is_empty());
    std::fs::remove_dir_all(&swap).unwrap();
    std::fs::remove_dir_all(&ck).unwrap();
}

/// A one-rank stage-3 engine over the MLP with `offload_param`.
fn one_rank_stage3(offload_param: Value) -> Result<(Engine, Layers), zerorun::Error> {
    let comm = threads::group(1, Duration::from_secs(10)).pop().unwrap();
    let (vs, model) = init_layers(&[IN, HIDDEN, HIDDEN, OUT]);
    let cfg = Config::from_value(json!({
        "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": offload_param}
    }))
    .unwrap();
    let engine = Engine::new(&vs, cfg, Box::new(comm), EngineOptions::default().units_of(&model))?;
    Ok((engine, model))
}

fn category(engine: &Engine, name: &str) -> usize {
    engine.memory_bytes().into_iter().find(|(n, _)| n.name() == name).unwrap().1
}

#[test]
fn parameters_on_nvme_leave_memory_and_max_in_cpu_keeps_them() {
    let swap = tmp("pmem");
    let shard_bytes = 4 * (IN * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT) as usize;
    let (engine, _) =
        one_rank_stage3(json!({"device": "nvme", "nvme_path": swap, "max_in_cpu": 0, "buffer_count": 3})).unwrap();
    assert_eq!(category(&engine, "parameters_nvme"), shard_bytes);
    // What stays in memory is the idle swap buffers (at most 3 pages here), counted apart from the parameters.
    assert_eq!(category(&engine, "parameters"), 0);
    assert!(category(&engine, "offload_buffers") <= 3 * 4096, "{}", category(&engine, "offload_buffers"));
    assert_eq!(files_in(&swap).len(), 3, "one swap file per unit: {:?}", files_in(&swap));
    drop(engine);
    // The default max_in_cpu (1e9 elements) keeps a small model's shard in host memory: no file at all.
    let (engine, _) = one_rank_stage3(json!({"device": "nvme", "nvme_path": swap})).unwrap();
    assert_eq!((category(&engine, "parameters_nvme"), category(&engine, "parameters")), (0, shard_bytes));
    assert!(files_in(&swap).is_empty());
    drop(engine);
    // A swap buffer must hold the largest unit's shard.
    let e = one_rank_stage3(json!({"device": "nvme", "nvme_path": swap, "max_in_cpu": 0, "buffer_size": 100}))
        .err()
        .unwrap()
        .to_string();
    let largest = HIDDEN * HIDDEN + HIDDEN;
    assert_eq!(
        e,
        format!("`zero_optimization.offload_param.buffer_size`: 100 is not allowed: at least the largest unit's shard on this rank, {largest} elements (or split that unit)")
    );
    assert!(files_in(&swap).is_empty());
    std::fs::remove_dir_all(&swap).unwrap();
}

#[test]
fn a_removed_parameter_swap_file_is_an_error_naming_it() {
    let swap = tmp("premoved");
    let (mut engine, model) = one_rank_stage3(json!({"device": "nvme", "nvme_path": swap, "max_in_cpu": 0})).unwrap();
    let victim = swap.join(files_in(&swap).into_iter().min().unwrap());
    std::fs::remove_file(&victim).unwrap();
    let x = Tensor::ones([4, IN], (Kind::Float, tch::Device::Cpu));
    let Err(e) = engine.forward(&model, &x) else { panic!("the unit's chunk cannot be read") };
    let e = e.to_string();
    assert!(e.contains(&victim.display().to_string()) && e.contains("the swap file is gone"), "{e}");
    drop(engine);
    assert!(files_in(&swap).is_empty(), "{:?}", files_in(&swap));
    std::fs::remove_dir_all(&swap).unwrap();
}

#[test]
fn a_removed_swap_file_is_an_error_naming_it_and_nothing_stays_behind() {
    let swap = tmp("removed");
    let comm = threads::group(1, Duration::from_secs(10)).pop().unwrap();
    let (vs, model) = init_layers(&[IN, HIDDEN, HIDDEN, OUT]);
    let cfg = Config::from_value(json!({
        "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 1, "sub_group_size": 100, "offload_optimizer": {"device": "nvme", "nvme_path": swap}}
    }))
    .unwrap();
    let mut engine = Engine::new(&vs, cfg, Box::new(comm), EngineOptions::default().units_of(&model)).unwrap();
    let x = Tensor::ones([4, IN], (Kind::Float, tch::Device::Cpu));
    let step = |engine: &mut Engine| -> Result<(), String> {
        let loss = engine.forward(&model, &x).map_err(|e| e.to_string())?.square().mean(Kind::Float);
        engine.backward_units(&model, &loss).map_err(|e| e.to_string())?;
        engine.step().map(|_| ()).map_err(|e| e.to_string())
    };
    step(&mut engine).unwrap();
    let files = files_in(&swap);
    assert!(!files.is_empty(), "the states are on disk");
    let victim = swap.join(files.iter().min().unwrap());
    std::fs::remove_file(&victim).unwrap();
    let e = step(&mut engine).unwrap_err();
    assert!(e.contains(&victim.display().to_string()) && e.contains("the swap file is gone"), "{e}");
    drop(engine);
    assert!(files_in(&swap).is_empty(), "no stray swap files after the error: {:?}", files_in(&swap));
    std::fs::remove_dir_all(&swap).unwrap();
}

#[test]
fn a_full_filesystem_fails_at_start_up_naming_nvme_path() {
    let mnt = tmp("full");
    // A 1 MiB tmpfs (root, as CI runs); the states of this model (2 x 4 bytes x ~5000 params per rank of one)
    // plus the margin do not fit.
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&mnt)
        .status()
        .is_ok_and(|s| s.success());
    let comm = threads::group(1, Duration::from_secs(10)).pop().unwrap();
    let (vs, model) = init_layers(&[IN, 256, 256, OUT]);
    let cfg = Config::from_value(json!({
        "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": mnt}}
    }))
    .unwrap();
    let result = Engine::new(&vs, cfg, Box::new(comm), EngineOptions::default().units_of(&model));
    if mounted {
        let e = result.expect_err("the preflight refuses a full filesystem").to_string();
        assert!(e.starts_with(&format!("nvme_path {}: needs ", mnt.display())) && e.contains("free"), "{e}");
        assert!(files_in(&mnt).is_empty(), "nothing left on the small filesystem");
        let _ = std::process::Command::new("umount").arg(&mnt).status();
    } else {
        // Without the right to mount: the same check against this filesystem's real free space.
        eprintln!("mount not permitted here; checking the preflight against the free space instead");
        drop(result);
        let free = zerorun::offload::preflight::free_bytes(&mnt).unwrap();
        let e = zerorun::offload::preflight::check(&mnt, free).unwrap_err().to_string();
        assert!(e.starts_with(&format!("nvme_path {}: needs ", mnt.display())), "{e}");
    }
    std::fs::remove_dir_all(&mnt).unwrap();
}

/// The example program's peak RSS with the given offload section (a fresh process per run).
fn peak_rss(mlp: &Path, dir: &Path, offload: Value) -> u64 {
    let cfg = dir.join(format!("cfg-{}.json", offload.get("device").and_then(|d| d.as_str()).unwrap_or("none")));
    std::fs::write(
        &cfg,
        json!({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 1, "sub_group_size": 250000, "offload_optimizer": offload}})
        .to_string(),
    )
    .unwrap();
    let out = std::process::Command::new(mlp)
        .args([
            "--config",
            cfg.to_str().unwrap(),
            "--steps",
            "2",
            "--in",
            "1024",
            "--hidden",
            "4096",
            "--layers",
            "4",
            "--out",
            "8",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("peak_rss_bytes "))
        .expect("the example prints its peak RSS")
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn nvme_offload_lowers_peak_rss_by_most_of_the_optimizer_states() {
    let mlp = examples::example("mlp");
    let dir = tmp("rss");
    let swap = dir.join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    // 1024*4096 + 2*4096*4096 + 4096*8 weights: ~37.8M parameters, 302 MB of Adam moments (large beside the
    // allocator's and the threads' noise of ~15 MB), in sub-groups of 250k elements (2 MB of state each).
    let params: u64 = 1024 * 4096 + 4096 + 2 * (4096 * 4096 + 4096) + 4096 * 8 + 8;
    let state_bytes = 8 * params;
    let in_memory = peak_rss(&mlp, &dir, json!({}));
    let on_nvme = peak_rss(&mlp, &dir, json!({"device": "nvme", "nvme_path": swap, "buffer_count": 4}));
    let saved = in_memory.saturating_sub(on_nvme);
    assert!(
        saved as f64 >= 0.8 * state_bytes as f64,
        "peak RSS {in_memory} in memory vs {on_nvme} with NVMe: saved {saved} bytes, want >= 80% of the {state_bytes} bytes of optimizer states"
    );
    assert!(files_in(&swap).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With parameters and optimizer states on NVMe the model states measured equal the estimate (what lives on NVMe
/// counts there, once), the tiers' host buffers are a category of their own, and a report's unaccounted bytes
/// leave out what is on NVMe.
#[test]
fn nvme_states_count_once_and_stay_out_of_the_resident_sum() {
    let swap = tmp("nvme-sums");
    let comm = threads::group(1, Duration::from_secs(10)).pop().unwrap();
    let (vs, model) = init_layers(&[IN, HIDDEN, HIDDEN, OUT]);
    let nvme = json!({"device": "nvme", "nvme_path": swap});
    let cfg = Config::from_value(json!({
        "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1000,
            "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0}, "offload_optimizer": nvme}
    }))
    .unwrap();
    let engine = Engine::new(&vs, cfg, Box::new(comm), EngineOptions::default().units_of(&model)).unwrap();
    let report = engine.memory_report();
    let (measured, estimated) = (report.model_states.measured_bytes, report.model_states.estimated_bytes);
    assert!((measured as f64 / estimated as f64 - 1.0).abs() < 0.01, "measured {measured}, estimate {estimated}");
    assert_eq!(category(&engine, "optimizer_states"), 0);
    assert!(category(&engine, "optimizer_states_nvme") > 0 && category(&engine, "parameters_nvme") > 0);
    assert!(category(&engine, "offload_buffers") > 0);
    let nvme_bytes = (category(&engine, "optimizer_states_nvme") + category(&engine, "parameters_nvme")) as u64;
    let sample = zerorun::runtime::report::memory::EventSample {
        step: 1,
        event: "x".into(),
        rss_bytes: 1 << 30,
        categories: engine.memory_bytes().into_iter().map(|(c, b)| (c.name().to_string(), b as u64)).collect(),
    };
    let resident: u64 = sample.categories.values().sum::<u64>() - nvme_bytes;
    assert_eq!(sample.unaccounted_bytes(0), (1i64 << 30) - resident as i64);
    drop(engine);
    std::fs::remove_dir_all(&swap).unwrap();
}
