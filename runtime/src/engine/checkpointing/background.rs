//! Asynchronous checkpoints (`checkpoint.async_save`): the step that saves copies what it must into host memory
//! and returns; a thread of this rank writes the files. The ranks do not meet again for it: each writer leaves its
//! rank file's checksum beside it in the staging folder, and rank 0's writer, once every expected checksum is
//! there, completes the manifest and publishes the checkpoint as a synchronous save does (the staging folder
//! renamed into place, then `latest`). A crash before that leaves the previous checkpoint as `latest`.
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::checkpoint::{files, CheckpointError, Manifest};
use crate::error::{Error, Result};

/// A file to write, with its contents already copied out of the engine.
pub(crate) enum Write {
    /// A rank file: tensors (name, shape) of f32: the values, then the optimizer states' bytes.
    RankFile { file: PathBuf, tensors: Vec<(String, Vec<usize>)>, values: Vec<f32>, states: Vec<Vec<u8>> },
    /// The model's tensors by name (rank 0).
    Tensors { file: PathBuf, tensors: Vec<(String, tch::Tensor)> },
}

/// What rank 0's writer publishes once every rank file is written.
pub(crate) struct Publication {
    pub dir: PathBuf,
    pub tag: String,
    pub manifest: Manifest,
    /// How long to wait for the other ranks' files (the config's `comms_timeout`).
    pub timeout: Duration,
}

/// The checksum file a writer leaves for rank file `file_name`.
fn checksum_path(staging: &Path, file_name: &str) -> PathBuf {
    staging.join(format!(".{file_name}.crc32"))
}

/// Writes `writes` into `staging`, then (rank 0) publishes. Runs on the writer thread.
fn write_all(staging: &Path, writes: Vec<Write>, publication: Option<Publication>) -> Result<String> {
    for write in writes {
        match write {
            Write::RankFile { file, tensors, values, states } => {
                let crc = files::write_safetensors(&file, &tensors, "F32", |i, w| match i {
                    0 => files::write_f32(w, &values),
                    _ => w.write_all(&states[i - 1]),
                })?;
                let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                files::write_atomic(&checksum_path(staging, &name), crc.to_string().as_bytes())?;
            }
            Write::Tensors { file, tensors } => {
                tch::Tensor::write_safetensors(&tensors, &file)
                    .map_err(|e| CheckpointError::Io { path: file.clone(), what: e.to_string() })?;
            }
        }
    }
    let Some(Publication { dir, tag, mut manifest, timeout }) = publication else { return Ok(String::new()) };
    let started = Instant::now();
    for entry in &mut manifest.ranks {
        let path = checksum_path(staging, &entry.file);
        let text = loop {
            match std::fs::read_to_string(&path) {
                Ok(text) => break text,
                Err(_) if started.elapsed() < timeout => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => {
                    return Err(CheckpointError::Io {
                        path,
                        what: format!(
                        "{e}: the rank writing {} did not finish within {timeout:?}; the checkpoint was not published",
                        entry.file
                    ),
                    }
                    .into())
                }
            }
        };
        entry.crc32 = text
            .trim()
            .parse()
            .map_err(|_| CheckpointError::Io { path: path.clone(), what: format!("not a checksum: {text:?}") })?;
        let _ = std::fs::remove_file(&path);
    }
    super::save::publish(&dir, staging, &tag, &manifest)?;
    tracing::info!(tag, "asynchronous checkpoint published");
    Ok(tag)
}

/// The save in flight on this rank, if any.
#[derive(Default)]
pub(crate) struct InFlight(Option<JoinHandle<Result<String>>>);

impl InFlight {
    /// Starts writing `writes` into `staging` on a thread (rank 0 with the `publication`).
    pub fn start(&mut self, staging: PathBuf, writes: Vec<Write>, publication: Option<Publication>) -> Result<()> {
        let thread = std::thread::Builder::new()
            .name("zerorun-checkpoint".into())
            .spawn(move || write_all(&staging, writes, publication))
            .map_err(|e| Error::Io { path: PathBuf::new(), what: format!("starting the checkpoint writer: {e}") })?;
        self.0 = Some(thread);
        Ok(())
    }

    pub fn is_busy(&self) -> bool {
        self.0.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Waits for the save in flight; its error, if it failed.
    pub fn wait(&mut self) -> Result<()> {
        match self.0.take().map(JoinHandle::join) {
            None | Some(Ok(Ok(_))) => Ok(()),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) => Err(Error::Io { path: PathBuf::new(), what: "the checkpoint writer panicked".into() }),
        }
    }
}
