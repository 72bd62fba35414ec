//! `checkpoint` (how checkpoints are tagged and loaded) and `activation_checkpointing` (recompute in backward).
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::Section;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
/// `checkpoint.tag_validation`: what to do when ranks save under different tags.
pub enum TagValidation {
    /// Do not compare.
    Ignore,
    /// Warn and save under rank 0's tag.
    Warn,
    /// Fail on every rank before anything is written.
    Fail,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
/// The `checkpoint` section.
pub struct CheckpointConfig {
    /// What to do when ranks save under different tags.
    pub tag_validation: TagValidation,
    /// `load_universal` (noticed: every checkpoint reshards).
    pub load_universal: bool,
    /// `use_node_local_storage` (noticed).
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
/// The `activation_checkpointing` section: DeepSpeed's checkpointing API; every key is noticed.
pub struct ActivationCheckpointingConfig {
    /// These keys configure DeepSpeed's activation checkpointing API; zerorun accepts them with a notice.
    pub partition_activations: bool,
    /// `contiguous_memory_optimization`.
    pub contiguous_memory_optimization: bool,
    /// `cpu_checkpointing`.
    pub cpu_checkpointing: bool,
    /// `number_checkpoints`.
    pub number_checkpoints: Option<u64>,
    /// `synchronize_checkpoint_boundary`.
    pub synchronize_checkpoint_boundary: bool,
    /// `profile`.
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
