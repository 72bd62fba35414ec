//! One rank's part in the replica groups' agreement: it heartbeats, joins each round's quorum, reduces across the
//! quorum's groups on a gloo group made for those members, and votes on the step. A collective across the groups
//! that fails (a member lost mid-step) is not an error: it marks the round failed, the rest of the step's
//! collectives across the groups are skipped, and the vote discards the step on every rank, which redoes it with
//! the groups left.
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::heartbeat::{Heartbeat, Liveness};
use super::quorum::{self, Decision, Quorum};
use crate::comm::groups::Split;
use crate::comm::{BufMut, BufRef, CommResult, Communicator, ReduceOp};
use crate::config::FaultToleranceConfig;
use crate::error::{Error, Result};
use crate::gloo::{GlooComm, TcpStore};

/// Where this rank sits among the replica groups.
#[derive(Debug, Clone, Copy)]
pub struct Place {
    /// This rank's replica group.
    pub group: usize,
    /// Replica groups in the job.
    pub groups: usize,
    /// This rank's place in its shard group.
    pub shard_rank: usize,
    /// Ranks per shard group.
    pub shard_size: usize,
}

impl Place {
    /// This rank's number among every data-parallel rank (its heartbeat's).
    fn rank(&self) -> usize {
        self.group * self.shard_size + self.shard_rank
    }
}

/// A quorum as a round formed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Formed {
    /// The groups taking the next step.
    pub quorum: Quorum,
    /// Groups restarted that rejoined in this round: they heal from a member that stayed.
    pub rejoined: Vec<usize>,
}

impl Formed {
    /// The member the rejoined groups heal from: the first that stayed.
    pub fn source(&self) -> Option<usize> {
        self.quorum.members.iter().copied().find(|g| !self.rejoined.contains(g))
    }
}

/// A step's end, as the replica groups agreed on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every member reduced and voted for it: take it.
    Commit,
    /// Take it, and form a quorum before the next step: a restarted group rejoins.
    Regroup,
    /// Some member failed or was lost: every rank drops the step's gradients and redoes it.
    Discard,
}

struct State {
    /// Rounds formed so far; the current round is `round - 1`.
    round: u64,
    quorum: Quorum,
    liveness: Liveness,
    last_look: Instant,
    /// The current quorum's group across the replica groups at this shard position (None: a quorum of one).
    group: Option<GlooComm>,
    /// Why a collective across the groups failed this round.
    failed: Option<String>,
    /// A restarted group's rank before its first quorum (its `quorum` is only a guess of the members).
    joining: bool,
}

/// This rank's fault-tolerance manager (torchft's `Manager`, with the job's TCPStore as its lighthouse).
pub struct Manager {
    store: Arc<TcpStore>,
    prefix: String,
    config: FaultToleranceConfig,
    place: Place,
    _heartbeat: Heartbeat,
    state: Mutex<State>,
}

