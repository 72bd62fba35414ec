//! The runtime's error type: every failure a training step can meet, typed, with what the user needs to act.
use crate::comm::CommError;
use crate::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Optim(#[from] zerorun_optim::OptimError),
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    Offload(#[from] zerorun_offload::OffloadError),
    #[error(transparent)]
    Report(#[from] zerorun_report::ReportError),
    #[error(transparent)]
    OptimizerTier(#[from] zerorun_offload::TierError),
    #[error(transparent)]
    Pipeline(#[from] crate::pipeline::PipelineError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A setting this build of the engine does not run yet; names the key.
    #[error("`{key}` = {value}: {why}")]
    Unsupported { key: &'static str, value: String, why: &'static str },
    /// The model handed to the engine cannot be sharded as it is.
    #[error("parameter `{name}`: {why}")]
    Parameter { name: String, why: String },
    #[error("{0}")]
    Usage(String),
    /// A file the engine writes or reads outside a checkpoint (a 16-bit model): which, and what failed.
    #[error("{}: {what}", path.display())]
    Io { path: std::path::PathBuf, what: String },
    /// libtorch's CUDA backend could not be loaded; names the library.
    #[error("CUDA: {}: {why}", library.display())]
    Cuda { library: std::path::PathBuf, why: String },
}

pub type Result<T> = std::result::Result<T, Error>;
