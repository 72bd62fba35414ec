//! The engine's place in a model split across ranks: the group holding the model's other parts (a pipeline's
//! stages, a tensor-parallel group), over which the gradient norm and the fp16 overflow verdict are agreed; the
//! parameters every member holds whole (counted once in that norm); and under tensor parallelism, which slice of
//! each whole parameter this rank holds, so that checkpoints save slices by their place in the whole tensor.
use super::{layout, plan, Engine};
use crate::checkpoint::Slice;
use crate::comm::{Collectives, Communicator};
use crate::error::{Error, Result};

/// The dimension along which parameter `name` is split across a tensor-parallel group (None: held whole).
pub type SplitDim<'a> = dyn Fn(&str) -> Option<usize> + 'a;

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
        self.model_parallel = (group.world_size() > 1).then_some(group);
    }

    /// Parameters (by name) that `copies` ranks of the model-parallel group hold whole with equal gradients, such as
    /// tensor parallelism's layer norms and row-parallel biases: the gradient norm over the group counts them once
    /// (each rank adds 1/copies of their squares), not `copies` times.
    pub fn count_replicated_once(&mut self, copies: usize, replicated: impl Fn(&str) -> bool) {
        let pick = |slot: &layout::ParamSlot| replicated(&slot.name);
        let ranges = match &self.shard.optimized {
            plan::Optimized::Flat(plan::FlatRange(range)) => self.layout.runs_where(range.clone(), &pick),
            plan::Optimized::Shard(_) => self.layout.shard_runs_where(self.rank(), &pick),
        };
        self.replicated = (copies > 1).then_some((ranges, copies));
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
        let mut slices = Vec::with_capacity(self.layout.slots.len());
        for slot in &self.layout.slots {
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
        self.tensor_parallel = (size > 1).then_some(TensorParallelPlace { rank, size, slices, group });
        Ok(())
    }

    /// The slice of its whole parameter that layout slot `slot` holds (None: the whole).
    pub(crate) fn slot_slice(&self, slot: usize) -> Option<Slice> {
        self.tensor_parallel.as_ref().and_then(|p| p.slices[slot])
    }
}
