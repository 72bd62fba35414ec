//! Shard groups (MiCS, `mics_shard_size`): ZeRO partitions over groups of consecutive ranks and the groups replicate
//! each other. At 4 thread ranks in 2 groups of 2 and 2 ranks in groups of 1, stages 1-3, the MLP ends at the
//! single-process AdamW reference within 1e-5 (every rank alike, whatever the other groups started from); the
//! optimizer states per rank are those of the group's size; two-level communicators (2 hosts x 2) split the shard
//! groups inside the hosts; quantized gradients quantize the all-reduce across the groups; the first group's checkpoint loads in a plain engine of another size; bad sizes and
//! combinations are errors naming the key.
use std::time::Duration;

use serde_json::{json, Value};
use tch::Tensor;
use zerorun::runtime::comm::{threads, Communicator};
use zerorun::{Config, Engine, EngineOptions};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

#[path = "common/hosts.rs"]
mod hosts;
use hosts::two_level_comms;

#[path = "common/compare.rs"]
mod compare;
use compare::{full_parameters, max_relative_difference};

const DIMS: [i64; 4] = [IN, HIDDEN, HIDDEN, OUT];

fn config(stage: u64, zero: Value, top: Value) -> Config {
    let mut z = json!({"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0});
    for (k, v) in zero.as_object().unwrap() {
        z[k] = v.clone();
    }
    let mut c = json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": z
    });
    for (k, v) in top.as_object().unwrap() {
        c[k] = v.clone();
    }
    Config::from_value(c).unwrap()
}

/// What one rank saw.
struct RankRun {
    params: Vec<(String, Vec<f32>)>,
    rank: usize,
    world_size: usize,
    shard_group_size: usize,
    optimizer_bytes: usize,
    losses: Vec<f64>,
}

fn thread_comms(world: usize) -> Vec<Box<dyn Communicator>> {
    threads::group(world, Duration::from_secs(60)).into_iter().map(|c| Box::new(c) as Box<dyn Communicator>).collect()
}

