//! Typed configuration errors. Every variant names the JSON path of the key at fault.
use thiserror::Error;

/// An error in a ds_config: what is wrong, where (the JSON path), and what would be accepted.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ConfigError {
    #[error("cannot read config file {file}: {message}")]
    Read { file: String, message: String },

    #[error("config is not valid JSON: {message}")]
    Json { message: String },

    #[error("`{path}`: expected {expected}, got {got}")]
    Type { path: String, expected: &'static str, got: String },

    #[error("`{path}`: {value} is not allowed: {allowed}")]
    Invalid { path: String, value: String, allowed: String },

    #[error("unknown key `{path}`{hint}")]
    UnknownKey { path: String, hint: String },

    #[error("`{path}` is \"auto\", but {why}; give a value")]
    Auto { path: String, why: &'static str },

    #[error("`{path}` is required {when}")]
    Missing { path: String, when: String },

    #[error(
        "`{first}` and `{second}` are the same key under two names and disagree ({first_value} vs {second_value})"
    )]
    Alias { first: String, second: String, first_value: String, second_value: String },

    #[error("`{path}`: {message}")]
    Conflict { path: String, message: String },

    #[error("batch sizes: {message}: train_batch_size {train}, train_micro_batch_size_per_gpu {micro}, gradient_accumulation_steps {gas}, world_size {world_size}")]
    Batch { message: &'static str, train: u64, micro: u64, gas: u64, world_size: u64 },

    #[error("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")]
    BatchMissing,
}

impl ConfigError {
    /// The JSON path this error is about, when it is about one key.
    pub fn path(&self) -> Option<&str> {
        match self {
            ConfigError::Type { path, .. }
            | ConfigError::Invalid { path, .. }
            | ConfigError::UnknownKey { path, .. }
            | ConfigError::Auto { path, .. }
            | ConfigError::Missing { path, .. }
            | ConfigError::Conflict { path, .. } => Some(path),
            ConfigError::Alias { first, .. } => Some(first),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, ConfigError>;
