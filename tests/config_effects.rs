//! The effect of config keys no other test covered (the walk over every key, tests/config_keys.rs, names these
//! tests): each compares a run with the key against one without, or against an equivalent setting.
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tch::Tensor;
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions, StepOutcome};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

#[path = "common/compare.rs"]
mod compare;
use compare::max_relative_difference;
#[path = "common/json.rs"]
mod json;
use json::merged;

/// Runs `steps` steps of the MLP on `world` thread ranks with `config`; returns rank 0's parameters, outcomes and
/// the engine's collective volume.
type Trained = (Vec<(String, Vec<f32>)>, Vec<StepOutcome>, zerorun::runtime::engine::CommVolume);

fn train(world: usize, config: Value, steps: i64) -> Trained {
    let config = Config::from_value(config).unwrap();
    let mut runs = on_thread_ranks(world, |comm, x, y| {
        let (vs, model) = init_store();
        let mut engine = Engine::new(&vs, config.clone(), Box::new(comm), EngineOptions::default()).unwrap();
        let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
        let rank = engine.rank();
        let mut outcomes = Vec::new();
        for step in 0..steps {
            let rows = batch_indices(step);
            let loss = loss_on(&model, &x, &y, &rows[rank * micro..(rank + 1) * micro]);
            engine.backward(&loss).unwrap();
            outcomes.push(engine.step().unwrap());
        }
        (params_of(&vs), outcomes, engine.comm_volume())
    });
    runs.remove(0)
}

fn sgd(stage: u8, lr: f64, extra: Value) -> Value {
    merged(
        json!({
            "train_batch_size": GLOBAL_BATCH, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": true,
            "optimizer": {"type": "SGD", "params": {"lr": lr}},
            "zero_optimization": {"stage": stage},
        }),
        &extra,
    )
}

#[test]
fn gradient_allreduce_op_sum_sums_where_mean_averages() {
    // SGD: summing the 2 ranks' gradients at lr equals averaging them at 2 lr, bit for bit (both scale by 2).
    for stage in [0, 1, 2] {
        let (sum, _, _) = train(2, sgd(stage, 0.05, json!({"gradient_allreduce_op": "sum"})), 3);
        let (mean, _, _) = train(2, sgd(stage, 0.1, json!({})), 3);
        let (half, _, _) = train(2, sgd(stage, 0.05, json!({})), 3);
        assert_eq!(sum, mean, "stage {stage}: sum at lr vs mean at 2 lr");
        assert!(max_relative_difference(&sum, &half) > 1e-3, "stage {stage}: the op changed nothing");
    }
}

#[test]
fn predivide_and_prescale_reduce_to_the_same_mean() {
    // Stage 2 reduces through the unit path stage 3 uses.
    for stage in [0, 1, 2] {
        let base = json!({"train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": stage}});
        let (plain, _, _) = train(2, base.clone(), 4);
        for extra in [json!({"gradient_predivide_factor": 8.0}), json!({"prescale_gradients": true})] {
            let (scaled, _, _) = train(2, merged(base.clone(), &extra), 4);
            let d = max_relative_difference(&scaled, &plain);
            assert!(d <= 1e-6, "stage {stage} {extra}: {d:e}");
        }
    }
}

#[test]
fn reduce_scatter_off_all_reduces_to_the_same_result() {
    for stage in [1, 2] {
        let config = |rs: bool| json!({"train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": stage, "reduce_scatter": rs}});
        let (with, _, v_with) = train(2, config(true), 4);
        let (without, _, v_without) = train(2, config(false), 4);
        assert!(max_relative_difference(&without, &with) <= 1e-6, "stage {stage}");
        assert!(v_with.reduce_scatter_elements > 0 && v_with.all_reduce_elements == 0, "stage {stage}: {v_with:?}");
        assert!(
            v_without.reduce_scatter_elements == 0 && v_without.all_reduce_elements > 0,
            "stage {stage}: {v_without:?}"
        );
    }
}

#[test]
fn communication_data_type_changes_what_travels_not_what_trains() {
    for stage in [0, 1, 2] {
        let config = |comm: &str| json!({"train_batch_size": GLOBAL_BATCH, "communication_data_type": comm, "zero_optimization": {"stage": stage}});
        let (fp32, _, _) = train(2, config("fp32"), 4);
        let (bf16, _, _) = train(2, config("bf16"), 4);
        let d = max_relative_difference(&bf16, &fp32);
        // bf16 keeps 8 bits of mantissa: the gradients round, the weights stay close.
        assert!(d > 0.0 && d < 5e-2, "stage {stage}: fp32 model, bf16 gradients vs fp32 ones: {d:e}");
    }
}

