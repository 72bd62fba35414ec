//! Live tensor bytes, counted by owner. The engine installs a counting CPU allocator (`native/counting_allocator.cpp`,
//! c10's own allocator with a header per block) and says, while it runs, whose allocations these are: its own,
//! the model's forward (what autograd keeps for backward, and the output), autograd's backward, or the program's
//! (everything outside the engine's calls: inputs, the loss, what a program keeps). The memory report reads the
//! counters at its events: that is how it names activations and temporaries instead of leaving them unaccounted.
//!
//! The counters are process-wide: with several engines in one process (thread ranks) the report leaves the
//! measured categories out rather than mix ranks. `ZERORUN_COUNT_ALLOCATIONS=0` keeps libtorch's allocator.
//!
//! The same allocator keeps freed large blocks for the next allocation of the same size ([`keep_freed`]): with
//! malloc's mmap threshold fixed, each of them would otherwise be mapped, and faulted in page by page, every step.
use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

pub use crate::comm::region::KeepBound;

/// Turns the counting allocator off when set to `0` (read when an engine is built).
pub const COUNT_ALLOCATIONS_ENV: &str = "ZERORUN_COUNT_ALLOCATIONS";
/// Records the peak's largest allocations (op, phase) when set to `1`: `memory_snapshot_rank{r}.json`.
pub const SNAPSHOT_ENV: &str = "ZERORUN_MEMORY_SNAPSHOT";
/// Which freed blocks are kept for reuse (read when an engine is built): `0` none, `peak` within the live bytes'
/// peak ([`KeepBound::Peak`]), unset or `1` within it plus the largest block ([`KeepBound::PeakAndLargest`]).
pub const KEEP_FREED_ENV: &str = "ZERORUN_ALLOCATOR_CACHE";

extern "C" {
    fn zr_counting_allocator_install();
    fn zr_counting_allocator_set_tag(tag: c_int) -> c_int;
    fn zr_counting_allocator_stats(out: *mut i64);
    fn zr_counting_allocator_keep(min_bytes: i64, keep: c_int, headroom: c_int);
    fn zr_counting_allocator_release_kept();
    fn zr_counting_allocator_trace(on: c_int);
    fn zr_counting_allocator_set_phase(phase: *const c_char);
    fn zr_counting_allocator_top(
        max: c_int,
        bytes: *mut i64,
        tags: *mut c_int,
        op: *mut c_char,
        phase: *mut c_char,
        text_len: c_int,
    ) -> c_int;
}

/// Whose allocation a block is: the tag current when it was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Owner {
    /// Outside the engine's calls: the program's inputs, loss, and what it keeps.
    Program = 0,
    /// The engine's own buffers and transients.
    Engine = 1,
    /// The model's forward: what autograd saves for backward, and the output.
    Forward = 2,
    /// Autograd's backward: gradients before the engine takes them, and backward's temporaries.
    Backward = 3,
}

impl Owner {
    /// The name in snapshots.
    pub fn name(self) -> &'static str {
        match self {
            Owner::Program => "program",
            Owner::Engine => "engine",
            Owner::Forward => "forward",
            Owner::Backward => "backward",
        }
    }

    fn from_tag(tag: i32) -> Owner {
        match tag {
            1 => Owner::Engine,
            2 => Owner::Forward,
            3 => Owner::Backward,
            _ => Owner::Program,
        }
    }
}

/// The counters now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LiveBytes {
    /// Live bytes by [`Owner`] (indexed by its value).
    pub by_owner: [u64; 4],
    /// All live bytes the allocator handed out.
    pub total: u64,
    /// Freed blocks the allocator keeps for reuse ([`keep_freed`]): resident, not live.
    pub kept: u64,
}

impl LiveBytes {
    /// Live bytes of `owner`.
    pub fn of(&self, owner: Owner) -> u64 {
        self.by_owner[owner as usize]
    }
}

/// Engines alive in this process that count: the measured categories are per process, so only one may.
static COUNTING_ENGINES: AtomicUsize = AtomicUsize::new(0);

/// An engine's share of the counters: installs the allocator when first made and allowed; while more than one is
/// alive in the process, nothing is measured.
#[derive(Debug)]
pub struct Counting(());

impl Counting {
    /// Installs the counting allocator (unless `ZERORUN_COUNT_ALLOCATIONS=0`) and registers an engine.
    pub fn start() -> Option<Counting> {
        if std::env::var(COUNT_ALLOCATIONS_ENV).is_ok_and(|v| v.trim() == "0") {
            return None;
        }
        // SAFETY: installation swaps libtorch's CPU allocator pointer; storages keep their own deleters.
        unsafe { zr_counting_allocator_install() };
        COUNTING_ENGINES.fetch_add(1, Ordering::SeqCst);
        Some(Counting(()))
    }

    /// The counters, when this engine is the only counting one in the process.
    pub fn live(&self) -> Option<LiveBytes> {
        (COUNTING_ENGINES.load(Ordering::SeqCst) == 1).then(live)
    }
}

