//! The communication logger (DeepSpeed's `comms_logger`): the [`Observer`] of a [`Logged`] communicator, timing every
//! collective it runs and recording it by name (DeepSpeed's: all_reduce, all_gather, reduce_scatter, all_to_all,
//! broadcast, send, recv, barrier), group size and message size; groups split from it record into the same
//! [`CommLog`]. Bandwidths follow
//! nccl-tests (doc/PERFORMANCE.md): algorithm bandwidth = S / t with S the whole buffer (the gathered buffer, the
//! reduce-scatter's input), bus bandwidth = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather,
//! reduce-scatter and all-to-all, x 1 otherwise, n the group's size (DeepSpeed uses the world's). Bus bytes
//! (S x the same factor) are what one rank sends: the figure the ZeRO formulas give per step.
//!
//! A collective is timed on the thread that runs it, from the call to its return: no device synchronize is added
//! (DeepSpeed's logger synchronizes after every op, serialising asynchronous communication).
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::observed::{Call, Observed, Observer};
use crate::CommResult;

/// Which collectives a [`Logged`] communicator records.
#[derive(Debug, Clone, Default)]
pub struct LogPolicy {
    /// Only these names (None: all).
    pub only: Option<Vec<&'static str>>,
    /// Log each collective as it ends (tracing, info).
    pub verbose: bool,
}

/// One row of the log: a collective, a group size and a message size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpKey {
    /// DeepSpeed's name for it.
    pub op: &'static str,
    /// Ranks in the group it ran on.
    pub group_size: usize,
    /// Bytes of the whole buffer (nccl-tests' S).
    pub bytes: usize,
}

/// What the calls of one [`OpKey`] added up to.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpStats {
    /// Calls.
    pub count: u64,
    /// Their time.
    pub total: Duration,
}

/// nccl-tests' bus-bandwidth factor of `op` on `n` ranks.
pub fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n.max(1) as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "all_to_all" => (n - 1.0) / n,
        _ => 1.0,
    }
}

impl OpKey {
    /// Bytes one rank sends per call: S x the bus factor.
    pub fn bus_bytes(&self) -> f64 {
        self.bytes as f64 * bus_factor(self.op, self.group_size)
    }
}

/// The calls recorded, shared by a communicator and the groups split from it.
#[derive(Debug, Default)]
pub struct CommLog {
    rows: Mutex<BTreeMap<OpKey, OpStats>>,
    policy: LogPolicy,
    /// Not recording for now (an evaluation's gathers are no training step's).
    paused: std::sync::atomic::AtomicBool,
}

impl CommLog {
    /// An empty log recording what `policy` asks for.
    pub fn new(policy: LogPolicy) -> Arc<CommLog> {
        Arc::new(CommLog { rows: Mutex::new(BTreeMap::new()), policy, paused: Default::default() })
    }

    /// Stops recording; returns whether it was stopped already (for [`CommLog::resume`]).
    pub fn pause(&self) -> bool {
        self.paused.swap(true, std::sync::atomic::Ordering::Relaxed)
    }

    /// Records again unless `was_paused` (what the matching [`CommLog::pause`] returned).
    pub fn resume(&self, was_paused: bool) {
        self.paused.store(was_paused, std::sync::atomic::Ordering::Relaxed);
    }

    fn records(&self, op: &str) -> bool {
        !self.paused.load(std::sync::atomic::Ordering::Relaxed)
            && self.policy.only.as_ref().map_or(true, |only| only.contains(&op))
    }

    fn record(&self, key: OpKey, took: Duration) {
        if self.policy.verbose {
            let secs = took.as_secs_f64().max(1e-9);
            tracing::info!(
                "comm op: {} | time (ms): {:.3} | msg size: {} | algbw (Gbps): {:.2} | busbw (Gbps): {:.2} | group: {} ranks",
                key.op,
                secs * 1e3,
                human_bytes(key.bytes as f64),
                key.bytes as f64 * 8.0 / secs / 1e9,
                key.bus_bytes() * 8.0 / secs / 1e9,
                key.group_size
            );
        }
        let mut rows = self.rows.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let s = rows.entry(key).or_default();
        s.count += 1;
        s.total += took;
    }

    /// The rows so far, by op, group size and message size.
    pub fn rows(&self) -> Vec<(OpKey, OpStats)> {
        let rows = self.rows.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        rows.iter().map(|(k, s)| (*k, *s)).collect()
    }

    /// Bus bytes of every call so far (what this rank sent).
    pub fn bus_bytes(&self) -> f64 {
        self.rows().iter().map(|(k, s)| k.bus_bytes() * s.count as f64).sum()
    }

    /// Time in collectives so far.
    pub fn total_time(&self) -> Duration {
        self.rows().iter().map(|(_, s)| s.total).sum()
    }

