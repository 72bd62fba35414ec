//! Shared buffer memory for the shm backend: one memfd per process, mapped by every peer once, from which the
//! engine allocates the buffers it hands to collectives (gradient and parameter buffers, stage-3 units). A peer
//! then reads such a buffer with a plain memcpy from its own mapping, where `process_vm_readv` (cma.rs) pins and
//! copies page by page at under half of memcpy's speed; an all-reduce writes each reduced segment straight into
//! every rank's buffer.
//!
//! The region is a large sparse file (pages exist only once written); blocks are page-granular, and freeing one
//! punches it out of the file, so its memory goes back to the system for every process that maps it. Tensors'
//! blocks of a size the engine names ([`keep_freed`]) are kept instead, for the next tensor of the same size: a
//! stage-3 step gathers the same units every step, and a punched block is faulted in again page by page, by its
//! owner and by every peer that reads it.
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

static REGION: OnceLock<Option<SharedRegion>> = OnceLock::new();
/// The size from which freed tensor blocks are kept (0: none), for a region made later.
static KEEP_FROM: AtomicUsize = AtomicUsize::new(0);
/// Whether kept blocks may exceed the peak by the largest block ([`KeepBound`]), for a region made later.
static KEEP_HEADROOM: AtomicBool = AtomicBool::new(false);

/// How many freed large blocks are kept for reuse, beside the large blocks live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeepBound {
    /// Live and kept together never exceed the most that were live at once: keeping never raises that peak.
    Peak,
    /// They may exceed that peak by the largest block: a step whose mix of live sizes changes (a unit's gradient
    /// beside the next unit in backward, activations in forward) evicts at its peak, within the peak alone, the
    /// blocks it needs next and maps them afresh every step; one block of headroom keeps them.
    #[default]
    PeakAndLargest,
}

/// Bytes of address space the region reserves (nothing is allocated until used).
const REGION_BYTES: usize = 256 << 30;
const PAGE: usize = 4096;

/// Page-granular best-fit allocator over `0..capacity`: pure bookkeeping, no memory.
#[derive(Debug, Default)]
pub(crate) struct FreeList {
    /// Free blocks below `top`, by start offset.
    free: BTreeMap<usize, usize>,
    /// Everything from `top` up is free.
    top: usize,
    capacity: usize,
}

impl FreeList {
    pub fn new(capacity: usize) -> FreeList {
        FreeList { free: BTreeMap::new(), top: 0, capacity }
    }

    /// The offset of a free block of `len` bytes (a multiple of the page): the smallest free block that fits,
    /// else the top.
    pub fn alloc(&mut self, len: usize) -> Option<usize> {
        let best = self.free.iter().filter(|(_, &l)| l >= len).min_by_key(|(_, &l)| l).map(|(&s, &l)| (s, l));
        if let Some((start, l)) = best {
            self.free.remove(&start);
            if l > len {
                self.free.insert(start + len, l - len);
            }
            return Some(start);
        }
        (self.top + len <= self.capacity).then(|| {
            self.top += len;
            self.top - len
        })
    }

    /// Returns a block, merging it with free neighbours (and the top).
    pub fn release(&mut self, mut start: usize, mut len: usize) {
        if let Some((&s, &l)) = self.free.range(..start).next_back() {
            if s + l == start {
                self.free.remove(&s);
                start = s;
                len += l;
            }
        }
        if let Some(&l) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += l;
        }
        if start + len == self.top {
            self.top = start;
        } else {
            self.free.insert(start, len);
        }
    }

    /// Bytes in use.
    pub fn used(&self) -> usize {
        self.top - self.free.values().sum::<usize>()
    }
}

