//! The config reference: every key zerorun reads, what it does here and where DeepSpeed differs
//! (`zerorun config keys`, the guide's configuration chapter).
use serde_json::Value;

use crate::Config;
use KeyStatus::*;

/// Every key the reader accepts, with what its getter expects and its default as `config show` writes it, sorted by path.
pub(crate) fn accepted() -> Vec<AcceptedKey> {
    let mut keys = std::collections::BTreeMap::<String, AcceptedKey>::new();
    // A key's default is what `config show` writes when the probe did not give it.
    let mut read = |value: Value, what: &str| {
        let given = crate::notices::given_paths(&value);
        let (parsed, asked) = crate::reader::collect_keys(|| Config::from_value(value));
        let config = parsed.unwrap_or_else(|e| panic!("{what}: {e}"));
        let shown = config.to_value();
        for (path, kind) in asked {
            let default = path
                .split('.')
                .try_fold(&shown, |v, k| v.get(k))
                .filter(|v| !v.is_null() && (v.is_object() || !given.contains(&path)))
                .cloned();
            let entry =
                keys.entry(path.clone()).or_insert_with(|| AcceptedKey { path, kind: String::new(), default: None });
            if entry.kind.is_empty() {
                entry.kind = kind;
            }
            if entry.default.is_none() {
                entry.default = default;
            }
        }
    };
    // Stage 3 first: its size keys default to "auto" (sized from the model), as `config show` writes them.
    read(serde_json::json!({"zero_optimization": {"stage": 3}}), "bare stage 3");
    read(serde_json::json!({}), "the empty config");
    let optimizers = ["Adam", "AdamW", "Adagrad", "Lamb", "Lion", "SGD"];
    let schedulers = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"];
    for (i, optimizer) in optimizers.iter().enumerate() {
        for scheduler in if i == 0 { &schedulers[..] } else { &schedulers[..1] } {
            let every_section = serde_json::json!({
                "train_batch_size": 1,
                "optimizer": {"type": optimizer, "params": {}},
                "scheduler": {"type": scheduler, "params": match *scheduler {
                    "WarmupDecayLR" | "WarmupCosineLR" => serde_json::json!({"total_num_steps": 10_000}),
                    "OneCycle" => serde_json::json!({"cycle_min_lr": 0.0, "cycle_max_lr": 1.0}),
                    _ => serde_json::json!({}),
                }},
                "zero_optimization": {"offload_optimizer": {}, "offload_param": {}},
                "fp16": {}, "bf16": {}, "aio": {}, "checkpoint": {}, "activation_checkpointing": {}, "pipeline": {},
                "async_training": {"mode": "diloco", "sync_every": 1, "outer_optimizer": {}},
            });
            read(every_section, &format!("{optimizer} with {scheduler}"));
        }
    }
    // The 1-bit optimizers' keys (they run synchronously, at stage 0).
    for optimizer in ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"] {
        let one_bit = serde_json::json!({"train_batch_size": 1, "optimizer": {"type": optimizer, "params": {}}});
        read(one_bit, optimizer);
    }
    let powersgd = serde_json::json!({"train_batch_size": 1, "gradient_compression": {"type": "powersgd"}});
    read(powersgd, "PowerSGD");
    // The keys of async_training's other modes.
    let bounded = serde_json::json!({
        "train_batch_size": 1, "gradient_clipping": 0, "zero_optimization": {"stage": 1},
        "async_training": {"mode": "bounded_staleness"},
    });
    read(bounded, "bounded_staleness");
    keys.into_values().collect()
}

/// A key as the reader met it: its JSON path, what its getter expects, its default as `config show` writes it.
pub(crate) struct AcceptedKey {
    pub path: String,
    pub kind: String,
    pub default: Option<Value>,
}

/// What zerorun does with a key it accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyStatus {
    /// An object holding other keys.
    Section,
    /// Acted on: it changes what the run does.
    Acted,
    /// Accepted with no effect here: a config that gives it (or the value named) gets a warning naming it.
    Noticed,
    /// Refused: the value named is an error at load or `initialize`, naming the key.
    Refused,
}

impl KeyStatus {
    /// The word the reference prints.
    pub fn as_str(self) -> &'static str {
        match self {
            Section => "section",
            Acted => "acted on",
            Noticed => "noticed",
            Refused => "refused",
        }
    }
}

/// One key of the config reference.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KeyReference {
    /// The key's JSON path, e.g. `zero_optimization.stage`.
    pub path: String,
    /// What it holds, as errors name it ("a non-negative integer", "one of ...").
    #[serde(rename = "type")]
    pub kind: String,
    /// Its default as `zerorun config show` writes it; `None` when there is none (absent means unset).
    pub default: Option<Value>,
    /// Acted on, noticed or refused.
    pub status: KeyStatus,
    /// What it does here.
    pub what: &'static str,
    /// DeepSpeed's behaviour where it differs ("" where it is the same).
    pub deepspeed: &'static str,
}

struct KeyDoc {
    path: &'static str,
    status: KeyStatus,
    what: &'static str,
    deepspeed: &'static str,
}

/// Every key [`Config::accepted_keys`] lists, sorted by path, with its type, default and meaning here.
///
/// # Panics
/// When a key the reader accepts has no entry in the table below, or the table names a key the reader does not
/// accept: the reference can never fall behind the reader (`tests/config_keys.rs` runs it).
pub fn reference() -> Vec<KeyReference> {
    let accepted = accepted();
    let undocumented: Vec<&str> =
        accepted.iter().map(|k| k.path.as_str()).filter(|p| !DOCS.iter().any(|d| d.path == *p)).collect();
    let stale: Vec<&str> = DOCS.iter().map(|d| d.path).filter(|p| !accepted.iter().any(|k| k.path == *p)).collect();
    assert!(
        undocumented.is_empty() && stale.is_empty(),
        "config keys undocumented: {undocumented:?}; documented but not read: {stale:?}"
    );
    accepted
        .into_iter()
        .map(|k| {
            let doc = DOCS.iter().find(|d| d.path == k.path).expect("checked above");
            let kind = match (doc.status, k.kind.as_str()) {
                (Section, _) => "an object".to_string(),
                (_, "") => "see the description".to_string(),
                (_, kind) => kind.to_string(),
            };
            let default = if doc.status == Section { None } else { k.default };
            KeyReference { path: k.path, kind, default, status: doc.status, what: doc.what, deepspeed: doc.deepspeed }
        })
        .collect()
}

/// The reference as a Markdown page (the guide's `configuration/keys.md`).
pub fn markdown() -> String {
    let cell = |s: &str| s.replace('|', "\\|");
    let mut out = String::from(
        "# Every ds_config key\n\n\
         Generated by `zerorun config keys --markdown`; a test fails when this page and the command differ.\n\
         *Acted on*: the key changes what the run does. *Noticed*: accepted, and a config that gives it (or the value\n\
         named) gets a warning naming it and saying why it has no effect here. *Refused*: the value named is an error\n\
         naming the key. A default of \"auto\" is sized from the model at `initialize`; \"-\" means unset.\n\n\
         | key | type | default | status | what it does here | DeepSpeed, where it differs |\n|---|---|---|---|---|---|\n",
    );
    for k in reference() {
        let default = k.default.as_ref().map_or("-".to_string(), |v| format!("`{v}`"));
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} | {} |\n",
            k.path,
            cell(&k.kind),
            cell(&default),
            k.status.as_str(),
            cell(k.what),
            cell(k.deepspeed)
        ));
    }
    out
}

