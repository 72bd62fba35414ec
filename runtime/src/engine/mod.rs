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

pub mod async_training;
pub(crate) mod checkpointing;
mod counters;
pub mod device;
mod engine_comm;
pub mod parallel;
mod reporting;
pub mod sampler;
mod setup;
mod step;
pub mod zero;

use std::time::Instant;

use tch::{nn, Tensor};
use zerorun_optim::LossScaler;

use crate::comm::Communicator;
use crate::config::{BatchSizes, Config, Precision};
use crate::error::{Error, Result};
use crate::report::Phase;
pub use checkpointing::{load_mapped, load_mapped_slices, SaveOptions};
use counters::Progress;
pub use counters::{CommVolume, GatheredBytes};
pub use device::optimizer as device_optimizer;
pub use parallel::placement::SplitDim;
pub use reporting::{MemoryReportFiles, MEMORY_REPORT_ENV};
pub use zero::builders::{BuiltModel, UnitBuilders, UnitForward};
pub use zero::layout::{self, FlatLayout, ParamSlot, UnitSpan};
use zero::plan::{GradientPath, StagePlan};
pub use zero::units::{self, Sequence, UnitModel, Whole};
pub use zero::variables::BufferSync;

/// Where a backward starts.
#[derive(Clone, Copy)]
enum Root<'a> {
    /// A micro-batch's loss, scaled by the loss scale over the accumulation steps.
    Loss(&'a Tensor),
    /// A part's output and the gradient of the loss with respect to it.
    Output { output: &'a Tensor, grad: &'a Tensor },
}

/// What `step` did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutcome {
    /// Not at a gradient-accumulation boundary: gradients were kept, nothing else happened.
    Accumulating,
    /// An optimizer step was taken; `loss` is the mean over micro-batches and ranks.
    Stepped { step: u64, loss: f64, grad_norm: f64, lr: f64 },
    /// fp16 gradients (or bf16 ones with `bf16.check_grad_overflow`) overflowed on some rank: no update; under fp16
    /// the loss scale was lowered (`scale` is the new one, 1 under bf16).
    Skipped { step: u64, loss: f64, scale: f64 },
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
}

