//! zerorun-runtime: everything that knows about ranks and tensors. Its tensor-free parts are crates of their own,
//! re-exported here under their old names, so commands that touch no tensor link no libtorch: `config` (with
//! `estimate`), `comm` and `checkpoint` (the format).
//!
//! - [`config`]: ds_config.json, parsed and validated.
//! - [`comm`]: collectives behind one trait (threads, shm, MPI, NCCL backends; a communication thread).
//! - [`cuda`]: libtorch's CUDA backend, loaded on demand.
//! - [`gloo`]: the backend across hosts (libtorch's TCPStore and ProcessGroupGloo), and the communicator factory
//!   that knows it.
//! - [`mesh`]: the ranks laid out over named dimensions (pipeline, data replicate and shard, tensor), every
//!   parallelism's groups.
//! - [`engine`]: the ZeRO engine (stages 0-3, offload) over a tch `VarStore`.
//! - [`pipeline`]: pipeline parallelism: the partition, the stages' links, and the engine that runs a schedule over
//!   a ZeRO engine per stage.
//! - [`tensor_parallel`]: Megatron-LM's tensor-parallel layers and the regions between split and whole.
//! - [`checkpoint`]: the sharded checkpoint format.
//! - [`estimate`]: model-state memory per stage and offload option, before a run.
//! - [`report`]: the measured memory report, its picture, and the wall-clock breakdown.
#![warn(missing_docs)]
pub use zerorun_checkpoint as checkpoint;
pub use zerorun_comm as comm;
pub use zerorun_config as config;
pub use zerorun_config::estimate;
pub mod cuda;
pub mod engine;
mod error;
pub mod exchange;
pub mod fault_tolerance;
pub mod gloo;
pub mod mesh;
pub mod moe;
pub mod pipeline;
pub mod report;
pub mod sequence;
pub mod tensor_parallel;

pub use config::{Config, ConfigError};
pub use engine::{
    BufferSync, BuiltModel, Engine, EngineOptions, PretrainedOptions, SaveOptions, StepOutcome, UnitBuilders,
};
pub use error::{Error, Result};
pub use mesh::{Mesh, MeshOptions, MeshShape};

/// Builds the engine for the model on `vs` from `config`, data parallel over the ranks the environment names
/// (`zerorun launch`'s or mpirun's variables; one rank without them), whose collectives time out after
/// `comms_timeout`. A model with units, or one split by tensor-parallel layers, goes through [`initialize_with`];
/// a pipeline through [`initialize_pipeline`].
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tch::nn::{self, Module};
/// use tch::{Device, Kind, Reduction, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let model = nn::linear(vs.root() / "fc", 4, 1, Default::default());
/// let config: zerorun_runtime::Config =
///     r#"{"train_batch_size": 2, "zero_optimization": {"stage": 2}}"#.parse()?;
/// let mut engine = zerorun_runtime::initialize(&vs, config)?; // one rank here; N under `zerorun launch`
/// let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
/// let loss = model.forward(&x).mse_loss(&x.sum_dim_intlist(1, true, Kind::Float), Reduction::Mean);
/// engine.backward(&loss)?;
/// assert!(matches!(engine.step()?, zerorun_runtime::StepOutcome::Stepped { step: 1, .. }));
/// # Ok(()) }
/// ```
pub fn initialize(vs: &tch::nn::VarStore, config: Config) -> Result<Engine> {
    let mesh = Mesh::from_env(&config, MeshOptions::default())?;
    initialize_with(vs, config, mesh, EngineOptions::default())
}

/// [`initialize`] on a mesh of the program's (made from the environment with [`Mesh::from_env`] to build
/// tensor-parallel layers on [`Mesh::tensor_parallel`] first, or over a communicator of its own: thread ranks, a
/// sub-group) with options set in code.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tch::nn;
/// use zerorun_runtime::{EngineOptions, Mesh, MeshOptions};
///
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let _model = nn::linear(vs.root() / "fc", 4, 1, Default::default());
/// let config: zerorun_runtime::Config = r#"{"train_batch_size": 2}"#.parse()?;
/// let mesh = Mesh::from_env(&config, MeshOptions::default())?;
/// // Biases and norm weights (1-D tensors) out of weight decay.
/// let options = EngineOptions { no_weight_decay: Some(zerorun_runtime::engine::no_decay_for_1d), ..Default::default() };
/// let engine = zerorun_runtime::initialize_with(&vs, config, mesh, options)?;
/// assert_eq!(engine.world_size(), 1);
/// # Ok(()) }
/// ```
pub fn initialize_with(
    vs: &tch::nn::VarStore,
    config: Config,
    mesh: impl Into<Mesh>,
    options: EngineOptions,
) -> Result<Engine> {
    let mesh = mesh.into();
    if mesh.shape().pipeline > 1 {
        return Err(Error::Usage(format!(
            "the mesh has {} pipeline stages (pipeline.stages): build the stage's model and run it with zerorun::initialize_pipeline",
            mesh.shape().pipeline
        )));
    }
    Engine::on_mesh(vs, config, mesh, options)
}

/// The pipeline engine for this rank's stage of a pipeline model (`model`, built on `vs` with
/// [`pipeline::PipelineModel::build_stage`] at [`pipeline::StagePlacement::of`] the mesh) on `mesh`.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tch::nn::{self, Module};
/// use tch::{Device, Kind, Tensor};
/// use zerorun_runtime::pipeline::{MicroBatch, PipelineModel, StagePlacement};
/// use zerorun_runtime::{Mesh, MeshOptions};
///
/// let model = PipelineModel::new(|out: &Tensor, target: &Tensor| out.mse_loss(target, tch::Reduction::Mean))
///     .layer("first", |p| {
///         let l = nn::linear(p / "first", 4, 8, Default::default());
///         Box::new(move |x: &Tensor| l.forward(x).relu())
///     })
///     .layer("second", |p| {
///         let l = nn::linear(p / "second", 8, 1, Default::default());
///         Box::new(move |x: &Tensor| l.forward(x))
///     });
/// let config: zerorun_runtime::Config = r#"{"train_batch_size": 4, "gradient_accumulation_steps": 2}"#.parse()?;
/// // Here one rank holds the one stage; `MeshOptions { pipeline_stages: Some(S), .. }` cuts it into S.
/// let mesh = Mesh::from_env(&config, MeshOptions::default())?;
/// let placement = StagePlacement::of(&mesh, &config.pipeline);
/// let vs = nn::VarStore::new(Device::Cpu);
/// let stage = model.build_stage(&vs, &placement, &config.pipeline.partition)?;
/// let mut pipe = zerorun_runtime::initialize_pipeline(&vs, config, mesh, stage, Default::default())?;
/// let mut micro_batches = (0..2).map(|_| MicroBatch {
///     inputs: Some(Tensor::randn([2, 4], (Kind::Float, Device::Cpu))),
///     labels: Some(Tensor::zeros([2, 1], (Kind::Float, Device::Cpu))),
/// });
/// pipe.train_batch(&mut micro_batches)?; // one optimizer step over both micro-batches
/// # Ok(()) }
/// ```
pub fn initialize_pipeline<'a>(
    vs: &tch::nn::VarStore,
    config: Config,
    mesh: Mesh,
    model: pipeline::StageModel<'a>,
    options: EngineOptions,
) -> Result<pipeline::PipelineEngine<'a>> {
    pipeline::PipelineEngine::new(vs, config, mesh, options, model)
}
