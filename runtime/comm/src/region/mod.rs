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
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

mod books;

pub use books::KeepBound;
use books::{FreeList, Kept, Taken};

static REGION: OnceLock<Option<SharedRegion>> = OnceLock::new();
/// The size from which freed tensor blocks are kept (0: none), for a region made later.
static KEEP_FROM: AtomicUsize = AtomicUsize::new(0);
/// Whether kept blocks may exceed the peak by the largest block ([`KeepBound`]), for a region made later.
static KEEP_HEADROOM: AtomicBool = AtomicBool::new(false);

/// Bytes of address space the region reserves (nothing is allocated until used).
const REGION_BYTES: usize = 256 << 30;
const PAGE: usize = 4096;

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
        self.books().kept.bytes()
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
            None => SharedBuffer::on_heap(len),
        }
    }

    /// `len` zero bytes on the heap (for buffers no peer reads through the region).
    pub fn on_heap(len: usize) -> SharedBuffer {
        let mut heap = vec![0u64; len.div_ceil(8)];
        SharedBuffer { ptr: heap.as_mut_ptr() as *mut u8, len, heap: Some(heap) }
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