impl Drop for Counting {
    fn drop(&mut self) {
        COUNTING_ENGINES.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The counters now (zeros until installed).
pub fn live() -> LiveBytes {
    let mut out = [0i64; 6];
    // SAFETY: the shim writes exactly 6 values.
    unsafe { zr_counting_allocator_stats(out.as_mut_ptr()) };
    let u = |v: i64| v.max(0) as u64;
    LiveBytes { by_owner: [u(out[0]), u(out[1]), u(out[2]), u(out[3])], total: u(out[4]), kept: u(out[5]) }
}

/// From now on the counting allocator gives each block of at least `min_bytes` a mapping of its own (`None`: every
/// block from libtorch's `alloc_cpu`, i.e. malloc) and, with `keep`, keeps each freed one for the next allocation
/// of the same size (rounded up to a page); without, unmaps it at once and gives back what is kept. Kept blocks are
/// bounded by every byte live: when the live and kept bytes pass the most that were live at once
/// ([`KeepBound::Peak`]: keeping never raises that peak), or that plus the largest block, the oldest kept blocks
/// are given back, before the allocation that passed it is made.
/// Process-wide; nothing happens until the allocator is installed ([`Counting::start`]).
pub fn keep_freed(min_bytes: Option<usize>, keep: Option<KeepBound>) {
    let headroom = c_int::from(keep == Some(KeepBound::PeakAndLargest));
    // SAFETY: stores a threshold and two flags; not keeping frees the kept blocks under the shim's lock.
    unsafe {
        zr_counting_allocator_keep(min_bytes.map_or(0, |b| b.max(1) as i64), c_int::from(keep.is_some()), headroom)
    }
}

/// Gives every kept block back to the system; the peak and the largest block count again from what is live.
pub fn release_kept() {
    // SAFETY: frees the kept blocks under the shim's lock; none of them is in use.
    unsafe { zr_counting_allocator_release_kept() }
}

/// Sets the owner of allocations until the guard drops (then the previous owner again).
#[must_use = "the owner reverts when the guard drops"]
pub struct OwnerScope(c_int);

/// Allocations from now until the guard drops belong to `owner`.
pub fn owned_by(owner: Owner) -> OwnerScope {
    // SAFETY: an atomic exchange in the shim.
    OwnerScope(unsafe { zr_counting_allocator_set_tag(owner as c_int) })
}

impl Drop for OwnerScope {
    fn drop(&mut self) {
        // SAFETY: as in `owned_by`.
        unsafe { zr_counting_allocator_set_tag(self.0) };
    }
}

/// Records every block allocated from now on with its operator (libtorch's RecordFunction) and phase.
pub fn trace(on: bool) {
    // SAFETY: adds a global RecordFunction callback once; flips a flag.
    unsafe { zr_counting_allocator_trace(on as c_int) }
}

/// The phase traced blocks record from now on (e.g. `forward: unit 3`).
pub fn set_phase(phase: &str) {
    let c = std::ffi::CString::new(phase.replace('\0', " ")).expect("no NUL left");
    // SAFETY: the shim copies the string.
    unsafe { zr_counting_allocator_set_phase(c.as_ptr()) }
}

/// One traced live block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracedBlock {
    /// Its size.
    pub bytes: u64,
    /// Whose it is.
    pub owner: Owner,
    /// The operator that allocated it (outermost > innermost), empty outside any operator.
    pub op: String,
    /// The engine's phase then.
    pub phase: String,
}

/// The `n` largest traced blocks alive now, largest first.
pub fn largest(n: usize) -> Vec<TracedBlock> {
    const TEXT: usize = 160;
    let mut bytes = vec![0i64; n];
    let mut tags = vec![0 as c_int; n];
    let mut op = vec![0 as c_char; n * TEXT];
    let mut phase = vec![0 as c_char; n * TEXT];
    // SAFETY: every buffer holds `n` entries of the sizes the shim writes.
    let got = unsafe {
        zr_counting_allocator_top(
            n as c_int,
            bytes.as_mut_ptr(),
            tags.as_mut_ptr(),
            op.as_mut_ptr(),
            phase.as_mut_ptr(),
            TEXT as c_int,
        )
    };
    let text = |buf: &[c_char], i: usize| {
        // SAFETY: the shim NUL-terminates each entry within TEXT bytes.
        unsafe { CStr::from_ptr(buf[i * TEXT..].as_ptr()) }.to_string_lossy().into_owned()
    };
    (0..got.max(0) as usize)
        .map(|i| TracedBlock {
            bytes: bytes[i].max(0) as u64,
            owner: Owner::from_tag(tags[i]),
            op: text(&op, i),
            phase: text(&phase, i),
        })
        .collect()
}

/// Bytes glibc's malloc holds in free blocks of its arenas (`mallinfo2`: `fordblks`): freed memory it keeps
/// resident for reuse instead of returning it. 0 where glibc is not the allocator.
pub fn malloc_free_bytes() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 reads the arenas' statistics under their locks.
        let info = unsafe { libc::mallinfo2() };
        info.fordblks as u64
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0
    }
}
