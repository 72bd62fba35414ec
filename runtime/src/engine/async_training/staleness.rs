//! Bounded staleness (`async_training.mode = "bounded_staleness"`): stale synchronous parallel (Ho et al. 2013) on
//! stage 1's partition, with every rank both a worker and the owner of one partition (a parameter server spread
//! over the ranks, as ZeRO spreads the optimizer). No collective runs during training:
//!
//! - A worker at clock c (its optimizer steps so far) pushes partition k of its gradients into owner k's inbox: one
//!   slot per worker and clock modulo `staleness + 1`, written straight into k's window (shared memory, one-sided),
//!   stamped with the clock and with how many steps owner k had applied to the values it computed on.
//! - An owner adds each gradient into the accumulator of its clock as it finds it (divided by its staleness with
//!   `lr_staleness_scaling`), and once every worker's gradient of its next clock is in, steps its partition with
//!   their mean and publishes the values (a sequence lock) with the new count. Summing a clock's gradients before
//!   one step keeps s = 0 exactly synchronous data parallelism, and Adam sees the gradient it would see there.
//! - Before clock c + 1 a worker pulls every owner's latest values, waiting only for owners that have applied
//!   fewer than c + 1 - s steps: it never runs more than s clocks ahead of the slowest, and the values a gradient is
//!   computed on lack at most s steps (its staleness, counted by the owners: `staleness_counts`).
//!
//! The engine drives it from `staleness_step.rs`. Where ranks do not share memory (gloo), `staleness_relay.rs` carries the pushes and the owners' values as
//! messages into the owners' windows and into mirrors of them, and the logic here reads those alike.
//!
//! Owners serve from the worker's own thread, whenever it is inside `engine.step()` (and while it waits there), so
//! the optimizer state stays the engine's. Every wait has the config's `comms_timeout` and names the rank waited
//! for: a dead rank is an error, never a hang.
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::comm::region::SharedBuffer;
use crate::comm::Communicator;
use crate::error::{Error, Result};

/// Header words of a window: the owner's applied steps and the sequence lock over its published values.
pub(crate) const APPLIED: usize = 0;
pub(crate) const SEQ: usize = 1;
const HEADER_WORDS: usize = 8;
/// Stamps of one inbox slot: the clock + 1 of the gradient written there, of the last one the owner took, and the
/// owner's applied count the worker's values were from.
pub(crate) const FILLED: usize = 0;
pub(crate) const TAKEN: usize = 1;
pub(crate) const BASE: usize = 2;
const STAMP_WORDS: usize = 3;

/// Where things are in a window: the header, the stamps of every worker's inbox slots, the owner's published
/// values, then the inbox (a slot per worker and clock modulo `slots`). A relay's mirror of a peer's window
/// (message-passing backends) stops after the values.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WindowLayout {
    pub world: usize,
    pub slots: usize,
    /// Elements of one partition.
    pub partition: usize,
}

impl WindowLayout {
    fn values_offset(&self) -> usize {
        ((HEADER_WORDS + self.world * self.slots * STAMP_WORDS) * 8).next_multiple_of(64)
    }

    /// Bytes of a whole window.
    pub fn bytes(&self) -> usize {
        self.values_offset() + (1 + self.world * self.slots) * self.partition * 4
    }

    /// Bytes of a mirror: the header, the stamps and the values.
    pub fn mirror_bytes(&self) -> usize {
        self.values_offset() + self.partition * 4
    }

    /// Word `index` of the window at `base`.
    ///
    /// # Safety
    /// `base` is a live window (or mirror) of this layout, u64-aligned; shared words are only accessed atomically.
    pub unsafe fn word<'a>(&self, base: usize, index: usize) -> &'a AtomicU64 {
        unsafe { &*((base as *const AtomicU64).add(index)) }
    }

    /// Stamp `which` of `worker`'s inbox slot `slot` in the window at `base` (safety: as [`WindowLayout::word`]).
    pub unsafe fn stamp<'a>(&self, base: usize, worker: usize, slot: usize, which: usize) -> &'a AtomicU64 {
        unsafe { self.word(base, HEADER_WORDS + (worker * self.slots + slot) * STAMP_WORDS + which) }
    }

