//! Errors of the offload tiers, each naming the file (and offset) at fault.
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OffloadError {
    /// A read or write failed (ENOSPC, EIO, a removed file, a short read).
    #[error("{path} at offset {offset}: {what}")]
    Io { path: PathBuf, offset: u64, what: String },
    /// The swap folder cannot take the swap files; found before the first step.
    #[error("nvme_path {path}: {what}")]
    Preflight { path: PathBuf, what: String },
    #[error("swap key `{key}`: {what}")]
    Key { key: String, what: String },
    #[error("the offload I/O thread ended before finishing `{op}` of `{key}`")]
    WorkerGone { op: &'static str, key: String },
}

pub type Result<T> = std::result::Result<T, OffloadError>;
