//! What the engine measures for the memory report and the wall-clock breakdown. The engine's methods that read
//! it (memory by category, sampling after every optimizer step, printing every `steps_per_print`, the files at
//! the end of the run) are the facade's, in `engine/mod.rs`: they walk every part.
use std::path::PathBuf;

pub use crate::comm::env::MEMORY_REPORT_ENV;

/// What [`Engine::finish_memory_report`](crate::engine::Engine::finish_memory_report) wrote (rank 0 also drew the picture and made the table).
#[derive(Debug, Clone)]
pub struct MemoryReportFiles {
    /// This rank's report.
    pub json: PathBuf,
    /// Rank 0: the table of every rank and the pictures.
    pub table: Option<String>,
    /// Rank 0: the per-step picture (SVG).
    pub svg: Option<PathBuf>,
    /// Rank 0: the same as PNG.
    pub png: Option<PathBuf>,
}

/// What the engine measures for its reports.
#[derive(Default)]
pub(crate) struct Reporting {
    /// Resident memory when the engine's set-up began, less the model's variables: the process floor the memory
    /// report names.
    pub floor_rss_bytes: u64,
    /// The process's peak resident memory when set-up ended.
    pub init_peak_rss_bytes: u64,
    /// Whether the engine samples memory at its events (a report is asked for; see `memory_event`).
    pub sample_events: bool,
    pub memory: crate::report::memory::MemoryTracker,
    pub times: crate::report::PhaseTimes,
    pub comm_volume: crate::engine::CommVolume,
}
