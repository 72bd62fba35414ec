//! `async_training`: local SGD and DiLoCo. With `sync_every` 1 and plain SGD, local SGD is the synchronous run
//! (averaging the parameters after a linear step is averaging the gradients before it); DiLoCo with an outer SGD of
//! lr 1 and no momentum is local SGD; with H > 1 the ranks really do step alone between meetings (their parameters
//! differ before a meeting and are equal after it), DiLoCo's outer Nesterov step is checked against its formula,
//! and the config refuses what these modes cannot run.
use serde_json::{json, Value};
use tch::Tensor;
use zerorun::runtime::comm::Communicator;
use zerorun::{Config, Engine, EngineOptions};

#[path = "common/examples.rs"]
mod examples;
#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

#[path = "common/compare.rs"]
mod compare;
use compare::max_relative_difference;

#[path = "common/json.rs"]
mod json;

const RANKS: usize = 3;

fn config(extra: Value) -> Config {
    let base = json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": 0},
    });
    Config::from_value(json::merged(base, &extra)).unwrap()
}

/// Every rank's parameters after `steps` optimizer steps, in rank order.
fn train(config: &Config, steps: i64) -> Vec<Vec<(String, Vec<f32>)>> {
    train_from(config, 0..steps, None, None)
}

/// `train` over `steps`, loading the checkpoint in `load` first and saving one into `save` at the end.
fn train_from(
    config: &Config,
    steps: std::ops::Range<i64>,
    load: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
) -> Vec<Vec<(String, Vec<f32>)>> {
    on_thread_ranks(RANKS, |comm, x, y| {
        let rank = comm.rank();
        let (vs, model) = init_store();
        let mut engine = Engine::new(&vs, config.clone(), Box::new(comm), EngineOptions::default()).unwrap();
        if let Some(dir) = load {
            engine.load_checkpoint(dir, None).unwrap();
        }
        let b = engine.batch_sizes();
        for step in steps.clone() {
            let rows = batch_indices(step);
            for m in 0..b.gradient_accumulation_steps as usize {
                let micro = b.train_micro_batch_size_per_gpu as usize;
                let first = (m * RANKS + rank) * micro;
                let loss = loss_on(&model, &x, &y, &rows[first..first + micro]);
                engine.backward(&loss).unwrap();
                engine.step().unwrap();
            }
        }
        if let Some(dir) = save {
            engine.save_checkpoint(dir, None).unwrap();
        }
        params_of(&vs)
    })
}

#[test]
fn local_sgd_every_step_is_synchronous_sgd() {
    let sync = train(&config(json!({})), 8);
    let local = train(&config(json!({"async_training": {"mode": "local_sgd", "sync_every": 1}})), 8);
    let d = max_relative_difference(&local[0], &sync[0]);
    assert!(d < 1e-6, "max relative difference {d}");
    // DiLoCo with an outer SGD of lr 1, no momentum: the anchor moves to the average, which is local SGD.
    let plain =
        json!({"mode": "diloco", "sync_every": 1, "outer_optimizer": {"type": "sgd", "lr": 1.0, "momentum": 0.0}});
    let diloco = train(&config(json!({ "async_training": plain })), 8);
    let d = max_relative_difference(&diloco[0], &sync[0]);
    assert!(d < 1e-6, "diloco (lr 1, no momentum) vs synchronous: {d}");
}

#[test]
fn between_meetings_the_ranks_step_alone() {
    let every = 4;
    let runs = train(&config(json!({"async_training": {"mode": "local_sgd", "sync_every": every}})), 8);
    // After step 8 (a meeting) every rank holds the same parameters.
    for r in 1..RANKS {
        assert_eq!(max_relative_difference(&runs[r], &runs[0]), 0.0, "rank {r} after a meeting");
    }
    // Stopping at step 6 (between meetings), the ranks differ: they stepped on their own gradients.
    let apart = train(&config(json!({"async_training": {"mode": "local_sgd", "sync_every": every}})), 6);
    assert!(max_relative_difference(&apart[1], &apart[0]) > 1e-4);
    // And it is not the synchronous run.
    let sync = train(&config(json!({})), 8);
    assert!(max_relative_difference(&runs[0], &sync[0]) > 1e-5);
}

