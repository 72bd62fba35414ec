//! Where an optimizer's states live between steps, behind one trait: in memory with the optimizer
//! ([`InMemory`]), or on NVMe by sub-group ([`SwappedOptimizer`](crate::SwappedOptimizer), ZeRO-Infinity's
//! optimizer offload). The engine steps, checkpoints and reports through [`OptimizerTier`] without knowing which.
use std::ops::Range;

use zerorun_optim::{AlignedVec, Grads, Group, Optimizer, OptimizerState, ParamsOut};

use crate::OffloadError;

/// A tier that could not step, save or load: what failed underneath.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error(transparent)]
    /// A swap failed.
    Offload(#[from] OffloadError),
    #[error(transparent)]
    /// The optimizer failed (a state buffer of the wrong length, say).
    Optim(#[from] zerorun_optim::OptimError),
    /// The caller's `fill` of a state load failed (a checkpoint file, say); its message as given.
    #[error("{0}")]
    Fill(Box<dyn std::error::Error + Send + Sync>),
}

/// Writes every state buffer of the optimizer over a range of the optimized elements (checkpoint load).
pub type FillState<'a> = dyn FnMut(Range<usize>, &mut [&mut [f32]]) -> Result<(), TierError> + 'a;

/// An optimizer's states wherever they live, stepped over the optimized elements of one rank.
pub trait OptimizerTier: Send {
    /// The optimizer's name (`Adam`, `AdamW`, ...), as checkpoints record it.
    fn name(&self) -> &'static str;
    /// The state buffers' names, in the order checkpoints store them.
    fn state_names(&self) -> Vec<String>;
    /// Optimizer steps taken (bias correction's t).
    fn step_count(&self) -> u64;
    /// The tier as `Any`, so that an engine reaches a tier of its own kind directly (zerorun's device-path Adam
    /// steps tensors where they live rather than host slices). None by default.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
    /// The optimizer itself where the tier holds one whole in memory (what the engine asks a compressing optimizer:
    /// whether it keeps gradients local, its per-rank state). None for tiers that build optimizers per sub-group.
    fn optimizer(&self) -> Option<&dyn Optimizer> {
        None
    }
    /// [`OptimizerTier::optimizer`], mutable.
    fn optimizer_mut(&mut self) -> Option<&mut dyn Optimizer> {
        None
    }
    /// One step over all the optimized elements; `groups` are relative to them; `out` takes the 16-bit copy.
    fn step(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<(), TierError>;
    /// [`OptimizerTier::step`] with the gradients multiplied by `scale` (clipping's coefficient): bitwise the step
    /// after scaling them in place. Tiers that read the gradients once fold the factor into that read; the default
    /// scales them in place first (so `grads` may be left scaled).
    fn step_scaled(
        &mut self,
        params: &mut [f32],
        grads: &mut [f32],
        scale: f32,
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<(), TierError> {
        if scale != 1.0 {
            zerorun_optim::norm::scale_in_place(grads, scale);
        }
        self.step(params, grads, groups, out)
    }
    /// Starts a step taken in pieces (stage 3's optimizer in backward): advances the step count; each piece is then
    /// an [`OptimizerTier::update_range`]. See [`Optimizer::update_range`].
    fn begin_step(&mut self) -> Result<(), TierError>;
    /// Updates elements `range` of the optimized elements at the current step count; `params`, `grads` and `out`
    /// hold the range's elements, `groups` are the whole range's.
    fn update_range(
        &mut self,
        range: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<(), TierError>;
    /// Ends a step taken in pieces: waits for what the pieces left in flight (NVMe writes), so an I/O error
    /// surfaces in the step that caused it.
    fn finish_step(&mut self) -> Result<(), TierError> {
        Ok(())
    }
    /// The momentum a schedule cycles (see [`Optimizer::set_momentum`]).
    fn set_momentum(&mut self, momentum: f64);
    /// State bytes in host memory between steps (the states themselves, not copies staged for NVMe).
    fn resident_bytes(&self) -> usize;
    /// Host buffers of the tier that are not states: swap buffers and the sub-group being stepped (NVMe).
    fn buffer_bytes(&self) -> usize {
        0
    }
    /// State bytes on NVMe.
    fn swapped_bytes(&self) -> usize;
    /// Writes state buffer `index` over the whole range as little-endian f32 (a checkpoint streams it).
    fn write_state(&mut self, index: usize, w: &mut dyn std::io::Write) -> std::io::Result<()>;
    /// Replaces the state at optimizer step `step`: `fill(range, buffers)` writes every state buffer over `range`.
    fn import_from(&mut self, step: u64, fill: &mut FillState<'_>) -> Result<(), TierError>;
}

/// The states in memory, in the optimizer itself (also `offload_optimizer.device = cpu` on a CPU run, where host
/// memory is the only memory, so nothing is copied).
pub struct InMemory(pub Box<dyn Optimizer>);

impl OptimizerTier for InMemory {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn state_names(&self) -> Vec<String> {
        self.0.state().buffers.iter().map(|(n, _)| n.clone()).collect()
    }

    fn step_count(&self) -> u64 {
        self.0.state().step
    }

    fn optimizer(&self) -> Option<&dyn Optimizer> {
        Some(self.0.as_ref())
    }

    fn optimizer_mut(&mut self) -> Option<&mut dyn Optimizer> {
        Some(self.0.as_mut())
    }

    fn step(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<(), TierError> {
        Ok(self.0.step(params, Grads::F32(grads), groups, out)?)
    }

    fn step_scaled(
        &mut self,
        params: &mut [f32],
        grads: &mut [f32],
        scale: f32,
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<(), TierError> {
        let grads = if scale == 1.0 { Grads::F32(grads) } else { Grads::Scaled(grads, scale) };
        Ok(self.0.step(params, grads, groups, out)?)
    }

    fn begin_step(&mut self) -> Result<(), TierError> {
        self.0.begin_step();
        Ok(())
    }

    fn update_range(
        &mut self,
        range: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<(), TierError> {
        Ok(self.0.update_range(range, params, Grads::F32(grads), groups, out)?)
    }

    fn set_momentum(&mut self, momentum: f64) {
        self.0.set_momentum(momentum);
    }

    fn resident_bytes(&self) -> usize {
        self.0.state().bytes()
    }

    fn swapped_bytes(&self) -> usize {
        0
    }

    fn write_state(&mut self, index: usize, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        let values: &[f32] = &self.0.state().buffers[index].1;
        w.write_all(bytemuck::cast_slice(values))
    }

    /// One call over the whole range, into fresh buffers that then replace the state.
    fn import_from(&mut self, step: u64, fill: &mut FillState<'_>) -> Result<(), TierError> {
        let len = self.0.state().buffers.first().map_or(0, |(_, b)| b.len());
        let mut buffers: Vec<(String, AlignedVec)> =
            self.0.state().buffers.iter().map(|(n, _)| (n.clone(), AlignedVec::filled(len, 0.0))).collect();
        {
            let mut out: Vec<&mut [f32]> = buffers.iter_mut().map(|(_, b)| b.as_mut_slice()).collect();
            fill(0..len, &mut out)?;
        }
        Ok(self.0.state_mut().load(OptimizerState { step, buffers })?)
    }
}
