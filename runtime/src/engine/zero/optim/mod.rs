//! This rank's optimizer side (ZeRO's partitioned optimizer states): the values it optimizes, in their index space
//! ([`Optimized`]), the fp32 master of a 16-bit model, the optimizer states in their tier (memory or NVMe) and the
//! parameter groups. Its step writes this rank's parameters in place where they are one contiguous range, unit by
//! unit where they are on NVMe (stage 3), piece by piece in place where they are pieces of every unit (stage 2, an
//! fp32 model on the host: each unit's all-gather can start as its piece is done), or through a contiguous copy
//! (stage 2 with a 16-bit model's master, or parameters on a device).
//!
//! Two homes: the device path's optimizer ([`DeviceOptimizer`]) keeps its states, the master and the gradients on the model's
//! device and steps them there as tensors; the host tiers (zerorun-optim's optimizers, NVMe) step host slices, and
//! when the engine's buffers are on a device (CPU offload) they step host copies of the values and gradients,
//! written back after the step.
pub(crate) mod build;
pub(crate) mod in_backward;

use tch::{Kind, Tensor};
use zerorun_optim::{Group, ParamsOut};

use crate::config::Precision;
use crate::engine::counters::CommVolume;
use crate::engine::device::optimizer::DeviceOptimizer;
use crate::engine::device::staging::{self, Staged};
use crate::engine::device::views;
use crate::engine::device::{flat_math, Residence};
use crate::engine::engine_comm::EngineComm;
use crate::engine::zero::grads::Gradients;
use crate::engine::zero::layout::FlatLayout;
use crate::engine::zero::optim::build::OptimizerTier;
use crate::engine::zero::parameters::Parameters;
use crate::engine::zero::plan::{Optimized, StagePlan};
use crate::error::Result;

pub(crate) struct OptimizerShard {
    /// The values this rank steps.
    pub optimized: Optimized,
    /// fp32 master of the optimized range (16-bit models only; fp32 models step the parameters directly), where the
    /// optimizer's states live.
    pub master: Option<Tensor>,
    /// The optimizer and where its states live.
    pub tier: OptimizerTier,
    /// Groups relative to the optimized range (weight decay or not; the schedule's learning rate).
    pub groups: Vec<Group>,
    /// The optimizer's configured learning rate (what the schedule starts from).
    pub base_lr: f64,
    /// The learning-rate schedule (`scheduler` in the config).
    pub scheduler: Option<zerorun_optim::schedule::LrScheduler>,
    /// fp16's loss scaler.
    pub scaler: Option<zerorun_optim::LossScaler>,
    /// `optimizer_in_backward`: the step this backward took in pieces, until `step` ends it.
    pub in_backward: Option<in_backward::StepInBackward>,
}

/// What a step reads and writes beside the optimizer's own state.
pub(crate) struct StepTarget<'a> {
    /// What the reduced gradients are multiplied by before the update (clipping's coefficient, fp16's unscaling):
    /// folded into the tier's read of them where the step is one contiguous host step, else applied in place first
    /// ([`scale_first`]). Bitwise the same either way.
    pub grad_scale: f32,
    pub parameters: &'a mut Parameters,
    pub gradients: &'a mut Gradients,
    pub layout: &'a FlatLayout,
    pub plan: &'a StagePlan,
    pub precision: Precision,
    pub rank: usize,
    pub residence: Residence,
    /// The engine's groups: with a communication thread, stage 2's step in pieces starts each unit's all-gather
    /// there (over the unit's group) as soon as its chunk is stepped.
    pub comm: &'a EngineComm,
    pub volume: &'a mut CommVolume,
}

/// Multiplies the reduced gradients by `t.grad_scale` in place: what the steps that do not read them in one pass
/// of a host tier (`OptimizerTier::step_scaled`) do first.
fn scale_first(optimized: &Optimized, t: &StepTarget<'_>) -> Result<()> {
    if t.grad_scale != 1.0 {
        flat_math::scale(t.residence, &t.gradients.for_step(optimized), t.grad_scale)?;
    }
    Ok(())
}