#[test]
fn diloco_applies_the_averaged_change_with_outer_nesterov() {
    // One meeting after H = 2 steps. The outer step from the anchor θ0 (the initial parameters) with the average
    // θ̄ of local SGD's meeting: g = θ0 - θ̄, momentum m = g (first step), update = g + μ m, θ1 = θ0 - lr update.
    let (lr, mu) = (0.7, 0.9);
    let d =
        json!({"mode": "diloco", "sync_every": 2, "outer_optimizer": {"type": "nesterov", "lr": lr, "momentum": mu}});
    let diloco = train(&config(json!({ "async_training": d })), 2);
    let averaged = train(&config(json!({"async_training": {"mode": "local_sgd", "sync_every": 2}})), 2);
    let (vs, _) = init_store();
    let initial = params_of(&vs);
    for (((name, got), (_, avg)), (_, init)) in diloco[0].iter().zip(&averaged[0]).zip(&initial) {
        for ((g, a), i) in got.iter().zip(avg).zip(init) {
            let outer_grad = i - a;
            let want = i - (lr as f32) * (outer_grad + (mu as f32) * outer_grad);
            assert!((g - want).abs() <= 1e-6 * want.abs().max(1.0), "{name}: {g} vs {want}");
        }
    }
}

/// 16-bit local SGD and DiLoCo: the ranks meet by their fp32 master (the values the next step starts from). A
/// step with zero gradients after a meeting leaves every rank's master where the meeting put it, so the ranks'
/// bf16 parameters are equal after it; had the meeting averaged only the bf16 parameters, each rank's step would
/// write back its own master and they would differ. Trained like the fp32 run (within bf16's rounding).
#[test]
fn sixteen_bit_ranks_meet_by_their_master_weights() {
    for (precision, mode) in [
        ("bf16", json!({"mode": "local_sgd", "sync_every": 2})),
        ("fp16", json!({"mode": "local_sgd", "sync_every": 2})),
        ("bf16", json!({"mode": "diloco", "sync_every": 2})),
    ] {
        // Plain SGD: a zero gradient moves nothing (no momentum, no decay).
        let c = config(json!({"async_training": mode, precision: {"enabled": true}}));
        let runs = on_thread_ranks(RANKS, |comm, x, y| {
            let rank = comm.rank();
            let (mut vs, model) = init_store();
            if precision == "bf16" {
                vs.bfloat16();
            } else {
                vs.half();
            }
            let mut engine = Engine::new(&vs, c.clone(), Box::new(comm), EngineOptions::default()).unwrap();
            let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
            let kind = if precision == "bf16" { tch::Kind::BFloat16 } else { tch::Kind::Half };
            let x = x.to_kind(kind);
            for step in 0..3 {
                let rows = batch_indices(step);
                let loss = loss_on(&model, &x, &y, &rows[rank * micro..(rank + 1) * micro]);
                // Step 3, after the meeting at 2: zero gradients, so every rank's master stays the met values.
                let loss = if step == 2 { loss * 0.0 } else { loss };
                engine.backward(&loss).unwrap();
                engine.step().unwrap();
            }
            params_of(&vs)
        });
        for r in 1..RANKS {
            assert_eq!(max_relative_difference(&runs[r], &runs[0]), 0.0, "{precision} {mode}: rank {r} after the step");
        }
    }
}

