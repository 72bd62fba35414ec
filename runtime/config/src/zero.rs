//! `zero_optimization`: the ZeRO stage, buckets, stage-3 gathering limits and offload targets.
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::{MaybeAuto, Section};

/// Where a tier of model state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadDevice {
    /// Not offloaded.
    None,
    /// Host memory.
    Cpu,
    /// NVMe swap files.
    Nvme,
}

impl OffloadDevice {
    fn read(s: &mut Section) -> Result<Self> {
        Ok(match s.choice("device", &["none", "cpu", "nvme"], "none")? {
            "cpu" => OffloadDevice::Cpu,
            "nvme" => OffloadDevice::Nvme,
            _ => OffloadDevice::None,
        })
    }
}

/// `zero_optimization.offload_optimizer`: fp32 master weights and optimizer moments off the device (ZeRO-Offload).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OffloadOptimizerConfig {
    /// Where the states live.
    pub device: OffloadDevice,
    /// The swap folder (`nvme`).
    pub nvme_path: Option<String>,
    /// Swap buffers for NVMe sub-groups.
    pub buffer_count: u64,
    /// `pin_memory` (noticed on CPU runs).
    pub pin_memory: bool,
    /// Read the next NVMe sub-group while stepping this one.
    pub pipeline_read: bool,
    /// Write a stepped sub-group while stepping the next.
    pub pipeline_write: bool,
    /// `fast_init` (noticed).
    pub fast_init: bool,
    /// Fraction of the optimizer step that runs on the host.
    pub ratio: f64,
}

/// `zero_optimization.offload_param` (stage 3 only): parameter shards off the device (ZeRO-Infinity).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OffloadParamConfig {
    /// Where the parameter shards live.
    pub device: OffloadDevice,
    /// The swap folder (`nvme`).
    pub nvme_path: Option<String>,
    /// Read-ahead buffers.
    pub buffer_count: u64,
    /// Elements per swap buffer.
    pub buffer_size: u64,
    /// Elements of parameters kept in host memory when offloading to NVMe.
    pub max_in_cpu: u64,
    /// `pin_memory` (noticed on CPU runs).
    pub pin_memory: bool,
}

/// `zero_optimization`, every default filled in. Sizes are in elements, as in DeepSpeed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZeroConfig {
    /// 0: plain data parallel; 1: optimizer states sharded; 2: + gradients; 3: + parameters.
    pub stage: u8,
    /// `contiguous_gradients` (noticed when false).
    pub contiguous_gradients: bool,
    /// `false`: all-reduce gradients and keep this rank's part (stages 1-2).
    pub reduce_scatter: bool,
    /// Elements per gradient reduction round.
    pub reduce_bucket_size: u64,
    /// `allgather_partitions` (noticed when false).
    pub allgather_partitions: bool,
    /// `allgather_bucket_size` (noticed when not the default).
    pub allgather_bucket_size: u64,
    /// Collectives run on the communication thread, overlapping compute. Default: true at stage 3 only.
    pub overlap_comm: bool,
    /// `load_from_fp32_weights` (noticed when false).
    pub load_from_fp32_weights: bool,
    /// `elastic_checkpoint` (noticed when true).
    pub elastic_checkpoint: bool,
    /// Elements per optimizer sub-group (the unit of NVMe swapping).
    pub sub_group_size: u64,
    /// Stage 3: elements gathered ahead of use.
    pub stage3_prefetch_bucket_size: u64,
    /// Parameters smaller than this stay gathered for the whole step.
    pub stage3_param_persistence_threshold: u64,
    /// Stage 3: elements of persistent parameters allowed in all.
    pub stage3_model_persistence_threshold: u64,
    /// Stage 3: gathered elements allowed at once.
    pub stage3_max_live_parameters: u64,
    /// Stage 3: a unit needed again within this many elements stays gathered.
    pub stage3_max_reuse_distance: u64,
    /// Stage 3: `save_16bit_model` gathers the whole model.
    pub stage3_gather_16bit_weights_on_model_save: bool,
    /// `round_robin_gradients` (noticed when true).
    pub round_robin_gradients: bool,
    /// `zero_quantized_weights` (ZeRO++ qwZ, stage 3): parameter all-gathers carry int8 values in blocks with
    /// one scale each; the shard keeps full precision.
    pub zero_quantized_weights: bool,
    /// `zero_quantized_gradients` (ZeRO++ qgZ, stages 2-3): the gradient reduce-scatter's parts travel as int8
    /// blocks (across hosts only, when the collectives run in two levels), summed in f32.
    pub zero_quantized_gradients: bool,
    /// `zero_hpz_partition_size` (ZeRO++ hpZ, stage 3; 1 = off): a secondary copy of each gathered unit, split
    /// over a host's ranks, serves the unit's later gathers until the next step from inside the host.
    pub zero_hpz_partition_size: u64,
    /// `mics_shard_size` (MiCS, FSDP2's HSDP; None = off): the data-parallel ranks form groups of this many,
    /// ZeRO partitions over a group and the groups replicate each other (gradients all-reduced across them).
    pub mics_shard_size: Option<u64>,
    /// `false`: a parameter without a gradient is an error (stages 2-3).
    pub ignore_unused_parameters: bool,
    /// The `offload_optimizer` section.
    pub offload_optimizer: OffloadOptimizerConfig,
    /// The `offload_param` section.
    pub offload_param: OffloadParamConfig,
    /// Stage 3's size keys the config left out or set to "auto" (`reduce_bucket_size`,
    /// `stage3_prefetch_bucket_size`, `stage3_param_persistence_threshold`, `stage3_max_live_parameters`): the
    /// engine sizes them from the model's units at initialize (DeepSpeed's defaults until then); at stages 0 and 2,
    /// `reduce_bucket_size` alone (the gradient hooks' buckets). Empty once sized, and at stage 1. Not a key:
    /// `Config::to_value` writes these keys as "auto".
    #[serde(skip)]
    pub sized_from_model: Vec<&'static str>,
}

