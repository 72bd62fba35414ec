//! Where gradients go: the buffers they are staged, reduced and accumulated in (sized by the plan's
//! [`GradientSizes`]), and the reduction of each gradient path through one [`BucketQueue`]: the rounds of stages
//! 0-1 after backward, and a unit's gradients during the unit walk of stages 2-3 or from stage 2's hooks
//! (`hooks.rs`); stage 0's buckets all-reduced in place from the same hooks during backward (`all_reduce.rs`).
pub(crate) mod all_reduce;
pub(crate) mod bucket;
pub(crate) mod hooks;

use tch::{Device, Kind, Tensor};

use crate::comm::ReduceOp;
use crate::config::{Config, Precision};
use crate::engine::counters::CommVolume;
use crate::engine::device::native;
use crate::engine::device::views;
use crate::engine::device::{flat_math, Residence};
use crate::engine::engine_comm::EngineComm;
use crate::engine::zero::grads::all_reduce::AllReduceInBackward;
use crate::engine::zero::grads::bucket::{Bucket, BucketQueue, Landing, Reduction};
use crate::engine::zero::grads::hooks::Countdown;
use crate::engine::zero::layout::{FlatLayout, UnitRanks};
use crate::engine::zero::optim::in_backward::ShardStepper;
use crate::engine::zero::plan::{GradientPath, GradientSizes, GradientViews, Optimized, ReducedGradients, StagePlan};
use crate::error::{Error, Result};
use crate::report::{Phase, PhaseTimes};

/// The gradient buffers and how they are reduced.
pub(crate) struct Gradients {
    /// The staging buffer the collectives read, in the communication dtype, in one or two halves: all gradients at
    /// stage 0; a reduction round (`reduce_bucket_size` elements: `round_len` of every rank's partition) at stage 1;
    /// a unit or bucket (or a round of one) at stages 2-3.
    queue: BucketQueue,
    /// Stages 0-1 when gradients travel in the model's dtype: the flat buffer the model's `.grad` tensors are views
    /// of (DDP's gradient_as_bucket_view), so autograd accumulates into it and no copy precedes a reduction. At
    /// stage 0 it is the staging buffer itself. Calling `detach_()` on such a gradient fails, as under DDP.
    grad_buffer: Option<Tensor>,
    /// Elements of each rank's partition reduced per round (stage 1).
    round_len: usize,
    /// This rank's reduced gradient partition (stage 1), or a bucket's part of it per staging half (stages 2-3),
    /// in the communication dtype.
    grad_part: Option<Tensor>,
    /// fp32 reduced gradients of the optimized range: accumulated over micro-batches (16-bit models, stages 2-3),
    /// or the boundary's reduction (fp32 models reducing into a partition buffer). Where the optimizer's values
    /// live: on the model's device, or in host memory when the optimizer is offloaded.
    accumulator: Tensor,
    /// Where the reduced fp32 gradients are when the optimizer steps.
    reduced: ReducedGradients,
    how: Reduction,
    /// `zero_optimization.ignore_unused_parameters` is false: a unit's parameter without a gradient is an error.
    refuse_unused: bool,
    /// Where each unit's chunk starts in this rank's shard space (stages 2-3).
    unit_offsets: Vec<usize>,
    /// Stage 2 of a plain loop, stage 0's all-reduce in backward: the hooked buckets' countdown.
    pub countdown: Option<Countdown>,
    /// 1-bit Adam at stage 1: the gradient averaged as signs before the step, the change gathered as signs after.
    pub sharded_signs: Option<crate::engine::compression::ShardedSigns>,
    /// `gradient_compression` PowerSGD (stage 0): the flat gradients averaged as low-rank factors.
    pub powersgd: Option<crate::engine::compression::powersgd::PowerSgd>,
    /// Stage 0 with `overlap_comm`: the buckets all-reduced during backward.
    pub all_reduce_in_backward: Option<AllReduceInBackward>,
    /// The gradient hooks that reduce bucket by bucket during backward (the countdown's).
    pub hooks: Option<hooks::GradHooks>,
    /// The gradients' fingerprint at the end of the last `step` call (see `Engine::gradient_fingerprint`).
    pub mark: i64,
    /// [`crate::engine::Engine::set_requires_gradient_sync`] false on an fp32 model (16-bit ones reduce every
    /// micro-batch anyway): backwards leave their gradients in `.grad`.
    pub defers_reduction: bool,
}