/// Freed blocks kept for reuse by size: pure bookkeeping, like [`FreeList`]. A block is kept only if it was
/// handed out while keeping was on ([`Kept::born`]), so the large blocks live and kept are both known; an
/// allocation that finds no kept block of its size gives back the oldest until the live and kept ones, with it,
/// are no more than the most that were live at once ([`KeepBound::Peak`]), or that plus the largest block.
#[derive(Debug, Default)]
pub(crate) struct Kept {
    /// Blocks from this many bytes up are kept (0: none).
    from: usize,
    bound: KeepBound,
    /// The largest block handed out since the kept blocks were last released.
    largest: usize,
    /// Kept blocks (offset, length), oldest first.
    blocks: Vec<(usize, usize)>,
    bytes: usize,
    /// Live blocks handed out while keeping was on, by offset.
    live: HashMap<usize, usize>,
    live_bytes: usize,
    peak: usize,
}

/// What [`Kept::take`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Taken {
    /// A kept block of the size, at this offset.
    Reused(usize),
    /// None of the size: allocate afresh, after releasing these kept blocks (offset, length).
    Fresh(Vec<(usize, usize)>),
}

impl Kept {
    /// Whether blocks of `len` bytes are kept.
    pub fn keeps(&self, len: usize) -> bool {
        self.from != 0 && len >= self.from
    }

    /// A kept block of `len` bytes (the most recently kept), or the kept blocks to release before allocating one.
    pub fn take(&mut self, len: usize) -> Taken {
        if let Some(i) = self.blocks.iter().rposition(|&(_, l)| l == len) {
            self.bytes -= len;
            return Taken::Reused(self.blocks.remove(i).0);
        }
        let after = self.live_bytes + len;
        let headroom = match self.bound {
            KeepBound::Peak => 0,
            KeepBound::PeakAndLargest => self.largest.max(len),
        };
        let bound = self.peak.max(after) + headroom;
        let mut n = 0;
        while n < self.blocks.len() && after + self.bytes > bound {
            self.bytes -= self.blocks[n].1;
            n += 1;
        }
        Taken::Fresh(self.blocks.drain(..n).collect())
    }

    /// A block of `len` bytes at `at` handed out.
    pub fn born(&mut self, at: usize, len: usize) {
        self.live.insert(at, len);
        self.live_bytes += len;
        self.peak = self.peak.max(self.live_bytes);
        self.largest = self.largest.max(len);
    }

    /// The block at `at` freed: true when it is kept (else the caller releases it).
    pub fn freed(&mut self, at: usize) -> bool {
        let Some(len) = self.live.remove(&at) else { return false };
        self.live_bytes -= len;
        if self.from == 0 {
            return false;
        }
        self.blocks.push((at, len));
        self.bytes += len;
        true
    }

    /// Keeps blocks from `from` bytes up (0: none) within `bound`; returns the kept blocks to release when keeping
    /// stops.
    pub fn set(&mut self, from: usize, bound: KeepBound) -> Vec<(usize, usize)> {
        self.from = from;
        self.bound = bound;
        if from == 0 {
            self.drain()
        } else {
            Vec::new()
        }
    }

    /// Every kept block, to release. The peak and the largest block count again from the blocks live now
    /// (start-up's one-off blocks no longer widen the bound).
    pub fn drain(&mut self) -> Vec<(usize, usize)> {
        self.bytes = 0;
        self.peak = self.live_bytes;
        self.largest = 0;
        std::mem::take(&mut self.blocks)
    }
}

/// The region's books: free space and kept blocks, under one lock.
#[derive(Debug)]
struct Books {
    free: FreeList,
    kept: Kept,
}

/// This process's region.
pub struct SharedRegion {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
    books: Mutex<Books>,
}