/// DeepSpeed ZeRO keys zerorun accepts and does not act on (performance knobs of DeepSpeed's own kernels).
const IGNORED: &[&str] = &[
    "memory_efficient_linear",
    "use_multi_rank_bucket_allreduce",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "legacy_stage1",
    "stage3_use_all_reduce_for_fetch_params",
    "zeropp_loco_param",
];

/// DeepSpeed ZeRO features zerorun does not have: accepted only while they stay off.
const UNSUPPORTED_FLAGS: &[&str] = &["zero_quantized_nontrainable_weights"];

impl ZeroConfig {
    /// Reads the section. `legacy` is the old boolean form (`"zero_optimization": true` = stage 1).
    pub(crate) fn read(mut s: Section, ignored: &mut Vec<String>) -> Result<Self> {
        let stage = s.uint("stage", 0)?;
        if stage > 3 {
            return Err(ConfigError::Invalid {
                path: s.path_of("stage"),
                value: stage.to_string(),
                allowed: "one of 0, 1, 2, 3".into(),
            });
        }
        let stage = stage as u8;
        // "auto" bucket sizes (HF Trainer) take DeepSpeed's defaults: zerorun does not know the hidden size here.
        let size = |s: &mut Section, keys: &[&'static str], default: u64| -> Result<u64> {
            let v = match s.uint_auto(keys)? {
                MaybeAuto::Value(v) => v,
                MaybeAuto::Absent | MaybeAuto::Auto => default,
            };
            if v == 0 {
                return Err(ConfigError::Invalid {
                    path: s.path_of(keys[0]),
                    value: "0".into(),
                    allowed: "must be >= 1".into(),
                });
            }
            Ok(v)
        };
        let contiguous_gradients = s.bool("contiguous_gradients", true)?;
        let reduce_scatter = s.bool("reduce_scatter", true)?;
        // Stage 3's size keys left out or "auto": noted, so the engine sizes them from the model; stages 0 and 2's
        // reduce_bucket_size too (their gradient hooks cut the model into buckets of that size).
        let mut sized_from_model = Vec::new();
        let sized = |s: &mut Section, noted: &mut Vec<&'static str>, keys: &[&'static str], default: u64| {
            let defaulted = matches!(s.uint_auto_peek(keys), MaybeAuto::Absent | MaybeAuto::Auto);
            if defaulted && (stage == 3 || (stage != 1 && keys[0] == "reduce_bucket_size")) {
                noted.push(keys[0]);
            }
            size(s, keys, default)
        };
        let reduce_bucket_size = sized(&mut s, &mut sized_from_model, &["reduce_bucket_size"], 500_000_000)?;
        let allgather_partitions = s.bool("allgather_partitions", true)?;
        let allgather_bucket_size = size(&mut s, &["allgather_bucket_size"], 500_000_000)?;
        // DeepSpeed's default is true at stage 3 only; zerorun's stage-2 overlap costs no memory with units (one
        // staging round either way) and one more staging half in a plain loop (an eighth of the model when sized
        // from it), and stage 0's (the buckets all-reduced in place during backward, as DDP always does) none, so
        // it is on by default there too.
        let overlap_comm = s.opt_bool(&["overlap_comm"])?.unwrap_or(stage != 1);
        let load_from_fp32_weights = s.bool("load_from_fp32_weights", true)?;
        let elastic_checkpoint = s.bool("elastic_checkpoint", false)?;
        let sub_group_size = size(&mut s, &["sub_group_size"], 1_000_000_000)?;
        let stage3_prefetch_bucket_size =
            sized(&mut s, &mut sized_from_model, &["stage3_prefetch_bucket_size", "prefetch_bucket_size"], 50_000_000)?;
        let stage3_param_persistence_threshold =
            match s.uint_auto(&["stage3_param_persistence_threshold", "param_persistence_threshold"])? {
                MaybeAuto::Value(v) => v,
                _ => {
                    if stage == 3 {
                        sized_from_model.push("stage3_param_persistence_threshold");
                    }
                    100_000
                }
            };
        let stage3_model_persistence_threshold =
            match s.uint_auto(&["stage3_model_persistence_threshold", "model_persistence_threshold"])? {
                MaybeAuto::Value(v) => v,
                _ => i64::MAX as u64,
            };
        let stage3_max_live_parameters = sized(
            &mut s,
            &mut sized_from_model,
            &["stage3_max_live_parameters", "max_live_parameters"],
            1_000_000_000,
        )?;
        let stage3_max_reuse_distance = match s.uint_auto(&["stage3_max_reuse_distance", "max_reuse_distance"])? {
            MaybeAuto::Value(v) => v,
            _ => 1_000_000_000,
        };
        let gather_keys = [
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "gather_fp16_weights_on_model_save",
        ];
        let stage3_gather_16bit_weights_on_model_save = s.opt_bool(&gather_keys)?.unwrap_or(false);
        let round_robin_gradients = s.bool("round_robin_gradients", false)?;
        let zero_quantized_weights = s.bool("zero_quantized_weights", false)?;
        let zero_quantized_gradients = s.bool("zero_quantized_gradients", false)?;
        if zero_quantized_gradients && (stage < 2 || !reduce_scatter) {
            let why = if stage < 2 {
                format!("at stage {stage}: quantized gradient reduce-scatters are stages 2 and 3's")
            } else {
                "with reduce_scatter false: the gradients are all-reduced, which is not quantized".into()
            };
            return Err(ConfigError::Invalid {
                path: s.path_of("zero_quantized_gradients"),
                value: "true".into(),
                allowed: format!("`false` {why}"),
            });
        }
        if zero_quantized_weights && stage != 3 {
            return Err(ConfigError::Invalid {
                path: s.path_of("zero_quantized_weights"),
                value: "true".into(),
                allowed: format!(
                    "`false` at stage {stage}: quantized weight all-gathers are stage 3's (set \"stage\": 3, or remove the key)"
                ),
            });
        }
        let ignore_unused_parameters = s.bool("ignore_unused_parameters", true)?;