impl Gradients {
    /// Allocates the buffers the plan sizes, and makes the model's `.grad` tensors views of the reduction buffer
    /// where gradients travel in the model's dtype (stages 0-1). The buffers go on the model's `device`, the fp32
    /// accumulator on the optimizer's (`optimizer_device`). A mean divides by `data_world_size`: the shard
    /// group's ranks, times its replicas with shard groups.
    #[allow(clippy::too_many_arguments)] // one call site (the engine's set-up), each argument a distinct input
    pub fn new(
        config: &Config,
        plan: &StagePlan,
        layout: &FlatLayout,
        params: &[Tensor],
        (rank, data_world_size): (usize, usize),
        shared: bool,
        residence: Residence,
        optimizer_device: Device,
    ) -> Result<Self> {
        let device = residence.device();
        let precision = config.precision();
        let comm_kind = views::comm_kind(config.communication_data_type, precision);
        let sizes = GradientSizes::new(
            plan,
            layout,
            config.zero_optimization.reduce_bucket_size,
            precision == Precision::Fp32,
            comm_kind == views::kind_of(precision),
            rank,
        );
        let staging = views::comm_zeros(sizes.staged, comm_kind, shared, device)?;
        let grad_buffer = match sizes.views {
            GradientViews::None => None,
            GradientViews::OfStaging => Some(staging.shallow_clone()),
            GradientViews::OfOwnBuffer => Some(views::comm_zeros(layout.padded, comm_kind, shared, device)?),
        };
        if let Some(g) = &grad_buffer {
            for (slot, t) in layout.slots.iter().zip(params) {
                let view = tch::no_grad(|| {
                    g.narrow(0, slot.range.start as i64, slot.range.len() as i64).view(slot.shape.as_slice())
                });
                native::set_grad(t, &view)?;
            }
        }
        let ws = layout.world_size;
        let unit_offsets = layout
            .units
            .iter()
            .scan(0, |at, u| {
                let start = *at;
                *at += u.held_len(rank, ws);
                Some(start)
            })
            .collect();
        // The hooks' buckets: stage 2's are the layout's units, stage 0's cut from its one unit.
        let (countdown, all_reduce_in_backward) =
            if plan.all_reduce_in_backward && sizes.views == GradientViews::OfStaging {
                let buckets = all_reduce::bucket_slots(layout, config.zero_optimization.reduce_bucket_size);
                (Some(Countdown::new(buckets.clone())), Some(AllReduceInBackward::new(layout, &buckets)))
            } else if plan.gradients == GradientPath::Hooks {
                (Some(Countdown::new(layout.units.iter().map(|u| u.slots.clone()).collect())), None)
            } else {
                (None, None)
            };
        Ok(Gradients {
            queue: BucketQueue::new(staging, plan.staging_halves()),
            grad_buffer,
            round_len: sizes.round_len,
            grad_part: sizes.part.map(|n| Tensor::f_zeros([n as i64], (comm_kind, device))).transpose()?,
            // Pinned when it is host memory that a CUDA model's gradients are copied into (CPU offload).
            accumulator: crate::engine::device::staging::pinned_for(
                Tensor::f_zeros([sizes.accumulator as i64], (Kind::Float, optimizer_device))?,
                device,
            )?,
            reduced: sizes.reduced,
            how: Reduction::new(config, rank, data_world_size, residence),
            refuse_unused: !config.zero_optimization.ignore_unused_parameters,
            unit_offsets,
            countdown,
            all_reduce_in_backward,
            powersgd: config
                .gradient_compression
                .powersgd()
                .map(|p| crate::engine::compression::powersgd::PowerSgd::new(*p, layout)),
            sharded_signs: None,
            hooks: None,
            mark: 0,
            defers_reduction: false,
        })
    }

