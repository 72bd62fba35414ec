//! Bounded staleness over a backend that only carries messages (gloo, across hosts): what shared memory does one-
//! sidedly, threads of each rank do with messages. Between every two ranks a and b there are two groups of two,
//! one per direction and kind: a's pushes of gradients to b, and a's publications of its values to b. A push
//! goes out from the worker's step straight to a thread of the owner that writes it into the owner's inbox and
//! stamps it, as a peer would through shared memory; an owner that applies a step sends its values to every
//! peer, where a thread writes them into that peer's mirror of the owner's window (under its sequence lock) and
//! marks the pushes the step took. The bounded-staleness logic then reads windows and mirrors as it reads shared
//! windows.
//!
//! Each group is used by one thread on each side, so this needs groups that run from threads of their own
//! ([`Communicator::independent_groups`]). A receiving thread waits with the group's timeout: a peer silent
//! for `comms_timeout` (or dead) ends it, and the waits of the step then fail naming the rank.
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::comm::{Collectives, Communicator};
use crate::engine::async_training::staleness::{WindowLayout, APPLIED, BASE, FILLED, SEQ, TAKEN};
use crate::error::{Error, Result};

/// First word of a message header: what follows.
const STOP: i64 = 0;
const PUSH: i64 = 1;
const PUBLISH: i64 = 2;
const HEADER: usize = 3;

pub(crate) struct Relay {
    rank: usize,
    /// By peer: the group this rank pushes its gradients to it over (this rank is the group's rank 0).
    push_to: Vec<Option<Box<dyn Communicator>>>,
    /// By peer: the group this rank publishes its values to it over.
    publish_to: Vec<Option<Box<dyn Communicator>>>,
    receivers: Vec<JoinHandle<()>>,
    /// By peer: what ended a receiving thread of its streams early (the peer gone, or silent for the group's
    /// timeout), for the errors of the waits.
    failures: Arc<Mutex<Vec<Option<String>>>>,
}

/// A window address handed to a receiving thread.
#[derive(Clone, Copy)]
struct Window(usize);

impl Relay {
    /// The groups and the receiving threads; `windows[rank]` is this rank's window, `windows[k]` its mirror of
    /// rank k's. Collective.
    pub fn new(comm: &dyn Communicator, layout: WindowLayout, windows: &[usize]) -> Result<Relay> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let mut relay = Relay {
            rank,
            push_to: (0..world).map(|_| None).collect(),
            publish_to: (0..world).map(|_| None).collect(),
            receivers: Vec::new(),
            failures: Arc::new(Mutex::new(vec![None; world])),
        };
        for from in 0..world {
            for to in (0..world).filter(|&to| to != from) {
                let push = comm.new_group(&[from, to])?;
                let publish = comm.new_group(&[from, to])?;
                if rank == from {
                    relay.push_to[to] = push;
                    relay.publish_to[to] = publish;
                } else if let (true, Some(push), Some(publish)) = (rank == to, push, publish) {
                    let failures = relay.failures.clone();
                    let own = Window(windows[rank]);
                    relay.receivers.push(spawn(format!("push from {from}"), move || {
                        if let Err(why) = receive_pushes(push.as_ref(), layout, own, from) {
                            record(&failures, from, why)
                        }
                    })?);
                    let failures = relay.failures.clone();
                    let mirror = Window(windows[from]);
                    relay.receivers.push(spawn(format!("values of {from}"), move || {
                        if let Err(why) = receive_values(publish.as_ref(), layout, mirror, rank) {
                            record(&failures, from, why)
                        }
                    })?);
                }
            }
        }
        Ok(relay)
    }

    /// Sends this worker's gradient of clock `filled - 1` (computed on values `base` steps into owner k's) to k.
    pub fn push(&self, k: usize, filled: u64, base: u64, part: &[f32]) -> Result<()> {
        let group = self.push_to[k].as_deref().expect("a group to every peer");
        let sent = group.send(&[PUSH, filled as i64, base as i64], 1).and_then(|_| group.send(part, 1));
        sent.map_err(|e| self.lost(k, "push a gradient to", e))
    }

    /// Sends this owner's values after its `applied`-th step to every peer.
    pub fn publish(&self, applied: u64, values: &[f32]) -> Result<()> {
        for (k, group) in self.publish_to.iter().enumerate() {
            let Some(group) = group.as_deref() else { continue };
            let sent = group.send(&[PUBLISH, applied as i64, 0], 1).and_then(|_| group.send(values, 1));
            sent.map_err(|e| self.lost(k, "send its values to", e))?;
        }
        Ok(())
    }

    /// What ended a receiving thread of rank k's streams, if one ended early.
    pub fn failure(&self, k: usize) -> Option<String> {
        self.failures.lock().unwrap_or_else(|p| p.into_inner())[k].clone()
    }

    fn lost(&self, k: usize, what: &str, e: crate::comm::CommError) -> Error {
        Error::Usage(format!("bounded_staleness: rank {} could not {what} rank {k} (it may have died): {e}", self.rank))
    }
}