/// Bounded staleness on a bf16 model: workers push their bf16 gradients (widened), owners step their fp32 master;
/// `staleness` 0 ends where synchronous stage 1 in bf16 with fp32 reductions does (every gradient fresh), and
/// with `staleness` 2 and a slow rank it trains and the ranks end equal after `finish`.
#[test]
fn bounded_staleness_trains_a_bf16_model_from_fp32_masters() {
    // `steps` from `load`'s checkpoint (or the start), saving into `save` at the end.
    let run_from = |mode: Value,
                    slow: Option<u64>,
                    steps: std::ops::Range<i64>,
                    load: Option<&std::path::Path>,
                    save: Option<&std::path::Path>| {
        let mut extra = json!({"zero_optimization": {"stage": 1}, "bf16": {"enabled": true}, "async_training": mode,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}});
        if extra["async_training"]["mode"] == "off" {
            // The synchronous run reduces in fp32, as the owners sum.
            extra["communication_data_type"] = json!("fp32");
        }
        let c = config(extra);
        on_thread_ranks(RANKS, |comm, x, y| {
            let rank = comm.rank();
            let (mut vs, model) = init_store();
            vs.bfloat16();
            let mut engine = Engine::new(&vs, c.clone(), Box::new(comm), EngineOptions::default()).unwrap();
            if let Some(dir) = load {
                engine.load_checkpoint(dir, None).unwrap();
            }
            let x = x.to_kind(tch::Kind::BFloat16);
            let last = train_steps(&mut engine, &model, (&x, &y), steps.clone(), slow.filter(|_| rank == 2));
            if let Some(dir) = save {
                engine.save_checkpoint(dir, None).unwrap();
            }
            engine.finish().unwrap();
            (params_of(&vs), engine.staleness_counts(), last)
        })
    };
    let run = |mode: Value, slow: Option<u64>, steps: i64| run_from(mode, slow, 0..steps, None, None);
    let sync = run(json!({"mode": "off"}), None, 10);
    let fresh = run(json!({"mode": "bounded_staleness", "staleness": 0}), Some(5), 10);
    for (r, (params, counts, _)) in fresh.iter().enumerate() {
        assert_eq!(counts, &vec![30], "rank {r}: 3 workers x 10 steps, all fresh");
        let d = max_relative_difference(params, &sync[0].0);
        assert!(d < 1e-2, "rank {r}: {d:e} from synchronous bf16 (a bf16 rounding apart at most)");
    }
    // As the fp32 test: 24 steps with a rank sleeping 15 ms, each rank's own last loss (the start is 6.4).
    let stale = run(json!({"mode": "bounded_staleness", "staleness": 2}), Some(15), 24);
    for (r, (params, counts, loss)) in stale.iter().enumerate() {
        assert_eq!(counts.iter().sum::<u64>(), 72, "rank {r}: {counts:?}");
        assert!(loss.is_finite() && *loss < 3.0, "rank {r} trains: {loss}");
        assert_eq!(max_relative_difference(params, &stale[0].0), 0.0, "rank {r} after finish");
    }
    let stale_counts: u64 = stale.iter().map(|(_, c, _)| c[1] + c[2]).sum();
    assert!(stale_counts > 0, "the slow rank's peers ran ahead");
    // A checkpoint holds the owners' fp32 masters: saved after 5 steps and resumed, it ends where 10 steps do.
    let dir = std::env::temp_dir().join(format!("zerorun-async-bf16-{}", std::process::id()));
    let fresh_mode = json!({"mode": "bounded_staleness", "staleness": 0});
    run_from(fresh_mode.clone(), None, 0..5, None, Some(&dir));
    let resumed = run_from(fresh_mode, None, 5..10, Some(&dir), None);
    std::fs::remove_dir_all(&dir).unwrap();
    let d = max_relative_difference(&resumed[0].0, &fresh[0].0);
    assert!(d < 1e-6, "resumed vs uninterrupted: {d:e}");
}

