//! The ZeRO engine: wraps a tch `VarStore` so a training loop shards its optimizer states (stage 1), gradients
//! (stage 2) and parameters (stage 3) across the data-parallel ranks of a [`Communicator`].
//!
//! Stages 0-2: parameters are packed into one contiguous buffer of the model's dtype and the model's tensors
//! become views into it (`set_data`); their `.grad` tensors are views of the buffer the reduction runs in. fp32
//! models: the optimizer steps the parameter buffer itself; gradients accumulate in autograd over micro-batches
//! and are reduced once per optimizer step. 16-bit models (bf16, fp16): each rank keeps an fp32 master copy of the
//! part it optimizes; gradients are reduced after every micro-batch and accumulated in fp32 there; the optimizer
//! writes the updated 16-bit parameters in the same pass, and stages 1-2 all-gather them.
//!
//! With the model's units (see [`units`]): stage 3 keeps one buffer per unit, gathered only while the unit runs
//! (`zero/sharded_unit.rs`, `zero/unit_walk.rs`); stage 2 walks the same units in backward and reduces each unit's
//! gradients at once. Stage 2 of a plain loop lays buckets out like units and reduces each when autograd's hooks
//! say its gradients are all written (`zero/grads/hooks.rs`).
//!
//! The Engine is a facade: it keeps what every strategy shares (config, communicator, plan, progress) and one
//! field per part, each part in a folder of its own: [`zero`] (the plan, the layout, where the parameter values
//! live, the units and stage 3's walk; `zero/grads/` reduces, `zero/optim/` steps this rank's values with states
//! in memory or on NVMe), [`device`] (where buffers live, decided once as a [`device::Residence`]),
//! [`async_training`] (how ranks synchronise at a step boundary), [`parallel`] (the engine's place in a model
//! split across ranks), `checkpointing/`; `setup.rs` builds it all, `step.rs` runs the optimizer step.
/// The engine's parts bounded staleness borrows for a call: disjoint fields, so the others stay usable beside it.
macro_rules! stale_parts {
    ($engine:expr) => {
        crate::engine::async_training::stale_step::StaleParts {
            comm: $engine.comm.as_ref(),
            flat: &$engine.states.parameters.flat,
            shard: &mut $engine.shard,
            layout: &$engine.states.layout,
            residence: $engine.residence,
        }
    };
}

#[doc(hidden)] // the engine's parts: what a program uses is re-exported below
pub mod async_training;
pub(crate) mod checkpointing;
pub(crate) mod compression;
mod counters;
mod data_groups;
#[doc(hidden)] // the engine's parts: what a program uses is re-exported below
pub mod device;
mod engine_comm;
mod fault_tolerant;
mod flops_profile;
mod micro_batch;
#[doc(hidden)] // the engine's parts: what a program uses is re-exported below
pub mod parallel;
mod reporting;
pub mod sampler;
mod setup;
mod step;
mod unit_scopes;
mod watching;
#[doc(hidden)] // the engine's parts: what a program uses is re-exported below
pub mod zero;

use tch::nn;
use zerorun_optim::LossScaler;

use crate::comm::Communicator;
use crate::config::{BatchSizes, Config, Precision};
use crate::error::Result;
pub use checkpointing::{load_mapped, load_mapped_slices, write_pretrained, PretrainedOptions, SaveOptions};
use counters::Progress;
pub use counters::{CommVolume, GatheredBytes};
pub use device::native::generator_lock;
pub use device::optimizer as device_optimizer;
pub use reporting::{MemoryReportFiles, MEMORY_REPORT_ENV};
pub use unit_scopes::NestedUnits;
pub use watching::{measure_peak_flops, StepRates, Throughput};
pub use zero::builders::{BuiltModel, UnitBuilders, UnitForward};
pub use zero::layout::{self, FlatLayout, ParamSlot, UnitSpan};
use zero::plan::StagePlan;
pub use zero::scopes::UnitOutput;
pub use zero::unit_walk::CHAIN_WALK_ENV;
pub use zero::units::{self, Sequence, UnitModel, Whole};
pub use zero::variables::BufferSync;