// SAFETY: the mapping lives as long as the process (the region is never dropped); blocks are handed out under the
// mutex, each to one owner.
unsafe impl Send for SharedRegion {}
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    fn create() -> io::Result<SharedRegion> {
        // SAFETY: plain syscalls on a name we own; the fd is checked before use.
        let fd = unsafe { libc::memfd_create(c"zerorun-region".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        if unsafe { libc::ftruncate(fd.as_raw_fd(), REGION_BYTES as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let base = map(fd.as_raw_fd(), REGION_BYTES, libc::PROT_READ | libc::PROT_WRITE)?;
        Ok(SharedRegion {
            fd,
            base,
            len: REGION_BYTES,
            books: Mutex::new(Books { free: FreeList::new(REGION_BYTES), kept: Kept::default() }),
        })
    }

    /// The process's region, created on first use; None where memfd or the mapping is refused.
    pub fn process() -> Option<&'static SharedRegion> {
        REGION
            .get_or_init(|| match SharedRegion::create() {
                Ok(r) => {
                    r.books().kept.set(KEEP_FROM.load(Ordering::Relaxed), keep_bound());
                    Some(r)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "no shared buffer region: collectives read peers through process_vm_readv");
                    None
                }
            })
            .as_ref()
    }

    /// The process's region if one was made.
    fn existing() -> Option<&'static SharedRegion> {
        REGION.get().and_then(Option::as_ref)
    }

    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `bytes` (rounded up to pages) of zeroed memory, or None when the region is full.
    pub fn alloc(&self, bytes: usize) -> Option<*mut u8> {
        let len = bytes.max(1).div_ceil(PAGE) * PAGE;
        let at = self.books().free.alloc(len)?;
        // SAFETY: inside the mapping.
        Some(unsafe { self.base.add(at) })
    }

    /// `bytes` (rounded up to pages) of memory whose contents are undefined: a kept block of the size when there is
    /// one ([`keep_freed`]), else fresh zeroed memory. None when the region is full.
    pub fn alloc_reusable(&self, bytes: usize) -> Option<*mut u8> {
        let len = bytes.max(1).div_ceil(PAGE) * PAGE;
        let mut books = self.books();
        if !books.kept.keeps(len) {
            drop(books);
            return self.alloc(bytes);
        }
        let at = match books.kept.take(len) {
            Taken::Reused(at) => at,
            Taken::Fresh(released) => {
                drop(books);
                self.release_all(released);
                books = self.books();
                books.free.alloc(len)?
            }
        };
        books.kept.born(at, len);
        // SAFETY: inside the mapping.
        Some(unsafe { self.base.add(at) })
    }

    /// Frees a block from [`alloc`](Self::alloc) or [`alloc_reusable`](Self::alloc_reusable) of `bytes`: kept
    /// when it is of a kept size, else its pages leave the file (memory goes back to the system, and the block
    /// reads as zeros when handed out again).
    ///
    /// SAFETY (for callers): `ptr` and `bytes` are those of a live block, not used afterwards.
    pub fn free(&self, ptr: *mut u8, bytes: usize) {
        let len = bytes.max(1).div_ceil(PAGE) * PAGE;
        let at = ptr as usize - self.base as usize;
        if self.books().kept.freed(at) {
            return;
        }
        self.release(at, len);
    }

    /// Punches a block out of the file and returns it to the free list.
    fn release(&self, at: usize, len: usize) {
        // SAFETY: the range is the block's, inside the file.
        let punched = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                at as libc::off_t,
                len as libc::off_t,
            )
        };
        if punched != 0 {
            // Keep the block out of circulation rather than hand out pages that are not zero.
            tracing::warn!(error = %io::Error::last_os_error(), bytes = len, "could not release a shared buffer block");
            return;
        }
        self.books().free.release(at, len);
    }

    /// Bytes of kept blocks: freed, resident, counted in [`used`](Self::used).
    pub fn kept_bytes(&self) -> usize {
        self.books().kept.bytes
    }

    fn release_all(&self, blocks: Vec<(usize, usize)>) {
        for (at, len) in blocks {
            self.release(at, len);
        }
    }

    /// Whether `[addr, addr + len)` is inside the region.
    pub fn contains(&self, addr: usize, len: usize) -> bool {
        let base = self.base as usize;
        addr >= base && addr + len <= base + self.len
    }

    /// Bytes in use.
    pub fn used(&self) -> usize {
        self.books().free.used()
    }

    /// What a peer needs to map it: (fd number in this process, base address here, length).
    pub fn published(&self) -> (u64, u64, u64) {
        (self.fd.as_raw_fd() as u64, self.base as u64, self.len as u64)
    }
}

