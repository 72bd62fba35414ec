//! The manifest: what a checkpoint holds and where.
use std::path::Path;

use serde::{Deserialize, Serialize};
use zerorun_optim::LossScalerState;

use super::{files, io_err, CheckpointError, Result};

/// Bumped when the layout of checkpoints changes; a newer version is refused with a clear error.
pub const FORMAT_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<i64>,
    /// Flat element range (in the layout shared by every world size).
    pub start: usize,
    pub len: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankEntry {
    pub file: String,
    /// The flat element range this file holds (`params` and every state buffer cover it).
    pub start: usize,
    pub end: usize,
    pub crc32: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub tag: String,
    pub global_steps: u64,
    pub global_samples: u64,
    pub skipped_steps: u64,
    /// The optimizer's own step count (bias correction).
    pub optimizer_steps: u64,
    pub optimizer: String,
    /// Optimizer state buffers, stored as tensors of these names in every rank file.
    pub state_names: Vec<String>,
    pub scheduler_last_batch_iteration: Option<i64>,
    pub loss_scaler: Option<LossScalerState>,
    pub world_size: usize,
    pub stage: u8,
    pub precision: String,
    /// Real (unpadded) parameter elements.
    pub numel: usize,
    pub params: Vec<ParamEntry>,
    pub ranks: Vec<RankEntry>,
    /// The resolved config of the run that saved it.
    pub config: serde_json::Value,
}

impl Manifest {
    pub fn read(path: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(path).map_err(|e| CheckpointError::Missing { path: path.to_path_buf(), what: e.to_string() })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| io_err(path, format!("not valid JSON: {e}")))?;
        let found = v.get("format_version").and_then(|x| x.as_u64()).unwrap_or(0) as u32;
        if found > FORMAT_VERSION {
            return Err(CheckpointError::NewerFormat { path: path.to_path_buf(), found, supported: FORMAT_VERSION });
        }
        serde_json::from_value(v).map_err(|e| io_err(path, format!("not a zerorun manifest: {e}")))
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        files::write_atomic(path, serde_json::to_string_pretty(self).expect("manifest serializes").as_bytes())
    }
}