#[rustfmt::skip]
const DOCS: &[KeyDoc] = &[
    KeyDoc { path: "activation_checkpointing", status: Section, what: "DeepSpeed's activation checkpointing API settings (`deepspeed.checkpointing`).", deepspeed: "zerorun recomputes stage-3 units with `EngineOptions::activation_checkpointing` (the examples' `--activation-checkpointing`)." },
    KeyDoc { path: "activation_checkpointing.contiguous_memory_optimization", status: Noticed, what: "No effect: zerorun keeps no contiguous activation buffer.", deepspeed: "Copies checkpoints into one buffer." },
    KeyDoc { path: "activation_checkpointing.cpu_checkpointing", status: Acted, what: "On the device path, with `EngineOptions::activation_checkpointing` at stage 3: the unit inputs kept for the recomputation wait in pinned host memory (a non-blocking copy out as each unit's forward ends, back one unit ahead of its recomputation). No effect on a CPU run (said once as a warning): the inputs are in host memory already.", deepspeed: "Moves partitioned checkpoints to CPU; requires `partition_activations`, as here." },
    KeyDoc { path: "activation_checkpointing.number_checkpoints", status: Noticed, what: "No effect: zerorun checkpoints every unit the program asks for.", deepspeed: "Sizes the contiguous buffer." },
    KeyDoc { path: "activation_checkpointing.partition_activations", status: Noticed, what: "No effect: a checkpointed unit's input is kept whole on every tensor-parallel rank.", deepspeed: "Splits checkpoints over model-parallel ranks." },
    KeyDoc { path: "activation_checkpointing.profile", status: Noticed, what: "No effect: the memory report and `wall_clock_breakdown` time the recomputation.", deepspeed: "Times checkpoint functions." },
    KeyDoc { path: "activation_checkpointing.synchronize_checkpoint_boundary", status: Noticed, what: "No effect: a CPU run has no device to synchronise.", deepspeed: "Calls `cuda.synchronize` at each checkpoint." },
    KeyDoc { path: "aio", status: Section, what: "The NVMe swapper's I/O settings (offload to `nvme`).", deepspeed: "" },
    KeyDoc { path: "aio.block_size", status: Acted, what: "Bytes per read or write of the swap files (a multiple of 4096, for O_DIRECT).", deepspeed: "" },
    KeyDoc { path: "aio.intra_op_parallelism", status: Acted, what: "I/O threads per swapper (old name `thread_count`).", deepspeed: "" },
    KeyDoc { path: "aio.overlap_events", status: Noticed, what: "Only `false` is noticed: the swapper always overlaps submission and completion.", deepspeed: "" },
    KeyDoc { path: "aio.queue_depth", status: Acted, what: "Requests in flight per swapper.", deepspeed: "" },
    KeyDoc { path: "aio.single_submit", status: Noticed, what: "Only `true` is noticed: the swapper submits through its own queue.", deepspeed: "" },
    KeyDoc { path: "aio.use_gds", status: Refused, what: "`true` is refused: GPUDirect Storage needs a GPU and cuFile.", deepspeed: "" },
    KeyDoc { path: "amp", status: Noticed, what: "No effect: NVIDIA Apex AMP; use `fp16` or `bf16`.", deepspeed: "" },
    KeyDoc { path: "async_training", status: Section, what: "zerorun's own key: asynchronous data parallelism (bounded staleness, local SGD, DiLoCo).", deepspeed: "Not in DeepSpeed." },
    KeyDoc { path: "async_training.lr_staleness_scaling", status: Acted, what: "Divides a stale gradient's learning rate by its staleness + 1 (bounded staleness).", deepspeed: "" },
    KeyDoc { path: "async_training.mode", status: Acted, what: "`off`, `local_sgd`, `diloco` (stage 0) or `bounded_staleness` (stage 1).", deepspeed: "" },
    KeyDoc { path: "async_training.outer_optimizer", status: Section, what: "DiLoCo's outer optimizer over the averaged pseudo-gradient.", deepspeed: "" },
    KeyDoc { path: "async_training.outer_optimizer.lr", status: Acted, what: "The outer learning rate.", deepspeed: "" },
    KeyDoc { path: "async_training.outer_optimizer.momentum", status: Acted, what: "The outer momentum.", deepspeed: "" },
    KeyDoc { path: "async_training.outer_optimizer.type", status: Acted, what: "`nesterov` (DiLoCo's) or `sgd`.", deepspeed: "" },
    KeyDoc { path: "async_training.staleness", status: Acted, what: "Steps a rank may run ahead of the slowest (bounded staleness).", deepspeed: "" },
    KeyDoc { path: "async_training.sync_every", status: Acted, what: "Local steps between averages (local SGD, DiLoCo).", deepspeed: "" },
    KeyDoc { path: "autotuning", status: Noticed, what: "No effect: DeepSpeed's autotuner; see `zerorun plan`.", deepspeed: "" },
    KeyDoc { path: "bf16", status: Section, what: "bfloat16 training with an fp32 master copy (alias `bfloat16`).", deepspeed: "" },
    KeyDoc { path: "bf16.check_grad_overflow", status: Acted, what: "Skips a step whose gradients are not finite, as fp16's loss scaler does.", deepspeed: "" },
    KeyDoc { path: "bf16.enabled", status: Acted, what: "Trains in bf16: the model's parameters and gradients in bf16, the optimizer on an fp32 master.", deepspeed: "" },
    KeyDoc { path: "checkpoint", status: Section, what: "Checkpoint settings.", deepspeed: "" },
    KeyDoc { path: "checkpoint.async_save", status: Acted, what: "zerorun's own key: snapshots the state into host memory and writes it on a background thread, one save in flight.", deepspeed: "Not in DeepSpeed (its Nebula/FastPersist differ)." },
    KeyDoc { path: "checkpoint.load_universal", status: Noticed, what: "No effect: every zerorun checkpoint reshards on load at any world size and stage.", deepspeed: "Loads an offline-converted universal checkpoint." },
    KeyDoc { path: "checkpoint.parallel_write", status: Noticed, what: "No effect: every rank writes its own files by layer name.", deepspeed: "Configures pipeline checkpoint writes." },
    KeyDoc { path: "checkpoint.tag_validation", status: Acted, what: "Compares the ranks' tags before anything is written: `Fail` errors on every rank, `Warn` warns, `Ignore` does not look.", deepspeed: "" },
    KeyDoc { path: "checkpoint.use_node_local_storage", status: Noticed, what: "No effect: every rank writes into the checkpoint directory, which all ranks must see.", deepspeed: "" },
    KeyDoc { path: "comet", status: Section, what: "DeepSpeed's Comet monitor: `enabled: true` is refused, naming `tensorboard` and `csv_monitor`; its other keys are accepted and do nothing while it is off.", deepspeed: "" },
    KeyDoc { path: "comet.api_key", status: Noticed, what: "No effect while `comet.enabled` is false (the only value accepted).", deepspeed: "" },
    KeyDoc { path: "comet.enabled", status: Refused, what: "`true` is refused: zerorun does not log to Comet; use `tensorboard` or `csv_monitor`.", deepspeed: "" },
    KeyDoc { path: "comet.experiment_key", status: Noticed, what: "No effect (see `comet.enabled`).", deepspeed: "" },
    KeyDoc { path: "comet.experiment_name", status: Noticed, what: "No effect (see `comet.enabled`).", deepspeed: "" },
    KeyDoc { path: "comet.mode", status: Noticed, what: "No effect (see `comet.enabled`).", deepspeed: "" },
    KeyDoc { path: "comet.online", status: Noticed, what: "No effect (see `comet.enabled`).", deepspeed: "" },
    KeyDoc { path: "comet.project", status: Noticed, what: "No effect (see `comet.enabled`).", deepspeed: "" },
    KeyDoc { path: "comet.samples_log_interval", status: Noticed, what: "No effect (see `comet.enabled`).", deepspeed: "" },
    KeyDoc { path: "comet.workspace", status: Noticed, what: "No effect (see `comet.enabled`).", deepspeed: "" },
    KeyDoc { path: "comms_logger", status: Section, what: "Times and counts every collective of the engine by name and message size (the guide's \"Watching a run\").", deepspeed: "" },
    KeyDoc { path: "comms_logger.debug", status: Noticed, what: "No effect: records carry no caller's name.", deepspeed: "Appends the calling function's name." },
    KeyDoc { path: "comms_logger.enabled", status: Acted, what: "Turns the logger on: `engine.comms_summary()` (printed by the examples at the end, rank 0) has a row per collective and message size: count, total and mean ms, algorithm and bus bandwidth (nccl-tests' factors on the group's size), and the bytes per optimizer step.", deepspeed: "DeepSpeed turns it on when the section is present, whatever `enabled` says, and synchronizes the device after every collective; zerorun reads `enabled` and times the collective's own call." },
    KeyDoc { path: "comms_logger.prof_all", status: Acted, what: "Every collective (true) or only `prof_ops`.", deepspeed: "" },
    KeyDoc { path: "comms_logger.prof_ops", status: Acted, what: "The collectives logged when `prof_all` is false: `all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `broadcast`, `send`, `recv`, `barrier` (DeepSpeed's `_tensor`/`_single`/`_into_tensor` names too).", deepspeed: "" },
    KeyDoc { path: "comms_logger.verbose", status: Acted, what: "Logs every collective as it ends (rank 0, tracing's info level): name, ms, bytes, bandwidths.", deepspeed: "" },
    KeyDoc { path: "comms_timeout", status: Acted, what: "zerorun's own key: seconds any collective may wait before it fails naming the operation and the missing ranks.", deepspeed: "Not in DeepSpeed (torch.distributed's timeout)." },
    KeyDoc { path: "communication_data_type", status: Acted, what: "The dtype gradients are reduced in: `fp32`, `fp16` or `bf16` (default: the parameters').", deepspeed: "" },
    KeyDoc { path: "compile", status: Noticed, what: "No effect: torch.compile.", deepspeed: "" },
    KeyDoc { path: "compression_training", status: Noticed, what: "No effect: DeepSpeed's compression library.", deepspeed: "" },
    KeyDoc { path: "csv_monitor", status: Section, what: "DeepSpeed's CSV monitor: rank 0 appends each scalar to `<output_path>/<job_name>/<tag, '/' and ' ' as '_'>.csv` (header `step,<last part of the tag>`), step = samples seen, flushed every step.", deepspeed: "" },
    KeyDoc { path: "csv_monitor.enabled", status: Acted, what: "Writes the run's scalars as CSV files.", deepspeed: "" },
    KeyDoc { path: "csv_monitor.job_name", status: Acted, what: "The run's folder under `output_path` (default DeepSpeedJobName).", deepspeed: "" },
    KeyDoc { path: "csv_monitor.output_path", status: Acted, what: "The folder holding the job's folder (default: the working directory).", deepspeed: "" },
    KeyDoc { path: "curriculum_learning", status: Noticed, what: "No effect: DeepSpeed's curriculum learning.", deepspeed: "" },
    KeyDoc { path: "data_efficiency", status: Noticed, what: "No effect: DeepSpeed's data efficiency library.", deepspeed: "" },
    KeyDoc { path: "dump_state", status: Noticed, what: "No effect: DeepSpeed's state dump.", deepspeed: "" },
    KeyDoc { path: "eigenvalue", status: Noticed, what: "No effect: DeepSpeed's eigenvalue computation.", deepspeed: "" },
    KeyDoc { path: "elasticity", status: Section, what: "Elastic batch arithmetic: one global batch for many world sizes (DeepSpeed 0.18's computation).", deepspeed: "DeepSpeed 0.19 refuses the section (elastic training removed)." },
    KeyDoc { path: "elasticity.enabled", status: Acted, what: "The batch sizes come from this section at every world size; batch keys beside it are refused unless `ignore_non_elastic_batch_info`.", deepspeed: "" },
    KeyDoc { path: "elasticity.ignore_non_elastic_batch_info", status: Acted, what: "Batch keys given beside the section are overridden instead of refused.", deepspeed: "" },
    KeyDoc { path: "elasticity.max_gpus", status: Acted, what: "Most data-parallel ranks the batch must suit.", deepspeed: "" },
    KeyDoc { path: "elasticity.max_train_batch_size", status: Acted, what: "The largest global batch acceptable (required when enabled).", deepspeed: "" },
    KeyDoc { path: "elasticity.micro_batch_sizes", status: Acted, what: "Micro-batch sizes a rank may run (required when enabled); each world size takes the largest that divides its share.", deepspeed: "" },
    KeyDoc { path: "elasticity.min_gpus", status: Acted, what: "Fewest data-parallel ranks the batch must suit.", deepspeed: "" },
    KeyDoc { path: "elasticity.min_time", status: Noticed, what: "No effect: a scheduler's setting; `zerorun launch --nnodes MIN:MAX` restarts at once on the nodes left.", deepspeed: "" },
    KeyDoc { path: "elasticity.model_parallel_size", status: Refused, what: "Values other than 1 are refused: the batch divides zerorun's data-parallel ranks, whatever the model parallelism.", deepspeed: "v0.2 divides GPUs per node by it." },
    KeyDoc { path: "elasticity.num_gpus_per_node", status: Acted, what: "Version 0.2: world sizes move by whole nodes of this many ranks.", deepspeed: "" },
    KeyDoc { path: "elasticity.prefer_larger_batch", status: Acted, what: "Among batches that suit as many world sizes, the larger (else the smaller).", deepspeed: "" },
    KeyDoc { path: "elasticity.version", status: Acted, what: "0.1: one batch, other world sizes refused; 0.2: by nodes, and a world size outside the list gets a batch of its own.", deepspeed: "" },
    KeyDoc { path: "expert_parallel", status: Section, what: "Expert parallelism (DeepSpeed 0.19's AutoEP block): groups of `autoep_size` adjacent data-parallel ranks split each mixture-of-experts layer's experts (`zerorun::runtime::moe`). The model composes `MoeLayer` itself and calls `forward_parallel` on the group (`ExpertParallel::adjacent`); the Llama example does with Mixtral and Qwen3-MoE.", deepspeed: "DeepSpeed finds Hugging Face MoE blocks by preset or patterns and swaps its layers in; its pattern keys are refused here (the model names its layers)." },
    KeyDoc { path: "expert_parallel.autoep_size", status: Acted, what: "Ranks per expert-parallel group (E): a divisor of the data-parallel ranks and of every layer's experts. Each rank computes `experts / E` experts for the group's tokens (E times the rows per expert and call). At stages 1-3 a unit holding one position's experts (`MoeLayer::expert_units`) is split over the ranks at that position (world / E of them: the expert-data-parallel group), which alone reduce, step and hold it (stage 3 gathers it among them; at stages 1-2 only they keep its values, at stage 1 its gradients too); otherwise (stage 0, stage 1 with compressed gradients, asynchronous training, shard groups or frozen parameters, or experts inside a unit with other parameters) every rank holds every expert, which ZeRO shards over all data-parallel ranks. Not with sequence parallelism, tensor parallelism or pipeline stages yet.", deepspeed: "DeepSpeed shards expert states over the expert-data-parallel group (world / E) at every stage; zerorun at stages 1-3 (with units)." },
    KeyDoc { path: "expert_parallel.disable_triton_grouped_mm", status: Noticed, what: "No effect: the experts' matmuls are libtorch's.", deepspeed: "" },
    KeyDoc { path: "expert_parallel.enabled", status: Acted, what: "Turns the section on (`autoep_size` counts only when true).", deepspeed: "" },
    KeyDoc { path: "expert_parallel.expert_tensor_parallel_size", status: Refused, what: "Values other than 1 are refused, as DeepSpeed does.", deepspeed: "" },
    KeyDoc { path: "expert_parallel.preset_model", status: Acted, what: "`mixtral` or `qwen3_moe`: checked against the model's `model_type` by the Llama example; other presets are refused.", deepspeed: "" },
    KeyDoc { path: "expert_parallel.use_grouped_mm", status: Noticed, what: "No effect: the experts' matmuls are libtorch's.", deepspeed: "" },
    KeyDoc { path: "fault_tolerance", status: Section, what: "zerorun's own section: the replica groups of shard groups (`zero_optimization.mics_shard_size`) survive the loss of one another. Each step the live groups form a quorum over the job's TCPStore (at least `min_replicas`, and a majority of the groups still heartbeating), reduce gradients among themselves only and commit or discard the step together; a group that lost a rank leaves, and the others redo the step with the global batch split over them (`engine.batch_sizes()` and `engine.rank()` / `engine.world_size()` follow the live groups); a group its launcher restarts (`zerorun launch --fault-tolerant --max-restarts N`) heals from a live group's state and rejoins. Needs the gloo backend; the store is rank 0's, so group 0 must live.", deepspeed: "torchft's replica groups and lighthouse; DeepSpeed has no such section." },
    KeyDoc { path: "fault_tolerance.enabled", status: Acted, what: "Make the replica dimension fault-tolerant (needs `mics_shard_size`; not with `optimizer_in_backward`, asynchronous training, `elasticity` or gradient compression).", deepspeed: "" },
    KeyDoc { path: "fault_tolerance.heartbeat_ms", status: Acted, what: "Milliseconds between a rank's heartbeats (default 100); a rank silent for 5 of them takes its group out of the next quorum.", deepspeed: "" },
    KeyDoc { path: "fault_tolerance.min_replicas", status: Acted, what: "Fewest replica groups a step may be taken with (default 1); below it the run stops, naming the groups it waited for.", deepspeed: "" },
    KeyDoc { path: "fault_tolerance.quorum_timeout", status: Acted, what: "Seconds a quorum or a step's vote waits for the groups that still heartbeat (default 60).", deepspeed: "" },
    KeyDoc { path: "flops_profiler", status: Section, what: "One step's profile: per unit parameters, forward FLOPs (counted from the unit's own matmuls and linears by the shapes libtorch ran), forward/backward/step time and the model's total (rank 0).", deepspeed: "" },
    KeyDoc { path: "flops_profiler.detailed", status: Acted, what: "A row per unit (true) or the summary only.", deepspeed: "" },
    KeyDoc { path: "flops_profiler.enabled", status: Acted, what: "Profiles `profile_step`; turns `wall_clock_breakdown` on (as DeepSpeed does).", deepspeed: "" },
    KeyDoc { path: "flops_profiler.module_depth", status: Noticed, what: "No effect: zerorun profiles its units (one level).", deepspeed: "Depth of the module tree aggregated." },
    KeyDoc { path: "flops_profiler.output_file", status: Acted, what: "Writes the profile to this file as well (rank 0); absent: the log and `engine.flops_profile()` only.", deepspeed: "" },
    KeyDoc { path: "flops_profiler.profile_step", status: Acted, what: "The optimizer step profiled (1 = the first).", deepspeed: "" },
    KeyDoc { path: "flops_profiler.recompute_fwd_factor", status: Acted, what: "Share of the forward recomputed in backward: backward FLOPs are (2 + this) x forward.", deepspeed: "" },
    KeyDoc { path: "flops_profiler.top_modules", status: Noticed, what: "No effect: every unit is listed.", deepspeed: "Top-k modules per depth." },
    KeyDoc { path: "fp16", status: Section, what: "fp16 training with an fp32 master copy and loss scaling.", deepspeed: "" },
    KeyDoc { path: "fp16.auto_cast", status: Noticed, what: "Only `true` is noticed: zerorun does not cast inputs; convert the VarStore and feed fp16 inputs.", deepspeed: "Casts the model's inputs." },
    KeyDoc { path: "fp16.consecutive_hysteresis", status: Acted, what: "Refills the hysteresis after every step without overflow.", deepspeed: "" },
    KeyDoc { path: "fp16.enabled", status: Acted, what: "Trains in fp16 with dynamic (or static) loss scaling.", deepspeed: "" },
    KeyDoc { path: "fp16.hysteresis", status: Acted, what: "Overflows tolerated before the loss scale is lowered.", deepspeed: "" },
    KeyDoc { path: "fp16.initial_scale_power", status: Acted, what: "The first dynamic loss scale is 2 to this power.", deepspeed: "" },
    KeyDoc { path: "fp16.loss_scale", status: Acted, what: "0 for dynamic loss scaling, otherwise this static scale.", deepspeed: "" },
    KeyDoc { path: "fp16.loss_scale_window", status: Acted, what: "Steps without overflow before the scale doubles.", deepspeed: "" },
    KeyDoc { path: "fp16.min_loss_scale", status: Acted, what: "The dynamic scale never goes below this.", deepspeed: "" },
    KeyDoc { path: "fp32_allreduce", status: Noticed, what: "No effect: gradients are reduced in `communication_data_type`.", deepspeed: "" },
    KeyDoc { path: "gradient_accumulation_steps", status: Acted, what: "Micro-batches per optimizer step (the batch rule infers it when absent or \"auto\").", deepspeed: "" },
    KeyDoc { path: "gradient_allreduce_op", status: Acted, what: "`mean` averages the ranks' gradients; `sum` sums them (stages 0-2).", deepspeed: "`sum` is refused at stage 3 in both." },
    KeyDoc { path: "gradient_clipping", status: Acted, what: "Clips the global gradient norm to this value (0 disables).", deepspeed: "" },
    KeyDoc { path: "gradient_compression", status: Section, what: "zerorun's own: gradients averaged compressed at stages 0 and 1 (PowerSGD, PyTorch's `PowerSGDState` names and defaults). The 1-bit optimizers are `optimizer.type`s.", deepspeed: "Not a DeepSpeed key." },
    KeyDoc { path: "gradient_compression.matrix_approximation_rank", status: Acted, what: "PowerSGD's rank r: each matrix gradient averaged as P Q^T, P n x r, Q m x r (default 1).", deepspeed: "" },
    KeyDoc { path: "gradient_compression.min_compression_rate", status: Acted, what: "A matrix n x m is compressed when (n + m) r x this < n m; others, and every vector, are averaged whole (default 2).", deepspeed: "" },
    KeyDoc { path: "gradient_compression.orthogonalization_epsilon", status: Acted, what: "Added to the column norms in Gram-Schmidt (default 0).", deepspeed: "" },
    KeyDoc { path: "gradient_compression.random_seed", status: Acted, what: "Seed of Q's first values, the same on every rank (default 0).", deepspeed: "" },
    KeyDoc { path: "gradient_compression.start_powerSGD_iter", status: Acted, what: "Optimizer steps averaged exactly before PowerSGD starts (default 1000; PyTorch suggests 10% of the run, after the warm-up).", deepspeed: "" },
    KeyDoc { path: "gradient_compression.type", status: Acted, what: "`none` (default) or `powersgd` (stages 0 and 1, fp32 at stage 1; not with a 1-bit optimizer, asynchronous training, a sum reduction or predivision).", deepspeed: "" },
    KeyDoc { path: "gradient_compression.use_error_feedback", status: Acted, what: "What the approximation missed is added to the next step's gradient (default true; per rank, saved in checkpoints).", deepspeed: "" },
    KeyDoc { path: "gradient_compression.warm_start", status: Acted, what: "Q starts each step from the last step's (default true).", deepspeed: "" },
    KeyDoc { path: "gradient_predivide_factor", status: Acted, what: "Divides gradients by this before the reduction and by world size / factor after.", deepspeed: "" },
    KeyDoc { path: "hybrid_engine", status: Noticed, what: "No effect: DeepSpeed's RLHF hybrid engine.", deepspeed: "" },
    KeyDoc { path: "memory_breakdown", status: Acted, what: "Logs the memory accounting at every step.", deepspeed: "" },
    KeyDoc { path: "nebula", status: Noticed, what: "No effect: DeepSpeed's Nebula checkpoint service.", deepspeed: "" },
    KeyDoc { path: "optimizer", status: Section, what: "The optimizer: `type` and `params`.", deepspeed: "" },
    KeyDoc { path: "optimizer.params", status: Section, what: "The optimizer's parameters; which are read depends on `type`.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.adam_w_mode", status: Acted, what: "Adam: decoupled weight decay (AdamW) when true, L2 in the gradient when false.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.amsgrad", status: Acted, what: "Adam/AdamW: keeps the maximum of the second moment (the 1-bit optimizers refuse true, as DeepSpeed does).", deepspeed: "" },
    KeyDoc { path: "optimizer.params.betas", status: Acted, what: "Adam/AdamW/Lamb/Lion and the 1-bit optimizers: the moment coefficients.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.bias_correction", status: Acted, what: "Adam/AdamW/Lamb and the 1-bit optimizers: bias-corrected moments (the 1-bit ones' variance correction stops with the variance).", deepspeed: "The 1-bit optimizers read it and never apply it: false gives their update." },
    KeyDoc { path: "optimizer.params.coeff_beta", status: Acted, what: "OneBitLamb: the trust ratio's moving average in the warm-up, frozen after it.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.comm_backend_name", status: Noticed, what: "1-bit optimizers: zerorun's exchange runs on the engine's backend, whatever this names (`nccl`, `mpi`, `hccl`, `compressed` accepted).", deepspeed: "Chooses the 1-bit optimizers' collective backend (GPU only)." },
    KeyDoc { path: "optimizer.params.cuda_aware", status: Noticed, what: "1-bit optimizers: only `true` is noticed (DeepSpeed's MPI backend).", deepspeed: "CUDA-aware MPI for the 1-bit optimizers' MPI backend." },
    KeyDoc { path: "optimizer.params.dampening", status: Acted, what: "SGD: momentum dampening.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.eps", status: Acted, what: "The denominator's epsilon (default per optimizer).", deepspeed: "" },
    KeyDoc { path: "optimizer.params.eps_inside_sqrt", status: Acted, what: "Lamb: epsilon inside the square root.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.factor_max", status: Acted, what: "OneBitLamb: upper bound of the compression stage's trust-ratio factor.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.factor_min", status: Acted, what: "OneBitLamb: lower bound of that factor.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.factor_threshold", status: Acted, what: "OneBitLamb: the factor's largest relative change per step.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.freeze_step", status: Acted, what: "OneBitAdam/OneBitLamb: steps of plain Adam on averaged gradients before the momentum travels as signs (>= 1). The variance is frozen after them: too few (a handful) and elements with a tiny variance take huge steps; DeepSpeed's guidance is 15-25% of the run's steps.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.initial_accumulator_value", status: Acted, what: "Adagrad: the accumulator's first value.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.local_step_clipper", status: Acted, what: "ZeroOneAdam: the largest local-step interval.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.local_step_scaler", status: Acted, what: "ZeroOneAdam: the local-step interval doubles every this many steps after `var_freeze_step`.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.lr", status: Acted, what: "The learning rate (a schedule's bounds take it as default).", deepspeed: "" },
    KeyDoc { path: "optimizer.params.lr_decay", status: Acted, what: "Adagrad: learning-rate decay.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.max_coeff", status: Acted, what: "Lamb/OneBitLamb: upper bound of the trust ratio.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.max_grad_norm", status: Refused, what: "Lamb: refused when non-zero; Adam and the 1-bit optimizers: refused when given; use `gradient_clipping`.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.min_coeff", status: Acted, what: "Lamb/OneBitLamb: lower bound of the trust ratio.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.momentum", status: Acted, what: "SGD: momentum.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.nesterov", status: Acted, what: "SGD: Nesterov momentum.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.torch_adam", status: Noticed, what: "Only `true` is noticed: zerorun steps with its own vectorised kernels, equal to torch's.", deepspeed: "Selects torch's Adam over the fused kernel." },
    KeyDoc { path: "optimizer.params.var_freeze_step", status: Acted, what: "ZeroOneAdam: the last step that may update the variance; local steps follow.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.var_update_scaler", status: Acted, what: "ZeroOneAdam: the variance-update interval doubles every this many updates.", deepspeed: "" },
    KeyDoc { path: "optimizer.params.weight_decay", status: Acted, what: "Weight decay (decoupled for AdamW; `EngineOptions::no_weight_decay` exempts parameters).", deepspeed: "" },
    KeyDoc { path: "optimizer.type", status: Acted, what: "`Adam`, `AdamW`, `Adagrad`, `Lamb`, `Lion`, `SGD`, or the 1-bit `OneBitAdam`, `ZeroOneAdam`, `OneBitLamb` (stage 0; Lamb too) (case-insensitive); at stages >= 1 the untested ones need `zero_allow_untested_optimizer`.", deepspeed: "" },
    KeyDoc { path: "optimizer_in_backward", status: Acted, what: "zerorun's own key: steps each part as soon as its gradients are reduced, during backward: at stage 3 each unit's part of the shard (no gradient shard is held), at stage 0 each bucket as its all-reduce lands (the step hides behind the all-reduces still in flight).", deepspeed: "Not in DeepSpeed (torchtune's `optimizer_in_bwd`)." },
    KeyDoc { path: "pipeline", status: Section, what: "Pipeline parallelism (`zerorun::initialize_pipeline`).", deepspeed: "" },
    KeyDoc { path: "pipeline.activation_checkpoint_interval", status: Noticed, what: "No effect: pipeline layers checkpoint through `PipelineLayer`'s own flag.", deepspeed: "Checkpoints every N layers." },
    KeyDoc { path: "pipeline.allow_fewer_micro_batches", status: Acted, what: "Lets a step run with fewer micro-batches than stages (a larger bubble) instead of an error.", deepspeed: "" },
    KeyDoc { path: "pipeline.grad_partitioned", status: Noticed, what: "Only `false` is noticed: stage boundaries send whole gradients.", deepspeed: "Partitions boundary gradients over tensor ranks." },
    KeyDoc { path: "pipeline.partition", status: Acted, what: "How layers are cut into stages: `parameters`, `uniform`, or explicit boundaries.", deepspeed: "" },
    KeyDoc { path: "pipeline.pipe_partitioned", status: Noticed, what: "Only `false` is noticed: stage boundaries send whole activations.", deepspeed: "Partitions boundary activations over tensor ranks." },
    KeyDoc { path: "pipeline.schedule", status: Acted, what: "`1f1b`, `gpipe` or `interleaved` (with `virtual_stages`).", deepspeed: "DeepSpeed runs 1F1B only." },
    KeyDoc { path: "pipeline.seed_layers", status: Noticed, what: "Only `true` is noticed: layers take the generator state of the whole model's build.", deepspeed: "Seeds every layer by its index." },
    KeyDoc { path: "pipeline.stages", status: Acted, what: "The number of pipeline stages.", deepspeed: "" },
    KeyDoc { path: "pipeline.use_reentrant", status: Noticed, what: "Only `false` is noticed: recomputation does not go through Python's checkpoint.", deepspeed: "" },
    KeyDoc { path: "pipeline.virtual_stages", status: Acted, what: "Model chunks per rank for the interleaved schedule.", deepspeed: "" },
    KeyDoc { path: "prescale_gradients", status: Acted, what: "Divides gradients by `gradient_predivide_factor` before the reduction.", deepspeed: "" },
    KeyDoc { path: "progressive_layer_drop", status: Noticed, what: "No effect: DeepSpeed's progressive layer dropping.", deepspeed: "" },
    KeyDoc { path: "quantize_training", status: Noticed, what: "No effect: DeepSpeed's quantization-aware training.", deepspeed: "" },
    KeyDoc { path: "scheduler", status: Section, what: "The learning-rate schedule: `type` and `params`, stepped after every optimizer step.", deepspeed: "" },
    KeyDoc { path: "scheduler.params", status: Section, what: "The schedule's parameters; which are read depends on `type`.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.cos_min_ratio", status: Acted, what: "WarmupCosineLR: the floor as a ratio of the peak.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.cycle_first_stair_count", status: Acted, what: "OneCycle: stairs in the first phase.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.cycle_first_step_size", status: Acted, what: "OneCycle: steps of the first phase.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.cycle_max_lr", status: Acted, what: "OneCycle: the peak learning rate.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.cycle_max_mom", status: Acted, what: "OneCycle: the highest momentum (Adam's beta1, SGD's momentum).", deepspeed: "" },
    KeyDoc { path: "scheduler.params.cycle_min_lr", status: Acted, what: "OneCycle: the lowest learning rate.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.cycle_min_mom", status: Acted, what: "OneCycle: the lowest momentum.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.cycle_momentum", status: Acted, what: "OneCycle: cycles the momentum against the learning rate.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.cycle_second_stair_count", status: Acted, what: "OneCycle: stairs in the second phase.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.cycle_second_step_size", status: Acted, what: "OneCycle: steps of the second phase (default: the first's).", deepspeed: "" },
    KeyDoc { path: "scheduler.params.decay_lr_rate", status: Acted, what: "OneCycle: learning-rate decay after the cycle.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.decay_mom_rate", status: Acted, what: "OneCycle: momentum decay after the cycle.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.decay_step_size", status: Acted, what: "OneCycle: steps per decay interval.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.last_batch_iteration", status: Acted, what: "The step the schedule resumes after (-1: from the start).", deepspeed: "" },
    KeyDoc { path: "scheduler.params.lr_range_test_min_lr", status: Acted, what: "LRRangeTest: the starting learning rate.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.lr_range_test_staircase", status: Acted, what: "LRRangeTest: grows in stairs instead of continuously.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.lr_range_test_step_rate", status: Acted, what: "LRRangeTest: growth per interval.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.lr_range_test_step_size", status: Acted, what: "LRRangeTest: steps per interval.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.total_num_steps", status: Acted, what: "WarmupDecayLR / WarmupCosineLR: the schedule's length.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.warmup_max_lr", status: Acted, what: "Warmup*: the learning rate after warmup (default: the optimizer's `lr`).", deepspeed: "" },
    KeyDoc { path: "scheduler.params.warmup_min_lr", status: Acted, what: "Warmup*: the learning rate warmup starts from.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.warmup_min_ratio", status: Acted, what: "WarmupCosineLR: warmup's start as a ratio of the peak.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.warmup_num_steps", status: Acted, what: "Warmup*: steps of warmup.", deepspeed: "" },
    KeyDoc { path: "scheduler.params.warmup_type", status: Acted, what: "Warmup*: `log` or `linear` growth.", deepspeed: "" },
    KeyDoc { path: "scheduler.type", status: Acted, what: "`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle` or `LRRangeTest`.", deepspeed: "" },
    KeyDoc { path: "sequence_parallel_size", status: Acted, what: "Ranks that split each row's sequence (DeepSpeed-Ulysses, `zerorun::runtime::sequence`): a batch's rows are counted over the world divided by it, and ZeRO shards over every rank. The model's attention trades slices for heads over the group (`ulysses_attention`) and its loss is `sequence_loss`; not with pipeline stages, tensor parallelism or shard groups yet.", deepspeed: "" },
    KeyDoc { path: "sparse_attention", status: Noticed, what: "No effect: DeepSpeed's sparse attention kernels.", deepspeed: "" },
    KeyDoc { path: "sparse_gradients", status: Noticed, what: "No effect: DeepSpeed's sparse embedding gradients.", deepspeed: "" },
    KeyDoc { path: "steps_per_print", status: Acted, what: "Rank 0 logs the step, loss, learning rate and (with `wall_clock_breakdown`) timings every N steps.", deepspeed: "" },
    KeyDoc { path: "tensorboard", status: Section, what: "DeepSpeed's TensorBoard monitor: rank 0 writes an event file under `<output_path>/<job_name>/` (TFRecord framing, masked CRC32C, Event/Summary protobuf), step = samples seen, flushed after every step: Train/Samples/train_loss, lr, loss_scale (fp16), elapsed_time_ms_* (wall_clock_breakdown), and zerorun's own tags beside them.", deepspeed: "" },
    KeyDoc { path: "tensorboard.enabled", status: Acted, what: "Writes the run's scalars as a TensorBoard event file.", deepspeed: "" },
    KeyDoc { path: "tensorboard.job_name", status: Acted, what: "The run's folder under `output_path` (default DeepSpeedJobName).", deepspeed: "" },
    KeyDoc { path: "tensorboard.output_path", status: Acted, what: "The folder holding the job's folder (default: the working directory).", deepspeed: "" },
    KeyDoc { path: "timers", status: Noticed, what: "No effect: DeepSpeed's timer settings; see `wall_clock_breakdown`.", deepspeed: "" },
    KeyDoc { path: "train_batch_size", status: Acted, what: "Samples per optimizer step over all ranks (the batch rule infers it when absent or \"auto\").", deepspeed: "" },
    KeyDoc { path: "train_micro_batch_size_per_gpu", status: Acted, what: "Samples per micro-batch per rank (the batch rule infers it when absent or \"auto\").", deepspeed: "" },
    KeyDoc { path: "wall_clock_breakdown", status: Acted, what: "Times forward, backward, reduction, gather and step per step (the report's wall-clock table); a forward under no_grad (an evaluation) is left out.", deepspeed: "" },
    KeyDoc { path: "wandb", status: Section, what: "DeepSpeed's Weights & Biases monitor: `enabled: true` is refused, naming `tensorboard` and `csv_monitor`.", deepspeed: "" },
    KeyDoc { path: "wandb.enabled", status: Refused, what: "`true` is refused: zerorun does not log to Weights & Biases; use `tensorboard` (W&B imports TensorBoard logs) or `csv_monitor`.", deepspeed: "" },
    KeyDoc { path: "wandb.group", status: Noticed, what: "No effect (see `wandb.enabled`).", deepspeed: "" },
    KeyDoc { path: "wandb.project", status: Noticed, what: "No effect (see `wandb.enabled`).", deepspeed: "" },
    KeyDoc { path: "wandb.team", status: Noticed, what: "No effect (see `wandb.enabled`).", deepspeed: "" },
    KeyDoc { path: "zero_allow_untested_optimizer", status: Acted, what: "Allows Lamb, SGD and other optimizers at stages >= 1.", deepspeed: "" },
    KeyDoc { path: "zero_force_ds_cpu_optimizer", status: Noticed, what: "Only `false` is noticed: offloaded states are always stepped by zerorun's CPU optimizers.", deepspeed: "" },
    KeyDoc { path: "zero_ignore_unused_parameters", status: Noticed, what: "No effect: the old top-level name; use `zero_optimization.ignore_unused_parameters`.", deepspeed: "" },
    KeyDoc { path: "zero_optimization", status: Section, what: "ZeRO's settings (`true`, the old boolean form, means stage 1).", deepspeed: "" },
    KeyDoc { path: "zero_optimization.allgather_bucket_size", status: Noticed, what: "Only a non-default value is noticed: parameters are gathered in place or unit by unit, with no staging buffer.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.allgather_partitions", status: Noticed, what: "Only `false` is noticed: updated partitions are always all-gathered.", deepspeed: "`false` broadcasts instead (same values)." },
    KeyDoc { path: "zero_optimization.contiguous_gradients", status: Noticed, what: "Only `false` is noticed: gradients are always copied into contiguous buckets.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.cpu_offload", status: Acted, what: "Old name: `true` is `offload_optimizer.device: cpu`.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.cpu_offload_param", status: Acted, what: "Old name: `true` is `offload_param.device: cpu`.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.cpu_offload_use_pin_memory", status: Noticed, what: "No effect: a CPU run has no device memory to pin for.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.elastic_checkpoint", status: Noticed, what: "Only `true` is noticed: checkpoints load at any world size and stage already.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.ignore_unused_parameters", status: Acted, what: "`false` makes a parameter without a gradient an error naming it (stages 2-3; noticed at 0-1).", deepspeed: "" },
    KeyDoc { path: "zero_optimization.legacy_stage1", status: Noticed, what: "No effect: DeepSpeed's old stage-1 implementation.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.load_from_fp32_weights", status: Noticed, what: "Only `false` is noticed: checkpoints always load the fp32 values into the master.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.log_trace_cache_warnings", status: Noticed, what: "No effect: DeepSpeed's stage-3 trace cache.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.memory_efficient_linear", status: Noticed, what: "No effect: DeepSpeed's linear-layer kernel.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.mics_shard_size", status: Acted, what: "Stages 1-3 (MiCS, FSDP2's HSDP): the data-parallel ranks form groups of this many consecutive ranks (a host's, typically); ZeRO partitions over a group and the groups replicate each other: a bucket's gradients reduce-scatter inside the group, then its part is all-reduced across the replicas. The gradient norm is the group's; the loss, the sampler and the batch sizes span every data-parallel rank; the first group writes checkpoints, which load at any world size, stage and shard size. Must divide the data-parallel ranks. A group that is exactly one host's ranks talks over shared memory, the replicas over gloo. -1 or 0: off. Refused at stage 0, with `zero_hpz_partition_size`, pipeline stages, tensor parallelism and asynchronous training.", deepspeed: "DeepSpeed's is stage 3 on CUDA." },
    KeyDoc { path: "zero_optimization.mics_hierarchical_params_gather", status: Noticed, what: "No effect: a shard group's gathers run on the group's own communicator (shared memory when the group is one host's ranks, gloo otherwise).", deepspeed: "Gathers in two steps when a shard group spans nodes." },
    KeyDoc { path: "zero_optimization.offload_optimizer", status: Section, what: "Where optimizer states live: `cpu` or `nvme`.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_optimizer.buffer_count", status: Acted, what: "NVMe: swap buffers per swapper.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_optimizer.device", status: Acted, what: "`none`, `cpu` (in place on a CPU run) or `nvme` (O_DIRECT swap files, sub-group by sub-group).", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_optimizer.fast_init", status: Noticed, what: "Only `true` is noticed: swap files are written as they are initialised.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_optimizer.nvme_path", status: Acted, what: "NVMe: the folder for the swap files (required for `nvme`).", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_optimizer.pin_memory", status: Noticed, what: "Only `true` on an offloading CPU run is noticed: no device memory to pin for.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_optimizer.pipeline", status: Acted, what: "Old name: turns on both `pipeline_read` and `pipeline_write`.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_optimizer.pipeline_read", status: Acted, what: "NVMe: reads the next sub-group while stepping this one.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_optimizer.pipeline_write", status: Acted, what: "NVMe: writes a stepped sub-group while stepping the next.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_optimizer.ratio", status: Noticed, what: "Only a value below 1 is noticed: partial optimizer offload is not implemented.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_param", status: Section, what: "Where stage 3's parameter shards live: `cpu` or `nvme`.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_param.buffer_count", status: Acted, what: "NVMe: read-ahead buffers.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_param.buffer_size", status: Acted, what: "NVMe: elements per read-ahead buffer.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_param.device", status: Acted, what: "`none`, `cpu` or `nvme` (stage 3; shards read ahead of the all-gather).", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_param.max_in_cpu", status: Acted, what: "NVMe: elements of parameters kept in memory.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_param.nvme_path", status: Acted, what: "NVMe: the folder for the parameter files.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.offload_param.pin_memory", status: Noticed, what: "Only `true` on an offloading CPU run is noticed: no device memory to pin for.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.overlap_comm", status: Acted, what: "Reduces gradients on a communication thread while backward runs (stage 0: each bucket of gradients all-reduced in place once autograd has written it, as DDP does; stage 3: gathers the next units there too). Absent: true at stages 0, 2 and 3, false at stage 1 (the default column shows stage 3's): it costs no memory at stage 0 or with units at stage 2, and one more staging half in a plain stage-2 loop.", deepspeed: "DeepSpeed's default is true at stage 3 only; its stage 0 all-reduces after backward whatever this says." },
    KeyDoc { path: "zero_optimization.override_module_apply", status: Noticed, what: "No effect: DeepSpeed's `module.apply` hook.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.pipeline_loading_checkpoint", status: Noticed, what: "No effect: DeepSpeed's pipeline checkpoint loading.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.reduce_bucket_size", status: Acted, what: "Elements per gradient reduction round; absent or \"auto\", sized from the model at stage 3 (a quarter of the largest unit) and at stages 0 and 2 in a plain loop (an eighth of the model: the gradient hooks' buckets), both at least 1M.", deepspeed: "DeepSpeed keeps 5e8 when absent." },
    KeyDoc { path: "zero_optimization.reduce_scatter", status: Acted, what: "`false` all-reduces gradients and keeps this rank's part (stages 1-2).", deepspeed: "" },
    KeyDoc { path: "zero_optimization.round_robin_gradients", status: Noticed, what: "Only `true` is noticed: gradients are reduced straight into each rank's shard.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.stage", status: Acted, what: "0 (data parallel), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters, unit by unit).", deepspeed: "" },
    KeyDoc { path: "zero_optimization.stage3_gather_16bit_weights_on_model_save", status: Acted, what: "Stage 3: `save_16bit_model` gathers the whole model into one file.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.stage3_max_live_parameters", status: Acted, what: "Stage 3: gathered elements allowed at once (absent or \"auto\": twice the largest unit, the one in use and the next one prefetched).", deepspeed: "DeepSpeed keeps 1e9 when absent." },
    KeyDoc { path: "zero_optimization.stage3_max_reuse_distance", status: Acted, what: "Stage 3: a unit needed again within this many elements stays gathered.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.stage3_model_persistence_threshold", status: Acted, what: "Stage 3: total elements of persistent (never released) parameters allowed.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.stage3_param_persistence_threshold", status: Acted, what: "Stage 3: parameters this small stay gathered (1% of the model, at most 1e5, when absent or \"auto\").", deepspeed: "DeepSpeed keeps 1e5 when absent." },
    KeyDoc { path: "zero_optimization.stage3_prefetch_bucket_size", status: Acted, what: "Stage 3: elements gathered ahead of use (the largest unit when absent or \"auto\").", deepspeed: "DeepSpeed keeps 5e7 when absent." },
    KeyDoc { path: "zero_optimization.stage3_use_all_reduce_for_fetch_params", status: Noticed, what: "No effect: parameters are gathered with all-gathers.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.sub_group_size", status: Acted, what: "Elements stepped at once (NVMe offload swaps sub-group by sub-group).", deepspeed: "" },
    KeyDoc { path: "zero_optimization.use_multi_rank_bucket_allreduce", status: Noticed, what: "No effect: DeepSpeed's bucket all-reduce variant.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.zero_hpz_partition_size", status: Acted, what: "Stage 3 (ZeRO++ hpZ), the ranks of a host: the first gather of each unit after a step keeps this rank's 1/k of it, and the unit's later gathers until the next step (backward's, the next micro-batches') all-gather those pieces inside the host. Costs 1/k of the gathered units' bytes per rank until the step (counted in `parameters_gathered`). An error when the hosts run another number of ranks; no effect without a host level (one host, or ZERORUN_HIERARCHY=flat). 1: off.", deepspeed: "DeepSpeed's needs CUDA." },
    KeyDoc { path: "zero_optimization.zero_quantized_gradients", status: Acted, what: "Stages 2-3 (ZeRO++ qgZ): the gradient reduce-scatter sends its parts as int8 blocks of 4096 with one f32 scale each and sums them in f32 after dequantizing (this rank's own part exactly); when ranks span hosts with several on each, only the cross-host step is quantized; with shard groups (`mics_shard_size`) the all-reduce across the groups is (a quantized reduce-scatter and all-gather), the group's reduce-scatter stays exact. Refused at stages 0-1 and with `reduce_scatter` false.", deepspeed: "DeepSpeed's needs CUDA; LoCo's error feedback (`zeropp_loco_param`) is not built." },
    KeyDoc { path: "zero_optimization.zero_quantized_nontrainable_weights", status: Refused, what: "`true` is refused: quantized frozen weights are not built yet.", deepspeed: "" },
    KeyDoc { path: "zero_optimization.zero_quantized_weights", status: Acted, what: "Stage 3 (ZeRO++ qwZ): parameter all-gathers carry int8 values in blocks of 4096 with one f32 scale each (a quarter of fp32's bytes, half of 16-bit's); every rank dequantizes every part, its own included; the shard and the optimizer keep full precision. `true` below stage 3 is refused.", deepspeed: "DeepSpeed's needs CUDA." },
    KeyDoc { path: "zero_optimization.zeropp_loco_param", status: Noticed, what: "No effect: ZeRO++ LoCo's parameters.", deepspeed: "" },
];
