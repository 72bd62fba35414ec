//! Errors of the offload tiers, each naming the file (and offset) at fault.
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
/// What an offload tier could not do, naming the file (and offset) or the swap key at fault.
pub enum OffloadError {
    /// A read or write failed (ENOSPC, EIO, a removed file, a short read).
    #[error("{path} at offset {offset}: {what}")]
    Io {
        /// The swap file.
        path: PathBuf,
        /// The byte offset of the read or write.
        offset: u64,
        /// The system's error.
        what: String,
    },
    /// The swap folder cannot take the swap files; found before the first step.
    #[error("nvme_path {path}: {what}")]
    Preflight {
        /// The swap folder (`nvme_path`).
        path: PathBuf,
        /// Why it cannot take the files (missing, read-only, no O_DIRECT, too small).
        what: String,
    },
    #[error("swap key `{key}`: {what}")]
    /// A swap key used wrongly (swapped in before it was swapped out, or twice at once).
    Key {
        /// The key.
        key: String,
        /// What was wrong.
        what: String,
    },
    #[error("the offload I/O thread ended before finishing `{op}` of `{key}`")]
    /// The I/O thread stopped (it panicked or the swapper was dropped) with a request in flight.
    WorkerGone {
        /// The request (`swap_in`, `swap_out`).
        op: &'static str,
        /// Its key.
        key: String,
    },
}

/// This crate's results.
pub type Result<T> = std::result::Result<T, OffloadError>;
