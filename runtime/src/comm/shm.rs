//! Ranks as processes on one host, exchanging through one shared-memory segment (memmap2 over /dev/shm).
//!
//! Layout: a header (magic, world size, slot size, an attach count, and per rank an arrival counter, pid, and the
//! op and length of its current collective), then one staging slot per rank and one result slot. A collective
//! moves its buffer through the slots in chunks; ranks meet at barriers made of the arrival counters.
//!
//! Nothing is left in /dev/shm: rank 0 unlinks the segment as soon as every rank has mapped it, so the memory is
//! returned when the last process exits, however it exits. A barrier that waits checks, every 50 ms, that the
//! ranks it waits for are alive (by pid) and that `comms_timeout` has not passed; either failure is an error that
//! names the operation, the group, the rank and the time waited.
use std::cell::Cell;
use std::fs::OpenOptions;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use super::env::RankInfo;
use super::region::{PeerRegion, SharedRegion};
use super::agreement::{self, Call};
use super::buffer::{combine_pair, combine_pair_in_place, fold_into};
use super::{reduce_into, BufMut, BufRef, CommError, CommResult, Communicator, Dtype, ReduceOp};

const MAGIC: u64 = 0x5a45_524f_5255_4e31; // "ZERORUN1"
const HEADER: usize = 64 * 1024;
const RANK_BLOCK: usize = 256;
const RANKS_AT: usize = 256;
const MAX_RANKS: usize = (HEADER - RANKS_AT) / RANK_BLOCK;
/// Bytes per staging slot: large enough that barriers cost little next to the copies.
const SLOT_BYTES: usize = 16 << 20;

// Header words.
const W_MAGIC: usize = 0;
const W_WORLD: usize = 1;
const W_SLOT: usize = 2;
const W_ATTACHED: usize = 3;
// Per-rank words.
const R_ARRIVE: usize = 0;
const R_PID: usize = 1;
const R_OP: usize = 2;
const R_LEN: usize = 3;
/// Address of the rank's buffer in the current collective (for direct reads).
const R_ADDR: usize = 4;
/// Result of the direct-read probe: 1 = could read every peer, 2 = could not.
const R_DIRECT: usize = 5;
/// Element type of the current collective.
const R_DTYPE: usize = 6;
/// Set when this rank saw a peer die: if it exits too, others name the first death, not this rank.
const R_FAILED: usize = 7;
/// This rank's shared buffer region (region.rs), for peers to map: fd number, base address, length (0: none).
const R_REGION_FD: usize = 8;
const R_REGION_BASE: usize = 9;
const R_REGION_LEN: usize = 10;
/// Result of mapping every peer's region: 1 = all mapped, 2 = not.
const R_REGION_OK: usize = 11;
/// Bytes reduced at a time in the direct path (256 KiB: the chunk and its scratch stay in L2).
const REDUCE_CHUNK: usize = 256 * 1024;


/// One rank's handle on a shared-memory group.
pub struct ShmComm {
    rank: usize,
    world_size: usize,
    group: String,
    map: MmapMut,
    /// Barriers this rank has entered (its arrival counter).
    seq: Cell<u64>,
    timeout: Duration,
    /// Ranks read each other's buffers directly (cross-memory attach) instead of staging through the slots.
    direct: bool,
    /// Scratch of the direct reduction: an accumulator and a landing buffer, REDUCE_CHUNK bytes each, reused
    /// (u64 words keep every element type aligned).
    scratch: std::cell::RefCell<Vec<u64>>,
    /// Every peer's shared buffer region mapped here (None for this rank, or where mapping failed): buffers in a
    /// peer's region are read with memcpy, others through `process_vm_readv`.
    peers: Vec<Option<PeerRegion>>,
    /// Every rank mapped every other's region, so buffers in this process's region are read at memcpy speed.
    shared_buffers: bool,
}

/// `/dev/shm/zerorun-<run id>` with anything but letters, digits, '-' and '.' replaced.
pub fn segment_path(run_id: &str) -> PathBuf {
    let clean: String = run_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' }).collect();
    PathBuf::from(format!("/dev/shm/zerorun-{clean}"))
}

