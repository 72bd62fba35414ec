//! `checkpoint` (how checkpoints are tagged and loaded) and `activation_checkpointing` (recompute in backward).
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::Section;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum TagValidation {
    Ignore,
    Warn,
    Fail,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckpointConfig {
    /// What to do when ranks save under different tags.
    pub tag_validation: TagValidation,
    pub load_universal: bool,
    pub use_node_local_storage: bool,
    /// zerorun's: a save copies its data into host memory and writes the files on a thread of each rank while
    /// training goes on; published (and `latest` moved) only once every file is written.
    pub async_save: bool,
}

impl CheckpointConfig {
    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let tag_validation = match s.choice("tag_validation", &["Ignore", "Warn", "Fail"], "Warn")? {
            "Ignore" => TagValidation::Ignore,
            "Fail" => TagValidation::Fail,
            _ => TagValidation::Warn,
        };
        let c = CheckpointConfig {
            tag_validation,
            load_universal: s.bool("load_universal", false)?,
            use_node_local_storage: s.bool("use_node_local_storage", false)?,
            async_save: s.bool("async_save", false)?,
        };
        // Noticed (notices.rs): pipeline-parallel checkpoint writes.
        let _ = s.ignore("parallel_write");
        s.finish()?;
        Ok(c)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActivationCheckpointingConfig {
    /// These keys configure DeepSpeed's activation checkpointing API; zerorun accepts them with a notice.
    pub partition_activations: bool,
    pub contiguous_memory_optimization: bool,
    pub cpu_checkpointing: bool,
    pub number_checkpoints: Option<u64>,
    pub synchronize_checkpoint_boundary: bool,
    pub profile: bool,
}

impl ActivationCheckpointingConfig {
    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let c = ActivationCheckpointingConfig {
            partition_activations: s.bool("partition_activations", false)?,
            contiguous_memory_optimization: s.bool("contiguous_memory_optimization", false)?,
            cpu_checkpointing: s.bool("cpu_checkpointing", false)?,
            number_checkpoints: s.opt_uint("number_checkpoints")?,
            synchronize_checkpoint_boundary: s.bool("synchronize_checkpoint_boundary", false)?,
            profile: s.bool("profile", false)?,
        };
        if c.cpu_checkpointing && !c.partition_activations {
            return Err(ConfigError::Conflict {
                path: s.path_of("cpu_checkpointing"),
                message: "requires `activation_checkpointing.partition_activations` (as in DeepSpeed)".into(),
            });
        }
        s.finish()?;
        Ok(c)
    }
}
