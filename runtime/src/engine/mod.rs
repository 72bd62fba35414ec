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
//! (`sharded_unit.rs`, `stage3.rs`); stage 2 walks the same units in backward and reduces each unit's gradients at once.
//! Stage 2 of a plain loop lays buckets out like units and reduces each when autograd's hooks say its gradients are
//! all written (`grad_hooks.rs`).
//! Optimizer states live in memory or on NVMe (zerorun-offload's `OptimizerTier`); so does stage 3's
//! parameter shard (`swapped_params.rs`).
//! `setup.rs` holds how `Engine::new` builds all of it, one decision per function; `shard.rs` where this rank's
//! optimized values live; mod.rs the Engine itself: backward, the optimizer step and what it takes.
mod allocator;
mod bucket;
mod builders;
mod checkpointing;
mod engine_comm;
mod frozen;
mod grad_hooks;
mod gradients;
pub mod layout;
mod native;
mod optimizer;
mod plan;
mod reporting;
pub mod sampler;
mod setup;
mod shard;
mod sharded_unit;
mod stage3;
mod swapped_params;
pub mod units;
mod variables;
mod views;

use std::time::Instant;

use tch::{nn, Kind, Tensor};
use zerorun_optim::loss_scale::StepDecision;
use zerorun_optim::schedule::LrScheduler;
use zerorun_optim::{norm, AlignedVec, Grads, Group, LossScaler, LossScalerConfig, ParamsOut};

use crate::comm::{Collectives, Communicator, ReduceOp};
use crate::config::{BatchSizes, Config, OffloadDevice, OptimizerConfig, Precision};
use crate::error::{Error, Result};
use crate::report::memory::MemoryTracker;
use crate::report::{Phase, PhaseTimes};
pub use builders::{BuiltModel, UnitBuilders, UnitForward};
pub use checkpointing::{load_mapped, SaveOptions};
pub use layout::{FlatLayout, ParamSlot, UnitSpan};
use plan::{AfterStep, GradientPath, Optimized, StagePlan};
pub use reporting::{MemoryReportFiles, MEMORY_REPORT_ENV};
use shard::shard_values;
use sharded_unit::ShardedUnit;
pub use stage3::{CommVolume, GatheredBytes};
pub use units::{Sequence, UnitModel, Whole};
pub use variables::BufferSync;

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

pub struct Engine {
    comm: engine_comm::EngineComm,
    config: Config,
    /// What the stage partitions and how gradients reach the reduction: every stage decision asks it.
    plan: StagePlan,
    batch: BatchSizes,
    precision: Precision,
    layout: FlatLayout,
    /// The model's parameters, in layout order; views into `flat_params` (stages 0-2) or into their unit's
    /// buffer (stage 3).
    params: Vec<Tensor>,
    /// All parameters in the model's dtype (stages 0-2); this rank's shard of every unit (stage 3; empty when
    /// the shard is on NVMe).
    flat_params: Tensor,
    /// Stage 3 with `offload_param.device = nvme`: where the shard lives instead of `flat_params`.
    swapped_params: Option<swapped_params::SwappedParams>,
    /// Stage 3: one per unit, in execution order (empty at stages 0-2).
    units: Vec<ShardedUnit>,
    /// Stage 3: the frozen parameters, partitioned unit by unit beside `units`.
    frozen_units: Option<frozen::FrozenUnits>,
    /// Stages 0-2: the frozen parameters, whole on every rank (rank 0's values), by name.
    frozen: Vec<(String, Tensor)>,
    /// The model's buffers by name, whole on every rank, kept consistent by `buffer_sync`.
    buffers: Vec<(String, Tensor)>,
    buffer_sync: BufferSync,
    /// Every variable of the VarStore is this engine's while it lives.
    _claim: variables::Claim,
    /// The gradients' fingerprint at the end of the last `step` call (see `gradient_fingerprint`).
    grad_mark: i64,
    /// Resident memory when `new` began, less the model's variables: the process floor the memory report names.
    floor_rss_bytes: u64,
    /// The process's peak resident memory when `new` returned.
    init_peak_rss_bytes: u64,
    /// Whether the engine samples memory at its events (a report is asked for; see `memory_event`).
    sample_events: bool,
    unit_prefixes: Vec<Vec<String>>,
    /// Stage 2 of a plain loop: the gradient hooks that reduce bucket by bucket during backward.
    grad_hooks: Option<grad_hooks::GradHooks>,
    /// Stage 3: what the current micro-batch's forward kept for backward.
    records: Vec<stage3::UnitRecord>,
    activation_checkpointing: bool,
    gathered: GatheredBytes,
    comm_volume: CommVolume,
    memory: MemoryTracker,
    times: PhaseTimes,
    /// fp32 master of the optimized range (16-bit models only; fp32 models step `flat_params` directly).
    master: Option<AlignedVec>,
    /// Where gradients are staged, reduced and accumulated, and how.
    gradients: gradients::Gradients,
    optimizer: optimizer::OptimizerTier,
    /// Groups relative to the optimized range (the partition at stages 1-2, everything at stage 0).
    groups: Vec<Group>,
    optimized: Optimized,
    base_lr: f64,
    scheduler: Option<LrScheduler>,
    scaler: Option<LossScaler>,
    micro_steps: u64,
    global_steps: u64,
    global_samples: u64,
    skipped_steps: u64,
    loss_sum: f64,
    loss_count: u64,
    step_started: Option<Instant>,
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

