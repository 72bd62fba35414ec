//! Communication compression: DeepSpeed's 1-bit optimizers (`OneBitAdam`, `ZeroOneAdam`) at stage 0 on thread ranks.
//! During 1-bit Adam's warm-up (`freeze_step`) the run is AdamW on averaged gradients; after it only the momentum
//! travels, as signs, and every rank still ends each step with bitwise the same parameters; 0/1 Adam's local steps
//! (after `var_freeze_step`, meetings at intervals doubling every `local_step_scaler` steps up to
//! `local_step_clipper`) leave the ranks apart between meetings, where a checkpoint is refused. The error feedback
//! and the schedules are saved per rank (`rank_state_files`): a resume equals the uninterrupted run bitwise at the
//! same world size, and at another one (`bias_correction` as given) it runs with fresh errors. Error feedback is
//! what makes sign compression converge: without it the averaged signs stop short of a least-squares optimum.
use serde_json::{json, Value};
use zerorun::runtime::comm::signs::{self, SignErrors};
use zerorun::runtime::comm::Communicator;
use zerorun::{Config, Engine, EngineOptions, StepOutcome};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

#[path = "common/compare.rs"]
mod compare;
use compare::max_relative_difference;

#[path = "common/json.rs"]
mod json;

#[path = "common/examples.rs"]
mod examples;

const RANKS: usize = 3;

/// A fresh folder for a checkpoint, this test's own.
fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zerorun-compression-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn config(optimizer: Value, extra: Value) -> Config {
    let base = json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_clipping": CLIP,
        "optimizer": optimizer,
        "zero_optimization": {"stage": 0},
    });
    Config::from_value(json::merged(base, &extra)).unwrap()
}

fn one_bit_adam(freeze_step: u64) -> Value {
    json!({"type": "OneBitAdam", "params": {"lr": LR, "weight_decay": WD, "freeze_step": freeze_step}})
}

fn zero_one_adam() -> Value {
    json!({"type": "ZeroOneAdam", "params": {
        "lr": LR, "weight_decay": WD, "var_freeze_step": 6, "var_update_scaler": 2,
        "local_step_scaler": 2, "local_step_clipper": 4,
    }})
}

/// What a run on `ranks` thread ranks ends with: every rank's parameters, and rank 0's step losses.
struct Run {
    params: Vec<Vec<(String, Vec<f32>)>>,
    losses: Vec<f64>,
    saved: Vec<Result<(), String>>,
}

/// Steps `steps` of the MLP on `ranks` thread ranks, loading `load` first and saving into `save` at the end.
fn train(
    config: &Config,
    ranks: usize,
    steps: std::ops::Range<i64>,
    load: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
) -> Run {
    let out = on_thread_ranks(ranks, |comm, x, y| {
        let rank = comm.rank();
        let (vs, model) = init_store();
        let mut engine = Engine::new(&vs, config.clone(), Box::new(comm), EngineOptions::default()).unwrap();
        if let Some(dir) = load {
            engine.load_checkpoint(dir, None).unwrap();
        }
        let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
        let mut losses = Vec::new();
        for step in steps.clone() {
            let rows = batch_indices(step);
            let first = rank * micro;
            let loss = loss_on(&model, &x, &y, &rows[first..first + micro]);
            engine.backward(&loss).unwrap();
            match engine.step().unwrap() {
                StepOutcome::Stepped { loss, .. } => losses.push(loss),
                other => panic!("step {step}: {other:?}"),
            }
        }
        let saved = match save {
            Some(dir) => engine.save_checkpoint(dir, None).map(|_| ()).map_err(|e| e.to_string()),
            None => Ok(()),
        };
        (params_of(&vs), losses, saved)
    });
    let losses = out[0].1.clone();
    let (params, saved) = out.into_iter().map(|(p, _, s)| (p, s)).unzip();
    Run { params, losses, saved }
}

fn bits(params: &[(String, Vec<f32>)]) -> Vec<u32> {
    params.iter().flat_map(|(_, v)| v.iter().map(|x| x.to_bits())).collect()
}