impl Drop for Relay {
    /// Tells every peer's receiving threads to end, then waits for this rank's (which end when the peers do the
    /// same); a peer that is gone fails its sends, which are let be.
    fn drop(&mut self) {
        for group in self.push_to.iter().chain(&self.publish_to).flatten() {
            let _ = group.send(&[STOP, 0, 0], 1);
        }
        for thread in self.receivers.drain(..) {
            let _ = thread.join();
        }
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("zerorun staleness {name}"))
        .spawn(f)
        .map_err(|e| Error::Usage(format!("bounded_staleness: cannot start a relay thread: {e}")))
}

fn record(failures: &Mutex<Vec<Option<String>>>, peer: usize, what: String) {
    let mut all = failures.lock().unwrap_or_else(|p| p.into_inner());
    all[peer].get_or_insert(what);
}

/// The owner's side of worker `from`'s pushes: each into its inbox slot of this rank's window, stamped.
fn receive_pushes(
    group: &dyn Communicator,
    layout: WindowLayout,
    own: Window,
    from: usize,
) -> std::result::Result<(), String> {
    loop {
        let mut header = [0i64; HEADER];
        group.recv(&mut header, 0).map_err(|e| format!("its pushes stopped coming: {e}"))?;
        if header[0] != PUSH {
            return Ok(());
        }
        let (filled, base) = (header[1] as u64, header[2] as u64);
        let slot = ((filled - 1) % layout.slots as u64) as usize;
        // SAFETY: this rank's window lives until the relay is dropped (which joins this thread); the worker pushes
        // into a slot only once the owner took its last gradient, so nothing reads it now.
        let inbox = unsafe { layout.inbox(own.0, from, slot) };
        group.recv(inbox, 0).map_err(|e| format!("its push of step {} broke off: {e}", filled - 1))?;
        // SAFETY: as above; stamps are atomics.
        unsafe {
            layout.stamp(own.0, from, slot, BASE).store(base, Ordering::Relaxed);
            layout.stamp(own.0, from, slot, FILLED).store(filled, Ordering::Release);
        }
    }
}

/// A worker's side of an owner's publications: each into this rank's mirror of the owner's window, under its
/// sequence lock, and the pushes of `me` the owner's steps so far took marked taken.
fn receive_values(
    group: &dyn Communicator,
    layout: WindowLayout,
    mirror: Window,
    me: usize,
) -> std::result::Result<(), String> {
    let mut values = vec![0f32; layout.partition];
    loop {
        let mut header = [0i64; HEADER];
        group.recv(&mut header, 0).map_err(|e| format!("its values stopped coming: {e}"))?;
        if header[0] != PUBLISH {
            return Ok(());
        }
        group.recv(&mut values, 0).map_err(|e| format!("its values of step {} broke off: {e}", header[1]))?;
        let applied = header[1] as u64;
        // SAFETY: the mirror lives until the relay is dropped (which joins this thread); this thread is its only
        // writer, inside the sequence lock the worker reads it under.
        unsafe {
            layout.word(mirror.0, SEQ).fetch_add(1, Ordering::AcqRel);
            layout.values(mirror.0).copy_from_slice(&values);
            layout.word(mirror.0, APPLIED).store(applied, Ordering::Release);
            layout.word(mirror.0, SEQ).fetch_add(1, Ordering::Release);
            // A step applied every gradient of its clock: the pushes of clocks before `applied` were taken.
            for slot in 0..layout.slots {
                let filled = layout.stamp(mirror.0, me, slot, FILLED).load(Ordering::Acquire);
                let taken = layout.stamp(mirror.0, me, slot, TAKEN);
                if filled <= applied && filled > taken.load(Ordering::Relaxed) {
                    taken.store(filled, Ordering::Release);
                }
            }
        }
    }
}
