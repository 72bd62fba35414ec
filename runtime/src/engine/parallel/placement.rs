//! The engine's place in a model split across ranks: the group holding the model's other parts (a pipeline's
//! stages, a tensor-parallel group), over which the gradient norm and the fp16 overflow verdict are agreed; the
//! parameters every member holds whole (counted once in that norm); and under tensor parallelism, which slice of
//! each whole parameter this rank holds, so that checkpoints save slices by their place in the whole tensor.
use crate::checkpoint::Slice;
use crate::comm::{Collectives, Communicator};
use crate::engine::zero::layout;
use crate::engine::zero::plan;
use std::ops::Range;

use crate::error::{Error, Result};
use crate::mesh::{Dim, Mesh};
use crate::tensor_parallel::Placements;

/// The engine's place in a model split across ranks (none: the engine holds the whole model).
#[derive(Default)]
pub(crate) struct Placement {
    /// The mesh the engine was built on, when its groups are splits of the mesh's communicator (kept alive with
    /// them).
    pub mesh: Option<Mesh>,
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

/// What taking a place on the mesh reads of the engine's data-parallel side.
pub(crate) struct PlacementInputs<'a> {
    pub layout: &'a layout::FlatLayout,
    /// The values this rank optimizes and its data-parallel rank.
    pub optimized: &'a plan::Optimized,
    pub rank: usize,
    /// The pieces of the flat space this rank optimizes, in order, and their fp32 values (with tensor parallelism).
    pub pieces: Vec<Range<usize>>,
    pub values: Option<Vec<f32>>,
    /// Buffers and frozen parameters, by name: whole on every member.
    pub whole_only: Vec<String>,
    /// The data-parallel group, and whether it partitions the optimized values (a fingerprint sums over it).
    pub data: &'a dyn Communicator,
    pub partitions_optimizer: bool,
}

impl Placement {
    /// The engine's place on `mesh`: with pipeline stages or tensor parallelism, the gradient norm, clipping and
    /// the fp16 overflow verdict are agreed over `pipe x tensor` (every part skips or clips the same step); with
    /// tensor parallelism, the parameters the mesh's layers did not split are counted once in that norm, replicas
    /// that differ are refused, and checkpoints save each slice by its place in the whole tensor (one checkpoint
    /// for the job, which loads at any tensor-parallel degree and which `zerorun consolidate` makes whole).
    /// Collective over the mesh.
    pub fn on_mesh(mesh: &Mesh, inputs: PlacementInputs<'_>) -> Result<Placement> {
        let shape = mesh.shape();
        let mut placement = Placement::default();
        if shape.pipeline * shape.tensor > 1 {
            placement.model_parallel = Some(mesh.group(&[Dim::Pipeline, Dim::Tensor])?);
        }
        if Placement::records_slices(mesh) {
            // The checkpoints' group: its members' manifests meet at its first rank.
            let group = mesh.group(&[Dim::Tensor])?;
            placement.place_tensor_parallel(group, mesh.placements(), inputs)?;
        }
        Ok(placement)
    }

    /// Whether an engine on `mesh` records the slices of its parameters: with tensor parallelism, and in a group
    /// of one when a layer padded a tensor (checkpoints hold the true size).
    pub fn records_slices(mesh: &Mesh) -> bool {
        mesh.shape().tensor > 1 || mesh.placements().any_padded()
    }