        // Deprecated booleans from DeepSpeed < 0.3.x configs, still seen in the wild.
        let cpu_offload = s.opt_bool(&["cpu_offload"])?;
        let cpu_offload_param = s.opt_bool(&["cpu_offload_param"])?;
        let cpu_offload_pin = s.opt_bool(&["cpu_offload_use_pin_memory"])?;

        let mut offload_optimizer = read_offload_optimizer(s.section("offload_optimizer")?)?;
        let mut offload_param = read_offload_param(s.section("offload_param")?)?;
        if cpu_offload == Some(true) {
            if offload_optimizer.device != OffloadDevice::None {
                return Err(conflict(
                    &s,
                    "cpu_offload",
                    "the deprecated flag and `offload_optimizer` are both given; keep `offload_optimizer`",
                ));
            }
            offload_optimizer.device = OffloadDevice::Cpu;
        }
        if cpu_offload_param == Some(true) {
            if offload_param.device != OffloadDevice::None {
                return Err(conflict(
                    &s,
                    "cpu_offload_param",
                    "the deprecated flag and `offload_param` are both given; keep `offload_param`",
                ));
            }
            offload_param.device = OffloadDevice::Cpu;
        }
        if let Some(pin) = cpu_offload_pin {
            offload_optimizer.pin_memory = pin;
            offload_param.pin_memory = pin;
        }

