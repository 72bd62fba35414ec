//! The job's shared-memory segment (memmap2 over /dev/shm): its layout, the rendezvous that creates and attaches
//! it, and the barrier ranks meet at, which never waits on a dead rank.
//!
//! Layout: a header (magic, world size, slot size, an attach count, and per rank a block of words: arrival counter,
//! pid, the current collective's op, length, element type and buffer address, and flags), then one staging slot per
//! rank and one result slot.
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

use super::super::agreement::{self, Call};
use super::super::rank_info::RankInfo;
use super::super::{CommError, CommResult, Dtype};

const MAGIC: u64 = 0x5a45_524f_5255_4e31; // "ZERORUN1"
const HEADER: usize = 64 * 1024;
const RANK_BLOCK: usize = 256;
const RANKS_AT: usize = 256;
const MAX_RANKS: usize = (HEADER - RANKS_AT) / RANK_BLOCK;
/// Bytes per staging slot: large enough that barriers cost little next to the copies.
pub(super) const SLOT_BYTES: usize = 16 << 20;

// Header words.
const W_MAGIC: usize = 0;
const W_WORLD: usize = 1;
const W_SLOT: usize = 2;
const W_ATTACHED: usize = 3;
// Per-rank words.
const R_ARRIVE: usize = 0;
pub(super) const R_PID: usize = 1;
const R_OP: usize = 2;
const R_LEN: usize = 3;
/// Address of the rank's buffer in the current collective (for direct reads).
pub(super) const R_ADDR: usize = 4;
/// Result of the direct-read probe: 1 = could read every peer, 2 = could not.
pub(super) const R_DIRECT: usize = 5;
/// Element type of the current collective.
const R_DTYPE: usize = 6;
/// Set when this rank saw a peer die: if it exits too, others name the first death, not this rank.
const R_FAILED: usize = 7;
/// This rank's shared buffer region (region/), for peers to map: fd number, base address, length (0: none).
pub(super) const R_REGION_FD: usize = 8;
pub(super) const R_REGION_BASE: usize = 9;
pub(super) const R_REGION_LEN: usize = 10;
/// Result of mapping every peer's region: 1 = all mapped, 2 = not.
pub(super) const R_REGION_OK: usize = 11;
/// Point-to-point (p2p.rs), in the sender's block: destination + 1 of the current send (0: none), its number,
/// length, element type code and address, staged chunks written; the receiver's answer, chunks it consumed, and
/// its own length and type code when it refused.
pub(super) const R_P2P_TO: usize = 12;
pub(super) const R_P2P_SEQ: usize = 13;
pub(super) const R_P2P_LEN: usize = 14;
pub(super) const R_P2P_DTYPE: usize = 15;
pub(super) const R_P2P_ADDR: usize = 16;
pub(super) const R_P2P_CHUNKS: usize = 17;
pub(super) const R_P2P_ANSWER: usize = 18;
pub(super) const R_P2P_ACKED: usize = 19;
pub(super) const R_P2P_THEIR_LEN: usize = 20;
pub(super) const R_P2P_THEIR_DTYPE: usize = 21;
/// Set when this rank's segment is dropped (its communicator goes: the program ended or gave up): a peer that finds
/// its process gone says it exited rather than died.
const R_EXITED: usize = 22;

/// One wait of a polling loop. Peers of one collective arrive within microseconds of each other: spin, then yield
/// (which hands the core to any other runnable rank on an oversubscribed host), and only sleep (whose wake-up costs
/// 50-100 us, more than a whole 1 MiB collective) once the wait is clearly long.
fn pause(spins: u32, waited: Duration) {
    if spins < 64 {
        std::hint::spin_loop();
    } else if waited < Duration::from_millis(2) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// `/dev/shm/zerorun-<run id>` with anything but letters, digits, '-' and '.' replaced.
pub fn segment_path(run_id: &str) -> PathBuf {
    let clean: String =
        run_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' }).collect();
    PathBuf::from(format!("/dev/shm/zerorun-{clean}"))
}

/// One rank's mapping of the segment, and its place in the group's barriers.
pub(super) struct Segment {
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) group: String,
    map: MmapMut,
    /// Barriers this rank has entered (its arrival counter).
    seq: Cell<u64>,
    timeout: Duration,
}

