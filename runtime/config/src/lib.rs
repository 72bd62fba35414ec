//! ds_config.json: DeepSpeed's keys, defaults and meanings, parsed into typed structs.
//!
//! A config written for DeepSpeed loads unchanged and means the same thing. Every error names the JSON path of
//! the key at fault; unknown keys are errors that suggest the closest known key. `Config` keeps the batch keys as
//! given until [`Config::resolve`] applies the batch rule for a world size.
#![warn(missing_docs)]
mod aio;
mod async_training;
mod batch;
mod checkpointing;
mod elasticity;
mod error;
pub mod estimate;
mod expert_parallel;
mod fault_tolerance;
mod gradient_compression;
pub mod keys;
mod monitor;
mod notices;
mod optimizer;
mod pipeline;
mod precision;
mod reader;
mod scheduler;
mod zero;

use std::path::Path;

use serde::Serialize;
use serde_json::Value;

pub use aio::AioConfig;
pub use async_training::{AsyncTraining, OuterOptimizer};
pub use batch::{BatchInput, BatchSizes};
pub use checkpointing::{ActivationCheckpointingConfig, CheckpointConfig, TagValidation};
pub use elasticity::ElasticityConfig;
pub use error::{ConfigError, Result};
pub use expert_parallel::ExpertParallelConfig;
pub use fault_tolerance::FaultToleranceConfig;
pub use gradient_compression::{GradientCompression, PowerSgd};
pub use monitor::{comm_op_name, CommsLoggerConfig, FlopsProfilerConfig, MonitorConfig, MonitorOutput, COMM_OPS};
pub use notices::Notice;
pub use optimizer::{
    AdagradParams, AdamParams, LambParams, LionParams, OneBitAdamParams, OneBitCommon, OneBitLambParams,
    OptimizerConfig, SgdParams, ZeroOneAdamParams, ZERO_SUPPORTED,
};
pub use pipeline::{Partition, PipelineConfig, ScheduleName};
pub use precision::{Bf16Config, Fp16Config, Precision};
pub use scheduler::{
    LrRangeTestParams, OneCycleParams, SchedulerConfig, WarmupCosineLrParams, WarmupDecayLrParams, WarmupLrParams,
    WarmupType,
};
pub use zero::{OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig};

use reader::{MaybeAuto, Section};

/// How gradients are combined across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AllreduceOp {
    /// The mean of the ranks' gradients.
    Mean,
    /// Their sum (stages 0-2).
    Sum,
}

/// The dtype gradients travel in (`communication_data_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CommDataType {
    /// fp32.
    Fp32,
    /// fp16.
    Fp16,
    /// bf16.
    Bf16,
}