impl Engine {
    /// Wraps the trainable variables of `vs` for data-parallel training with `comm`.
    pub fn new(
        vs: &nn::VarStore,
        config: Config,
        comm: Box<dyn Communicator>,
        options: EngineOptions,
    ) -> Result<Engine> {
        Self::new_materialized(vs, config, comm, options, None)
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The device the model and the engine's buffers are on (the CPU, or the CUDA device of the model).
    pub fn device(&self) -> tch::Device {
        self.residence.device()
    }

    /// The precision the config trains in.
    fn precision(&self) -> Precision {
        self.config.precision()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn batch_sizes(&self) -> BatchSizes {
        self.batch
    }

    pub fn layout(&self) -> &FlatLayout {
        &self.states.layout
    }

    /// Optimizer steps taken, skipped ones included (as DeepSpeed counts them).
    pub fn global_steps(&self) -> u64 {
        self.progress.global_steps
    }

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
    pub fn sampler(&self, dataset_len: usize, seed: u64, shuffle: bool) -> sampler::DistributedSampler {
        sampler::DistributedSampler {
            dataset_len,
            seed,
            shuffle,
            batch: self.batch,
            rank: self.rank(),
            world_size: self.world_size(),
        }
    }

    /// Averages `buf` over the engine's (data-parallel) ranks.
    pub fn data_parallel_mean(&self, buf: &mut [f32]) -> Result<()> {
        Ok(crate::comm::Collectives::all_reduce(self.comm.as_ref(), buf, crate::comm::ReduceOp::Avg)?)
    }

    /// Whether the next `step` is an optimizer step (the last micro-batch of an accumulation).
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        (self.progress.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0
    }

    /// Backward of one micro-batch's loss, scaled by 1/gradient_accumulation_steps as DeepSpeed does (and by the
    /// loss scale under fp16).
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        self.backward_impl(None, loss)
    }

    /// [`Engine::backward`] with the model at hand, which stage 3 needs to recompute units under activation
    /// checkpointing. Works at every stage.
    pub fn backward_units(&mut self, model: &dyn UnitModel, loss: &Tensor) -> Result<()> {
        self.backward_impl(Some(model), loss)
    }

    /// Whether the next backwards reduce their gradients (true, the default), or leave them accumulating in
    /// `.grad` for a later backward to reduce (FSDP2's `set_requires_gradient_sync`): a pipeline stage, whose
    /// micro-batches' backwards spread over the whole step, reduces once, during the last. Stage 2 of an fp32
    /// plain loop then holds full gradients until that backward (as stage 1 does) and runs no collective before it;
    /// 16-bit models reduce every micro-batch into their fp32 accumulator whatever this says, and the other paths
    /// reduce at the step anyway.
    pub fn set_requires_gradient_sync(&mut self, sync: bool) {
        self.gradients.defers_reduction = !sync && self.precision() == Precision::Fp32;
    }

    /// Backward of a part of the model from the gradient of its `output` (what the next pipeline stage sent back,
    /// already scaled as that stage's loss was): accumulates the parameters' gradients as [`Engine::backward`]
    /// does, records no loss. Stages 0-2 without units.
    pub(crate) fn backward_output(&mut self, output: &Tensor, grad: &Tensor) -> Result<()> {
        if self.plan.gradients == GradientPath::UnitWalk {
            return Err(Error::Usage(
                "engine.backward_output runs a plain backward: it needs ZeRO stage 0-2 without units".into(),
            ));
        }
        self.backward_root(Root::Output { output, grad })
    }

    fn backward_impl(&mut self, model: Option<&dyn UnitModel>, loss: &Tensor) -> Result<()> {
        if self.plan.gradients == GradientPath::UnitWalk {
            self.begin_backward(Some(loss))?;
            let factor = self.loss_scale() / self.batch.gradient_accumulation_steps as f64;
            let (started, comm_before) = (Instant::now(), self.report.times.comm());
            let _span = Phase::Backward.span().entered();
            // The walk records its own events, unit by unit.
            return self.backward_units_impl(model, loss, factor).map(|()| self.end_backward(started, comm_before));
        }
        self.backward_root(Root::Loss(loss))
    }

    /// Counts the backward (and its loss).
    fn begin_backward(&mut self, loss: Option<&Tensor>) -> Result<()> {
        if self.progress.step_started.is_none() {
            self.progress.step_started = Some(Instant::now());
        }
        if let Some(loss) = loss {
            self.progress.loss_sum += loss.f_double_value(&[])?;
            self.progress.loss_count += 1;
        }
        self.progress.backwards += 1;
        Ok(())
    }

    fn backward_root(&mut self, root: Root<'_>) -> Result<()> {
        self.begin_backward(match root {
            Root::Loss(loss) => Some(loss),
            Root::Output { .. } => None,
        })?;
        let factor = self.loss_scale() / self.batch.gradient_accumulation_steps as f64;
        let _span = Phase::Backward.span().entered();
        let (started, comm_before) = (Instant::now(), self.report.times.comm());
        let autograd = || -> Result<()> {
            match root {
                Root::Loss(loss) if factor != 1.0 => (loss * factor).f_backward()?,
                Root::Loss(loss) => loss.f_backward()?,
                // d/d(output) of sum(output * grad) is grad, exactly.
                Root::Output { output, grad } => (output * grad.detach()).sum(None).f_backward()?,
            }
            Ok(())
        };
        // Deferring: this micro-batch's gradients stay in `.grad` (the hooks only act while lent).
        let defer = self.gradients.defers_reduction;
        match self.plan.gradients {
            GradientPath::AfterBackward => autograd()?,
            GradientPath::Hooks if defer => autograd()?,
            GradientPath::Hooks => {
                let hooks = self.gradients.hooks.take().expect("hooked mode has hooks");
                let ran = hooks.lend(&mut self.gradient_sync(), autograd);
                self.gradients.hooks = Some(hooks);
                ran?
            }
            GradientPath::UnitWalk => unreachable!("unit walks run in backward_impl"),
        }
        self.memory_event(|| "backward".into(), &[]);
        self.end_backward(started, comm_before);
        Ok(())
    }

    fn end_backward(&mut self, started: Instant, comm_before: std::time::Duration) {
        self.report
            .times
            .add(Phase::Backward, started.elapsed().saturating_sub(self.report.times.comm() - comm_before));
    }

    /// Runs `f` as collective time of `phase`.
    fn timed<T>(&mut self, phase: Phase, f: impl FnOnce(&mut Self) -> T) -> T {
        let _span = phase.span().entered();
        let t = Instant::now();
        let out = f(self);
        self.report.times.add(phase, t.elapsed());
        out
    }

    /// What reducing gradients needs, borrowed from the engine's fields.
    fn gradient_sync(&mut self) -> zero::grads::GradientSync<'_> {
        // Only while stage 3's optimizer in backward has begun a step.
        let stepper = self.shard.in_backward.as_mut().map(|progress| zero::optim::in_backward::ShardStepper {
            tier: &mut self.shard.tier,
            groups: &self.shard.groups,
            shard: &self.states.parameters.flat,
            progress,
            residence: self.residence,
        });
        zero::grads::GradientSync {
            gradients: &mut self.gradients,
            comm: &self.comm,
            layout: &self.states.layout,
            params: &self.states.params,
            volume: &mut self.report.comm_volume,
            times: &mut self.report.times,
            stepper,
        }
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
        if self.sync.stale().is_some_and(|s| !s.finished()) && !std::thread::panicking() {
            tracing::warn!(
                rank = self.rank(),
                "the engine was dropped without engine.finish(): under bounded staleness the steps still in flight are not applied and the ranks' parameters may differ"
            );
        }
    }
}