    /// [`Engine::new`] where stage 3's unit parameters may still lack their values (`builders.rs`): `materialize`
    /// gives unit `i`'s variables (name, tensor) their storage and values right before the unit is packed.
    pub(super) fn new_materialized(
        vs: &nn::VarStore,
        config: Config,
        comm: Box<dyn Communicator>,
        options: EngineOptions,
        mut materialize: Option<&mut units::Materialize>,
    ) -> Result<Engine> {
        // The process floor: what is resident before the engine allocates, less the model's own variables
        // (built by the program already; they are model states, which the engine then takes over).
        let model_bytes: usize = vs.variables().values().map(native::storage_nbytes).sum();
        let floor_rss_bytes = crate::report::memory::rss().0.saturating_sub(model_bytes as u64);
        if !options.keep_allocator_settings {
            allocator::fix_mmap_threshold();
        }
        let (world_size, rank) = (comm.world_size(), comm.rank());
        let batch = config.batch_sizes(world_size)?;
        if let Some(OptimizerConfig::Lamb(_)) = &config.optimizer {
            return Err(Error::Unsupported {
                key: "optimizer.type",
                value: "\"Lamb\"".into(),
                why: "Lamb needs per-tensor trust ratios across ranks, not in this build yet",
            });
        }
        let z = &config.zero_optimization;
        let precision = config.precision();
        let kind = views::kind_of(precision);
        let plan = StagePlan::new(z.stage, options.units.is_some(), z.overlap_comm, z.reduce_scatter, world_size);
        // Buffers the collectives read go where the peers map them (the shm backend's shared region).
        let shared = comm.prefers_shared_buffers();
        let variables::Variables { trainable, frozen, buffers } = variables::classify(vs);
        let claim = variables::Claim::new(trainable.iter().chain(&frozen).chain(&buffers))?;
        let setup::Arrangement { named, layout, unit_prefixes, frozen_by_unit } =
            setup::arrange(trainable, frozen, &options, &plan, z.reduce_bucket_size, precision, world_size)?;
        let frozen_numel: Vec<u64> =
            frozen_by_unit.iter().map(|u| u.iter().map(|(_, t)| t.numel() as u64).sum()).collect();
        if plan.partitions_parameters() && options.units.is_none() {
            setup::check_whole_model_persists(z, layout.numel as u64 + frozen_numel.iter().sum::<u64>())?;
        }
        // Every rank starts from rank 0's model: trainable parameters are broadcast as they are packed, frozen
        // parameters and buffers here (stage 3 partitions the frozen ones, broadcasting unit by unit).
        let frozen_whole: Vec<(String, Tensor)> = if plan.partitions_parameters() {
            Vec::new()
        } else {
            frozen_by_unit.iter().flatten().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
        };
        let broadcast: Vec<&Tensor> = frozen_whole.iter().chain(&buffers).map(|(_, t)| t).collect();
        variables::broadcast_values(comm.as_ref(), &broadcast)?;
        let (mut flat_params, params, sharded_units) = if plan.partitions_parameters() {
            Self::shard_units(&layout, named, &frozen_numel, kind, comm.as_ref(), &config, materialize.as_deref_mut())?
        } else {
            setup::pack(&layout, named, kind, comm.as_ref(), &plan, shared)?
        };
        let frozen_units = if plan.partitions_parameters() && frozen_by_unit.iter().any(|u| !u.is_empty()) {
            let persistent: Vec<bool> = sharded_units.iter().map(|u| u.persistent).collect();
            Some(frozen::FrozenUnits::new(frozen_by_unit, &persistent, comm.as_ref(), materialize)?)
        } else {
            None
        };

        let optimized = plan.optimized(&layout, rank);
        let master = (precision != Precision::Fp32).then(|| {
            let part = shard_values(&flat_params, &layout, rank, &plan, &optimized).to_kind(Kind::Float);
            // SAFETY: `part` is a fresh fp32 copy (to_kind) nothing else holds.
            AlignedVec::from_slice(unsafe { views::slice::<f32>(&part) })
        });
        let swapped_params = if plan.partitions_parameters() && z.offload_param.device == OffloadDevice::Nvme {
            let chunks = sharded_units.iter().map(|u| u.shard_range(world_size)).collect();
            let persistent: Vec<bool> = sharded_units.iter().map(|u| u.persistent).collect();
            let prefix = format!("zerorun-{}-{}-rank{rank}-params", std::process::id(), next_engine_id());
            let swapped = swapped_params::SwappedParams::new(
                &flat_params,
                chunks,
                &persistent,
                &z.offload_param,
                setup::io_config(&config),
                &prefix,
            )?;
            flat_params = Tensor::zeros([0], (kind, tch::Device::Cpu));
            Some(swapped)
        } else {
            if plan.partitions_parameters() && z.offload_param.device == OffloadDevice::Cpu {
                tracing::info!(
                    rank,
                    "offload_param.device = cpu: a CPU run keeps parameter shards in host memory already"
                );
            }
            None
        };
        let (optimizer, base_lr, weight_decay) =
            setup::optimizer_tier(&config, optimized.len(), rank, next_engine_id())?;
        let runs = match &optimized {
            Optimized::Shard(_) => layout.shard_decay_runs(rank),
            Optimized::Flat(plan::FlatRange(range)) => layout.decay_runs(range.clone()),
        };
        let groups = runs
            .into_iter()
            .map(|(range, decay)| Group { range, lr: base_lr, weight_decay: if decay { weight_decay } else { 0.0 } })
            .collect();
        let scheduler = optimizer::scheduler(&config, base_lr);
        let gradients = gradients::Gradients::new(&config, &plan, &layout, &params, rank, shared)?;
        let scaler = config.fp16.enabled.then(|| {
            let f = &config.fp16;
            LossScaler::new(LossScalerConfig::from_fp16(
                f.loss_scale,
                f.initial_scale_power,
                f.loss_scale_window,
                f.hysteresis,
                f.consecutive_hysteresis,
                f.min_loss_scale,
            ))
        });
        if precision == Precision::Fp16 && rank == 0 {
            // Every parameter is on the CPU (checked in `arrange`).
            tracing::warn!("fp16 on the CPU: libtorch runs Half matmuls with a slow reference kernel on most CPUs (hundreds of times slower than bf16); bf16.enabled saves the same memory at full speed");
        }
        tracing::info!(
            rank,
            world_size,
            stage = plan.stage(),
            ?precision,
            params = layout.numel,
            partition = layout.partition_len(),
            units = layout.units.len(),
            "zerorun engine ready"
        );
        // Gathered bytes count units' own buffers (stage 3); stage 2's units are regions of `flat_params`.
        let persistent_bytes = sharded_units
            .iter()
            .filter(|u| u.persistent && u.owns_buffer())
            .map(ShardedUnit::full_bytes)
            .sum::<usize>()
            + frozen_units
                .as_ref()
                .map_or(0, |f| f.units.iter().filter(|u| u.persistent).map(ShardedUnit::full_bytes).sum());
        let mut engine = Engine {
            comm: engine_comm::EngineComm::new(comm, plan.threaded_comm()),
            config,
            plan,
            batch,
            precision,
            layout,
            params,
            flat_params,
            swapped_params,
            units: sharded_units,
            frozen_units,
            frozen: frozen_whole,
            buffers,
            buffer_sync: options.buffers,
            _claim: claim,
            grad_mark: 0,
            floor_rss_bytes,
            init_peak_rss_bytes: 0,
            sample_events: false,
            unit_prefixes,
            grad_hooks: None,
            records: Vec::new(),
            activation_checkpointing: options.activation_checkpointing,
            gathered: GatheredBytes { current: persistent_bytes, peak: persistent_bytes, step_peak: persistent_bytes },
            comm_volume: CommVolume::default(),
            memory: MemoryTracker::default(),
            times: PhaseTimes::default(),
            master,
            gradients,
            optimizer,
            groups,
            optimized,
            base_lr,
            scheduler,
            scaler,
            micro_steps: 0,
            global_steps: 0,
            global_samples: 0,
            skipped_steps: 0,
            loss_sum: 0.0,
            loss_count: 0,
            step_started: None,
        };
        if plan.gradients == plan::GradientPath::Hooks {
            engine.grad_hooks = Some(grad_hooks::GradHooks::install(&engine.params)?);
        }
        engine.grad_mark = engine.gradient_fingerprint();
        allocator::return_freed_memory();
        engine.init_peak_rss_bytes = crate::report::memory::rss().1;
        engine.sample_events = engine.memory_report_dir().is_some();
        engine.memory_event_initialized();
        Ok(engine)
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
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
        &self.layout
    }