impl ShmComm {
    /// Creates (rank 0) or attaches to (other ranks) the job's segment and waits until every rank is there.
    pub fn join(info: &RankInfo, timeout: Duration) -> CommResult<ShmComm> {
        let (rank, world_size) = (info.rank, info.world_size);
        let path = segment_path(&info.run_id);
        let place = path.display().to_string();
        let fail = |what: String| CommError::Rendezvous { rank, world_size, place: place.clone(), what };
        if world_size > MAX_RANKS {
            return Err(fail(format!("at most {MAX_RANKS} ranks per host")));
        }
        let total = HEADER + (world_size + 1) * SLOT_BYTES;
        let start = Instant::now();
        super::cma::allow_peers_to_read();
        let map = if rank == 0 {
            // Written under a temporary name and renamed, so no rank ever maps a half-initialised segment.
            let tmp = PathBuf::from(format!("{}.tmp-{}", path.display(), std::process::id()));
            let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&tmp).map_err(|e| fail(format!("create: {e}")))?;
            file.set_len(total as u64).map_err(|e| fail(format!("size {total} bytes: {e}")))?;
            // SAFETY: the file is ours and stays mapped for the life of the communicator.
            let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| fail(format!("mmap: {e}")))?;
            let c = ShmComm::with_map(info, map, timeout);
            c.word(W_WORLD).store(world_size as u64, Ordering::Relaxed);
            c.word(W_SLOT).store(SLOT_BYTES as u64, Ordering::Relaxed);
            c.rank_word(0, R_PID).store(std::process::id() as u64, Ordering::Relaxed);
            c.word(W_MAGIC).store(MAGIC, Ordering::Release);
            std::fs::rename(&tmp, &path).map_err(|e| fail(format!("publish: {e}")))?;
            while c.word(W_ATTACHED).load(Ordering::Acquire) < world_size as u64 - 1 {
                if start.elapsed() > timeout {
                    let _ = std::fs::remove_file(&path);
                    let missing: Vec<usize> = (1..world_size).filter(|&r| c.rank_word(r, R_PID).load(Ordering::Acquire) == 0).collect();
                    return Err(fail(format!("ranks {missing:?} did not attach within {timeout:?} (comms_timeout)")));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            // Every rank has it mapped: unlink now, so nothing outlives the processes.
            std::fs::remove_file(&path).map_err(|e| fail(format!("unlink: {e}")))?;
            let mut c = c;
            c.barrier_op("rendezvous")?;
            c.probe_direct()?;
            return Ok(c);
        } else {
            let file = loop {
                match OpenOptions::new().read(true).write(true).open(&path) {
                    Ok(f) if f.metadata().map(|m| m.len() as usize == total).unwrap_or(false) => break f,
                    Ok(f) => {
                        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                        if len as usize != total && len != 0 {
                            return Err(fail(format!("segment has {len} bytes, expected {total}: is WORLD_SIZE the same on every rank?")));
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(fail(format!("open: {e}"))),
                }
                if start.elapsed() > timeout {
                    return Err(fail(format!("rank 0 did not create the segment within {timeout:?} (comms_timeout)")));
                }
                std::thread::sleep(Duration::from_millis(2));
            };
            // SAFETY: as above; the segment is shared by design and accessed through atomics and barriers.
            unsafe { MmapMut::map_mut(&file) }.map_err(|e| fail(format!("mmap: {e}")))?
        };
        let c = ShmComm::with_map(info, map, timeout);
        if c.word(W_MAGIC).load(Ordering::Acquire) != MAGIC || c.word(W_WORLD).load(Ordering::Relaxed) != world_size as u64 {
            return Err(fail("the segment belongs to another job (magic or world size differ)".into()));
        }
        c.rank_word(rank, R_PID).store(std::process::id() as u64, Ordering::Relaxed);
        c.word(W_ATTACHED).fetch_add(1, Ordering::AcqRel);
        let mut c = c;
        c.barrier_op("rendezvous")?;
        c.probe_direct()?;
        Ok(c)
    }

    fn with_map(info: &RankInfo, map: MmapMut, timeout: Duration) -> ShmComm {
        ShmComm {
            rank: info.rank,
            world_size: info.world_size,
            group: info.run_id.clone(),
            map,
            seq: Cell::new(0),
            timeout,
            direct: false,
            scratch: std::cell::RefCell::new(Vec::new()),
            peers: Vec::new(),
            shared_buffers: false,
        }
    }

    /// Whether collectives read peers' buffers directly (one copy) rather than through the staging slots.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Every rank tries to read every other; direct reads are used only if all succeed.
    fn probe_direct(&mut self) -> CommResult<()> {
        if std::env::var("ZERORUN_SHM_STAGING").is_ok() {
            return Ok(());
        }
        self.rank_word(self.rank, R_ADDR).store(&super::cma::PROBE as *const u64 as u64, Ordering::Relaxed);
        self.barrier_op("rendezvous")?;
        let ok = (0..self.world_size).filter(|&k| k != self.rank).all(|k| {
            let pid = self.rank_word(k, R_PID).load(Ordering::Relaxed) as u32;
            let addr = self.rank_word(k, R_ADDR).load(Ordering::Relaxed) as usize;
            let mut v = [0u8; 8];
            super::cma::read(pid, addr, &mut v).is_ok() && u64::from_ne_bytes(v) == super::cma::PROBE
        });
        self.rank_word(self.rank, R_DIRECT).store(if ok { 1 } else { 2 }, Ordering::Relaxed);
        self.barrier_op("rendezvous")?;
        self.direct = (0..self.world_size).all(|k| self.rank_word(k, R_DIRECT).load(Ordering::Relaxed) == 1);
        if self.direct {
            self.map_peer_regions()?;
        }
        tracing::debug!(rank = self.rank, direct = self.direct, shared_buffers = self.shared_buffers, "shm backend ready");
        Ok(())
    }

    /// Publishes this process's buffer region and maps every peer's (through `/proc/<pid>/fd`, which needs the
    /// same rights as `process_vm_readv`).
    fn map_peer_regions(&mut self) -> CommResult<()> {
        let (fd, base, len) = SharedRegion::process().map_or((0, 0, 0), SharedRegion::published);
        self.rank_word(self.rank, R_REGION_FD).store(fd, Ordering::Relaxed);
        self.rank_word(self.rank, R_REGION_BASE).store(base, Ordering::Relaxed);
        self.rank_word(self.rank, R_REGION_LEN).store(len, Ordering::Relaxed);
        self.barrier_op("rendezvous")?;
        self.peers = (0..self.world_size)
            .map(|k| {
                let published = (self.rank_word(k, R_REGION_FD).load(Ordering::Relaxed), self.rank_word(k, R_REGION_BASE).load(Ordering::Relaxed), self.rank_word(k, R_REGION_LEN).load(Ordering::Relaxed));
                if k == self.rank || published.2 == 0 {
                    return None;
                }
                let pid = self.rank_word(k, R_PID).load(Ordering::Relaxed) as u32;
                PeerRegion::map(pid, published).map_err(|e| tracing::debug!(rank = self.rank, peer = k, error = %e, "cannot map the peer's buffer region")).ok()
            })
            .collect();
        let ok = len != 0 && (0..self.world_size).all(|k| k == self.rank || self.peers[k].is_some());
        self.rank_word(self.rank, R_REGION_OK).store(if ok { 1 } else { 2 }, Ordering::Relaxed);
        self.barrier_op("rendezvous")?;
        self.shared_buffers = (0..self.world_size).all(|k| self.rank_word(k, R_REGION_OK).load(Ordering::Relaxed) == 1);
        Ok(())
    }

    /// Whether every rank's buffer of this collective (`bytes` long) is in its shared region: the same answer on
    /// every rank, since each sees every rank's published address and region.
    fn all_buffers_shared(&self, bytes: usize) -> bool {
        let own = self.rank_word(self.rank, R_ADDR).load(Ordering::Relaxed) as usize;
        self.shared_buffers
            && SharedRegion::process().is_some_and(|r| r.contains(own, bytes))
            && (0..self.world_size).all(|k| k == self.rank || self.peer_ptr(k, 0, bytes).is_some())
    }

    /// Where rank `k`'s bytes at byte offset `offset` of its buffer in this collective are mapped here, when they
    /// are in its region.
    fn peer_ptr(&self, k: usize, offset: usize, len: usize) -> Option<*mut u8> {
        let addr = self.rank_word(k, R_ADDR).load(Ordering::Relaxed) as usize + offset;
        self.peers.get(k)?.as_ref()?.ptr(addr, len)
    }

    /// Rank `k`'s bytes at byte offset `offset` of its buffer in this collective, when they are in its region.
    fn peer_bytes(&self, k: usize, offset: usize, len: usize) -> Option<&[u8]> {
        // SAFETY: mapped, inside the peer's region; the collective's barriers keep it unchanged meanwhile.
        self.peer_ptr(k, offset, len).map(|p| unsafe { std::slice::from_raw_parts(p as *const u8, len) })
    }

    /// Reads `dst.len()` bytes at byte offset `offset` of rank `k`'s buffer in this collective.
    fn read_peer(&self, op: &'static str, k: usize, offset: usize, dst: &mut [u8]) -> CommResult<()> {
        if dst.is_empty() {
            return Ok(());
        }
        if let Some(src) = self.peer_bytes(k, offset, dst.len()) {
            dst.copy_from_slice(src);
            return Ok(());
        }
        let pid = self.rank_word(k, R_PID).load(Ordering::Relaxed);
        let addr = self.rank_word(k, R_ADDR).load(Ordering::Relaxed) as usize + offset;
        super::cma::read(pid as u32, addr, dst).map_err(|e| {
            if e.raw_os_error() == Some(libc::ESRCH) {
                // Rank k is gone; if it left because it saw another rank die (it flagged itself), name that one.
                let dead = self.first_death(|_| true).unwrap_or(k);
                let pid = self.rank_word(dead, R_PID).load(Ordering::Acquire) as u32;
                CommError::PeerDied { op, rank: self.rank, group: self.group.clone(), dead, pid, waited: Duration::ZERO }
            } else {
                CommError::BadArgument { op, rank: self.rank, what: format!("reading rank {k}'s buffer: {e}") }
            }
        })
    }

    /// Combines, in rank order, bytes `range` (whole `dtype` elements) of every rank's buffer (`local` is this
    /// rank's) into `dst` (`range.len()` bytes; it may be `local`'s own `range`: each chunk of `local` is read
    /// before that chunk of `dst` is written).
    /// Each finished chunk is also copied to every pointer of `push` (each `range.len()` bytes, not overlapping).
    #[allow(clippy::too_many_arguments)]
    fn reduce_direct(&self, op: &'static str, range: std::ops::Range<usize>, local: *const u8, dst: *mut u8, push: &[*mut u8], dtype: Dtype, how: ReduceOp) -> CommResult<()> {
        let mut scratch = self.scratch.borrow_mut();
        if scratch.len() < 2 * REDUCE_CHUNK / 8 {
            scratch.resize(2 * REDUCE_CHUNK / 8, 0);
        }
        let (acc, tmp) = bytemuck::cast_slice_mut::<u64, u8>(&mut scratch).split_at_mut(REDUCE_CHUNK);
        let n = self.world_size;
        for a in (range.start..range.end).step_by(REDUCE_CHUNK) {
            let b = (a + REDUCE_CHUNK).min(range.end);
            // SAFETY: `local` holds at least range.end bytes and `dst` range.len(); the chunk of `local` is read
            // before the same chunk of `dst` is written.
            let (mine, out) = unsafe { (local.add(a), dst.add(a - range.start)) };
            if n == 2 {
                // Two ranks: the peer's chunk from its mapped region (else landed in `tmp`) and one fused pass, in
                // rank order.
                let peer = 1 - self.rank;
                let theirs = match self.peer_bytes(peer, a, b - a) {
                    Some(mapped) => mapped.as_ptr(),
                    None => {
                        self.read_peer(op, peer, a, &mut tmp[..b - a])?;
                        tmp.as_ptr()
                    }
                };
                // SAFETY: chunks of `local`, `dst` and the peer's bytes (mapped or landed in `tmp`), `b - a` long;
                // `dst` either is `local`'s chunk (all-reduce) or overlaps neither.
                let theirs = unsafe { std::slice::from_raw_parts(theirs, b - a) };
                let out_chunk = unsafe { std::slice::from_raw_parts_mut(out, b - a) };
                if std::ptr::eq(out as *const u8, mine) {
                    combine_pair_in_place(dtype, out_chunk, theirs, self.rank == 1, how, n);
                } else {
                    let mine = unsafe { std::slice::from_raw_parts(mine, b - a) };
                    let (first, second) = if self.rank == 0 { (mine, theirs) } else { (theirs, mine) };
                    combine_pair(dtype, out_chunk, first, second, how, n);
                }
                push_chunk(push, a - range.start, out_chunk);
                continue;
            }
            // Only one peer's chunk fits the landing buffer at a time: fold as we go, in rank order.
            for k in 0..n {
                let part: &[u8] = if k == self.rank {
                    unsafe { std::slice::from_raw_parts(mine, b - a) }
                } else if let Some(mapped) = self.peer_bytes(k, a, b - a) {
                    mapped
                } else {
                    self.read_peer(op, k, a, &mut tmp[..b - a])?;
                    &tmp[..b - a]
                };
                if k == 0 {
                    acc[..b - a].copy_from_slice(part);
                } else {
                    fold_into(dtype, &mut acc[..b - a], part, how);
                }
            }
            if how == ReduceOp::Avg {
                super::buffer::divide(dtype, &mut acc[..b - a], n);
            }
            unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), out, b - a) };
            push_chunk(push, a - range.start, &acc[..b - a]);
        }
        Ok(())
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the header is inside the mapping, 8-byte aligned, and only accessed atomically.
        unsafe { &*(self.map.as_ptr().add(i * 8) as *const AtomicU64) }
    }

    fn rank_word(&self, rank: usize, i: usize) -> &AtomicU64 {
        // SAFETY: as above.
        unsafe { &*(self.map.as_ptr().add(RANKS_AT + rank * RANK_BLOCK + i * 8) as *const AtomicU64) }
    }

    /// Slot `k` (k = world_size is the result slot). Writers and readers are kept apart by barriers.
    #[allow(clippy::mut_from_ref)]
    fn slot(&self, k: usize) -> &mut [u8] {
        // SAFETY: slots are disjoint regions of the mapping, 64 KiB aligned; who writes what between which
        // barriers is fixed by each collective below.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr().add(HEADER + k * SLOT_BYTES) as *mut u8, SLOT_BYTES) }
    }

    fn alive(pid: u64) -> bool {
        if pid == 0 {
            return true;
        }
        // SAFETY: signal 0 only checks that the process exists.
        let exists = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
        // A killed rank its parent has not reaped yet is a zombie: dead, though signal 0 still finds it.
        exists && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
    }

    /// Among the ranks that are gone and satisfy `candidate`, the one that died first: a rank that left after
    /// seeing another die flagged itself, so an unflagged one is the cause.
    fn first_death(&self, candidate: impl Fn(usize) -> bool) -> Option<usize> {
        let dead: Vec<usize> = (0..self.world_size).filter(|&k| k != self.rank && candidate(k) && !Self::alive(self.rank_word(k, R_PID).load(Ordering::Acquire))).collect();
        dead.iter().copied().find(|&k| self.rank_word(k, R_FAILED).load(Ordering::Acquire) == 0).or(dead.first().copied())
    }

    fn flag_failure<T>(&self, r: CommResult<T>) -> CommResult<T> {
        if r.is_err() {
            self.rank_word(self.rank, R_FAILED).store(1, Ordering::Release);
        }
        r
    }

    fn barrier_op(&self, op: &'static str) -> CommResult<()> {
        let target = self.seq.get() + 1;
        self.seq.set(target);
        self.rank_word(self.rank, R_ARRIVE).store(target, Ordering::Release);
        let start = Instant::now();
        let mut spins = 0u32;
        let mut next_check = Duration::from_millis(50);
        loop {
            if (0..self.world_size).all(|k| self.rank_word(k, R_ARRIVE).load(Ordering::Acquire) >= target) {
                return Ok(());
            }
            spins += 1;
            let waited = start.elapsed();
            // Peers of one collective arrive within microseconds of each other: spin, then yield (which hands
            // the core to any other runnable rank on an oversubscribed host), and only sleep (whose wake-up costs
            // 50-100 us, more than a whole 1 MiB collective) once the wait is clearly long.
            if spins < 64 {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
            if waited >= next_check {
                next_check = waited + Duration::from_millis(50);
                // A rank that did not arrive is gone: name the rank that died first, which may be one that arrived
                // and died afterwards (the missing rank saw it die, flagged itself and left).
                if let Some(k) = self.first_death(|k| self.rank_word(k, R_ARRIVE).load(Ordering::Acquire) < target).and_then(|_| self.first_death(|_| true)) {
                    let pid = self.rank_word(k, R_PID).load(Ordering::Acquire) as u32;
                    return Err(CommError::PeerDied { op, rank: self.rank, group: self.group.clone(), dead: k, pid, waited });
                }
                if waited >= self.timeout {
                    let missing = (0..self.world_size).filter(|&k| self.rank_word(k, R_ARRIVE).load(Ordering::Acquire) < target).collect();
                    return Err(CommError::Timeout { op, rank: self.rank, missing, waited });
                }
            }
        }
    }

    /// Publishes (op, length, element type, address) and checks after a barrier that every rank called the same
    /// collective with the same size and type.
    fn handshake(&self, op: &'static str, len: usize, dtype: Dtype, addr: *const u8) -> CommResult<()> {
        self.rank_word(self.rank, R_ADDR).store(addr as u64, Ordering::Relaxed);
        let [c, l, d] = Call::new(op, len, dtype).words();
        self.rank_word(self.rank, R_OP).store(c, Ordering::Relaxed);
        self.rank_word(self.rank, R_LEN).store(l, Ordering::Relaxed);
        self.rank_word(self.rank, R_DTYPE).store(d, Ordering::Relaxed);
        self.barrier_op(op)?;
        let word = |k: usize, w: usize| self.rank_word(k, w).load(Ordering::Relaxed);
        let calls: Vec<Call> = (0..self.world_size).map(|k| Call::from_words(&[word(k, R_OP), word(k, R_LEN), word(k, R_DTYPE)])).collect();
        let result = agreement::check(op, self.rank, &calls);
        // Nobody rewrites its words before everyone has read them.
        self.barrier_op(op)?;
        result
    }

}

