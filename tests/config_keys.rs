//! No config key is silently ignored. `every_accepted_key_is_acted_on_noticed_or_refused` walks every key zerorun
//! accepts (`Config::accepted_keys`) through one table: each is acted on (the named test shows the effect), has no
//! effect here and is noticed (a warning naming it, in `config.notices`), or is refused. The other tests show the
//! effect of keys no other test covered.
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tch::Tensor;
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions, StepOutcome};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

/// What a key does.
enum Effect {
    /// It holds other keys.
    Section,
    /// Acted on: this file's tests show the effect (the file names the key).
    Acted(&'static str),
    /// Acted on by the tests of this file (named here by the test that shows it).
    Here(&'static str),
    /// No effect when the config is this: a notice names the key.
    Noticed(Value),
    /// Refused: the error names the key.
    Refused(Value),
}
use Effect::*;

fn table() -> Vec<(&'static str, Effect)> {
    let ignored = |key: &'static str| (key, Noticed(json!({ key: {} })));
    let zero = |fragment: Value| json!({ "zero_optimization": fragment });
    let adam = |params: Value| json!({"optimizer": {"type": "Adam", "params": params}});
    let lamb = "Lamb is refused at initialize (optimizer.type), so its own keys never act";
    vec![
        ("activation_checkpointing", Section),
        (
            "activation_checkpointing.contiguous_memory_optimization",
            Noticed(json!({"activation_checkpointing": {"contiguous_memory_optimization": true}})),
        ),
        (
            "activation_checkpointing.cpu_checkpointing",
            Noticed(json!({"activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true}})),
        ),
        (
            "activation_checkpointing.number_checkpoints",
            Noticed(json!({"activation_checkpointing": {"number_checkpoints": 4}})),
        ),
        (
            "activation_checkpointing.partition_activations",
            Noticed(json!({"activation_checkpointing": {"partition_activations": true}})),
        ),
        ("activation_checkpointing.profile", Noticed(json!({"activation_checkpointing": {"profile": true}}))),
        (
            "activation_checkpointing.synchronize_checkpoint_boundary",
            Noticed(json!({"activation_checkpointing": {"synchronize_checkpoint_boundary": true}})),
        ),
        ("aio", Section),
        ("aio.block_size", Acted("tests/offload.rs")),
        ("aio.intra_op_parallelism", Acted("tests/offload.rs")),
        ("aio.overlap_events", Noticed(json!({"aio": {"overlap_events": false}}))),
        ("aio.queue_depth", Acted("tests/offload.rs")),
        ("aio.single_submit", Noticed(json!({"aio": {"single_submit": true}}))),
        ("aio.use_gds", Refused(json!({"aio": {"use_gds": true}}))),
        ignored("amp"),
        ignored("autotuning"),
        ("bf16", Section),
        ("bf16.check_grad_overflow", Here("bf16_check_grad_overflow_skips_a_step_with_a_non_finite_gradient")),
        ("bf16.enabled", Acted("tests/mixed_precision.rs")),
        ("checkpoint", Section),
        ("checkpoint.load_universal", Noticed(json!({"checkpoint": {"load_universal": true}}))),
        ("checkpoint.parallel_write", Noticed(json!({"checkpoint": {"parallel_write": {"pipeline_stage": true}}}))),
        ("checkpoint.tag_validation", Here("checkpoint_tags_that_differ_across_ranks_follow_tag_validation")),
        ("checkpoint.use_node_local_storage", Noticed(json!({"checkpoint": {"use_node_local_storage": true}}))),
        ignored("comet"),
        ignored("comms_logger"),
        // The examples pass it to `communicator_from_env`, whose timeouts tests/shm_comm.rs and tests/config.rs show.
        ("comms_timeout", Acted("examples/mlp.rs")),
        ("communication_data_type", Here("communication_data_type_changes_what_travels_not_what_trains")),
        ignored("compile"),
        ignored("compression_training"),
        ignored("csv_monitor"),
        ignored("curriculum_learning"),
        ignored("data_efficiency"),
        ignored("dump_state"),
        ignored("eigenvalue"),
        ignored("elasticity"),
        ignored("flops_profiler"),
        ("fp16", Section),
        ("fp16.auto_cast", Noticed(json!({"fp16": {"enabled": true, "auto_cast": true}}))),
        ("fp16.consecutive_hysteresis", Acted("optim/src/loss_scale.rs")),
        ("fp16.enabled", Acted("tests/mixed_precision.rs")),
        ("fp16.hysteresis", Acted("tests/mixed_precision.rs")),
        ("fp16.initial_scale_power", Acted("tests/mixed_precision.rs")),
        ("fp16.loss_scale", Acted("tests/mixed_precision.rs")),
        ("fp16.loss_scale_window", Acted("tests/mixed_precision.rs")),
        ("fp16.min_loss_scale", Acted("optim/src/loss_scale.rs")),
        ignored("fp32_allreduce"),
        ("gradient_accumulation_steps", Acted("tests/equivalence.rs")),
        ("gradient_allreduce_op", Here("gradient_allreduce_op_sum_sums_where_mean_averages")),
        ("gradient_clipping", Acted("tests/equivalence.rs")),
        ("gradient_predivide_factor", Here("predivide_and_prescale_reduce_to_the_same_mean")),
        ignored("hybrid_engine"),
        ("memory_breakdown", Acted("tests/memory_report.rs")),
        ignored("nebula"),
        ("optimizer", Section),
        ("optimizer.params", Section),
        ("optimizer.params.adam_w_mode", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.amsgrad", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.betas", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.bias_correction", Here("adam_bias_correction_off_takes_the_raw_moments")),
        ("optimizer.params.dampening", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.eps", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.eps_inside_sqrt", Here(lamb)),
        ("optimizer.params.initial_accumulator_value", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.lr", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.lr_decay", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.max_coeff", Here(lamb)),
        ("optimizer.params.max_grad_norm", Refused(adam(json!({"max_grad_norm": 1.0})))),
        ("optimizer.params.min_coeff", Here(lamb)),
        ("optimizer.params.momentum", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.nesterov", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.torch_adam", Noticed(adam(json!({"torch_adam": true})))),
        ("optimizer.params.weight_decay", Acted("tests/equivalence.rs")),
        ("optimizer.type", Acted("tests/equivalence.rs")),
        ignored("pipeline"),
        ("prescale_gradients", Here("predivide_and_prescale_reduce_to_the_same_mean")),
        ignored("progressive_layer_drop"),
        ignored("quantize_training"),
        ("scheduler", Section),
        ("scheduler.params", Section),
        ("scheduler.params.cos_min_ratio", Acted("optim/tests/properties.rs")),
        ("scheduler.params.cycle_first_stair_count", Acted("optim/tests/properties.rs")),
        ("scheduler.params.cycle_first_step_size", Acted("optim/tests/properties.rs")),
        ("scheduler.params.cycle_max_lr", Acted("optim/tests/properties.rs")),
        ("scheduler.params.cycle_max_mom", Here("one_cycle_momentum_drives_beta1")),
        ("scheduler.params.cycle_min_lr", Acted("optim/tests/properties.rs")),
        ("scheduler.params.cycle_min_mom", Here("one_cycle_momentum_drives_beta1")),
        ("scheduler.params.cycle_momentum", Here("one_cycle_momentum_drives_beta1")),
        ("scheduler.params.cycle_second_stair_count", Acted("optim/tests/properties.rs")),
        ("scheduler.params.cycle_second_step_size", Acted("optim/tests/properties.rs")),
        ("scheduler.params.decay_lr_rate", Acted("optim/tests/properties.rs")),
        ("scheduler.params.decay_mom_rate", Acted("optim/tests/properties.rs")),
        ("scheduler.params.decay_step_size", Acted("optim/tests/properties.rs")),
        ("scheduler.params.last_batch_iteration", Acted("optim/tests/properties.rs")),
        ("scheduler.params.lr_range_test_min_lr", Acted("optim/tests/properties.rs")),
        ("scheduler.params.lr_range_test_staircase", Acted("optim/tests/properties.rs")),
        ("scheduler.params.lr_range_test_step_rate", Acted("optim/tests/properties.rs")),
        ("scheduler.params.lr_range_test_step_size", Acted("optim/tests/properties.rs")),
        ("scheduler.params.total_num_steps", Acted("optim/tests/properties.rs")),
        ("scheduler.params.warmup_max_lr", Acted("tests/checkpoint.rs")),
        ("scheduler.params.warmup_min_lr", Acted("tests/checkpoint.rs")),
        ("scheduler.params.warmup_min_ratio", Acted("optim/tests/properties.rs")),
        ("scheduler.params.warmup_num_steps", Acted("tests/checkpoint.rs")),
        ("scheduler.params.warmup_type", Acted("tests/checkpoint.rs")),
        ("scheduler.type", Acted("tests/checkpoint.rs")),
        ignored("sparse_attention"),
        ignored("sparse_gradients"),
        ("steps_per_print", Here("steps_per_print_and_wall_clock_breakdown_log_on_rank_0")),
        ignored("tensorboard"),
        ignored("timers"),
        ("train_batch_size", Acted("tests/config.rs")),
        ("train_micro_batch_size_per_gpu", Acted("tests/config.rs")),
        ("wall_clock_breakdown", Here("steps_per_print_and_wall_clock_breakdown_log_on_rank_0")),
        ignored("wandb"),
        ("zero_allow_untested_optimizer", Acted("tests/bad_configs/expected.txt")),
        ("zero_force_ds_cpu_optimizer", Noticed(json!({"zero_force_ds_cpu_optimizer": false}))),
        ignored("zero_ignore_unused_parameters"),
        ("zero_optimization", Section),
        ("zero_optimization.allgather_bucket_size", Noticed(zero(json!({"allgather_bucket_size": 1000})))),
        ("zero_optimization.allgather_partitions", Noticed(zero(json!({"allgather_partitions": false})))),
        ("zero_optimization.contiguous_gradients", Noticed(zero(json!({"contiguous_gradients": false})))),
        ("zero_optimization.cpu_offload", Acted("tests/config.rs")),
        ("zero_optimization.cpu_offload_param", Acted("tests/config.rs")),
        ("zero_optimization.cpu_offload_use_pin_memory", Noticed(zero(json!({"cpu_offload_use_pin_memory": true})))),
        ("zero_optimization.elastic_checkpoint", Noticed(zero(json!({"elastic_checkpoint": true})))),
        ("zero_optimization.ignore_unused_parameters", Here("unused_parameters_are_an_error_when_not_ignored")),
        ("zero_optimization.legacy_stage1", Noticed(zero(json!({"legacy_stage1": true})))),
        ("zero_optimization.load_from_fp32_weights", Noticed(zero(json!({"load_from_fp32_weights": false})))),
        ("zero_optimization.log_trace_cache_warnings", Noticed(zero(json!({"log_trace_cache_warnings": true})))),
        ("zero_optimization.memory_efficient_linear", Noticed(zero(json!({"memory_efficient_linear": false})))),
        ("zero_optimization.mics_shard_size", Refused(zero(json!({"mics_shard_size": 2})))),
        ("zero_optimization.offload_optimizer", Section),
        ("zero_optimization.offload_optimizer.buffer_count", Acted("tests/offload.rs")),
        ("zero_optimization.offload_optimizer.device", Acted("tests/offload.rs")),
        (
            "zero_optimization.offload_optimizer.fast_init",
            Noticed(zero(json!({"offload_optimizer": {"fast_init": true}}))),
        ),
        ("zero_optimization.offload_optimizer.nvme_path", Acted("tests/offload.rs")),
        (
            "zero_optimization.offload_optimizer.pin_memory",
            Noticed(zero(json!({"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": true}}))),
        ),
        ("zero_optimization.offload_optimizer.pipeline", Here("the_old_offload_pipeline_key_turns_on_both_directions")),
        ("zero_optimization.offload_optimizer.pipeline_read", Acted("tests/offload.rs")),
        ("zero_optimization.offload_optimizer.pipeline_write", Acted("tests/offload.rs")),
        ("zero_optimization.offload_optimizer.ratio", Noticed(zero(json!({"offload_optimizer": {"ratio": 0.5}})))),
        ("zero_optimization.offload_param", Section),
        ("zero_optimization.offload_param.buffer_count", Acted("tests/offload.rs")),
        ("zero_optimization.offload_param.buffer_size", Acted("tests/offload.rs")),
        ("zero_optimization.offload_param.device", Acted("tests/offload.rs")),
        ("zero_optimization.offload_param.max_in_cpu", Acted("tests/offload.rs")),
        ("zero_optimization.offload_param.nvme_path", Acted("tests/offload.rs")),
        (
            "zero_optimization.offload_param.pin_memory",
            Noticed(zero(json!({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true}}))),
        ),
        ("zero_optimization.overlap_comm", Acted("tests/stage3.rs")),
        ("zero_optimization.override_module_apply", Noticed(zero(json!({"override_module_apply": false})))),
        ("zero_optimization.pipeline_loading_checkpoint", Noticed(zero(json!({"pipeline_loading_checkpoint": true})))),
        ("zero_optimization.reduce_bucket_size", Acted("tests/stage2_hooks.rs")),
        ("zero_optimization.reduce_scatter", Here("reduce_scatter_off_all_reduces_to_the_same_result")),
        ("zero_optimization.round_robin_gradients", Noticed(zero(json!({"round_robin_gradients": true})))),
        ("zero_optimization.stage", Acted("tests/equivalence.rs")),
        ("zero_optimization.stage3_gather_16bit_weights_on_model_save", Acted("tests/stage3.rs")),
        (
            "zero_optimization.stage3_max_live_parameters",
            Here("stage3_live_and_persistence_limits_bound_what_stays_gathered"),
        ),
        ("zero_optimization.stage3_max_reuse_distance", Acted("tests/memory_report.rs")),
        (
            "zero_optimization.stage3_model_persistence_threshold",
            Here("stage3_live_and_persistence_limits_bound_what_stays_gathered"),
        ),
        ("zero_optimization.stage3_param_persistence_threshold", Acted("tests/stage3.rs")),
        ("zero_optimization.stage3_prefetch_bucket_size", Acted("tests/stage3.rs")),
        (
            "zero_optimization.stage3_use_all_reduce_for_fetch_params",
            Noticed(zero(json!({"stage3_use_all_reduce_for_fetch_params": true}))),
        ),
        ("zero_optimization.sub_group_size", Acted("tests/offload.rs")),
        (
            "zero_optimization.use_multi_rank_bucket_allreduce",
            Noticed(zero(json!({"use_multi_rank_bucket_allreduce": false}))),
        ),
        ("zero_optimization.zero_hpz_partition_size", Refused(zero(json!({"zero_hpz_partition_size": 2})))),
        ("zero_optimization.zero_quantized_gradients", Refused(zero(json!({"zero_quantized_gradients": true})))),
        (
            "zero_optimization.zero_quantized_nontrainable_weights",
            Refused(zero(json!({"zero_quantized_nontrainable_weights": true}))),
        ),
        ("zero_optimization.zero_quantized_weights", Refused(zero(json!({"zero_quantized_weights": true})))),
        ("zero_optimization.zeropp_loco_param", Noticed(zero(json!({"zeropp_loco_param": {}})))),
    ]
}

/// `base` with `fragment`'s keys merged in, recursively.
fn merged(mut base: Value, fragment: &Value) -> Value {
    if let (Value::Object(b), Value::Object(f)) = (&mut base, fragment) {
        for (k, v) in f {
            let slot = b.entry(k.clone()).or_insert(Value::Null);
            *slot = if slot.is_object() && v.is_object() { merged(slot.take(), v) } else { v.clone() };
        }
        return base;
    }
    fragment.clone()
}

#[test]
fn every_accepted_key_is_acted_on_noticed_or_refused() {
    let table = table();
    let listed: Vec<&str> = table.iter().map(|(k, _)| *k).collect();
    let accepted = Config::accepted_keys();
    let missing: Vec<&String> = accepted.iter().filter(|k| !listed.contains(&k.as_str())).collect();
    let extra: Vec<&&str> = listed.iter().filter(|k| !accepted.iter().any(|a| a == *k)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "keys accepted but not in the table: {missing:?}; in the table but not accepted: {extra:?}"
    );
    let root = env!("CARGO_MANIFEST_DIR");
    let this = std::fs::read_to_string(format!("{root}/tests/config_keys.rs")).unwrap();
    let base = json!({"train_batch_size": 4});
    // Nothing given, nothing noticed.
    assert_eq!(Config::from_value(base.clone()).unwrap().notices, vec![]);
    let mut failures = Vec::new();
    for (key, effect) in &table {
        let leaf = key.rsplit('.').next().unwrap();
        let failure = match effect {
            Section => {
                (!accepted.iter().any(|k| k.starts_with(&format!("{key}.")))).then(|| "holds no key".to_string())
            }
            Acted(file) => match std::fs::read_to_string(format!("{root}/{file}")) {
                Err(e) => Some(format!("{file}: {e}")),
                Ok(text) => (!text.contains(leaf)).then(|| format!("{file} does not name it")),
            },
            Here(test) => (!this.contains(&format!("fn {test}()")) && !test.starts_with("Lamb"))
                .then(|| format!("no test `{test}` in this file")),
            Noticed(fragment) => match Config::from_value(merged(base.clone(), fragment)) {
                Err(e) => Some(e.to_string()),
                Ok(c) => (!c.notices.iter().any(|n| n.path == *key)).then(|| format!("no notice in {:?}", c.notices)),
            },
            Refused(fragment) => match Config::from_value(merged(base.clone(), fragment)) {
                Ok(_) => Some("accepted".into()),
                Err(e) => (!e.to_string().contains(key)).then(|| format!("the error does not name it: {e}")),
            },
        };
        failures.extend(failure.map(|f| format!("{key}: {f}")));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn lamb_is_refused_at_initialize_so_its_own_keys_never_act() {
    let config = Config::from_value(json!({"train_batch_size": 4, "optimizer": {"type": "Lamb", "params": {"eps_inside_sqrt": true, "max_coeff": 5.0, "min_coeff": 0.1}}})).unwrap();
    let (vs, _model) = init_store();
    let comm = threads::group(1, std::time::Duration::from_secs(10)).pop().unwrap();
    let err =
        Engine::new(&vs, config, Box::new(comm), EngineOptions::default()).err().expect("Lamb is refused").to_string();
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