/// Whether `tier` is the device path's optimizer, which keeps the master and the gradients on the model's device.
pub(crate) fn steps_on_device(tier: &mut OptimizerTier) -> bool {
    tier.as_any_mut().is_some_and(|a| a.is::<DeviceOptimizer>())
}

impl OptimizerShard {
    /// The learning rate the next optimizer step uses.
    pub fn lr(&self) -> f64 {
        self.scheduler.as_ref().map_or(self.base_lr, zerorun_optim::schedule::LrScheduler::lr)
    }

    /// Begins this optimizer step before the backward walk reduces anything: the schedule's learning rate (and
    /// cycled momentum) for it, and the optimizer's step count. `step` ends it.
    pub fn begin_step_in_backward(&mut self) -> Result<()> {
        if self.in_backward.is_some() {
            return Err(crate::error::Error::Usage(
                "optimizer_in_backward steps the optimizer during backward: call `engine.step()` after each backward (gradient_accumulation_steps is 1)".into(),
            ));
        }
        let lr = self.lr();
        for g in &mut self.groups {
            g.lr = lr;
        }
        if let Some(momentum) = self.scheduler.as_ref().and_then(zerorun_optim::schedule::LrScheduler::momentum) {
            self.tier.set_momentum(momentum);
        }
        self.tier.begin_step()?;
        self.in_backward = Some(in_backward::StepInBackward::default());
        Ok(())
    }

    /// Steps this rank's values with the reduced fp32 gradients (the groups carry the learning rate).
    pub fn step(&mut self, t: StepTarget<'_>) -> Result<()> {
        if steps_on_device(&mut self.tier) {
            scale_first(&self.optimized, &t)?;
            let adam = self.tier.as_any_mut().and_then(|a| a.downcast_mut::<DeviceOptimizer>()).expect("checked");
            return step_on_device(adam, self.master.as_ref(), &self.optimized, &self.groups, t);
        }
        if self.steps_in_pieces(&t) {
            scale_first(&self.optimized, &t)?;
            return self.step_in_pieces(t);
        }
        if t.parameters.steps_a_copy(t.plan) || t.residence.device_path() {
            scale_first(&self.optimized, &t)?;
            return self.step_on_copy(t);
        }
        // Contiguous in the flat buffer: the flat range at stages 0-1, the shard buffer itself at stage 3.
        let range = self.optimized.range();
        match self.master.as_ref() {
            None => {
                // SAFETY: the optimizer step writes the flat parameters while no forward, backward or collective
                // runs; the gradients it reads are another buffer (the staging or view partition, or the accumulator).
                let params = &mut unsafe { views::slice::<f32>(&t.parameters.flat) }[range];
                let grads = t.gradients.for_step(&self.optimized);
                // SAFETY: the only view of the reduced gradients during the step (the parameters are another buffer).
                let grads = unsafe { views::slice::<f32>(&grads) };
                self.tier.step_scaled(params, grads, t.grad_scale, &self.groups, None)?;
            }
            Some(master) => {
                // The update writes the 16-bit model copy of the range in the same pass.
                // SAFETY: as above: nothing else touches the flat parameters during the step.
                let out = match t.precision {
                    Precision::Bf16 => {
                        ParamsOut::Bf16(&mut unsafe { views::slice::<half::bf16>(&t.parameters.flat) }[range])
                    }
                    _ => ParamsOut::F16(&mut unsafe { views::slice::<half::f16>(&t.parameters.flat) }[range]),
                };
                // SAFETY: the master and the accumulator are this shard's own host buffers, viewed for the step.
                let (master, grads) =
                    unsafe { (views::slice::<f32>(master), views::slice::<f32>(t.gradients.accumulator())) };
                self.tier.step_scaled(master, grads, t.grad_scale, &self.groups, Some(out))?;
                t.gradients.clear_accumulator();
            }
        }
        Ok(())
    }