    /// Optimizer steps taken, skipped ones included (as DeepSpeed counts them).
    pub fn global_steps(&self) -> u64 {
        self.global_steps
    }

    pub fn global_samples(&self) -> u64 {
        self.global_samples
    }

    /// Steps skipped because fp16 gradients overflowed.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// The current fp16 loss scale (1 without fp16).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// The learning rate the next optimizer step uses.
    pub fn lr(&self) -> f64 {
        self.scheduler.as_ref().map_or(self.base_lr, LrScheduler::lr)
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

    /// Whether the next `step` is an optimizer step (the last micro-batch of an accumulation).
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0
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

    fn backward_impl(&mut self, model: Option<&dyn UnitModel>, loss: &Tensor) -> Result<()> {
        if self.step_started.is_none() {
            self.step_started = Some(Instant::now());
        }
        self.loss_sum += loss.f_double_value(&[])?;
        self.loss_count += 1;
        let factor = self.loss_scale() / self.batch.gradient_accumulation_steps as f64;
        let _span = Phase::Backward.span().entered();
        let (started, comm_before) = (Instant::now(), self.times.comm());
        let autograd = || -> Result<()> {
            if factor != 1.0 {
                (loss * factor).f_backward()?;
            } else {
                loss.f_backward()?;
            }
            Ok(())
        };
        match self.plan.gradients {
            GradientPath::AfterBackward => autograd()?,
            GradientPath::Hooks => {
                let hooks = self.grad_hooks.take().expect("hooked mode has hooks");
                let ran = hooks.lend(&mut self.gradient_sync(), autograd);
                self.grad_hooks = Some(hooks);
                ran?
            }
            // The walk records its own events, unit by unit.
            GradientPath::UnitWalk => {
                return self.backward_units_impl(model, loss, factor).map(|()| self.end_backward(started, comm_before))
            }
        }
        self.memory_event(|| "backward".into(), &[]);
        self.end_backward(started, comm_before);
        Ok(())
    }

    fn end_backward(&mut self, started: Instant, comm_before: std::time::Duration) {
        self.times.add(Phase::Backward, started.elapsed().saturating_sub(self.times.comm() - comm_before));
    }

    /// Runs `f` as collective time of `phase`.
    fn timed<T>(&mut self, phase: Phase, f: impl FnOnce(&mut Self) -> T) -> T {
        let _span = phase.span().entered();
        let t = Instant::now();
        let out = f(self);
        self.times.add(phase, t.elapsed());
        out
    }

    /// Ends a micro-batch; at the accumulation boundary reduces gradients and steps the optimizer.
    pub fn step(&mut self) -> Result<StepOutcome> {
        if self.is_gradient_accumulation_boundary()
            && self.loss_count == 0
            && self.gradient_fingerprint() == self.grad_mark
        {
            return Err(Error::Usage(
                "engine.step() at an accumulation boundary with no backward since the last step: there are no gradients to apply (call `engine.backward(&loss)` before `engine.step()`)".into(),
            ));
        }
        let outcome = self.step_impl()?;
        variables::sync_buffers(self.comm.as_ref(), self.buffer_sync, &self.buffers)?;
        self.grad_mark = self.gradient_fingerprint();
        Ok(outcome)
    }

    /// What tells a direct `loss.backward()` (outside the engine) from no backward at all: the number of
    /// parameters with a `.grad` plus the version counters of those gradients (autograd bumps them as it
    /// accumulates in place; gradient views share the flat buffer's counter). Units' walks only run through the
    /// engine, which counts their losses.
    fn gradient_fingerprint(&self) -> i64 {
        if self.plan.gradients == GradientPath::UnitWalk {
            return 0;
        }
        self.params.iter().map(Tensor::grad).filter(Tensor::defined).map(|g| g.internal_version() + 1).sum()
    }

    fn step_impl(&mut self) -> Result<StepOutcome> {
        if self.plan.gradients == GradientPath::Hooks {
            let mut sync = self.gradient_sync();
            if sync.gradients_wait_in_grad() {
                // A backward the engine did not run: its gradients are still in `.grad`.
                sync.finish_hooked_reduction()?;
            }
        }
        self.micro_steps += 1;
        let boundary = self.micro_steps % self.batch.gradient_accumulation_steps == 0;
        // After backward: 16-bit models reduce every micro-batch and accumulate in fp32; fp32 models accumulate in
        // autograd. Hooks and unit walks reduced during backward already.
        let after_backward = self.plan.gradients == GradientPath::AfterBackward;
        if self.precision != Precision::Fp32 && after_backward {
            self.timed(Phase::ReduceScatter, Self::reduce_micro_batch)?;
        }
        if !boundary {
            return Ok(StepOutcome::Accumulating);
        }
        if self.precision == Precision::Fp32 && after_backward {
            self.timed(Phase::ReduceScatter, Self::reduce_fp32)?;
        }
        let lr = self.lr();

        // Global squared norm: the ranks' parts are disjoint at stages 1-2, so one all-reduce of a scalar; an
        // inf or NaN anywhere makes it non-finite on every rank, which is how an fp16 overflow is agreed on.
        let mut sq = [norm::sum_of_squares(Grads::F32(self.grads())) as f32];
        if self.plan.partitions_optimizer() {
            self.comm.all_reduce(&mut sq, ReduceOp::Sum)?;
        }
        let loss = self.finish_loss()?;
        let scale = self.loss_scale();
        let overflow = !sq[0].is_finite();
        let skip = match self.scaler.as_mut() {
            Some(scaler) => scaler.update(overflow)? == StepDecision::Skip,
            // bf16.check_grad_overflow (DeepSpeed's default): a non-finite gradient skips the step, no scale to lower.
            None => overflow && self.precision == Precision::Bf16 && self.config.bf16.check_grad_overflow,
        };
        if skip {
            self.skipped_steps += 1;
            self.global_steps += 1;
            self.global_samples += self.batch.train_batch_size;
            self.gradients.clear_accumulator();
            self.gradients.consume()?;
            let scale = self.loss_scale();
            tracing::warn!(
                step = self.global_steps,
                scale,
                "{:?} gradients overflowed; step skipped{}",
                self.precision,
                if self.scaler.is_some() { " (the loss scale drops once the hysteresis is used up)" } else { "" }
            );
            self.end_of_step();
            return Ok(StepOutcome::Skipped { step: self.global_steps, loss, scale });
        }
        let grad_norm = (sq[0] as f64).sqrt() / scale;
        let coef = norm::clip_coefficient(grad_norm, self.config.gradient_clipping) / scale;
        if coef != 1.0 {
            norm::scale_in_place(self.grads(), coef as f32);
        }
        for g in &mut self.groups {
            g.lr = lr;
        }
        // OneCycle's cycle_momentum: beta1 (or SGD's momentum) follows the schedule, as the lr does.
        if let Some(momentum) = self.scheduler.as_ref().and_then(LrScheduler::momentum) {
            self.optimizer.set_momentum(momentum);
        }
        self.timed(Phase::Step, Self::apply_optimizer)?;
        self.memory_event(|| "optimizer step".into(), &[]);
        self.gradients.consume()?;
        match self.plan.after_step() {
            AfterStep::Nothing => {}
            AfterStep::AllGatherFlat => {
                self.timed(Phase::AllGather, |e| views::all_gather(e.comm.as_ref(), &e.flat_params))?;
                self.comm_volume.all_gather_elements += self.layout.padded as u64;
            }
            AfterStep::RefreshGatheredUnits => {
                // Reductions during backward accumulate into the fp32 accumulator across micro-batches.
                self.gradients.clear_accumulator();
                self.timed(Phase::AllGather, Self::refresh_gathered_units)?;
            }
        }
        if let Some(s) = self.scheduler.as_mut() {
            s.step();
        }
        self.global_steps += 1;
        self.global_samples += self.batch.train_batch_size;
        if let Some(every) = self.config.steps_per_print {
            if self.global_steps % every == 0 && self.rank() == 0 {
                let secs = self.step_started.map_or(0.0, |t| t.elapsed().as_secs_f64());
                let samples_per_s = if secs > 0.0 { self.batch.train_batch_size as f64 / secs } else { 0.0 };
                tracing::info!(
                    step = self.global_steps,
                    loss,
                    lr,
                    grad_norm,
                    loss_scale = self.loss_scale(),
                    samples_per_s,
                    "train"
                );
            }
        }
        self.end_of_step();
        Ok(StepOutcome::Stepped { step: self.global_steps, loss, grad_norm, lr })
    }

    /// The fp32 gradients of the optimized range.
    fn grads(&mut self) -> &mut [f32] {
        self.gradients.for_step(&self.optimized)
    }

    /// What reducing gradients needs, borrowed from the engine's fields.
    fn gradient_sync(&mut self) -> gradients::GradientSync<'_> {
        gradients::GradientSync {
            gradients: &mut self.gradients,
            comm: &self.comm,
            layout: &self.layout,
            params: &self.params,
            volume: &mut self.comm_volume,
            times: &mut self.times,
        }
    }