#[test]
fn one_bit_adam_before_freeze_step_is_adamw_on_averaged_gradients() {
    // The warm-up's update is DeepSpeed's `p -= lr (m̂ / (sqrt(v̂) + eps) + wd p)`: AdamW's, rounded differently.
    let run = train(&config(one_bit_adam(1000), json!({})), RANKS, 0..STEPS, None, None);
    let d = max_relative_difference(&run.params[0], &adamw_reference());
    assert!(d < 1e-5, "max relative difference to AdamW {d}");
}

#[test]
fn one_bit_adam_after_freeze_step_keeps_every_rank_bitwise_equal_and_still_learns() {
    let compressed = train(&config(one_bit_adam(4), json!({})), RANKS, 0..STEPS, None, None);
    for r in 1..RANKS {
        assert_eq!(bits(&compressed.params[r]), bits(&compressed.params[0]), "rank {r} differs from rank 0");
    }
    let exact = train(&config(one_bit_adam(1000), json!({})), RANKS, 0..STEPS, None, None);
    let (first, last) = (compressed.losses[0], *compressed.losses.last().unwrap());
    assert!(last < 0.9 * first, "the loss went from {first} to {last} in {STEPS} steps");
    // The compressed run follows the uncompressed one: its mean loss over the last 5 steps within 10%.
    let tail = |l: &[f64]| l[l.len() - 5..].iter().sum::<f64>() / 5.0;
    let (c, e) = (tail(&compressed.losses), tail(&exact.losses));
    assert!((c - e).abs() < 0.1 * e, "mean of the last 5 losses {c}, uncompressed {e}");
    // And it really is compressed: the parameters are not the uncompressed run's.
    assert_ne!(bits(&compressed.params[0]), bits(&exact.params[0]));
}

#[test]
fn one_bit_adam_at_stage_1_exchanges_the_gradient_and_the_change_as_signs() {
    let stage1 = json!({"zero_optimization": {"stage": 1}});
    // Before freeze_step: stage 1's AdamW.
    let warm = train(&config(one_bit_adam(1000), stage1.clone()), RANKS, 0..STEPS, None, None);
    let d = max_relative_difference(&warm.params[0], &adamw_reference());
    assert!(d < 1e-5, "max relative difference to AdamW {d}");
    let cfg = config(one_bit_adam(4), stage1.clone());
    let compressed = train(&cfg, RANKS, 0..STEPS, None, None);
    for r in 1..RANKS {
        assert_eq!(bits(&compressed.params[r]), bits(&compressed.params[0]), "rank {r} differs from rank 0");
    }
    let exact = train(&config(one_bit_adam(1000), stage1.clone()), RANKS, 0..STEPS, None, None);
    assert_ne!(bits(&compressed.params[0]), bits(&exact.params[0]));
    let tail = |l: &[f64]| l[l.len() - 5..].iter().sum::<f64>() / 5.0;
    let (c, e) = (tail(&compressed.losses), tail(&exact.losses));
    assert!(c < 0.9 * compressed.losses[0] && (c - e).abs() < 0.1 * e, "last 5 losses {c}, uncompressed {e}");
    // The errors are saved per rank: a resume at step 12 is the whole run.
    let dir = tempdir("stage1");
    train(&cfg, RANKS, 0..12, None, Some(&dir));
    let resumed = train(&cfg, RANKS, 12..STEPS, Some(&dir), None);
    assert_eq!(bits(&resumed.params[0]), bits(&compressed.params[0]), "resumed at step 12");
    // 16-bit models are refused at stage 1, by name.
    let bf16 = config(one_bit_adam(4), json!({"zero_optimization": {"stage": 1}, "bf16": {"enabled": true}}));
    let e = on_thread_ranks(2, |comm, _, _| {
        let (mut vs, _) = init_store();
        vs.bfloat16();
        Engine::new(&vs, bf16.clone(), Box::new(comm), EngineOptions::default()).err().map(|e| e.to_string())
    });
    assert!(e[0].as_deref().is_some_and(|e| e.contains("optimizer.type") && e.contains("fp32 master")), "{e:?}");
}

