//! The engine's place in a model split across ranks: the group holding the model's other parts (a pipeline's
//! stages, a tensor-parallel group), over which the gradient norm and the fp16 overflow verdict are agreed; the
//! parameters every member holds whole (counted once in that norm); and under tensor parallelism, which slice of
//! each whole parameter this rank holds, so that checkpoints save slices by their place in the whole tensor.
use crate::checkpoint::Slice;
use crate::comm::{Collectives, Communicator};
use crate::engine::zero::layout;
use crate::engine::zero::plan;
use crate::engine::Engine;
use crate::error::{Error, Result};

/// The dimension along which parameter `name` is split across a tensor-parallel group (None: held whole).
pub type SplitDim<'a> = dyn Fn(&str) -> Option<usize> + 'a;

/// The engine's place in a model split across ranks (none: the engine holds the whole model).
#[derive(Default)]
pub(crate) struct Placement {
    /// The ranks holding the model's other parts (a pipeline's other stages, a tensor-parallel group): the
    /// gradient norm and fp16 overflow are agreed over them too.
    pub model_parallel: Option<Box<dyn Communicator>>,
    /// Ranges of the optimized values whose parameters every rank of the model-parallel group holds whole, and how
    /// many copies there are: the norm counts them once.
    pub replicated: Option<(Vec<std::ops::Range<usize>>, usize)>,
    /// Tensor parallelism: this rank's slices of the whole parameters.
    pub tensor_parallel: Option<TensorParallelPlace>,
}

/// This rank's part of a tensor-parallel group's model.
pub(crate) struct TensorParallelPlace {
    pub rank: usize,
    pub size: usize,
    /// Per layout slot: the slice of the whole parameter this rank holds, or None when it holds it whole.
    pub slices: Vec<Option<Slice>>,
    /// The tensor-parallel group, for checkpoints: its members' manifests meet at its first rank.
    pub group: Box<dyn Communicator>,
}

impl Engine {
    /// Adds the ranks that hold the model's other parts (every rank of the engine's group calls it with its own
    /// group of them, e.g. its pipeline): the gradient norm, clipping and the fp16 overflow verdict are then agreed
    /// over the whole model, so every part skips or clips the same step.
    pub fn set_model_parallel_group(&mut self, group: Box<dyn Communicator>) {
        self.placement.model_parallel = (group.world_size() > 1).then_some(group);
    }

    /// Parameters (by name) that `copies` ranks of the model-parallel group hold whole with equal gradients, such as
    /// tensor parallelism's layer norms and row-parallel biases: the gradient norm over the group counts them once
    /// (each rank adds 1/copies of their squares), not `copies` times.
    pub fn count_replicated_once(&mut self, copies: usize, replicated: impl Fn(&str) -> bool) {
        let pick = |slot: &layout::ParamSlot| replicated(&slot.name);
        let ranges = match &self.shard.optimized {
            plan::Optimized::Flat(plan::FlatRange(range)) => self.states.layout.runs_where(range.clone(), &pick),
            plan::Optimized::Shard(_) => self.states.layout.shard_runs_where(self.rank(), &pick),
        };
        self.placement.replicated = (copies > 1).then_some((ranges, copies));
    }

    /// Makes this engine one part of a tensor-parallel model: `group` is this rank's tensor-parallel group (a
    /// communicator of its own, not the one the layers' collectives use), and `split_dim(name)` the dimension along
    /// which parameter `name` is split evenly across the group in rank order (None: every member holds it whole).
    /// The gradient norm is then agreed over the group with the whole parameters counted once, and checkpoints
    /// save each slice with its place in the whole tensor, into one checkpoint for the job, which loads at any
    /// tensor-parallel degree (and without tensor parallelism) and which `zerorun consolidate` makes whole.
    pub fn set_tensor_parallel(
        &mut self,
        group: Box<dyn Communicator>,
        split_dim: impl Fn(&str) -> Option<usize>,
    ) -> Result<()> {
        let checkpoints = group.as_ref().split(Some(0), group.rank() as i64)?.expect("every member joins color 0");
        self.place_tensor_parallel(checkpoints, &split_dim)?;
        self.set_model_parallel_group(group);
        Ok(())
    }

