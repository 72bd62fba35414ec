//! zerorun-runtime: everything that knows about ranks and tensors.
//!
//! - [`config`]: ds_config.json, parsed and validated.
pub mod config;

pub use config::{Config, ConfigError};