    /// DeepSpeed's summary table (`log_summary`): a block per collective, a row per message size, with the
    /// group's size; `steps` optimizer steps ran (for the bytes per step line).
    pub fn summary(&self, steps: u64) -> String {
        let mut out = format!(
            "{:<16}{:>14}{:>8}{:>8}{:>19}{:>17}{:>17}{:>18}\n",
            "Comm. Op",
            "Message Size",
            "Ranks",
            "Count",
            "Total Latency(ms)",
            "Avg Latency(ms)",
            "tput_avg (Gbps)",
            "busbw_avg (Gbps)"
        );
        let rows = self.rows();
        let mut last = "";
        for &(k, s) in &rows {
            let op = if k.op == last { "" } else { k.op };
            last = k.op;
            let total = s.total.as_secs_f64();
            let per = total / s.count.max(1) as f64;
            let algbw = if per > 0.0 { k.bytes as f64 * 8.0 / per / 1e9 } else { 0.0 };
            out.push_str(&format!(
                "{:<16}{:>14}{:>8}{:>8}{:>19.3}{:>17.4}{:>17.3}{:>18.3}\n",
                op,
                human_bytes(k.bytes as f64),
                k.group_size,
                s.count,
                total * 1e3,
                per * 1e3,
                algbw,
                algbw * bus_factor(k.op, k.group_size)
            ));
        }
        let steps = steps.max(1) as f64;
        let bus_bytes: f64 = rows.iter().map(|(k, s)| k.bus_bytes() * s.count as f64).sum::<f64>() / steps;
        let seconds: f64 = rows.iter().map(|(_, s)| s.total.as_secs_f64()).sum::<f64>() / steps;
        out.push_str(&format!(
            "bus bytes per optimizer step (what this rank sent, S x nccl-tests' bus factor): {bus_bytes:.0} ({}); time in collectives per step: {:.3} ms",
            human_bytes(bus_bytes),
            seconds * 1e3
        ));
        out
    }
}

/// 1024-based sizes, as DeepSpeed's `convert_size` writes them ("678.86 MB").
pub fn human_bytes(b: f64) -> String {
    let units = ["B", "KB", "MB", "GB", "TB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.2} {}", units[i])
}

impl Observer for Arc<CommLog> {
    fn around<R>(&self, call: Call, f: impl FnOnce() -> CommResult<R>) -> CommResult<R> {
        if !self.records(call.op) {
            return f();
        }
        let started = Instant::now();
        let r = f()?;
        self.record(OpKey { op: call.op, group_size: call.group_size, bytes: call.bytes }, started.elapsed());
        Ok(r)
    }
}

/// A communicator whose collectives are timed and recorded in a [`CommLog`] (`Logged::new(comm, log)`).
pub type Logged = Observed<Arc<CommLog>>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Collectives, Communicator, ReduceOp};

    #[test]
    fn collectives_are_counted_by_name_and_size_with_nccl_tests_factors() {
        let log = CommLog::new(LogPolicy::default());
        let comms = crate::threads::group(2, std::time::Duration::from_secs(10));
        std::thread::scope(|s| {
            for c in comms {
                let log = log.clone();
                s.spawn(move || {
                    let c = Logged::new(Box::new(c), log);
                    let mut buf = vec![1.0f32; 8];
                    c.all_gather_in_place(&mut buf).unwrap();
                    c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                });
            }
        });
        let rows = log.rows();
        // Both ranks recorded into one log here: counts are doubled.
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].0.op, rows[0].0.bytes, rows[0].1.count), ("all_gather", 32, 2));
        assert_eq!((rows[1].0.op, rows[1].0.group_size, rows[1].1.count), ("all_reduce", 2, 4));
        // all-gather: 32 x 1/2 per call, all-reduce: 32 x 2 x 1/2.
        assert_eq!(log.bus_bytes(), 2.0 * 16.0 + 4.0 * 32.0);
        assert!(log.summary(2).contains("all_gather"));
        assert_eq!(human_bytes(678.86 * 1024.0 * 1024.0), "678.86 MB");
    }

    #[test]
    fn prof_all_false_records_only_prof_ops_and_a_pause_records_nothing() {
        // comms_logger.prof_all false with prof_ops ["all_reduce"]: the engine's policy.
        let log = CommLog::new(LogPolicy { only: Some(vec!["all_reduce"]), verbose: true });
        let comms = crate::threads::group(2, std::time::Duration::from_secs(10));
        std::thread::scope(|s| {
            for c in comms {
                let log = log.clone();
                s.spawn(move || {
                    let c = Logged::new(Box::new(c), log.clone());
                    let mut buf = vec![1.0f32; 4];
                    c.all_gather_in_place(&mut buf).unwrap();
                    c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    c.barrier().unwrap();
                    let was = log.pause();
                    c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    log.resume(was);
                });
            }
        });
        let rows = log.rows();
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!((rows[0].0.op, rows[0].1.count), ("all_reduce", 2));
    }
}
