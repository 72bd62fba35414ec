//! The stage plan, tensor-free: which sharding strategy the config asks for, how gradients reach the reduction,
//! the two index spaces the optimizer's values live in, the sizes of the gradient buffers, the bucket cuts of a
//! plain loop, and stage 3's persistence, reuse-distance and prefetch rules. Every stage decision of the engine is
//! a question to [`StagePlan`]: nothing outside this file compares stage numbers.
use std::ops::Range;

use crate::engine::zero::layout::FlatLayout;

/// What ZeRO partitions across the data-parallel ranks (its stages 0-3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// Stage 0: plain data parallelism; gradients all-reduced, every rank steps every parameter.
    Replicated,
    /// Stage 1: optimizer states partitioned; the full gradients are reduce-scattered at the boundary.
    PartitionedOptimizer,
    /// Stage 2: gradients partitioned too, reduced during backward (by units or by hooked buckets).
    PartitionedGradients,
    /// Stage 3: parameters partitioned too, gathered unit by unit while they run.
    PartitionedParameters,
}

impl Strategy {
    /// ZeRO's `zero_optimization.stage` (validated 0-3 by the config).
    pub fn of_stage(stage: u8) -> Strategy {
        match stage {
            0 => Strategy::Replicated,
            1 => Strategy::PartitionedOptimizer,
            2 => Strategy::PartitionedGradients,
            _ => Strategy::PartitionedParameters,
        }
    }
}

/// How the gradients of a backward reach the reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GradientPath {
    /// Autograd accumulates into `.grad` (views of the flat buffer where the dtypes allow); reduced at `step`
    /// (stages 0-1).
    AfterBackward,
    /// Stage 2 of a plain loop: a post-accumulate-grad hook per parameter counts its bucket down; full buckets are
    /// reduced during backward (`grad_hooks.rs`).
    Hooks,
    /// The engine walks the model's units in reverse and reduces each unit's gradients as they are computed
    /// (stage 2 with units, stage 3).
    UnitWalk,
    /// Stage 1 with units split over expert-data-parallel groups ([`StagePlan::split_units_over_groups`]):
    /// autograd accumulates into `.grad` as at stage 1, and the reduction takes the held units one by one, each
    /// over its own ranks, into this rank's chunk of each (stage 2's layout, stage 1's reduction after backward).
    UnitsAfterBackward,
}

/// What follows the optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterStep {
    /// Every rank stepped every parameter (stage 0).
    Nothing,
    /// Every rank's updated partition is all-gathered into the flat parameters (stage 1).
    AllGatherFlat,
    /// Units that are gathered take every rank's new chunk (stage 2: all of them, in place; stage 3: the
    /// persistent and kept ones).
    RefreshGatheredUnits,
}

/// A range of the flat layout: every trainable parameter, padded to the world size (stages 0-1 optimize one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FlatRange(pub Range<usize>);

/// A range of this rank's shard space: the concatenation of its chunk of every unit (stages 2-3 optimize one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardRange(pub Range<usize>);

/// The values this rank's optimizer steps, in the index space they are numbered in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Optimized {
    /// A range of the flat layout: everything at stage 0, the rank's partition at stage 1.
    Flat(FlatRange),
    /// The whole shard space (stages 2-3).
    Shard(ShardRange),
}

impl Optimized {
    pub fn len(&self) -> usize {
        self.range().len()
    }

    /// The range in its own index space.
    pub fn range(&self) -> Range<usize> {
        match self {
            Optimized::Flat(FlatRange(r)) | Optimized::Shard(ShardRange(r)) => r.clone(),
        }
    }
}

