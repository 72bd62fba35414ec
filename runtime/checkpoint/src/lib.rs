//! Checkpoint format: one safetensors file per rank with the fp32 values it optimizes (its master range) and the
//! optimizer state of that range, and a JSON manifest saying which flat element range lives in which file. The
//! flat index space is the engine's layout (parameters in name order), the same at every world size and stage,
//! so a checkpoint loads at any world size or stage 0-2 by reading overlaps of ranges.
//!
//! Writes are atomic: files go to a temporary name, are fsynced and renamed; the tag's folder is assembled under
//! a temporary name and renamed into place last, and `latest` is replaced only after that. A crash at any point
//! leaves the previous checkpoint and `latest` as they were.
#![warn(missing_docs)]
pub mod files;
pub mod hf;
pub mod manifest;
mod region;
mod saved;

pub use manifest::{region_of, Manifest, ParamEntry, RankEntry, Slice, VariableEntry, FORMAT_VERSION};
pub use region::read_region;
pub use saved::{SavedCheckpoint, VariableFiles};

use std::path::{Path, PathBuf};

/// Checkpoint failures, each naming the file (and offset) at fault.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {what}")]
    /// A file could not be read or written.
    Io {
        /// The file.
        path: PathBuf,
        /// The system's error.
        what: String,
    },
    #[error("{path}: checksum mismatch (manifest {expected:08x}, file {actual:08x}): the file is damaged")]
    /// A file's CRC differs from the manifest's: it changed after it was written.
    Checksum {
        /// The file.
        path: PathBuf,
        /// The manifest's CRC-32.
        expected: u32,
        /// The file's.
        actual: u32,
    },
    #[error("{path}: format version {found} is newer than this zerorun reads ({supported})")]
    /// Written by a newer zerorun.
    NewerFormat {
        /// The manifest.
        path: PathBuf,
        /// Its format version.
        found: u32,
        /// The newest this build reads.
        supported: u32,
    },
    #[error("{path}: the checkpoint does not match the model: {what}")]
    /// The checkpoint's names or shapes are not the model's.
    Mismatch {
        /// The manifest.
        path: PathBuf,
        /// The first difference.
        what: String,
    },
    #[error("{path}: no checkpoint here ({what})")]
    /// No checkpoint at the path (no `latest`, no such tag).
    Missing {
        /// What was looked for.
        path: PathBuf,
        /// The system's error.
        what: String,
    },
}

/// This crate's results.
pub type Result<T> = std::result::Result<T, CheckpointError>;

pub(crate) fn io_err(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io { path: path.to_path_buf(), what: e.to_string() }
}

/// The tag `latest` names in `dir`.
pub fn latest_tag(dir: &Path) -> Result<String> {
    let p = dir.join("latest");
    let tag =
        std::fs::read_to_string(&p).map_err(|e| CheckpointError::Missing { path: p.clone(), what: e.to_string() })?;
    Ok(tag.trim().to_string())
}
