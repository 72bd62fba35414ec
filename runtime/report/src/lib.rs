//! What zerorun tells the user about a run's memory, tensor-free so the CLI reads and draws it without libtorch:
//! the per-rank report (`memory.rs`: categories sampled every optimizer step and at events, the peak and its
//! breakdown, the table) and its pictures (`plot.rs`: one run per rank, or several runs side by side); line
//! charts of several runs' curves (`curves.rs`).
pub mod curves;
pub mod memory;
pub mod plot;

use std::path::PathBuf;

/// A report that could not be written, read or drawn: the file and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{}: {what}", path.display())]
    Io { path: PathBuf, what: String },
    /// A file that is not a zerorun memory report of this schema.
    #[error("{}: {what}", path.display())]
    Format { path: PathBuf, what: String },
    #[error("{0}")]
    Draw(String),
}

pub type Result<T> = std::result::Result<T, ReportError>;