/// A whole ds_config with every default filled in.
#[derive(Debug, Clone, PartialEq, Serialize)]
/// ```
/// # fn main() -> Result<(), zerorun_config::ConfigError> {
/// let config = zerorun_config::Config::from_json_str(
///     r#"{"train_batch_size": 32, "gradient_accumulation_steps": 2,
///         "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
///         "bf16": {"enabled": true}}"#,
/// )?;
/// assert_eq!(config.stage(), 3);
/// assert_eq!(config.gradient_clipping, 1.0); // DeepSpeed's default, filled in
/// // The batch rule at 4 ranks: 32 = micro-batch x 2 x 4.
/// let sizes = config.batch_sizes(4)?;
/// assert_eq!(sizes.train_micro_batch_size_per_gpu, 4);
/// // Errors name the JSON path of the key at fault.
/// let err = zerorun_config::Config::from_json_str(r#"{"zero_optimization": {"stgae": 3}}"#).unwrap_err();
/// assert!(err.to_string().contains("did you mean `zero_optimization.stage`?"));
/// # Ok(()) }
/// ```
pub struct Config {
    /// Global batch per optimizer step. None until given or resolved.
    pub train_batch_size: Option<u64>,
    /// Samples per micro-batch per rank. None until given or resolved.
    pub train_micro_batch_size_per_gpu: Option<u64>,
    /// Micro-batches per optimizer step. None until given or resolved.
    pub gradient_accumulation_steps: Option<u64>,
    /// Clip gradients to this global L2 norm; 0 disables.
    pub gradient_clipping: f64,
    /// Log a line every this many optimizer steps; None: no periodic log.
    pub steps_per_print: Option<u64>,
    /// `wall_clock_breakdown`: time each phase of the step.
    pub wall_clock_breakdown: bool,
    /// `memory_breakdown`: log the memory accounting every step.
    pub memory_breakdown: bool,
    /// Divide gradients by the world size before the reduction rather than after.
    pub prescale_gradients: bool,
    /// `gradient_predivide_factor`.
    pub gradient_predivide_factor: f64,
    /// `gradient_allreduce_op`.
    pub gradient_allreduce_op: AllreduceOp,
    /// `sequence_parallel_size`: ranks that split each row's sequence (DeepSpeed-Ulysses). A batch's rows are
    /// counted over the data-parallel ranks alone (the world divided by it); ZeRO runs over all of them.
    pub sequence_parallel_size: u64,
    /// The `expert_parallel` section (DeepSpeed's AutoEP block): ranks per expert-parallel group.
    pub expert_parallel: ExpertParallelConfig,
    /// None: gradients travel in the parameters' dtype.
    pub communication_data_type: Option<CommDataType>,
    /// `zero_allow_untested_optimizer`.
    pub zero_allow_untested_optimizer: bool,
    /// `zero_force_ds_cpu_optimizer` (noticed when false).
    pub zero_force_ds_cpu_optimizer: bool,
    /// zerorun's own key: seconds any collective or rendezvous may block before it is an error.
    pub comms_timeout: f64,
    /// The optimizer; None: AdamW's defaults at lr 1e-3 (`initialize` builds Adam with decoupled decay).
    pub optimizer: Option<OptimizerConfig>,
    /// The LR schedule; None: a constant learning rate.
    pub scheduler: Option<SchedulerConfig>,
    /// The `fp16` section.
    pub fp16: Fp16Config,
    /// The `bf16` section.
    pub bf16: Bf16Config,
    /// The `zero_optimization` section.
    pub zero_optimization: ZeroConfig,
    /// The `aio` section.
    pub aio: AioConfig,
    /// The `checkpoint` section.
    pub checkpoint: CheckpointConfig,
    /// The `activation_checkpointing` section (noticed).
    pub activation_checkpointing: ActivationCheckpointingConfig,
    /// The `pipeline` section.
    pub pipeline: PipelineConfig,
    /// The `elasticity` section: when enabled, the batch sizes come from it for every world size.
    pub elasticity: ElasticityConfig,
    /// zerorun's own section: replica groups (shard groups' replicas) that survive the loss of one another.
    pub fault_tolerance: FaultToleranceConfig,
    /// zerorun's own section: synchronous, or ranks stepping alone between meetings.
    pub async_training: AsyncTraining,
    /// zerorun's own section: gradients averaged compressed (PowerSGD).
    pub gradient_compression: GradientCompression,
    /// zerorun's own key: step each part as soon as its gradients are reduced, during backward (torchtune's
    /// `optimizer_in_bwd`): stage 3's units, so no gradient shard is held; stage 0's buckets as their all-reduces
    /// land, so the step hides behind the all-reduces still on the wire. Needs what a step in pieces allows: no
    /// clipping, no accumulation, fp32, an element-wise optimizer.
    pub optimizer_in_backward: bool,
    /// The monitors (`tensorboard`, `csv_monitor`), `flops_profiler` and `comms_logger`, at the top level as in
    /// DeepSpeed's config.
    #[serde(flatten)]
    pub monitor: MonitorConfig,
    /// Keys given that have no effect here, each with the reason (logged as warnings when the config is read).
    #[serde(skip)]
    pub notices: Vec<Notice>,
}

/// Top-level DeepSpeed sections zerorun accepts and does not act on (monitoring, autotuning, other features).
const IGNORED_SECTIONS: &[&str] = &[
    "autotuning",
    "data_efficiency",
    "curriculum_learning",
    "compression_training",
    "sparse_attention",
    "amp",
    "nebula",
    "progressive_layer_drop",
    "eigenvalue",
    "quantize_training",
    "hybrid_engine",
    "compile",
    "timers",
    "dump_state",
    "sparse_gradients",
    "fp32_allreduce",
    "zero_ignore_unused_parameters",
];

