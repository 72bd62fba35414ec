//! Reductions over a shard for clipping and overflow checks. Sums are taken tile by tile in a fixed order, so
//! they do not depend on the thread count; the engine all-reduces the one scalar a rank returns.
use std::ops::Range;

use rayon::prelude::*;

use crate::dispatch::{STAGE, TILE};
use crate::shard::Grads;

/// Sum of squares of a shard, accumulated in f64.
pub fn sum_of_squares(grads: Grads<'_>) -> f64 {
    let n = grads.len();
    tile_sums(grads, 0, n, 0..n.div_ceil(TILE)).iter().sum()
}

/// The sums of squares of tiles `tiles` of a buffer of `len` elements (tiles of `TILE` elements from its start;
/// the last may be shorter), each in its fixed order. `grads` holds the buffer's elements from `offset` on, at
/// least those of the tiles.
fn tile_sums(grads: Grads<'_>, offset: usize, len: usize, tiles: Range<usize>) -> Vec<f64> {
    tiles
        .collect::<Vec<_>>()
        .par_iter()
        .map(|&t| {
            let (start, end) = (t * TILE - offset, ((t + 1) * TILE).min(len) - offset);
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
        })
        .collect()
}

/// [`sum_of_squares`] of a buffer taken piece by piece as its ranges become final (stage 0's buckets as their
/// all-reduces land), bitwise the whole buffer's: each tile is summed once every element of it is final, and the
/// tiles are added in order at the end.
#[derive(Debug, Clone)]
pub struct PiecewiseSumOfSquares {
    len: usize,
    /// Final elements of each tile so far.
    final_elements: Vec<usize>,
    sums: Vec<Option<f64>>,
}

impl PiecewiseSumOfSquares {
    /// For a buffer of `len` elements, nothing final yet.
    pub fn new(len: usize) -> PiecewiseSumOfSquares {
        let tiles = len.div_ceil(TILE);
        PiecewiseSumOfSquares { len, final_elements: vec![0; tiles], sums: vec![None; tiles] }
    }

    /// Elements `range` of the buffer are final: sums the tiles that now are, reading them through `read`, which
    /// gives the buffer's elements of the range it is asked for (all of them final). Ranges must not overlap
    /// (each element is final once).
    pub fn add_final<'g>(&mut self, range: Range<usize>, read: impl FnOnce(Range<usize>) -> Grads<'g>) {
        if range.is_empty() {
            return;
        }
        let tiles = range.start / TILE..(range.end - 1) / TILE + 1;
        let mut ready = Vec::new();
        for t in tiles {
            let (start, end) = (t * TILE, ((t + 1) * TILE).min(self.len));
            self.final_elements[t] += range.end.min(end) - range.start.max(start);
            if self.final_elements[t] == end - start {
                ready.push(t);
            }
        }
        // Ready tiles are consecutive: every tile inside the range, and those straddling its ends if now final.
        if let (Some(&first), Some(&last)) = (ready.first(), ready.last()) {
            debug_assert_eq!(ready.len(), last + 1 - first);
            let span = first * TILE..((last + 1) * TILE).min(self.len);
            let sums = tile_sums(read(span.clone()), span.start, self.len, first..last + 1);
            for (t, sum) in (first..last + 1).zip(sums) {
                self.sums[t] = Some(sum);
            }
        }
    }

    /// The whole buffer's sum of squares, once every element is final.
    pub fn total(&self) -> Option<f64> {
        self.sums.iter().copied().sum::<Option<f64>>()
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn piecewise_sum_of_squares_is_bitwise_the_whole_buffers_in_any_landing_order() {
        // 2.5 tiles plus a ragged end; values whose f64 sums round differently when regrouped.
        let n = 2 * TILE + TILE / 2 + 7;
        let g: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 10f32.powi((i % 13) as i32 - 4)).collect();
        let whole = sum_of_squares(Grads::F32(&g));
        // Buckets cut inside tiles, landing last first (stage 0's order), first first, and out of order.
        let cuts = [0, 5, TILE - 3, TILE + 1, 2 * TILE, 2 * TILE + 100, n];
        let ranges: Vec<Range<usize>> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
        let orders: [Vec<usize>; 3] = [(0..6).rev().collect(), (0..6).collect(), vec![2, 5, 0, 3, 1, 4]];
        for order in orders {
            let mut piecewise = PiecewiseSumOfSquares::new(n);
            for (k, &b) in order.iter().enumerate() {
                assert!(piecewise.total().is_none(), "order {order:?}: complete before bucket {k}");
                piecewise.add_final(ranges[b].clone(), |r| Grads::F32(&g[r]));
            }
            assert_eq!(piecewise.total().map(f64::to_bits), Some(whole.to_bits()), "order {order:?}");
        }
        // A naive regrouping (a sum per bucket, then of the buckets) is not bitwise the same here.
        let regrouped: f64 = ranges.iter().map(|r| sum_of_squares(Grads::F32(&g[r.clone()]))).sum();
        assert_ne!(regrouped.to_bits(), whole.to_bits(), "the test's values do round differently");
    }
}
