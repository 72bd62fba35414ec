//! Stage 3's walk over the model's units (and stage 2's with units, whose units stay gathered): what forward keeps
//! of each unit for backward, and the start-up that packs each unit into its buffer and keeps this rank's chunk.
//! The walk itself runs in `engine/micro_batch.rs`, where it reaches every part it drives.
use tch::Tensor;

use crate::config::OffloadDevice;
use crate::engine::zero::plan;
use crate::engine::zero::sharded_unit::ShardedUnit;
use crate::engine::zero::swapped_params::SwappedParams;
use crate::error::Result;

/// `ZERORUN_STAGE3_WALK=chain`: `engine.forward` at stage 3 walks the units as a detached chain (the path before
/// scopes, kept for activation checkpointing) instead of entering them as scopes: the reference `zerorun bench
/// scopes` measures against.
pub const CHAIN_WALK_ENV: &str = "ZERORUN_STAGE3_WALK";

/// Whether the environment asks for the chain walk ([`CHAIN_WALK_ENV`]).
pub(crate) fn chain_walk_from_env() -> bool {
    std::env::var(CHAIN_WALK_ENV).is_ok_and(|v| v.trim() == "chain")
}

/// What forward keeps of one unit for backward.
pub(crate) struct UnitRecord {
    /// The unit's input as run: a leaf that requires grad (units after the first, floating inputs). Undefined while
    /// it waits in host memory (`on_host`).
    pub input: Tensor,
    /// The unit's output with its graph (None under activation checkpointing: recomputed in backward).
    pub output: Option<Tensor>,
    /// The input in host memory (`activation_checkpointing.cpu_checkpointing`), until backward brings it back.
    pub on_host: Option<crate::engine::device::host_inputs::HostInput>,
}

/// Stage 3's walk over the model's units.
pub(crate) struct Walk {
    /// The units' parameter-name prefixes, in execution order.
    pub unit_prefixes: Vec<Vec<String>>,
    /// What the current micro-batch's forward kept for backward.
    pub records: Vec<UnitRecord>,
    /// Keep only each unit's input in forward and recompute the unit in backward.
    pub activation_checkpointing: bool,
    /// Those inputs wait in host memory (`activation_checkpointing.cpu_checkpointing` on the device path).
    pub inputs_to_host: bool,
    /// Bytes of checkpointed inputs sent to host memory since the engine started.
    pub inputs_sent_bytes: u64,
    /// `engine.forward` walks the detached chain even without activation checkpointing ([`CHAIN_WALK_ENV`]).
    pub chain: bool,
    /// Units entered as scopes of the program's forward (`engine.unit`), set up on first use.
    pub scopes: Option<crate::engine::zero::scopes::Scopes>,
    /// Stage 1 with units split over expert groups: the prefixes of the units this rank does not hold (another
    /// position's experts, kept without storage), which `engine.unit` refuses. Empty otherwise.
    pub not_held: std::collections::HashSet<String>,
    /// `engine.forward` recorded the end of this micro-batch's forward for the memory report (a forward of the
    /// program's own scopes ends at its backward).
    pub forward_marked: bool,
}

