//! This process's resident memory as the kernel counts it (/proc/self/status), less the shm peers' pages it maps,
//! and the high-water mark the memory report resets between its events while keeping the whole run's peak.
use std::sync::atomic::{AtomicU64, Ordering};

use zerorun_comm as comm;

/// This process's resident memory now and at its peak (VmRSS, VmHWM), in bytes; zeros where /proc is absent.
/// The peak spans the whole process even where the memory report resets VmHWM to measure between its events.
///
/// Under the shm backend a process maps its peers' shared buffer regions, and the pages of theirs it has read
/// count in its RSS although they are the peers' memory (and in their RSS). Both numbers leave those out: shared
/// resident pages (RssShmem) beyond this process's own region blocks. That estimate never exceeds the peers' pages
/// (own blocks are counted whole), so the result does not undercount this process.
pub fn rss() -> (u64, u64) {
    let (now, high_water) = rss_since_reset();
    (now, high_water.max(PEAK_BEFORE_RESET.load(Ordering::Relaxed)))
}

/// [`rss`] with VmHWM as the kernel has it: since the memory report last reset it (at its previous event).
pub(crate) fn rss_since_reset() -> (u64, u64) {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return (0, 0) };
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    let peers = if comm::region::peers_mapped() {
        let own = comm::region::SharedRegion::process().map_or(0, |r| r.used() as u64);
        field("RssShmem:").saturating_sub(own)
    } else {
        0
    };
    (field("VmRSS:").saturating_sub(peers), field("VmHWM:").saturating_sub(peers))
}

/// The process's peak resident memory before the last reset of VmHWM (see [`rss`]).
static PEAK_BEFORE_RESET: AtomicU64 = AtomicU64::new(0);

/// Resets the process's VmHWM to its current resident memory (Linux's `clear_refs` 5), keeping `high_water` (the
/// caller's reading of [`rss_since_reset`], the very value its window reports) as the peak so far for [`rss`];
/// nothing where refused. A second reading here could come out lower than the caller's: the peers' pages it
/// subtracts may have grown in between (a gather on the communication thread).
pub(crate) fn reset_high_water(high_water: u64) {
    PEAK_BEFORE_RESET.fetch_max(high_water, Ordering::Relaxed);
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}