    /// Records this rank's slices in the tensor-parallel `group` (see [`Engine::set_tensor_parallel`]) and counts
    /// the whole parameters once in the norm; the norm's group is the caller's to set (a pipeline's spans its
    /// stages too).
    pub(crate) fn place_tensor_parallel(
        &mut self,
        group: Box<dyn Communicator>,
        split_dim: &SplitDim<'_>,
    ) -> Result<()> {
        let (rank, size) = (group.rank(), group.world_size());
        // Buffers and frozen parameters are whole on every member (a checkpoint keeps the first member's): one
        // the caller says is split would come back as that member's slice on every rank.
        let whole_only =
            self.states.buffers.iter().map(|(n, _)| n.clone()).chain(self.frozen_specs().into_iter().map(|s| s.0));
        for name in whole_only {
            if let Some(dim) = split_dim(&name) {
                return Err(Error::Usage(format!(
                    "tensor parallelism: `{name}` is a buffer or a frozen parameter, which every member of the group holds whole, but split_dim gives it dimension {dim}: split only trainable parameters (keep such a layer outside the split, or make its state trainable)"
                )));
            }
        }
        let mut slices = Vec::with_capacity(self.states.layout.slots.len());
        for slot in &self.states.layout.slots {
            slices.push(match split_dim(&slot.name) {
                None => None,
                Some(dim) if dim >= slot.shape.len() => {
                    return Err(Error::Usage(format!(
                        "tensor parallelism: parameter `{}` {:?} has no dimension {dim} to split",
                        slot.name, slot.shape
                    )))
                }
                Some(dim) => {
                    let n = slot.shape[dim];
                    Some(Slice { dim, start: rank as i64 * n, full: n * size as i64 })
                }
            });
        }
        self.count_replicated_once(size, |name| split_dim(name).is_none());
        if size > 1 {
            self.check_whole_parameters_agree(group.as_ref(), &slices)?;
        }
        self.placement.tensor_parallel = (size > 1).then_some(TensorParallelPlace { rank, size, slices, group });
        Ok(())
    }

    /// Every member of the tensor-parallel `group` must start from the same values of the parameters they all hold
    /// whole (`slices[i]` None), or the replicas drift apart with nothing to notice it. Compares one fingerprint
    /// per parameter (a weighted sum of its values, summed over the data-parallel ranks that each optimize a part,
    /// so it does not depend on the partition) across the group; the error names the first that differs.
    fn check_whole_parameters_agree(&mut self, group: &dyn Communicator, slices: &[Option<Slice>]) -> Result<()> {
        let whole: Vec<usize> = (0..slices.len()).filter(|&i| slices[i].is_none()).collect();
        if whole.is_empty() {
            return Ok(());
        }
        let values = self.optimized_values()?;
        let (mut prints, mut scales) = (vec![0f64; whole.len()], vec![0f64; whole.len()]);
        let mut base = 0;
        for piece in self.optimized_pieces(self.rank()) {
            for (k, &i) in whole.iter().enumerate() {
                let slot = &self.states.layout.slots[i].range;
                for e in slot.start.max(piece.start)..slot.end.min(piece.end) {
                    let (v, w) = (values[base + e - piece.start] as f64, 1.0 + ((e - slot.start) % 101) as f64 / 101.0);
                    prints[k] += v * w;
                    scales[k] += v.abs() * w;
                }
            }
            base += piece.len();
        }
        let mut sums: Vec<f32> = prints.iter().chain(&scales).map(|&x| x as f32).collect();
        if self.plan.partitions_optimizer() {
            self.comm.all_reduce(&mut sums, crate::comm::ReduceOp::Sum)?;
        }
        let n = whole.len();
        // The group's largest and smallest fingerprint of each parameter, in one max.
        let mut extremes: Vec<f32> = sums[..n].iter().copied().chain(sums[..n].iter().map(|x| -x)).collect();
        group.all_reduce(&mut extremes, crate::comm::ReduceOp::Max)?;
        for (k, &i) in whole.iter().enumerate() {
            let (max, min) = (extremes[k], -extremes[n + k]);
            if (max - min) as f64 > 1e-5 * sums[n + k] as f64 + 1e-30 {
                return Err(Error::Usage(format!(
                    "tensor parallelism: `{}` is held whole by every member of the tensor-parallel group, but their values differ: build the model from the same seed on every member (libtorch's generator is one per process: threads that draw from it at once interleave), or split it (split_dim)",
                    self.states.layout.slots[i].name
                )));
            }
        }
        Ok(())
    }

    /// The slice of its whole parameter that layout slot `slot` holds (None: the whole).
    pub(crate) fn slot_slice(&self, slot: usize) -> Option<Slice> {
        self.placement.tensor_parallel.as_ref().and_then(|p| p.slices[slot])
    }
}
