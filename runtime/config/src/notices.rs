//! Keys zerorun accepts that have no effect in the config they are given in, each with the reason: DeepSpeed
//! features zerorun does not have, and knobs of DeepSpeed's own kernels or of a GPU run. Reading a config logs one
//! warning per notice and keeps them in [`Config::notices`](super::Config::notices), so nothing is silently
//! ignored. Only keys the config actually gives are noticed: a default never warns.
use std::collections::BTreeSet;

use serde::Serialize;
use serde_json::Value;

use super::{Config, OffloadDevice};

/// One accepted key that does nothing here, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Notice {
    /// The key's JSON path, e.g. `zero_optimization.round_robin_gradients`.
    pub path: String,
    /// Why it has no effect here.
    pub why: String,
}

/// The JSON path of every key present in `value` (objects only, nested paths joined by dots).
pub(crate) fn given_paths(value: &Value) -> BTreeSet<String> {
    fn walk(prefix: &str, value: &Value, out: &mut BTreeSet<String>) {
        if let Value::Object(map) = value {
            for (k, v) in map {
                if v.is_null() {
                    continue;
                }
                let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                walk(&path, v, out);
                out.insert(path);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk("", value, &mut out);
    out
}

const ACTIVATION_CHECKPOINTING: &str = "DeepSpeed's activation checkpointing API (deepspeed.checkpointing) reads it; zerorun recomputes stage-3 units with `EngineOptions::activation_checkpointing` and keeps a checkpointed unit's input whole on every tensor-parallel rank (no partitioned activations)";

/// The notices of `config`, read from a JSON that gave the keys `given`; `ignored` are the paths of whole
/// DeepSpeed features the readers took without looking inside.
pub(crate) fn collect(config: &Config, given: &BTreeSet<String>, ignored: Vec<String>) -> Vec<Notice> {
    let mut out: Vec<Notice> = ignored
        .into_iter()
        .map(|path| Notice { path, why: "a DeepSpeed feature zerorun does not implement; ignored".into() })
        .collect();
    let mut note = |path: &str, applies: bool, why: &str| {
        if applies && given.contains(path) {
            out.push(Notice { path: path.into(), why: why.into() });
        }
    };
    for key in ["expert_parallel.use_grouped_mm", "expert_parallel.disable_triton_grouped_mm"] {
        note(key, true, "DeepSpeed's grouped-GEMM switches; zerorun's experts run libtorch's matmuls");
    }
    let z = &config.zero_optimization;
    note(
        "zero_optimization.contiguous_gradients",
        !z.contiguous_gradients,
        "zerorun always copies gradients into contiguous buckets before reducing them",
    );
    note(
        "zero_optimization.round_robin_gradients",
        z.round_robin_gradients,
        "it spreads DeepSpeed's gradient copies into offloaded CPU buffers over ranks; zerorun reduces straight into each rank's shard",
    );
    note(
        "zero_optimization.allgather_partitions",
        !z.allgather_partitions,
        "zerorun gathers updated partitions with all-gathers (DeepSpeed's false uses broadcasts: the same values)",
    );
    note(
        "zero_optimization.allgather_bucket_size",
        // DeepSpeed's default is what `config show` writes back: only another value is the user's.
        z.allgather_bucket_size != 500_000_000,
        "zerorun all-gathers in place into the parameter buffer (stages 1-2) or unit by unit (stage 3, bounded by stage3_prefetch_bucket_size): there is no staging buffer to size",
    );
    note(
        "zero_optimization.elastic_checkpoint",
        z.elastic_checkpoint,
        "zerorun's checkpoints load at any world size and stage already",
    );
    note(
        "zero_optimization.load_from_fp32_weights",
        !z.load_from_fp32_weights,
        "zerorun's checkpoints hold the fp32 values, which always load into the fp32 master",
    );
    note(
        "zero_optimization.ignore_unused_parameters",
        !z.ignore_unused_parameters && z.stage < 2,
        "only stages 2-3 see which parameters got no gradient (stages 0-1 reduce gradient views, where an unused parameter reads as zeros)",
    );
    for (section, device, pin) in [
        ("offload_optimizer", z.offload_optimizer.device, z.offload_optimizer.pin_memory),
        ("offload_param", z.offload_param.device, z.offload_param.pin_memory),
    ] {
        note(
            &format!("zero_optimization.{section}.pin_memory"),
            pin && device != OffloadDevice::None,
            "a CPU run has no device memory to pin host buffers for",
        );
    }
    note(
        "zero_optimization.cpu_offload_use_pin_memory",
        true,
        "a CPU run has no device memory to pin host buffers for",
    );
    note(
        "zero_optimization.offload_optimizer.fast_init",
        z.offload_optimizer.fast_init,
        "zerorun's NVMe optimizer tier writes its swap files as it initialises them, with no slower path to skip",
    );
    note(
        "zero_optimization.offload_optimizer.ratio",
        z.offload_optimizer.ratio != 1.0,
        "partial optimizer offload (ZeRO-Offload++) is not implemented: every optimizer state goes where `device` says",
    );
    note(
        "zero_force_ds_cpu_optimizer",
        !config.zero_force_ds_cpu_optimizer,
        "zerorun always steps offloaded optimizer states with its own CPU optimizers",
    );
    note(
        "aio.single_submit",
        config.aio.single_submit,
        "zerorun's swapper submits through its own queue (aio.queue_depth, aio.intra_op_parallelism)",
    );
    note(
        "aio.overlap_events",
        !config.aio.overlap_events,
        "zerorun's swapper always overlaps submission and completion (aio.queue_depth in flight)",
    );
    note(
        "fp16.auto_cast",
        config.fp16.auto_cast,
        "zerorun does not cast a model's inputs: convert the VarStore with `vs.half()` and feed it fp16 inputs",
    );
    let c = &config.checkpoint;
    note(
        "checkpoint.load_universal",
        c.load_universal,
        "zerorun's checkpoints reshard on load at any world size and stage: there is no separate universal format",
    );
    note(
        "checkpoint.use_node_local_storage",
        c.use_node_local_storage,
        "every rank writes its own files into the checkpoint directory, which all ranks must see",
    );
    note(
        "checkpoint.parallel_write",
        true,
        "it configures DeepSpeed's pipeline checkpoint writes; every zerorun rank writes its own files by layer name",
    );
    note(
        "elasticity.min_time",
        config.elasticity.min_time != 0,
        "it tells a scheduler how long to let the job run before scaling it; `zerorun launch --nnodes MIN:MAX` restarts at once on the nodes left",
    );
    let p = &config.pipeline;
    note(
        "pipeline.seed_layers",
        p.seed_layers,
        "every stage builds its layers from the generator state the whole model's build gives them, so values never depend on the cut",
    );
    note(
        "pipeline.activation_checkpoint_interval",
        p.activation_checkpoint_interval != 0,
        "pipeline stages do not recompute layers in backward yet: each stage keeps its in-flight micro-batches' activations",
    );
    for (key, applies) in [("pipe_partitioned", !p.pipe_partitioned), ("grad_partitioned", !p.grad_partitioned)] {
        note(
            &format!("pipeline.{key}"),
            applies,
            "it partitions activations sent between stages over tensor-parallel ranks; zerorun sends them whole",
        );
    }
    note(
        "pipeline.use_reentrant",
        !p.use_reentrant,
        "it picks torch's activation-checkpointing implementation; no effect here",
    );
    let a = &config.activation_checkpointing;
    for (key, applies) in [
        ("partition_activations", a.partition_activations),
        ("contiguous_memory_optimization", a.contiguous_memory_optimization),
        ("number_checkpoints", a.number_checkpoints.is_some()),
        ("synchronize_checkpoint_boundary", a.synchronize_checkpoint_boundary),
        ("profile", a.profile),
    ] {
        note(&format!("activation_checkpointing.{key}"), applies, ACTIVATION_CHECKPOINTING);
    }
    if let Some(super::OptimizerConfig::Adam(p) | super::OptimizerConfig::AdamW(p)) = &config.optimizer {
        note(
            "optimizer.params.torch_adam",
            p.torch_adam,
            "zerorun's Adam is one kernel with torch.optim.Adam's arithmetic: there is no second implementation to choose",
        );
    }
    if let Some(common) = config.optimizer.as_ref().and_then(super::OptimizerConfig::one_bit) {
        note(
            "optimizer.params.cuda_aware",
            common.cuda_aware,
            "DeepSpeed's MPI backend of the 1-bit optimizers only: zerorun's 1-bit exchange runs on the engine's own backend",
        );
        note(
            "optimizer.params.comm_backend_name",
            true,
            "zerorun's 1-bit exchange runs on the engine's own backend (threads, shm, gloo, MPI or NCCL's host path), whatever this names",
        );
    }
    let m = &config.monitor;
    for key in ["wandb.group", "wandb.team", "wandb.project"] {
        note(key, true, "zerorun does not log to Weights & Biases (`wandb.enabled` must be false)");
    }
    for key in [
        "api_key",
        "experiment_key",
        "experiment_name",
        "mode",
        "online",
        "project",
        "samples_log_interval",
        "workspace",
    ] {
        note(&format!("comet.{key}"), true, "zerorun does not log to Comet (`comet.enabled` must be false)");
    }
    let f = &m.flops_profiler;
    note(
        "flops_profiler.module_depth",
        f.module_depth != -1,
        "zerorun profiles its units, one level: every unit is listed",
    );
    note(
        "flops_profiler.top_modules",
        f.top_modules != 1,
        "zerorun profiles its units, one level: every unit is listed",
    );
    note("comms_logger.debug", m.comms_logger.debug, "zerorun's records carry no caller's name");
    out
}
