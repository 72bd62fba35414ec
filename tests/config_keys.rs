//! No config key is silently ignored. `every_accepted_key_is_acted_on_noticed_or_refused` walks every key zerorun
//! accepts (`Config::accepted_keys`) through one table: each is acted on (the named test shows the effect), has no
//! effect here and is noticed (a warning naming it, in `config.notices`), or is refused. The effects no other test
//! covered are shown in `tests/config_effects.rs`.
use serde_json::{json, Value};
use zerorun::Config;

#[path = "common/json.rs"]
mod json;
use json::merged;

/// What a key does.
enum Effect {
    /// It holds other keys.
    Section,
    /// Acted on: this file's tests show the effect (the file names the key).
    Acted(&'static str),
    /// Acted on: the test of tests/config_effects.rs named here shows the effect.
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
    // Lamb is refused at initialize (optimizer.type), so its own keys never act.
    let lamb = "lamb_is_refused_at_initialize_so_its_own_keys_never_act";
    let one_bit = |params: Value| json!({"optimizer": {"type": "OneBitAdam", "params": params}});
    vec![
        ("activation_checkpointing", Section),
        (
            "activation_checkpointing.contiguous_memory_optimization",
            Noticed(json!({"activation_checkpointing": {"contiguous_memory_optimization": true}})),
        ),
        ("activation_checkpointing.cpu_checkpointing", Acted("tests/device_emulation.rs")),
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
        ("async_training", Section),
        ("async_training.lr_staleness_scaling", Acted("tests/async_training.rs")),
        ("async_training.mode", Acted("tests/async_training.rs")),
        ("async_training.outer_optimizer", Section),
        ("async_training.outer_optimizer.lr", Acted("tests/async_training.rs")),
        ("async_training.outer_optimizer.momentum", Acted("tests/async_training.rs")),
        ("async_training.outer_optimizer.type", Acted("tests/async_training.rs")),
        ("async_training.staleness", Acted("tests/async_training.rs")),
        ("async_training.sync_every", Acted("tests/async_training.rs")),
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
        ("checkpoint.async_save", Acted("tests/checkpoint_kill.rs")),
        ("checkpoint.load_universal", Noticed(json!({"checkpoint": {"load_universal": true}}))),
        ("checkpoint.parallel_write", Noticed(json!({"checkpoint": {"parallel_write": {"pipeline_stage": true}}}))),
        ("checkpoint.tag_validation", Here("checkpoint_tags_that_differ_across_ranks_follow_tag_validation")),
        ("checkpoint.use_node_local_storage", Noticed(json!({"checkpoint": {"use_node_local_storage": true}}))),
        ("comet", Section),
        ("comet.api_key", Noticed(json!({"comet": {"api_key": "k"}}))),
        ("comet.enabled", Refused(json!({"comet": {"enabled": true}}))),
        ("comet.experiment_key", Noticed(json!({"comet": {"experiment_key": "k"}}))),
        ("comet.experiment_name", Noticed(json!({"comet": {"experiment_name": "n"}}))),
        ("comet.mode", Noticed(json!({"comet": {"mode": "get"}}))),
        ("comet.online", Noticed(json!({"comet": {"online": true}}))),
        ("comet.project", Noticed(json!({"comet": {"project": "p"}}))),
        ("comet.samples_log_interval", Noticed(json!({"comet": {"samples_log_interval": 10}}))),
        ("comet.workspace", Noticed(json!({"comet": {"workspace": "w"}}))),
        ("comms_logger", Section),
        ("comms_logger.debug", Noticed(json!({"comms_logger": {"debug": true}}))),
        ("comms_logger.enabled", Acted("tests/monitors.rs")),
        ("comms_logger.prof_all", Acted("runtime/comm/src/logged.rs")),
        ("comms_logger.prof_ops", Acted("runtime/comm/src/logged.rs")),
        ("comms_logger.verbose", Acted("runtime/comm/src/logged.rs")),
        // The examples pass it to `communicator_from_env`, whose timeouts tests/shm_comm.rs and tests/config.rs show.
        ("comms_timeout", Acted("examples/mlp.rs")),
        ("communication_data_type", Here("communication_data_type_changes_what_travels_not_what_trains")),
        ignored("compile"),
        ignored("compression_training"),
        ("csv_monitor", Section),
        ("csv_monitor.enabled", Acted("tests/monitors.rs")),
        ("csv_monitor.job_name", Acted("tests/monitors.rs")),
        ("csv_monitor.output_path", Acted("tests/monitors.rs")),
        ignored("curriculum_learning"),
        ignored("data_efficiency"),
        ignored("dump_state"),
        ignored("eigenvalue"),
        ("elasticity", Section),
        ("elasticity.enabled", Acted("tests/config.rs")),
        ("elasticity.ignore_non_elastic_batch_info", Acted("tests/config.rs")),
        ("elasticity.max_gpus", Acted("tests/config.rs")),
        ("elasticity.max_train_batch_size", Acted("tests/config.rs")),
        ("elasticity.micro_batch_sizes", Acted("tests/config.rs")),
        ("elasticity.min_gpus", Acted("tests/config.rs")),
        ("elasticity.min_time", Noticed(json!({"elasticity": {"min_time": 20}}))),
        ("elasticity.model_parallel_size", Refused(json!({"elasticity": {"model_parallel_size": 2}}))),
        ("elasticity.num_gpus_per_node", Acted("tests/config.rs")),
        ("elasticity.prefer_larger_batch", Acted("tests/config.rs")),
        ("elasticity.version", Acted("tests/config.rs")),
        ("fault_tolerance", Section),
        ("fault_tolerance.enabled", Acted("tests/fault_tolerance.rs")),
        ("fault_tolerance.heartbeat_ms", Acted("tests/fault_tolerance.rs")),
        ("fault_tolerance.min_replicas", Acted("tests/fault_tolerance.rs")),
        ("fault_tolerance.quorum_timeout", Acted("tests/fault_tolerance.rs")),
        ("expert_parallel", Section),
        ("expert_parallel.autoep_size", Acted("tests/llama.rs")),
        (
            "expert_parallel.disable_triton_grouped_mm",
            Noticed(json!({"expert_parallel": {"disable_triton_grouped_mm": true}})),
        ),
        ("expert_parallel.enabled", Acted("tests/llama.rs")),
        (
            "expert_parallel.expert_tensor_parallel_size",
            Refused(json!({"expert_parallel": {"expert_tensor_parallel_size": 2}})),
        ),
        ("expert_parallel.preset_model", Acted("tests/llama.rs")),
        ("expert_parallel.use_grouped_mm", Noticed(json!({"expert_parallel": {"use_grouped_mm": true}}))),
        ("flops_profiler", Section),
        ("flops_profiler.detailed", Acted("tests/monitors.rs")),
        ("flops_profiler.enabled", Acted("tests/monitors.rs")),
        ("flops_profiler.module_depth", Noticed(json!({"flops_profiler": {"module_depth": 2}}))),
        ("flops_profiler.output_file", Acted("tests/monitors.rs")),
        ("flops_profiler.profile_step", Acted("tests/monitors.rs")),
        ("flops_profiler.recompute_fwd_factor", Acted("tests/monitors.rs")),
        ("flops_profiler.top_modules", Noticed(json!({"flops_profiler": {"top_modules": 3}}))),
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
        ("gradient_compression", Section),
        ("gradient_compression.matrix_approximation_rank", Acted("tests/compression.rs")),
        ("gradient_compression.min_compression_rate", Acted("tests/compression.rs")),
        ("gradient_compression.orthogonalization_epsilon", Acted("tests/compression.rs")),
        ("gradient_compression.random_seed", Acted("tests/compression.rs")),
        ("gradient_compression.start_powerSGD_iter", Acted("tests/compression.rs")),
        ("gradient_compression.type", Acted("tests/compression.rs")),
        ("gradient_compression.use_error_feedback", Acted("tests/compression.rs")),
        ("gradient_compression.warm_start", Acted("tests/compression.rs")),
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
        ("optimizer.params.coeff_beta", Acted("tests/compression.rs")),
        ("optimizer.params.comm_backend_name", Noticed(one_bit(json!({"comm_backend_name": "mpi"})))),
        ("optimizer.params.cuda_aware", Noticed(one_bit(json!({"cuda_aware": true})))),
        ("optimizer.params.dampening", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.eps", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.eps_inside_sqrt", Here(lamb)),
        ("optimizer.params.factor_max", Acted("tests/compression.rs")),
        ("optimizer.params.factor_min", Acted("tests/compression.rs")),
        ("optimizer.params.factor_threshold", Acted("tests/compression.rs")),
        ("optimizer.params.freeze_step", Acted("tests/compression.rs")),
        ("optimizer.params.initial_accumulator_value", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.local_step_clipper", Acted("tests/compression.rs")),
        ("optimizer.params.local_step_scaler", Acted("tests/compression.rs")),
        ("optimizer.params.lr", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.lr_decay", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.max_coeff", Here(lamb)),
        ("optimizer.params.max_grad_norm", Refused(adam(json!({"max_grad_norm": 1.0})))),
        ("optimizer.params.min_coeff", Here(lamb)),
        ("optimizer.params.momentum", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.nesterov", Acted("tests/optim_vs_torch.rs")),
        ("optimizer.params.torch_adam", Noticed(adam(json!({"torch_adam": true})))),
        ("optimizer.params.var_freeze_step", Acted("tests/compression.rs")),
        ("optimizer.params.var_update_scaler", Acted("tests/compression.rs")),
        ("optimizer.params.weight_decay", Acted("tests/equivalence.rs")),
        ("optimizer.type", Acted("tests/equivalence.rs")),
        ("optimizer_in_backward", Acted("tests/stage3.rs")),
        ("pipeline", Section),
        (
            "pipeline.activation_checkpoint_interval",
            Noticed(json!({"pipeline": {"activation_checkpoint_interval": 2}})),
        ),
        ("pipeline.allow_fewer_micro_batches", Acted("tests/pipeline.rs")),
        ("pipeline.grad_partitioned", Noticed(json!({"pipeline": {"grad_partitioned": false}}))),
        ("pipeline.partition", Acted("tests/pipeline.rs")),
        ("pipeline.pipe_partitioned", Noticed(json!({"pipeline": {"pipe_partitioned": false}}))),
        ("pipeline.schedule", Acted("tests/pipeline.rs")),
        ("pipeline.seed_layers", Noticed(json!({"pipeline": {"seed_layers": true}}))),
        ("pipeline.stages", Acted("tests/pipeline.rs")),
        ("pipeline.virtual_stages", Acted("tests/pipeline.rs")),
        ("pipeline.use_reentrant", Noticed(json!({"pipeline": {"use_reentrant": false}}))),
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
        ("sequence_parallel_size", Acted("tests/llama.rs")),
        ignored("sparse_attention"),
        ignored("sparse_gradients"),
        ("steps_per_print", Here("steps_per_print_and_wall_clock_breakdown_log_on_rank_0")),
        ("tensorboard", Section),
        ("tensorboard.enabled", Acted("tests/monitors.rs")),
        ("tensorboard.job_name", Acted("tests/monitors.rs")),
        ("tensorboard.output_path", Acted("tests/monitors.rs")),
        ignored("timers"),
        ("train_batch_size", Acted("tests/config.rs")),
        ("train_micro_batch_size_per_gpu", Acted("tests/config.rs")),
        ("wall_clock_breakdown", Here("steps_per_print_and_wall_clock_breakdown_log_on_rank_0")),
        ("wandb", Section),
        ("wandb.enabled", Refused(json!({"wandb": {"enabled": true}}))),
        ("wandb.group", Noticed(json!({"wandb": {"group": "g"}}))),
        ("wandb.project", Noticed(json!({"wandb": {"project": "p"}}))),
        ("wandb.team", Noticed(json!({"wandb": {"team": "t"}}))),
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
        ("zero_optimization.mics_shard_size", Acted("tests/shard_groups.rs")),
        (
            "zero_optimization.mics_hierarchical_params_gather",
            Noticed(zero(json!({"mics_hierarchical_params_gather": true}))),
        ),
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
        ("zero_optimization.zero_hpz_partition_size", Acted("tests/zeropp.rs")),
        ("zero_optimization.zero_quantized_gradients", Acted("tests/zeropp.rs")),
        (
            "zero_optimization.zero_quantized_nontrainable_weights",
            Refused(zero(json!({"zero_quantized_nontrainable_weights": true}))),
        ),
        ("zero_optimization.zero_quantized_weights", Acted("tests/zeropp.rs")),
        ("zero_optimization.zeropp_loco_param", Noticed(zero(json!({"zeropp_loco_param": {}})))),
    ]
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
    let this = std::fs::read_to_string(format!("{root}/tests/config_effects.rs")).unwrap();
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
            Here(test) => (!this.contains(&format!("fn {test}()")))
                .then(|| format!("no test `{test}` in tests/config_effects.rs")),
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

/// The generated reference (`zerorun config keys`) says of every key what this file's table shows it does.
#[test]
fn the_config_reference_agrees_with_the_table() {
    use zerorun::config::keys::KeyStatus;
    let table = table();
    let mut failures = Vec::new();
    for key in zerorun::config::keys::reference() {
        let Some((_, effect)) = table.iter().find(|(k, _)| *k == key.path) else {
            failures.push(format!("{}: not in the table", key.path));
            continue;
        };
        let expected = match effect {
            Section => KeyStatus::Section,
            Acted(_) | Here(_) => KeyStatus::Acted,
            Noticed(_) => KeyStatus::Noticed,
            Refused(_) => KeyStatus::Refused,
        };
        if key.status != expected {
            failures.push(format!("{}: the reference says {:?}, the table shows {expected:?}", key.path, key.status));
        }
        if key.what.is_empty() {
            failures.push(format!("{}: no description", key.path));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Defaults are DeepSpeed's, and stage 3's size keys are sized from the model.
    let default =
        |path: &str| zerorun::config::keys::reference().into_iter().find(|k| k.path == path).and_then(|k| k.default);
    assert_eq!(default("gradient_clipping"), Some(json!(1.0)));
    assert_eq!(default("zero_optimization.stage"), Some(json!(0)));
    assert_eq!(default("zero_optimization.stage3_max_live_parameters"), Some(json!("auto")));
    assert_eq!(default("train_batch_size"), None);
}