/// Start-up at stage 3: packs each unit's parameters into its buffer, takes rank 0's values, keeps this
/// rank's chunk of every unit (in the shard, or with `offload_param.device = nvme` written to its swap file as the
/// unit is sharded, so the shard is never whole in memory) and releases all but the persistent units.
pub(crate) fn shard_units(
    layout: &crate::engine::FlatLayout,
    named: Vec<(String, Tensor)>,
    frozen_numel: &[u64],
    (kind, residence): (tch::Kind, crate::engine::device::Residence),
    comm: &dyn crate::comm::Communicator,
    config: &crate::config::Config,
    mut materialize: Option<&mut crate::engine::zero::units::Materialize>,
) -> Result<ShardedStart> {
    let z = &config.zero_optimization;
    let (ws, rank) = (comm.world_size(), comm.rank());
    let host_piece = host_piece(z.zero_hpz_partition_size as usize, comm)?;
    let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
    // A unit persists by its whole size, frozen parameters included: both parts are gathered together.
    let numels: Vec<u64> = layout
        .units
        .iter()
        .zip(frozen_numel)
        .map(|(span, frozen)| {
            layout.slots[span.slots.clone()].iter().map(|s| s.range.len() as u64).sum::<u64>() + frozen
        })
        .collect();
    let mut persistence =
        plan::persistent_units(&numels, z.stage3_param_persistence_threshold, z.stage3_model_persistence_threshold);
    // A unit split over a group this rank is not in is never gathered here, however small.
    for (p, span) in persistence.iter_mut().zip(&layout.units) {
        *p &= span.holds(rank);
    }
    let mut chunks = Vec::with_capacity(layout.units.len());
    let mut offset = 0;
    for span in &layout.units {
        chunks.push(offset..offset + span.held_len(rank, ws));
        offset += span.held_len(rank, ws);
    }
    let mut swapped = match z.offload_param.device {
        OffloadDevice::Nvme => {
            let prefix =
                format!("zerorun-{}-{}-rank{rank}-params", std::process::id(), crate::engine::next_engine_id());
            let io = crate::engine::setup::io_config(config);
            Some(SwappedParams::create(kind, chunks.clone(), &persistence, &z.offload_param, io, &prefix)?)
        }
        OffloadDevice::Cpu => {
            tracing::info!(rank, "offload_param.device = cpu: a CPU run keeps parameter shards in host memory already");
            None
        }
        OffloadDevice::None => None,
    };
    let len = if swapped.is_some() { 0 } else { layout.shard_len(rank) };
    let shard = Tensor::f_zeros([len as i64], (kind, residence.device()))?;
    let mut units = Vec::with_capacity(layout.units.len());
    for (u, (span, persistent)) in layout.units.iter().zip(persistence).enumerate() {
        if let (Some(m), false) = (materialize.as_deref_mut(), span.slots.is_empty()) {
            let vars: Vec<(&str, &Tensor)> =
                names[span.slots.clone()].iter().map(String::as_str).zip(&params[span.slots.clone()]).collect();
            m(units.len(), &vars)?;
        }
        let own: Vec<Tensor> = params[span.slots.clone()].iter().map(Tensor::shallow_clone).collect();
        let r = chunks[u].clone();
        let store = |chunk: &Tensor| -> Result<()> {
            match swapped.as_mut() {
                Some(s) => s.put(u, chunk),
                None => {
                    tch::no_grad(|| shard.narrow(0, r.start as i64, r.len() as i64).f_copy_(chunk))?;
                    Ok(())
                }
            }
        };
        let mut unit = ShardedUnit::shard_from_rank0(
            span.clone(),
            &layout.slots[span.slots.clone()],
            own,
            kind,
            r.start,
            persistent,
            comm,
            store,
            residence,
        )?;
        if z.zero_quantized_weights {
            unit.quantize_gathers(crate::comm::quantized::BLOCK);
        }
        if let Some((local, per_host)) = host_piece {
            unit.keep_host_copies(local, per_host);
        }
        units.push(unit);
    }
    if let Some(s) = swapped.as_mut() {
        s.finish()?;
    }
    Ok(ShardedStart { shard, swapped, params, units })
}

/// What stage 3's start-up leaves: where this rank's values live, the model's tensors and the units.
pub(crate) struct ShardedStart {
    /// This rank's chunk of every unit (empty when they are on NVMe).
    pub shard: Tensor,
    /// The chunks on NVMe (`offload_param.device = nvme`).
    pub swapped: Option<SwappedParams>,
    /// The model's tensors, in layout order.
    pub params: Vec<Tensor>,
    pub units: Vec<ShardedUnit>,
}

/// hpZ's secondary partition (`zero_hpz_partition_size` k above 1): this rank's place on its host and the host's
/// ranks, which must be k. Without a host level (one host, or flat collectives) every gather stays inside the
/// host's reach anyway or has no host to stay in: the key has no effect, which the log says.
fn host_piece(k: usize, comm: &dyn crate::comm::Communicator) -> Result<Option<(usize, usize)>> {
    if k <= 1 {
        return Ok(None);
    }
    match comm.host_layout() {
        Some((local, per_host)) if per_host == k => Ok(Some((local, per_host))),
        Some((_, per_host)) => Err(crate::error::Error::Usage(format!(
            "zero_optimization.zero_hpz_partition_size is {k}, but each host runs {per_host} ranks: the secondary \
             partition spans a host's ranks (set it to {per_host}, or 1 for none)"
        ))),
        None => {
            tracing::warn!(
                rank = comm.rank(),
                "zero_optimization.zero_hpz_partition_size = {k} has no effect: the collectives have no host level \
                 (the ranks are on one host, or ZERORUN_HIERARCHY=flat)"
            );
            Ok(None)
        }
    }
}