#[test]
fn what_local_steps_cannot_run_is_refused() {
    let err = |v: Value| Config::from_value(json::merged(json!({"train_batch_size": 4}), &v)).unwrap_err().to_string();
    let e = err(json!({"async_training": {"mode": "local_sgd", "sync_every": 2}, "zero_optimization": {"stage": 1}}));
    assert!(e.contains("async_training.mode") && e.contains("`zero_optimization.stage` must be 0"), "{e}");
    let e = err(json!({"async_training": {"mode": "local_sgd"}}));
    assert!(e.contains("async_training.sync_every"), "{e}");
    let e = err(json!({"async_training": {"mode": "diloco", "sync_every": 2, "outer_optimizer": {"momentum": 1.5}}}));
    assert!(e.contains("async_training.outer_optimizer.momentum"), "{e}");
    let e = err(json!({"async_training": {"mode": "diloco", "sync_every": 2, "outer_optimizer": {"lr": 0}}}));
    assert!(e.contains("async_training.outer_optimizer.lr"), "{e}");
    let e = err(json!({"async_training": {"mode": "diloco", "sync_every": 2, "outer_optimizer": {"type": "adam"}}}));
    assert!(e.contains("async_training.outer_optimizer.type"), "{e}");
    let stage1 = json!({"gradient_clipping": 0, "zero_optimization": {"stage": 1}});
    let e = err(json::merged(
        stage1.clone(),
        &json!({"async_training": {"mode": "bounded_staleness"}, "zero_optimization": {"stage": 2}}),
    ));
    assert!(e.contains("async_training.mode") && e.contains("`zero_optimization.stage` must be 1 (it is 2)"), "{e}");
    let e = err(json!({"async_training": {"mode": "bounded_staleness"}, "zero_optimization": {"stage": 1}}));
    assert!(e.contains("async_training.mode") && e.contains("set `gradient_clipping` to 0 (it is 1)"), "{e}");
    let e =
        err(json::merged(stage1, &json!({"async_training": {"mode": "bounded_staleness"}, "fp16": {"enabled": true}})));
    assert!(e.contains("async_training.mode") && e.contains("`fp16.enabled` must be false"), "{e}");
    let e = err(json!({"async_training": {"mode": "bounded_staleness", "staleness": -1}}));
    assert!(e.contains("async_training.staleness"), "{e}");
}

/// What a bounded-staleness rank ends with: its parameters, its staleness counts as an owner, its last loss.
struct BoundedRun {
    params: Vec<(String, Vec<f32>)>,
    counts: Vec<u64>,
    loss: f64,
}

/// This rank's micro-batch of each step of `steps` through `engine` (sleeping `sleep_ms` first in each, a slow
/// rank); the last loss a step reported.
fn train_steps(
    engine: &mut Engine,
    model: &tch::nn::Sequential,
    (x, y): (&tch::Tensor, &tch::Tensor),
    steps: std::ops::Range<i64>,
    sleep_ms: Option<u64>,
) -> f64 {
    let (rank, micro) = (engine.rank(), engine.batch_sizes().train_micro_batch_size_per_gpu as usize);
    let mut last = f64::NAN;
    for step in steps {
        if let Some(ms) = sleep_ms {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        let rows = batch_indices(step);
        let loss = loss_on(model, x, y, &rows[rank * micro..(rank + 1) * micro]);
        engine.backward(&loss).unwrap();
        if let zerorun::StepOutcome::Stepped { loss, .. } = engine.step().unwrap() {
            last = loss;
        }
    }
    last
}

/// Bounded staleness at stage 1 with AdamW and WarmupLR, 3 thread ranks: each rank's parameters after `steps`
/// steps, its staleness counts as an owner and its last loss. `slow`: (rank, milliseconds it sleeps per step).
fn bounded(staleness: u64, scaling: bool, steps: i64, slow: Option<(usize, u64)>) -> Vec<BoundedRun> {
    let mode = if staleness == u64::MAX {
        json!({"mode": "off"})
    } else {
        json!({"mode": "bounded_staleness", "staleness": staleness, "lr_staleness_scaling": scaling})
    };
    let c = config(json!({
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 5}},
        "zero_optimization": {"stage": 1}, "async_training": mode,
    }));
    on_thread_ranks(RANKS, |comm, x, y| {
        let rank = comm.rank();
        let (vs, model) = init_store();
        let options =
            EngineOptions { no_weight_decay: Some(zerorun::runtime::engine::no_decay_for_1d), ..Default::default() };
        let mut engine = Engine::new(&vs, c.clone(), Box::new(comm), options).unwrap();
        let sleep = slow.filter(|(r, _)| *r == rank).map(|(_, ms)| ms);
        let last = train_steps(&mut engine, &model, (&x, &y), 0..steps, sleep);
        // Every owner applies every step and every rank pulls the final values.
        engine.finish().unwrap();
        BoundedRun { params: params_of(&vs), counts: engine.staleness_counts(), loss: last }
    })
}

