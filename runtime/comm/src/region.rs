//! Shared buffer memory for the shm backend: one memfd per process, mapped by every peer once, from which the
//! engine allocates the buffers it hands to collectives (gradient and parameter buffers, stage-3 units). A peer
//! then reads such a buffer with a plain memcpy from its own mapping, where `process_vm_readv` (cma.rs) pins and
//! copies page by page at under half of memcpy's speed; an all-reduce writes each reduced segment straight into
//! every rank's buffer.
//!
//! The region is a large sparse file (pages exist only once written); blocks are page-granular, and freeing one
//! punches it out of the file, so its memory goes back to the system for every process that maps it.
use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock};

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

/// This process's region.
pub struct SharedRegion {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
    blocks: Mutex<FreeList>,
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
        Ok(SharedRegion { fd, base, len: REGION_BYTES, blocks: Mutex::new(FreeList::new(REGION_BYTES)) })
    }

    /// The process's region, created on first use; None where memfd or the mapping is refused.
    pub fn process() -> Option<&'static SharedRegion> {
        static REGION: OnceLock<Option<SharedRegion>> = OnceLock::new();
        REGION
            .get_or_init(|| match SharedRegion::create() {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::warn!(error = %e, "no shared buffer region: collectives read peers through process_vm_readv");
                    None
                }
            })
            .as_ref()
    }

    /// `bytes` (rounded up to pages) of zeroed memory, or None when the region is full.
    pub fn alloc(&self, bytes: usize) -> Option<*mut u8> {
        let len = bytes.max(1).div_ceil(PAGE) * PAGE;
        let at = self.blocks.lock().unwrap_or_else(|p| p.into_inner()).alloc(len)?;
        // SAFETY: inside the mapping.
        Some(unsafe { self.base.add(at) })
    }

    /// Frees a block from [`alloc`](Self::alloc) of `bytes`: its pages leave the file (memory goes back to the
    /// system, and the block reads as zeros when handed out again).
    ///
    /// SAFETY (for callers): `ptr` and `bytes` are those of a live block, not used afterwards.
    pub fn free(&self, ptr: *mut u8, bytes: usize) {
        let len = bytes.max(1).div_ceil(PAGE) * PAGE;
        let at = ptr as usize - self.base as usize;
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
        self.blocks.lock().unwrap_or_else(|p| p.into_inner()).release(at, len);
    }

    /// Whether `[addr, addr + len)` is inside the region.
    pub fn contains(&self, addr: usize, len: usize) -> bool {
        let base = self.base as usize;
        addr >= base && addr + len <= base + self.len
    }

    /// Bytes in use.
    pub fn used(&self) -> usize {
        self.blocks.lock().unwrap_or_else(|p| p.into_inner()).used()
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

/// `region_alloc` / `region_free` for the C++ allocator of tensors in the region (engine/native.rs).
pub extern "C" fn region_alloc(bytes: usize) -> *mut std::ffi::c_void {
    SharedRegion::process().and_then(|r| r.alloc(bytes)).map_or(std::ptr::null_mut(), |p| p as *mut std::ffi::c_void)
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
