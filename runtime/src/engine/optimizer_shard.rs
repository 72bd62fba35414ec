//! This rank's optimizer side (ZeRO's partitioned optimizer states): the values it optimizes, in their index space
//! ([`Optimized`]), the fp32 master of a 16-bit model, the optimizer states in their tier (memory or NVMe) and the
//! parameter groups. Its step writes this rank's parameters in place where they are one contiguous range, or
//! through a contiguous copy where they are pieces of every unit (stage 2) or on NVMe (stage 3).
use tch::Tensor;
use zerorun_optim::{AlignedVec, Group, ParamsOut};

use super::gradients::Gradients;
use super::layout::FlatLayout;
use super::optimizer::OptimizerTier;
use super::parameters::Parameters;
use super::plan::{Optimized, StagePlan};
use super::views;
use crate::config::Precision;
use crate::error::Result;

pub(super) struct OptimizerShard {
    /// The values this rank steps.
    pub optimized: Optimized,
    /// fp32 master of the optimized range (16-bit models only; fp32 models step the parameters directly).
    pub master: Option<AlignedVec>,
    /// The optimizer and where its states live.
    pub tier: OptimizerTier,
    /// Groups relative to the optimized range (weight decay or not; the schedule's learning rate).
    pub groups: Vec<Group>,
    /// The optimizer's configured learning rate (what the schedule starts from).
    pub base_lr: f64,
}

/// What a step reads and writes beside the optimizer's own state.
pub(super) struct StepTarget<'a> {
    pub parameters: &'a mut Parameters,
    pub gradients: &'a mut Gradients,
    pub layout: &'a FlatLayout,
    pub plan: &'a StagePlan,
    pub precision: Precision,
    pub rank: usize,
}

impl OptimizerShard {
    /// Steps this rank's values with the reduced fp32 gradients (the groups carry the learning rate).
    pub fn step(&mut self, t: StepTarget<'_>) -> Result<()> {
        if t.parameters.steps_a_copy(t.plan) {
            return self.step_on_copy(t);
        }
        // Contiguous in the flat buffer: the flat range at stages 0-1, the shard buffer itself at stage 3.
        let range = self.optimized.range();
        match self.master.as_mut() {
            None => {
                // SAFETY: the optimizer step writes the flat parameters while no forward, backward or collective
                // runs; the gradients it reads are another buffer (the staging or view partition, or the accumulator).
                let params = &mut unsafe { views::slice::<f32>(&t.parameters.flat) }[range];
                // The only view of the reduced gradients during the step (the parameters are another buffer).
                let grads = t.gradients.for_step(&self.optimized);
                self.tier.step(params, grads, &self.groups, None)?;
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
                self.tier.step(master, t.gradients.accumulator(), &self.groups, Some(out))?;
                t.gradients.clear_accumulator();
            }
        }
        Ok(())
    }

    /// When this rank's shard is not one contiguous range in memory (stage 2 with units: a chunk of every unit
    /// inside the full parameter buffer; stage 3 with parameters on NVMe), the optimizer steps a contiguous copy
    /// of it (the fp32 values, or the 16-bit output with an fp32 master), which is then written back: a transient
    /// buffer of one shard, not held between steps. 16-bit parameters on NVMe skip the copy.
    fn step_on_copy(&mut self, t: StepTarget<'_>) -> Result<()> {
        if let (Some(master), Some(swapped)) = (self.master.as_mut(), t.parameters.swapped.as_mut()) {
            // 16-bit parameters on NVMe: step the master, then write each unit's rounded chunk (the same rounding
            // as the step's own 16-bit output), with no copy of the shard.
            self.tier.step(master, t.gradients.accumulator(), &self.groups, None)?;
            t.gradients.clear_accumulator();
            return swapped.write_all_from_f32(master);
        }
        let scratch = match self.master {
            None => t.parameters.read_shard(t.layout, t.rank, t.plan, &self.optimized)?,
            Some(_) => Tensor::zeros([self.optimized.len() as i64], (views::kind_of(t.precision), tch::Device::Cpu)),
        };
        match self.master.as_mut() {
            // SAFETY: `scratch` is this step's own copy of the shard.
            None => self.tier.step(
                unsafe { views::slice::<f32>(&scratch) },
                t.gradients.accumulator(),
                &self.groups,
                None,
            )?,
            Some(master) => {
                // SAFETY: `scratch` was just made here; nothing else holds it.
                let out = match t.precision {
                    Precision::Bf16 => ParamsOut::Bf16(unsafe { views::slice::<half::bf16>(&scratch) }),
                    _ => ParamsOut::F16(unsafe { views::slice::<half::f16>(&scratch) }),
                };
                self.tier.step(master, t.gradients.accumulator(), &self.groups, Some(out))?;
                t.gradients.clear_accumulator();
            }
        }
        t.parameters.write_shard(&scratch, t.layout, t.rank, t.plan, &self.optimized)
    }
}
