//! Each rank's heartbeat on the job's store, and what a rank reads from the others': a counter per rank that a
//! thread bumps every `heartbeat_ms`, and the time (this rank's own clock, so hosts' clocks never compare) each
//! counter was last seen to move. A rank whose counter stood still for `heartbeat_timeout` is lost, and with it
//! its replica group.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::CommResult;
use crate::gloo::TcpStore;

/// The key of rank `rank`'s heartbeat counter in its incarnation `k` (0: the job's first start; a restarted
/// group's ranks beat apart, so their old counter stands still and the group is found lost before it rejoins).
pub(crate) fn beat_key(prefix: &str, rank: usize, k: u64) -> String {
    match k {
        0 => format!("{prefix}beat/{rank}"),
        k => format!("{prefix}beat/{rank}@{k}"),
    }
}

/// The thread that bumps this rank's counter; it stops when dropped (or when the store is gone).
pub(crate) struct Heartbeat {
    stop: Arc<AtomicBool>,
}

impl Heartbeat {
    pub fn start(store: Arc<TcpStore>, prefix: &str, rank: usize, k: u64, every: Duration) -> Heartbeat {
        let stop = Arc::new(AtomicBool::new(false));
        let (key, flag) = (beat_key(prefix, rank, k), stop.clone());
        std::thread::Builder::new()
            .name(format!("zerorun-heartbeat-{rank}"))
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    if let Err(e) = store.add(&key, 1) {
                        tracing::warn!(rank, "heartbeat stopped: {e}");
                        return;
                    }
                    std::thread::sleep(every);
                }
            })
            .expect("a thread for the heartbeat");
        Heartbeat { stop }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// What this rank has seen of every rank's heartbeat.
pub(crate) struct Liveness {
    prefix: String,
    timeout: Duration,
    /// Per rank: the counter last read and when it was first seen at that value.
    seen: Vec<(i64, Instant)>,
    /// Per rank: the incarnation whose counter is read.
    incarnations: Vec<u64>,
    /// Ranks found lost (they stay lost: a lost rank's group must heal before it counts again).
    lost: Vec<bool>,
}

impl Liveness {
    pub fn new(prefix: &str, ranks: usize, timeout: Duration) -> Liveness {
        let now = Instant::now();
        Liveness {
            prefix: prefix.into(),
            timeout,
            seen: vec![(-1, now); ranks],
            incarnations: vec![0; ranks],
            lost: vec![false; ranks],
        }
    }

    /// Reads every rank's counter; a counter that moved restarts that rank's clock.
    pub fn observe(&mut self, store: &TcpStore) -> CommResult<()> {
        let now = Instant::now();
        for (rank, (value, since)) in self.seen.iter_mut().enumerate() {
            if self.lost[rank] {
                continue;
            }
            let v = store.add(&beat_key(&self.prefix, rank, self.incarnations[rank]), 0)?;
            if v != *value {
                *value = v;
                *since = now;
            } else if now.duration_since(*since) > self.timeout {
                self.lost[rank] = true;
            }
        }
        Ok(())
    }

    /// Counts rank `rank` alive again from now, reading its incarnation `k`'s counter (its group was restarted
    /// and rejoins).
    pub fn revive(&mut self, rank: usize, k: u64) {
        self.lost[rank] = false;
        self.incarnations[rank] = k;
        self.seen[rank] = (-1, Instant::now());
    }

    /// Whether rank `rank` is still heartbeating (as of the last [`observe`](Self::observe)).
    pub fn alive(&self, rank: usize) -> bool {
        !self.lost[rank]
    }
}
