//! Keeping the process's allocators from holding freed memory at the peak. libtorch's CPU tensors come from
//! glibc's malloc, whose mmap threshold rises to the size of the largest block freed (up to 32 MiB): from then on,
//! blocks below it come from the heap, and freed heap pages stay resident. The engine fixes the threshold at
//! [`MMAP_THRESHOLD`] unless `EngineOptions::keep_allocator_settings`, and trims the heap when start-up freed the
//! model's tensors (measured, 16 x 2048 MLP at stage 3 on 2 ranks: unaccounted 386 of a 1143 MiB peak before,
//! 31 of 788 after, at the same step time).
//!
//! That left the heap itself: a step's activations and temporaries (0.25-4 MiB each for a small model) are
//! allocated and freed all over it, and the pages they touched stay resident, so the heap holds their high-water
//! mark plus what temporaries walked through (the demo's GPT at stage 3: 150 MiB over the live bytes at the peak,
//! whether or not the heap is trimmed every step). So the counting allocator gives every tensor block from
//! [`KEPT_TENSOR_BLOCKS_FROM`] up a mapping of its own (2 MiB-aligned and marked for transparent huge pages from
//! 2 MiB, so a fresh one is zeroed 2 MiB per fault) and keeps freed ones for the next allocation of the same
//! size: a step allocates the same sizes every step, so in the steady state nothing is mapped. Kept blocks are
//! bounded by *every* byte live: kept plus live stays within the most bytes that were live at once (plus the
//! largest block, `ZERORUN_ALLOCATOR_CACHE=1`), so where the step is at its most (forward's end) nothing is kept,
//! and the resident peak is the live peak. Measured on the demo in the guide's Memory chapter.
//! The shared region (`comm::region::keep_freed`) keeps its collective buffers from [`MMAP_THRESHOLD`] up the
//! same way, bounded by its own peak.

use crate::report::allocations::{self, KeepBound};

/// Blocks of at least this many bytes are mapped by malloc and given back to the OS when freed.
pub const MMAP_THRESHOLD: usize = 4 << 20;

/// Tensor blocks of at least this many bytes get a mapping of their own from the counting allocator, kept for
/// reuse when freed (see the module's doc): activations and temporaries of a small model are 0.25-4 MiB.
pub const KEPT_TENSOR_BLOCKS_FROM: usize = 256 << 10;

/// Fixes malloc's mmap threshold (glibc only; elsewhere nothing).
pub(crate) fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt changes a tunable of glibc's allocator; any thread may call it at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
    }
}

/// Maps tensor blocks of [`KEPT_TENSOR_BLOCKS_FROM`] and up one by one and keeps freed ones (and the shm backend's
/// shared-region blocks of [`MMAP_THRESHOLD`] and up) for reuse by the next allocation of the same size, as
/// `ZERORUN_ALLOCATOR_CACHE` says: unset or `1` within the live bytes' peak plus the largest block, `peak` within
/// the peak, `0` none (every freed block given back at once: the least resident memory, a fresh mapping each time).
pub(crate) fn keep_freed_blocks() -> crate::error::Result<()> {
    let value = std::env::var(allocations::KEEP_FREED_ENV).ok();
    let keep = match value.as_deref().map(str::trim) {
        None | Some("" | "1") => Some(KeepBound::PeakAndLargest),
        Some("peak") => Some(KeepBound::Peak),
        Some("0") => None,
        Some(other) => {
            return Err(crate::error::Error::Usage(format!(
                "{}={other:?}: expected 1 (keep freed blocks within the peak plus the largest block, the default), \
                 peak (within the peak) or 0 (keep none)",
                allocations::KEEP_FREED_ENV
            )))
        }
    };
    allocations::keep_freed(Some(KEPT_TENSOR_BLOCKS_FROM), keep);
    crate::comm::region::keep_freed(keep.map(|_| MMAP_THRESHOLD), keep.unwrap_or(KeepBound::Peak));
    Ok(())
}

/// Releases the blocks kept for reuse (the counting allocator's and the shared region's).
pub(crate) fn release_kept() {
    allocations::release_kept();
    crate::comm::region::release_kept();
}

/// Hands the free pages of malloc's heap and the kept blocks back to the OS (glibc's
/// heap only on glibc).
pub(crate) fn return_freed_memory() {
    release_kept();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free pages of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}
