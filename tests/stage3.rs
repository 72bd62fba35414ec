//! Stage 3: the MLP with one unit per layer, and as a single unit, at world sizes 1-4 (with gradient
//! accumulation and activation checkpointing) ends at the single-process AdamW reference within 1e-5; gathered
//! full parameters never exceed the two largest units plus persistent ones; model-state bytes per rank are 16Psi/N
//! (fp32 Adam) within 5%; comm volume is 3Psi per step; misuse gives errors that say what to do. Also every
//! `optimizer_in_backward` test, stage 0's (each bucket stepped as its all-reduce lands) included.
use std::time::Duration;

use serde_json::{json, Value};
use tch::nn::Module;
use tch::Tensor;
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions, Whole};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

#[path = "common/compare.rs"]
mod compare;
use compare::{full_parameters, max_relative_difference};

#[path = "common/stage3_runs.rs"]
mod stage3_runs;
use stage3_runs::*;

#[test]
fn stage3_matches_single_process_adamw_per_layer_whole_and_with_activation_checkpointing() {
    let reference = adamw_reference();
    // (world size, accumulation, units, activation checkpointing, overlap_comm: prefetch on the comm thread)
    let cases = [
        (1, 1, Units::PerLayer, false, true),
        (2, 2, Units::PerLayer, false, true),
        (3, 1, Units::PerLayer, false, true),
        (4, 1, Units::PerLayer, false, true),
        (3, 1, Units::PerLayer, false, false),
        (3, 2, Units::Whole, false, true),
        (2, 1, Units::PerLayer, true, true),
        (3, 2, Units::PerLayer, true, false),
    ];
    for (world, gas, units, ac, overlap) in cases {
        let runs = run(world, config(gas, json!({"overlap_comm": overlap})), units, ac, &DIMS);
        for (rank, r) in runs.iter().enumerate() {
            let d = max_relative_difference(&r.params, &reference);
            assert!(d <= 1e-5, "world size {world}, accumulation {gas}, {units:?}, checkpointing {ac}, overlap {overlap}, rank {rank}: {d:e}");
        }
    }
    // The defaults keep these small units gathered (persistence threshold 1e5 elements): same result.
    let runs = run(
        3,
        config(1, json!({"stage3_param_persistence_threshold": 100000, "stage3_max_reuse_distance": 1000000000})),
        Units::PerLayer,
        false,
        &DIMS,
    );
    assert!(max_relative_difference(&runs[0].params, &reference) <= 1e-5);
    let persistent: usize = runs[0].memory.iter().find(|(n, _)| n.name() == "parameters_gathered").unwrap().1;
    let all: usize = DIMS.windows(2).map(|w| ((w[0] * w[1] + w[1]) as usize).div_ceil(3) * 3 * 4).sum();
    assert_eq!(persistent, all, "every unit stays gathered under the default persistence threshold");
}

