//! What zerorun tells the user about a run's memory, tensor-free so the CLI reads and draws it without libtorch:
//! the per-rank report (`memory.rs`: categories sampled every optimizer step and at events, the peak and its
//! breakdown), its table (`table.rs`), what would lower its peak (`advice.rs`, from its own numbers) and its pictures
//! (`plot.rs`: one run per rank, or several runs side by side); line charts of several runs' curves (`curves.rs`).
#![warn(missing_docs)]
pub mod advice;
pub mod curves;
pub mod html;
pub mod memory;
pub mod plot;
pub mod rss;
pub mod table;

use std::path::PathBuf;

/// A report that could not be written, read or drawn: the file and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{}: {what}", path.display())]
    /// A report could not be read or written.
    Io {
        /// The file.
        path: PathBuf,
        /// The system's error.
        what: String,
    },
    /// A file that is not a zerorun memory report of this schema.
    #[error("{}: {what}", path.display())]
    /// A report file is not what this version writes.
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    #[error("{0}")]
    /// A picture could not be drawn (plotters' error).
    Draw(String),
}

/// This crate's results.
pub type Result<T> = std::result::Result<T, ReportError>;
