//! How a rank reaches its peers' buffers: with memcpy through a mapping of the peer's shared buffer region
//! (region/) when the buffer is in it, else with `process_vm_readv` (cma.rs). Both are checked at join; if a
//! rank cannot read every other, the group stages everything through the segment's slots instead.
use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering;

use super::super::region::{PeerRegion, SharedRegion};
use super::super::{cma, CommError, CommResult};
use super::segment::{Segment, R_ADDR, R_DIRECT, R_REGION_BASE, R_REGION_FD, R_REGION_LEN, R_REGION_OK};

/// What this rank can read of every peer's memory.
pub(super) struct PeerAccess {
    /// Ranks read each other's buffers directly instead of staging through the slots.
    direct: bool,
    /// Every peer's shared buffer region mapped here (None for this rank, or where mapping failed).
    regions: Vec<Option<PeerRegion>>,
    /// Every rank mapped every other's region, so buffers in this process's region are read at memcpy speed.
    shared_buffers: bool,
    /// Whether the all-gather in progress notes the peer pages it reads, and those of the last one
    /// ([`PeerAccess::forget_gathered_pages`]).
    noting: Cell<bool>,
    gathered: RefCell<Vec<(usize, usize)>>,
}

impl PeerAccess {
    /// Every rank tries to read every other; direct reads are used only if all succeed. Then the regions are
    /// exchanged and mapped. Collective: every rank of `seg` calls it at join.
    pub(super) fn probe(seg: &Segment) -> CommResult<PeerAccess> {
        let mut access = PeerAccess {
            direct: false,
            regions: Vec::new(),
            shared_buffers: false,
            noting: Cell::new(false),
            gathered: RefCell::new(Vec::new()),
        };
        if std::env::var("ZERORUN_SHM_STAGING").is_ok() {
            return Ok(access);
        }
        let (rank, n) = (seg.rank, seg.world_size);
        seg.rank_word(rank, R_ADDR).store(&cma::PROBE as *const u64 as u64, Ordering::Relaxed);
        seg.barrier("rendezvous")?;
        let ok = (0..n).filter(|&k| k != rank).all(|k| {
            let addr = seg.rank_word(k, R_ADDR).load(Ordering::Relaxed) as usize;
            let mut v = [0u8; 8];
            cma::read(seg.pid(k), addr, &mut v).is_ok() && u64::from_ne_bytes(v) == cma::PROBE
        });
        seg.rank_word(rank, R_DIRECT).store(if ok { 1 } else { 2 }, Ordering::Relaxed);
        seg.barrier("rendezvous")?;
        access.direct = (0..n).all(|k| seg.rank_word(k, R_DIRECT).load(Ordering::Relaxed) == 1);
        if access.direct {
            access.map_regions(seg)?;
        }
        tracing::debug!(rank, direct = access.direct, shared_buffers = access.shared_buffers, "shm backend ready");
        Ok(access)
    }

    /// Publishes this process's buffer region and maps every peer's (through `/proc/<pid>/fd`, which needs the
    /// same rights as `process_vm_readv`).
    fn map_regions(&mut self, seg: &Segment) -> CommResult<()> {
        let (rank, n) = (seg.rank, seg.world_size);
        let (fd, base, len) = SharedRegion::process().map_or((0, 0, 0), SharedRegion::published);
        seg.rank_word(rank, R_REGION_FD).store(fd, Ordering::Relaxed);
        seg.rank_word(rank, R_REGION_BASE).store(base, Ordering::Relaxed);
        seg.rank_word(rank, R_REGION_LEN).store(len, Ordering::Relaxed);
        seg.barrier("rendezvous")?;
        self.regions = (0..n)
            .map(|k| {
                let word = |w: usize| seg.rank_word(k, w).load(Ordering::Relaxed);
                let published = (word(R_REGION_FD), word(R_REGION_BASE), word(R_REGION_LEN));
                if k == rank || published.2 == 0 {
                    return None;
                }
                PeerRegion::map(seg.pid(k), published)
                    .map_err(|e| tracing::debug!(rank, peer = k, error = %e, "cannot map the peer's buffer region"))
                    .ok()
            })
            .collect();
        let ok = len != 0 && (0..n).all(|k| k == rank || self.regions[k].is_some());
        seg.rank_word(rank, R_REGION_OK).store(if ok { 1 } else { 2 }, Ordering::Relaxed);
        seg.barrier("rendezvous")?;
        self.shared_buffers = (0..n).all(|k| seg.rank_word(k, R_REGION_OK).load(Ordering::Relaxed) == 1);
        Ok(())
    }

    pub(super) fn direct(&self) -> bool {
        self.direct
    }

    pub(super) fn shared_buffers(&self) -> bool {
        self.shared_buffers
    }