/// Trains the MLP (a unit per layer) on every rank of `comms` through `zerorun::initialize_with`, which lays out the
/// shard groups; ranks other than 0 start from other weights (the engine must start them all from rank 0's). With
/// `save`, saves a checkpoint there at the end.
fn run_on(comms: Vec<Box<dyn Communicator>>, config: Config, save: Option<&std::path::Path>) -> Vec<RankRun> {
    let (xv, yv) = data();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(job_rank, comm)| {
                let (config, xv, yv) = (config.clone(), &xv, &yv);
                s.spawn(move || {
                    let kind = if config.bf16.enabled { tch::Kind::BFloat16 } else { tch::Kind::Float };
                    let (x, y) = (
                        Tensor::from_slice(xv).view([SAMPLES, IN]).to_kind(kind),
                        Tensor::from_slice(yv).view([SAMPLES, OUT]).to_kind(kind),
                    );
                    let (mut vs, layers) = init_layers(&DIMS);
                    if config.bf16.enabled {
                        vs.bfloat16();
                    }
                    if job_rank > 0 {
                        tch::no_grad(|| {
                            for (_, mut t) in vs.variables() {
                                let _ = t.f_add_scalar_(0.25 * job_rank as f64).unwrap();
                            }
                        });
                    }
                    let options = EngineOptions::default().units_of(&layers);
                    let mut engine = zerorun::initialize_with(&vs, config, comm, options).unwrap();
                    let b = engine.batch_sizes();
                    let (rank, world) = (engine.rank() as i64, engine.world_size() as i64);
                    let micro = b.train_micro_batch_size_per_gpu as i64;
                    let mut losses = Vec::new();
                    for step in 0..STEPS {
                        let order = batch_indices(step);
                        for m in 0..b.gradient_accumulation_steps as i64 {
                            let first = ((m * world + rank) * micro) as usize;
                            let idx = Tensor::from_slice(&order[first..first + micro as usize]);
                            let pred = engine.forward(&layers, &x.index_select(0, &idx)).unwrap();
                            let loss = pred.mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
                            engine.backward_units(&layers, &loss).unwrap();
                            if let zerorun::StepOutcome::Stepped { loss, .. } = engine.step().unwrap() {
                                losses.push(loss);
                            }
                        }
                    }
                    if let Some(dir) = save {
                        engine.save_checkpoint(dir, Some("mics")).unwrap();
                    }
                    let optimizer_bytes = engine
                        .memory_bytes()
                        .iter()
                        .find(|(c, _)| c.name() == "optimizer_states")
                        .map_or(0, |(_, b)| *b);
                    let params = full_parameters(&mut engine);
                    RankRun {
                        params,
                        rank: engine.rank(),
                        world_size: engine.world_size(),
                        shard_group_size: engine.shard_group_size(),
                        optimizer_bytes,
                        losses,
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn shard_groups_match_the_single_process_reference_at_stages_1_to_3() {
    let reference = adamw_reference();
    // (stage, ranks, shard group, overlap_comm)
    for (stage, world, shard, overlap) in
        [(3, 4, 2, true), (3, 4, 2, false), (2, 4, 2, true), (1, 4, 2, false), (3, 2, 1, true)]
    {
        let c = config(stage, json!({"mics_shard_size": shard, "overlap_comm": overlap}), json!({}));
        let runs = run_on(thread_comms(world), c, None);
        for (job_rank, r) in runs.iter().enumerate() {
            let what = format!("stage {stage}, {world} ranks in groups of {shard}, overlap {overlap}, rank {job_rank}");
            assert_eq!((r.rank, r.world_size, r.shard_group_size), (job_rank, world, shard), "{what}");
            let d = max_relative_difference(&r.params, &reference);
            assert!(d <= 1e-5, "{what}: {d:e} from the reference");
            assert_eq!(r.params, runs[0].params, "{what}: every rank holds the same parameters");
            assert_eq!(r.losses, runs[0].losses, "{what}: the loss is the mean over every data-parallel rank");
        }
    }
}

#[test]
fn a_rank_keeps_the_optimizer_states_of_its_group_size() {
    let states = |world: usize, zero: Value| {
        let runs = run_on(thread_comms(world), config(3, zero, json!({})), None);
        runs.iter().map(|r| r.optimizer_bytes).collect::<Vec<_>>()
    };
    let groups_of_2 = states(4, json!({"mics_shard_size": 2}));
    let two_ranks = states(2, json!({}));
    let four_ranks = states(4, json!({}));
    assert!(four_ranks[0] > 0);
    assert_eq!(groups_of_2[..2], two_ranks[..], "4 ranks in groups of 2 keep what 2 ranks keep");
    assert_eq!(groups_of_2[2..], two_ranks[..]);
    assert!(groups_of_2[0] > four_ranks[0] * 3 / 2, "{groups_of_2:?} against {four_ranks:?}");
}

#[test]
fn shard_groups_of_a_host_run_over_two_level_communicators_and_bf16_stays_near_fp32() {
    let reference = adamw_reference();
    let c = config(3, json!({"mics_shard_size": 2}), json!({}));
    let runs = run_on(two_level_comms(2, 2), c, None);
    for r in &runs {
        assert!(max_relative_difference(&r.params, &reference) <= 1e-5, "rank {}", r.rank);
    }
    // bf16: the groups' losses follow the plain 4-rank run's.
    let bf16 = |zero: Value| {
        let runs = run_on(thread_comms(4), config(3, zero, json!({"bf16": {"enabled": true}})), None);
        runs[0].losses.clone()
    };
    let (grouped, plain) = (bf16(json!({"mics_shard_size": 2})), bf16(json!({})));
    for (step, (g, p)) in grouped.iter().zip(&plain).enumerate() {
        assert!((g - p).abs() <= 0.01 * p.abs() + 1e-3, "bf16 step {step}: {g} against {p}");
    }
}

/// `zero_quantized_gradients` with shard groups quantizes the all-reduce across the groups (the reduce-scatter
/// inside a group stays exact): the run ends near the reference, not at it, every rank alike.
#[test]
fn quantized_gradients_quantize_the_all_reduce_across_the_groups() {
    let reference = adamw_reference();
    for stage in [2, 3] {
        let zero = json!({"mics_shard_size": 2, "zero_quantized_gradients": true});
        let runs = run_on(two_level_comms(2, 2), config(stage, zero, json!({})), None);
        let d = max_relative_difference(&runs[0].params, &reference);
        assert!(d > 1e-6 && d < 0.1, "stage {stage}: {d:e} from the reference");
        for r in &runs {
            assert_eq!(r.params, runs[0].params, "stage {stage}, rank {}", r.rank);
        }
    }
}

#[test]
fn the_first_group_writes_a_checkpoint_that_loads_at_another_world_size_and_stage() {
    let dir = std::env::temp_dir().join(format!("zerorun-mics-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let runs = run_on(thread_comms(4), config(3, json!({"mics_shard_size": 2}), json!({})), Some(&dir));
    assert!(dir.join("mics").is_dir() && dir.join("latest").is_file());
    let loaded = on_thread_ranks(3, |comm, _, _| {
        let (vs, layers) = init_layers(&DIMS);
        let options = EngineOptions::default().units_of(&layers);
        let mut engine = Engine::new(&vs, config(2, json!({}), json!({})), Box::new(comm), options).unwrap();
        engine.load_checkpoint(&dir, None).unwrap();
        full_parameters(&mut engine)
    });
    for params in loaded {
        assert_eq!(params, runs[0].params, "the shard groups' parameters, loaded at 3 ranks and stage 2");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_engine_built_on_a_communicator_lays_out_the_shard_groups_too() {
    let reference = adamw_reference();
    let (xv, yv) = data();
    let finals = on_thread_ranks(4, |comm, _, _| {
        let (x, y) = (Tensor::from_slice(&xv).view([SAMPLES, IN]), Tensor::from_slice(&yv).view([SAMPLES, OUT]));
        let (vs, layers) = init_layers(&DIMS);
        let options = EngineOptions::default().units_of(&layers);
        let c = config(2, json!({"mics_shard_size": 2}), json!({}));
        let mut engine = Engine::new(&vs, c, Box::new(comm), options).unwrap();
        assert_eq!((engine.world_size(), engine.shard_group_size()), (4, 2));
        let (rank, micro) = (engine.rank() as i64, engine.batch_sizes().train_micro_batch_size_per_gpu as i64);
        for step in 0..STEPS {
            let order = batch_indices(step);
            let first = (rank * micro) as usize;
            let idx = Tensor::from_slice(&order[first..first + micro as usize]);
            let loss = engine
                .forward(&layers, &x.index_select(0, &idx))
                .unwrap()
                .mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
            engine.backward_units(&layers, &loss).unwrap();
            engine.step().unwrap();
        }
        full_parameters(&mut engine)
    });
    for (rank, params) in finals.iter().enumerate() {
        assert!(max_relative_difference(params, &reference) <= 1e-5, "rank {rank}");
    }
}

/// Built unit by unit (`Engine::from_builders`) from initial weights in a file, in shard groups: every group's
/// units start alike and the run ends at the reference.
#[test]
fn models_built_unit_by_unit_train_in_shard_groups() {
    let reference = adamw_reference();
    let dir = std::env::temp_dir().join(format!("zerorun-mics-builders-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let init = dir.join("init.safetensors");
    let (vs, _) = init_layers(&DIMS);
    vs.save(&init).unwrap();
    let (xv, yv) = data();
    let finals = on_thread_ranks(4, |comm, _, _| {
        let (x, y) = (Tensor::from_slice(&xv).view([SAMPLES, IN]), Tensor::from_slice(&yv).view([SAMPLES, OUT]));
        let builders = (0..DIMS.len() - 1).fold(zerorun::UnitBuilders::new(), |b, i| {
            b.unit([format!("layers.{i}")], move |p: &tch::nn::Path| {
                let l = tch::nn::linear(p / "layers" / i, DIMS[i], DIMS[i + 1], Default::default());
                let last = i + 2 == DIMS.len();
                Box::new(move |x: &Tensor| {
                    let h = tch::nn::Module::forward(&l, x);
                    if last {
                        h
                    } else {
                        h.gelu("none")
                    }
                })
            })
        });
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let c = config(3, json!({"mics_shard_size": 2}), json!({}));
        let (mut engine, model) =
            Engine::from_builders(&vs, c, Box::new(comm), EngineOptions::default(), builders.init_from(&init)).unwrap();
        let (rank, micro) = (engine.rank() as i64, engine.batch_sizes().train_micro_batch_size_per_gpu as i64);
        for step in 0..STEPS {
            let order = batch_indices(step);
            let first = (rank * micro) as usize;
            let idx = Tensor::from_slice(&order[first..first + micro as usize]);
            let out = engine.forward(&model, &x.index_select(0, &idx)).unwrap();
            let loss = out.mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
            engine.backward_units(&model, &loss).unwrap();
            engine.step().unwrap();
        }
        let params = full_parameters(&mut engine);
        (engine.shard_group_size(), params)
    });
    for (rank, (shard, params)) in finals.iter().enumerate() {
        assert_eq!(*shard, 2);
        assert!(max_relative_difference(params, &reference) <= 1e-5, "rank {rank}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_shard_groups_are_errors_naming_the_key() {
    let err = |world: usize, c: Config| {
        let errors = on_thread_ranks(world, |comm, _, _| {
            let (vs, layers) = init_layers(&DIMS);
            let options = EngineOptions::default().units_of(&layers);
            zerorun::initialize_with(&vs, c.clone(), Box::new(comm) as Box<dyn Communicator>, options)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        });
        errors[0].clone()
    };
    let e = err(4, config(3, json!({"mics_shard_size": 3}), json!({})));
    assert!(
        e.contains("zero_optimization.mics_shard_size") && e.contains("must divide the 4 data-parallel ranks"),
        "{e}"
    );
    let e = err(
        4,
        config(
            1,
            json!({"mics_shard_size": 2}),
            json!({"gradient_clipping": 0.0, "async_training": {"mode": "bounded_staleness", "staleness": 1}}),
        ),
    );
    assert!(e.contains("zero_optimization.mics_shard_size") && e.contains("synchronous"), "{e}");
    for (stage, zero, why) in [
        (0, json!({"mics_shard_size": 2}), "stage 0"),
        (3, json!({"mics_shard_size": 2, "zero_hpz_partition_size": 2}), "zero_hpz_partition_size"),
    ] {
        let mut z = zero.clone();
        z["stage"] = json!(stage);
        let e = Config::from_value(json!({"train_batch_size": 4, "zero_optimization": z})).unwrap_err().to_string();
        assert!(e.contains("zero_optimization.mics_shard_size") && e.contains(why), "{e}");
    }
}