    /// The published values of the window at `base`.
    ///
    /// # Safety
    /// As [`WindowLayout::word`]; written by one writer only inside its sequence lock, read inside it; the slice is
    /// dropped before the window goes.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn values<'a>(&self, base: usize) -> &'a mut [f32] {
        unsafe { std::slice::from_raw_parts_mut((base + self.values_offset()) as *mut f32, self.partition) }
    }

    /// Worker `w`'s inbox slot `slot` in the (whole) window at `base`.
    ///
    /// # Safety
    /// As [`WindowLayout::word`]; the worker writes it while its FILLED stamp says the owner took the last one,
    /// the owner reads it after; the slice is dropped before the window goes.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn inbox<'a>(&self, base: usize, w: usize, slot: usize) -> &'a mut [f32] {
        let p = base + self.values_offset() + (1 + w * self.slots + slot) * self.partition * 4;
        unsafe { std::slice::from_raw_parts_mut(p as *mut f32, self.partition) }
    }
}

/// One clock's gradients summed on the owner.
struct Accumulator {
    clock: Option<u64>,
    count: usize,
    sum: Vec<f32>,
}

pub(crate) struct BoundedStaleness {
    /// Message-passing backends: the threads that carry pushes to the owners and the owners' values back (dropped,
    /// and joined, before the windows they write).
    relay: Option<crate::engine::async_training::relay::Relay>,
    /// This rank's window: header, stamps, its published values, its inbox.
    _window: SharedBuffer,
    /// Message-passing backends: this rank's mirror of every peer's window (header, stamps, values).
    _mirrors: Vec<Vec<u64>>,
    /// Every rank's window as mapped here (or its mirror).
    windows: Vec<usize>,
    layout: WindowLayout,
    rank: usize,
    world: usize,
    staleness: u64,
    scaling: bool,
    /// Elements of one partition (the padded flat length over the world size).
    partition: usize,
    /// Steps this worker has pushed.
    clock: u64,
    /// Per owner: how many steps it had applied to the values this worker last pulled.
    based: Vec<u64>,
    /// By clock modulo `staleness + 1`.
    accumulators: Vec<Accumulator>,
    /// Applied gradients by staleness (index: steps of updates their values lacked).
    staleness_counts: Vec<u64>,
    timeout: Duration,
    /// `finish` ran: every owner applied every step and every rank holds the final values.
    finished: bool,
}

/// The optimizer step an owner runs on its partition, in the order its steps are applied: (the partition's values,
/// the mean gradient).
pub(crate) type OwnerStep<'a> = dyn FnMut(&mut [f32], &[f32]) -> Result<()> + 'a;

