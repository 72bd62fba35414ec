//! The optimizer step of the engine: at the accumulation boundary the gradients are reduced (where backward did
//! not already), their global norm agreed on, overflow and clipping applied, and this rank's values stepped in place
//! or through a contiguous copy; then what follows the step by the plan ([`AfterStep`]).
use tch::Tensor;
use zerorun_optim::loss_scale::StepDecision;
use zerorun_optim::norm;
use zerorun_optim::schedule::LrScheduler;

use crate::comm::{Collectives, ReduceOp};
use crate::config::Precision;
use crate::engine::async_training::Synchronization;
use crate::engine::device::flat_math;
use crate::engine::device::views;
use crate::engine::zero::optim::StepTarget;
use crate::engine::zero::plan::{AfterStep, GradientPath};
use crate::engine::zero::variables;
use crate::engine::{Engine, StepOutcome};
use crate::error::{Error, Result};
use crate::fault_tolerance::Verdict;
use crate::report::Phase;

impl Engine {
    /// Ends a micro-batch; at the accumulation boundary reduces gradients and steps the optimizer.
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
    /// let loss = engine.forward(&model, &x)?.square().mean(Kind::Float);
    /// engine.backward_units(&model, &loss)?;
    /// match engine.step()? {
    ///     zerorun_runtime::StepOutcome::Stepped { step, .. } => assert_eq!(step, 1),
    ///     zerorun_runtime::StepOutcome::Skipped { .. } => unreachable!("fp32 gradients never overflow here"),
    ///     zerorun_runtime::StepOutcome::Accumulating => unreachable!("one micro-batch per step"),
    ///     zerorun_runtime::StepOutcome::Discarded { .. } => unreachable!("no fault tolerance here"),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn step(&mut self) -> Result<StepOutcome> {
        let _owner = crate::report::allocations::owned_by(crate::report::allocations::Owner::Engine);
        self.enter_phase(|| "optimizer step".into());
        if self.is_gradient_accumulation_boundary()
            && self.progress.backwards == 0
            && self.gradient_fingerprint() == self.gradients.mark
        {
            return Err(Error::Usage(
                "engine.step() at an accumulation boundary with no backward since the last step: there are no gradients to apply (call `engine.backward(&loss)` before `engine.step()`)".into(),
            ));
        }
        let outcome = self.step_impl()?;
        // Local SGD / DiLoCo: buffers meet with the parameters.
        let met = match (&self.sync, outcome) {
            // Bounded staleness: no collective during training; buffers stay each rank's.
            (Synchronization::Stale(_), _) => false,
            (Synchronization::Synchronous, _) => true,
            (Synchronization::Meetings(m), StepOutcome::Stepped { step, .. }) => m.meets_after(step),
            (Synchronization::Meetings(_), _) => false,
        };
        if met {
            variables::sync_buffers(self.comm.as_ref(), self.states.buffer_sync, &self.states.buffers)?;
            if let Some(replicas) = self.comm.replicas() {
                replicas.with(|g| variables::sync_buffers(g, self.states.buffer_sync, &self.states.buffers))?;
            }
        }
        self.gradients.mark = self.gradient_fingerprint();
        if outcome != StepOutcome::Accumulating {
            crate::engine::fault_tolerant::after_step(self)?;
        }
        Ok(outcome)
    }

    /// What tells a direct `loss.backward()` (outside the engine) from no backward at all
    /// ([`crate::engine::zero::grads::fingerprint`]). Units' walks only run through the engine, which counts their losses.
    pub(super) fn gradient_fingerprint(&self) -> i64 {
        if self.plan.gradients == GradientPath::UnitWalk {
            return 0;
        }
        crate::engine::zero::grads::fingerprint(&self.states.params)
    }

    fn step_impl(&mut self) -> Result<StepOutcome> {
        if self.plan.gradients == GradientPath::Hooks
            && (!self.gradients.defers_reduction || self.is_gradient_accumulation_boundary())
        {
            let mut sync = self.gradient_sync();
            if sync.gradients_wait_in_grad() {
                // A backward the engine did not run: its gradients are still in `.grad`.
                sync.finish_hooked_reduction()?;
            }
        }
        // A 1-bit optimizer's step may take this rank's own gradients (it exchanges its momentum itself).
        let one_bit_local = self.shard.tier.optimizer().is_some_and(|o| o.keeps_gradients_local());
        self.gradients.keep_local(self.config.async_training.is_local() || one_bit_local);
        self.progress.micro_steps += 1;
        let boundary =
            (self.progress.micro_steps - self.progress.micro_at_boundary) % self.batch.gradient_accumulation_steps == 0;
        // After backward: 16-bit models reduce every micro-batch and accumulate in fp32; fp32 models accumulate in
        // autograd. Hooks and unit walks reduced during backward already.
        let after_backward =
            matches!(self.plan.gradients, GradientPath::AfterBackward | GradientPath::UnitsAfterBackward);
        // Bounded staleness pushes the gradients as autograd accumulated them: nothing is reduced.
        if self.precision() != Precision::Fp32 && after_backward && !self.sync.is_stale() {
            self.timed(Phase::ReduceScatter, Self::reduce_micro_batch)?;
        }
        if !boundary {
            return Ok(StepOutcome::Accumulating);
        }
        self.progress.micro_at_boundary = self.progress.micro_steps;
        if self.sync.is_stale() {
            return self.bounded_staleness_step();
        }
        if self.precision() == Precision::Fp32 && after_backward {
            self.timed(Phase::ReduceScatter, Self::reduce_fp32)?;
        }
        let lr = self.lr();
        // The optimizer in backward (stage 3) has stepped already; what is left is the step's bookkeeping.
        let stepped = self.shard.in_backward.take();
        self.states.parameters.keep_chunks_for_step(false);

        // Global squared norm: the ranks' parts are disjoint at stages 1-2, so one all-reduce of a scalar; an
        // inf or NaN anywhere makes it non-finite on every rank, which is how an fp16 overflow is agreed on.
        let mut sq = [match stepped {
            Some(s) => s.sum_of_squares as f32,
            None => self.local_sum_of_squares()? as f32,
        }];
        if self.plan.partitions_optimizer() {
            self.comm.all_reduce(&mut sq, ReduceOp::Sum)?;
        } else if one_bit_local {
            // Each rank's own gradient: the mean of their squared norms (at least the averaged gradient's, and the
            // same on every rank, so clipping and an overflow's skip are agreed on). DeepSpeed clips each rank by
            // its own norm here.
            self.comm.all_reduce(&mut sq, ReduceOp::Avg)?;
        }
        if let Some(others) = &self.placement.model_parallel {
            others.all_reduce(&mut sq, ReduceOp::Sum)?;
        }
        let loss = self.finish_loss()?;
        // Fault tolerance: every cross-group collective of the step is done; the groups commit it or drop it.
        let step = self.progress.global_steps + 1;
        if self.comm.fault_tolerance().map(|ft| ft.vote(step)).transpose()? == Some(Verdict::Discard) {
            return self.discard_step(loss);
        }
        let scale = self.loss_scale();
        let overflow = !sq[0].is_finite();
        let skip = match self.shard.scaler.as_mut() {
            Some(scaler) => scaler.update(overflow)? == StepDecision::Skip,
            // bf16.check_grad_overflow (DeepSpeed's default): a non-finite gradient skips the step, no scale to lower.
            None => overflow && self.precision() == Precision::Bf16 && self.config.bf16.check_grad_overflow,
        };
        if skip {
            return self.skip_step(loss);
        }
        let grad_norm = (sq[0] as f64).sqrt() / scale;
        // Clipping's coefficient (and fp16's unscaling): applied by the optimizer step as it reads the gradients.
        let coef = norm::clip_coefficient(grad_norm, self.config.gradient_clipping) / scale;
        for g in &mut self.shard.groups {
            g.lr = lr;
        }
        // OneCycle's cycle_momentum: beta1 (or SGD's momentum) follows the schedule, as the lr does.
        if let Some(momentum) = self.shard.scheduler.as_ref().and_then(LrScheduler::momentum) {
            self.shard.tier.set_momentum(momentum);
        }
        // 1-bit Adam at stage 1: the partition before the step, whose change the ranks exchange as signs after it.
        let change_as_signs = one_bit_local && self.gradients.sharded_signs.is_some();
        if change_as_signs {
            let own = self.states.layout.partition(self.comm.rank());
            // SAFETY: the flat parameters, read while nothing writes them (before the step).
            let values = unsafe { views::slice::<f32>(&self.states.parameters.flat) };
            self.gradients.sharded_signs.as_mut().expect("checked").keep(&values[own]);
        }
        match stepped {
            None => self.timed(Phase::Step, |e| e.apply_optimizer(coef as f32))?,
            // What the pieces left in flight (NVMe writes of states and values) ends with the step.
            Some(_) => {
                self.shard.tier.finish_step()?;
                if let Some(swapped) = self.states.parameters.swapped.as_mut() {
                    swapped.flush()?;
                }
            }
        }
        self.memory_event(|| "optimizer step".into(), &[]);
        self.gradients.consume()?;
        self.after_step(change_as_signs)?;
        if self.sync.meetings().is_some_and(|m| m.meets_after(self.progress.global_steps + 1)) {
            let _span = Phase::AllGather.span().entered();
            self.meet()?;
        }
        Ok(self.count_step(loss, lr, grad_norm))
    }

    /// Local SGD's and DiLoCo's meeting. A 16-bit model's ranks meet by their fp32 master (the values the next
    /// step starts from), and the parameters take the met values; an fp32 model's parameters are the values.
    fn meet(&mut self) -> Result<()> {
        let Synchronization::Meetings(mut meetings) = std::mem::replace(&mut self.sync, Synchronization::Synchronous)
        else {
            unreachable!("a meeting has meetings")
        };
        let met = match self.shard.master.as_mut() {
            Some(master) => {
                let values = master.shallow_clone();
                meetings.meet(self.residence, self.comm.as_ref(), &values).and_then(|()| self.write_shard(&values))
            }
            None => meetings.meet(self.residence, self.comm.as_ref(), &self.states.parameters.flat),
        };
        self.sync = Synchronization::Meetings(meetings);
        self.report.comm_volume.all_reduce_elements += self.states.layout.padded as u64;
        met
    }

    /// What ends every optimizer step taken: the schedule moves on, the step and its samples are counted and logged.
    fn count_step(&mut self, loss: f64, lr: f64, grad_norm: f64) -> StepOutcome {
        if let Some(s) = self.shard.scheduler.as_mut() {
            s.step();
        }
        self.progress.global_steps += 1;
        self.progress.global_samples += self.batch.train_batch_size;
        self.log_step(loss, lr, grad_norm);
        let times = self.end_of_step();
        self.watch_step(loss, lr, Some(grad_norm), times);
        StepOutcome::Stepped { step: self.progress.global_steps, loss, grad_norm, lr }
    }

    /// Bounded staleness at the boundary: this rank's gradients go to their owners and the next step's values come
    /// back; the loss and the gradient norm are this rank's own (no collective runs).
    fn bounded_staleness_step(&mut self) -> Result<StepOutcome> {
        let lr = self.lr();
        let grads = self.gradients.view_buffer().expect("bounded staleness keeps gradient views");
        let grad_norm = flat_math::sum_of_squares(self.residence, grads)?.sqrt();
        self.timed(Phase::Step, |e| {
            let parts = stale_parts!(e);
            e.sync.stale_mut().expect("bounded staleness").step(&mut e.gradients, parts)
        })?;
        let loss = self.finish_loss()?;
        Ok(self.count_step(loss, lr, grad_norm))
    }

    /// A step the replica groups' vote discarded: gradients dropped, no update, nothing counted; the program redoes
    /// it over the groups of the next quorum.
    fn discard_step(&mut self, loss: f64) -> Result<StepOutcome> {
        self.gradients.clear_accumulator();
        self.gradients.consume()?;
        let step = self.progress.global_steps + 1;
        tracing::warn!(step, "step {step} discarded by the replica groups' vote: it is redone by the groups left");
        self.end_of_step();
        Ok(StepOutcome::Discarded { step, loss })
    }

    /// A step skipped for overflowed gradients: counted, gradients dropped, no update.
    fn skip_step(&mut self, loss: f64) -> Result<StepOutcome> {
        self.progress.skipped_steps += 1;
        self.progress.global_steps += 1;
        self.progress.global_samples += self.batch.train_batch_size;
        self.gradients.clear_accumulator();
        self.gradients.consume()?;
        let scale = self.loss_scale();
        tracing::warn!(
            step = self.progress.global_steps,
            scale,
            "{:?} gradients overflowed; step skipped{}",
            self.precision(),
            if self.shard.scaler.is_some() { " (the loss scale drops once the hysteresis is used up)" } else { "" }
        );
        let times = self.end_of_step();
        self.watch_step(loss, self.lr(), None, times);
        Ok(StepOutcome::Skipped { step: self.progress.global_steps, loss, scale })
    }

    /// What brings every rank's updated values to the others ([`AfterStep`]); `change_as_signs`: 1-bit Adam's
    /// compressed step at stage 1, whose change travels as signs instead of the values.
    fn after_step(&mut self, change_as_signs: bool) -> Result<()> {
        match self.plan.after_step() {
            AfterStep::Nothing => {}
            AfterStep::AllGatherFlat if change_as_signs => {
                let rank = self.comm.rank();
                self.timed(Phase::AllGather, |e| {
                    // SAFETY: the flat parameters, written here while no forward, backward or collective runs.
                    let flat = unsafe { views::slice::<f32>(&e.states.parameters.flat) };
                    e.gradients.sharded_signs.as_mut().expect("checked by the step").gather_change(flat, rank)
                })?;
            }
            AfterStep::AllGatherFlat => {
                self.timed(Phase::AllGather, |e| {
                    views::all_gather(e.residence, e.comm.as_ref(), &e.states.parameters.flat)
                })?;
                self.report.comm_volume.all_gather_elements += self.states.layout.padded as u64;
            }
            AfterStep::RefreshGatheredUnits => {
                // Reductions during backward accumulate into the fp32 accumulator across micro-batches.
                self.gradients.clear_accumulator();
                self.timed(Phase::AllGather, Self::refresh_gathered_units)?;
            }
        }
        Ok(())
    }

    /// `steps_per_print`: rank 0 logs the step's loss, learning rate, norm, scale and throughput.
    fn log_step(&self, loss: f64, lr: f64, grad_norm: f64) {
        let Some(every) = self.config.steps_per_print else { return };
        if self.progress.global_steps % every != 0 || self.rank() != 0 {
            return;
        }
        let secs = self.progress.step_started.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let samples_per_s = if secs > 0.0 { self.batch.train_batch_size as f64 / secs } else { 0.0 };
        tracing::info!(
            step = self.progress.global_steps,
            loss,
            lr,
            grad_norm,
            loss_scale = self.loss_scale(),
            samples_per_s,
            "train"
        );
    }

    /// This rank's share of the squared gradient norm: its optimized gradients, replicated parameters counted by
    /// 1/copies (every rank of the model-parallel group adds them).
    fn local_sum_of_squares(&mut self) -> Result<f64> {
        let g = self.gradients.for_step(&self.shard.optimized);
        // Stage 0 may have summed its buckets as their all-reduces landed in backward.
        let landed = self.gradients.all_reduce_in_backward.as_mut().and_then(|a| a.take_landed_sum_of_squares());
        let sq = match landed {
            Some(sq) => {
                // Every stage-0 test checks the bucket-by-bucket sum against the whole buffer's.
                debug_assert_eq!(sq.to_bits(), flat_math::sum_of_squares(self.residence, &g)?.to_bits());
                sq
            }
            None => flat_math::sum_of_squares(self.residence, &g)?,
        };
        let Some((ranges, copies)) = &self.placement.replicated else { return Ok(sq) };
        let mut replicated = 0.0;
        for r in ranges {
            replicated += flat_math::sum_of_squares(self.residence, &g.narrow(0, r.start as i64, r.len() as i64))?;
        }
        Ok(sq - replicated * (1.0 - 1.0 / *copies as f64))
    }

    /// fp32 models at the boundary: reduce, and (stage 1 into a partition buffer) take the partition as fp32.
    fn reduce_fp32(&mut self) -> Result<()> {
        if self.plan.gradients == GradientPath::UnitsAfterBackward {
            // Into the accumulator, which the step clears after it.
            return self.gradient_sync().reduce_held_units();
        }
        let partitioned = self.plan.partitions_optimizer();
        self.gradient_sync().reduce_after_backward(partitioned)?;
        if !self.gradients.in_flat_buffer() {
            self.gradients.clear_accumulator();
            self.gradients.accumulate_partition()?;
        }
        Ok(())
    }

    /// 16-bit models, every micro-batch: reduce, accumulate the optimized range in fp32.
    fn reduce_micro_batch(&mut self) -> Result<()> {
        if self.plan.gradients == GradientPath::UnitsAfterBackward {
            return self.gradient_sync().reduce_held_units();
        }
        let partitioned = self.plan.partitions_optimizer();
        self.gradient_sync().reduce_after_backward(partitioned)?;
        self.gradients.accumulate_partition()?;
        self.gradients.consume()
    }

    /// The mean loss over this step's micro-batches and all ranks (this rank's between local SGD's meetings).
    fn finish_loss(&mut self) -> Result<f64> {
        let mut loss = [(self.progress.loss_sum / self.progress.loss_count.max(1) as f64) as f32];
        let meets = self.sync.meetings().map_or(true, |m| m.meets_after(self.progress.global_steps + 1));
        if meets && !self.sync.is_stale() {
            self.comm.all_reduce_data(&mut loss, ReduceOp::Avg)?;
        }
        self.progress.loss_sum = 0.0;
        self.progress.loss_count = 0;
        self.progress.backwards = 0;
        Ok(loss[0] as f64)
    }

    fn apply_optimizer(&mut self, grad_scale: f32) -> Result<()> {
        let (rank, precision) = (self.comm.rank(), self.precision());
        self.shard.step(StepTarget {
            grad_scale,
            parameters: &mut self.states.parameters,
            gradients: &mut self.gradients,
            layout: &self.states.layout,
            plan: &self.plan,
            precision,
            rank,
            residence: self.residence,
            comm: &self.comm,
            volume: &mut self.report.comm_volume,
        })
    }

    /// This rank's optimized values in the optimizer's order (see [`parameters::Parameters::read_shard`]).
    pub(super) fn read_shard(&mut self) -> Result<Tensor> {
        let rank = self.comm.rank();
        self.states.parameters.read_shard(&self.states.layout, rank, &self.plan, &self.shard.optimized)
    }

    /// Writes values in the optimizer's order into this rank's part of the parameters.
    pub(super) fn write_shard(&mut self, values: &Tensor) -> Result<()> {
        let rank = self.comm.rank();
        self.states.parameters.write_shard(values, &self.states.layout, rank, &self.plan, &self.shard.optimized)
    }

    /// Runs `f` as collective time of `phase`.
    fn timed<T>(&mut self, phase: Phase, f: impl FnOnce(&mut Self) -> T) -> T {
        let _span = phase.span().entered();
        let t = std::time::Instant::now();
        let out = f(self);
        self.report.times.add(phase, t.elapsed());
        out
    }
}
