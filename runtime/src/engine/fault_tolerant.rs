//! The engine's side of `fault_tolerance`: at set-up the replica groups' communicator becomes the managed one
//! (collectives over the step's quorum only, [`ManagedReplicas`]); at each step's end the ranks vote on it, and
//! after the vote they form the next step's quorum, whose groups split the same global batch among themselves
//! (more micro-batches per rank when fewer groups are left). A group its launcher restarted builds its groups from
//! the store ([`rejoining_groups`]) and, once a vote takes it in, loads the state the first group that stayed sends
//! it, rank r from rank r (the group's checkpoint files, over the quorum's gloo group). The rule and the rounds are
//! in [`crate::fault_tolerance`].
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::{Collectives, Communicator};
use crate::config::{BatchSizes, Config};
use crate::engine::data_groups::DataGroups;
use crate::engine::engine_comm::EngineComm;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::fault_tolerance::{Formed, ManagedReplicas, Manager, Place, RejoiningWorld, Verdict};
use crate::gloo::{GlooComm, TcpStore};

/// A fault-tolerant engine's manager and the batch it keeps whole.
pub(super) struct FaultTolerance {
    manager: Arc<Manager>,
    /// The last step's verdict: after a commit the quorum stays, else a new one is formed.
    verdict: Cell<Verdict>,
    /// The job's run id (names the heal's folders).
    run_id: String,
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
    let verdict = Cell::new(Verdict::Commit);
    Ok((Some(managed), Some(FaultTolerance { manager, verdict, run_id: info.run_id, batch, shard_size })))
}

impl FaultTolerance {
    /// The vote on step `step`: whether every member of its quorum reduced it.
    pub fn vote(&self, step: u64) -> Result<Verdict> {
        let verdict = self.manager.vote(step)?;
        self.verdict.set(verdict);
        Ok(verdict)
    }

    /// This rank's group's place among the quorum's groups, and the batch sizes over them (the same global
    /// batch, gradient accumulation taking up the groups lost).
    fn live_batch(&self, comm: &EngineComm) -> BatchSizes {
        let (index, live) = self.manager.live_place();
        if let Some(r) = comm.replicas() {
            r.set_live(index, live);
        }
        let b = self.batch;
        let gradient_accumulation_steps =
            b.train_batch_size / (b.train_micro_batch_size_per_gpu * (live * self.shard_size) as u64);
        BatchSizes { gradient_accumulation_steps, ..b }
    }
}

/// After a step's vote: the quorum for the next step (the same after a commit, formed anew after a discard or
/// when a restarted group rejoins), the batch over its groups, and, on the ranks of the group the rejoined ones
/// heal from, their state sent.
pub(super) fn after_step(engine: &mut Engine) -> Result<()> {
    let Some(ft) = engine.comm.fault_tolerance() else { return Ok(()) };
    let step = engine.progress.global_steps + 1;
    let formed = match ft.verdict.get() {
        Verdict::Commit => {
            ft.manager.keep_quorum();
            None
        }
        Verdict::Discard | Verdict::Regroup => Some(ft.manager.form_quorum(step)?),
    };
    let batch = ft.live_batch(&engine.comm);
    engine.batch = batch;
    match formed {
        Some(f) if !f.rejoined.is_empty() && f.source() == Some(ft.manager.group()) => send_state(engine, &f),
        _ => Ok(()),
    }
}

/// A restarted group's rank, its engine built: rejoins the job at the next step a live group's vote takes it in,
/// and loads that group's state as it is there (its values, optimizer states, schedule, loss scale and step).
pub(super) fn rejoin(engine: &mut Engine, incarnation: u64) -> Result<()> {
    let Some(ft) = engine.comm.fault_tolerance() else { return Ok(()) };
    let formed = ft.manager.rejoin(incarnation)?;
    let batch = ft.live_batch(&engine.comm);
    engine.batch = batch;
    receive_state(engine, &formed)
}

/// The folder a heal's files pass through on this host (shared memory: the transfer is over the network).
fn heal_dir(run_id: &str, what: &str) -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    base.join(format!("zerorun-heal-{}-{what}", run_id.replace(['/', ':'], "_")))
}

/// The tag of the checkpoint a heal moves.
const HEAL_TAG: &str = "heal";

/// The source group's ranks: the group's checkpoint, written to shared memory, then from each rank to the rank of
/// each rejoined group at its place, the files that rank loads (the manifest, the variables, its own shard).
fn send_state(engine: &mut Engine, formed: &Formed) -> Result<()> {
    let started = Instant::now();
    let ft = engine.comm.fault_tolerance().expect("fault-tolerant");
    let (group, run_id) = (ft.manager.group(), ft.run_id.clone());
    let dir = heal_dir(&run_id, &format!("g{group}"));
    let options = crate::engine::SaveOptions { tag: Some(HEAL_TAG.into()), ..Default::default() };
    let folder = engine.save_group_checkpoint(&dir, &options)?;
    engine.wait_for_checkpoint()?;
    let rank = engine.comm.rank();
    let files = heal_files(&folder, rank, engine.comm.world_size())?;
    let bytes: usize = files.iter().map(|(_, b)| b.len()).sum();
    let ft = engine.comm.fault_tolerance().expect("fault-tolerant");
    let mut healed = Vec::new();
    for &g in &formed.rejoined {
        let dst = formed.quorum.members.iter().position(|&m| m == g).expect("a member");
        // A rejoining group lost while it heals is not this group's failure: the next step's collectives fail,
        // its vote discards the step, and the quorum after it goes on without that group.
        match ft.manager.with_group(|c| send_files(c.expect("a quorum of several"), dst, &files)) {
            Ok(()) => healed.push(g),
            Err(e) => tracing::warn!(group = g, "healing replica group {g} failed: {e}; it leaves again"),
        }
    }
    engine.comm.barrier()?;
    if rank == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let secs = started.elapsed().as_secs_f64();
    for g in healed {
        tracing::info!(
            step = engine.progress.global_steps,
            bytes,
            "group {g} healed from group {group} at step {} in {secs:.2} s ({:.1} MB/s from this rank)",
            engine.progress.global_steps,
            bytes as f64 / secs / 1e6
        );
    }
    Ok(())
}