fn map(fd: libc::c_int, len: usize, prot: libc::c_int) -> io::Result<*mut u8> {
    // SAFETY: a new shared mapping of a file we hold; checked for failure.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED | libc::MAP_NORESERVE, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p as *mut u8)
}

/// Peer regions mapped in this process now (their pages count in its RSS once read; see report::memory::rss).
static PEERS_MAPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether this process maps any peer's region.
pub fn peers_mapped() -> bool {
    PEERS_MAPPED.load(std::sync::atomic::Ordering::Relaxed) > 0
}

/// A peer's region, mapped into this process.
pub struct PeerRegion {
    /// Where the region starts in the peer.
    remote_base: usize,
    local: *mut u8,
    len: usize,
}

// SAFETY: a mapping owned by this value; what is read or written through it is ordered by the collectives.
unsafe impl Send for PeerRegion {}

impl PeerRegion {
    /// Maps process `pid`'s region, published as (fd, base, len), through `/proc/<pid>/fd/<fd>`.
    pub fn map(pid: u32, (fd, base, len): (u64, u64, u64)) -> io::Result<PeerRegion> {
        let file = std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{pid}/fd/{fd}"))?;
        let local = map(file.as_raw_fd(), len as usize, libc::PROT_READ | libc::PROT_WRITE)?;
        PEERS_MAPPED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(PeerRegion { remote_base: base as usize, local, len: len as usize })
    }

    /// Where the peer's bytes `[addr, addr + len)` (its addresses) are mapped here, if they are in its region: a
    /// collective reads them, or writes there what the peer waits for (all-reduce pushes each reduced segment to
    /// every rank).
    pub fn ptr(&self, addr: usize, len: usize) -> Option<*mut u8> {
        // SAFETY (of the offset): inside the mapping.
        (addr >= self.remote_base && addr + len <= self.remote_base + self.len)
            .then(|| unsafe { self.local.add(addr - self.remote_base) })
    }
}

impl Drop for PeerRegion {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.local as *mut libc::c_void, self.len) };
        PEERS_MAPPED.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Keeps freed tensor blocks ([`region_alloc`]) of at least `min_bytes` for the next tensor of the same size, in
/// the process's region now or made later, within `bound`; None keeps none and releases what is kept.
pub fn keep_freed(min_bytes: Option<usize>, bound: KeepBound) {
    let from = min_bytes.map_or(0, |b| b.max(1));
    KEEP_FROM.store(from, Ordering::Relaxed);
    KEEP_HEADROOM.store(bound == KeepBound::PeakAndLargest, Ordering::Relaxed);
    if let Some(r) = SharedRegion::existing() {
        let released = r.books().kept.set(from, bound);
        r.release_all(released);
    }
}

fn keep_bound() -> KeepBound {
    if KEEP_HEADROOM.load(Ordering::Relaxed) {
        KeepBound::PeakAndLargest
    } else {
        KeepBound::Peak
    }
}

/// Releases the blocks the process's region keeps.
pub fn release_kept() {
    if let Some(r) = SharedRegion::existing() {
        let released = r.books().kept.drain();
        r.release_all(released);
    }
}

/// Bytes the process's region keeps ([`keep_freed`]).
pub fn kept_bytes() -> usize {
    SharedRegion::existing().map_or(0, SharedRegion::kept_bytes)
}

/// `region_alloc` / `region_free` for the C++ allocator of tensors in the region (engine/native.rs).
pub extern "C" fn region_alloc(bytes: usize) -> *mut std::ffi::c_void {
    SharedRegion::process()
        .and_then(|r| r.alloc_reusable(bytes))
        .map_or(std::ptr::null_mut(), |p| p as *mut std::ffi::c_void)
}

/// Frees a block [`region_alloc`] returned.
pub extern "C" fn region_free(ptr: *mut std::ffi::c_void, bytes: usize) {
    if let Some(r) = SharedRegion::process() {
        r.free(ptr as *mut u8, bytes);
    }
}

