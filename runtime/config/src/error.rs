//! Typed configuration errors. Every variant names the JSON path of the key at fault.
use thiserror::Error;

/// An error in a ds_config: what is wrong, where (the JSON path), and what would be accepted.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ConfigError {
    #[error("cannot read config file {file}: {message}")]
    /// The config file could not be read.
    Read {
        /// The file.
        file: String,
        /// The system's error.
        message: String,
    },

    #[error("config is not valid JSON: {message}")]
    /// The text is not JSON.
    Json {
        /// serde_json's error, with line and column.
        message: String,
    },

    #[error("`{path}`: expected {expected}, got {got}")]
    /// A key holds the wrong type.
    Type {
        /// The key's JSON path.
        path: String,
        /// What it takes.
        expected: &'static str,
        /// What it holds.
        got: String,
    },

    #[error("`{path}`: {value} is not allowed: {allowed}")]
    /// A key's value is outside what is allowed.
    Invalid {
        /// The key's JSON path.
        path: String,
        /// The value.
        value: String,
        /// What is allowed.
        allowed: String,
    },

    #[error("unknown key `{path}`{hint}")]
    /// A key neither DeepSpeed nor zerorun knows.
    UnknownKey {
        /// The key's JSON path.
        path: String,
        /// The closest known key, or the keys known there.
        hint: String,
    },

    #[error("`{path}` is \"auto\", but {why}; give a value")]
    /// "auto" where zerorun cannot resolve it.
    Auto {
        /// The key's JSON path.
        path: String,
        /// Why it cannot.
        why: &'static str,
    },

    #[error("`{path}` is required {when}")]
    /// A key required by another's value.
    Missing {
        /// The key's JSON path.
        path: String,
        /// The value that requires it.
        when: String,
    },

    #[error(
        "`{first}` and `{second}` are the same key under two names and disagree ({first_value} vs {second_value})"
    )]
    /// A key given under two names with different values.
    Alias {
        /// One name's JSON path.
        first: String,
        /// The other's.
        second: String,
        /// The first's value.
        first_value: String,
        /// The second's.
        second_value: String,
    },

    #[error("`{path}`: {message}")]
    /// Keys whose values cannot go together.
    Conflict {
        /// The key's JSON path.
        path: String,
        /// What conflicts and what to change.
        message: String,
    },

    #[error("batch sizes: {message}: train_batch_size {train}, train_micro_batch_size_per_gpu {micro}, gradient_accumulation_steps {gas}, world_size {world_size}")]
    /// The batch rule does not hold.
    Batch {
        /// What is wrong.
        message: &'static str,
        /// `train_batch_size`.
        train: u64,
        /// `train_micro_batch_size_per_gpu`.
        micro: u64,
        /// `gradient_accumulation_steps`.
        gas: u64,
        /// Data-parallel ranks.
        world_size: u64,
    },

    #[error("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")]
    /// No batch size given at all.
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

/// This crate's results.
pub type Result<T> = std::result::Result<T, ConfigError>;