/// Copies a finished chunk (at byte `offset` of the reduced range) to the same place in each of `push`.
fn push_chunk(push: &[*mut u8], offset: usize, chunk: &[u8]) {
    for &p in push {
        // SAFETY: each destination holds the whole range (reduce_direct's contract).
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), p.add(offset), chunk.len()) };
    }
}

impl ShmComm {
    fn all_reduce_buf_impl(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        const OP: &str = "all_reduce";
        let (dtype, es, len) = (buf.dtype, buf.dtype.size(), buf.len());
        let bytes = buf.bytes;
        self.handshake(OP, len, dtype, bytes.as_ptr())?;
        let n = self.world_size;
        let seg = |k: usize| (len * k / n * es)..(len * (k + 1) / n * es);
        if self.direct {
            // Reduce-scatter: rank r combines segment r of every buffer into its own (peers read only other
            // segments of ours meanwhile); then all-gather: read every other segment from its owner.
            let mine = seg(self.rank);
            let base = bytes.as_mut_ptr();
            // When every rank's buffer is in its shared region, each rank also writes its reduced segment into
            // every peer's buffer (no rank then reads what a peer has just written, which costs a cross-core
            // transfer of dirty lines) and one barrier ends the collective.
            let push: Option<Vec<*mut u8>> = self.all_buffers_shared(bytes.len()).then(|| {
                (0..n).filter(|&k| k != self.rank).map(|k| self.peer_ptr(k, mine.start, mine.len()).expect("checked: the peer's buffer is mapped")).collect()
            });
            // SAFETY: our own segment of our own buffer; the pushed-to ranges are this segment of the peers'
            // buffers, which their owners neither read nor write during the collective.
            self.reduce_direct(OP, mine.clone(), base, unsafe { base.add(mine.start) }, push.as_deref().unwrap_or(&[]), dtype, op)?;
            if push.is_some() {
                return self.barrier_op(OP);
            }
            self.barrier_op(OP)?;
            for k in (0..n).filter(|&k| k != self.rank) {
                let s = seg(k);
                self.read_peer(OP, k, s.start, &mut bytes[s])?;
            }
            return self.barrier_op(OP);
        }
        let chunk_elems = SLOT_BYTES / es;
        for start in (0..len).step_by(chunk_elems.max(1)) {
            let l = chunk_elems.min(len - start);
            let chunk = &mut bytes[start * es..(start + l) * es];
            self.slot(self.rank)[..chunk.len()].copy_from_slice(chunk);
            self.barrier_op(OP)?;
            // Rank r reduces segment r of every slot into the result slot.
            let s = (l * self.rank / n * es)..(l * (self.rank + 1) / n * es);
            let parts: Vec<&[u8]> = (0..n).map(|k| &self.slot(k)[s.clone()]).collect();
            reduce_into(dtype, &mut self.slot(n)[s.clone()], &parts, op);
            self.barrier_op(OP)?;
            chunk.copy_from_slice(&self.slot(n)[..chunk.len()]);
            self.barrier_op(OP)?;
        }
        Ok(())
    }