impl BoundedStaleness {
    /// Sets up this rank's window with its partition of `flat` (the whole padded model; every rank starts from the
    /// same) and maps every peer's: one-sided where ranks share memory (shm, threads), else through a relay of
    /// messages over groups of two ranks (gloo). Collective.
    pub fn new(
        comm: &dyn Communicator,
        flat: &[f32],
        staleness: u64,
        scaling: bool,
        timeout: Duration,
    ) -> Result<BoundedStaleness> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let partition = flat.len() / world;
        let slots = staleness as usize + 1;
        let layout = WindowLayout { world, slots, partition };
        let mut window = SharedBuffer::zeroed(layout.bytes());
        let (windows, mirrors, relay) = match comm.window(window.as_slice_mut::<u8>())? {
            Some(windows) => (windows, Vec::new(), None),
            None if comm.independent_groups() => {
                // Each peer's mirror starts as its window does: applied 0 and its partition of the model.
                let mut mirrors: Vec<Vec<u64>> = (0..world)
                    .map(|k| if k == rank { Vec::new() } else { vec![0u64; layout.mirror_bytes().div_ceil(8)] })
                    .collect();
                let mut windows: Vec<usize> = mirrors.iter_mut().map(|m| m.as_mut_ptr() as usize).collect();
                windows[rank] = window.as_slice_mut::<u8>().as_mut_ptr() as usize;
                for k in (0..world).filter(|&k| k != rank) {
                    // SAFETY: the mirror just made, of this layout; no thread reads it yet.
                    unsafe { layout.values(windows[k]) }.copy_from_slice(&flat[k * partition..(k + 1) * partition]);
                }
                let relay = crate::engine::async_training::relay::Relay::new(comm, layout, &windows)?;
                (windows, mirrors, Some(relay))
            }
            None => {
                return Err(Error::Unsupported {
                    key: "async_training.mode",
                    value: "\"bounded_staleness\"".into(),
                    why: "bounded staleness needs ranks that share memory (shm, threads) or a backend whose groups carry messages from threads of their own (gloo); this backend has neither (MPI runs serialized)",
                })
            }
        };
        let ps = BoundedStaleness {
            relay,
            _window: window,
            _mirrors: mirrors,
            windows,
            layout,
            rank,
            world,
            staleness,
            scaling,
            partition,
            clock: 0,
            based: vec![0; world],
            accumulators: (0..slots)
                .map(|_| Accumulator { clock: None, count: 0, sum: vec![0.0; partition] })
                .collect(),
            staleness_counts: vec![0; slots],
            timeout,
            finished: false,
        };
        // SAFETY: this rank's own published values; nobody reads them before the barrier below.
        unsafe { ps.values(rank) }.copy_from_slice(&flat[rank * partition..(rank + 1) * partition]);
        comm.barrier()?;
        Ok(ps)
    }

    fn slots(&self) -> usize {
        self.layout.slots
    }

    fn word(&self, k: usize, index: usize) -> &AtomicU64 {
        // SAFETY: rank k's window (or mirror) lives as long as this value.
        unsafe { self.layout.word(self.windows[k], index) }
    }

    fn stamp(&self, owner: usize, worker: usize, slot: usize, which: usize) -> &AtomicU64 {
        // SAFETY: as `word`.
        unsafe { self.layout.stamp(self.windows[owner], worker, slot, which) }
    }

    /// Owner k's published values.
    ///
    /// # Safety
    /// Written by the owner (or, for a mirror, its relay thread) only inside its sequence lock; the caller reads
    /// them inside it or is the owner, and drops the slice before the window goes (the engine's end).
    unsafe fn values<'a>(&self, k: usize) -> &'a mut [f32] {
        unsafe { self.layout.values(self.windows[k]) }
    }

    /// Worker `w`'s inbox slot `slot` at owner k (a whole window: shared memory, or this rank's own).
    ///
    /// # Safety
    /// As [`WindowLayout::inbox`].
    unsafe fn inbox<'a>(&self, k: usize, w: usize, slot: usize) -> &'a mut [f32] {
        unsafe { self.layout.inbox(self.windows[k], w, slot) }
    }

    /// Gradients this rank applied as an owner, by staleness (index 0: computed on up-to-date values).
    pub fn staleness_counts(&self) -> &[u64] {
        &self.staleness_counts
    }

    /// Pushes this worker's gradients of its current clock (`grads`: the whole padded flat model) into every
    /// owner's inbox, then waits for the values of the next clock (pulled into `flat`, every partition but this
    /// rank's own, which `step` updates in place), serving this rank's inbox meanwhile.
    pub fn step(&mut self, grads: &[f32], flat: &mut [f32], step: &mut OwnerStep<'_>) -> Result<()> {
        if self.finished {
            return Err(Error::Usage(
                "bounded_staleness: the engine was finished (`engine.finish()`); no more steps".into(),
            ));
        }
        self.push(grads)?;
        self.serve(flat, step)?;
        self.pull(flat, step, self.clock.saturating_sub(self.staleness))
    }

    fn push(&mut self, grads: &[f32]) -> Result<()> {
        let (c, slot, p) = (self.clock, (self.clock % self.slots() as u64) as usize, self.partition);
        for k in 0..self.world {
            // The slot's last gradient (clock c - slots) was taken: it was, since this worker's pull of clock c
            // waited for owner k to apply clock c - s - 1, which needs it.
            let taken = self.stamp(k, self.rank, slot, TAKEN);
            self.wait(k, "take this rank's gradient of an earlier step", || {
                taken.load(Ordering::Acquire) + self.slots() as u64 > c
            })?;
            let part = &grads[k * p..(k + 1) * p];
            match &self.relay {
                Some(relay) if k != self.rank => {
                    // The mirror's stamps say what was pushed (the relay marks it taken once k applies it).
                    self.stamp(k, self.rank, slot, BASE).store(self.based[k], Ordering::Relaxed);
                    self.stamp(k, self.rank, slot, FILLED).store(c + 1, Ordering::Release);
                    relay.push(k, c + 1, self.based[k], part)?;
                }
                _ => {
                    // SAFETY: the slot is free (above) and only this worker writes it.
                    unsafe { self.inbox(k, self.rank, slot) }.copy_from_slice(part);
                    self.stamp(k, self.rank, slot, BASE).store(self.based[k], Ordering::Relaxed);
                    self.stamp(k, self.rank, slot, FILLED).store(c + 1, Ordering::Release);
                }
            }
        }
        self.clock += 1;
        Ok(())
    }

    /// Takes every gradient waiting in this rank's inbox into its clock's accumulator, and steps this rank's
    /// partition (in `flat`) for every clock whose gradients are all in, in order. Returns whether it did anything.
    fn serve(&mut self, flat: &mut [f32], step: &mut OwnerStep<'_>) -> Result<bool> {
        let (me, slots, p) = (self.rank, self.slots(), self.partition);
        let mut progressed = false;
        for w in 0..self.world {
            for slot in 0..slots {
                let filled = self.stamp(me, w, slot, FILLED).load(Ordering::Acquire);
                if filled <= self.stamp(me, w, slot, TAKEN).load(Ordering::Relaxed) {
                    continue;
                }
                let clock = filled - 1;
                let base = self.stamp(me, w, slot, BASE).load(Ordering::Relaxed);
                let staleness = clock - base;
                if staleness > self.staleness {
                    return Err(Error::Usage(format!(
                        "bounded_staleness: rank {w}'s gradient of step {clock} was computed on values {staleness} steps old (the bound is {})",
                        self.staleness
                    )));
                }
                self.staleness_counts[staleness as usize] += 1;
                let scale = if self.scaling && staleness > 1 { 1.0 / staleness as f32 } else { 1.0 };
                // SAFETY: FILLED (acquired above) says the worker finished writing this slot; it writes it again only
                // after TAKEN below.
                let g: &[f32] = unsafe { self.inbox(me, w, slot) };
                let acc = &mut self.accumulators[(clock % slots as u64) as usize];
                if acc.clock != Some(clock) {
                    debug_assert_eq!(acc.count, 0, "an accumulator is reused only once stepped");
                    acc.clock = Some(clock);
                    acc.sum.fill(0.0);
                }
                acc.sum.iter_mut().zip(g.iter()).for_each(|(a, g)| *a += g * scale);
                acc.count += 1;
                self.stamp(me, w, slot, TAKEN).store(filled, Ordering::Release);
                progressed = true;
            }
        }
        loop {
            let applied = self.word(me, APPLIED).load(Ordering::Relaxed);
            let acc = &mut self.accumulators[(applied % slots as u64) as usize];
            if acc.clock != Some(applied) || acc.count < self.world {
                break;
            }
            let inv = 1.0 / self.world as f32;
            acc.sum.iter_mut().for_each(|g| *g *= inv);
            let own = &mut flat[me * p..(me + 1) * p];
            step(own, &acc.sum)?;
            (acc.clock, acc.count) = (None, 0);
            // Publish the values and the count together (readers retry while SEQ is odd or moved).
            self.word(me, SEQ).fetch_add(1, Ordering::AcqRel);
            // SAFETY: this rank's own published values, written inside its sequence lock.
            unsafe { self.values(me) }.copy_from_slice(own);
            self.word(me, APPLIED).store(applied + 1, Ordering::Release);
            self.word(me, SEQ).fetch_add(1, Ordering::Release);
            if let Some(relay) = &self.relay {
                relay.publish(applied + 1, own)?;
            }
            progressed = true;
        }
        Ok(progressed)
    }

    /// Pulls every owner's values once it has applied at least `need` steps (serving this rank's inbox while it
    /// waits).
    fn pull(&mut self, flat: &mut [f32], step: &mut OwnerStep<'_>, need: u64) -> Result<()> {
        let p = self.partition;
        for k in 0..self.world {
            let started = Instant::now();
            while self.word(k, APPLIED).load(Ordering::Acquire) < need {
                if !self.serve(flat, step)? {
                    if started.elapsed() > self.timeout {
                        return Err(self.stuck(k));
                    }
                    std::thread::yield_now();
                }
            }
            if k == self.rank {
                // This rank's partition is stepped in place: `flat` holds the owner's values.
                self.based[k] = self.word(k, APPLIED).load(Ordering::Relaxed);
                continue;
            }
            loop {
                let before = self.word(k, SEQ).load(Ordering::Acquire);
                if before % 2 == 1 {
                    std::hint::spin_loop();
                    continue;
                }
                let applied = self.word(k, APPLIED).load(Ordering::Acquire);
                // SAFETY: read inside owner k's sequence lock; a torn copy is thrown away below.
                flat[k * p..(k + 1) * p].copy_from_slice(unsafe { self.values(k) });
                fence(Ordering::Acquire);
                if self.word(k, SEQ).load(Ordering::Relaxed) == before {
                    self.based[k] = applied;
                    break;
                }
            }
        }
        Ok(())
    }

    /// Ends the run (collective): serves this rank's inbox until it has applied every step (which needs every
    /// worker's last gradients), then, once every owner has, pulls every partition, so every rank holds the final
    /// values; the closing barrier keeps each window until every rank has read it.
    pub fn finish(&mut self, comm: &dyn Communicator, flat: &mut [f32], step: &mut OwnerStep<'_>) -> Result<()> {
        if self.finished {
            return Ok(());
        }
        self.quiesce(comm, flat, step)?;
        self.finished = true;
        Ok(())
    }

    /// Brings every rank to the same values (collective): what `finish` does, after which training may go on (a
    /// checkpoint is taken here: no gradient is in flight, every owner has applied every step).
    pub fn quiesce(&mut self, comm: &dyn Communicator, flat: &mut [f32], step: &mut OwnerStep<'_>) -> Result<()> {
        let started = Instant::now();
        while self.word(self.rank, APPLIED).load(Ordering::Acquire) < self.clock {
            if !self.serve(flat, step)? {
                let slowest = (0..self.world).min_by_key(|&w| self.pushed_to(self.rank, w)).unwrap_or(0);
                self.check_timeout(slowest, started, "push its last steps' gradients")?;
                std::thread::yield_now();
            }
        }
        comm.barrier()?;
        self.pull(flat, step, self.clock)?;
        comm.barrier()?;
        Ok(())
    }

    /// The latest clock + 1 worker `w` pushed into owner k's inbox.
    fn pushed_to(&self, k: usize, w: usize) -> u64 {
        (0..self.slots()).map(|s| self.stamp(k, w, s, FILLED).load(Ordering::Relaxed)).max().unwrap_or(0)
    }

    /// Why owner k has not applied its next step after the timeout: the workers whose gradient of that step it has
    /// not got (a rank that died), read from its inbox's stamps.
    fn stuck(&self, k: usize) -> Error {
        let next = self.word(k, APPLIED).load(Ordering::Acquire);
        if let (Some(relay), true) = (&self.relay, k != self.rank) {
            // A mirror knows only this worker's pushes: what the relay saw fail, if anything.
            let mut why =
                format!("rank {k} has not published it (it, or a rank whose gradient it waits for, may have died)");
            if let Some(failure) = relay.failure(k) {
                why += &format!("; rank {k}: {failure}");
            }
            return Error::Usage(format!(
                "bounded_staleness: rank {} waited {:.0} s (comms_timeout) for step {next} to be applied to partition {k}: {why}",
                self.rank,
                self.timeout.as_secs_f64()
            ));
        }
        let missing: Vec<usize> = (0..self.world).filter(|&w| self.pushed_to(k, w) <= next).collect();
        let why = if missing.is_empty() {
            format!("rank {k} has every gradient of it and has not stepped (it may have died)")
        } else {
            let ranks: Vec<String> = missing.iter().map(|w| w.to_string()).collect();
            format!("rank {k} has no gradient of it from rank {} (it may have died)", ranks.join(", rank "))
        };
        Error::Usage(format!(
            "bounded_staleness: rank {} waited {:.0} s (comms_timeout) for step {next} to be applied to partition {k}: {why}",
            self.rank,
            self.timeout.as_secs_f64()
        ))
    }

    fn wait(&self, k: usize, what: &str, mut ready: impl FnMut() -> bool) -> Result<()> {
        let started = Instant::now();
        while !ready() {
            self.check_timeout(k, started, what)?;
            std::thread::yield_now();
        }
        Ok(())
    }

    fn check_timeout(&self, k: usize, started: Instant, what: &str) -> Result<()> {
        if started.elapsed() > self.timeout {
            return Err(Error::Usage(format!(
                "bounded_staleness: rank {} waited {:.0} s (comms_timeout) for rank {k} to {what}; it may have died",
                self.rank,
                self.timeout.as_secs_f64()
            )));
        }
        Ok(())
    }
}