    /// Whether the step goes unit by unit in place ([`OptimizerShard::step_in_pieces`]): stage 2's chunks of an
    /// fp32 model in host memory, stepped by a host tier (the device path's was dispatched before).
    fn steps_in_pieces(&self, t: &StepTarget<'_>) -> bool {
        t.plan.shard_in_pieces()
            && self.master.is_none()
            && t.parameters.swapped.is_none()
            && !t.residence.device_path()
    }

    /// Stage 2 (see [`OptimizerShard::steps_in_pieces`]): steps this rank's chunk of each unit where it is in the
    /// flat buffer, unit by unit (a step begun once, then a piece per unit: bitwise the whole step, every element's
    /// update being its own), so no copy of the shard is made; with a communication thread each unit's all-gather
    /// starts as soon as its chunk is done, while the next chunk steps.
    fn step_in_pieces(&mut self, t: StepTarget<'_>) -> Result<()> {
        let flat = t.parameters.flat.shallow_clone();
        let grads = t.gradients.for_step(&self.optimized);
        // SAFETY: the step writes this rank's chunks of `flat` while no forward or backward runs; a unit's
        // all-gather, started after its chunk, writes only the peers' chunks of that unit. The reduced gradients
        // are another buffer, read-only here.
        let (values, g) = unsafe { (views::slice::<f32>(&flat), views::slice::<f32>(&grads)) };
        self.tier.begin_step()?;
        let mut at = 0;
        for (i, piece) in t.layout.resident_pieces(t.rank).into_iter().enumerate() {
            let n = piece.len();
            if n > 0 {
                self.tier.update_range(at..at + n, &mut values[piece], &g[at..at + n], &self.groups, None)?;
            }
            at += n;
            // A unit of another expert-parallel position's experts is its ranks' to gather.
            let span = &t.layout.units[i];
            if let (true, Some(thread)) = (span.holds(t.rank), t.comm.thread_of_unit(span)) {
                t.parameters.begin_refresh(i, thread, t.volume);
            }
        }
        self.tier.finish_step()?;
        Ok(())
    }