    /// The buffer of the whole model's gradients the `.grad` tensors are views of (stages 0-1 when gradients
    /// travel in the model's dtype).
    pub fn view_buffer(&self) -> Option<&Tensor> {
        self.grad_buffer.as_ref()
    }

    /// The fp32 accumulator of the optimized range.
    pub fn accumulator(&self) -> &Tensor {
        &self.accumulator
    }

    /// Zeroes the fp32 accumulator (after the step used it, or a skipped step).
    pub fn clear_accumulator(&mut self) {
        let _ = tch::no_grad(|| self.accumulator.zero_());
    }

    /// The fp32 reduced gradients of the optimized range wherever they are ([`ReducedGradients`]), if in a flat
    /// buffer: a view of the staging buffer (stage 0) or of the gradient buffer's partition (stage 1).
    fn reduced_in_flat_buffer(&self, optimized: &Optimized) -> Option<Tensor> {
        match self.reduced {
            ReducedGradients::Staging => Some(self.queue.staging().shallow_clone()),
            ReducedGradients::ViewPartition => self.grad_buffer.as_ref().map(|g| {
                let r = optimized.range();
                g.narrow(0, r.start as i64, r.len() as i64)
            }),
            ReducedGradients::Accumulator | ReducedGradients::Stepped => None,
        }
    }

    /// The fp32 gradients the optimizer steps with (a handle to them: the norm, clipping and the step read and
    /// scale them between the reduction and the next backward): in a flat buffer, or the accumulator.
    pub fn for_step(&self, optimized: &Optimized) -> Tensor {
        self.reduced_in_flat_buffer(optimized).unwrap_or_else(|| self.accumulator.shallow_clone())
    }

    /// Whether the reduced fp32 gradients are in a flat buffer rather than the fp32 accumulator: fp32 models at
    /// stage 0 reduce in the staging buffer, and with gradient views at stage 1 in the partition of the view buffer.
    pub fn in_flat_buffer(&self) -> bool {
        self.reduced != ReducedGradients::Accumulator
    }

    /// Bytes of the view buffer, of staging, of the partition buffer.
    pub fn buffer_bytes(&self) -> (Option<usize>, usize, usize) {
        let bytes = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        (self.grad_buffer.as_ref().map(bytes), bytes(self.queue.staging()), self.grad_part.as_ref().map_or(0, bytes))
    }

    /// Bytes of the fp32 accumulator.
    pub fn accumulator_bytes(&self) -> usize {
        self.accumulator.numel() * 4
    }

    /// After the gradients were used (the optimizer step, or a micro-batch's accumulation into fp32): with gradient
    /// views, zero the buffer autograd accumulates into (without views, the reduction cleared the `.grad` tensors).
    /// Whether this step's gradients stay this rank's own, unreduced: asynchronous training's local steps always,
    /// a 1-bit optimizer's steps when it says so (it exchanges what it needs itself). Set before each reduction.
    pub fn keep_local(&mut self, local: bool) {
        self.how.local = local;
    }

    pub fn consume(&self) -> Result<()> {
        if let Some(g) = &self.grad_buffer {
            let _ = g.shallow_clone().f_zero_()?;
        }
        Ok(())
    }

    /// Stage 1 after a reduction: adds this rank's reduced partition to the fp32 accumulator.
    pub fn accumulate_partition(&mut self) -> Result<()> {
        match &self.grad_part {
            Some(part) => flat_math::accumulate(self.how.residence, &self.accumulator, part),
            None => flat_math::accumulate(self.how.residence, &self.accumulator, self.queue.staging()),
        }
    }
}

/// What tells one state of the gradients from another: the number of parameters with a `.grad` plus the version
/// counters of those gradients (autograd bumps them as it accumulates in place; gradient views share the flat
/// buffer's counter).
pub(crate) fn fingerprint(params: &[Tensor]) -> i64 {
    params.iter().map(Tensor::grad).filter(Tensor::defined).map(|g| g.internal_version() + 1).sum()
}