/// What the stage and options ask of the layout, the reduction and the communication thread.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StagePlan {
    pub strategy: Strategy,
    pub gradients: GradientPath,
    /// `overlap_comm` with more than one rank at stages 1-3.
    pub overlap: bool,
    /// Hooked stage 2 with overlap and reduce-scatter: two staging halves, one reducing on the communication thread.
    pub hooked_overlap: bool,
    /// `optimizer_in_backward`: stage 3's unit walk steps each reduced part at once (no gradient shard); stage 0
    /// steps each bucket as its all-reduce in backward lands (set only with that all-reduce).
    pub steps_in_backward: bool,
    /// Stage 0 with `overlap_comm` and more than one rank (DDP's bucketed all-reduce): gradient hooks start each
    /// bucket's all-reduce on the communication thread while backward goes on. The engine turns it off where the
    /// gradients are not views of the staging buffer or the ranks do not reduce every step (`grads/all_reduce.rs`).
    pub all_reduce_in_backward: bool,
}

impl StagePlan {
    /// `stage` comes validated from the config (0-3); `has_units`: the program gave the model's units.
    pub fn new(stage: u8, has_units: bool, overlap_comm: bool, reduce_scatter: bool, world_size: usize) -> StagePlan {
        let strategy = Strategy::of_stage(stage);
        let gradients = match strategy {
            Strategy::Replicated | Strategy::PartitionedOptimizer => GradientPath::AfterBackward,
            Strategy::PartitionedGradients if !has_units => GradientPath::Hooks,
            _ => GradientPath::UnitWalk,
        };
        let overlap = overlap_comm && world_size > 1 && strategy != Strategy::Replicated;
        let hooked_overlap = gradients == GradientPath::Hooks && overlap && reduce_scatter;
        let all_reduce_in_backward = overlap_comm && world_size > 1 && strategy == Strategy::Replicated;
        StagePlan { strategy, gradients, overlap, hooked_overlap, steps_in_backward: false, all_reduce_in_backward }
    }

    /// ZeRO's stage number, for reports, manifests and messages.
    pub fn stage(&self) -> u8 {
        match self.strategy {
            Strategy::Replicated => 0,
            Strategy::PartitionedOptimizer => 1,
            Strategy::PartitionedGradients => 2,
            Strategy::PartitionedParameters => 3,
        }
    }

    /// Optimizer states (and the reduced gradients they step with) are divided among ranks: the gradient norm is a
    /// sum over ranks, and each rank saves its own optimizer file.
    pub fn partitions_optimizer(&self) -> bool {
        self.strategy != Strategy::Replicated
    }

    /// Parameters are divided among ranks and gathered unit by unit (stage 3).
    pub fn partitions_parameters(&self) -> bool {
        self.strategy == Strategy::PartitionedParameters
    }

    /// Stage 1 whose units are split over expert-data-parallel groups: laid out by units as stage 2 is (each rank
    /// keeps only the units it holds, and steps its chunk of each), reduced unit by unit after backward. Asked by
    /// the set-up once it knows the layout splits some unit over a group; other stages keep their path.
    pub fn split_units_over_groups(&mut self) {
        if self.strategy == Strategy::PartitionedOptimizer {
            self.gradients = GradientPath::UnitsAfterBackward;
        }
    }

    /// Parameters are laid out unit by unit (stages 2-3, and stage 1 with units split over groups): stage 3
    /// gathers them so, stage 2 reduces gradients so during backward (the model's units, or hook buckets laid out
    /// like units in a plain loop), stage 1 so after it.
    pub fn lays_out_by_units(&self) -> bool {
        matches!(self.strategy, Strategy::PartitionedGradients | Strategy::PartitionedParameters)
            || self.gradients == GradientPath::UnitsAfterBackward
    }

    /// This rank's optimized values are pieces of the full parameter buffer, a chunk of every unit (stage 2, and
    /// stage 1 with units split over groups).
    pub fn shard_in_pieces(&self) -> bool {
        self.strategy == Strategy::PartitionedGradients || self.gradients == GradientPath::UnitsAfterBackward
    }

    /// What brings every rank's updated values to the others after the optimizer step.
    pub fn after_step(&self) -> AfterStep {
        match self.strategy {
            Strategy::Replicated => AfterStep::Nothing,
            Strategy::PartitionedOptimizer if !self.shard_in_pieces() => AfterStep::AllGatherFlat,
            _ => AfterStep::RefreshGatheredUnits,
        }
    }