    /// Whether every rank's buffer of this collective (`bytes` long) is in its shared region: the same answer on
    /// every rank, since each sees every rank's published address and region.
    pub(super) fn all_buffers_shared(&self, seg: &Segment, bytes: usize) -> bool {
        let own = seg.rank_word(seg.rank, R_ADDR).load(Ordering::Relaxed) as usize;
        self.shared_buffers
            && SharedRegion::process().is_some_and(|r| r.contains(own, bytes))
            && (0..seg.world_size).all(|k| k == seg.rank || self.ptr(seg, k, 0, bytes).is_some())
    }

    /// Where rank `k`'s bytes at byte offset `offset` of its buffer in this collective are mapped here, when they
    /// are in its region.
    pub(super) fn ptr(&self, seg: &Segment, k: usize, offset: usize, len: usize) -> Option<*mut u8> {
        let addr = seg.rank_word(k, R_ADDR).load(Ordering::Relaxed) as usize + offset;
        self.regions.get(k)?.as_ref()?.ptr(addr, len)
    }

    /// Rank `k`'s bytes at byte offset `offset` of its buffer in this collective, when they are in its region.
    pub(super) fn bytes<'a>(&'a self, seg: &Segment, k: usize, offset: usize, len: usize) -> Option<&'a [u8]> {
        // SAFETY: mapped, inside the peer's region; the collective's barriers keep it unchanged meanwhile.
        self.ptr(seg, k, offset, len).map(|p| unsafe { std::slice::from_raw_parts(p as *const u8, len) })
    }

    /// Where rank `k`'s bytes `[addr, addr + len)` (its addresses) are mapped here, when they are in its region.
    pub(super) fn mapped(&self, k: usize, addr: usize, len: usize) -> Option<usize> {
        self.regions.get(k)?.as_ref()?.ptr(addr, len).map(|p| p as usize)
    }

    /// An all-gather begins: the peer pages it reads are noted (those of the last one forgotten).
    pub(super) fn begin_gather(&self) {
        self.gathered.borrow_mut().clear();
        self.noting.set(true);
    }

    pub(super) fn end_gather(&self) {
        self.noting.set(false);
    }

    /// Drops this process's page-table entries for the peer pages the last all-gather read (`MADV_DONTNEED` on a
    /// shared memfd mapping only unmaps them here; the contents stay, a later read maps them again). Measured on
    /// a 4 x 8192 MLP at stage 3 and 2 ranks: each rank's resident set held the peer's half of the unit it had
    /// just gathered (128 MiB) for as long as the peer kept it. Only on request: re-mapping costs page faults,
    /// which a buffer read again and again (stage 1's parameters) should not pay.
    pub(super) fn forget_gathered_pages(&self) {
        const PAGE: usize = 4096;
        for (start, len) in self.gathered.borrow_mut().drain(..) {
            let (lo, hi) = (start.next_multiple_of(PAGE), (start + len) / PAGE * PAGE);
            if hi > lo {
                // SAFETY: whole pages inside a peer's shared mapping; MADV_DONTNEED only drops them from this
                // process's page tables.
                unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) };
            }
        }
    }

    /// Reads `dst.len()` bytes at byte offset `offset` of rank `k`'s buffer in this collective.
    pub(super) fn read(
        &self,
        seg: &Segment,
        op: &'static str,
        k: usize,
        offset: usize,
        dst: &mut [u8],
    ) -> CommResult<()> {
        let addr = seg.rank_word(k, R_ADDR).load(Ordering::Relaxed) as usize + offset;
        self.read_at(seg, op, k, addr, dst)
    }

    /// Reads `dst.len()` bytes at address `addr` of rank `k`: through its mapped region when the bytes are in it,
    /// else with process_vm_readv.
    pub(super) fn read_at(
        &self,
        seg: &Segment,
        op: &'static str,
        k: usize,
        addr: usize,
        dst: &mut [u8],
    ) -> CommResult<()> {
        if dst.is_empty() {
            return Ok(());
        }
        if let Some(p) = self.regions.get(k).and_then(Option::as_ref).and_then(|r| r.ptr(addr, dst.len())) {
            // SAFETY: mapped, inside the peer's region; the peer keeps the bytes unchanged until this rank answers.
            dst.copy_from_slice(unsafe { std::slice::from_raw_parts(p as *const u8, dst.len()) });
            if self.noting.get() {
                self.gathered.borrow_mut().push((p as usize, dst.len()));
            }
            return Ok(());
        }
        cma::read(seg.pid(k), addr, dst).map_err(|e| {
            if e.raw_os_error() == Some(libc::ESRCH) {
                // Rank k is gone; if it left because it saw another rank die (it flagged itself), name that one.
                seg.peer_died(op, k)
            } else {
                CommError::BadArgument { op, rank: seg.rank, what: format!("reading rank {k}'s buffer: {e}") }
            }
        })
    }
}
