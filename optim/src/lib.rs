//! zerorun-optim: optimizers on flat fp32 shards, LR schedules, loss scaling and norms.
//!
//! Knows nothing of tensors or ranks: an optimizer steps a `&mut [f32]` shard with gradients given as f32, bf16 or
//! f16 slices, optionally writing the updated parameters to a 16-bit copy in the same pass. Every element's math is
//! independent of every other's, so results are bitwise the same whatever the thread count or vector width.
#![warn(missing_docs)]
mod adagrad;
mod adam;
pub mod aligned;
mod dispatch;
mod lamb;
mod lion;
pub mod loss_scale;
pub mod norm;
pub mod one_bit;
pub mod schedule;
mod sgd;
mod shard;
mod state;
pub mod traffic;

pub use adagrad::{Adagrad, AdagradConfig};
pub use adam::{Adam, AdamConfig};
pub use aligned::AlignedVec;
pub use dispatch::{simd_level, SimdLevel};
pub use lamb::{Lamb, LambConfig};
pub use lion::{Lion, LionConfig};
pub use loss_scale::{LossScaler, LossScalerConfig, LossScalerState};
pub use one_bit::{
    Exchange, OneBitAdam, OneBitAdamConfig, OneBitLamb, OneBitLambConfig, ZeroOneAdam, ZeroOneAdamConfig,
};
pub use sgd::{Sgd, SgdConfig};
pub use shard::{Grads, Group, ParamsOut};
pub use state::OptimizerState;

/// Errors of this crate: wrong shapes of the inputs of a step, state that does not fit, loss scale at its floor.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimError {
    #[error("{what} has {got} elements, expected {expected}")]
    /// An input of the step has the wrong length.
    Length {
        /// The input.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The shard's.
        expected: usize,
    },
    #[error("parameter group {index} covers {start}..{end}, outside the shard of {len} elements")]
    /// A parameter group reaches outside the shard.
    GroupRange {
        /// The group's index.
        index: usize,
        /// Its first element.
        start: usize,
        /// One past its last.
        end: usize,
        /// The shard's length.
        len: usize,
    },
    #[error("parameter groups {first:?} and {second:?} overlap")]
    /// Two parameter groups cover the same elements.
    GroupOverlap {
        /// One group's range.
        first: std::ops::Range<usize>,
        /// The other's.
        second: std::ops::Range<usize>,
    },
    #[error("the optimizer's exchange between ranks failed: {what}")]
    /// A compressing optimizer's exchange (a collective) failed.
    Exchange {
        /// The collective's error.
        what: String,
    },
    #[error("optimizer state has no buffer `{name}`")]
    /// A state buffer the optimizer needs is missing (a checkpoint of another optimizer).
    MissingState {
        /// The buffer's name (`exp_avg`, ...).
        name: String,
    },
    #[error("{optimizer} cannot step part of its shard: its update reads more than one element (per-tensor norms)")]
    /// A step in pieces was asked of an optimizer whose update needs whole tensors.
    NotElementWise {
        /// Its name.
        optimizer: &'static str,
    },
    #[error("current loss scale {scale} is already at the minimum ({min}) and gradients still overflow")]
    /// fp16's dynamic loss scale cannot shrink further.
    LossScaleAtMinimum {
        /// The current scale.
        scale: f64,
        /// `fp16.min_loss_scale`.
        min: f64,
    },
}

/// This crate's results.
pub type Result<T> = std::result::Result<T, OptimError>;

/// An optimizer over one flat fp32 shard. `step` advances the step count by one.
pub trait Optimizer: Send {
    /// The optimizer's name, as ds_config's `optimizer.type` spells it.
    fn name(&self) -> &'static str;
    /// Updates `params` in place from `grads`, group by group (each group has its own lr and weight decay), and
    /// writes the updated values to `out` when given (the 16-bit model copy).
    fn step(
        &mut self,
        params: &mut [f32],
        grads: Grads<'_>,
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<()> {
        let n = params.len();
        let len = self.state().shard_len().unwrap_or(n);
        if len != n {
            return Err(OptimError::Length { what: "optimizer state", got: len, expected: n });
        }
        shard::check(n, &grads, groups, out.as_ref())?;
        self.begin_step();
        self.update_range(0..n, params, grads, groups, out)
    }
    /// Advances the step count by one and touches no element: a step taken in pieces, each by
    /// [`Optimizer::update_range`] (stage 3's optimizer in backward steps each unit's part as its gradients arrive).
    fn begin_step(&mut self) {
        self.state_mut().step += 1;
    }
    /// Updates elements `range` of the shard at the current step count (set by `begin_step`): `params`, `grads` and
    /// `out` hold the range's elements, `groups` are the whole shard's. Pieces of one step give bitwise the values
    /// of `step` over the whole shard, as every element's math is its own. Optimizers whose update reads more than
    /// one element (LAMB's trust ratio) refuse it.
    fn update_range(
        &mut self,
        range: std::ops::Range<usize>,
        params: &mut [f32],
        grads: Grads<'_>,
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<()>;
    /// The state as plain data (for checkpoints and resharding).
    fn state(&self) -> &OptimizerState;
    /// The state buffers, mutable (checkpoint loads).
    fn state_mut(&mut self) -> &mut OptimizerState;
    /// Sets the momentum a schedule cycles (OneCycle's `cycle_momentum`, as DeepSpeed applies it): beta1 of
    /// optimizers with betas, SGD's momentum. Optimizers without one (Adagrad) keep nothing.
    fn set_momentum(&mut self, _momentum: f64) {}
    /// Whether the next step takes this rank's own gradients, unaveraged: the optimizer exchanges what it needs
    /// itself (the 1-bit optimizers, [`one_bit`]). The engine then skips the gradients' reduction.
    fn keeps_gradients_local(&self) -> bool {
        false
    }
    /// Why the ranks' parameters differ after the last step, if they do (0/1 Adam between local-step meetings):
    /// a checkpoint, which holds one copy of them, cannot be taken then.
    fn ranks_differ(&self) -> Option<String> {
        None
    }
    /// State that is this rank's own and not element-aligned with the shard (the 1-bit optimizers' error
    /// feedback, named `worker_error` / `server_error`; 0/1 Adam's `schedule`), for a checkpoint per rank.
    fn rank_state(&self) -> Vec<(String, Vec<f32>)> {
        Vec::new()
    }
    /// Restores one buffer [`Optimizer::rank_state`] named.
    fn load_rank_state(&mut self, name: &str, _values: &[f32]) -> Result<()> {
        Err(OptimError::MissingState { name: name.into() })
    }
    /// Zeroes what of the rank state cannot be carried to another world size (the error feedback).
    fn reset_rank_state(&mut self) {}
}