impl Manager {
    /// Starts this rank's heartbeat and forms the first quorum (every group, which all start alive).
    pub fn start(
        config: FaultToleranceConfig,
        store: Arc<TcpStore>,
        prefix: &str,
        place: Place,
    ) -> Result<Arc<Manager>> {
        let every = Duration::from_millis(config.heartbeat_ms);
        let k = crate::fault_tolerance::incarnation().unwrap_or(0);
        // Its own connection: beats never queue behind this rank's reads of the store.
        let beat_store = Arc::new(store.reconnect()?);
        let heartbeat = Heartbeat::start(beat_store, prefix, place.rank(), k, every);
        let mut liveness = Liveness::new(prefix, place.groups * place.shard_size, config.heartbeat_timeout());
        for r in 0..place.shard_size {
            liveness.revive(place.group * place.shard_size + r, k);
        }
        let everyone = Quorum { id: 0, members: (0..place.groups).collect() };
        let state = State {
            round: 0,
            quorum: everyone,
            liveness,
            last_look: Instant::now(),
            group: None,
            failed: None,
            joining: false,
        };
        let manager = Arc::new(Manager {
            store,
            prefix: prefix.into(),
            config,
            place,
            _heartbeat: heartbeat,
            state: Mutex::new(state),
        });
        if crate::fault_tolerance::incarnation().is_none() {
            manager.form_quorum(0)?;
        }
        Ok(manager)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn error(&self, why: String) -> Error {
        Error::Quorum { group: self.place.group, why }
    }

    /// This rank's replica group.
    pub fn group(&self) -> usize {
        self.place.group
    }

    /// The groups that take the current round's step.
    pub fn quorum(&self) -> Quorum {
        self.state().quorum.clone()
    }

    /// This rank's group among the quorum's members, and how many they are.
    pub fn live_place(&self) -> (usize, usize) {
        let s = self.state();
        let index = s.quorum.members.iter().position(|&g| g == self.place.group).expect("a member of its quorum");
        (index, s.quorum.members.len())
    }

    /// Reads the heartbeats again if half a beat passed since the last look.
    fn look(&self, s: &mut State) -> Result<()> {
        if s.last_look.elapsed() >= Duration::from_millis(self.config.heartbeat_ms / 2) {
            s.liveness.observe(&self.store)?;
            s.last_look = Instant::now();
        }
        Ok(())
    }

    /// Groups every rank of which is still heartbeating.
    fn healthy(&self, s: &State) -> Vec<usize> {
        let p = self.place;
        (0..p.groups).filter(|g| (0..p.shard_size).all(|r| s.liveness.alive(g * p.shard_size + r))).collect()
    }

    /// Joins the next round and waits for its quorum; `step` (the optimizer step it is for) only names it in
    /// the log. The last rank of the previous quorum (and of the groups rejoining in this round) to join decides
    /// at once (the common case: nobody lost); otherwise the ranks wait on the decision's key half a heartbeat at a
    /// time, looking at the heartbeats in between. The members make their group across the replica groups anew
    /// when they changed.
    pub fn form_quorum(&self, step: u64) -> Result<Formed> {
        let mut s = self.state();
        let round = s.round;
        let (p, prefix) = (self.place, &self.prefix);
        let key = format!("{prefix}quorum/{round}");
        let decode = |text: String| Quorum::decode(&text).ok_or_else(|| self.error(format!("`{key}` holds {text:?}")));
        // Groups restarted that a vote took in for this round ([`Manager::vote`]): alive again.
        let rejoining: Vec<(usize, u64)> = match self.store.get(&format!("{prefix}regroup_round/{round}"))? {
            Some(list) => list
                .split(',')
                .filter_map(|gk| gk.split_once(':').and_then(|(g, k)| Some((g.parse().ok()?, k.parse().ok()?))))
                .collect(),
            None => Vec::new(),
        };
        for &(g, k) in &rejoining {
            for r in 0..p.shard_size {
                s.liveness.revive(g * p.shard_size + r, k);
            }
        }
        let rejoining: Vec<usize> = rejoining.into_iter().map(|(g, _)| g).collect();
        let mut expected: Vec<usize> = s.quorum.members.iter().chain(&rejoining).copied().collect();
        expected.sort_unstable();
        expected.dedup();
        self.store.add(&format!("{prefix}join/{round}/{}", p.group), 1)?;
        let joined_all = self.store.add(&format!("{prefix}join/{round}/all"), 1)?;
        let started = Instant::now();
        let timeout = Duration::from_secs_f64(self.config.quorum_timeout);
        let mut decided = None;
        if joined_all == (expected.len() * p.shard_size) as i64 {
            let text = self.store.set_once(&key, &s.quorum.next(expected.clone()).encode())?;
            decided = Some(decode(text)?);
        }
        let decided = loop {
            if let Some(q) = decided.take() {
                break q;
            }
            if let Some(text) = self.await_key(&key)? {
                break decode(text)?;
            }
            self.look(&mut s)?;
            let healthy = self.healthy(&s);
            let mut joined = Vec::new();
            for g in 0..p.groups {
                if self.store.add(&format!("{prefix}join/{round}/{g}"), 0)? >= p.shard_size as i64 {
                    joined.push(g);
                }
            }
            match quorum::decide(&joined, &healthy, self.config.min_replicas as usize, started.elapsed() >= timeout) {
                Decision::Wait => {}
                Decision::Propose(members) => {
                    decided = Some(decode(self.store.set_once(&key, &s.quorum.next(members).encode())?)?);
                }
                Decision::Fail(why) => return Err(self.error(format!("no quorum for step {step}: {why}"))),
            }
        };
        if !decided.members.contains(&p.group) {
            return Err(self.error(format!(
                "left out of the {decided} for step {step} (it joined too late); it must restart and heal"
            )));
        }
        for lost in s.quorum.members.iter().filter(|g| !decided.members.contains(g)) {
            tracing::warn!(group = lost, step, "replica group {lost} lost at step {step}");
        }
        let rejoined: Vec<usize> = rejoining.into_iter().filter(|g| decided.members.contains(g)).collect();
        if decided.id != s.quorum.id || s.round == 0 || s.joining {
            if decided.members.len() < s.quorum.members.len() {
                tracing::warn!(step, "continuing with {} of {} replica groups", decided.members.len(), p.groups);
            }
            for g in &rejoined {
                tracing::info!(group = g, step, "replica group {g} rejoins at step {step}");
            }
            s.group = None; // the old group's connections close before the new ones open
            s.group = self.group_of(&decided)?;
        }
        tracing::debug!(round, step, "{decided} in {:?}", started.elapsed());
        s.quorum = decided.clone();
        s.failed = None;
        s.joining = false;
        s.round += 1;
        Ok(Formed { quorum: decided, rejoined })
    }

    /// The last voter of a step: the restarted groups whose ranks all wait to rejoin ([`Manager::rejoin`]) are
    /// told the round they join (the next one, which every rank then forms: [`Verdict::Regroup`]).
    fn take_in_rejoining(&self, s: &State) -> Result<bool> {
        let (p, prefix, round) = (self.place, &self.prefix, s.round);
        let mut taken = Vec::new();
        for g in (0..p.groups).filter(|g| !s.quorum.members.contains(g)) {
            let Some(k) = self.store.get(&format!("{prefix}rejoin/{g}"))? else { continue };
            let ready = self.store.add(&format!("{prefix}ready/{g}/{k}"), 0)? >= p.shard_size as i64;
            if ready && self.store.get(&format!("{prefix}served/{g}"))?.as_deref() != Some(k.as_str()) {
                self.store.set(&format!("{prefix}served/{g}"), &k)?;
                taken.push((g, k));
            }
        }
        if taken.is_empty() {
            return Ok(false);
        }
        let list: Vec<String> = taken.iter().map(|(g, k)| format!("{g}:{k}")).collect();
        self.store.set(&format!("{prefix}regroup_round/{round}"), &list.join(","))?;
        for (g, k) in &taken {
            self.store.set(&format!("{prefix}regroup/{g}/{k}"), &format!("{round};{}", s.quorum.encode()))?;
        }
        Ok(true)
    }

    /// A restarted group's rank: says it waits to rejoin (incarnation `k`), waits until a step's last voter takes
    /// its group in (however long the live groups' step takes), and forms that round's quorum with the others.
    /// Stops, naming why, when no other group has heartbeated for `quorum_timeout`.
    pub fn rejoin(&self, k: u64) -> Result<Formed> {
        let (p, prefix) = (self.place, self.prefix.clone());
        {
            let mut s = self.state();
            s.joining = true;
            self.store.set(&format!("{prefix}rejoin/{}", p.group), &k.to_string())?;
            self.store.add(&format!("{prefix}ready/{}/{k}", p.group), 1)?;
            let key = format!("{prefix}regroup/{}/{k}", p.group);
            let timeout = Duration::from_secs_f64(self.config.quorum_timeout);
            let mut others_seen = Instant::now();
            let text = loop {
                if let Some(text) = self.await_key(&key)? {
                    break text;
                }
                self.look(&mut s)?;
                if self.healthy(&s).iter().any(|&g| g != p.group) {
                    others_seen = Instant::now();
                } else if others_seen.elapsed() >= timeout {
                    return Err(self.error(format!(
                        "restarted (incarnation {k}) to rejoin, but no other replica group has heartbeated for `quorum_timeout`"
                    )));
                }
            };
            let parsed = text.split_once(';').and_then(|(r, q)| Some((r.parse::<u64>().ok()?, Quorum::decode(q)?)));
            let Some((round, quorum)) = parsed else {
                return Err(self.error(format!("`{key}` holds {text:?}")));
            };
            s.round = round;
            s.quorum = quorum;
        }
        self.form_quorum(0)
    }

    /// Runs `f` on the current quorum's group across the replica groups (None for a quorum of one), its errors
    /// this call's (a heal's transfer, unlike a step's collectives, has no vote to fall back on).
    pub fn with_group<R>(&self, f: impl FnOnce(Option<&GlooComm>) -> CommResult<R>) -> Result<R> {
        let s = self.state();
        Ok(f(s.group.as_ref())?)
    }

    /// After a step the quorum committed: the next round keeps its members with no meeting of its own (a member
    /// lost meanwhile fails a collective of the next step, whose vote discards it and forms a new quorum), so a
    /// step costs the ranks one agreement, the vote.
    pub fn keep_quorum(&self) {
        let mut s = self.state();
        s.round += 1;
        s.failed = None;
    }

    /// The value of `key` once it has one, read for at most half a heartbeat (then None: the caller looks at
    /// the heartbeats and asks again). Reads back off from 0.05 ms to 1 ms apart: a decision that comes at once
    /// (the common case) is seen at once, a long wait costs the store little. (Not the store's own blocking
    /// wait: c10d logs every one that times out, and it holds the connection while it waits.)
    fn await_key(&self, key: &str) -> Result<Option<String>> {
        let started = Instant::now();
        let half_beat = Duration::from_millis((self.config.heartbeat_ms / 2).max(1));
        let mut pause = Duration::from_micros(50);
        loop {
            if let Some(text) = self.store.get(key)? {
                return Ok(Some(text));
            }
            if started.elapsed() >= half_beat {
                return Ok(None);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// The gloo group of the quorum's members at this rank's shard position (None for a quorum of one).
    fn group_of(&self, q: &Quorum) -> Result<Option<GlooComm>> {
        if q.members.len() < 2 {
            return Ok(None);
        }
        let index = q.members.iter().position(|&g| g == self.place.group).expect("checked: a member");
        let prefix = format!("{}group/{}/{}/", self.prefix, q.id, self.place.shard_rank);
        Ok(Some(self.store.gloo_group(&prefix, index, q.members.len())?))
    }

    /// Votes on the current round's step (`ok`: this rank's collectives across the groups all succeeded) and
    /// returns what every rank of the quorum agreed: commit only if every member rank voted for it (the last
    /// voter writes the verdict); a vote against, a member found lost, or `quorum_timeout` discards it. The
    /// first verdict written wins, so no two ranks ever disagree.
    pub fn vote(&self, step: u64) -> Result<Verdict> {
        let mut s = self.state();
        let round = s.round - 1;
        let prefix = &self.prefix;
        let verdict_key = format!("{prefix}verdict/{round}");
        let voters = (s.quorum.members.len() * self.place.shard_size) as i64;
        let started = Instant::now();
        let timeout = Duration::from_secs_f64(self.config.quorum_timeout);
        let mut proposal = match &s.failed {
            Some(why) => {
                tracing::warn!(step, "a collective across the replica groups failed: {why}; the step is discarded");
                Some("discard")
            }
            None if self.store.add(&format!("{prefix}vote/{round}/yes"), 1)? == voters => {
                Some(if self.take_in_rejoining(&s)? { "regroup" } else { "commit" })
            }
            None => None,
        };
        let verdict = loop {
            if let Some(p) = proposal.take() {
                break self.store.set_once(&verdict_key, p)?;
            }
            if let Some(text) = self.await_key(&verdict_key)? {
                break text;
            }
            self.look(&mut s)?;
            let healthy = self.healthy(&s);
            if let Some(lost) = s.quorum.members.iter().find(|g| !healthy.contains(g)) {
                tracing::warn!(step, "replica group {lost} stopped heartbeating during step {step}");
                proposal = Some("discard");
            } else if started.elapsed() >= timeout {
                tracing::warn!(step, "the vote on step {step} waited `quorum_timeout` for the members' votes");
                proposal = Some("discard");
            }
        };
        tracing::debug!(round, step, verdict, "vote in {:?}", started.elapsed());
        Ok(match verdict.as_str() {
            "commit" => Verdict::Commit,
            "regroup" => Verdict::Regroup,
            _ => Verdict::Discard,
        })
    }

    /// Runs `f` on the current quorum's group across the replica groups, unless one of them failed this round
    /// already; a failure is kept for the vote and is not an error here.
    fn across<R: Default>(&self, op: &str, f: impl FnOnce(&GlooComm) -> CommResult<R>) -> CommResult<R> {
        let mut s = self.state();
        if s.failed.is_some() {
            return Ok(R::default());
        }
        let Some(group) = s.group.as_ref() else { return Ok(R::default()) };
        match f(group) {
            Ok(r) => Ok(r),
            Err(e) => {
                tracing::warn!(op, "across the replica groups: {e}");
                s.failed = Some(e.to_string());
                Ok(R::default())
            }
        }
    }
}

/// The replica groups as a communicator for the engine: its members are the current quorum's groups, so a
/// mean is over the live groups only.
pub struct ManagedReplicas(pub Arc<Manager>);

impl Communicator for ManagedReplicas {
    fn rank(&self) -> usize {
        self.0.live_place().0
    }

    fn world_size(&self) -> usize {
        self.0.live_place().1
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.0.across("all-reduce", |g| g.all_reduce_buf(buf, op))
    }

    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.0.across("reduce-scatter", |g| g.reduce_scatter_buf(input, output, op))
    }

    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        self.0.across("all-gather", |g| g.all_gather_buf(buf))
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        self.0.across("broadcast", |g| g.broadcast_buf(buf, root))
    }

    fn barrier(&self) -> CommResult<()> {
        self.0.across("barrier", |g| g.barrier())
    }

    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        self.0.across("send", |g| g.send_buf(buf, dst))
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        self.0.across("recv", |g| g.recv_buf(buf, src))
    }

    fn split_group(&self, _split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        Err(crate::comm::CommError::BadArgument {
            op: "split",
            rank: self.rank(),
            what: "the fault-tolerant replica groups change members from step to step: no fixed group splits from them"
                .into(),
        })
    }

    fn group_name(&self) -> String {
        "replica groups (fault-tolerant)".into()
    }
}
