//! Communication compression (issue: faster than the link): the 1-bit optimizers' exchange over the data-parallel
//! ranks ([`SignExchange`], the optimizers themselves are zerorun-optim's `one_bit`). The engine's part is small by
//! design: it hands the optimizer an exchange over its own group, keeps a step's gradients local when the
//! optimizer asks (`Optimizer::keeps_gradients_local`), and saves the optimizer's per-rank state.
pub(crate) mod powersgd;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use zerorun_optim::one_bit::{ErrorFeedback, Exchange};

use crate::comm::{signs, Communicator};

/// The 1-bit average over a group of its own (a duplicate of the engine's data-parallel group, so the optimizer
/// owns it for the run), with the bytes it sent counted where the engine's report reads them.
pub(crate) struct SignExchange {
    group: Box<dyn Communicator>,
    sent: Arc<AtomicU64>,
}

impl SignExchange {
    pub fn new(group: Box<dyn Communicator>, sent: Arc<AtomicU64>) -> SignExchange {
        SignExchange { group, sent }
    }
}

impl Exchange for SignExchange {
    fn world_size(&self) -> usize {
        self.group.world_size()
    }

    fn error_lens(&self, n: usize) -> (usize, usize) {
        let w = self.group.world_size();
        let padded = signs::padded_len(n, w);
        (padded, padded / w)
    }

    fn one_bit_average(&mut self, values: &mut [f32], errors: &mut ErrorFeedback) -> Result<(), String> {
        signs::all_reduce(self.group.as_ref(), values, &mut errors.worker, &mut errors.server)
            .map_err(|e| e.to_string())?;
        self.sent.fetch_add(signs::wire_bytes(values.len(), self.group.world_size()) as u64, Ordering::Relaxed);
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

/// The exchange a 1-bit optimizer steps with: over a duplicate of the engine's group `comm`. Refuses what the
/// exchange cannot run with, by name.
pub(crate) fn exchange(
    config: &crate::Config,
    comm: &dyn Communicator,
    replicas: usize,
) -> crate::error::Result<Box<dyn Exchange>> {
    use crate::comm::Collectives;
    let name = config.optimizer.as_ref().map_or("", |o| o.name());
    if replicas > 1 {
        return Err(crate::error::Error::Unsupported {
            key: "zero_optimization.mics_shard_size",
            value: config.zero_optimization.mics_shard_size.map_or(String::new(), |s| s.to_string()),
            why: "the 1-bit optimizers exchange the momentum over one group of every data-parallel rank; shard groups split it in two levels",
        });
    }
    let ranks: Vec<usize> = (0..comm.world_size()).collect();
    let group = comm.new_group(&ranks)?.expect("every rank is in the group of all ranks");
    tracing::debug!(optimizer = name, ranks = ranks.len(), "1-bit exchange over its own group");
    Ok(Box::new(SignExchange::new(group, Arc::new(AtomicU64::new(0)))))
}

/// The file of rank `rank`'s optimizer state in a checkpoint (`prefix`: the engine's tensor-parallel prefix).
fn rank_state_file(prefix: &str, rank: usize) -> String {
    format!("{prefix}optimizer_rank{rank}.safetensors")
}

/// What of a run is each rank's own and not element-aligned with the shard: a 1-bit optimizer's error feedback and
/// schedule, PowerSGD's error, Q and step count. Saved per rank, restored by [`restore`].
pub(crate) fn rank_state(
    optimizer: Option<&dyn zerorun_optim::Optimizer>,
    powersgd: Option<&powersgd::PowerSgd>,
) -> Vec<(String, Vec<f32>)> {
    let mut state = optimizer.map(|o| o.rank_state()).unwrap_or_default();
    state.extend(powersgd.map(|p| p.saved()).unwrap_or_default());
    state
}

/// Writes this rank's own state ([`rank_state`]) into `staging` and returns the files of every rank, as the
/// manifest lists them; nothing when there is none.
pub(crate) fn save_rank_state(
    state: Vec<(String, Vec<f32>)>,
    staging: &std::path::Path,
    prefix: &str,
    rank: usize,
    world_size: usize,
) -> crate::error::Result<Vec<String>> {
    if state.is_empty() {
        return Ok(Vec::new());
    }
    let tensors: Vec<(String, tch::Tensor)> =
        state.iter().map(|(name, values)| (name.clone(), tch::Tensor::from_slice(values))).collect();
    let file = staging.join(rank_state_file(prefix, rank));
    tch::Tensor::write_safetensors(&tensors, &file)
        .map_err(|e| crate::checkpoint::CheckpointError::Io { path: file.clone(), what: e.to_string() })?;
    Ok((0..world_size).map(|r| rank_state_file(prefix, r)).collect())
}

/// Restores this rank's own state from a checkpoint's `files` (by rank): at the world size that saved it, this
/// rank's; at another, rank 0's without the error-feedback buffers (names ending `_error`), which are each rank's
/// and sized by the world: they restart at zero, as DeepSpeed restarts them on every load, while 0/1 Adam's
/// schedule and PowerSGD's Q and step count carry over.
pub(crate) fn restore(
    mut optimizer: Option<&mut dyn zerorun_optim::Optimizer>,
    mut powersgd: Option<&mut powersgd::PowerSgd>,
    folder: &std::path::Path,
    files: &[String],
    rank: usize,
    world_size: usize,
) -> crate::error::Result<()> {
    let wanted = rank_state(optimizer.as_deref(), powersgd.as_deref());
    if wanted.is_empty() {
        return Ok(());
    }
    if let Some(o) = optimizer.as_deref_mut() {
        o.reset_rank_state();
    }
    if let Some(p) = powersgd.as_deref_mut() {
        p.reset_error();
    }
    if files.is_empty() {
        tracing::warn!(
            "the checkpoint has no per-rank state (saved without compression): error feedback starts at zero"
        );
        return Ok(());
    }
    let same_world = files.len() == world_size;
    let path = folder.join(&files[if same_world { rank } else { 0 }]);
    let file = crate::checkpoint::hf::WeightFiles::open(&path)?;
    for (name, _) in wanted {
        if !same_world && name.ends_with("_error") {
            continue;
        }
        let (_, t) = crate::engine::checkpointing::read_variable(&file, &name)?;
        let values: Vec<f32> = Vec::<f32>::try_from(t.to_kind(tch::Kind::Float).reshape([-1]))
            .map_err(|e| crate::checkpoint::CheckpointError::Io { path: path.clone(), what: e.to_string() })?;
        let taken = match powersgd.as_deref_mut() {
            Some(p) => p.load(&name, &values)?,
            None => false,
        };
        if let (false, Some(o)) = (taken, optimizer.as_deref_mut()) {
            o.load_rank_state(&name, &values)?;
        }
    }
    if !same_world && rank == 0 {
        tracing::info!(
            from = files.len(),
            to = world_size,
            "another world size: the error feedback restarts at zero (it is each rank's, sized by the world)"
        );
    }
    Ok(())
}
