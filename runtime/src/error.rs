//! The runtime's error type: every failure a training step can meet, typed, with what the user needs to act.
use crate::comm::CommError;
use crate::config::ConfigError;

#[derive(Debug, thiserror::Error)]
/// Every failure of the engine, typed; the message names what the user can act on.
pub enum Error {
    #[error(transparent)]
    /// A config key is wrong.
    Config(#[from] ConfigError),
    #[error(transparent)]
    /// A collective failed (a rank died, timed out, or disagreed).
    Comm(#[from] CommError),
    #[error(transparent)]
    /// The optimizer failed.
    Optim(#[from] zerorun_optim::OptimError),
    #[error(transparent)]
    /// A checkpoint could not be saved or loaded.
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    /// NVMe offload failed.
    Offload(#[from] zerorun_offload::OffloadError),
    #[error(transparent)]
    /// A memory report could not be written.
    Report(#[from] zerorun_report::ReportError),
    #[error(transparent)]
    /// An offloaded optimizer failed.
    OptimizerTier(#[from] zerorun_offload::TierError),
    #[error(transparent)]
    /// A pipeline cannot be set up or run.
    Pipeline(#[from] crate::pipeline::PipelineError),
    #[error("libtorch: {0}")]
    /// libtorch raised an error.
    Torch(#[from] tch::TchError),
    /// A setting this build of the engine does not run yet; names the key.
    #[error("`{key}` = {value}: {why}")]
    Unsupported {
        /// The config key.
        key: &'static str,
        /// Its value.
        value: String,
        /// Why, and what would work.
        why: &'static str,
    },
    /// The model handed to the engine cannot be sharded as it is.
    #[error("parameter `{name}`: {why}")]
    Parameter {
        /// The parameter.
        name: String,
        /// What is wrong.
        why: String,
    },
    #[error("{0}")]
    /// A call the engine cannot honour in its state (a second backward before `step`, say); the message says which.
    Usage(String),
    /// A file the engine writes or reads outside a checkpoint (a 16-bit model): which, and what failed.
    #[error("{}: {what}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The system's error.
        what: String,
    },
    /// libtorch's CUDA backend could not be loaded; names the library.
    #[error("CUDA: {}: {why}", library.display())]
    Cuda {
        /// The library.
        library: std::path::PathBuf,
        /// Why it did not load.
        why: String,
    },
    /// Fault tolerance could not go on: no quorum of replica groups, or this rank's group was left out of one.
    #[error("fault tolerance, replica group {group}: {why}")]
    Quorum {
        /// This rank's replica group.
        group: usize,
        /// What happened.
        why: String,
    },
}

/// The runtime's results.
pub type Result<T> = std::result::Result<T, Error>;
