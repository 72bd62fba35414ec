//! zerorun: a ZeRO-style memory-sharding training runtime for tch (libtorch) training loops.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tch::nn;
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! // ... build the model on vs.root() ...
//! let config = zerorun::Config::from_file("configs/zero2.json")?;
//! // The communicator comes from the environment `zerorun launch` sets (one rank without it).
//! let mut engine = zerorun::initialize(&vs, config)?;
//! // for each micro-batch: engine.backward(&loss)?; engine.step()?;
//! # Ok(()) }
//! ```
//!
//! A model split by tensor-parallel layers is built on the mesh's group first; the engine reads where the layers
//! split their parameters from the mesh:
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tch::nn;
//! use zerorun::runtime::tensor_parallel::{ColumnParallelLinear, RowParallelLinear};
//! let config = zerorun::Config::from_file("configs/zero1.json")?;
//! let mesh = zerorun::Mesh::from_env(&config, zerorun::MeshOptions { tensor_parallel: Some(2), ..Default::default() })?;
//! let tp = mesh.tensor_parallel()?;
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let up = ColumnParallelLinear::new(&(vs.root() / "up"), &tp, 16, 64, true, false);
//! let down = RowParallelLinear::new(&(vs.root() / "down"), &tp, 64, 16, true, true);
//! let mut engine = zerorun::initialize_with(&vs, config, mesh, Default::default())?;
//! # let _ = (up, down, &mut engine);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]
pub use zerorun_offload as offload;
pub use zerorun_optim as optim;
pub use zerorun_runtime as runtime;
pub use zerorun_runtime::config::{self, Config, ConfigError};
pub use zerorun_runtime::cuda;
pub use zerorun_runtime::cuda::local_device;
pub use zerorun_runtime::engine::generator_lock;
pub use zerorun_runtime::engine::no_decay_for_1d;
pub use zerorun_runtime::engine::{measure_peak_flops, StepRates, Throughput};
pub use zerorun_runtime::engine::{
    BuiltModel, NestedUnits, Sequence, UnitBuilders, UnitForward, UnitModel, UnitOutput, Whole,
};
pub use zerorun_runtime::estimate::{estimate, EstimateInput, EstimateRow};
pub use zerorun_runtime::gloo::communicator_from_env;
pub use zerorun_runtime::mesh::{Dim, Mesh, MeshOptions, MeshShape};
pub use zerorun_runtime::pipeline::{
    LayerForward, MicroBatch, PipelineEngine, PipelineModel, StageModel, StagePlacement,
};
pub use zerorun_runtime::tensor_parallel::TensorParallel;
pub use zerorun_runtime::{
    initialize, initialize_pipeline, initialize_with, BufferSync, Engine, EngineOptions, Error, PretrainedOptions,
    Result, SaveOptions, StepOutcome,
};

mod logging;
pub use logging::{init_logging, init_logging_with_default};