/// What `step` did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutcome {
    /// Not at a gradient-accumulation boundary: gradients were kept, nothing else happened.
    Accumulating,
    /// An optimizer step was taken; `loss` is the mean over micro-batches and ranks.
    Stepped {
        /// The optimizer step (1 for the first).
        step: u64,
        /// The loss, mean over micro-batches and ranks.
        loss: f64,
        /// The global gradient norm before clipping.
        grad_norm: f64,
        /// The learning rate used.
        lr: f64,
    },
    /// fp16 gradients (or bf16 ones with `bf16.check_grad_overflow`) overflowed on some rank: no update; under fp16
    /// the loss scale was lowered (`scale` is the new one, 1 under bf16).
    Skipped {
        /// The optimizer step.
        step: u64,
        /// The loss, mean over micro-batches and ranks.
        loss: f64,
        /// The loss scale now.
        scale: f64,
    },
    /// `fault_tolerance`: a replica group failed or was lost during the step, and the groups' vote dropped it on
    /// every rank: no update, not counted. Redo the step: its global batch split over the groups left, as
    /// `batch_sizes()`, `rank()` and `world_size()` now say.
    Discarded {
        /// The optimizer step to redo.
        step: u64,
        /// The loss this rank saw (not a mean over the groups: some never finished the step).
        loss: f64,
    },
}

/// Options a program sets in code rather than in ds_config.json.
#[derive(Clone, Default)]
pub struct EngineOptions {
    /// Parameters (by name) that get no weight decay, e.g. biases and norm weights.
    pub no_weight_decay: Option<fn(&str, &[i64]) -> bool>,
    /// The model's units (parameter-name prefixes, in execution order; see [`UnitModel`]). Stage 3 gathers
    /// parameters unit by unit (without units the whole model is one unit); stage 2 reduces gradients unit by unit
    /// during backward, so no full gradients are held. With units, train through `engine.forward`.
    pub units: Option<Vec<Vec<String>>>,
    /// Stage 3: keep only each unit's input in forward and recompute the unit in backward
    /// (`engine.backward_units(&model, &loss)`).
    pub activation_checkpointing: bool,
    /// How buffers (BatchNorm's running statistics) stay consistent across ranks; DDP's broadcast by default.
    pub buffers: BufferSync,
    /// Leave glibc's malloc as the program set it. By default the engine fixes its mmap threshold at 4 MiB
    /// (`mallopt(M_MMAP_THRESHOLD)`), so freed large tensors leave the resident memory instead of staying in the
    /// heap (see `engine/allocator.rs`); a program that tunes malloc itself sets this.
    pub keep_allocator_settings: bool,
}

impl EngineOptions {
    /// Takes the units of `model`.
    pub fn units_of(mut self, model: &dyn UnitModel) -> Self {
        self.units = Some(model.unit_prefixes());
        self
    }

    /// Sets how buffers stay consistent across ranks.
    pub fn buffers(mut self, sync: BufferSync) -> Self {
        self.buffers = sync;
        self
    }
}

/// Distinguishes engines of one process (thread ranks, tests) in swap-file names.
fn next_engine_id() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Biases and norm weights (1-D parameters) get no weight decay: the usual transformer recipe.
pub fn no_decay_for_1d(_name: &str, shape: &[i64]) -> bool {
    shape.len() <= 1
}

/// The ZeRO engine: a facade over the parts that own the work, each in a folder of its own (`zero/`: the plan,
/// the parameters and units, `zero/grads/`, `zero/optim/`; `device/`; `async_training/`; `parallel/`;
/// `checkpointing/`). The engine keeps what every strategy shares and hands each part what it borrows.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # use tch::nn::{self, Module};
/// # use tch::{Device, Kind, Tensor};
/// # let vs = nn::VarStore::new(Device::Cpu);
/// # let (l0, l1) = (nn::linear(vs.root() / "l0", 4, 8, Default::default()), nn::linear(vs.root() / "l1", 8, 1, Default::default()));
/// # let model = zerorun_runtime::engine::Sequence::new().unit(["l0"], move |x| l0.forward(x).relu()).unit(["l1"], move |x| l1.forward(x));
/// # let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
/// # let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
/// # let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, zerorun_runtime::EngineOptions::default().units_of(&model))?;
/// # let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
/// // A step at stage 3: forward gathers one unit at a time, backward reduces each unit's gradients.
/// let y = engine.forward(&model, &x)?;
/// let loss = y.mse_loss(&x.sum_dim_intlist(1, true, Kind::Float), tch::Reduction::Mean);
/// engine.backward_units(&model, &loss)?;
/// if let zerorun_runtime::StepOutcome::Stepped { step, loss, grad_norm, lr } = engine.step()? {
///     println!("step {step}: loss {loss:.4}, gradient norm {grad_norm:.3}, lr {lr}");
/// }
/// assert_eq!(engine.global_steps(), 1);
/// # Ok(()) }
/// ```
pub struct Engine {
    comm: engine_comm::EngineComm,
    /// Where the model and the engine's buffers live, decided once at set-up.
    residence: device::Residence,
    config: Config,
    /// What the stage partitions and how gradients reach the reduction: every stage decision asks it.
    plan: StagePlan,
    batch: BatchSizes,
    /// The parameters, their layout, the frozen ones and the buffers.
    states: zero::ModelStates,
    /// Stage 3's walk over the units: what forward kept for backward.
    walk: zero::unit_walk::Walk,
    /// Where gradients are staged, reduced and accumulated, and how.
    gradients: zero::grads::Gradients,
    /// This rank's optimizer: the values it steps, the fp32 master, the states, the groups, the schedule.
    shard: zero::optim::OptimizerShard,
    progress: Progress,
    /// The memory and wall-clock reports' measurements.
    report: reporting::Reporting,
    /// The engine's place in a model split across ranks (pipeline stages, tensor parallelism).
    placement: parallel::placement::Placement,
    /// How the ranks synchronise at a step boundary (`async_training`).
    sync: async_training::Synchronization,
    /// The asynchronous checkpoint being written, if any (`checkpoint.async_save`).
    in_flight: checkpointing::background::InFlight,
    /// The monitors, the throughput and MFU, the communication logger.
    watch: watching::Watch,
}