#[test]
fn adam_bias_correction_off_takes_the_raw_moments() {
    let config = |bc: bool| json!({"train_batch_size": GLOBAL_BATCH, "gradient_clipping": 0.0, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": bc}}});
    let (start, _) = {
        let (vs, m) = init_store();
        (params_of(&vs), m)
    };
    let step = |bc| {
        let (after, _, _) = train(1, config(bc), 1);
        // The first step moves every weight by about lr (corrected) or lr (1 - b1) / sqrt(1 - b2) = 3.16 lr.
        let moved: Vec<f32> =
            after.iter().zip(&start).flat_map(|((_, a), (_, s))| a.iter().zip(s).map(|(x, y)| (x - y).abs())).collect();
        moved.iter().copied().fold(0f32, f32::max)
    };
    let (on, off) = (step(true), step(false));
    assert!((on - 1e-3).abs() < 1e-5, "bias-corrected first step {on}");
    assert!((off - 3.1623e-3).abs() < 1e-5, "uncorrected first step {off}");
}

#[test]
fn one_cycle_momentum_drives_beta1() {
    // A cycle whose momentum is 0.5 throughout is Adam with beta1 0.5; without cycling, beta1 stays the config's.
    let one_cycle = |cycle_momentum: bool| {
        json!({"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999]}},
               "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-2, "cycle_max_lr": 1e-2, "cycle_momentum": cycle_momentum, "cycle_min_mom": 0.5, "cycle_max_mom": 0.5}}})
    };
    let fixed = |beta1: f64| json!({"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [beta1, 0.999]}}});
    let (cycled, _, _) = train(1, one_cycle(true), 4);
    let (beta_half, _, _) = train(1, fixed(0.5), 4);
    let (not_cycled, _, _) = train(1, one_cycle(false), 4);
    let (beta_default, _, _) = train(1, fixed(0.9), 4);
    assert_eq!(cycled, beta_half);
    assert_eq!(not_cycled, beta_default);
    assert_ne!(cycled, not_cycled);
}

#[test]
fn bf16_check_grad_overflow_skips_a_step_with_a_non_finite_gradient() {
    let run = |check: bool| {
        let config = Config::from_value(
            json!({"train_batch_size": GLOBAL_BATCH, "bf16": {"enabled": true, "check_grad_overflow": check}}),
        )
        .unwrap();
        let mut runs = on_thread_ranks(2, |comm, x, y| {
            let (mut vs, model) = init_store();
            vs.bfloat16();
            let mut engine = Engine::new(&vs, config.clone(), Box::new(comm), EngineOptions::default()).unwrap();
            let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
            let rank = engine.rank();
            let x = x.to_kind(tch::Kind::BFloat16);
            let mut outcomes = Vec::new();
            for step in 0..3 {
                let rows = batch_indices(step);
                let mut loss = loss_on(&model, &x, &y, &rows[rank * micro..(rank + 1) * micro]);
                if step == 1 && rank == 1 {
                    loss *= f64::NAN;
                }
                engine.backward(&loss).unwrap();
                outcomes.push(engine.step().unwrap());
            }
            let finite = params_of(&vs).iter().all(|(_, v)| v.iter().all(|x| x.is_finite()));
            (outcomes, finite, engine.skipped_steps())
        });
        runs.remove(0)
    };
    let (outcomes, finite, skipped) = run(true);
    assert!(matches!(outcomes[1], StepOutcome::Skipped { step: 2, .. }), "{outcomes:?}");
    assert!(matches!(outcomes[2], StepOutcome::Stepped { step: 3, .. }), "{outcomes:?}");
    assert!(finite && skipped == 1);
    let (outcomes, finite, skipped) = run(false);
    assert!(matches!(outcomes[1], StepOutcome::Stepped { .. }), "{outcomes:?}");
    assert!(!finite && skipped == 0, "without the check the NaN reaches the weights");
}

#[test]
fn unused_parameters_are_an_error_when_not_ignored() {
    for (stage, units) in [(2, false), (2, true), (3, true)] {
        let config = Config::from_value(json!({"train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": stage, "ignore_unused_parameters": false, "stage3_param_persistence_threshold": 0}})).unwrap();
        let errors = on_thread_ranks(2, |comm, x, y| {
            let (vs, layers) = init_layers(&[IN, HIDDEN, HIDDEN, OUT]);
            let _ = vs.root().sub("layers").sub("2").var("unused", &[3], tch::nn::Init::Const(1.0));
            let options = if units { EngineOptions::default().units_of(&layers) } else { EngineOptions::default() };
            let mut engine = Engine::new(&vs, config.clone(), Box::new(comm), options).unwrap();
            let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
            let rows = &batch_indices(0)[engine.rank() * micro..(engine.rank() + 1) * micro];
            let idx = Tensor::from_slice(rows);
            let input = x.index_select(0, &idx);
            let out = if units { engine.forward(&layers, &input).unwrap() } else { layers.forward_all(&input) };
            let loss = out.mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
            engine.backward(&loss).err().map(|e| e.to_string())
        });
        for e in errors {
            let e = e.unwrap_or_else(|| panic!("stage {stage}, units {units}: no error"));
            assert_eq!(e, "parameter `layers.2.unused`: got no gradient in this backward (it took no part in the loss), and zero_optimization.ignore_unused_parameters is false");
        }
    }
    let c = Config::from_value(json!({"zero_optimization": {"stage": 1, "ignore_unused_parameters": false}})).unwrap();
    assert_eq!(
        c.notices.iter().map(|n| n.path.as_str()).collect::<Vec<_>>(),
        ["zero_optimization.ignore_unused_parameters"]
    );
}

#[test]
fn stage3_live_and_persistence_limits_bound_what_stays_gathered() {
    let gathered = |zero: Value| {
        let mut base = json!({"stage": 3, "stage3_max_reuse_distance": 1_000_000});
        base = merged(base, &zero);
        let config = Config::from_value(json!({"train_batch_size": GLOBAL_BATCH, "zero_optimization": base})).unwrap();
        let mut runs = on_thread_ranks(2, |comm, x, y| {
            let (vs, layers) = init_layers(&[IN, HIDDEN, HIDDEN, OUT]);
            let mut engine =
                Engine::new(&vs, config.clone(), Box::new(comm), EngineOptions::default().units_of(&layers)).unwrap();
            let at_start = engine.gathered_bytes().current;
            let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
            let idx = Tensor::from_slice(&batch_indices(0)[engine.rank() * micro..(engine.rank() + 1) * micro]);
            let loss = engine
                .forward(&layers, &x.index_select(0, &idx))
                .unwrap()
                .mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
            let after_forward = engine.gathered_bytes().current;
            engine.backward(&loss).unwrap();
            engine.step().unwrap();
            (at_start, after_forward)
        });
        runs.remove(0)
    };
    // Every unit is under the parameter threshold: all persist, unless the model threshold caps them.
    let (all, _) = gathered(json!({"stage3_param_persistence_threshold": 1_000_000}));
    let (capped, _) =
        gathered(json!({"stage3_param_persistence_threshold": 1_000_000, "stage3_model_persistence_threshold": 200}));
    let (none, _) = gathered(json!({"stage3_param_persistence_threshold": 0}));
    assert!(all > capped && capped > none && none == 0, "persistent bytes: {all} > {capped} > {none} = 0");
    // Forward keeps the units backward reuses first, unless the live limit says no.
    let (_, kept) = gathered(json!({"stage3_param_persistence_threshold": 0}));
    let (_, limited) = gathered(json!({"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1}));
    assert!(kept > limited, "gathered after forward: {kept} with the default live limit, {limited} with 1");
}

#[test]
fn checkpoint_tags_that_differ_across_ranks_follow_tag_validation() {
    let dir = std::env::temp_dir().join(format!("zerorun-tags-{}", std::process::id()));
    for mode in ["Fail", "Warn"] {
        let _ = std::fs::remove_dir_all(&dir);
        let config = Config::from_value(json!({"train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": 1}, "checkpoint": {"tag_validation": mode}})).unwrap();
        let results = on_thread_ranks(2, |comm, x, y| {
            let (vs, model) = init_store();
            let mut engine = Engine::new(&vs, config.clone(), Box::new(comm), EngineOptions::default()).unwrap();
            let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
            let rank = engine.rank();
            let loss = loss_on(&model, &x, &y, &batch_indices(0)[rank * micro..(rank + 1) * micro]);
            engine.backward(&loss).unwrap();
            engine.step().unwrap();
            let options = zerorun::SaveOptions { tag: Some(format!("tag-of-rank{rank}")), ..Default::default() };
            engine.save_checkpoint_with(&dir, &options).map_err(|e| e.to_string())
        });
        match mode {
            "Fail" => {
                for r in &results {
                    let e = r.as_ref().expect_err("different tags under Fail");
                    assert!(e.contains("checkpoint tags differ across ranks") && e.contains("\"tag-of-rank0\""), "{e}");
                }
                assert!(!dir.join("tag-of-rank0").exists() && !dir.join("tag-of-rank1").exists(), "nothing written");
            }
            _ => {
                for r in &results {
                    assert_eq!(r.as_ref().unwrap(), &dir.join("tag-of-rank0"));
                }
                assert!(dir.join("tag-of-rank0").join("manifest.json").exists() && !dir.join("tag-of-rank1").exists());
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Collects what `tracing` writes while `f` runs on this thread.
fn logged(f: impl FnOnce()) -> String {
    #[derive(Clone)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink(Arc::new(Mutex::new(Vec::new())));
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt().with_ansi(false).with_writer(move || writer.clone()).finish();
    tracing::subscriber::with_default(subscriber, f);
    let bytes = sink.0.lock().unwrap().clone();
    String::from_utf8(bytes).unwrap()
}

#[test]
fn steps_per_print_and_wall_clock_breakdown_log_on_rank_0() {
    let run = |extra: Value| {
        let config = Config::from_value(merged(json!({"train_batch_size": GLOBAL_BATCH}), &extra)).unwrap();
        logged(|| {
            let (x, y) = data();
            let (x, y) = (Tensor::from_slice(&x).view([SAMPLES, IN]), Tensor::from_slice(&y).view([SAMPLES, OUT]));
            let (vs, model) = init_store();
            let comm = threads::group(1, std::time::Duration::from_secs(10)).pop().unwrap();
            let mut engine = Engine::new(&vs, config, Box::new(comm), EngineOptions::default()).unwrap();
            for step in 0..4 {
                let loss = loss_on(&model, &x, &y, &batch_indices(step));
                engine.backward(&loss).unwrap();
                engine.step().unwrap();
            }
        })
    };
    let count = |text: &str, what: &str| text.lines().filter(|l| l.contains(what)).count();
    let quiet = run(json!({}));
    assert_eq!((count(&quiet, " train"), count(&quiet, "wall_clock_breakdown")), (0, 0), "{quiet}");
    let every2 = run(json!({"steps_per_print": 2}));
    assert_eq!((count(&every2, " train"), count(&every2, "wall_clock_breakdown")), (2, 0), "{every2}");
    let both = run(json!({"steps_per_print": 2, "wall_clock_breakdown": true}));
    assert_eq!((count(&both, " train"), count(&both, "wall_clock_breakdown")), (2, 2), "{both}");
}

#[test]
fn lamb_is_refused_at_initialize_so_its_own_keys_never_act() {
    // Lamb runs at stage 0 (tests/compression.rs); at stages 1-3 its per-tensor trust ratios are refused.
    let config = Config::from_value(json!({"train_batch_size": 4, "zero_allow_untested_optimizer": true,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "Lamb", "params": {"eps_inside_sqrt": true, "max_coeff": 5.0, "min_coeff": 0.1}}}))
    .unwrap();
    let (vs, _model) = init_store();
    let comm = threads::group(1, std::time::Duration::from_secs(10)).pop().unwrap();
    let err =
        Engine::new(&vs, config, Box::new(comm), EngineOptions::default()).expect_err("Lamb is refused").to_string();
    assert!(err.contains("optimizer.type"), "{err}");
}

#[test]
fn the_old_offload_pipeline_key_turns_on_both_directions() {
    let read = |pipeline: bool| {
        let c = Config::from_value(
            json!({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pipeline": pipeline}}}),
        )
        .unwrap();
        (c.zero_optimization.offload_optimizer.pipeline_read, c.zero_optimization.offload_optimizer.pipeline_write)
    };
    assert_eq!(read(true), (true, true));
    assert_eq!(read(false), (false, false));
}