#[test]
fn zero_one_adam_ranks_differ_between_meetings_and_agree_after_them() {
    // var_freeze_step 6, then meetings after steps 7, 8 (interval 1), 10 (interval 2), 12, 16, 20 (interval 4).
    let cfg = config(zero_one_adam(), json!({}));
    let dir = tempdir("between");
    let between = train(&cfg, RANKS, 0..19, None, Some(&dir));
    assert_ne!(bits(&between.params[1]), bits(&between.params[0]), "after step 19 the ranks took local steps");
    let refused = between.saved[0].as_ref().unwrap_err();
    assert!(refused.contains("ZeroOneAdam: after 19 steps the ranks are between local-step meetings"), "{refused}");
    let met = train(&cfg, RANKS, 0..20, None, None);
    for r in 1..RANKS {
        assert_eq!(bits(&met.params[r]), bits(&met.params[0]), "rank {r} after the meeting of step 20");
    }
    let (first, last) = (met.losses[0], *met.losses.last().unwrap());
    assert!(last < 0.9 * first, "the loss went from {first} to {last}");
}

#[test]
fn a_resume_continues_bitwise_at_the_same_world_size_and_runs_at_another() {
    for optimizer in [one_bit_adam(1000), one_bit_adam(4), zero_one_adam()] {
        let cfg = config(optimizer.clone(), json!({}));
        let whole = train(&cfg, RANKS, 0..STEPS, None, None);
        let dir = tempdir(optimizer["type"].as_str().unwrap());
        // Step 12 ends with a meeting for 0/1 Adam.
        let first = train(&cfg, RANKS, 0..12, None, Some(&dir));
        assert!(first.saved.iter().all(Result::is_ok), "{:?}", first.saved);
        let files: Vec<String> = std::fs::read_dir(dir.join("global_step12"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        for r in 0..RANKS {
            assert!(files.contains(&format!("optimizer_rank{r}.safetensors")), "{files:?}");
        }
        let resumed = train(&cfg, RANKS, 12..STEPS, Some(&dir), None);
        assert_eq!(bits(&resumed.params[0]), bits(&whole.params[0]), "{optimizer}: resumed at step 12");
        // Two ranks: the error feedback restarts at zero, the run goes on and still learns.
        let two = Config::from_value(json::merged(cfg.to_value(), &json!({"train_batch_size": 12}))).unwrap();
        let other = train(&two, 2, 12..STEPS, Some(&dir), None);
        assert!(other.losses.iter().all(|l| l.is_finite()));
        assert_eq!(bits(&other.params[0]), bits(&other.params[1]));
    }
}

fn lamb(kind: &str, freeze_step: u64) -> Value {
    let mut params = json!({"lr": LR, "weight_decay": WD, "max_coeff": 10.0, "min_coeff": 0.01});
    if kind == "OneBitLamb" {
        params["freeze_step"] = json!(freeze_step);
        params["coeff_beta"] = json!(0.5);
        params["factor_max"] = json!(4.0);
        params["factor_min"] = json!(0.5);
        params["factor_threshold"] = json!(0.1);
    }
    json!({"type": kind, "params": params})
}

#[test]
fn one_bit_lamb_before_freeze_step_is_lamb_and_after_it_keeps_ranks_equal_and_learns() {
    // Lamb runs at stage 0 (a group per tensor: its trust ratio is per tensor).
    let plain = train(&config(lamb("Lamb", 0), json!({})), RANKS, 0..STEPS, None, None);
    let warm = train(&config(lamb("OneBitLamb", 1000), json!({})), RANKS, 0..STEPS, None, None);
    let d = max_relative_difference(&warm.params[0], &plain.params[0]);
    assert!(d < 1e-5, "max relative difference to Lamb {d}");
    let one = train(&config(lamb("Lamb", 0), json!({})), 1, 0..STEPS, None, None);
    let d = max_relative_difference(&one.params[0], &plain.params[0]);
    assert!(d < 1e-5, "Lamb on one rank against three: {d}");
    let cfg = config(lamb("OneBitLamb", 4), json!({}));
    let compressed = train(&cfg, RANKS, 0..STEPS, None, None);
    for r in 1..RANKS {
        assert_eq!(bits(&compressed.params[r]), bits(&compressed.params[0]), "rank {r}");
    }
    assert_ne!(bits(&compressed.params[0]), bits(&warm.params[0]));
    let tail = |l: &[f64]| l[l.len() - 5..].iter().sum::<f64>() / 5.0;
    let (c, e) = (tail(&compressed.losses), tail(&plain.losses));
    // The trust ratio is frozen at its warm-up average (coeff_beta 0.5 over 4 steps, as DeepSpeed asks:
    // 1 / (1 - coeff_beta) <= freeze_step); 16 compressed steps on this small problem stay within 25% of Lamb.
    assert!(c < 0.9 * compressed.losses[0] && (c - e).abs() < 0.25 * e, "last 5 losses {c}, Lamb's {e}");
    let dir = tempdir("lamb");
    train(&cfg, RANKS, 0..12, None, Some(&dir));
    let resumed = train(&cfg, RANKS, 12..STEPS, Some(&dir), None);
    assert_eq!(bits(&resumed.params[0]), bits(&compressed.params[0]), "resumed at step 12");
}

fn adamw() -> Value {
    json!({"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}})
}

fn powersgd(start: u64, rank: u64) -> Value {
    json!({"gradient_compression": {"type": "powersgd", "matrix_approximation_rank": rank,
        "start_powerSGD_iter": start, "min_compression_rate": 1.5}})
}

#[test]
fn powersgd_before_start_powersgd_iter_is_the_plain_run_bitwise() {
    let plain = train(&config(adamw(), json!({})), RANKS, 0..STEPS, None, None);
    let waiting = train(&config(adamw(), powersgd(1000, 2)), RANKS, 0..STEPS, None, None);
    assert_eq!(bits(&waiting.params[0]), bits(&plain.params[0]));
}

#[test]
fn powersgd_keeps_every_rank_bitwise_equal_learns_and_resumes_bitwise() {
    let cfg = config(adamw(), powersgd(3, 2));
    let whole = train(&cfg, RANKS, 0..STEPS, None, None);
    for r in 1..RANKS {
        assert_eq!(bits(&whole.params[r]), bits(&whole.params[0]), "rank {r}");
    }
    let plain = train(&config(adamw(), json!({})), RANKS, 0..STEPS, None, None);
    assert_ne!(bits(&whole.params[0]), bits(&plain.params[0]), "the steps after the third were compressed");
    let tail = |l: &[f64]| l[l.len() - 5..].iter().sum::<f64>() / 5.0;
    let (c, e) = (tail(&whole.losses), tail(&plain.losses));
    assert!(c < 0.9 * whole.losses[0] && (c - e).abs() < 0.1 * e, "last 5 losses {c}, uncompressed {e}");
    // Error feedback, Q and the step count are saved per rank: the resumed run is the whole run.
    let dir = tempdir("powersgd");
    let first = train(&cfg, RANKS, 0..9, None, Some(&dir));
    assert!(first.saved.iter().all(Result::is_ok), "{:?}", first.saved);
    let resumed = train(&cfg, RANKS, 9..STEPS, Some(&dir), None);
    assert_eq!(bits(&resumed.params[0]), bits(&whole.params[0]));
}

/// PowerSGD at stage 1: until `start_powerSGD_iter` it is plain stage 1 (reduce-scatter) bitwise; after it the
/// whole gradient is averaged through the same low-rank factors as at stage 0 and each rank steps its partition, so
/// the run follows stage 0's PowerSGD run within rounding; ranks agree bitwise and a resume is bitwise. 16-bit
/// models are refused there by name.
#[test]
fn powersgd_at_stage_1_is_stage_0_powersgd_with_the_optimizer_sharded() {
    let stage1 = json!({"zero_optimization": {"stage": 1}});
    let waiting = json::merged(powersgd(1000, 2), &stage1);
    let plain = train(&config(adamw(), stage1.clone()), RANKS, 0..STEPS, None, None);
    let before = train(&config(adamw(), waiting), RANKS, 0..STEPS, None, None);
    assert_eq!(bits(&before.params[0]), bits(&plain.params[0]));
    let cfg = config(adamw(), json::merged(powersgd(3, 2), &stage1));
    let sharded = train(&cfg, RANKS, 0..STEPS, None, None);
    for r in 1..RANKS {
        assert_eq!(bits(&sharded.params[r]), bits(&sharded.params[0]), "rank {r}");
    }
    assert_ne!(bits(&sharded.params[0]), bits(&plain.params[0]), "the steps after the third were compressed");
    let stage0 = train(&config(adamw(), powersgd(3, 2)), RANKS, 0..STEPS, None, None);
    let d = max_relative_difference(&sharded.params[0], &stage0.params[0]);
    assert!(d < 1e-4, "max relative difference to stage 0's PowerSGD run {d}");
    let dir = tempdir("powersgd-stage1");
    train(&cfg, RANKS, 0..9, None, Some(&dir));
    let resumed = train(&cfg, RANKS, 9..STEPS, Some(&dir), None);
    assert_eq!(bits(&resumed.params[0]), bits(&sharded.params[0]), "resumed at step 9");
    let bf16 = config(
        adamw(),
        json::merged(powersgd(3, 2), &json!({"zero_optimization": {"stage": 1}, "bf16": {"enabled": true}})),
    );
    let e = on_thread_ranks(2, |comm, _, _| {
        let (mut vs, _) = init_store();
        vs.bfloat16();
        Engine::new(&vs, bf16.clone(), Box::new(comm), EngineOptions::default()).err().map(|e| e.to_string())
    });
    assert!(e[0].as_deref().is_some_and(|e| e.contains("gradient_compression.type") && e.contains("16-bit")), "{e:?}");
}

#[test]
fn every_powersgd_option_changes_the_run() {
    let run = |extra: Value| {
        let mut compression = powersgd(3, 2);
        for (k, v) in extra.as_object().unwrap() {
            compression["gradient_compression"][k] = v.clone();
        }
        bits(&train(&config(adamw(), compression), RANKS, 0..8, None, None).params[0])
    };
    let default = run(json!({}));
    for option in [
        json!({"use_error_feedback": false}),
        json!({"warm_start": false}),
        json!({"random_seed": 7}),
        json!({"orthogonalization_epsilon": 1e-3}),
        json!({"matrix_approximation_rank": 1}),
        json!({"start_powerSGD_iter": 5}),
        // Every matrix now too small to gain: all averaged whole, the plain run.
        json!({"min_compression_rate": 100.0}),
    ] {
        assert_ne!(run(option.clone()), default, "{option} changed nothing");
    }
}

#[test]
fn the_config_refuses_what_the_one_bit_optimizers_cannot_run_by_name() {
    let refused = |optimizer: Value, extra: Value| {
        let base = json!({"train_batch_size": 8, "optimizer": optimizer});
        Config::from_value(json::merged(base, &extra)).unwrap_err().to_string()
    };
    let e = refused(one_bit_adam(10), json!({"zero_optimization": {"stage": 2}}));
    assert!(e.contains("optimizer.type") && e.contains("OneBitAdam runs at ZeRO stage 0 or 1"), "{e}");
    let e = refused(zero_one_adam(), json!({"zero_optimization": {"stage": 1}}));
    assert!(e.contains("ZeroOneAdam runs at ZeRO stage 0 (this config has stage 1)"), "{e}");
    let e = refused(json!({"type": "OneBitAdam", "params": {"freeze_step": 0}}), json!({}));
    assert!(e.contains("optimizer.params.freeze_step"), "{e}");
    let e = refused(json!({"type": "OneBitAdam", "params": {"amsgrad": true}}), json!({}));
    assert!(e.contains("optimizer.params.amsgrad"), "{e}");
    let e = refused(json!({"type": "ZeroOneAdam", "params": {"max_grad_norm": 1.0}}), json!({}));
    assert!(e.contains("optimizer.params.max_grad_norm") && e.contains("gradient_clipping"), "{e}");
    let e = refused(json!({"type": "ZeroOneAdam", "params": {"local_step_clipper": 0}}), json!({}));
    assert!(e.contains("optimizer.params.local_step_clipper"), "{e}");
    let e = refused(json!({"type": "OneBitLamb", "params": {"factor_min": 5.0}}), json!({}));
    assert!(e.contains("optimizer.params.factor_min"), "{e}");
    let e = refused(json!({"type": "OneBitAdam", "params": {"comm_backend_name": "gloo"}}), json!({}));
    assert!(e.contains("optimizer.params.comm_backend_name"), "{e}");
    let e = refused(one_bit_adam(10), json!({"async_training": {"mode": "local_sgd", "sync_every": 2}}));
    assert!(e.contains("asynchronous training"), "{e}");
    let e = refused(adamw(), json!({"gradient_compression": {"type": "powersgd"}, "zero_optimization": {"stage": 2}}));
    assert!(e.contains("gradient_compression.type") && e.contains("stages 0 and 1"), "{e}");
    let e = refused(one_bit_adam(10), powersgd(0, 1));
    assert!(e.contains("gradient_compression.type") && e.contains("OneBitAdam compresses its own exchange"), "{e}");
    let e = refused(adamw(), json!({"gradient_compression": {"type": "powersgd", "matrix_approximation_rank": 0}}));
    assert!(e.contains("gradient_compression.matrix_approximation_rank"), "{e}");
    let e = refused(adamw(), json!({"gradient_compression": {"type": "powersgd", "min_compression_rate": 0.5}}));
    assert!(e.contains("gradient_compression.min_compression_rate"), "{e}");
    let e = refused(adamw(), json!({"gradient_compression": {"type": "powersgd", "orthogonalization_epsilon": -1.0}}));
    assert!(e.contains("gradient_compression.orthogonalization_epsilon"), "{e}");
    let e = refused(adamw(), json!({"gradient_compression": {"type": "powersgd"}, "prescale_gradients": true}));
    assert!(e.contains("prescale_gradients"), "{e}");
    let e = refused(adamw(), json!({"gradient_compression": {"type": "topk"}}));
    assert!(e.contains("gradient_compression.type"), "{e}");
    // DeepSpeed's own spellings are accepted, the GPU-only knobs with a notice.
    let c = Config::from_value(json!({"train_batch_size": 8, "optimizer": {"type": "onebitadam", "params": {
        "cuda_aware": true, "comm_backend_name": "mpi", "freeze_step": 3, "bias_correction": false}}}))
    .unwrap();
    let noticed: Vec<&str> = c.notices.iter().map(|n| n.path.as_str()).collect();
    assert!(
        noticed.contains(&"optimizer.params.cuda_aware") && noticed.contains(&"optimizer.params.comm_backend_name")
    );
    let e = refused(json!({"type": "OneBitLamb", "params": {}}), json!({"zero_optimization": {"stage": 2}}));
    assert!(e.contains("OneBitLamb runs at ZeRO stage 0"), "{e}");
}

/// The MLP example's final weights (`--save-final`) after 6 steps of `optimizer` and `extra` at stage `stage` on
/// three ranks started by `how`: threads in one process, or processes under `zerorun launch` (`--backend` given).
fn example_weights(how: Option<&str>, optimizer: Value, extra: Value, stage: u64, dir: &std::path::Path) -> Vec<u8> {
    let tag = format!("{}-{}-{stage}", how.unwrap_or("threads"), optimizer["type"].as_str().unwrap());
    let cfg = dir.join(format!("{tag}.json"));
    let base = json!({"train_batch_size": 12, "gradient_clipping": 1.0, "optimizer": optimizer,
        "zero_optimization": {"stage": stage}});
    std::fs::write(&cfg, json::merged(base, &extra).to_string()).unwrap();
    let out = dir.join(format!("{tag}.safetensors"));
    let mlp = examples::example("mlp");
    let mut cmd = match how {
        None => std::process::Command::new(&mlp),
        Some(backend) => {
            let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_zerorun"));
            c.args(["launch", "--nproc-per-node", "3", "--backend", backend, "--"]).arg(&mlp);
            c
        }
    };
    if how.is_none() {
        cmd.args(["--ranks", "3"]);
    }
    let o = cmd
        .args(["--config", cfg.to_str().unwrap(), "--steps", "6", "--seed", "3"])
        .args(["--in", "16", "--hidden", "48", "--layers", "4", "--out", "4"])
        .args(["--save-final", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{tag}: {}", String::from_utf8_lossy(&o.stderr));
    std::fs::read(&out).unwrap()
}

/// Threads and shm processes run the same collectives' arithmetic, so the compressed runs end bitwise equal. (gloo's
/// exact all-reduce sums in its own order, so the warm-up steps differ by rounding there; the 1-bit exchange itself
/// is bitwise the simulation's on every backend: the conformance suite, `tests/common/conformance.rs`.)
#[test]
fn the_compressed_runs_are_bitwise_the_same_on_threads_and_shm() {
    let dir = tempdir("backends");
    let one_bit = json!({"type": "OneBitAdam", "params": {"lr": 0.003, "weight_decay": 0.01, "freeze_step": 2}});
    let adamw = json!({"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}});
    let cases = [
        (one_bit.clone(), json!({}), 0),
        (one_bit, json!({}), 1),
        (
            adamw,
            json!({"gradient_compression": {"type": "powersgd", "matrix_approximation_rank": 2, "start_powerSGD_iter": 2, "min_compression_rate": 1.5}}),
            0,
        ),
    ];
    for (optimizer, extra, stage) in cases {
        let threads = example_weights(None, optimizer.clone(), extra.clone(), stage, &dir);
        let shm = example_weights(Some("shm"), optimizer.clone(), extra.clone(), stage, &dir);
        assert!(shm == threads, "shm differs from threads: {optimizer} {extra} at stage {stage}");
    }
}

/// `wall_clock_breakdown` line of the mlp example on 2 thread ranks: mean ms per step by phase name.
fn breakdown(
    optimizer: Value,
    extra: Value,
    dir: &std::path::Path,
    tag: &str,
) -> std::collections::HashMap<String, f64> {
    let cfg = dir.join(format!("{tag}.json"));
    let base = json!({"train_batch_size": 8, "optimizer": optimizer, "zero_optimization": {"stage": 0},
        "wall_clock_breakdown": true});
    std::fs::write(&cfg, json::merged(base, &extra).to_string()).unwrap();
    let o = std::process::Command::new(examples::example("mlp"))
        .args(["--config", cfg.to_str().unwrap(), "--ranks", "2", "--steps", "6"])
        .args(["--in", "64", "--hidden", "512", "--layers", "3", "--out", "4"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{tag}: {}", String::from_utf8_lossy(&o.stderr));
    let line = out.lines().find(|l| l.starts_with("wall_clock_breakdown")).unwrap_or_else(|| panic!("{tag}: {out}"));
    let (_, phases) = line.split_once("mean ms per step: ").unwrap();
    phases
        .split(", ")
        .map(|p| {
            let (name, ms) = p.rsplit_once(' ').unwrap();
            (name.to_string(), ms.parse().unwrap())
        })
        .collect()
}

/// The step-time breakdown keeps a compressed exchange's arithmetic apart from its wire time: a `compression`
/// phase that is zero without compression and holds the packing of signs and PowerSGD's products with it.
#[test]
fn the_breakdown_shows_the_compression_arithmetic_apart() {
    let dir = tempdir("breakdown");
    let adamw = json!({"type": "AdamW", "params": {"lr": 0.001}});
    let plain = breakdown(adamw.clone(), json!({}), &dir, "plain");
    assert_eq!(plain["compression"], 0.0, "{plain:?}");
    assert!(plain["reduce_scatter"] > 0.0, "{plain:?}");
    let one_bit = json!({"type": "OneBitAdam", "params": {"lr": 0.001, "freeze_step": 2}});
    let powersgd =
        json!({"gradient_compression": {"type": "powersgd", "matrix_approximation_rank": 2, "start_powerSGD_iter": 2}});
    for (tag, optimizer, extra) in [("one_bit", one_bit, json!({})), ("powersgd", adamw, powersgd)] {
        let phases = breakdown(optimizer, extra, &dir, tag);
        assert!(phases["compression"] > 0.0, "{tag}: {phases:?}");
        assert!(phases.values().all(|ms| ms.is_finite() && *ms >= 0.0), "{tag}: {phases:?}");
    }
}

/// Least squares split over two workers, min over x of sum_w |A_w x - b_w|^2 / 2n, by `steps` steps of gradient
/// descent (step size 0.4 / (1 + t/200)) on the averaged gradient: exactly, through the 1-bit average with error
/// feedback, and through it without (each call's errors thrown away: plain averaged signs). Returns the norm of the
/// averaged gradient at the end.
fn least_squares(exchange: Option<bool>, steps: usize) -> f64 {
    let (n, world, lr) = (64usize, 2usize, 0.4f32);
    let a = |w: usize, i: usize, j: usize| {
        (((i * 31 + j * 17 + w * 7) % 23) as f32 / 23.0 - 0.5) + if i == j { 8.0 } else { 0.0 }
    };
    let b = |w: usize, i: usize| ((i * 13 + w * 5) % 11) as f32 / 11.0 - 0.5 + w as f32;
    let grad = |w: usize, x: &[f32]| -> Vec<f32> {
        let r: Vec<f32> = (0..n).map(|i| (0..n).map(|j| a(w, i, j) * x[j]).sum::<f32>() - b(w, i)).collect();
        (0..n).map(|j| (0..n).map(|i| a(w, i, j) * r[i]).sum::<f32>() / n as f32).collect()
    };
    let norm = |x: &[f32]| {
        let g: Vec<f32> = (0..n).map(|j| (0..world).map(|w| grad(w, x)[j]).sum::<f32>() / world as f32).collect();
        g.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt()
    };
    let mut x = vec![0f32; n];
    let mut errors: Vec<SignErrors> = (0..world).map(|_| SignErrors::new(n, world)).collect();
    for t in 0..steps {
        let lr = lr / (1.0 + t as f32 / 200.0);
        let mut grads: Vec<Vec<f32>> = (0..world).map(|w| grad(w, &x)).collect();
        match exchange {
            None => {
                let avg: Vec<f32> = (0..n).map(|j| grads.iter().map(|g| g[j]).sum::<f32>() / world as f32).collect();
                grads = vec![avg; world];
            }
            Some(feedback) => {
                if !feedback {
                    errors.iter_mut().for_each(SignErrors::reset);
                }
                signs::simulate(&mut grads, &mut errors);
            }
        }
        for j in 0..n {
            x[j] -= lr * grads[0][j];
        }
    }
    norm(&x)
}

#[test]
fn error_feedback_is_what_makes_signs_converge() {
    // Karimireddy et al. 2019: compressed without error feedback, descent stalls away from the optimum; with it,
    // it reaches the optimum as the exact average does.
    let start = least_squares(None, 0);
    let exact = least_squares(None, 5000);
    let with_feedback = least_squares(Some(true), 5000);
    let without = least_squares(Some(false), 5000);
    assert!(exact < 1e-5 * start, "exact gradient descent ends with gradient norm {exact} (from {start})");
    assert!(
        with_feedback < 0.03 * start,
        "with error feedback the gradient norm ends at {with_feedback} (from {start})"
    );
    assert!(without > 0.25 * start, "without error feedback the gradient norm ends at {without} (from {start})");
    assert!(without > 10.0 * with_feedback, "without error feedback {without}, with it {with_feedback}");
}
