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
    let name = config.optimizer.as_ref().map_or("", |o| o.name());
    if replicas > 1 {
        return Err(crate::error::Error::Unsupported {
            key: "zero_optimization.mics_shard_size",
            value: config.zero_optimization.mics_shard_size.map_or(String::new(), |s| s.to_string()),
            why: "the 1-bit optimizers exchange the momentum over one group of every data-parallel rank; shard groups split it in two levels",
        });
    }
    let group = own_group(comm)?;
    tracing::debug!(optimizer = name, ranks = group.world_size(), "1-bit exchange over its own group");
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
    sharded: Option<&ShardedSigns>,
) -> Vec<(String, Vec<f32>)> {
    let mut state = optimizer.map(|o| o.rank_state()).unwrap_or_default();
    state.extend(powersgd.map(|p| p.saved()).unwrap_or_default());
    state.extend(sharded.map(|s| s.saved()).unwrap_or_default());
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
    mut sharded: Option<&mut ShardedSigns>,
    folder: &std::path::Path,
    files: &[String],
    rank: usize,
    world_size: usize,
) -> crate::error::Result<()> {
    let wanted = rank_state(optimizer.as_deref(), powersgd.as_deref(), sharded.as_deref());
    if wanted.is_empty() {
        return Ok(());
    }
    if let Some(o) = optimizer.as_deref_mut() {
        o.reset_rank_state();
    }
    if let Some(p) = powersgd.as_deref_mut() {
        p.reset_error();
    }
    if let Some(s) = sharded.as_deref_mut() {
        s.reset();
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
        } || match sharded.as_deref_mut() {
            Some(s) => s.load(&name, &values)?,
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

/// 1-bit Adam at stage 1, where the momentum is partitioned and no rank can form the whole local momentum the
/// stage-0 exchange compresses. The two halves of the exchange move to either side of the step instead:
///
/// 1. before it, each rank's whole local gradient travels as signs (a 1-bit reduce-scatter, [`signs::reduce_scatter_compensated`],
///    the worker error over the whole flat buffer): the owner of partition q steps with the average of the signs
///    sent for q, moving its momentum exactly;
/// 2. after it, the owner's change of its partition travels as signs (a 1-bit all-gather, [`signs::all_gather_add`],
///    the server error over the partition): every rank adds every decoded change to the values it had, so the
///    parameters stay bitwise equal on every rank, the owner's own partition included.
///
/// The same bytes as stage 0 (2 (W-1)/W x n/8 per rank); what differs: the gradient is compressed on the way in (not
/// the momentum), the momentum is exact on its owner (not replaced by its compressed average each step), and the
/// server-side error is the step's change (not the momentum). fp32 models only: a 16-bit model's owner keeps an fp32
/// master the other ranks cannot rebuild from the 16-bit values plus the change.
pub(crate) struct ShardedSigns {
    group: Box<dyn Communicator>,
    /// This rank's worker error, over the whole padded flat buffer.
    worker: Vec<f32>,
    /// This rank's server error, over its partition.
    server: Vec<f32>,
    /// This rank's partition before the step (the change is the step's values less these).
    before: Vec<f32>,
    /// The flat buffer's padding: zeroed after each gather (signs cannot say zero).
    padding: Vec<std::ops::Range<usize>>,
    sent: Arc<AtomicU64>,
}

impl ShardedSigns {
    pub fn new(group: Box<dyn Communicator>, layout: &crate::engine::zero::layout::FlatLayout) -> ShardedSigns {
        let mut padding = Vec::new();
        let mut at = 0;
        for slot in &layout.slots {
            if slot.range.start > at {
                padding.push(at..slot.range.start);
            }
            at = at.max(slot.range.end);
        }
        if at < layout.padded {
            padding.push(at..layout.padded);
        }
        let part = layout.partition_len();
        ShardedSigns {
            group,
            worker: vec![0.0; layout.padded],
            server: vec![0.0; part],
            before: vec![0.0; part],
            padding,
            sent: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Half 1: `gradients` (this rank's whole flat fp32 gradient) averaged as signs into `out`, this rank's part.
    pub fn reduce_scatter(&mut self, gradients: &[f32], out: &mut [f32]) -> crate::error::Result<()> {
        for (e, g) in self.worker.iter_mut().zip(gradients) {
            *e += *g;
        }
        signs::reduce_scatter_compensated(self.group.as_ref(), &mut self.worker, out)?;
        Ok(())
    }

    /// Before the step: this rank's partition as it is.
    pub fn keep(&mut self, partition: &[f32]) {
        self.before.copy_from_slice(partition);
    }

    /// Half 2, after the step: this rank's change (its partition now less [`ShardedSigns::keep`]'s) averaged as
    /// signs and added to every rank's values; `flat` is the whole flat buffer, this rank's partition at `rank`.
    pub fn gather_change(&mut self, flat: &mut [f32], rank: usize) -> crate::error::Result<()> {
        let part = self.server.len();
        let own = &mut flat[rank * part..(rank + 1) * part];
        let change: Vec<f32> = own.iter().zip(&self.before).map(|(now, was)| now - was).collect();
        // Every rank adds the decoded changes to the values it had before the step: the owner too.
        own.copy_from_slice(&self.before);
        signs::all_gather_add(self.group.as_ref(), &change, &mut self.server, flat)?;
        for r in &self.padding {
            flat[r.clone()].fill(0.0);
        }
        let world = self.group.world_size();
        self.sent.fetch_add(signs::sharded_wire_bytes(part, world) as u64, Ordering::Relaxed);
        Ok(())
    }

    /// The state a checkpoint keeps per rank.
    pub fn saved(&self) -> Vec<(String, Vec<f32>)> {
        vec![
            ("sharded_worker_error".to_string(), self.worker.clone()),
            ("sharded_server_error".to_string(), self.server.clone()),
        ]
    }

    /// Restores a buffer [`ShardedSigns::saved`] named; false for other names.
    pub fn load(&mut self, name: &str, values: &[f32]) -> crate::error::Result<bool> {
        let buf = match name {
            "sharded_worker_error" => &mut self.worker,
            "sharded_server_error" => &mut self.server,
            _ => return Ok(false),
        };
        if buf.len() != values.len() {
            return Err(crate::error::Error::Usage(format!(
                "the checkpoint's `{name}` has {} values, this run's {}: another model or world size",
                values.len(),
                buf.len()
            )));
        }
        buf.copy_from_slice(values);
        Ok(true)
    }

    /// Zeroes both errors (a resume at another world size).
    pub fn reset(&mut self) {
        self.worker.fill(0.0);
        self.server.fill(0.0);
    }
}

/// What the sharded form ([`ShardedSigns`], stage 1) cannot run with, refused by name.
pub(crate) fn check_sharded(
    config: &crate::Config,
    precision: crate::config::Precision,
    replicas: usize,
) -> crate::error::Result<()> {
    let refuse =
        |key: &'static str, value: String, why: &'static str| Err(crate::error::Error::Unsupported { key, value, why });
    if precision != crate::config::Precision::Fp32 {
        return refuse(
            "optimizer.type",
            "\"OneBitAdam\"".into(),
            "at stage 1 the owner of a partition keeps an fp32 master that the other ranks cannot rebuild from 16-bit values plus the 1-bit change; train fp32, or at stage 0",
        );
    }
    if replicas > 1 {
        return refuse(
            "zero_optimization.mics_shard_size",
            config.zero_optimization.mics_shard_size.map_or(String::new(), |s| s.to_string()),
            "the 1-bit exchange runs over one group of every data-parallel rank; shard groups split it in two levels",
        );
    }
    Ok(())
}

/// A duplicate of the engine's group `comm`, for an exchange that owns its communicator for the run.
pub(crate) fn own_group(comm: &dyn Communicator) -> crate::error::Result<Box<dyn Communicator>> {
    use crate::comm::Collectives;
    let ranks: Vec<usize> = (0..comm.world_size()).collect();
    Ok(comm.new_group(&ranks)?.expect("every rank is in the group of all ranks"))
}
