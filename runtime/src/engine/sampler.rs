//! Which samples each rank trains on: torch's DistributedSampler, by global batch.
//!
//! Every epoch is a permutation of the dataset drawn from (seed, epoch) alone; global batch k is samples
//! `k * train_batch_size ..` of it, split into micro-batches; rank r takes micro-batch `m * world_size + r` of
//! accumulation step m. The sequence of global batches therefore never depends on the number of ranks.
use std::ops::Range;

use crate::engine::BatchSizes;

#[derive(Debug, Clone, PartialEq)]
/// torch's DistributedSampler by global batch: every global batch is a function of (seed, epoch, index), split over ranks and micro-batches, so a restart at any world size continues with the next sample.
pub struct DistributedSampler {
    /// Samples in the data set.
    pub dataset_len: usize,
    /// The permutation's seed.
    pub seed: u64,
    /// Shuffle each epoch.
    pub shuffle: bool,
    /// The batch sizes.
    pub batch: BatchSizes,
    /// This rank.
    pub rank: usize,
    /// Data-parallel ranks.
    pub world_size: usize,
}

/// splitmix64, for a permutation that depends only on (seed, epoch).
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl DistributedSampler {
    /// Global batches per epoch (the last partial batch is dropped, as with drop_last).
    pub fn batches_per_epoch(&self) -> usize {
        self.dataset_len / self.batch.train_batch_size as usize
    }

    /// The dataset order of `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.dataset_len).collect();
        if self.shuffle {
            let mut state = self.seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03);
            for i in (1..order.len()).rev() {
                let j = (splitmix(&mut state) % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
        }
        order
    }

    /// Where the run is after `global_samples` samples (the data cursor: `engine.global_samples()`, which checkpoints
    /// record): (epoch, global batch index within it) of the next global batch. The global batch size must be the
    /// one the samples were counted in; the world size need not be.
    pub fn position(&self, global_samples: u64) -> (u64, usize) {
        let batch = global_samples / self.batch.train_batch_size;
        let per_epoch = self.batches_per_epoch().max(1) as u64;
        (batch / per_epoch, (batch % per_epoch) as usize)
    }

    /// This rank's micro-batches of the next global batch after `global_samples` samples ([`Self::position`]).
    pub fn next_micro_batches(&self, global_samples: u64) -> Vec<Vec<usize>> {
        let (epoch, index) = self.position(global_samples);
        self.micro_batches(epoch, index)
    }

    /// The positions within a global batch of this rank's micro-batch `micro` (0 .. accumulation steps).
    pub fn micro_range(&self, micro: u64) -> Range<usize> {
        let m = self.batch.train_micro_batch_size_per_gpu as usize;
        let first = (micro as usize * self.world_size + self.rank) * m;
        first..first + m
    }

    /// This rank's micro-batches of global batch `index` of `epoch`, as dataset indices, one Vec per
    /// accumulation step.
    pub fn micro_batches(&self, epoch: u64, index: usize) -> Vec<Vec<usize>> {
        let order = self.epoch_order(epoch);
        let t = self.batch.train_batch_size as usize;
        let global = &order[index * t..(index + 1) * t];
        (0..self.batch.gradient_accumulation_steps).map(|m| global[self.micro_range(m)].to_vec()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(rank: usize, world: usize, gas: u64) -> DistributedSampler {
        let train = 12;
        let batch = BatchSizes {
            train_batch_size: train,
            train_micro_batch_size_per_gpu: train / (gas * world as u64),
            gradient_accumulation_steps: gas,
        };
        DistributedSampler { dataset_len: 100, seed: 3, shuffle: true, batch, rank, world_size: world }
    }

    #[test]
    fn ranks_cover_each_global_batch_exactly_whatever_the_world_size() {
        let global: Vec<usize> = sampler(0, 1, 1).micro_batches(2, 3).concat();
        assert_eq!(global.len(), 12);
        for (world, gas) in [(2, 1), (3, 2), (4, 3), (2, 3)] {
            let mut got: Vec<usize> =
                (0..world).flat_map(|r| sampler(r, world, gas).micro_batches(2, 3).concat()).collect();
            let mut want = global.clone();
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want, "world {world}, accumulation {gas}");
        }
    }

    #[test]
    fn the_cursor_walks_batches_then_epochs() {
        let s = sampler(1, 2, 1);
        assert_eq!(s.position(0), (0, 0));
        assert_eq!(s.position(12 * 7), (0, 7));
        assert_eq!(s.position(12 * 8), (1, 0));
        assert_eq!(s.next_micro_batches(12 * 9), s.micro_batches(1, 1));
    }

    #[test]
    fn epochs_are_permutations_that_differ() {
        let s = sampler(0, 1, 1);
        let (a, b) = (s.epoch_order(0), s.epoch_order(1));
        assert_ne!(a, b);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(s.batches_per_epoch(), 8);
        assert_eq!(DistributedSampler { shuffle: false, ..s }.epoch_order(5), (0..100).collect::<Vec<_>>());
    }
}
