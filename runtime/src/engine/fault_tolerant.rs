//! The engine's side of `fault_tolerance`: at set-up the replica groups' communicator becomes the managed one
//! (collectives over the step's quorum only, [`ManagedReplicas`]); at each step's end the ranks vote on it, and
//! after the vote they form the next step's quorum, whose groups split the same global batch among themselves
//! (more micro-batches per rank when fewer groups are left). The rule and the rounds are in
//! [`crate::fault_tolerance`].
use std::sync::Arc;
use std::time::Duration;

use crate::comm::Communicator;
use crate::config::{BatchSizes, Config};
use crate::engine::engine_comm::EngineComm;
use crate::error::{Error, Result};
use crate::fault_tolerance::{ManagedReplicas, Manager, Place, Verdict};
use crate::gloo::TcpStore;

/// A fault-tolerant engine's manager and the batch it keeps whole.
pub(super) struct FaultTolerance {
    manager: Arc<Manager>,
    /// The global batch and micro-batch, as the config resolved them with every group.
    batch: BatchSizes,
    /// Ranks per shard group.
    shard_size: usize,
}

/// The replica groups' communicator the engine runs on, and the engine's part of fault tolerance.
type Wrapped = (Option<Box<dyn Communicator>>, Option<FaultTolerance>);

/// The config's refusal of fault tolerance here.
fn refused(why: String) -> Error {
    Error::Usage(format!("`fault_tolerance.enabled`: {why}"))
}

/// With `fault_tolerance.enabled`: the managed replica groups in place of `replicas`, and the engine's part; else
/// `replicas` as they are.
pub(super) fn wrap(
    config: &Config,
    shard: &dyn Communicator,
    replicas: Option<Box<dyn Communicator>>,
    batch: BatchSizes,
) -> Result<Wrapped> {
    let ft = &config.fault_tolerance;
    if !ft.enabled {
        return Ok((replicas, None));
    }
    let Some(replicas) = replicas.filter(|r| r.world_size() > 1) else {
        return Err(refused(format!(
            "the replica groups are the failure domain, and `zero_optimization.mics_shard_size` {} over these {} ranks leaves one",
            config.zero_optimization.mics_shard_size.unwrap_or(0),
            shard.world_size()
        )));
    };
    let (groups, shard_size) = (replicas.world_size(), shard.world_size());
    if ft.min_replicas as usize > groups {
        return Err(refused(format!(
            "`fault_tolerance.min_replicas` {} is more than the job's {groups} replica groups",
            ft.min_replicas
        )));
    }
    // Each count of groups left must split the global batch evenly (accumulation takes the difference).
    for live in ft.min_replicas as usize..=groups {
        let ranks = (live * shard_size) as u64;
        if batch.train_batch_size % (batch.train_micro_batch_size_per_gpu * ranks) != 0 {
            return Err(refused(format!(
                "with {live} of the {groups} replica groups left, train_batch_size {} does not split into micro-batches of {} over {ranks} ranks; choose a batch every count of groups from `min_replicas` up divides",
                batch.train_batch_size, batch.train_micro_batch_size_per_gpu
            )));
        }
    }
    let info = crate::comm::rank_info::RankInfo::from_env()?;
    let timeout = Duration::from_secs_f64(ft.quorum_timeout);
    let store = TcpStore::connect(&info.master_addr, info.master_port, info.rank, timeout).map_err(|e| {
        refused(format!("it agrees over the job's TCPStore (the gloo backend's rendezvous, rank 0's): {e}"))
    })?;
    let place = Place { group: replicas.rank(), groups, shard_rank: shard.rank(), shard_size };
    let prefix = format!("zerorun/{}/ft/", info.run_id);
    let manager = Manager::start(ft.clone(), Arc::new(store), &prefix, place)?;
    tracing::info!(groups, min_replicas = ft.min_replicas, "fault tolerance: {} formed", manager.quorum());
    let managed: Box<dyn Communicator> = Box::new(ManagedReplicas(manager.clone()));
    Ok((Some(managed), Some(FaultTolerance { manager, batch, shard_size })))
}

impl FaultTolerance {
    /// The vote on step `step`: whether every member of its quorum reduced it.
    pub fn vote(&self, step: u64) -> Result<Verdict> {
        self.manager.vote(step)
    }

    /// After a step's vote: the quorum for step `step` (the same after a commit, formed anew after a discard),
    /// this rank's group's place among its groups, and the batch sizes over them (the same global batch,
    /// gradient accumulation taking up the groups lost).
    pub fn next_quorum(&self, step: u64, discarded: bool, comm: &EngineComm) -> Result<BatchSizes> {
        if discarded {
            self.manager.form_quorum(step)?;
        } else {
            self.manager.keep_quorum();
        }
        let (index, live) = self.manager.live_place();
        if let Some(r) = comm.replicas() {
            r.set_live(index, live);
        }
        let b = self.batch;
        let gradient_accumulation_steps =
            b.train_batch_size / (b.train_micro_batch_size_per_gpu * (live * self.shard_size) as u64);
        Ok(BatchSizes { gradient_accumulation_steps, ..b })
    }
}
