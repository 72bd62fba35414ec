//! `pipeline`: pipeline parallelism (DeepSpeed's section, whose `stages` and `partition` DeepSpeed parses and then
//! ignores; here they decide the stages and the cut), plus zerorun's schedule keys.
use serde::Serialize;
use serde_json::Value;

use super::error::{ConfigError, Result};
use super::reader::{MaybeAuto, Section};

/// How the layers are cut into stages. Written back as ds_config spells it (`"parameters"`, `"type:REGEX"`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Partition {
    /// Balance trainable parameter counts (DeepSpeed's `parameters`; its default `best` means the same here).
    Parameters,
    /// The same number of layers per stage.
    Uniform,
    /// Balance the layers whose name matches the regular expression (`type:REGEX`).
    Type(String),
    /// Stage `s` holds layers `bounds[s]..bounds[s + 1]`: `stages + 1` increasing indices from 0 to the layer count.
    Bounds(Vec<usize>),
}

impl Serialize for Partition {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Partition::Parameters => s.serialize_str("parameters"),
            Partition::Uniform => s.serialize_str("uniform"),
            Partition::Type(re) => s.serialize_str(&format!("type:{re}")),
            Partition::Bounds(b) => b.serialize(s),
        }
    }
}

/// Which schedule runs a step's micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ScheduleName {
    /// One forward, one backward, after a warm-up of `stages - stage - 1` forwards: activations bounded by depth.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Every forward, then every backward: `m` activations held.
    #[serde(rename = "gpipe")]
    GPipe,
    /// Interleaved 1F1B: each rank holds `virtual_stages` chunks of layers; the bubble shrinks by about that factor.
    #[serde(rename = "interleaved")]
    Interleaved,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
/// The `pipeline` section: pipeline parallelism's stages, partition and schedule.
pub struct PipelineConfig {
    /// None: `"auto"` or absent, the program's number of stages (1 without one).
    pub stages: Option<u64>,
    /// How layers are cut into stages.
    pub partition: Partition,
    /// The schedule.
    pub schedule: ScheduleName,
    /// Chunks of layers per rank under the interleaved schedule (Megatron-LM's virtual pipeline size); 1 otherwise.
    pub virtual_stages: u64,
    /// Fewer micro-batches than stages leaves most stages idle; refused unless this is set.
    pub allow_fewer_micro_batches: bool,
    /// `seed_layers` (noticed).
    pub seed_layers: bool,
    /// `activation_checkpoint_interval` (noticed).
    pub activation_checkpoint_interval: u64,
    /// `pipe_partitioned` (noticed when false).
    pub pipe_partitioned: bool,
    /// `grad_partitioned` (noticed when false).
    pub grad_partitioned: bool,
    /// `use_reentrant` (noticed when false).
    pub use_reentrant: bool,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            stages: None,
            partition: Partition::Parameters,
            schedule: ScheduleName::OneFOneB,
            virtual_stages: 1,
            allow_fewer_micro_batches: false,
            seed_layers: false,
            activation_checkpoint_interval: 0,
            pipe_partitioned: true,
            grad_partitioned: true,
            use_reentrant: true,
        }
    }
}

impl PipelineConfig {
    /// Chunks of layers per rank: `virtual_stages` under the interleaved schedule, else 1.
    pub fn chunks(&self) -> usize {
        self.virtual_stages as usize
    }

    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let stages = match s.uint_auto(&["stages"])? {
            MaybeAuto::Value(0) => {
                return Err(ConfigError::Invalid {
                    path: s.path_of("stages"),
                    value: "0".into(),
                    allowed: "at least 1, or \"auto\"".into(),
                })
            }
            MaybeAuto::Value(v) => Some(v),
            MaybeAuto::Absent | MaybeAuto::Auto => None,
        };
        let partition = match s.take("partition") {
            None => Partition::Parameters,
            Some(v) => read_partition(&s.path_of("partition"), v)?,
        };
        let schedule = match s.choice("schedule", &["1f1b", "gpipe", "interleaved"], "1f1b")? {
            "gpipe" => ScheduleName::GPipe,
            "interleaved" => ScheduleName::Interleaved,
            _ => ScheduleName::OneFOneB,
        };
        let virtual_stages = s.uint("virtual_stages", if schedule == ScheduleName::Interleaved { 2 } else { 1 })?;
        let wants = if schedule == ScheduleName::Interleaved {
            "at least 2 with \"schedule\": \"interleaved\""
        } else {
            "1 unless \"schedule\" is \"interleaved\""
        };
        if (schedule == ScheduleName::Interleaved) != (virtual_stages >= 2) || virtual_stages == 0 {
            return Err(ConfigError::Invalid {
                path: s.path_of("virtual_stages"),
                value: virtual_stages.to_string(),
                allowed: wants.into(),
            });
        }
        let c = PipelineConfig {
            stages,
            partition,
            schedule,
            virtual_stages,
            allow_fewer_micro_batches: s.bool("allow_fewer_micro_batches", false)?,
            seed_layers: s.bool("seed_layers", false)?,
            activation_checkpoint_interval: s.uint("activation_checkpoint_interval", 0)?,
            pipe_partitioned: s.bool("pipe_partitioned", true)?,
            grad_partitioned: s.bool("grad_partitioned", true)?,
            use_reentrant: s.bool("use_reentrant", true)?,
        };
        s.finish()?;
        Ok(c)
    }
}

fn read_partition(path: &str, v: Value) -> Result<Partition> {
    let invalid = |value: String| {
        ConfigError::Invalid {
        path: path.into(),
        value,
        allowed: "\"parameters\" (or \"best\"), \"uniform\", \"type:REGEX\", or the stage boundaries as an array of layer indices starting at 0".into(),
    }
    };
    match v {
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "parameters" | "best" => Ok(Partition::Parameters),
            "uniform" => Ok(Partition::Uniform),
            _ => match s.strip_prefix("type:") {
                Some(re) if !re.is_empty() => Ok(Partition::Type(re.to_string())),
                _ => Err(invalid(format!("\"{s}\""))),
            },
        },
        Value::Array(items) => {
            let bounds: Option<Vec<usize>> = items.iter().map(|i| i.as_u64().map(|b| b as usize)).collect();
            match bounds {
                Some(b) if b.len() >= 2 && b[0] == 0 && b.windows(2).all(|w| w[0] < w[1]) => Ok(Partition::Bounds(b)),
                _ => Err(invalid(Value::Array(items).to_string())),
            }
        }
        other => Err(invalid(other.to_string())),
    }
}
