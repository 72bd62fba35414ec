//! `expert_parallel`: DeepSpeed 0.19's AutoEP block. Its ranks split each mixture-of-experts layer's experts into
//! groups of `autoep_size` adjacent ranks (`moe::ExpertParallel::adjacent`), each computing `experts / autoep_size`
//! of them for every token of the group. DeepSpeed finds Hugging Face MoE blocks by `preset_model` or patterns and
//! swaps its own layers in; in zerorun the model composes `moe::MoeLayer` itself, so the pattern keys have nothing
//! to find and are refused by name.
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::Section;

/// The models DeepSpeed's presets name that zerorun's Llama example reads.
const PRESETS: [&str; 2] = ["mixtral", "qwen3_moe"];

/// The `expert_parallel` section.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct ExpertParallelConfig {
    /// Split the experts over groups of ranks.
    pub enabled: bool,
    /// Ranks per expert-parallel group (E); 1 when not enabled.
    pub autoep_size: u64,
    /// `preset_model`: the model family (`mixtral`, `qwen3_moe`), checked against the model's `model_type`.
    pub preset_model: Option<String>,
}

impl ExpertParallelConfig {
    /// Ranks per expert-parallel group: `autoep_size` when enabled, else 1.
    pub fn size(&self) -> u64 {
        if self.enabled {
            self.autoep_size
        } else {
            1
        }
    }

    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let enabled = s.bool("enabled", false)?;
        let autoep_size = s.uint("autoep_size", 1)?;
        if autoep_size == 0 {
            return Err(ConfigError::Invalid {
                path: s.path_of("autoep_size"),
                value: "0".into(),
                allowed: "at least 1 (ranks per expert-parallel group)".into(),
            });
        }
        let preset_model = s.opt_string("preset_model")?;
        if let Some(p) = &preset_model {
            if !PRESETS.contains(&p.as_str()) {
                return Err(ConfigError::Invalid {
                    path: s.path_of("preset_model"),
                    value: format!("\"{p}\""),
                    allowed: "\"mixtral\" or \"qwen3_moe\" (the mixture-of-experts models zerorun's Llama example reads; DeepSpeed's deepseek and qwen3_5 presets are not built)".into(),
                });
            }
        }
        let etp = s.uint("expert_tensor_parallel_size", 1)?;
        if etp != 1 {
            return Err(ConfigError::Invalid {
                path: s.path_of("expert_tensor_parallel_size"),
                value: etp.to_string(),
                allowed: "1 (as in DeepSpeed: experts are not split by tensor parallelism)".into(),
            });
        }
        // On the CPU every expert's matmuls run one after another; DeepSpeed's grouped GEMM switches change nothing.
        let _ = s.bool("use_grouped_mm", true)?;
        let _ = s.bool("disable_triton_grouped_mm", false)?;
        let c = ExpertParallelConfig { enabled, autoep_size, preset_model };
        s.finish()?;
        Ok(c)
    }
}
