//! The optimizer in backward (`optimizer_in_backward`, torchtune's `optimizer_in_bwd`): at stage 3 each unit's part
//! of this rank's shard is stepped as soon as its reduced gradients arrive, during the backward walk, so no gradient
//! shard is held between the reduction and the step; at stage 0 each bucket is stepped as its all-reduce in backward
//! lands (`grads/all_reduce.rs`), so the step runs while the buckets after it are still on the wire. The step is taken in pieces (`OptimizerTier::begin_step`
//! once, then `update_range` per reduced bucket), which gives bitwise the values of one whole step because every
//! element's update is its own. What needs every gradient before any update (clipping, accumulation, an overflow
//! that skips the step, LAMB's trust ratio) is refused by the config.
use std::ops::Range;

use tch::Tensor;
use zerorun_optim::Group;

use crate::engine::device::flat_math;
use crate::engine::device::optimizer::DeviceOptimizer;
use crate::engine::device::views;
use crate::engine::zero::optim::build::OptimizerTier;
use crate::engine::zero::swapped_params::SwappedParams;
use crate::error::Result;

/// What a bucket's reduced part is handed to when it is stepped at once ([`crate::engine::zero::grads::bucket::Landing::Step`]).
pub(crate) trait StepPart {
    /// Steps elements `at..at + grads.numel()` of the optimized range with `grads` (fp32, this rank's reduced part).
    fn step_part(&mut self, at: usize, grads: &Tensor) -> Result<()>;
}

/// The step of this optimizer step so far: the squared norm of the gradients stepped (reported as the step's
/// gradient norm once the ranks' parts are summed).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StepInBackward {
    pub sum_of_squares: f64,
}

/// Where the stepped values are.
pub(crate) enum ShardValues<'a> {
    /// The optimized range, in place.
    InMemory(&'a Tensor),
    /// `offload_param.device = nvme`.
    Swapped(&'a mut SwappedParams),
}

/// Steps pieces of this rank's fp32 shard, borrowed from the engine for one backward.
pub(crate) struct ShardStepper<'a> {
    pub tier: &'a mut OptimizerTier,
    /// Groups relative to the optimized range, with this step's learning rate.
    pub groups: &'a [Group],
    /// This rank's values: the shard of every unit in memory (stepped in place), or on NVMe (read, stepped and
    /// written back unit by unit).
    pub values: ShardValues<'a>,
    pub progress: &'a mut StepInBackward,
    pub residence: crate::engine::device::Residence,
    /// Ranges of the optimized values every rank of the model-parallel group holds whole, and how many copies
    /// there are: each rank adds 1/copies of their squares to the norm (as the ordinary step's norm does).
    pub replicated: Option<&'a (Vec<Range<usize>>, usize)>,
}

impl ShardStepper<'_> {
    /// The squares of a part at `at` the norm counts: all of them, less (1 - 1/copies) of the replicated ones'.
    fn sum_of_squares(&self, at: usize, grads: &Tensor) -> Result<f64> {
        let mut sq = flat_math::sum_of_squares(self.residence, grads)?;
        if let Some((ranges, copies)) = self.replicated {
            let n = grads.numel();
            for r in ranges {
                let (start, end) = (r.start.max(at), r.end.min(at + n));
                if start < end {
                    let part = grads.narrow(0, (start - at) as i64, (end - start) as i64);
                    sq -= flat_math::sum_of_squares(self.residence, &part)? * (1.0 - 1.0 / *copies as f64);
                }
            }
        }
        Ok(sq)
    }
}

impl StepPart for ShardStepper<'_> {
    fn step_part(&mut self, at: usize, grads: &Tensor) -> Result<()> {
        let n = grads.numel();
        self.progress.sum_of_squares += self.sum_of_squares(at, grads)?;
        let device_adam = self.tier.as_any_mut().and_then(|a| a.downcast_mut::<DeviceOptimizer>());
        match (&mut self.values, device_adam) {
            // The device path: the part is stepped where the shard lives.
            (ShardValues::InMemory(shard), Some(adam)) => {
                adam.update_range_tensors(at, &shard.narrow(0, at as i64, n as i64), grads, self.groups)
            }
            (ShardValues::InMemory(shard), None) => {
                // SAFETY: `grads` is the bucket's reduced part, finished and not touched again before its half is
                // claimed (stage 0: its all-reduce has landed); the range `at..at + n` is this unit's part, which no
                // gather reads during this unit's reduction (the unit was gathered before its backward; other units'
                // gathers read their own), or at stage 0 the bucket's parameters, which autograd has finished with.
                let (g, params) = unsafe { (views::slice::<f32>(grads), views::slice::<f32>(shard)) };
                Ok(self.tier.update_range(at..at + n, &mut params[at..at + n], g, self.groups, None)?)
            }
            (ShardValues::Swapped(swapped), Some(adam)) => swapped.update_f32(at..at + n, |sub, values| {
                // Host values from NVMe, stepped on the states' device and brought back.
                let on_device = Tensor::f_from_slice(values)?.f_to_device(adam.device())?;
                let part = grads.narrow(0, (sub.start - at) as i64, sub.len() as i64);
                adam.update_range_tensors(sub.start, &on_device, &part, self.groups)?;
                on_device.f_to_device(tch::Device::Cpu)?.f_copy_data(values, sub.len())?;
                Ok(())
            }),
            (ShardValues::Swapped(swapped), None) => {
                // SAFETY: as above, the bucket's reduced part (host memory: the host tiers' reductions land there).
                step_swapped(self.tier, self.groups, swapped, at, unsafe { views::slice::<f32>(grads) })
            }
        }
    }
}

/// Steps elements `at..at + grads.len()` of fp32 values on NVMe with a host tier: each chunk they touch is read,
/// updated and written back (`SwappedParams::update_f32`). A piece of a step begun with `begin_step`: the
/// optimizer in backward's parts, or the whole range when an ordinary step goes unit by unit.
pub(crate) fn step_swapped(
    tier: &mut OptimizerTier,
    groups: &[Group],
    swapped: &mut SwappedParams,
    at: usize,
    grads: &[f32],
) -> Result<()> {
    swapped.update_f32(at..at + grads.len(), |sub, values| {
        Ok(tier.update_range(sub.clone(), values, &grads[sub.start - at..sub.end - at], groups, None)?)
    })
}