        for key in IGNORED {
            if let Some(path) = s.ignore(key) {
                ignored.push(path);
            }
        }
        for key in UNSUPPORTED_FLAGS {
            if s.opt_bool(&[key])? == Some(true) {
                return Err(ConfigError::Invalid {
                    path: s.path_of(key),
                    value: "true".into(),
                    allowed: "zerorun does not implement this ZeRO++ quantized communication yet; set it to false"
                        .into(),
                });
            }
        }
        let zero_hpz_partition_size = s.uint("zero_hpz_partition_size", 1)?;
        if zero_hpz_partition_size == 0 || (zero_hpz_partition_size > 1 && stage != 3) {
            return Err(ConfigError::Invalid {
                path: s.path_of("zero_hpz_partition_size"),
                value: zero_hpz_partition_size.to_string(),
                allowed: format!(
                    "1 (off){}",
                    if stage == 3 {
                        ", or the ranks of a host"
                    } else {
                        " below stage 3: the secondary partition is of stage 3's gathered parameters"
                    }
                ),
            });
        }
        // DeepSpeed's default -1 (and 0) mean no shard groups.
        let mics_shard_size = match s.opt_int("mics_shard_size")? {
            Some(v) if v > 0 => {
                if stage == 0 || zero_hpz_partition_size > 1 {
                    return Err(ConfigError::Invalid {
                        path: s.path_of("mics_shard_size"),
                        value: v.to_string(),
                        allowed: if stage == 0 {
                            "-1 (off) at stage 0, which shards nothing; shard groups need stages 1-3".into()
                        } else {
                            "-1 (off) with zero_hpz_partition_size: the shard group already keeps the gathers inside it"
                                .into()
                        },
                    });
                }
                Some(v as u64)
            }
            _ => None,
        };
        if s.bool("mics_hierarchical_params_gather", false)? {
            ignored.push(s.path_of("mics_hierarchical_params_gather"));
        }
        s.finish()?;
        Ok(ZeroConfig {
            stage,
            contiguous_gradients,
            reduce_scatter,
            reduce_bucket_size,
            allgather_partitions,
            allgather_bucket_size,
            overlap_comm,
            load_from_fp32_weights,
            elastic_checkpoint,
            sub_group_size,
            stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold,
            stage3_model_persistence_threshold,
            stage3_max_live_parameters,
            stage3_max_reuse_distance,
            stage3_gather_16bit_weights_on_model_save,
            round_robin_gradients,
            zero_quantized_weights,
            zero_quantized_gradients,
            zero_hpz_partition_size,
            mics_shard_size,
            ignore_unused_parameters,
            offload_optimizer,
            offload_param,
            sized_from_model,
        })
    }

    /// The old boolean form of the section: true = stage 1.
    pub(crate) fn from_legacy_bool(enabled: bool) -> Result<Self> {
        let mut ignored = Vec::new();
        let mut z = ZeroConfig::read(Section::new("zero_optimization", serde_json::json!({}))?, &mut ignored)?;
        z.stage = u8::from(enabled);
        Ok(z)
    }
}

fn conflict(s: &Section, key: &str, message: &str) -> ConfigError {
    ConfigError::Conflict { path: s.path_of(key), message: message.into() }
}

fn positive(s: &Section, key: &str, v: u64) -> Result<u64> {
    if v == 0 {
        return Err(ConfigError::Invalid { path: s.path_of(key), value: "0".into(), allowed: "must be >= 1".into() });
    }
    Ok(v)
}

fn read_offload_optimizer(mut s: Section) -> Result<OffloadOptimizerConfig> {
    let device = OffloadDevice::read(&mut s)?;
    let nvme_path = s.opt_string("nvme_path")?;
    let buffer_count = s.uint("buffer_count", 4)?;
    let c = OffloadOptimizerConfig {
        device,
        nvme_path,
        buffer_count: positive(&s, "buffer_count", buffer_count)?,
        pin_memory: s.bool("pin_memory", true)?,
        pipeline_read: s.bool("pipeline_read", false)?,
        pipeline_write: s.bool("pipeline_write", false)?,
        fast_init: s.bool("fast_init", false)?,
        ratio: s.float("ratio", 1.0)?,
    };
    if !(c.ratio > 0.0 && c.ratio <= 1.0) {
        return Err(ConfigError::Invalid {
            path: s.path_of("ratio"),
            value: c.ratio.to_string(),
            allowed: "must be in (0, 1]".into(),
        });
    }
    // The old name of both directions (DeepSpeed < 0.4): true turns on pipeline_read and pipeline_write.
    let legacy = s.opt_bool(&["pipeline"])?;
    let mut c = c;
    if legacy == Some(true) {
        c.pipeline_read = true;
        c.pipeline_write = true;
    }
    s.finish()?;
    Ok(c)
}

fn read_offload_param(mut s: Section) -> Result<OffloadParamConfig> {
    let device = OffloadDevice::read(&mut s)?;
    let nvme_path = s.opt_string("nvme_path")?;
    let buffer_count = s.uint("buffer_count", 5)?;
    let buffer_size = s.uint("buffer_size", 100_000_000)?;
    let c = OffloadParamConfig {
        device,
        nvme_path,
        buffer_count: positive(&s, "buffer_count", buffer_count)?,
        buffer_size: positive(&s, "buffer_size", buffer_size)?,
        max_in_cpu: s.uint("max_in_cpu", 1_000_000_000)?,
        pin_memory: s.bool("pin_memory", true)?,
    };
    s.finish()?;
    Ok(c)
}
