//! zerorun: a ZeRO-style memory-sharding training runtime for tch (libtorch) training loops.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tch::nn;
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! // ... build the model on vs.root() ...
//! let config = zerorun::Config::from_file("configs/zero2.json")?;
//! let comm = zerorun::runtime::comm::threads::group(1, std::time::Duration::from_secs(60)).pop().unwrap();
//! let mut engine = zerorun::initialize(&vs, config, Box::new(comm))?;
//! // for each micro-batch: engine.backward(&loss)?; engine.step()?;
//! # Ok(()) }
//! ```
pub use zerorun_offload as offload;
pub use zerorun_optim as optim;
pub use zerorun_runtime as runtime;
pub use zerorun_runtime::config::{self, Config, ConfigError};
pub use zerorun_runtime::estimate::{estimate, EstimateInput, EstimateRow};
pub use zerorun_runtime::engine::{Sequence, UnitModel, Whole};
pub use zerorun_runtime::{initialize, BufferSync, Engine, EngineOptions, Error, SaveOptions, StepOutcome};

/// Shows zerorun's logs on stderr, as a training program (or the CLI) should install them: warnings by default
/// (ignored config keys, slow settings, skipped fp16 steps), more with `RUST_LOG`; colours only on a terminal, not
/// into the pipes of `zerorun launch`. The library itself only logs through `tracing` and never prints; call this
/// once at the start of `main`, or install your own subscriber instead.
pub fn init_logging() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_target(false)
        .init();
}
