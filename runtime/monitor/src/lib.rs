//! zerorun's monitors: the run's scalars as DeepSpeed's monitor writes them (rank 0 only, `(tag, value, step)` with
//! step = samples seen, flushed after every write so a crash loses at most the step being written).
//!
//! - [`tfevents`]: TensorBoard event files (TFRecord framing with masked CRC32C around `Event` protobufs).
//! - [`csv`]: DeepSpeed's `csv_monitor` layout, one file per tag.
//! - [`Monitor`]: the monitors a config enables, fed one step's events at a time.
#![warn(missing_docs)]
pub mod csv;
pub mod tfevents;

use std::path::{Path, PathBuf};

use zerorun_config::MonitorConfig;

/// A scalar as DeepSpeed's monitors take it: `(tag, value, step)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The tag, e.g. `Train/Samples/train_loss`.
    pub tag: String,
    /// The value.
    pub value: f64,
    /// The step: samples seen (DeepSpeed's `global_samples`).
    pub step: u64,
}

impl Event {
    /// An event.
    pub fn new(tag: impl Into<String>, value: f64, step: u64) -> Event {
        Event { tag: tag.into(), value, step }
    }
}

/// A monitor's file could not be written.
#[derive(Debug, thiserror::Error)]
#[error("monitor file {}: {message}", path.display())]
pub struct MonitorError {
    /// The file or folder.
    pub path: PathBuf,
    /// What failed.
    pub message: String,
}

impl MonitorError {
    pub(crate) fn io(path: &Path, e: std::io::Error) -> MonitorError {
        MonitorError { path: path.to_path_buf(), message: e.to_string() }
    }
}

/// The result of a monitor's write.
pub type Result<T> = std::result::Result<T, MonitorError>;

/// The file monitors a config turns on (DeepSpeed's `MonitorMaster`): built on rank 0 only.
pub struct Monitor {
    tensorboard: Option<tfevents::EventWriter>,
    csv: Option<csv::CsvMonitor>,
}

impl Monitor {
    /// The monitors `config` enables; None when none is. Creates the folders and the event file now, so a bad
    /// `output_path` fails at start-up.
    pub fn from_config(config: &MonitorConfig) -> Result<Option<Monitor>> {
        if !config.writes_scalars() {
            return Ok(None);
        }
        let tensorboard = match config.tensorboard.enabled {
            true => Some(tfevents::EventWriter::create_in(&config.tensorboard.dir())?),
            false => None,
        };
        let csv = match config.csv_monitor.enabled {
            true => Some(csv::CsvMonitor::new(&config.csv_monitor.dir())?),
            false => None,
        };
        Ok(Some(Monitor { tensorboard, csv }))
    }

    /// Writes `events` to every monitor and flushes them.
    pub fn write_events(&mut self, events: &[Event]) -> Result<()> {
        if let Some(tb) = self.tensorboard.as_mut() {
            for e in events {
                tb.write_scalar(&e.tag, e.value as f32, e.step as i64)?;
            }
            tb.flush()?;
        }
        if let Some(csv) = self.csv.as_mut() {
            for e in events {
                csv.write(e)?;
            }
            csv.flush()?;
        }
        Ok(())
    }

    /// The event file being written, if TensorBoard's monitor is on.
    pub fn event_file(&self) -> Option<&Path> {
        self.tensorboard.as_ref().map(tfevents::EventWriter::path)
    }
}
