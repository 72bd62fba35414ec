//! Stage 3's optimizer in backward (`optimizer_in_backward`, torchtune's `optimizer_in_bwd`): each unit's part of
//! this rank's shard is stepped as soon as its reduced gradients arrive, during the backward walk, so no gradient
//! shard is held between the reduction and the step. The step is taken in pieces (`OptimizerTier::begin_step`
//! once, then `update_range` per reduced bucket), which gives bitwise the values of one whole step because every
//! element's update is its own. What needs every gradient before any update (clipping, accumulation, an overflow
//! that skips the step, LAMB's trust ratio) is refused by the config.
use tch::Tensor;
use zerorun_optim::{norm, Grads, Group};

use crate::engine::device::flat_math;
use crate::engine::device::optimizer::DeviceOptimizer;
use crate::engine::device::views;
use crate::engine::zero::optim::build::OptimizerTier;
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

/// Steps pieces of this rank's fp32 shard, borrowed from the engine for one backward.
pub(crate) struct ShardStepper<'a> {
    pub tier: &'a mut OptimizerTier,
    /// Groups relative to the optimized range, with this step's learning rate.
    pub groups: &'a [Group],
    /// This rank's shard of every unit (the optimized range, in place).
    pub shard: &'a Tensor,
    pub progress: &'a mut StepInBackward,
    pub residence: crate::engine::device::Residence,
}

impl StepPart for ShardStepper<'_> {
    fn step_part(&mut self, at: usize, grads: &Tensor) -> Result<()> {
        let n = grads.numel();
        if let Some(adam) = self.tier.as_any_mut().and_then(|a| a.downcast_mut::<DeviceOptimizer>()) {
            // The device path: the part is stepped where the shard lives.
            self.progress.sum_of_squares += flat_math::sum_of_squares(self.residence, grads)?;
            let values = self.shard.narrow(0, at as i64, n as i64);
            return adam.update_range_tensors(at, &values, grads, self.groups);
        }
        // SAFETY: `grads` is the bucket's reduced part, finished and not touched again before its half is claimed;
        // the shard's range `at..at + n` is this unit's part, which no gather reads during this unit's reduction
        // (the unit was gathered before its backward; other units' gathers read their own parts).
        let g = unsafe { views::slice::<f32>(grads) };
        self.progress.sum_of_squares += norm::sum_of_squares(Grads::F32(g));
        let params = &mut unsafe { views::slice::<f32>(self.shard) }[at..at + n];
        self.tier.update_range(at..at + n, params, g, self.groups, None)?;
        Ok(())
    }
}