impl Engine {
    /// Wraps the trainable variables of `vs` for data-parallel training with `comm`.
    pub fn new(
        vs: &nn::VarStore,
        config: Config,
        comm: Box<dyn Communicator>,
        options: EngineOptions,
    ) -> Result<Engine> {
        // Shard groups (`mics_shard_size`) split the communicator; without them it is the engine's group.
        let groups = data_groups::DataGroups::of(comm, &config)?;
        Self::on_data_groups(vs, config, groups, options)
    }

    /// This rank's index among the data-parallel ranks (with shard groups: every group's ranks, group by group).
    pub fn rank(&self) -> usize {
        self.comm.data_rank()
    }

    /// The device the model and the engine's buffers are on (the CPU, or the CUDA device of the model).
    pub fn device(&self) -> tch::Device {
        self.residence.device()
    }

    /// The precision the config trains in.
    fn precision(&self) -> Precision {
        self.config.precision()
    }

    /// Data-parallel ranks (with shard groups: every group's).
    pub fn world_size(&self) -> usize {
        self.comm.data_world_size()
    }

    /// Ranks ZeRO partitions the model states over: the shard group's (`mics_shard_size`), else every
    /// data-parallel rank.
    pub fn shard_group_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The config as `initialize` resolved it (stage 3's sizes filled in).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The batch sizes for this world size.
    pub fn batch_sizes(&self) -> BatchSizes {
        self.batch
    }

    /// Where every parameter lives in the flat buffer.
    pub fn layout(&self) -> &FlatLayout {
        &self.states.layout
    }

    /// Optimizer steps taken, skipped ones included (as DeepSpeed counts them).
    pub fn global_steps(&self) -> u64 {
        self.progress.global_steps
    }

    /// Samples trained on over all ranks: the data cursor (`sampler(..).next_micro_batches(engine.global_samples())`).
    pub fn global_samples(&self) -> u64 {
        self.progress.global_samples
    }

    /// Steps skipped because fp16 gradients overflowed.
    pub fn skipped_steps(&self) -> u64 {
        self.progress.skipped_steps
    }

    /// The current fp16 loss scale (1 without fp16).
    pub fn loss_scale(&self) -> f64 {
        self.shard.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// The learning rate the next optimizer step uses.
    pub fn lr(&self) -> f64 {
        self.shard.lr()
    }

    /// A sampler giving this rank its micro-batches of every global batch (torch's DistributedSampler by batch).
    /// With `sequence_parallel_size` S the S ranks of a sequence group get the same rows (the data-parallel rank is
    /// the rank / S), each then taking its slice of their sequences (`runtime::sequence`).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use tch::nn::{self, Module};
    /// # use tch::{Device, Kind, Tensor};
    /// # let vs = nn::VarStore::new(Device::Cpu);
    /// # let (l0, l1) = (nn::linear(vs.root() / "l0", 4, 8, Default::default()), nn::linear(vs.root() / "l1", 8, 1, Default::default()));
    /// # let model = zerorun_runtime::engine::Sequence::new().unit(["l0"], move |x| l0.forward(x).relu()).unit(["l1"], move |x| l1.forward(x));
    /// # let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// # let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// # let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, zerorun_runtime::EngineOptions::default().units_of(&model))?;
    /// # let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// let sampler = engine.sampler(1000, 7, true);
    /// // This rank's micro-batches of the next global batch, from the data cursor (a resumed run continues exactly).
    /// for indices in sampler.next_micro_batches(engine.global_samples()) {
    ///     assert_eq!(indices.len(), 2); // train_micro_batch_size_per_gpu
    /// }
    /// # Ok(()) }
    /// ```
    pub fn sampler(&self, dataset_len: usize, seed: u64, shuffle: bool) -> sampler::DistributedSampler {
        sampler::DistributedSampler {
            dataset_len,
            seed,
            shuffle,
            batch: self.batch,
            rank: self.rank() / self.sequence_parallel(),
            world_size: self.world_size() / self.sequence_parallel(),
        }
    }

    /// Ranks each row's sequence is split over (`sequence_parallel_size`; 1 without sequence parallelism).
    pub fn sequence_parallel(&self) -> usize {
        self.config.sequence_parallel_size.max(1) as usize
    }

    /// Averages `buf` over the engine's (data-parallel) ranks.
    pub fn data_parallel_mean(&self, buf: &mut [f32]) -> Result<()> {
        Ok(self.comm.all_reduce_data(buf, crate::comm::ReduceOp::Avg)?)
    }

    /// Bytes of gathered full parameters (stage 3): now, the run's peak, the current step's peak.
    pub fn gathered_bytes(&self) -> GatheredBytes {
        self.states.parameters.gathered
    }

    /// Bytes of checkpointed unit inputs this rank sent to host memory since the engine started
    /// (`activation_checkpointing.cpu_checkpointing` on the device path; 0 otherwise).
    pub fn inputs_sent_to_host_bytes(&self) -> u64 {
        self.walk.inputs_sent_bytes
    }

    /// Elements this rank's collectives moved since the engine started.
    pub fn comm_volume(&self) -> CommVolume {
        self.report.comm_volume
    }

    /// Whether the next `step` is an optimizer step (the last micro-batch of an accumulation).
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        (self.progress.micro_steps - self.progress.micro_at_boundary + 1) % self.batch.gradient_accumulation_steps == 0
    }
}

impl Engine {
    /// Gradients applied by this rank as an owner, by staleness (bounded staleness; empty otherwise).
    pub fn staleness_counts(&self) -> Vec<u64> {
        self.sync.stale().map_or_else(Vec::new, |s| s.counts().to_vec())
    }