    fn reduce_scatter_buf_impl(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        const OP: &str = "reduce_scatter";
        let part = agreement::scatter_output(OP, self.rank, self.world_size, &input, &output)?;
        let (dtype, es) = (input.dtype, input.dtype.size());
        self.handshake(OP, input.len(), dtype, input.bytes.as_ptr())?;
        let n = self.world_size;
        let r = self.rank;
        let pb = part * es;
        if self.direct {
            self.reduce_direct(OP, r * pb..(r + 1) * pb, input.bytes.as_ptr(), output.bytes.as_mut_ptr(), &[], dtype, op)?;
            return self.barrier_op(OP);
        }
        let q = (SLOT_BYTES / n / es).max(1) * es; // bytes of each part per round
        for a in (0..pb).step_by(q) {
            let b = (a + q).min(pb);
            let slot = self.slot(r);
            for k in 0..n {
                slot[k * q..k * q + (b - a)].copy_from_slice(&input.bytes[k * pb + a..k * pb + b]);
            }
            self.barrier_op(OP)?;
            let parts: Vec<&[u8]> = (0..n).map(|k| &self.slot(k)[r * q..r * q + (b - a)]).collect();
            reduce_into(dtype, &mut output.bytes[a..b], &parts, op);
            self.barrier_op(OP)?;
        }
        Ok(())
    }