impl Config {
    /// Reads and validates a ds_config.json file.
    /// ```no_run
    /// # fn main() -> Result<(), zerorun_config::ConfigError> {
    /// let config = zerorun_config::Config::from_file("ds_config.json")?;
    /// # let _ = config; Ok(()) }
    /// ```
    pub fn from_file(path: impl AsRef<Path>) -> Result<Config> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { file: path.display().to_string(), message: e.to_string() })?;
        Config::from_json_str(&text)
    }

    /// Reads and validates a config given as a JSON string.
    pub fn from_json_str(text: &str) -> Result<Config> {
        let value: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json { message: e.to_string() })?;
        Config::from_value(value)
    }

    /// Reads and validates a config given as a JSON value.
    pub fn from_value(value: Value) -> Result<Config> {
        let given = notices::given_paths(&value);
        let mut s = Section::new("", value)?;
        let mut batch_key = |key: &'static str| -> Result<Option<u64>> {
            // "auto" batch values are inferred by the batch rule, like missing ones.
            Ok(match s.uint_auto(&[key])? {
                MaybeAuto::Value(v) => Some(v),
                MaybeAuto::Absent | MaybeAuto::Auto => None,
            })
        };
        let train_batch_size = batch_key("train_batch_size")?;
        let train_micro_batch_size_per_gpu = batch_key("train_micro_batch_size_per_gpu")?;
        let gradient_accumulation_steps = batch_key("gradient_accumulation_steps")?;

        let mut ignored = Vec::new();
        let zero_optimization = match s.take("zero_optimization") {
            None => ZeroConfig::from_legacy_bool(false)?,
            Some(Value::Bool(enabled)) => ZeroConfig::from_legacy_bool(enabled)?,
            Some(v) => ZeroConfig::read(Section::new("zero_optimization", v)?, &mut ignored)?,
        };
        let optimizer = match s.take("optimizer") {
            None => None,
            Some(v) => Some(OptimizerConfig::read(Section::new("optimizer", v)?)?),
        };
        let default_lr = optimizer.as_ref().map_or(1e-3, OptimizerConfig::lr);
        let scheduler = match s.take("scheduler") {
            None => None,
            Some(v) => Some(scheduler::read_scheduler(Section::new("scheduler", v)?, default_lr)?),
        };
        let fp16 = Fp16Config::read(s.section("fp16")?)?;
        let bf16 = match s.take_aliased(&["bf16", "bfloat16"])? {
            None => Bf16Config::default(),
            Some((key, v)) => Bf16Config::read(Section::new(key, v)?)?,
        };
        let gradient_allreduce_op = match s.choice("gradient_allreduce_op", &["mean", "sum"], "mean")? {
            "sum" => AllreduceOp::Sum,
            _ => AllreduceOp::Mean,
        };
        let communication_data_type = match s.opt_string("communication_data_type")? {
            None => None,
            Some(t) => Some(match t.as_str() {
                "fp32" | "float32" => CommDataType::Fp32,
                "fp16" | "float16" => CommDataType::Fp16,
                "bf16" | "bfp16" | "bfloat16" => CommDataType::Bf16,
                _ => {
                    return Err(ConfigError::Invalid {
                        path: "communication_data_type".into(),
                        value: format!("\"{t}\""),
                        allowed: "one of \"fp32\", \"fp16\", \"bf16\"".into(),
                    })
                }
            }),
        };
        let monitor = MonitorConfig::read(&mut s)?;
        let config = Config {
            train_batch_size,
            train_micro_batch_size_per_gpu,
            gradient_accumulation_steps,
            gradient_clipping: s.float("gradient_clipping", 1.0)?,
            steps_per_print: s.opt_uint("steps_per_print")?,
            // The flops profiler reads the phase timers, as DeepSpeed's turns them on.
            wall_clock_breakdown: s.bool("wall_clock_breakdown", false)? || monitor.flops_profiler.enabled,
            memory_breakdown: s.bool("memory_breakdown", false)?,
            prescale_gradients: s.bool("prescale_gradients", false)?,
            gradient_predivide_factor: s.float("gradient_predivide_factor", 1.0)?,
            gradient_allreduce_op,
            sequence_parallel_size: s.uint("sequence_parallel_size", 1)?,
            expert_parallel: ExpertParallelConfig::read(s.section("expert_parallel")?)?,
            communication_data_type,
            zero_allow_untested_optimizer: s.bool("zero_allow_untested_optimizer", false)?,
            zero_force_ds_cpu_optimizer: s.bool("zero_force_ds_cpu_optimizer", true)?,
            comms_timeout: s.float("comms_timeout", 1800.0)?,
            optimizer,
            scheduler,
            fp16,
            bf16,
            zero_optimization,
            aio: AioConfig::read(s.section("aio")?)?,
            checkpoint: CheckpointConfig::read(s.section("checkpoint")?)?,
            activation_checkpointing: ActivationCheckpointingConfig::read(s.section("activation_checkpointing")?)?,
            pipeline: PipelineConfig::read(s.section("pipeline")?)?,
            elasticity: ElasticityConfig::read(s.section("elasticity")?)?,
            fault_tolerance: FaultToleranceConfig::read(s.section("fault_tolerance")?)?,
            async_training: AsyncTraining::read(s.section("async_training")?)?,
            gradient_compression: GradientCompression::read(s.section("gradient_compression")?)?,
            optimizer_in_backward: s.bool("optimizer_in_backward", false)?,
            monitor,
            notices: Vec::new(),
        };
        let mut config = config;
        for key in IGNORED_SECTIONS {
            if let Some(path) = s.ignore(key) {
                ignored.push(path);
            }
        }
        s.finish()?;
        config.validate()?;
        config.notices = notices::collect(&config, &given, ignored);
        for n in &config.notices {
            tracing::warn!("`{}` has no effect here: {}", n.path, n.why);
        }
        Ok(config)
    }

    /// The JSON path of every key zerorun accepts (sections' own keys, each optimizer's and scheduler's params;
    /// other names of a key left out), sorted. What each one does, or why it does nothing here, is in
    /// [`keys::reference`] (`zerorun config keys`), checked against `tests/config_keys.rs`.
    pub fn accepted_keys() -> Vec<String> {
        keys::accepted().into_iter().map(|k| k.path).collect()
    }

    /// Checks combinations no single section can see.
    fn validate(&self) -> Result<()> {
        let e = &self.elasticity;
        let given = [
            ("train_batch_size", self.train_batch_size),
            ("train_micro_batch_size_per_gpu", self.train_micro_batch_size_per_gpu),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps),
        ];
        let given: Vec<&str> = given.iter().filter(|(_, v)| v.is_some()).map(|(k, _)| *k).collect();
        if e.enabled && !given.is_empty() {
            if !e.ignore_non_elastic_batch_info {
                return Err(ConfigError::Conflict {
                    path: "elasticity.enabled".into(),
                    message: format!(
                        "elastic training computes the batch sizes, so {} would not be used; remove them, or set `elasticity.ignore_non_elastic_batch_info` to true to have them overridden",
                        given.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
                    ),
                });
            }
            tracing::warn!("elastic training overrides {}", given.join(", "));
        }
        let z = &self.zero_optimization;
        if self.async_training.is_local() {
            let conflict = |message: String| Err(ConfigError::Conflict { path: "async_training.mode".into(), message });
            if z.stage != 0 {
                return conflict(format!(
                    "local SGD and DiLoCo step every rank's whole optimizer on its own gradients: `zero_optimization.stage` must be 0 (it is {})",
                    z.stage
                ));
            }
        }
        if self.expert_parallel.size() > 1 && self.sequence_parallel_size > 1 {
            return Err(ConfigError::Conflict {
                path: "expert_parallel.autoep_size".into(),
                message: format!(
                    "expert parallelism with `sequence_parallel_size` {} is not built yet (DeepSpeed's AutoEP refuses it too): a sequence group's ranks hold parts of the same rows",
                    self.sequence_parallel_size
                ),
            });
        }
        if self.optimizer_in_backward {
            self.validate_optimizer_in_backward()?;
        }
        self.fault_tolerance.check(self)?;
        if let AsyncTraining::BoundedStaleness { .. } = self.async_training {
            self.validate_bounded_staleness()?;
        }
        if self.fp16.enabled && self.bf16.enabled {
            return Err(ConfigError::Conflict {
                path: "bf16.enabled".into(),
                message: "`fp16.enabled` and `bf16.enabled` are both true; enable one of them".into(),
            });
        }
        if z.offload_param.device != OffloadDevice::None && z.stage < 3 {
            return Err(ConfigError::Conflict {
                path: "zero_optimization.offload_param.device".into(),
                message: format!("parameter offload needs `zero_optimization.stage` 3 (it is {})", z.stage),
            });
        }
        if z.offload_optimizer.device != OffloadDevice::None && z.stage == 0 {
            return Err(ConfigError::Conflict {
                path: "zero_optimization.offload_optimizer.device".into(),
                message: "optimizer offload needs `zero_optimization.stage` >= 1 (it is 0)".into(),
            });
        }
        for (section, device, path) in [
            ("offload_optimizer", z.offload_optimizer.device, &z.offload_optimizer.nvme_path),
            ("offload_param", z.offload_param.device, &z.offload_param.nvme_path),
        ] {
            if device == OffloadDevice::Nvme && path.as_deref().map_or(true, str::is_empty) {
                return Err(ConfigError::Missing {
                    path: format!("zero_optimization.{section}.nvme_path"),
                    when: format!("when `zero_optimization.{section}.device` is \"nvme\""),
                });
            }
        }
        if self.gradient_allreduce_op == AllreduceOp::Sum && z.stage == 3 {
            return Err(ConfigError::Conflict {
                path: "gradient_allreduce_op".into(),
                message: "\"sum\" is not supported at `zero_optimization.stage` 3; use \"mean\"".into(),
            });
        }
        if self.gradient_compression.powersgd().is_some() {
            let conflict =
                |message: String| Err(ConfigError::Conflict { path: "gradient_compression.type".into(), message });
            if z.stage > 1 {
                return conflict(format!(
                    "PowerSGD averages whole gradient matrices at stages 0 and 1 (this config has stage {}); at stages 2-3 the gradients are reduce-scattered bucket by bucket during backward and no rank holds the whole gradient its low-rank factors are products of",
                    z.stage
                ));
            }
            if let Some(opt) = self.optimizer.as_ref().filter(|o| o.one_bit().is_some()) {
                return conflict(format!(
                    "{} compresses its own exchange; use one compression or the other",
                    opt.name()
                ));
            }
            if self.async_training.is_async() {
                return conflict("asynchronous training keeps gradients local; PowerSGD averages them".into());
            }
            if self.gradient_allreduce_op == AllreduceOp::Sum
                || self.prescale_gradients
                || self.gradient_predivide_factor != 1.0
            {
                return conflict("PowerSGD averages the ranks' gradients (its Q is divided by the world size): not with `gradient_allreduce_op` \"sum\", `prescale_gradients` or a `gradient_predivide_factor`".into());
            }
        }
        if let Some(opt) = self.optimizer.as_ref().filter(|o| o.one_bit().is_some()) {
            // Stage 0: the exchange is of the whole momentum, which every rank holds. Stage 1 (1-bit Adam only):
            // the gradient and the step's change travel as signs around an exact step of the partition. Stage 2
            // reduces each bucket during backward and never holds the whole local gradient; 0/1 Adam's local steps
            // and 1-bit LAMB's per-tensor ratios need every rank to hold the whole momentum.
            let highest = if matches!(opt, OptimizerConfig::OneBitAdam(_)) { 1 } else { 0 };
            if z.stage > highest {
                return Err(ConfigError::Conflict {
                    path: "optimizer.type".into(),
                    message: format!(
                        "{} runs at ZeRO stage {} (this config has stage {}): {}",
                        opt.name(),
                        if highest == 0 { "0" } else { "0 or 1" },
                        z.stage,
                        if highest == 0 {
                            "its ranks exchange the whole momentum as signs, and at stages 1-3 no rank holds the whole momentum"
                        } else {
                            "at stage 1 the gradient travels as signs before the step; stages 2 and 3 reduce each bucket during backward and never hold the whole local gradient"
                        }
                    ),
                });
            }
            if self.async_training.is_async() {
                return Err(ConfigError::Conflict {
                    path: "optimizer.type".into(),
                    message: format!(
                        "{} communicates its momentum every step (or on its own schedule); asynchronous training (`async_training`) keeps ranks apart: use one or the other",
                        opt.name()
                    ),
                });
            }
        }
        if let Some(opt) = &self.optimizer {
            if z.stage >= 1
                && opt.one_bit().is_none()
                && !self.zero_allow_untested_optimizer
                && !ZERO_SUPPORTED.contains(&opt.name())
            {
                return Err(ConfigError::Conflict {
                    path: "optimizer.type".into(),
                    message: format!(
                        "{} is not among ZeRO's supported optimizers ({}); set `zero_allow_untested_optimizer` to true to use it at stage {}",
                        opt.name(),
                        ZERO_SUPPORTED.join(", "),
                        z.stage
                    ),
                });
            }
        }
        let invalid = |path: &str, value: f64, allowed: &str| ConfigError::Invalid {
            path: path.into(),
            value: value.to_string(),
            allowed: allowed.into(),
        };
        // Written so NaN fails each check too.
        if self.gradient_clipping.is_nan() || self.gradient_clipping < 0.0 {
            return Err(invalid("gradient_clipping", self.gradient_clipping, "must be >= 0 (0 disables clipping)"));
        }
        if self.gradient_predivide_factor.is_nan() || self.gradient_predivide_factor <= 0.0 {
            return Err(invalid("gradient_predivide_factor", self.gradient_predivide_factor, "must be > 0"));
        }
        if self.comms_timeout.is_nan() || self.comms_timeout <= 0.0 {
            return Err(invalid("comms_timeout", self.comms_timeout, "must be > 0 seconds"));
        }
        if self.steps_per_print == Some(0) {
            return Err(invalid("steps_per_print", 0.0, "must be >= 1 (leave it out for no periodic log)"));
        }
        Ok(())
    }

    /// Bounded staleness serves stage 1's partitions from their owners, as gradients come in.
    fn validate_bounded_staleness(&self) -> Result<()> {
        let z = &self.zero_optimization;
        let conflict = |message: String| Err(ConfigError::Conflict { path: "async_training.mode".into(), message });
        if z.stage != 1 {
            return conflict(format!(
                "bounded staleness gives each rank a partition of the parameters and its optimizer state to serve, as at stage 1: `zero_optimization.stage` must be 1 (it is {})",
                z.stage
            ));
        }
        if self.fp16.enabled {
            return conflict(
                "fp16's loss scale needs every rank's overflow verdict on the same step, which no rank waits for here: use bf16 or fp32 (`fp16.enabled` must be false)".into(),
            );
        }
        if self.gradient_clipping != 0.0 {
            return conflict(format!(
                "clipping needs the global norm of one step's gradients, which no owner sees: set `gradient_clipping` to 0 (it is {})",
                self.gradient_clipping
            ));
        }
        if z.offload_optimizer.device == OffloadDevice::Nvme {
            return conflict(
                "an owner steps its partition as its gradients come in: `zero_optimization.offload_optimizer.device` must not be \"nvme\"".into(),
            );
        }
        Ok(())
    }

    /// `optimizer_in_backward` steps each unit as its gradients arrive: nothing may need every gradient first.
    fn validate_optimizer_in_backward(&self) -> Result<()> {
        let z = &self.zero_optimization;
        let conflict = |message: String| Err(ConfigError::Conflict { path: "optimizer_in_backward".into(), message });
        if z.stage != 0 && z.stage != 3 {
            return conflict(format!(
                "the optimizer steps each part as its gradients are reduced: stage 3's units in their walk, stage 0's buckets as their all-reduces land; `zero_optimization.stage` must be 0 or 3 (it is {})",
                z.stage
            ));
        }
        if z.stage == 0 && !z.overlap_comm {
            return conflict(
                "stage 0 steps each bucket as its all-reduce in backward lands: `zero_optimization.overlap_comm` must be true (its default at stage 0)".into(),
            );
        }
        if self.gradient_clipping != 0.0 {
            return conflict(format!(
                "clipping needs the norm of every gradient before any update: set `gradient_clipping` to 0 (it is {})",
                self.gradient_clipping
            ));
        }
        if let Some(gas) = self.gradient_accumulation_steps.filter(|&g| g > 1) {
            return conflict(format!(
                "accumulation needs a gradient shard to add micro-batches in: `gradient_accumulation_steps` must be 1 (it is {gas})"
            ));
        }
        if self.fp16.enabled || self.bf16.enabled {
            return conflict(
                "a step that may be skipped for overflow cannot start before every gradient is in; it runs fp32 models (`fp16.enabled` / `bf16.enabled` must be false)".into(),
            );
        }
        if let Some(opt) = self.optimizer.as_ref().filter(|o| o.name() == "Lamb") {
            return conflict(format!(
                "{}'s trust ratio needs each tensor's whole update: `optimizer.type` must be element-wise (Adam, AdamW, SGD, Adagrad, Lion)",
                opt.name()
            ));
        }
        Ok(())
    }

    /// The batch keys as given.
    pub fn batch_input(&self) -> BatchInput {
        BatchInput {
            train_batch_size: self.train_batch_size,
            train_micro_batch_size_per_gpu: self.train_micro_batch_size_per_gpu,
            gradient_accumulation_steps: self.gradient_accumulation_steps,
        }
    }

    /// The batch sizes for `world_size` data-parallel ranks.
    pub fn batch_sizes(&self, world_size: usize) -> Result<BatchSizes> {
        let world_size = self.data_parallel_size(world_size)?;
        if self.elasticity.enabled {
            return self.elasticity.batch_sizes(world_size as u64);
        }
        self.batch_input().resolve(world_size as u64)
    }

    /// The ranks a batch's rows are split over among `world_size`: all of them, or with `sequence_parallel_size`
    /// S the world divided by S (each row's sequence is split over S ranks).
    /// With `expert_parallel` E must divide the ranks too (groups of E adjacent ranks split the experts).
    pub fn data_parallel_size(&self, world_size: usize) -> Result<usize> {
        let s = self.sequence_parallel_size as usize;
        if s == 0 || world_size % s != 0 {
            return Err(ConfigError::Invalid {
                path: "sequence_parallel_size".into(),
                value: s.to_string(),
                allowed: format!(
                    "a divisor of the {world_size} data-parallel ranks (each row's sequence is split over that many)"
                ),
            });
        }
        let e = self.expert_parallel.size() as usize;
        if world_size % e != 0 {
            return Err(ConfigError::Invalid {
                path: "expert_parallel.autoep_size".into(),
                value: e.to_string(),
                allowed: format!(
                    "a divisor of the {world_size} data-parallel ranks (groups of that many adjacent ranks split the experts)"
                ),
            });
        }
        Ok(world_size / s)
    }

    /// A copy with the batch values inferred for `world_size`: the fully resolved config.
    /// ```
    /// # fn main() -> Result<(), zerorun_config::ConfigError> {
    /// let config: zerorun_config::Config = r#"{"train_micro_batch_size_per_gpu": 4}"#.parse()?;
    /// let resolved = config.resolve(8)?;
    /// assert_eq!(resolved.train_batch_size, Some(32));
    /// # Ok(()) }
    /// ```
    pub fn resolve(&self, world_size: usize) -> Result<Config> {
        let b = self.batch_sizes(world_size)?;
        let mut resolved = Config {
            train_batch_size: Some(b.train_batch_size),
            train_micro_batch_size_per_gpu: Some(b.train_micro_batch_size_per_gpu),
            gradient_accumulation_steps: Some(b.gradient_accumulation_steps),
            ..self.clone()
        };
        // The elastic batch written out beside the section: it reads back as given, overridden again.
        resolved.elasticity.ignore_non_elastic_batch_info |= self.elasticity.enabled;
        Ok(resolved)
    }

    /// `zero_optimization.stage`.
    pub fn stage(&self) -> u8 {
        self.zero_optimization.stage
    }

    /// The parameters' precision, from `fp16.enabled` and `bf16.enabled`.
    pub fn precision(&self) -> Precision {
        if self.fp16.enabled {
            Precision::Fp16
        } else if self.bf16.enabled {
            Precision::Bf16
        } else {
            Precision::Fp32
        }
    }

    /// The config as JSON with DeepSpeed's key names; it reads back to an equal `Config`. Stage 3's size keys the
    /// engine sizes from the model ([`ZeroConfig::sized_from_model`]) are written as "auto", as they were given.
    pub fn to_value(&self) -> Value {
        let mut v = serde_json::to_value(self).expect("config serializes");
        for key in &self.zero_optimization.sized_from_model {
            v["zero_optimization"][*key] = Value::String("auto".into());
        }
        v
    }
}

impl std::str::FromStr for Config {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Config> {
        Config::from_json_str(s)
    }
}