    /// fp32 models at the boundary: reduce, and (stage 1 into a partition buffer) take the partition as fp32.
    fn reduce_fp32(&mut self) -> Result<()> {
        let partitioned = self.plan.partitions_optimizer();
        self.gradient_sync().reduce_after_backward(partitioned)?;
        if !self.gradients.in_flat_buffer() {
            self.gradients.clear_accumulator();
            self.gradients.accumulate_partition();
        }
        Ok(())
    }

    /// 16-bit models, every micro-batch: reduce, accumulate the optimized range in fp32.
    fn reduce_micro_batch(&mut self) -> Result<()> {
        let partitioned = self.plan.partitions_optimizer();
        self.gradient_sync().reduce_after_backward(partitioned)?;
        self.gradients.accumulate_partition();
        self.gradients.consume()
    }

    /// The mean loss over this step's micro-batches and all ranks.
    fn finish_loss(&mut self) -> Result<f64> {
        let mut loss = [(self.loss_sum / self.loss_count.max(1) as f64) as f32];
        self.comm.all_reduce(&mut loss, ReduceOp::Avg)?;
        self.loss_sum = 0.0;
        self.loss_count = 0;
        Ok(loss[0] as f64)
    }

    fn apply_optimizer(&mut self) -> Result<()> {
        if self.steps_a_copy_of_the_shard() {
            return self.apply_optimizer_on_copy();
        }
        // Contiguous in `flat_params`: the flat range at stages 0-1, the shard buffer itself at stage 3.
        let range = self.optimized.range();
        match self.master.as_mut() {
            None => {
                // SAFETY: the optimizer step writes the flat parameters while no forward, backward or collective
                // runs; the gradients it reads are another buffer (the staging or view partition, or grad_acc).
                let params = &mut unsafe { views::slice::<f32>(&self.flat_params) }[range];
                // The only view of the reduced gradients during the step (the parameters are another buffer).
                let grads = self.gradients.for_step(&self.optimized);
                self.optimizer.step(params, grads, &self.groups, None)?;
            }
            Some(master) => {
                // The update writes the 16-bit model copy of the range in the same pass.
                // SAFETY: as above: nothing else touches the flat parameters during the step.
                let out = match self.precision {
                    Precision::Bf16 => {
                        ParamsOut::Bf16(&mut unsafe { views::slice::<half::bf16>(&self.flat_params) }[range])
                    }
                    _ => ParamsOut::F16(&mut unsafe { views::slice::<half::f16>(&self.flat_params) }[range]),
                };
                self.optimizer.step(master, self.gradients.accumulator(), &self.groups, Some(out))?;
                self.gradients.clear_accumulator();
            }
        }
        Ok(())
    }

