//! Pipeline parallelism: a model's layers cut into stages on different ranks, each batch cut into micro-batches
//! that flow through them (GPipe, 1F1B), every stage trained by a ZeRO engine (stages 0-2) over its data-parallel
//! group.
//!
//! - [`schedule`]: the schedules as data, each stage's actions for one optimizer step, proven by simulation.
//! - [`partition`]: which layers each stage holds.
//! - [`model`]: the model as layer builders, so each rank builds only its stage's layers.
//! - [`placement`]: where this rank sits in (pipe, data).
//! - [`link`]: activations and their gradients between neighbouring stages.
//! - [`engine`]: [`PipelineEngine`], which runs a schedule.
//! - `checkpoint.rs`: its checkpoints, one manifest over every stage, by parameter name.
//! - [`bubble`]: its measured idle fraction on stages of known cost (`zerorun bench pipeline`).
pub mod bubble;
mod checkpoint;
pub mod engine;
pub mod link;
pub mod model;
pub mod partition;
pub mod placement;
pub use zerorun_schedule as schedule;

pub use engine::{MicroBatch, PipelineEngine};
pub use model::{LayerForward, LossFn, PipelineModel, StageModel};
pub use placement::StagePlacement;

/// What makes a pipeline impossible to set up or run.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    /// The schedule cannot run.
    Schedule(#[from] schedule::ScheduleError),
    #[error(transparent)]
    /// The layers cannot be cut into the stages.
    Partition(#[from] partition::PartitionError),
    #[error("pipeline: {0}")]
    /// The ranks cannot be laid out as stages.
    Placement(String),
    #[error("pipeline model: {0}")]
    /// The model is wrong for a pipeline (a tied weight asked for before it is made, say).
    Model(String),
}
