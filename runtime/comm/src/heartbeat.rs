//! A rank's heartbeat for its launcher: whether the process is alive and whether it waits in a collective, so that a
//! hung rank (alive, but stuck outside every collective while its peers wait for it) is found and named without
//! waiting for `comms_timeout`. `zerorun launch` names a file per rank (`ZERORUN_HEARTBEAT_FILE`); a thread of the
//! rank rewrites it every half second with one line, `<now_ms> <waiting 0|1> <since_ms>`: the time, whether a
//! collective is in progress, and since when that has been so. [`Watched`] marks the collectives of every group made
//! from the job's communicator.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::observed::{Call, Observed, Observer};
use crate::CommResult;

/// The environment variable naming this rank's heartbeat file.
pub const HEARTBEAT_ENV: &str = "ZERORUN_HEARTBEAT_FILE";

/// Collectives in progress in this process (the communication thread's and the caller's).
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// When `IN_FLIGHT` last went from 0 to more or back, milliseconds since the epoch; 0 before the first collective.
static SINCE_MS: AtomicU64 = AtomicU64::new(0);
static STARTED: Once = Once::new();

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Starts the heartbeat thread when the launcher asked for one (idempotent); returns whether it did.
pub fn start_from_env() -> bool {
    let Some(path) = std::env::var_os(HEARTBEAT_ENV).filter(|p| !p.is_empty()) else { return false };
    STARTED.call_once(|| {
        std::thread::spawn(move || loop {
            let waiting = IN_FLIGHT.load(Ordering::Relaxed) > 0;
            let line = format!("{} {} {}\n", now_ms(), waiting as u8, SINCE_MS.load(Ordering::Relaxed));
            // Written whole then renamed, so the launcher never reads half a line.
            let tmp = std::path::PathBuf::from(format!("{}.tmp", path.to_string_lossy()));
            if std::fs::write(&tmp, line).and_then(|_| std::fs::rename(&tmp, &path)).is_err() {
                return; // the launcher's folder is gone: nobody is listening
            }
            std::thread::sleep(Duration::from_millis(500));
        });
    });
    true
}

/// Marks a collective in progress for as long as it lives.
struct InCollective;

impl InCollective {
    fn enter() -> InCollective {
        if IN_FLIGHT.fetch_add(1, Ordering::Relaxed) == 0 {
            SINCE_MS.store(now_ms(), Ordering::Relaxed);
        }
        InCollective
    }
}

impl Drop for InCollective {
    fn drop(&mut self) {
        if IN_FLIGHT.fetch_sub(1, Ordering::Relaxed) == 1 {
            SINCE_MS.store(now_ms(), Ordering::Relaxed);
        }
    }
}

/// The heartbeat's [`Observer`]: a call in progress (a collective, a group's making) counts as waiting.
#[derive(Debug, Clone, Copy, Default)]
pub struct Heartbeat;

impl Observer for Heartbeat {
    fn around<R>(&self, _call: Call, f: impl FnOnce() -> CommResult<R>) -> CommResult<R> {
        let _waiting = InCollective::enter();
        f()
    }
}

/// A communicator whose collectives count as waiting in the heartbeat; groups made from it are watched too.
pub type Watched = Observed<Heartbeat>;

/// A heartbeat line as the launcher reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    /// When it was written, milliseconds since the epoch.
    pub at_ms: u64,
    /// Whether a collective was in progress.
    pub waiting: bool,
    /// Since when `waiting` has been as it is, milliseconds since the epoch.
    pub since_ms: u64,
}

impl Beat {
    /// Parses a heartbeat file's line.
    pub fn parse(text: &str) -> Option<Beat> {
        let mut it = text.split_whitespace().map(|w| w.parse::<u64>().ok());
        let (at_ms, waiting, since_ms) = (it.next()??, it.next()??, it.next()??);
        Some(Beat { at_ms, waiting: waiting == 1, since_ms })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_round_trips_and_a_collective_marks_waiting() {
        assert_eq!(Beat::parse("10 1 7\n"), Some(Beat { at_ms: 10, waiting: true, since_ms: 7 }));
        assert_eq!(Beat::parse("10 x 7"), None);
        let before = IN_FLIGHT.load(Ordering::Relaxed);
        {
            let _a = InCollective::enter();
            let _b = InCollective::enter();
            assert_eq!(IN_FLIGHT.load(Ordering::Relaxed), before + 2);
        }
        assert_eq!(IN_FLIGHT.load(Ordering::Relaxed), before);
    }
}