    /// When this rank's shard is not one contiguous range in memory (stage 2 with units: a chunk of every unit
    /// inside the full parameter buffer; stage 3 with parameters on NVMe), the optimizer steps a contiguous copy
    /// of it (the fp32 values, or the 16-bit output with an fp32 master), which is then written back: a transient
    /// buffer of one shard, not held between steps. 16-bit parameters on NVMe skip the copy.
    fn apply_optimizer_on_copy(&mut self) -> Result<()> {
        if let (Some(master), Some(swapped)) = (self.master.as_mut(), self.swapped_params.as_mut()) {
            // 16-bit parameters on NVMe: step the master, then write each unit's rounded chunk (the same rounding
            // as the step's own 16-bit output), with no copy of the shard.
            self.optimizer.step(master, self.gradients.accumulator(), &self.groups, None)?;
            self.gradients.clear_accumulator();
            return swapped.write_all_from_f32(master);
        }
        if self.master.is_none() {
            let scratch = self.read_shard()?;
            // SAFETY: `scratch` is this step's own copy of the shard.
            self.optimizer.step(
                unsafe { views::slice::<f32>(&scratch) },
                self.gradients.accumulator(),
                &self.groups,
                None,
            )?;
            return self.write_shard(&scratch);
        }
        let scratch = Tensor::zeros([self.optimized.len() as i64], (views::kind_of(self.precision), tch::Device::Cpu));
        // SAFETY: `scratch` was just made here; nothing else holds it.
        let out = match self.precision {
            Precision::Bf16 => ParamsOut::Bf16(unsafe { views::slice::<half::bf16>(&scratch) }),
            _ => ParamsOut::F16(unsafe { views::slice::<half::f16>(&scratch) }),
        };
        let master = self.master.as_mut().expect("checked above");
        self.optimizer.step(master, self.gradients.accumulator(), &self.groups, Some(out))?;
        self.gradients.clear_accumulator();
        self.write_shard(&scratch)
    }
}