    /// The engine's collectives run on a communication thread: stage 3's prefetches, stage 1's double-buffered
    /// rounds, hooked stage 2's two staging halves, the unit walk's reductions at stages 2-3 (a unit's while the
    /// backward of the one before it runs), stage 0's buckets all-reduced in backward. Hooked stage 2 without
    /// reduce-scatter all-reduces in line.
    pub fn threaded_comm(&self) -> bool {
        self.all_reduce_in_backward
            || self.overlap
                && (self.strategy != Strategy::PartitionedGradients
                    || self.hooked_overlap
                    || self.gradients == GradientPath::UnitWalk)
    }

    /// Gradient hooks are installed on the parameters: stage 2's in a plain loop, stage 0's all-reduce in backward.
    pub fn hooks_gradients(&self) -> bool {
        self.gradients == GradientPath::Hooks || self.all_reduce_in_backward
    }

    /// Halves of the gradient staging buffer: two where one bucket reduces on the communication thread while the
    /// next is staged (stage 1's rounds with `overlap_comm`, hooked stage 2 with overlap and reduce-scatter).
    pub fn staging_halves(&self) -> usize {
        match self.gradients {
            GradientPath::Hooks if self.hooked_overlap => 2,
            GradientPath::AfterBackward if self.overlap => 2,
            _ => 1,
        }
    }

    /// The values this rank optimizes.
    pub fn optimized(&self, layout: &FlatLayout, rank: usize) -> Optimized {
        match self.strategy {
            Strategy::Replicated => Optimized::Flat(FlatRange(0..layout.padded)),
            _ if self.lays_out_by_units() => Optimized::Shard(ShardRange(0..layout.shard_len(rank))),
            _ => Optimized::Flat(FlatRange(layout.partition(rank))),
        }
    }
}

/// Where the reduced fp32 gradients of the optimized values are when the optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReducedGradients {
    /// In the staging buffer itself: fp32 models at stage 0 reducing in fp32 (the all-reduce's output).
    Staging,
    /// In this rank's partition of the gradient-view buffer: fp32 models at stage 1 reduce it in place.
    ViewPartition,
    /// In the fp32 accumulator: 16-bit models (accumulated over micro-batches), reductions into a partition buffer.
    Accumulator,
    /// Nowhere after backward: stage 3's optimizer in backward steps each reduced part as it arrives.
    Stepped,
}

/// Where the model's `.grad` tensors point (DDP's gradient_as_bucket_view).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GradientViews {
    /// Autograd allocates `.grad` itself (gradients laid out by units, or a communication dtype other than the
    /// model's): gathered into staging before each reduction.
    None,
    /// Views of the staging buffer, which is the whole model (stage 0).
    OfStaging,
    /// Views of a buffer of the whole model beside the staging rounds (stage 1).
    OfOwnBuffer,
}

/// The sizes of the buffers gradients are gathered, reduced and accumulated in (elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GradientSizes {
    /// The staging buffer collectives read: the whole model at stage 0; one round (`reduce_bucket_size`) or two
    /// halves with `overlap_comm` at stage 1; the largest unit, or a round of it, with units; two halves of the
    /// largest bucket with overlapped hooks.
    pub staged: usize,
    /// Elements of each rank's partition reduced per round (rounds of stage 1, rounds of a large unit).
    pub round_len: usize,
    pub views: GradientViews,
    /// This rank's reduced part in the communication dtype, when the reduction does not land in place.
    pub part: Option<usize>,
    /// The fp32 accumulator (the optimized length, or nothing).
    pub accumulator: usize,
    pub reduced: ReducedGradients,
}

