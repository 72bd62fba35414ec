//! Stage 3's walk over the model's units (and stage 2's with units, whose units stay gathered): what forward keeps
//! of each unit for backward, and the start-up that packs each unit into its buffer and keeps this rank's chunk.
//! The walk itself runs in `engine/micro_batch.rs`, where it reaches every part it drives.
use tch::Tensor;

use crate::engine::zero::plan;
use crate::error::Result;

/// What forward keeps of one unit for backward.
pub(crate) struct UnitRecord {
    /// The unit's input as run: a leaf that requires grad (units after the first, floating inputs).
    pub input: Tensor,
    /// The unit's output with its graph (None under activation checkpointing: recomputed in backward).
    pub output: Option<Tensor>,
}

/// Stage 3's walk over the model's units.
pub(crate) struct Walk {
    /// The units' parameter-name prefixes, in execution order.
    pub unit_prefixes: Vec<Vec<String>>,
    /// What the current micro-batch's forward kept for backward.
    pub records: Vec<UnitRecord>,
    /// Keep only each unit's input in forward and recompute the unit in backward.
    pub activation_checkpointing: bool,
}

/// Start-up at stage 3: packs each unit's parameters into its buffer, takes rank 0's values, keeps this
/// rank's chunk of every unit in the shard and releases all but the persistent units. Returns (shard, the
/// model's tensors in layout order, units).
pub(crate) fn shard_units(
    layout: &crate::engine::FlatLayout,
    named: Vec<(String, Tensor)>,
    frozen_numel: &[u64],
    (kind, residence): (tch::Kind, crate::engine::device::Residence),
    comm: &dyn crate::comm::Communicator,
    config: &crate::config::Config,
    mut materialize: Option<&mut crate::engine::zero::units::Materialize>,
) -> Result<(Tensor, Vec<Tensor>, Vec<crate::engine::zero::sharded_unit::ShardedUnit>)> {
    let z = &config.zero_optimization;
    let ws = comm.world_size();
    let shard = Tensor::f_zeros([layout.partition_len() as i64], (kind, residence.device()))?;
    let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
    let mut units = Vec::with_capacity(layout.units.len());
    // A unit persists by its whole size, frozen parameters included: both parts are gathered together.
    let numels: Vec<u64> = layout
        .units
        .iter()
        .zip(frozen_numel)
        .map(|(span, frozen)| {
            layout.slots[span.slots.clone()].iter().map(|s| s.range.len() as u64).sum::<u64>() + frozen
        })
        .collect();
    let persistence =
        plan::persistent_units(&numels, z.stage3_param_persistence_threshold, z.stage3_model_persistence_threshold);
    let mut offset = 0;
    for (span, persistent) in layout.units.iter().zip(persistence) {
        if let (Some(m), false) = (materialize.as_deref_mut(), span.slots.is_empty()) {
            let vars: Vec<(&str, &Tensor)> =
                names[span.slots.clone()].iter().map(String::as_str).zip(&params[span.slots.clone()]).collect();
            m(units.len(), &vars)?;
        }
        let own: Vec<Tensor> = params[span.slots.clone()].iter().map(Tensor::shallow_clone).collect();
        units.push(crate::engine::zero::sharded_unit::ShardedUnit::shard_from_rank0(
            span.clone(),
            &layout.slots[span.slots.clone()],
            own,
            kind,
            offset,
            persistent,
            comm,
            &shard,
            residence,
        )?);
        offset += span.chunk_len(ws);
    }
    Ok((shard, params, units))
}
