//! A rank's heartbeat for its launcher: whether the process is alive and whether it waits in a collective, so that a
//! hung rank (alive, but stuck outside every collective while its peers wait for it) is found and named without
//! waiting for `comms_timeout`. `zerorun launch` names a file per rank (`ZERORUN_HEARTBEAT_FILE`); a thread of the
//! rank rewrites it every half second with one line, `<now_ms> <waiting 0|1> <since_ms>`: the time, whether a
//! collective is in progress, and since when that has been so. [`Watched`] marks the collectives of every group made
//! from the job's communicator.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::buffer::{BufMut, BufRef, DeviceBuf};
use crate::{groups, CommResult, Communicator, ReduceOp};

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

/// A communicator whose collectives count as waiting in the heartbeat; groups made from it are watched too.
pub struct Watched(pub Box<dyn Communicator>);

impl Communicator for Watched {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.all_reduce_buf(buf, op)
    }
    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.reduce_scatter_buf(input, output, op)
    }
    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.all_gather_buf(buf)
    }
    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.broadcast_buf(buf, root)
    }
    fn host_layout(&self) -> Option<(usize, usize)> {
        self.0.host_layout()
    }
    fn host_all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.host_all_gather_buf(buf)
    }
    fn all_to_all_buf(&self, input: BufRef<'_>, output: BufMut<'_>) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.all_to_all_buf(input, output)
    }
    fn reduce_scatter_quantized_buf(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        block: usize,
    ) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.reduce_scatter_quantized_buf(input, output, op, block)
    }
    fn barrier(&self) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.barrier()
    }
    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.send_buf(buf, dst)
    }
    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.recv_buf(buf, src)
    }
    fn send_recv_buf(&self, send: BufRef<'_>, dst: usize, recv: BufMut<'_>, src: usize) -> CommResult<()> {
        let _waiting = InCollective::enter();
        self.0.send_recv_buf(send, dst, recv, src)
    }
    fn split_group(&self, split: &groups::Split) -> CommResult<Option<Box<dyn Communicator>>> {
        let group = {
            let _waiting = InCollective::enter();
            self.0.split_group(split)?
        };
        Ok(group.map(|g| Box::new(Watched(g)) as Box<dyn Communicator>))
    }
    fn group_name(&self) -> String {
        self.0.group_name()
    }
    fn prefers_shared_buffers(&self) -> bool {
        self.0.prefers_shared_buffers()
    }
    fn forget_gathered_pages(&self) {
        self.0.forget_gathered_pages()
    }
    fn window(&self, local: &mut [u8]) -> CommResult<Option<Vec<usize>>> {
        let _waiting = InCollective::enter();
        self.0.window(local)
    }
    fn independent_groups(&self) -> bool {
        self.0.independent_groups()
    }
    unsafe fn all_reduce_device(&self, buf: DeviceBuf, op: ReduceOp) -> CommResult<bool> {
        let _waiting = InCollective::enter();
        // SAFETY: the caller's guarantees, passed on.
        unsafe { self.0.all_reduce_device(buf, op) }
    }
    unsafe fn reduce_scatter_device(&self, input: DeviceBuf, output: DeviceBuf, op: ReduceOp) -> CommResult<bool> {
        let _waiting = InCollective::enter();
        // SAFETY: the caller's guarantees, passed on.
        unsafe { self.0.reduce_scatter_device(input, output, op) }
    }
    unsafe fn all_gather_device(&self, buf: DeviceBuf) -> CommResult<bool> {
        let _waiting = InCollective::enter();
        // SAFETY: the caller's guarantees, passed on.
        unsafe { self.0.all_gather_device(buf) }
    }
    unsafe fn broadcast_device(&self, buf: DeviceBuf, root: usize) -> CommResult<bool> {
        let _waiting = InCollective::enter();
        // SAFETY: the caller's guarantees, passed on.
        unsafe { self.0.broadcast_device(buf, root) }
    }
}

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