impl GradientSizes {
    /// `fp32_model`: the model trains in fp32; `comm_in_model_dtype`: gradients travel in the model's dtype.
    pub fn new(
        plan: &StagePlan,
        layout: &FlatLayout,
        reduce_bucket_size: u64,
        fp32_model: bool,
        comm_in_model_dtype: bool,
        rank: usize,
    ) -> GradientSizes {
        let ws = layout.world_size;
        let partition = layout.partition_len();
        let round_len = (reduce_bucket_size as usize / ws).clamp(1, partition.max(1));
        let largest_unit = layout.units.iter().map(|u| u.range.len()).max().unwrap_or(0);
        let staged = match (plan.strategy, plan.gradients) {
            (Strategy::Replicated, _) => layout.padded,
            (_, GradientPath::Hooks) => largest_unit * plan.staging_halves(),
            // Units larger than a bucket reduce in rounds of `round_len` per rank.
            (_, GradientPath::UnitWalk | GradientPath::UnitsAfterBackward) => largest_unit.min(round_len * ws),
            // Two halves with overlap_comm: one reduces while the next round is gathered into the other.
            _ => round_len * ws * plan.staging_halves(),
        };
        let views = match plan.strategy {
            _ if plan.lays_out_by_units() || !comm_in_model_dtype => GradientViews::None,
            Strategy::Replicated => GradientViews::OfStaging,
            _ => GradientViews::OfOwnBuffer,
        };
        // fp32 models at stage 1 with gradient views reduce each rank's partition in place in the view buffer.
        let fp32_in_place = fp32_model && views != GradientViews::None;
        let part = match plan.gradients {
            _ if !plan.partitions_optimizer() || fp32_in_place => None,
            GradientPath::Hooks => Some(largest_unit / ws * plan.staging_halves()),
            GradientPath::UnitWalk | GradientPath::UnitsAfterBackward => Some((largest_unit / ws).min(round_len)),
            GradientPath::AfterBackward => Some(partition),
        };
        let reduced = match plan.strategy {
            // Stage 0 steps its buckets where they are reduced, in the staging buffer.
            _ if plan.steps_in_backward && plan.partitions_parameters() => ReducedGradients::Stepped,
            _ if !fp32_model => ReducedGradients::Accumulator,
            Strategy::Replicated if comm_in_model_dtype => ReducedGradients::Staging,
            Strategy::PartitionedOptimizer if fp32_in_place => ReducedGradients::ViewPartition,
            _ => ReducedGradients::Accumulator,
        };
        // This rank's optimized length: with units split over groups of ranks, ranks hold different lengths.
        let accumulator = if reduced == ReducedGradients::Accumulator { plan.optimized(layout, rank).len() } else { 0 };
        GradientSizes { staged, round_len, views, part, accumulator, reduced }
    }
}

/// Cuts parameters of `sizes` elements (layout order) into buckets of at most `bucket` elements (a larger
/// parameter is a bucket of its own). Returns each parameter's bucket.
pub(crate) fn bucket_cuts(sizes: &[usize], bucket: u64) -> Vec<usize> {
    let mut out = Vec::with_capacity(sizes.len());
    let (mut current, mut filled) = (0usize, 0u64);
    for &n in sizes {
        if filled > 0 && filled + n as u64 > bucket {
            current += 1;
            filled = 0;
        }
        out.push(current);
        filled += n as u64;
    }
    out
}

/// Stage 3's persistence rule: a unit of fewer than `param_threshold` elements (trainable and frozen: both are
/// gathered together) stays gathered, while the persistent total stays within `model_threshold`.
pub(crate) fn persistent_units(unit_numels: &[u64], param_threshold: u64, model_threshold: u64) -> Vec<bool> {
    let mut total = 0u64;
    unit_numels
        .iter()
        .map(|&n| {
            let persistent = n < param_threshold && total + n <= model_threshold;
            if persistent {
                total += n;
            }
            persistent
        })
        .collect()
}