    /// Ends the run: with bounded staleness, every owner applies every step and every rank pulls the final values
    /// (collective), after which the ranks' parameters are equal and no step may follow. Nothing to do in other
    /// modes. Every rank calls it before the engine goes: dropping the engine runs no collective (a rank that drops
    /// its engine after an error must not wait on the others), it only logs that the run was not finished.
    pub fn finish(&mut self) -> Result<()> {
        self.wait_for_checkpoint()?;
        let parts = stale_parts!(self);
        match self.sync.stale_mut() {
            Some(stale) => stale.finish(parts),
            None => Ok(()),
        }
    }

    /// Bounded staleness's window, set up from the engine's values (collective; nothing in the other modes).
    fn start_bounded_staleness(&mut self) -> Result<()> {
        let parts = stale_parts!(self);
        if let Some(stale) = async_training::stale_step::Stale::start(&self.config, &self.gradients, parts)? {
            self.sync = async_training::Synchronization::Stale(Box::new(stale));
        }
        Ok(())
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("stage", &self.plan.stage())
            .field("parameters", &self.states.layout.numel)
            .field("residence", &self.residence)
            .field("global_steps", &self.progress.global_steps)
            .finish()
    }
}

impl Drop for Engine {
    /// No collective here: bounded staleness ends in `finish`, which every rank calls.
    fn drop(&mut self) {
        // An asynchronous checkpoint still being written is finished (a failure only logged: a drop returns none).
        if let Err(e) = self.in_flight.wait() {
            tracing::error!(rank = self.rank(), "the asynchronous checkpoint failed: {e}");
        }
        if self.sync.stale().is_some_and(|s| !s.finished()) && !std::thread::panicking() {
            tracing::warn!(
                rank = self.rank(),
                "the engine was dropped without engine.finish(): under bounded staleness the steps still in flight are not applied and the ranks' parameters may differ"
            );
        }
    }
}
