//! `HostBuffer`: zeroed host memory whose start and length are multiples of 4 KiB, as O_DIRECT requires.
use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};

/// The alignment and length granule of host buffers.
pub const PAGE: usize = 4096;

/// Host memory aligned for O_DIRECT (a multiple of 4096 bytes at a 4096-byte address), the unit every swap moves.
pub struct HostBuffer {
    ptr: *mut u8,
    capacity: usize,
}

// SAFETY: HostBuffer owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// At least `bytes` zeroed bytes, rounded up to whole pages (at least one).
    pub fn new(bytes: usize) -> HostBuffer {
        let capacity = bytes.div_ceil(PAGE).max(1) * PAGE;
        let layout = Layout::from_size_align(capacity, PAGE).expect("buffer size fits a Layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            handle_alloc_error(layout);
        }
        HostBuffer { ptr, capacity }
    }

    /// Bytes available (a multiple of [`PAGE`]).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr holds capacity initialised (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.capacity) }
    }

    /// The bytes, to fill before a swap-out.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we own it exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.capacity) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, Layout::from_size_align(self.capacity, PAGE).expect("same layout")) }
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuffer({} bytes at {:p})", self.capacity, self.ptr)
    }
}
