//! Where this rank's optimized values live and how the optimizer reaches them: a view of the flat parameter
//! buffer where they are contiguous, the pieces of every unit at stage 2, or the NVMe swap files of stage 3's
//! parameter shard; read as one tensor in the optimizer's order and written back the same way.
use tch::Tensor;

use super::plan::{Optimized, StagePlan};
use super::{Engine, FlatLayout};
use crate::error::Result;

/// This rank's optimized values in the model's dtype: a view of `flat_params` where they are contiguous (stages
/// 0-1, 3's shard), the concatenation of its chunk of every unit at stage 2 (laid out by units).
pub(super) fn shard_values(
    flat_params: &Tensor,
    layout: &FlatLayout,
    rank: usize,
    plan: &StagePlan,
    optimized: &Optimized,
) -> Tensor {
    if plan.shard_in_pieces() {
        let pieces: Vec<Tensor> = layout
            .shard_pieces(rank)
            .into_iter()
            .map(|p| flat_params.narrow(0, p.start as i64, p.len() as i64))
            .collect();
        Tensor::cat(&pieces, 0)
    } else {
        let r = optimized.range();
        flat_params.narrow(0, r.start as i64, r.len() as i64)
    }
}

impl Engine {
    /// Whether the optimizer steps a contiguous copy of the shard rather than the values in place.
    pub(super) fn steps_a_copy_of_the_shard(&self) -> bool {
        self.plan.shard_in_pieces() || self.swapped_params.is_some()
    }

    /// This rank's optimized values in the model's dtype, in the optimizer's order (a view where contiguous in
    /// memory; read from NVMe where the shard is there).
    pub(super) fn read_shard(&mut self) -> Result<Tensor> {
        let len = self.optimized.len();
        if let Some(swapped) = self.swapped_params.as_mut() {
            return swapped.read_all(len);
        }
        Ok(shard_values(&self.flat_params, &self.layout, self.rank(), &self.plan, &self.optimized))
    }

    /// Writes values in the optimizer's order (any float kind) into this rank's part of the parameters.
    pub(super) fn write_shard(&mut self, values: &Tensor) -> Result<()> {
        if let Some(swapped) = self.swapped_params.as_mut() {
            return swapped.write_all(values);
        }
        let values = values.to_kind(self.flat_params.kind());
        tch::no_grad(|| -> Result<()> {
            if self.plan.shard_in_pieces() {
                let mut at = 0i64;
                for piece in self.layout.shard_pieces(self.rank()) {
                    let n = piece.len() as i64;
                    self.flat_params.narrow(0, piece.start as i64, n).f_copy_(&values.narrow(0, at, n))?;
                    at += n;
                }
            } else {
                self.flat_params
                    .narrow(0, self.optimized.range().start as i64, self.optimized.len() as i64)
                    .f_copy_(&values)?;
            }
            Ok(())
        })
    }
}