/// A rejoined group's rank: receives its files from the source group's rank at its place and loads them.
fn receive_state(engine: &mut Engine, formed: &Formed) -> Result<()> {
    let started = Instant::now();
    let ft = engine.comm.fault_tolerance().expect("fault-tolerant");
    let source = formed.source().expect("a group that stayed");
    let src = formed.quorum.members.iter().position(|&m| m == source).expect("a member");
    let files = ft.manager.with_group(|c| recv_files(c.expect("a quorum of several"), src))?;
    let dir = heal_dir(&ft.run_id, &format!("r{}", engine.comm.data_rank()));
    let folder = dir.join(HEAL_TAG);
    let io = |path: &Path, e: std::io::Error| Error::Io { path: path.to_path_buf(), what: e.to_string() };
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&folder).map_err(|e| io(&folder, e))?;
    let bytes: usize = files.iter().map(|(_, b)| b.len()).sum();
    for (name, content) in &files {
        std::fs::write(folder.join(name), content).map_err(|e| io(&folder.join(name), e))?;
    }
    engine.load_checkpoint(&dir, Some(HEAL_TAG))?;
    let _ = std::fs::remove_dir_all(&dir);
    tracing::info!(
        step = engine.progress.global_steps,
        "replica group healed from group {source} at step {} in {:.2} s ({bytes} bytes to this rank)",
        engine.progress.global_steps,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The files of the checkpoint in `folder` that rank `rank` of `ranks` loads: every file but the other ranks'
/// shards.
fn heal_files(folder: &Path, rank: usize, ranks: usize) -> Result<Vec<(String, Vec<u8>)>> {
    let io = |e: std::io::Error| Error::Io { path: folder.to_path_buf(), what: e.to_string() };
    let others: Vec<String> = (0..ranks).filter(|&r| r != rank).map(|r| format!("rank{r}.safetensors")).collect();
    let mut out = Vec::new();
    for entry in std::fs::read_dir(folder).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.file_type().map_err(io)?.is_file() && !others.contains(&name) {
            out.push((name, std::fs::read(entry.path()).map_err(io)?));
        }
    }
    Ok(out)
}

/// Files to `dst`: their count, then each one's name and content, as lengths and 8-byte words.
fn send_files(c: &GlooComm, dst: usize, files: &[(String, Vec<u8>)]) -> crate::comm::CommResult<()> {
    c.send(&[files.len() as i64], dst)?;
    for (name, content) in files {
        for bytes in [name.as_bytes(), content.as_slice()] {
            c.send(&[bytes.len() as i64], dst)?;
            let mut words = vec![0i64; bytes.len().div_ceil(8)];
            bytemuck::cast_slice_mut::<i64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
            c.send(&words, dst)?;
        }
    }
    Ok(())
}

/// What [`send_files`] sent from `src`.
fn recv_files(c: &GlooComm, src: usize) -> crate::comm::CommResult<Vec<(String, Vec<u8>)>> {
    let mut count = [0i64];
    c.recv(&mut count, src)?;
    let mut out = Vec::new();
    for _ in 0..count[0] {
        let mut parts = Vec::new();
        for _ in 0..2 {
            let mut len = [0i64];
            c.recv(&mut len, src)?;
            let mut words = vec![0i64; (len[0] as usize).div_ceil(8)];
            c.recv(&mut words, src)?;
            let mut bytes = bytemuck::cast_slice::<i64, u8>(&words).to_vec();
            bytes.truncate(len[0] as usize);
            parts.push(bytes);
        }
        let content = parts.pop().expect("two parts");
        out.push((String::from_utf8_lossy(&parts[0]).into_owned(), content));
    }
    Ok(out)
}

/// A restarted group's ranks' groups: its shard group made on the job's store (the other groups' ranks are
/// mid-run, so there is no world group to split), and in place of the replicas its place among the groups.
pub(super) fn rejoining_groups(
    config: &Config,
    shard_size: usize,
    world: &dyn Communicator,
    k: u64,
) -> Result<DataGroups> {
    let info = crate::comm::rank_info::RankInfo::from_env()?;
    let timeout = Duration::from_secs_f64(config.fault_tolerance.quorum_timeout);
    let store = TcpStore::connect(&info.master_addr, info.master_port, info.rank, timeout)?;
    let (rank, world_size) = (world.rank(), world.world_size());
    let (group, shard_rank) = (rank / shard_size, rank % shard_size);
    let prefix = format!("zerorun/{}/ft/shard/{group}/{k}/", info.run_id);
    let shard: Box<dyn Communicator> = Box::new(store.gloo_group(&prefix, shard_rank, shard_size)?);
    let place = RejoiningWorld { rank: group, world_size: world_size / shard_size };
    Ok(DataGroups { shard, replicas: Some(Box::new(place)), mesh: None })
}