#[test]
fn bounded_staleness_zero_is_synchronous_data_parallelism() {
    let sync = bounded(u64::MAX, false, 10, None);
    let ssp = bounded(0, false, 10, Some((1, 5)));
    for (r, run) in ssp.iter().enumerate() {
        let d = max_relative_difference(&run.params, &sync[0].params);
        assert!(d < 1e-6, "rank {r}: {d:e}");
        // Every applied gradient was computed on up-to-date values: 3 workers x 10 steps at each owner.
        assert_eq!(run.counts, vec![30], "rank {r}'s staleness counts");
    }
}

#[test]
fn bounded_staleness_lets_fast_ranks_run_ahead_within_the_bound() {
    // Rank 2 sleeps 15 ms per step: the others run up to s = 2 steps ahead, on values that lack its updates.
    for scaling in [false, true] {
        let runs = bounded(2, scaling, 24, Some((2, 15)));
        let counts: Vec<u64> = (0..3).map(|i| runs.iter().map(|r| r.counts[i]).sum()).collect();
        // Every owner applied 3 x 24 gradients, none older than the bound (the owner refuses one that is).
        for (r, run) in runs.iter().enumerate() {
            assert_eq!(run.counts.len(), 3, "rank {r}: counts for staleness 0..=2");
            assert_eq!(run.counts.iter().sum::<u64>(), 72, "rank {r}");
        }
        assert!(counts[1] + counts[2] > 0, "some gradients were stale (lr_staleness_scaling {scaling}): {counts:?}");
        // It still trains (the mean loss starts at 6.4 here and the synchronous run ends at 1.1; the losses are each
        // rank's own), and after `finish` every rank holds the same values.
        for (r, run) in runs.iter().enumerate() {
            assert!(run.loss.is_finite() && run.loss < 3.0, "rank {r}'s last loss {}", run.loss);
            assert_eq!(max_relative_difference(&run.params, &runs[0].params), 0.0, "rank {r} after finish");
        }
    }
}

#[test]
fn a_rank_that_stops_is_an_error_on_the_others_not_a_hang() {
    let c = config(json!({
        "comms_timeout": 2, "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {}},
        "async_training": {"mode": "bounded_staleness", "staleness": 1},
    }));
    let errors = on_thread_ranks(RANKS, |comm, x, y| {
        let rank = comm.rank();
        let (vs, model) = init_store();
        let mut engine = Engine::new(&vs, c.clone(), Box::new(comm), EngineOptions::default()).unwrap();
        let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
        let mut error = None;
        for step in 0..6 {
            if rank == 2 && step == 1 {
                // Gone without a word (no drain, no barrier), as a killed process.
                std::mem::forget(engine);
                return None;
            }
            let rows = batch_indices(step);
            let loss = loss_on(&model, &x, &y, &rows[rank * micro..(rank + 1) * micro]);
            engine.backward(&loss).unwrap();
            if let Err(e) = engine.step() {
                error = Some(e.to_string());
                break;
            }
        }
        error
    });
    for (r, e) in errors.iter().take(2).enumerate() {
        let e = e.as_deref().unwrap_or("no error");
        // Rank 2 is named: as the worker whose gradient an owner lacks, or as the owner that never stepped.
        let named = e.contains("no gradient of it from rank 2") || e.contains("rank 2 has every gradient of it");
        assert!(e.starts_with("bounded_staleness: rank") && named, "rank {r}: {e}");
    }
}