/// What reducing gradients needs beside the buffers, borrowed from the engine for one call (or for one backward,
/// by the hooks).
pub(crate) struct GradientSync<'a> {
    pub gradients: &'a mut Gradients,
    pub comm: &'a EngineComm,
    pub layout: &'a FlatLayout,
    /// The model's trainable parameters, in layout order.
    pub params: &'a [Tensor],
    pub volume: &'a mut CommVolume,
    pub times: &'a mut PhaseTimes,
    /// Stage 3's optimizer in backward: reduced parts are stepped at once instead of accumulated.
    pub stepper: Option<ShardStepper<'a>>,
}

/// Where this backward's finished buckets land: the stepper when the optimizer runs in backward, else the fp32
/// accumulator.
fn landing<'s>(accumulator: &'s Tensor, stepper: &'s mut Option<ShardStepper<'_>>) -> Landing<'s> {
    match stepper {
        Some(s) => Landing::Step(s),
        None => Landing::Accumulate(accumulator),
    }
}

impl GradientSync<'_> {
    /// After backward (stages 0-1): stage 0 all-reduces every gradient (or, where its hooks all-reduced them during
    /// backward, only applies the post-factor); stage 1 reduce-scatters round by round into this rank's partition,
    /// double-buffered on the communication thread with `overlap_comm`.
    pub fn reduce_after_backward(&mut self, partitioned: bool) -> Result<()> {
        let g = &mut *self.gradients;
        if !partitioned {
            let staging = g.queue.staging().shallow_clone();
            // With gradient views the gradients are in the staging buffer already.
            if g.grad_buffer.is_none() {
                self.gather_grads(&staging, 0..self.layout.padded)?;
            }
            let how = self.gradients.how;
            if how.local {
                self.clear_param_grads();
                return Ok(());
            }
            // Stage 0's hooks may have all-reduced the buckets in backward already (and, with the optimizer in
            // backward, stepped them, post-factor applied).
            let mut stepped = false;
            match self.gradients.all_reduce_in_backward.as_mut().and_then(AllReduceInBackward::take_reduced) {
                Some(mark) if mark != fingerprint(self.params) => return Err(Error::Usage(
                    "gradients were added after stage 0 all-reduced this step's in engine.backward (zero_optimization.overlap_comm): a backward outside engine.backward (loss.backward()) must not follow one inside it before engine.step; run every backward through the engine, or set overlap_comm false".into(),
                )),
                Some(_) => stepped = self.stepper.is_some(),
                None => {
                    if let Some(a) = self.gradients.all_reduce_in_backward.as_mut() {
                        a.forget_landed();
                    }
                    if let Some(pre) = how.pre {
                        let _ = staging.shallow_clone().f_mul_scalar_(pre)?;
                    }
                    let sent = match self.gradients.powersgd.as_mut() {
                        Some(p) => p.average(how.residence, self.comm.as_ref(), &staging)?,
                        None => {
                            views::all_reduce(how.residence, self.comm.as_ref(), &staging, how.op)?;
                            self.layout.padded
                        }
                    };
                    self.volume.all_reduce_elements += sent as u64;
                    if let Some(a) = self.gradients.all_reduce_in_backward.as_mut() {
                        a.add_aside(&staging)?;
                    }
                }
            }
            if let Some(post) = how.post.filter(|_| !stepped) {
                let _ = staging.shallow_clone().f_mul_scalar_(post)?;
            }
            self.clear_param_grads();
            return Ok(());
        }
        let ws = self.layout.world_size;
        let part = self.layout.partition_len();
        if self.gradients.how.local && self.gradients.sharded_signs.is_some() {
            return self.reduce_as_signs(part);
        }
        if self.gradients.powersgd.as_mut().is_some_and(|p| !p.pass_uncompressed()) {
            return self.reduce_by_powersgd(part);
        }
        let round_len = self.gradients.round_len;
        for c in (0..part).step_by(round_len) {
            let l = round_len.min(part - c);
            let g = &mut *self.gradients;
            let staged = g.queue.claim(ws * l, &g.how, &mut Landing::Accumulate(&g.accumulator))?;
            for k in 0..ws {
                self.gather_grads(&staged.narrow(0, (k * l) as i64, l as i64), k * part + c..k * part + c + l)?;
            }
            let out = self.reduced_slice(c, l);
            let g = &mut *self.gradients;
            g.queue.launch(
                Bucket::new(staged, out, None),
                self.comm,
                &g.how,
                self.volume,
                &mut Landing::Accumulate(&g.accumulator),
            )?;
        }
        let g = &mut *self.gradients;
        g.queue.drain(&g.how, &mut Landing::Accumulate(&g.accumulator))?;
        self.clear_param_grads();
        Ok(())
    }

    /// This rank's whole fp32 gradient on the host: the gradient buffer itself where it is one, else a gather.
    fn whole_fp32_gradient(&mut self) -> Result<Tensor> {
        Ok(match &self.gradients.grad_buffer {
            Some(buffer) if buffer.kind() == tch::Kind::Float => buffer.shallow_clone(),
            _ => {
                let t = Tensor::f_zeros([self.layout.padded as i64], (tch::Kind::Float, tch::Device::Cpu))?;
                self.gather_grads(&t, 0..self.layout.padded)?;
                t
            }
        })
    }

    /// PowerSGD at stage 1, once `start_powerSGD_iter` steps have passed: the whole gradient averaged as stage 0
    /// averages it (the same low-rank factors on every rank), and this rank's partition of the average kept. The
    /// wire carries the factors instead of a reduce-scatter; the parameters' all-gather after the step is stage 1's.
    fn reduce_by_powersgd(&mut self, part: usize) -> Result<()> {
        let whole = self.whole_fp32_gradient()?;
        let p = self.gradients.powersgd.as_mut().expect("checked by the caller");
        let sent = p.average(self.gradients.how.residence, self.comm.as_ref(), &whole)?;
        self.volume.all_reduce_elements += sent as u64;
        let start = self.layout.partition(self.gradients.how.rank).start;
        self.reduced_slice(0, part).f_copy_(&whole.narrow(0, start as i64, part as i64))?;
        self.clear_param_grads();
        Ok(())
    }

    /// 1-bit Adam at stage 1 (`compression::ShardedSigns`): this rank's whole fp32 gradient averaged as signs into
    /// its reduced partition.
    fn reduce_as_signs(&mut self, part: usize) -> Result<()> {
        let whole = self.whole_fp32_gradient()?;
        let out = self.reduced_slice(0, part);
        let reduced = Tensor::f_zeros([part as i64], (tch::Kind::Float, tch::Device::Cpu))?;
        {
            // SAFETY: `whole` is read here only (the gradient buffer, or this call's gather of the gradients), and
            // `reduced` is this call's own; the partition `out` views is written after.
            let (g, r) = unsafe { (views::slice::<f32>(&whole), views::slice::<f32>(&reduced)) };
            self.gradients.sharded_signs.as_mut().expect("checked by the caller").reduce_scatter(g, r)?;
        }
        out.shallow_clone().f_copy_(&reduced)?;
        self.clear_param_grads();
        Ok(())
    }

    /// Where elements `c..c+l` of this rank's reduced partition go: in place in the gradient buffer (fp32 with
    /// gradient views: the round's input was copied to staging first), else the partition buffer.
    fn reduced_slice(&self, c: usize, l: usize) -> Tensor {
        let g = &self.gradients;
        match (&g.grad_part, &g.grad_buffer) {
            (Some(part), _) => part.narrow(0, c as i64, l as i64),
            (None, Some(buffer)) => {
                let start = self.layout.partition(self.gradients.how.rank).start;
                buffer.narrow(0, (start + c) as i64, l as i64)
            }
            (None, None) => unreachable!("stage 1 has a partition buffer or gradient views"),
        }
    }

    /// Copies the gradients of flat elements `range` into `dst` (as long as the range). Padding, and parameters
    /// this step did not use (as DDP's ignore_unused_parameters), give zeros.
    fn gather_grads(&self, dst: &Tensor, range: std::ops::Range<usize>) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            let _ = dst.shallow_clone().f_zero_()?;
            let slots = &self.layout.slots;
            let first = slots.partition_point(|s| s.range.end <= range.start);
            for (slot, t) in slots[first..].iter().zip(&self.params[first..]) {
                if slot.range.start >= range.end {
                    break;
                }
                let g = t.grad();
                if g.defined() {
                    let (a, b) = (slot.range.start.max(range.start), slot.range.end.min(range.end));
                    let src = g.reshape([-1]).narrow(0, (a - slot.range.start) as i64, (b - a) as i64);
                    dst.narrow(0, (a - range.start) as i64, (b - a) as i64).f_copy_(&src)?;
                }
            }
            Ok(())
        })
    }

    /// Clears the parameters' gradients for the next micro-batch once the reduction copied them out (without
    /// gradient views; with views the buffer is zeroed by [`Gradients::consume`] once the reduced values were used).
    fn clear_param_grads(&self) {
        if self.gradients.grad_buffer.is_some() {
            return;
        }
        for t in self.params {
            t.shallow_clone().zero_grad();
        }
    }

    /// Reduces unit `i`'s gradients (slot order; None: unused, zeros) into this rank's shard and adds them to the
    /// fp32 accumulator, in rounds of at most one partition half: each round stages its elements of every rank's
    /// chunk, so staging is one bucket, not the largest unit (a unit of 268 MB held 384 MiB of staging and
    /// partition beside its own gradients). On the communication thread a round reduces while the next one, or the
    /// next unit's backward, runs.
    pub fn reduce_unit(&mut self, i: usize, grads: &[Option<Tensor>]) -> Result<()> {
        let span = &self.layout.units[i];
        // The ranks the unit is split over: every rank, or its expert-data-parallel group.
        let ws = span.split(self.layout.world_size);
        let over_experts = span.ranks != UnitRanks::All;
        // A mean over the group is made a mean over every rank (a sum with a post-factor already divides by them).
        let scale =
            (over_experts && self.gradients.how.op == ReduceOp::Avg).then(|| ws as f64 / self.layout.world_size as f64);
        let chunk = span.chunk_len(ws);
        if chunk == 0 {
            // A unit of frozen parameters only.
            return Ok(());
        }
        self.check_unused_parameters(i, grads)?;
        let started = std::time::Instant::now();
        let g = &mut *self.gradients;
        let part = g.grad_part.as_ref().expect("units have a gradient part").shallow_clone();
        let part_half = part.numel() / g.queue.halves();
        let round = part_half.min(chunk).max(1);
        let offset = g.unit_offsets[i];
        for c in (0..chunk).step_by(round) {
            let l = round.min(chunk - c);
            let g = &mut *self.gradients;
            let half = g.queue.next_half();
            let staged = g.queue.claim(ws * l, &g.how, &mut landing(&g.accumulator, &mut self.stepper))?;
            self.stage_unit_round(i, grads, &staged, c, l)?;
            let out = part.narrow(0, (half * part_half) as i64, l as i64);
            let g = &mut *self.gradients;
            let bucket = Bucket { staged, out, lands_at: Some(offset + c), over_experts, scale };
            let mut landing = landing(&g.accumulator, &mut self.stepper);
            g.queue.launch(bucket, self.comm, &g.how, self.volume, &mut landing)?;
        }
        self.times.add(Phase::ReduceScatter, started.elapsed());
        Ok(())
    }

    /// Stage 1 with units split over groups, after backward: each unit this rank holds reduced from the
    /// parameters' `.grad` over its own ranks (every rank, or its expert-data-parallel group) into this rank's
    /// chunk of it, added to the fp32 accumulator; then the `.grad` tensors are zeroed for the next micro-batch.
    /// Every rank walks the units in layout order, so each group's ranks meet its units in one order.
    pub fn reduce_held_units(&mut self) -> Result<()> {
        let rank = self.gradients.how.rank;
        for i in 0..self.layout.units.len() {
            let span = &self.layout.units[i];
            if !span.holds(rank) {
                continue;
            }
            let grads: Vec<Option<Tensor>> =
                self.params[span.slots.clone()].iter().map(|t| Some(t.grad()).filter(Tensor::defined)).collect();
            self.reduce_unit(i, &grads)?;
        }
        self.drain()?;
        self.clear_param_grads();
        Ok(())
    }

    /// Finishes every reduction in flight (the end of a backward, before anything reads the accumulator).
    pub fn drain(&mut self) -> Result<()> {
        let g = &mut *self.gradients;
        g.queue.drain(&g.how, &mut landing(&g.accumulator, &mut self.stepper))
    }

    /// Copies elements `c..c+l` of every rank's chunk of unit `i`'s gradients (slot order; None: zeros) into
    /// `staged` (`ws * l` long, rank by rank). The whole unit (`c` 0, `l` the chunk) is the unit's flat gradient,
    /// staged slot by slot. Only what no gradient covers is zeroed (padding, unused parameters): zeroing it all
    /// first was one more pass over every unit's gradients each step.
    fn stage_unit_round(&self, i: usize, grads: &[Option<Tensor>], staged: &Tensor, c: usize, l: usize) -> Result<()> {
        let span = &self.layout.units[i];
        let ws = span.split(self.layout.world_size);
        let chunk = span.chunk_len(ws);
        let slots = &self.layout.slots[span.slots.clone()];
        tch::no_grad(|| -> Result<()> {
            // Where each copy lands in `staged`, in order.
            let mut covered: Vec<(usize, usize)> = Vec::with_capacity(slots.len());
            if c == 0 && l == chunk {
                for (slot, g) in slots.iter().zip(grads) {
                    if let Some(g) = g {
                        let at = slot.range.start - span.range.start;
                        staged.narrow(0, at as i64, slot.range.len() as i64).f_copy_(&g.reshape([-1]))?;
                        covered.push((at, slot.range.len()));
                    }
                }
            } else {
                for k in 0..ws {
                    // Unit-relative range of this round in rank k's chunk.
                    let (lo, hi) = (k * chunk + c, k * chunk + c + l);
                    for (slot, g) in slots.iter().zip(grads) {
                        let Some(g) = g else { continue };
                        let (s, e) = (slot.range.start - span.range.start, slot.range.end - span.range.start);
                        let (a, b) = (s.max(lo), e.min(hi));
                        if a >= b {
                            continue;
                        }
                        let src = g.reshape([-1]).narrow(0, (a - s) as i64, (b - a) as i64);
                        staged.narrow(0, (k * l + a - lo) as i64, (b - a) as i64).f_copy_(&src)?;
                        covered.push((k * l + a - lo, b - a));
                    }
                }
            }
            covered.sort_unstable();
            let mut from = 0;
            for (at, len) in covered.into_iter().chain([(ws * l, 0)]) {
                if at > from {
                    let _ = staged.narrow(0, from as i64, (at - from) as i64).f_zero_()?;
                }
                from = from.max(at + len);
            }
            Ok(())
        })
    }

    /// With `zero_optimization.ignore_unused_parameters` false, a trainable parameter of unit (or bucket) `i` that
    /// got no gradient in this backward is an error naming it (DeepSpeed's check for static graphs). Stages 2-3
    /// only: they see each parameter's gradient as it is reduced; the config notices the key at stages 0-1.
    fn check_unused_parameters(&self, i: usize, grads: &[Option<Tensor>]) -> Result<()> {
        if !self.gradients.refuse_unused {
            return Ok(());
        }
        let slots = &self.layout.slots[self.layout.units[i].slots.clone()];
        match slots.iter().zip(grads).find(|(_, g)| g.is_none()) {
            None => Ok(()),
            Some((slot, _)) => Err(Error::Parameter {
                name: slot.name.clone(),
                why: "got no gradient in this backward (it took no part in the loss), and zero_optimization.ignore_unused_parameters is false".into(),
            }),
        }
    }
}
