//! zerorun-runtime: everything that knows about ranks and tensors. Its tensor-free parts are crates of their own,
//! re-exported here under their old names, so commands that touch no tensor link no libtorch: `config` (with
//! `estimate`), `comm` and `checkpoint` (the format).
//!
//! - [`config`]: ds_config.json, parsed and validated.
//! - [`comm`]: collectives behind one trait (threads, shm, MPI, NCCL backends; a communication thread).
//! - [`cuda`]: libtorch's CUDA backend, loaded on demand.
//! - [`gloo`]: the backend across hosts (libtorch's TCPStore and ProcessGroupGloo), and the communicator factory
//!   that knows it.
//! - [`engine`]: the ZeRO engine (stages 0-3, offload) over a tch `VarStore`.
//! - [`pipeline`]: pipeline parallelism: the partition, the stages' links, and the engine that runs a schedule over
//!   a ZeRO engine per stage.
//! - [`tensor_parallel`]: Megatron-LM's tensor-parallel layers and the regions between split and whole.
//! - [`checkpoint`]: the sharded checkpoint format.
//! - [`estimate`]: model-state memory per stage and offload option, before a run.
//! - [`report`]: the measured memory report, its picture, and the wall-clock breakdown.
pub use zerorun_checkpoint as checkpoint;
pub use zerorun_comm as comm;
pub use zerorun_config as config;
pub use zerorun_config::estimate;
pub mod cuda;
pub mod engine;
mod error;
pub mod gloo;
pub mod pipeline;
pub mod report;
pub mod tensor_parallel;

pub use config::{Config, ConfigError};
pub use engine::{BufferSync, BuiltModel, Engine, EngineOptions, SaveOptions, StepOutcome, UnitBuilders};
pub use error::{Error, Result};

/// Builds the engine for `vs` from `config`, on the communicator the environment names (`zerorun launch`'s or
/// mpirun's variables; one rank without them), whose collectives time out after `comms_timeout`.
pub fn initialize(vs: &tch::nn::VarStore, config: Config) -> Result<Engine> {
    let comm = gloo::communicator_from_env(std::time::Duration::from_secs_f64(config.comms_timeout))?;
    Engine::new(vs, config, comm, EngineOptions::default())
}

/// [`initialize`] with a communicator of the program's own (thread ranks, a sub-group) and options set in code.
pub fn initialize_with(
    vs: &tch::nn::VarStore,
    config: Config,
    comm: Box<dyn comm::Communicator>,
    options: EngineOptions,
) -> Result<Engine> {
    Engine::new(vs, config, comm, options)
}