#[test]
fn local_sgd_checkpoints_right_after_a_meeting() {
    let dir = std::env::temp_dir().join(format!("zerorun-async-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let c = config(json!({"async_training": {"mode": "local_sgd", "sync_every": 2}}));
    let errors = on_thread_ranks(RANKS, |comm, x, y| {
        let rank = comm.rank();
        let (vs, model) = init_store();
        let mut engine = Engine::new(&vs, c.clone(), Box::new(comm), EngineOptions::default()).unwrap();
        let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
        let step = |engine: &mut Engine, s: i64| {
            let rows = batch_indices(s);
            let loss = loss_on(&model, &x, &y, &rows[rank * micro..(rank + 1) * micro]);
            engine.backward(&loss).unwrap();
            engine.step().unwrap();
        };
        step(&mut engine, 0);
        let between = engine.save_checkpoint(&dir, None).map(|_| ()).unwrap_err().to_string();
        step(&mut engine, 1);
        engine.save_checkpoint(&dir, None).unwrap();
        between
    });
    assert!(errors[0].contains("between meetings (every 2 steps)"), "{}", errors[0]);
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap().trim(), "global_step2");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn diloco_resumes_its_anchor_and_momentum() {
    let dir = std::env::temp_dir().join(format!("zerorun-diloco-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d =
        json!({"mode": "diloco", "sync_every": 2, "outer_optimizer": {"type": "nesterov", "lr": 0.7, "momentum": 0.9}});
    let c = config(json!({ "async_training": d }));
    let whole = train(&c, 6);
    // Two meetings, a checkpoint, then the third meeting after resuming: the momentum of the first two matters.
    train_from(&c, 0..4, None, Some(&dir));
    let resumed = train_from(&c, 4..6, Some(&dir), None);
    assert_eq!(max_relative_difference(&resumed[0], &whole[0]), 0.0);
    // A checkpoint without the outer state (local SGD's) loads too: the anchor is its parameters, no momentum.
    let local = config(json!({"async_training": {"mode": "local_sgd", "sync_every": 2}}));
    let _ = std::fs::remove_dir_all(&dir);
    train_from(&local, 0..4, None, Some(&dir));
    let restarted = train_from(&c, 4..6, Some(&dir), None);
    assert!(max_relative_difference(&restarted[0], &whole[0]) > 1e-4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bounded_staleness_checkpoints_are_a_meeting_and_resume() {
    let dir = std::env::temp_dir().join(format!("zerorun-ssp-{}", std::process::id()));
    let config = |staleness: u64| {
        config(json!({
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": 1},
            "async_training": {"mode": "bounded_staleness", "staleness": staleness},
        }))
    };
    // (steps, load first, save at the end): every rank's parameters at the end, after `finish`.
    let run = |c: &Config, steps: std::ops::Range<i64>, load: bool, save: bool| {
        on_thread_ranks(RANKS, |comm, x, y| {
            let rank = comm.rank();
            let (vs, model) = init_store();
            let mut engine = Engine::new(&vs, c.clone(), Box::new(comm), EngineOptions::default()).unwrap();
            if load {
                engine.load_checkpoint(&dir, None).unwrap();
            }
            let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
            for step in steps.clone() {
                if rank == 1 {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                let rows = batch_indices(step);
                let loss = loss_on(&model, &x, &y, &rows[rank * micro..(rank + 1) * micro]);
                engine.backward(&loss).unwrap();
                engine.step().unwrap();
            }
            let at_save = save.then(|| {
                engine.save_checkpoint(&dir, None).unwrap();
                params_of(&vs)
            });
            engine.finish().unwrap();
            (params_of(&vs), at_save, engine.global_steps())
        })
    };
    // Staleness 0 is deterministic: saved after 4 steps and resumed for 4 more, it ends where 8 steps end.
    let _ = std::fs::remove_dir_all(&dir);
    let whole = run(&config(0), 0..8, false, false);
    run(&config(0), 0..4, false, true);
    let resumed = run(&config(0), 4..8, true, false);
    assert_eq!(resumed[0].2, 8, "the step count resumes");
    let d = max_relative_difference(&resumed[0].0, &whole[0].0);
    assert!(d < 1e-6, "resumed vs uninterrupted: {d:e}");
    // Staleness 2: at the checkpoint every rank holds the same model (every step applied), and it resumes.
    let _ = std::fs::remove_dir_all(&dir);
    let saved = run(&config(2), 0..5, false, true);
    for (r, s) in saved.iter().enumerate() {
        let at_save = s.1.as_ref().unwrap();
        assert_eq!(max_relative_difference(at_save, saved[0].1.as_ref().unwrap()), 0.0, "rank {r} at the checkpoint");
    }
    let resumed = run(&config(2), 5..10, true, false);
    for (r, s) in resumed.iter().enumerate() {
        assert_eq!(max_relative_difference(&s.0, &resumed[0].0), 0.0, "rank {r} after finish");
        assert!(s.0.iter().all(|(_, v)| v.iter().all(|x| x.is_finite())));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The MLP example under `zerorun launch --backend gloo` (messages only: the relay carries pushes and values):
/// the launched ranks' output and saved weights.
fn gloo_mlp(config: &Value, tag: &str, slow: &[&str]) -> (String, Vec<(String, Tensor)>) {
    let dir = std::env::temp_dir().join(format!("zerorun-async-gloo-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cfg, out) = (dir.join("config.json"), dir.join("final.safetensors"));
    std::fs::write(&cfg, config.to_string()).unwrap();
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["launch", "--nproc-per-node", "3", "--backend", "gloo", "--"])
        .arg(examples::example("mlp"))
        .args(["--config", cfg.to_str().unwrap(), "--steps", "12", "--save-final", out.to_str().unwrap()])
        .args(slow)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "{tag}:\n{text}\n{}", String::from_utf8_lossy(&run.stderr));
    let mut weights = Tensor::read_safetensors(&out).unwrap();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    std::fs::remove_dir_all(&dir).unwrap();
    (text, weights)
}

/// Bounded staleness across hosts' backend (gloo, three processes): s = 0 saves the synchronous run's weights
/// within 1e-6 with every gradient fresh; s = 2 with a slow rank applies stale gradients, none beyond the bound,
/// and still trains.
#[test]
fn bounded_staleness_runs_over_gloo_messages() {
    let base = json!({"train_batch_size": 30, "gradient_clipping": 0, "comms_timeout": 60,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "zero_optimization": {"stage": 1}});
    let with = |mode: Value| {
        let mut c = base.clone();
        c["async_training"] = mode;
        c
    };
    let (_, sync) = gloo_mlp(&base, "sync", &[]);
    let (text, ssp) = gloo_mlp(&with(json!({"mode": "bounded_staleness", "staleness": 0})), "s0", &[]);
    assert!(text.contains("staleness_counts [36]"), "3 workers x 12 steps, all fresh:\n{text}");
    for ((name, a), (_, b)) in sync.iter().zip(&ssp) {
        let d = (a - b).abs().max().double_value(&[]) / a.abs().max().double_value(&[]).max(1e-6);
        assert!(d < 1e-6, "{name}: {d:e}");
    }
    let slow = ["--slow-rank", "2", "--slow-ms", "30"];
    let (text, _) = gloo_mlp(&with(json!({"mode": "bounded_staleness", "staleness": 2})), "s2", &slow);
    let line = text.lines().find(|l| l.contains("staleness_counts")).unwrap_or_else(|| panic!("{text}"));
    let counts: Vec<u64> = line
        .split("staleness_counts [")
        .nth(1)
        .unwrap()
        .trim_end_matches(']')
        .split(", ")
        .map(|c| c.trim().parse().unwrap())
        .collect();
    assert_eq!(counts.len(), 3, "staleness 0..=2 only: {line}");
    assert_eq!(counts.iter().sum::<u64>(), 36, "{line}");
    assert!(counts[1] + counts[2] > 0, "the slow rank's peers ran ahead: {line}");
    let eval: f64 = text.lines().find_map(|l| l.split("eval_loss ").nth(1)).unwrap().trim().parse().unwrap();
    assert!(eval < 0.98, "it trains (the synchronous run ends at 0.96 after 10 steps): {eval}");
    // A rank that stops (rank 2 sleeps a minute in its first step): an error within comms_timeout naming it.
    let mut stuck = with(json!({"mode": "bounded_staleness", "staleness": 1}));
    stuck["comms_timeout"] = json!(3);
    let cfg = std::env::temp_dir().join(format!("zerorun-async-gloo-{}-stuck.json", std::process::id()));
    std::fs::write(&cfg, stuck.to_string()).unwrap();
    let started = std::time::Instant::now();
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["launch", "--nproc-per-node", "3", "--backend", "gloo", "--"])
        .arg(examples::example("mlp"))
        .args(["--config", cfg.to_str().unwrap(), "--steps", "12", "--slow-rank", "2", "--slow-ms", "60000"])
        .output()
        .unwrap();
    std::fs::remove_file(&cfg).unwrap();
    let text = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && started.elapsed().as_secs() < 40, "{text}");
    assert!(text.contains("bounded_staleness: rank 0 waited 3 s") && text.contains("from rank 2"), "{text}");
}