    fn all_gather_buf_impl(&self, buf: BufMut<'_>) -> CommResult<()> {
        const OP: &str = "all_gather";
        let pb = agreement::equal_parts(OP, self.rank, self.world_size, buf.len())? * buf.dtype.size();
        let bytes = buf.bytes;
        self.handshake(OP, bytes.len() / buf.dtype.size(), buf.dtype, bytes.as_ptr())?;
        let r = self.rank;
        if self.direct {
            for k in (0..self.world_size).filter(|&k| k != r) {
                self.read_peer(OP, k, k * pb, &mut bytes[k * pb..(k + 1) * pb])?;
            }
            return self.barrier_op(OP);
        }
        for a in (0..pb).step_by(SLOT_BYTES) {
            let b = (a + SLOT_BYTES).min(pb);
            self.slot(r)[..b - a].copy_from_slice(&bytes[r * pb + a..r * pb + b]);
            self.barrier_op(OP)?;
            for k in (0..self.world_size).filter(|&k| k != r) {
                bytes[k * pb + a..k * pb + b].copy_from_slice(&self.slot(k)[..b - a]);
            }
            self.barrier_op(OP)?;
        }
        Ok(())
    }

    fn broadcast_buf_impl(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        const OP: &str = "broadcast";
        agreement::root(OP, self.rank, self.world_size, root)?;
        let bytes = buf.bytes;
        self.handshake(OP, bytes.len() / buf.dtype.size(), buf.dtype, bytes.as_ptr())?;
        if self.direct {
            if self.rank != root {
                self.read_peer(OP, root, 0, bytes)?;
            }
            return self.barrier_op(OP);
        }
        for chunk in bytes.chunks_mut(SLOT_BYTES) {
            if self.rank == root {
                self.slot(root)[..chunk.len()].copy_from_slice(chunk);
            }
            self.barrier_op(OP)?;
            if self.rank != root {
                chunk.copy_from_slice(&self.slot(root)[..chunk.len()]);
            }
            self.barrier_op(OP)?;
        }
        Ok(())
    }

}

/// Any failed collective flags this rank before returning, whatever the cause, so that if it exits, peers name the
/// rank whose death started it rather than this one.
impl Communicator for ShmComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.flag_failure(self.all_reduce_buf_impl(buf, op))
    }

    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.flag_failure(self.reduce_scatter_buf_impl(input, output, op))
    }

    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        self.flag_failure(self.all_gather_buf_impl(buf))
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        self.flag_failure(self.broadcast_buf_impl(buf, root))
    }

    fn prefers_shared_buffers(&self) -> bool {
        self.shared_buffers
    }

    fn barrier(&self) -> CommResult<()> {
        self.flag_failure(self.barrier_op("barrier"))
    }
}
