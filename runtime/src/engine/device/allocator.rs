//! Keeping the process's allocator from holding freed memory. libtorch's CPU tensors come from glibc's malloc,
//! whose mmap threshold rises to the size of the largest block freed (up to 32 MiB): from then on, blocks below it
//! come from the heap, and freed heap pages stay resident. A ZeRO run frees large blocks all the time (the model's
//! own tensors once packed, a unit's gradients once reduced), so without this the resident memory holds them all
//! and the memory report shows them as unaccounted (measured, 16 x 2048 MLP at stage 3 on 2 ranks: 386 MiB of a
//! 1143 MiB peak; with a fixed threshold 31 MiB of 788 MiB, at the same step time).
//!
//! The engine fixes the threshold at [`MMAP_THRESHOLD`] (blocks from there up are mapped and unmapped on free)
//! unless `EngineOptions::keep_allocator_settings`, and trims the heap when start-up freed the model's tensors.
//! Mapping afresh costs page faults (the kernel zeroes each page at first touch), and a ZeRO step allocates the
//! same large blocks every step, so the counting allocator and the shared region keep freed blocks from the
//! threshold up for the next allocation of the same size (`report::allocations::keep_freed`,
//! `comm::region::keep_freed`), bounded by the most of them live at once plus the largest block;
//! measured, 2 hosts x 2 ranks at stage 3 with ZeRO++ on CPUs: a fifth of the CPU time was these page faults,
//! and within the peak alone a step still mapped afresh about 220 MiB a rank (1.38-1.45 against 1.16-1.21 s).

use crate::report::allocations::{self, KeepBound};

/// Blocks of at least this many bytes are mapped by malloc and given back to the OS when freed.
pub const MMAP_THRESHOLD: usize = 4 << 20;

/// Fixes malloc's mmap threshold (glibc only; elsewhere nothing).
pub(crate) fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt changes a tunable of glibc's allocator; any thread may call it at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
    }
}

/// Keeps freed blocks of [`MMAP_THRESHOLD`] and up for reuse by the next allocation of the same size (tensors from
/// the counting allocator and in the shm backend's shared region) as `ZERORUN_ALLOCATOR_CACHE` says: unset or `1`
/// within the large blocks' peak plus the largest block, `peak` within the peak, `0` none.
pub(crate) fn keep_freed_blocks() -> crate::error::Result<()> {
    let value = std::env::var(allocations::KEEP_FREED_ENV).ok();
    let (keep, bound) = match value.as_deref().map(str::trim) {
        None | Some("" | "1") => (true, KeepBound::PeakAndLargest),
        Some("peak") => (true, KeepBound::Peak),
        Some("0") => (false, KeepBound::Peak),
        Some(other) => {
            return Err(crate::error::Error::Usage(format!(
                "{}={other:?}: expected 1 (keep freed blocks within the peak plus the largest block, the default), \
                 peak (within the peak) or 0 (keep none)",
                allocations::KEEP_FREED_ENV
            )))
        }
    };
    let from = keep.then_some(MMAP_THRESHOLD);
    allocations::keep_freed(from, bound);
    crate::comm::region::keep_freed(from, bound);
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
