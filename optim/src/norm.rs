//! Reductions over a shard for clipping and overflow checks. Sums are taken tile by tile in a fixed order, so
//! they do not depend on the thread count; the engine all-reduces the one scalar a rank returns.
use rayon::prelude::*;

use crate::dispatch::{STAGE, TILE};
use crate::shard::Grads;

/// Sum of squares of a shard, accumulated in f64.
pub fn sum_of_squares(grads: Grads<'_>) -> f64 {
    let n = grads.len();
    let tiles: Vec<f64> = (0..n)
        .step_by(TILE)
        .collect::<Vec<_>>()
        .par_iter()
        .map(|&start| {
            {
                let end = (start + TILE).min(n);
                let mut buf = [0f32; STAGE];
                let mut total = 0f64;
                for s in (start..end).step_by(STAGE) {
                    let r = s..(s + STAGE).min(end);
                    let b = &mut buf[..r.len()];
                    grads.load(r, b);
                    // Eight f64 lanes keep the sum vectorizable and its order fixed.
                    let mut lanes = [0f64; 8];
                    for chunk in b.chunks(8) {
                        for (l, x) in lanes.iter_mut().zip(chunk) {
                            *l += (*x as f64) * (*x as f64);
                        }
                    }
                    total += lanes.iter().sum::<f64>();
                }
                total
            }
        })
        .collect();
    tiles.iter().sum()
}

/// Whether any element is inf or NaN (a loss-scale overflow).
pub fn has_overflow(grads: Grads<'_>) -> bool {
    !sum_of_squares(grads).is_finite()
}

/// Multiplies a shard by `factor` (gradient clipping, unscaling).
pub fn scale_in_place(x: &mut [f32], factor: f32) {
    x.par_chunks_mut(TILE).for_each(|c| c.iter_mut().for_each(|v| *v *= factor));
}

/// The factor that clips gradients of global norm `total_norm` to `max_norm` (torch's clip_grad_norm_ and
/// DeepSpeed's: max_norm / (total_norm + 1e-6), never above 1). `max_norm` 0 disables clipping.
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (total_norm + 1e-6)).min(1.0)
}