#[test]
fn gathered_parameters_stay_within_the_two_largest_units_and_model_states_are_16_psi_over_n() {
    // Larger layers so padding is negligible: 64 -> 256 -> 256 -> 3.
    let dims = [IN, 256, 256, OUT];
    let world = 2;
    // Prefetch on, one unit ahead (DeepSpeed's live bound given: sized from the model, it would allow one unit).
    let runs = run(
        world,
        config(
            1,
            json!({"overlap_comm": true, "stage3_prefetch_bucket_size": 1, "stage3_max_live_parameters": 1_000_000_000u64}),
        ),
        Units::PerLayer,
        false,
        &dims,
    );
    let unit_bytes: Vec<usize> =
        dims.windows(2).map(|w| ((w[0] * w[1] + w[1]) as usize).div_ceil(world) * world * 4).collect();
    let mut sorted = unit_bytes.clone();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let psi: usize = dims.windows(2).map(|w| (w[0] * w[1] + w[1]) as usize).sum();
    for (rank, r) in runs.iter().enumerate() {
        assert!(r.peak_gathered > 0, "rank {rank}: stage 3 gathered something");
        assert!(
            r.peak_gathered <= sorted[0] + sorted[1],
            "rank {rank}: peak gathered {} > two largest units {}",
            r.peak_gathered,
            sorted[0] + sorted[1]
        );
        assert!(r.peak_gathered < unit_bytes.iter().sum::<usize>(), "rank {rank}: never the whole model");
        // Without prefetch one unit is gathered at a time; more means the next unit's all-gather was in flight.
        assert!(r.peak_gathered > sorted[0], "rank {rank}: prefetch gathered the next unit while one computed");
        let get = |name: &str| r.memory.iter().find(|(n, _)| n.name() == name).map_or(0, |(_, b)| *b);
        assert_eq!(get("parameters_gathered"), 0, "rank {rank}: nothing stays gathered after the step");
        let measured = get("parameters") + get("gradients_shard") + get("master_fp32") + get("optimizer_states");
        let expected = 16.0 * psi as f64 / world as f64;
        let rel = (measured as f64 - expected).abs() / expected;
        assert!(
            rel <= 0.05,
            "rank {rank}: model states {measured} B vs 16 Psi / N = {expected} B ({:.1}% off)",
            rel * 100.0
        );
    }
    // Per step: all-gather in forward (every unit but the last, which backward reuses), all-gather in backward,
    // reduce-scatter: 3 Psi less the last unit, in padded elements.
    let padded: Vec<u64> = unit_bytes.iter().map(|b| (b / 4) as u64).collect();
    let want = 3 * padded.iter().sum::<u64>() - padded[padded.len() - 1];
    assert_eq!(runs[0].volume_per_step, want);
    let three_psi = 3 * psi as u64;
    assert!(
        (want as f64 - three_psi as f64).abs() / three_psi as f64 <= 0.02,
        "within padding and the last unit of 3 Psi"
    );
}

#[test]
fn misuse_at_stage_3_is_a_clear_error() {
    let comm = threads::group(1, Duration::from_secs(10)).pop().unwrap();
    let (vs, layers) = init_layers(&DIMS);
    // A parameter no unit claims.
    let bad =
        EngineOptions { units: Some(vec![vec!["layers.0".into()], vec!["layers.1".into()]]), ..Default::default() };
    let e = Engine::new(&vs, config(1, json!({})), Box::new(comm), bad).unwrap_err().to_string();
    assert!(e.starts_with("parameter `layers.2.bias`: belongs to no unit"), "{e}");

    let comm = threads::group(1, Duration::from_secs(10)).pop().unwrap();
    let (vs, layers2) = init_layers(&DIMS);
    let mut engine =
        Engine::new(&vs, config(1, json!({})), Box::new(comm), EngineOptions::default().units_of(&layers2)).unwrap();
    let x = Tensor::ones([2, IN], (tch::Kind::Float, tch::Device::Cpu));
    // A plain backward without the engine's forward.
    let loss = Tensor::ones([1], (tch::Kind::Float, tch::Device::Cpu)).sum(tch::Kind::Float);
    let e = engine.backward(&loss).unwrap_err().to_string();
    assert!(e.contains("must come from `engine.forward(&model, input)`"), "{e}");
    // A model with other units than the engine's.
    let whole = Whole(|x: &Tensor| layers.forward_all(x));
    let e = engine.forward(&whole, &x).unwrap_err().to_string();
    assert!(e.contains("are not the ones the engine was built with"), "{e}");
    // Using the model outside the engine while it is sharded fails in libtorch, not with garbage.
    let outside = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| layers2.forward_all(&x)));
    assert!(outside.is_err(), "a released unit must not compute");
}

#[test]
fn activation_checkpointing_needs_the_model_in_backward() {
    let comm = threads::group(1, Duration::from_secs(10)).pop().unwrap();
    let (vs, layers) = init_layers(&DIMS);
    let options = EngineOptions { activation_checkpointing: true, ..Default::default() }.units_of(&layers);
    let mut engine = Engine::new(&vs, config(1, json!({})), Box::new(comm), options).unwrap();
    let x = Tensor::ones([2, IN], (tch::Kind::Float, tch::Device::Cpu));
    let loss = engine.forward(&layers, &x).unwrap().sum(tch::Kind::Float);
    let e = engine.backward(&loss).unwrap_err().to_string();
    assert!(e.contains("call `engine.backward_units(&model, &loss)`"), "{e}");
}