impl Segment {
    /// Creates (rank 0) or attaches to (other ranks) the job's segment and waits until every rank is there.
    pub(super) fn join(info: &RankInfo, timeout: Duration) -> CommResult<Segment> {
        let (rank, world_size) = (info.rank, info.world_size);
        let path = segment_path(&info.run_id);
        let place = path.display().to_string();
        let fail = |what: String| CommError::Rendezvous { rank, world_size, place: place.clone(), what };
        if world_size > MAX_RANKS {
            return Err(fail(format!("at most {MAX_RANKS} ranks per host")));
        }
        let total = HEADER + (world_size + 1) * SLOT_BYTES;
        let start = Instant::now();
        if rank == 0 {
            // Written under a temporary name and renamed, so no rank ever maps a half-initialised segment.
            let tmp = PathBuf::from(format!("{}.tmp-{}", path.display(), std::process::id()));
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)
                .map_err(|e| fail(format!("create: {e}")))?;
            file.set_len(total as u64).map_err(|e| fail(format!("size {total} bytes: {e}")))?;
            // SAFETY: the file is ours and stays mapped for the life of the communicator.
            let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| fail(format!("mmap: {e}")))?;
            let s = Segment::with_map(info, map, timeout);
            s.word(W_WORLD).store(world_size as u64, Ordering::Relaxed);
            s.word(W_SLOT).store(SLOT_BYTES as u64, Ordering::Relaxed);
            s.rank_word(0, R_PID).store(std::process::id() as u64, Ordering::Relaxed);
            s.word(W_MAGIC).store(MAGIC, Ordering::Release);
            std::fs::rename(&tmp, &path).map_err(|e| fail(format!("publish: {e}")))?;
            while s.word(W_ATTACHED).load(Ordering::Acquire) < world_size as u64 - 1 {
                if start.elapsed() > timeout {
                    let _ = std::fs::remove_file(&path);
                    let missing: Vec<usize> =
                        (1..world_size).filter(|&r| s.rank_word(r, R_PID).load(Ordering::Acquire) == 0).collect();
                    return Err(fail(format!("ranks {missing:?} did not attach within {timeout:?} (comms_timeout)")));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            // Every rank has it mapped: unlink now, so nothing outlives the processes.
            std::fs::remove_file(&path).map_err(|e| fail(format!("unlink: {e}")))?;
            s.barrier("rendezvous")?;
            return Ok(s);
        }
        let file = loop {
            match OpenOptions::new().read(true).write(true).open(&path) {
                Ok(f) if f.metadata().map(|m| m.len() as usize == total).unwrap_or(false) => break f,
                Ok(f) => {
                    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                    if len as usize != total && len != 0 {
                        return Err(fail(format!(
                            "segment has {len} bytes, expected {total}: is WORLD_SIZE the same on every rank?"
                        )));
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
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| fail(format!("mmap: {e}")))?;
        let s = Segment::with_map(info, map, timeout);
        if s.word(W_MAGIC).load(Ordering::Acquire) != MAGIC
            || s.word(W_WORLD).load(Ordering::Relaxed) != world_size as u64
        {
            return Err(fail("the segment belongs to another job (magic or world size differ)".into()));
        }
        s.rank_word(rank, R_PID).store(std::process::id() as u64, Ordering::Relaxed);
        s.word(W_ATTACHED).fetch_add(1, Ordering::AcqRel);
        s.barrier("rendezvous")?;
        Ok(s)
    }

    fn with_map(info: &RankInfo, map: MmapMut, timeout: Duration) -> Segment {
        Segment {
            rank: info.rank,
            world_size: info.world_size,
            group: info.run_id.clone(),
            map,
            seq: Cell::new(0),
            timeout,
        }
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the header is inside the mapping, 8-byte aligned, and only accessed atomically.
        unsafe { &*(self.map.as_ptr().add(i * 8) as *const AtomicU64) }
    }

    /// Word `i` of rank `rank`'s block.
    pub(super) fn rank_word(&self, rank: usize, i: usize) -> &AtomicU64 {
        // SAFETY: as above.
        unsafe { &*(self.map.as_ptr().add(RANKS_AT + rank * RANK_BLOCK + i * 8) as *const AtomicU64) }
    }

    /// Rank `k`'s pid.
    pub(super) fn pid(&self, k: usize) -> u32 {
        self.rank_word(k, R_PID).load(Ordering::Acquire) as u32
    }

    /// Slot `k` (k = world_size is the result slot). Writers and readers are kept apart by barriers.
    #[allow(clippy::mut_from_ref)]
    pub(super) fn slot(&self, k: usize) -> &mut [u8] {
        // SAFETY: slots are disjoint regions of the mapping, 64 KiB aligned; who writes what between which
        // barriers is fixed by each collective.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr().add(HEADER + k * SLOT_BYTES) as *mut u8, SLOT_BYTES) }
    }

    /// Waits until every rank has arrived here, or fails naming the rank that died or the ranks missing at the
    /// timeout.
    pub(super) fn barrier(&self, op: &'static str) -> CommResult<()> {
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
            pause(spins, waited);
            if waited >= next_check {
                next_check = waited + Duration::from_millis(50);
                // A rank that did not arrive is gone: name the rank that died first, which may be one that arrived
                // and died afterwards (the missing rank saw it die, flagged itself and left).
                if let Some(k) = self
                    .first_death(|k| self.rank_word(k, R_ARRIVE).load(Ordering::Acquire) < target)
                    .and_then(|_| self.first_death(|_| true))
                {
                    return Err(CommError::PeerDied {
                        op,
                        rank: self.rank,
                        group: self.group.clone(),
                        dead: k,
                        pid: self.pid(k),
                        waited,
                        exited: self.exited(k),
                    });
                }
                if waited >= self.timeout {
                    let missing = (0..self.world_size)
                        .filter(|&k| self.rank_word(k, R_ARRIVE).load(Ordering::Acquire) < target)
                        .collect();
                    return Err(CommError::Timeout { op, rank: self.rank, missing, waited });
                }
            }
        }
    }

    /// Waits until `ready` holds, for `op` with rank `peer`: fails when the peer dies or `comms_timeout` passes.
    pub(super) fn wait_for_peer(&self, op: &'static str, peer: usize, ready: impl Fn() -> bool) -> CommResult<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        let mut next_check = Duration::from_millis(50);
        loop {
            if ready() {
                return Ok(());
            }
            spins += 1;
            let waited = start.elapsed();
            pause(spins, waited);
            if waited >= next_check {
                next_check = waited + Duration::from_millis(50);
                if !Self::alive(self.rank_word(peer, R_PID).load(Ordering::Acquire)) {
                    let mut e = self.peer_died(op, peer);
                    if let CommError::PeerDied { waited: w, .. } = &mut e {
                        *w = waited;
                    }
                    return Err(e);
                }
                if waited >= self.timeout {
                    return Err(CommError::Timeout { op, rank: self.rank, missing: vec![peer], waited });
                }
            }
        }
    }

    /// Publishes (op, length, element type, address) and checks after a barrier that every rank called the same
    /// collective with the same size and type.
    pub(super) fn handshake(&self, op: &'static str, len: usize, dtype: Dtype, addr: *const u8) -> CommResult<()> {
        self.rank_word(self.rank, R_ADDR).store(addr as u64, Ordering::Relaxed);
        let [c, l, d] = Call::new(op, len, dtype).words();
        self.rank_word(self.rank, R_OP).store(c, Ordering::Relaxed);
        self.rank_word(self.rank, R_LEN).store(l, Ordering::Relaxed);
        self.rank_word(self.rank, R_DTYPE).store(d, Ordering::Relaxed);
        self.barrier(op)?;
        let word = |k: usize, w: usize| self.rank_word(k, w).load(Ordering::Relaxed);
        let calls: Vec<Call> = (0..self.world_size)
            .map(|k| Call::from_words(&[word(k, R_OP), word(k, R_LEN), word(k, R_DTYPE)]))
            .collect();
        let result = agreement::check(op, self.rank, &calls);
        // Nobody rewrites its words before everyone has read them.
        self.barrier(op)?;
        result
    }

    /// The error for a peer found gone in `op` (rank `k`, or the rank whose death made it leave).
    pub(super) fn peer_died(&self, op: &'static str, k: usize) -> CommError {
        let dead = self.first_death(|_| true).unwrap_or(k);
        CommError::PeerDied {
            op,
            rank: self.rank,
            group: self.group.clone(),
            dead,
            pid: self.pid(dead),
            waited: Duration::ZERO,
            exited: self.exited(dead),
        }
    }

    /// Whether rank `k` dropped its segment (left cleanly) rather than being killed.
    fn exited(&self, k: usize) -> bool {
        self.rank_word(k, R_EXITED).load(Ordering::Acquire) != 0
    }

    fn alive(pid: u64) -> bool {
        if pid == 0 {
            return true;
        }
        // SAFETY: signal 0 only checks that the process exists.
        let exists = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
        // A killed rank its parent has not reaped yet is a zombie: dead, though signal 0 still finds it.
        exists
            && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
    }

    /// Among the ranks that are gone and satisfy `candidate`, the one that died first: a rank that left after
    /// seeing another die flagged itself, so an unflagged one is the cause.
    fn first_death(&self, candidate: impl Fn(usize) -> bool) -> Option<usize> {
        let dead: Vec<usize> = (0..self.world_size)
            .filter(|&k| {
                k != self.rank && candidate(k) && !Self::alive(self.rank_word(k, R_PID).load(Ordering::Acquire))
            })
            .collect();
        dead.iter()
            .copied()
            .find(|&k| self.rank_word(k, R_FAILED).load(Ordering::Acquire) == 0)
            .or(dead.first().copied())
    }

    /// Flags this rank as failed when `r` is an error, so that if it exits, peers name the rank whose death
    /// started it rather than this one.
    pub(super) fn flag_failure<T>(&self, r: CommResult<T>) -> CommResult<T> {
        if r.is_err() {
            self.rank_word(self.rank, R_FAILED).store(1, Ordering::Release);
        }
        r
    }
}

impl Drop for Segment {
    /// Leaving cleanly: a peer that finds this process gone says it exited, not died.
    fn drop(&mut self) {
        self.rank_word(self.rank, R_EXITED).store(1, Ordering::Release);
    }
}