/// Which units forward leaves gathered because backward reuses them soon: the last one always, and units whose
/// reuse distance (elements of the units after them) is within `max_reuse_distance`, while the live gathered
/// elements stay within `max_live`. Persistent units stay gathered anyway and count only as distance.
pub(crate) fn kept_after_forward(
    sizes: &[u64],
    persistent: &[bool],
    max_reuse_distance: u64,
    max_live: u64,
) -> Vec<bool> {
    let n = sizes.len();
    let mut keep = vec![false; n];
    let (mut later, mut live) = (0u64, 0u64);
    for i in (0..n).rev() {
        let len = sizes[i];
        if persistent[i] {
            later += len;
            continue;
        }
        if i + 1 == n || (later <= max_reuse_distance && live + len <= max_live) {
            keep[i] = true;
            live += len;
        }
        later += len;
    }
    keep
}

/// All-gathers in flight at most, as FSDP's rate limiter: more only holds memory without hiding more latency.
pub(crate) const MAX_GATHERS_IN_FLIGHT: usize = 2;

/// The units to start gathering next, walking `order` (unit indices in execution order after the current one):
/// sharded ones, in order, while their elements fit `bucket` (the first always does), the gathered elements stay
/// within `max_live`, and at most [`MAX_GATHERS_IN_FLIGHT`] counting the `in_flight` ones. `sizes[u]`: unit u's
/// elements; `sharded[u]`: whether it still needs gathering; `live`: elements gathered or in flight now.
pub(crate) fn units_to_prefetch(
    order: impl Iterator<Item = usize>,
    sizes: &[u64],
    sharded: &[bool],
    live: u64,
    in_flight: usize,
    bucket: u64,
    max_live: u64,
) -> Vec<usize> {
    let mut picked = Vec::new();
    let (mut taken, mut live) = (0u64, live);
    for u in order {
        if in_flight + picked.len() >= MAX_GATHERS_IN_FLIGHT {
            break;
        }
        if !sharded[u] {
            continue;
        }
        let n = sizes[u];
        if (!picked.is_empty() && taken + n > bucket) || live + n > max_live {
            break;
        }
        picked.push(u);
        taken += n;
        live += n;
    }
    picked
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, n: i64) -> (String, Vec<i64>, bool) {
        (name.to_string(), vec![n], true)
    }

    /// Two units of 10 and 7 elements at world size 2, or the same parameters flat.
    fn layouts() -> (FlatLayout, FlatLayout) {
        let by_units = FlatLayout::with_units(&[vec![spec("a", 6), spec("b", 4)], vec![spec("c", 7)]], 2);
        let flat = FlatLayout::new(&[spec("a", 6), spec("b", 4), spec("c", 7)], 2);
        (by_units, flat)
    }

    #[test]
    fn each_stage_is_one_strategy_with_its_gradient_path() {
        let cases = [
            (0, false, Strategy::Replicated, GradientPath::AfterBackward),
            (1, true, Strategy::PartitionedOptimizer, GradientPath::AfterBackward),
            (2, false, Strategy::PartitionedGradients, GradientPath::Hooks),
            (2, true, Strategy::PartitionedGradients, GradientPath::UnitWalk),
            (3, false, Strategy::PartitionedParameters, GradientPath::UnitWalk),
            (3, true, Strategy::PartitionedParameters, GradientPath::UnitWalk),
        ];
        for (stage, units, strategy, path) in cases {
            let p = StagePlan::new(stage, units, true, true, 2);
            assert_eq!((p.strategy, p.gradients, p.stage()), (strategy, path, stage));
            assert_eq!(p.lays_out_by_units(), stage >= 2);
            let after = [AfterStep::Nothing, AfterStep::AllGatherFlat][..].get(stage as usize).copied();
            assert_eq!(p.after_step(), after.unwrap_or(AfterStep::RefreshGatheredUnits));
        }
        // Overlap needs two ranks; stage 0's is its all-reduce in backward, from the gradient hooks.
        let stage0 = StagePlan::new(0, false, true, true, 2);
        assert!(stage0.threaded_comm() && stage0.all_reduce_in_backward && stage0.hooks_gradients());
        assert!(!StagePlan::new(0, false, false, true, 2).threaded_comm());
        assert!(!StagePlan::new(0, false, true, true, 1).all_reduce_in_backward);
        assert!(!StagePlan::new(1, false, true, true, 2).hooks_gradients());
        assert!(!StagePlan::new(3, true, true, true, 1).threaded_comm());
        assert!(StagePlan::new(1, false, true, true, 2).threaded_comm());
        assert!(StagePlan::new(2, false, true, true, 2).threaded_comm());
        assert!(!StagePlan::new(2, false, true, false, 2).threaded_comm());
        assert!(StagePlan::new(2, true, true, true, 2).threaded_comm());
        assert!(!StagePlan::new(2, true, false, true, 2).threaded_comm());
        assert!(StagePlan::new(3, true, true, true, 2).threaded_comm());
    }

    #[test]
    fn stage_1_with_units_over_groups_lays_out_as_stage_2_and_reduces_after_backward() {
        let (by_units, _) = layouts();
        let mut p = StagePlan::new(1, true, true, true, 2);
        p.split_units_over_groups();
        assert_eq!((p.stage(), p.gradients), (1, GradientPath::UnitsAfterBackward));
        assert!(p.lays_out_by_units() && p.shard_in_pieces() && p.partitions_optimizer());
        assert!(!p.partitions_parameters() && !p.hooks_gradients());
        assert_eq!(p.after_step(), AfterStep::RefreshGatheredUnits);
        assert_eq!(p.optimized(&by_units, 1), Optimized::Shard(ShardRange(0..9)));
        // The unit rounds' buffers, as the unit walk's: one staging half, a part of the largest unit's chunk.
        let s = GradientSizes::new(&p, &by_units, 100, true, true, 0);
        assert_eq!((s.staged, s.views, s.part, s.accumulator), (10, GradientViews::None, Some(5), 9));
        assert_eq!(s.reduced, ReducedGradients::Accumulator);
        // Other stages keep their path.
        for stage in [0, 2, 3] {
            let mut q = StagePlan::new(stage, true, true, true, 2);
            let before = q.gradients;
            q.split_units_over_groups();
            assert_eq!(q.gradients, before, "stage {stage}");
        }
    }

    #[test]
    fn the_optimized_values_are_a_flat_range_at_stages_0_1_and_the_shard_at_2_3() {
        let (by_units, flat) = layouts();
        assert_eq!(StagePlan::new(0, false, false, true, 2).optimized(&flat, 1), Optimized::Flat(FlatRange(0..18)));
        assert_eq!(StagePlan::new(1, false, false, true, 2).optimized(&flat, 1), Optimized::Flat(FlatRange(9..18)));
        // Units pad to the world size one by one: chunks of 5 and 4.
        let shard = Optimized::Shard(ShardRange(0..9));
        assert_eq!(StagePlan::new(2, true, false, true, 2).optimized(&by_units, 1), shard);
        assert_eq!(StagePlan::new(3, true, false, true, 2).optimized(&by_units, 0), shard);
    }

    #[test]
    fn gradient_buffers_are_sized_by_stage_dtype_and_overlap() {
        let (by_units, flat) = layouts();
        let sizes = |stage, units, overlap, bucket, fp32, same| {
            let p = StagePlan::new(stage, units, overlap, true, 2);
            GradientSizes::new(&p, if stage >= 2 { &by_units } else { &flat }, bucket, fp32, same, 0)
        };
        // Stage 0, fp32: autograd writes into the staging buffer, which is reduced in place.
        let s = sizes(0, false, false, 100, true, true);
        assert_eq!(
            (s.staged, s.views, s.part, s.accumulator, s.reduced),
            (18, GradientViews::OfStaging, None, 0, ReducedGradients::Staging)
        );
        // Stage 0, bf16 model: the same views, accumulated in fp32.
        let s = sizes(0, false, false, 100, false, true);
        assert_eq!((s.part, s.accumulator, s.reduced), (None, 18, ReducedGradients::Accumulator));
        // Stage 1, fp32, rounds of 4 per rank (bucket 8), two halves with overlap.
        let s = sizes(1, false, false, 8, true, true);
        assert_eq!(
            (s.staged, s.round_len, s.views, s.part, s.reduced),
            (8, 4, GradientViews::OfOwnBuffer, None, ReducedGradients::ViewPartition)
        );
        assert_eq!(sizes(1, false, true, 8, true, true).staged, 16);
        // Stage 1 communicating in another dtype: no views, a partition buffer and the accumulator.
        let s = sizes(1, false, false, 8, true, false);
        assert_eq!(
            (s.views, s.part, s.accumulator, s.reduced),
            (GradientViews::None, Some(9), 9, ReducedGradients::Accumulator)
        );
        // Units: the largest unit (10), or a round of it when a bucket is smaller.
        let s = sizes(3, true, false, 100, true, true);
        assert_eq!((s.staged, s.views, s.part, s.accumulator), (10, GradientViews::None, Some(5), 9));
        let s = sizes(3, true, false, 4, true, true);
        assert_eq!((s.staged, s.round_len, s.part), (4, 2, Some(2)));
        // Hooked buckets: one bucket, or two halves with overlap.
        assert_eq!(sizes(2, false, false, 100, true, true).staged, 10);
        let s = sizes(2, false, true, 100, true, true);
        assert_eq!((s.staged, s.part), (20, Some(10)));
    }

    #[test]
    fn buckets_take_whole_parameters_up_to_the_bucket_size() {
        assert_eq!(bucket_cuts(&[4, 4, 4, 10, 1], 8), vec![0, 0, 1, 2, 3]);
        // A parameter larger than the bucket is a bucket of its own, never split.
        assert_eq!(bucket_cuts(&[20, 3], 8), vec![0, 1]);
        assert_eq!(bucket_cuts(&[], 8), Vec::<usize>::new());
    }

    #[test]
    fn units_persist_under_the_parameter_threshold_within_the_model_budget() {
        assert_eq!(persistent_units(&[5, 50, 5, 5], 10, 100), vec![true, false, true, true]);
        // The model threshold caps the persistent total, in order.
        assert_eq!(persistent_units(&[5, 5, 5], 10, 10), vec![true, true, false]);
        assert_eq!(persistent_units(&[5, 5], 0, 100), vec![false, false]);
    }

    #[test]
    fn forward_keeps_the_units_backward_reuses_first() {
        let sizes = [10, 10, 10, 10];
        // Nothing reusable: only the last unit stays.
        assert_eq!(kept_after_forward(&sizes, &[false; 4], 0, 1000), vec![false, false, false, true]);
        // Reuse distance 10: the unit before the last too.
        assert_eq!(kept_after_forward(&sizes, &[false; 4], 10, 1000), vec![false, false, true, true]);
        // The live limit stops it however close.
        assert_eq!(kept_after_forward(&sizes, &[false; 4], 1000, 20), vec![false, false, true, true]);
        // A persistent unit is never "kept" but counts as distance.
        assert_eq!(kept_after_forward(&sizes, &[false, false, true, false], 10, 1000), vec![false, false, false, true]);
    }

    #[test]
    fn prefetch_takes_the_next_sharded_units_within_the_bucket_and_the_live_limit() {
        let sizes = [10, 20, 30, 40];
        let sharded = [true, false, true, true];
        // Unit 1 is gathered already (persistent): skipped. The first unit always fits the bucket.
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 0, 0, 5, 1000), vec![0]);
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 0, 0, 40, 1000), vec![0, 2]);
        // At most two in flight, however large the bucket.
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 0, 0, 1000, 1000), vec![0, 2]);
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 0, 1, 1000, 1000), vec![0]);
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 0, 2, 1000, 1000), Vec::<usize>::new());
        // Never beyond the live limit, not even the first.
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 95, 0, 1000, 100), Vec::<usize>::new());
        // Backward walks down.
        assert_eq!(units_to_prefetch((0..3).rev(), &sizes, &sharded, 0, 0, 30, 1000), vec![2]);
    }
}