#[test]
fn saving_the_16bit_model_at_stage_3_gathers_on_rank_0_or_refuses_by_name() {
    let dir = std::env::temp_dir().join(format!("zerorun-save16-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    type Saved = Vec<Result<Vec<(String, Vec<f32>)>, String>>;
    let save = |gather: bool| -> Saved {
        let comms = threads::group(2, Duration::from_secs(30));
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let path = path.clone();
                    s.spawn(move || {
                        let (vs, layers) = init_layers(&DIMS);
                        let cfg = config(1, json!({"stage3_gather_16bit_weights_on_model_save": gather}));
                        let mut engine =
                            Engine::new(&vs, cfg, Box::new(comm), EngineOptions::default().units_of(&layers)).unwrap();
                        engine.save_16bit_model(&path).map_err(|e| e.to_string())?;
                        let full = full_parameters(&mut engine);
                        Ok(full)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    for r in save(false) {
        let e = r.unwrap_err();
        assert!(e.starts_with("`zero_optimization.stage3_gather_16bit_weights_on_model_save` = false: at stage 3 the weights are sharded"), "{e}");
    }
    assert!(!path.exists(), "nothing written when refused");
    let full = save(true).remove(0).unwrap();
    let mut saved: Vec<(String, Vec<f32>)> = Tensor::read_safetensors(&path)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(t.reshape([-1])).unwrap()))
        .collect();
    saved.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(saved, full, "the file holds the full weights, not empty shards");
    assert!(saved.iter().all(|(_, v)| !v.is_empty()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn stage2_with_units_reduces_unit_by_unit_holds_no_full_gradients_and_overlaps_bitwise() {
    let reference = adamw_reference();
    let dims = [IN, HIDDEN, HIDDEN, OUT];
    for (world, gas) in [(2, 2), (3, 1)] {
        let runs = run(world, config(gas, json!({"stage": 2})), Units::PerLayer, false, &dims);
        let padded: u64 =
            dims.windows(2).map(|w| ((w[0] * w[1] + w[1]) as u64).div_ceil(world as u64) * world as u64).sum();
        for (rank, r) in runs.iter().enumerate() {
            let d = max_relative_difference(&r.params, &reference);
            assert!(d <= 1e-5, "world size {world}, rank {rank}: {d:e}");
            let get = |name: &str| r.memory.iter().find(|(n, _)| n.name() == name).map_or(0, |(_, b)| *b);
            assert_eq!(get("gradients_full"), 0, "no full gradients are held");
            assert_eq!(get("gradients_shard"), 4 * padded as usize / world, "the fp32 gradient shard");
            assert_eq!(get("parameters"), 4 * padded as usize, "parameters stay whole at stage 2");
            // Per step: one reduce-scatter per micro-batch and one all-gather of every unit.
            assert_eq!(r.volume_per_step, padded * (gas + 1), "world size {world}");
        }
        // overlap_comm: each unit's reduce-scatter runs on the communication thread while the unit before it
        // backpropagates, and each unit's all-gather while the optimizer steps the next unit's chunk; the same
        // sums in the same order, the same step, and no more memory (one staging round still, no shard copy).
        let overlapped =
            run(world, config(gas, json!({"stage": 2, "overlap_comm": true})), Units::PerLayer, false, &dims);
        for (rank, (a, b)) in runs.iter().zip(&overlapped).enumerate() {
            assert_eq!(a.params, b.params, "overlap_comm changes nothing: world size {world}, rank {rank}");
            assert_eq!(a.memory, b.memory, "world size {world}, rank {rank}");
            // The all-gathers started unit by unit during the step move what the in-line ones move.
            assert_eq!(a.volume_per_step, b.volume_per_step, "world size {world}, rank {rank}");
        }
    }
}

#[test]
fn evaluation_under_no_grad_gathers_releases_and_is_left_out_of_the_timings_and_a_sequence_is_a_unit_model() {
    let comms = threads::group(2, Duration::from_secs(30));
    let outs: Vec<(Vec<f32>, Vec<f32>, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let (vs, layers) = init_layers(&DIMS);
                    let x = Tensor::from_slice(&data().0[..(4 * IN) as usize]).view([4, IN]);
                    // The full model's output before any sharding.
                    let expected = Vec::<f32>::try_from(layers.forward_all(&x).reshape([-1])).unwrap();
                    // The same layers as closures: a Sequence with the same prefixes is the same unit model.
                    let l = &layers.0;
                    let seq = zerorun::Sequence::new()
                        .unit(["layers.0"], |x| l[0].forward(x).gelu("none"))
                        .unit(["layers.1"], |x| l[1].forward(x).gelu("none"))
                        .unit(["layers.2"], |x| l[2].forward(x));
                    let mut engine =
                        Engine::new(&vs, config(1, json!({})), Box::new(comm), EngineOptions::default().units_of(&seq))
                            .unwrap();
                    let got = tch::no_grad(|| engine.forward(&seq, &x)).unwrap();
                    // An evaluation is no training step's: the wall-clock breakdown leaves its forward and
                    // gathers out.
                    let summary = engine.wall_clock_summary();
                    assert!(summary.contains("forward 0.000,") && summary.contains("all_gather 0.000,"), "{summary}");
                    (expected, Vec::<f32>::try_from(got.reshape([-1])).unwrap(), engine.gathered_bytes().current)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (expected, got, gathered) in outs {
        assert_eq!(got, expected, "evaluation through the units gives the model's output");
        assert_eq!(gathered, 0, "nothing stays gathered after an evaluation forward");
    }
}

/// A config with `optimizer_in_backward` as given, no clipping (it needs none), WarmupLR so the learning rate
/// changes every step, and uneven chunks at 3 ranks.
fn in_backward_config(in_backward: bool, extra: Value) -> Config {
    let mut c = json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_clipping": 0.0, "optimizer_in_backward": in_backward,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 7}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                              "reduce_bucket_size": 40}
    });
    for (k, v) in extra.as_object().unwrap() {
        match (k.as_str(), v.as_object()) {
            // `zero_optimization` keys are merged into the section above.
            ("zero_optimization", Some(zero)) => zero.iter().for_each(|(z, v)| c[k][z] = v.clone()),
            _ => c[k] = v.clone(),
        }
    }
    Config::from_value(c).unwrap()
}

#[test]
fn optimizer_in_backward_gives_the_whole_steps_weights_bitwise_and_holds_no_gradient_shard() {
    // Decay and no-decay groups cut across the units' parts; buckets of 40 elements cut each unit into rounds.
    let options =
        EngineOptions { no_weight_decay: Some(zerorun::runtime::engine::no_decay_for_1d), ..Default::default() };
    for (world, overlap, units) in [(3, true, Units::PerLayer), (2, false, Units::PerLayer), (3, true, Units::Whole)] {
        let extra = json!({});
        let mut configs = [in_backward_config(false, extra.clone()), in_backward_config(true, extra)];
        for c in &mut configs {
            c.zero_optimization.overlap_comm = overlap;
        }
        let [whole, pieces] = configs.map(|c| run_with(world, c, units, options.clone(), &DIMS));
        for (rank, (w, p)) in whole.iter().zip(&pieces).enumerate() {
            let d = max_relative_difference(&p.params, &w.params);
            assert!(
                w.params == p.params,
                "world size {world}, overlap {overlap}, {units:?}, rank {rank}: weights differ ({d:e})"
            );
            let get = |r: &RankRun, name: &str| r.memory.iter().find(|(n, _)| n.name() == name).map_or(0, |(_, b)| *b);
            assert!(get(w, "gradients_shard") > 0, "the whole step holds a gradient shard");
            assert_eq!(get(p, "gradients_shard"), 0, "rank {rank}: the optimizer in backward holds none");
        }
    }
}

#[test]
fn optimizer_in_backward_with_parameters_and_states_on_nvme_steps_like_in_memory() {
    // Every chunk on NVMe (max_in_cpu 0) and sub-groups of 64 elements: a bucket's part reads and writes the chunks
    // and sub-groups it touches, some of them twice (parts of one unit share them). Bitwise the in-memory weights.
    let swap = std::env::temp_dir().join(format!("zerorun-stage3-in-backward-nvme-{}", std::process::id()));
    std::fs::create_dir_all(&swap).unwrap();
    let options =
        EngineOptions { no_weight_decay: Some(zerorun::runtime::engine::no_decay_for_1d), ..Default::default() };
    let nvme = json!({"zero_optimization": {
        "sub_group_size": 64,
        "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": swap, "buffer_count": 3}
    }});
    for world in [2, 3] {
        let memory = run_with(world, in_backward_config(true, json!({})), Units::PerLayer, options.clone(), &DIMS);
        let on_nvme = run_with(world, in_backward_config(true, nvme.clone()), Units::PerLayer, options.clone(), &DIMS);
        for (rank, (m, n)) in memory.iter().zip(&on_nvme).enumerate() {
            let d = max_relative_difference(&n.params, &m.params);
            assert!(m.params == n.params, "world size {world}, rank {rank}: weights differ ({d:e})");
            let get = |r: &RankRun, name: &str| r.memory.iter().find(|(n, _)| n.name() == name).map_or(0, |(_, b)| *b);
            assert_eq!(get(n, "gradients_shard"), 0, "rank {rank}: no gradient shard");
            assert_eq!(get(n, "parameters"), 0, "rank {rank}: the values are on NVMe");
            assert_eq!(get(n, "optimizer_states"), 0, "rank {rank}: the states are on NVMe");
        }
    }
    std::fs::remove_dir_all(&swap).ok();
}

#[test]
fn optimizer_in_backward_refuses_accumulation_and_a_second_backward_before_step() {
    // 12 samples at micro-batch 2 on 3 ranks: the batch rule resolves 2 accumulation steps.
    let config = in_backward_config(true, json!({"train_micro_batch_size_per_gpu": 2}));
    let comms = threads::group(3, Duration::from_secs(60));
    std::thread::scope(|s| {
        for comm in comms {
            let config = config.clone();
            s.spawn(move || {
                let (vs, layers) = init_layers(&DIMS);
                let options = EngineOptions::default().units_of(&layers);
                let err = Engine::new(&vs, config, Box::new(comm), options).expect_err("refused").to_string();
                assert_eq!(
                    err,
                    "`optimizer_in_backward`: accumulation needs a gradient shard to add micro-batches in: the batch sizes resolve to gradient_accumulation_steps 2 at 3 ranks (train_batch_size 12 = micro batch 2 x ranks); it must be 1"
                );
            });
        }
    });
    let (vs, layers) = init_layers(&DIMS);
    let comm = threads::group(1, Duration::from_secs(60)).pop().unwrap();
    let options = EngineOptions::default().units_of(&layers);
    let mut engine = Engine::new(&vs, in_backward_config(true, json!({})), Box::new(comm), options).unwrap();
    let x = Tensor::ones([4, IN], (tch::Kind::Float, tch::Device::Cpu));
    for second in [false, true] {
        let loss = engine.forward(&layers, &x).unwrap().square().mean(None);
        let r = engine.backward_units(&layers, &loss);
        if second {
            assert_eq!(
                r.unwrap_err().to_string(),
                "optimizer_in_backward steps the optimizer during backward: call `engine.step()` after each backward (gradient_accumulation_steps is 1)"
            );
        } else {
            r.unwrap();
        }
    }
}

#[test]
fn optimizer_in_backward_at_stage_0_steps_each_bucket_as_its_all_reduce_lands_bitwise_like_the_whole_step() {
    // Stage 0 (its all-reduce in backward) with buckets of 40 elements: each layer's weight a bucket of its own,
    // biases together, decay and no-decay groups across them; the predivide's post-factor applied bucket by bucket
    // as each lands. One rank has no all-reduce and takes its ordinary step.
    let options =
        EngineOptions { no_weight_decay: Some(zerorun::runtime::engine::no_decay_for_1d), ..Default::default() };
    for (world, extra) in [
        (2, json!({"zero_optimization": {"stage": 0}})),
        (3, json!({"zero_optimization": {"stage": 0}, "gradient_predivide_factor": 2.0})),
        (1, json!({"zero_optimization": {"stage": 0}})),
    ] {
        let [whole, pieces] = [false, true]
            .map(|b| run_with(world, in_backward_config(b, extra.clone()), Units::PerLayer, options.clone(), &DIMS));
        for (rank, (w, p)) in whole.iter().zip(&pieces).enumerate() {
            let d = max_relative_difference(&p.params, &w.params);
            assert!(w.params == p.params, "stage 0, world size {world}, rank {rank}: weights differ ({d:e})");
        }
    }
    // The step happens in backward: the weights change there, and `engine.step` ends it; a second backward first
    // is refused, naming the call to make.
    let comms = threads::group(2, Duration::from_secs(60));
    std::thread::scope(|s| {
        for comm in comms {
            s.spawn(move || {
                let (vs, layers) = init_layers(&DIMS);
                let config = in_backward_config(true, json!({"zero_optimization": {"stage": 0}}));
                let mut engine = Engine::new(&vs, config, Box::new(comm), EngineOptions::default().units_of(&layers)).unwrap();
                let x = Tensor::ones([2, IN], (tch::Kind::Float, tch::Device::Cpu));
                // WarmupLR's first two steps (iterations -1 and 0) have a learning rate of 0.
                for _ in 0..2 {
                    let loss = engine.forward(&layers, &x).unwrap().square().mean(None);
                    engine.backward_units(&layers, &loss).unwrap();
                    engine.step().unwrap();
                }
                let before = full_parameters(&mut engine);
                let loss = engine.forward(&layers, &x).unwrap().square().mean(None);
                engine.backward_units(&layers, &loss).unwrap();
                let after_backward = full_parameters(&mut engine);
                assert!(after_backward != before, "the optimizer stepped in backward");
                let loss = engine.forward(&layers, &x).unwrap().square().mean(None);
                assert_eq!(
                    engine.backward_units(&layers, &loss).unwrap_err().to_string(),
                    "optimizer_in_backward steps the optimizer during backward: call `engine.step()` after each backward (gradient_accumulation_steps is 1)"
                );
                engine.step().unwrap();
                assert_eq!(full_parameters(&mut engine), after_backward, "the step in backward is the whole step");
            });
        }
    });
}

#[test]
fn a_bare_stage_3_config_sizes_its_buckets_from_the_units_and_saves_what_deepspeeds_defaults_keep() {
    // `{"stage": 3}` alone: DeepSpeed's defaults (1e9 live parameters, 5e7 prefetched) would keep this model
    // gathered whole; sized from the units, one unit is live at a time. The same training either way.
    let dims = [IN, 256, 256, OUT];
    let bare = |zero: Value| {
        Config::from_value(json!({
            "train_batch_size": GLOBAL_BATCH, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": zero
        }))
        .unwrap()
    };
    let sized = bare(json!({"stage": 3, "stage3_max_reuse_distance": 0}));
    assert_eq!(
        sized.zero_optimization.sized_from_model,
        [
            "reduce_bucket_size",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters"
        ]
    );
    let defaults = bare(json!({
        "stage": 3, "stage3_max_reuse_distance": 0, "reduce_bucket_size": 500_000_000,
        "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000u64
    }));
    assert!(defaults.zero_optimization.sized_from_model.is_empty());
    let (small, large) =
        (run(2, sized, Units::PerLayer, false, &dims), run(2, defaults, Units::PerLayer, false, &dims));
    let unit_bytes: Vec<usize> = dims.windows(2).map(|w| ((w[0] * w[1] + w[1]) as usize).div_ceil(2) * 2 * 4).collect();
    let largest = *unit_bytes.iter().max().unwrap();
    for (s, l) in small.iter().zip(&large) {
        assert!(
            l.peak_gathered >= unit_bytes.iter().sum::<usize>() - unit_bytes[0],
            "DeepSpeed's defaults keep the model gathered: {}",
            l.peak_gathered
        );
        assert!(
            s.peak_gathered <= 2 * largest,
            "sized: at most the largest unit in use and the next one prefetched: {}",
            s.peak_gathered
        );
        let d = max_relative_difference(&s.params, &l.params);
        assert!(d <= 1e-6, "the same training: {d}");
    }
}