/// A zeroed byte buffer in the region (falls back to the heap where there is none), for callers without tch:
/// the comm benchmark and tests.
pub struct SharedBuffer {
    ptr: *mut u8,
    len: usize,
    /// The heap fallback's memory (None: the block is in the region).
    heap: Option<Vec<u64>>,
}

// SAFETY: owns its block exclusively.
unsafe impl Send for SharedBuffer {}

impl SharedBuffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> SharedBuffer {
        match SharedRegion::process().and_then(|r| r.alloc(len)) {
            Some(ptr) => SharedBuffer { ptr, len, heap: None },
            None => {
                let mut heap = vec![0u64; len.div_ceil(8)];
                SharedBuffer { ptr: heap.as_mut_ptr() as *mut u8, len, heap: Some(heap) }
            }
        }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether it lives in the shared region (else on the heap).
    pub fn in_region(&self) -> bool {
        self.heap.is_none()
    }

    /// The buffer as elements of `T` (its length must be a multiple of `T`'s size).
    pub fn as_slice_mut<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        // SAFETY: page- (or 8-byte-) aligned memory of `len` bytes owned by self.
        bytemuck::cast_slice_mut(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        if self.heap.is_none() {
            region_free(self.ptr as *mut std::ffi::c_void, self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_reused_and_merged() {
        let mut f = FreeList::new(10 * PAGE);
        let a = f.alloc(2 * PAGE).unwrap();
        let b = f.alloc(3 * PAGE).unwrap();
        let c = f.alloc(PAGE).unwrap();
        assert_eq!((a, b, c), (0, 2 * PAGE, 5 * PAGE));
        assert_eq!(f.alloc(5 * PAGE), None, "only 4 pages left");
        f.release(a, 2 * PAGE);
        // The smallest block that fits: the freed 2 pages for 1 page, the rest stays free.
        assert_eq!(f.alloc(PAGE), Some(0));
        f.release(0, PAGE);
        f.release(b, 3 * PAGE);
        // 0..5 pages merged into one block.
        assert_eq!(f.alloc(5 * PAGE), Some(0));
        f.release(0, 5 * PAGE);
        f.release(c, PAGE);
        // Everything merged back into the top.
        assert_eq!((f.used(), f.top), (0, 0));
    }

    #[test]
    fn kept_blocks_stay_within_the_live_peak() {
        let mut k = Kept::default();
        k.set(4 * PAGE, KeepBound::Peak);
        assert!(!k.keeps(2 * PAGE) && k.keeps(4 * PAGE));
        // Two 8-page blocks live at once, both freed and kept.
        assert_eq!(k.take(8 * PAGE), Taken::Fresh(vec![]));
        k.born(0, 8 * PAGE);
        assert_eq!(k.take(8 * PAGE), Taken::Fresh(vec![]));
        k.born(8 * PAGE, 8 * PAGE);
        assert!(k.freed(0) && k.freed(8 * PAGE));
        assert!(!k.freed(99 * PAGE), "a block handed out before keeping is not kept");
        // The most recently kept block of the size comes back.
        assert_eq!(k.take(8 * PAGE), Taken::Reused(8 * PAGE));
        k.born(8 * PAGE, 8 * PAGE);
        // 12 pages: none of the size; 8 live + 12 + 8 kept would exceed the 16 live at once, so the kept block goes.
        assert_eq!(k.take(12 * PAGE), Taken::Fresh(vec![(0, 8 * PAGE)]));
        k.born(16 * PAGE, 12 * PAGE);
        assert!(k.freed(8 * PAGE) && k.freed(16 * PAGE));
        assert_eq!(k.bytes, 20 * PAGE);
        // 4 pages beside 20 kept is over the peak of 20 live: the oldest kept block (8 pages) goes, 12 stay.
        assert_eq!(k.take(4 * PAGE), Taken::Fresh(vec![(8 * PAGE, 8 * PAGE)]));
        assert_eq!(k.bytes, 12 * PAGE);
        assert_eq!(k.set(0, KeepBound::Peak), vec![(16 * PAGE, 12 * PAGE)], "keeping off releases what is kept");
    }

    /// A cycle whose live mix changes: two 8-page blocks live at once, then a 4-page one. Within the peak alone the
    /// 4-page block evicts an 8-page one, which the next cycle maps afresh (two blocks a cycle); with the largest
    /// block's headroom every later cycle reuses, and live and kept stay within the peak plus that block.
    #[test]
    fn headroom_of_the_largest_block_keeps_a_changing_mix() {
        for (bound, fresh_after_the_first) in [(KeepBound::Peak, 4), (KeepBound::PeakAndLargest, 0)] {
            let mut k = Kept::default();
            k.set(4 * PAGE, bound);
            let (mut fresh, mut next_at) = (0, 0);
            for cycle in 0..3 {
                let mut take = |k: &mut Kept, len: usize| {
                    let at = match k.take(len) {
                        Taken::Reused(at) => at,
                        Taken::Fresh(_) => {
                            fresh += usize::from(cycle > 0);
                            next_at += len;
                            next_at - len
                        }
                    };
                    k.born(at, len);
                    at
                };
                let (a, b) = (take(&mut k, 8 * PAGE), take(&mut k, 8 * PAGE));
                assert!(k.freed(a) && k.freed(b));
                let c = take(&mut k, 4 * PAGE);
                assert!(k.live_bytes + k.bytes <= 16 * PAGE + if bound == KeepBound::Peak { 0 } else { 8 * PAGE });
                assert!(k.freed(c));
            }
            assert_eq!(fresh, fresh_after_the_first, "{bound:?}: blocks mapped afresh after the first cycle");
        }
        // Releasing the kept blocks starts the peak and the largest block over from what is live.
        let mut k = Kept::default();
        k.set(4 * PAGE, KeepBound::PeakAndLargest);
        let _ = k.take(8 * PAGE);
        k.born(0, 8 * PAGE);
        assert!(k.freed(0));
        assert_eq!(k.drain(), vec![(0, 8 * PAGE)]);
        assert_eq!((k.peak, k.largest), (0, 0));
    }

    #[test]
    fn a_kept_tensor_block_is_reused_unzeroed_and_released_zeroed() {
        let Some(r) = SharedRegion::process() else { return };
        // Keeping is process-wide; other tests here use `alloc`, whose blocks are never kept.
        keep_freed(Some(64 * PAGE), KeepBound::default());
        let p = r.alloc_reusable(64 * PAGE).unwrap();
        unsafe { std::ptr::write_bytes(p, 7, 64 * PAGE) };
        r.free(p, 64 * PAGE);
        assert_eq!(kept_bytes(), 64 * PAGE, "kept and counted");
        let q = r.alloc_reusable(64 * PAGE).unwrap();
        assert_eq!(q, p);
        assert!(unsafe { std::slice::from_raw_parts(q, 64 * PAGE) }.iter().all(|&b| b == 7), "not punched");
        r.free(q, 64 * PAGE);
        keep_freed(None, KeepBound::default());
        assert_eq!(kept_bytes(), 0, "keeping off releases the block");
        let z = r.alloc(64 * PAGE).unwrap();
        assert!(unsafe { std::slice::from_raw_parts(z, 64 * PAGE) }.iter().all(|&b| b == 0), "released: punched");
        r.free(z, 64 * PAGE);
    }

    #[test]
    fn freed_blocks_leave_memory_and_read_zero() {
        let Some(r) = SharedRegion::process() else { return };
        let before = r.used();
        let p = r.alloc(3 * PAGE + 1).unwrap();
        assert!(r.contains(p as usize, 4 * PAGE));
        unsafe { std::ptr::write_bytes(p, 7, 4 * PAGE) };
        r.free(p, 3 * PAGE + 1);
        assert_eq!(r.used(), before);
        let q = r.alloc(4 * PAGE).unwrap();
        assert!(unsafe { std::slice::from_raw_parts(q, 4 * PAGE) }.iter().all(|&b| b == 0));
        r.free(q, 4 * PAGE);
    }
}