    /// Records this rank's slices in the tensor-parallel `group` (`placements`: where the mesh's layers split
    /// each parameter) and counts the whole parameters once in the norm.
    fn place_tensor_parallel(
        &mut self,
        group: Box<dyn Communicator>,
        placements: &Placements,
        inputs: PlacementInputs<'_>,
    ) -> Result<()> {
        let split_dim = |name: &str| placements.split_dim(name);
        let (rank, size) = (group.rank(), group.world_size());
        // Buffers and frozen parameters are whole on every member (a checkpoint keeps the first member's): one
        // placed as split would come back as that member's slice on every rank.
        for name in &inputs.whole_only {
            if let Some(dim) = split_dim(name) {
                return Err(Error::Usage(format!(
                    "tensor parallelism: `{name}` is a buffer or a frozen parameter, which every member of the group holds whole, but it is placed split along dimension {dim}: split only trainable parameters (keep such a layer outside the split, or make its state trainable)"
                )));
            }
        }
        let mut slices = Vec::with_capacity(inputs.layout.slots.len());
        for slot in &inputs.layout.slots {
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
                    let whole = placements.get(&slot.name).and_then(|s| s.whole).unwrap_or(n * size as i64);
                    Some(Slice { dim, start: rank as i64 * n, full: whole })
                }
            });
        }
        // The parameters every member holds whole (layer norms, row-parallel biases) have equal gradients: the
        // norm over the group counts them once (each rank adds 1/copies of their squares), not `size` times.
        let pick = |slot: &layout::ParamSlot| split_dim(&slot.name).is_none();
        let ranges = match inputs.optimized {
            plan::Optimized::Flat(plan::FlatRange(range)) => inputs.layout.runs_where(range.clone(), &pick),
            plan::Optimized::Shard(_) => inputs.layout.shard_runs_where(inputs.rank, &pick),
        };
        self.replicated = Some((ranges, size));
        check_whole_parameters_agree(group.as_ref(), &slices, &inputs)?;
        self.tensor_parallel = Some(TensorParallelPlace { rank, size, slices, group });
        Ok(())
    }

    /// The slice of its whole parameter that layout slot `slot` holds (None: the whole).
    pub fn slot_slice(&self, slot: usize) -> Option<Slice> {
        self.tensor_parallel.as_ref().and_then(|p| p.slices[slot])
    }
}

/// Every member of the tensor-parallel `group` must start from the same values of the parameters they all hold
/// whole (`slices[i]` None), or the replicas drift apart with nothing to notice it. Compares one fingerprint per
/// parameter (a weighted sum of its values, summed over the data-parallel ranks that each optimize a part, so it
/// does not depend on the partition) across the group; the error names the first that differs.
fn check_whole_parameters_agree(
    group: &dyn Communicator,
    slices: &[Option<Slice>],
    inputs: &PlacementInputs<'_>,
) -> Result<()> {
    let whole: Vec<usize> = (0..slices.len()).filter(|&i| slices[i].is_none()).collect();
    if whole.is_empty() {
        return Ok(());
    }
    let values = inputs.values.as_ref().expect("tensor parallelism reads the optimized values");
    let (mut prints, mut scales) = (vec![0f64; whole.len()], vec![0f64; whole.len()]);
    let mut base = 0;
    for piece in &inputs.pieces {
        for (k, &i) in whole.iter().enumerate() {
            let slot = &inputs.layout.slots[i].range;
            for e in slot.start.max(piece.start)..slot.end.min(piece.end) {
                let (v, w) = (values[base + e - piece.start] as f64, 1.0 + ((e - slot.start) % 101) as f64 / 101.0);
                prints[k] += v * w;
                scales[k] += v.abs() * w;
            }
        }
        base += piece.len();
    }
    let mut sums: Vec<f32> = prints.iter().chain(&scales).map(|&x| x as f32).collect();
    if inputs.partitions_optimizer {
        inputs.data.all_reduce(&mut sums, crate::comm::ReduceOp::Sum)?;
    }
    let n = whole.len();
    // The group's largest and smallest fingerprint of each parameter, in one max.
    let mut extremes: Vec<f32> = sums[..n].iter().copied().chain(sums[..n].iter().map(|x| -x)).collect();
    group.all_reduce(&mut extremes, crate::comm::ReduceOp::Max)?;
    for (k, &i) in whole.iter().enumerate() {
        let (max, min) = (extremes[k], -extremes[n + k]);
        if (max - min) as f64 > 1e-5 * sums[n + k] as f64 + 1e-30 {
            return Err(Error::Usage(format!(
                "tensor parallelism: `{}` is held whole by every member of the tensor-parallel group, but their values differ: build the model from the same seed on every member (libtorch's generator is one per process: threads that draw from it at once interleave), or split it (a tensor-parallel layer, or `TensorParallel::place`)",
                inputs.layout.slots[i].name
            )));
        }
    }
    Ok(())
}