    /// When this rank's shard is not one contiguous range of host memory (stage 2 with units: a chunk of every
    /// unit inside the full parameter buffer; parameters on a device with the optimizer on the host), the optimizer
    /// steps a contiguous host copy of it (the fp32 values, or the 16-bit output with an fp32 master), which is
    /// then written back: a transient buffer of one shard, not held between steps. Parameters on NVMe skip the
    /// copy: 16-bit ones take the master's rounding unit by unit, fp32 ones are stepped unit by unit.
    fn step_on_copy(&mut self, t: StepTarget<'_>) -> Result<()> {
        if let (Some(master), Some(swapped)) = (self.master.as_ref(), t.parameters.swapped.as_mut()) {
            // 16-bit parameters on NVMe: step the master, then write each unit's rounded chunk (the same rounding
            // as the step's own 16-bit output), with no copy of the shard.
            // SAFETY: the master and the accumulator are this shard's own host buffers, viewed for the step.
            let (master, grads) =
                unsafe { (views::slice::<f32>(master), views::slice::<f32>(t.gradients.accumulator())) };
            self.tier.step(master, grads, &self.groups, None)?;
            t.gradients.clear_accumulator();
            return swapped.write_all_from_f32(master);
        }
        if let (None, Some(swapped)) = (self.master.as_ref(), t.parameters.swapped.as_mut()) {
            // fp32 parameters on NVMe: one step taken unit by unit as each chunk is read (`update_f32`), so no
            // copy of the shard is made; every element's update is its own, so the values are the whole step's.
            let grads = flat_math::on_host(t.residence, &t.gradients.for_step(&self.optimized))?;
            // SAFETY: the reduced gradients (or a host copy of them), read-only during the step.
            let g = unsafe { views::slice::<f32>(grads.values()) };
            self.tier.begin_step()?;
            in_backward::step_swapped(&mut self.tier, &self.groups, swapped, 0, g)?;
            self.tier.finish_step()?;
            return swapped.flush();
        }
        let (len, kind, device) = (self.optimized.len(), views::kind_of(t.precision), t.parameters.flat.device());
        let scratch = match self.master {
            None => {
                flat_math::on_host(t.residence, &t.parameters.read_shard(t.layout, t.rank, t.plan, &self.optimized)?)?
            }
            // The step writes every element of the 16-bit output: a kept staging buffer for device parameters,
            // a transient one otherwise (host memory is not held between steps for it).
            Some(_) if t.residence.device_path() => staging::host_buffer(len, kind, device)?,
            Some(_) => Staged::borrowed(&Tensor::f_zeros([len as i64], (kind, tch::Device::Cpu))?),
        };
        let scratch = scratch.values();
        match self.master.as_ref() {
            None => {
                let grads = flat_math::on_host(t.residence, &t.gradients.for_step(&self.optimized))?;
                let grads = grads.values();
                // SAFETY: `scratch` is this step's own copy of the shard; `grads` the reduced gradients (or a host
                // copy of them), another buffer.
                let (params, grads) = unsafe { (views::slice::<f32>(scratch), views::slice::<f32>(grads)) };
                self.tier.step(params, grads, &self.groups, None)?
            }
            Some(master) => {
                // SAFETY: `scratch` was just made here; nothing else holds it.
                let out = match t.precision {
                    Precision::Bf16 => ParamsOut::Bf16(unsafe { views::slice::<half::bf16>(scratch) }),
                    _ => ParamsOut::F16(unsafe { views::slice::<half::f16>(scratch) }),
                };
                // SAFETY: the master and the accumulator are this shard's own host buffers, viewed for the step.
                let (master, grads) =
                    unsafe { (views::slice::<f32>(master), views::slice::<f32>(t.gradients.accumulator())) };
                self.tier.step(master, grads, &self.groups, Some(out))?;
                t.gradients.clear_accumulator();
            }
        }
        t.parameters.write_shard(scratch, t.layout, t.rank, t.plan, &self.optimized)
    }
}

/// The device path's step: libtorch's kernels on the values where they live. fp32 models step the parameters
/// in place where they are contiguous (else a copy of the shard, written back); 16-bit models step the fp32 master
/// and take its rounding into the parameters.
fn step_on_device(
    adam: &mut DeviceOptimizer,
    master: Option<&Tensor>,
    optimized: &Optimized,
    groups: &[Group],
    t: StepTarget<'_>,
) -> Result<()> {
    match master {
        None => {
            let grads = t.gradients.for_step(optimized);
            if t.parameters.steps_a_copy(t.plan) {
                // Pieces of every unit (stage 2), or read from NVMe into host memory (stage 3): stepped on the
                // optimizer's device, written back where they came from.
                let values =
                    t.parameters.read_shard(t.layout, t.rank, t.plan, optimized)?.f_to_device(adam.device())?;
                adam.step_tensors(&values, &grads, groups)?;
                t.parameters.write_shard(&values, t.layout, t.rank, t.plan, optimized)
            } else {
                let r = optimized.range();
                adam.step_tensors(&t.parameters.flat.narrow(0, r.start as i64, r.len() as i64), &grads, groups)
            }
        }
        Some(master) => {
            adam.step_tensors(master, t.gradients.accumulator(), groups)?;
            t.gradients.clear_accumulator();
            match t.parameters.swapped.as_mut() {
                Some(swapped) => {
                    let host = master.to_device(tch::Device::Cpu).to_kind(Kind::Float).contiguous();
                    // SAFETY: `host` is this call's own copy.
                    swapped.write_all_from_f32(unsafe { views::slice::<f32>(&host) })
                }
                None => t.parameters.write_shard(master, t.layout, t.rank, t.plan, optimized),
            }
        }
    }
}
