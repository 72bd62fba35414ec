//! Ranks as threads of one process: buffers are exchanged by address between barrier phases.
//!
//! Each collective is three steps: every rank publishes its buffer's address, waits until all have (phase A),
//! reads what it needs from the others, waits until all have read (phase B), then returns. Writes go only to a
//! rank's own buffer, or to a part of another's that only this rank produces, so no two threads race.
//!
//! A send posts its buffer's address for the receiver and waits until the receiver has copied it (or refused it
//! for a size or type mismatch); a split's groups are made by their members through the parent's state.
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::agreement::{self, Call};
use super::groups::{self, Split};
use super::{reduce_into, BufMut, BufRef, CommError, CommResult, Communicator, Dtype, ReduceOp};

struct State {
    /// Barrier generation and arrivals in the current one.
    generation: u64,
    arrived: Vec<bool>,
    /// Ranks whose communicator was dropped (thread finished or panicked).
    departed: Vec<bool>,
    /// Published buffers: (address, bytes, element type) per rank, and each rank's call.
    slots: Vec<(usize, usize, Dtype)>,
    calls: Vec<Call>,
    /// Groups being made by a split, by (split id, color), until every member has taken its handle.
    forming: HashMap<(u64, u32), Arc<Shared>>,
    /// Sends waiting for their receive, by (source, destination).
    posts: HashMap<(usize, usize), Post>,
}

/// A posted send: the sender's buffer, and the receiver's answer once it copied it (Ok) or refused it (its own
/// length and type).
struct Post {
    addr: usize,
    len: usize,
    dtype: Dtype,
    answer: Option<Result<(), (usize, Dtype)>>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    timeout: Duration,
}

/// One rank's handle on a threads group.
pub struct ThreadComm {
    rank: usize,
    world_size: usize,
    shared: Arc<Shared>,
    /// All-reduce's reduced chunk, reused (u64 words keep every element type aligned).
    scratch: RefCell<Vec<u64>>,
}

/// Bytes an all-reduce combines at a time (whole elements of every type): the chunk stays in L2 while it is copied
/// to every rank.
const REDUCE_CHUNK: usize = 256 * 1024;

/// Creates the handles of a group of `world_size` thread ranks; give one to each thread.
pub fn group(world_size: usize, timeout: Duration) -> Vec<ThreadComm> {
    let shared = new_shared(world_size, timeout);
    (0..world_size).map(|rank| ThreadComm::with(rank, world_size, shared.clone())).collect()
}

fn new_shared(world_size: usize, timeout: Duration) -> Arc<Shared> {
    Arc::new(Shared {
        state: Mutex::new(State {
            generation: 0,
            arrived: vec![false; world_size],
            departed: vec![false; world_size],
            slots: vec![(0, 0, Dtype::F32); world_size],
            calls: vec![Call::new("barrier", 0, Dtype::F32); world_size],
            forming: HashMap::new(),
            posts: HashMap::new(),
        }),
        cv: Condvar::new(),
        timeout,
    })
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let mut s = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        s.departed[self.rank] = true;
        self.shared.cv.notify_all();
    }
}

impl ThreadComm {
    fn with(rank: usize, world_size: usize, shared: Arc<Shared>) -> ThreadComm {
        ThreadComm { rank, world_size, shared, scratch: RefCell::new(Vec::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on the condition variable until `ready` gives a result, `peer` departs or the timeout passes.
    fn wait_for<T>(
        &self,
        op: &'static str,
        peer: usize,
        mut ready: impl FnMut(&mut State) -> Option<T>,
        mut give_up: impl FnMut(&mut State),
    ) -> CommResult<T> {
        let start = Instant::now();
        let mut st = self.lock();
        loop {
            if let Some(out) = ready(&mut st) {
                return Ok(out);
            }
            let waited = start.elapsed();
            if st.departed[peer] {
                give_up(&mut st);
                return Err(CommError::PeerGone { op, rank: self.rank, dead: peer, waited });
            }
            if waited >= self.shared.timeout {
                give_up(&mut st);
                return Err(CommError::Timeout { op, rank: self.rank, missing: vec![peer], waited });
            }
            let step = (self.shared.timeout - waited).min(Duration::from_millis(200));
            st = self.shared.cv.wait_timeout(st, step).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Waits until every rank has arrived; a departed rank or the timeout ends the wait with an error.
    fn barrier_op(&self, op: &'static str) -> CommResult<()> {
        let start = Instant::now();
        let mut s = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        let generation = s.generation;
        s.arrived[self.rank] = true;
        if s.arrived.iter().all(|a| *a) {
            s.arrived.iter_mut().for_each(|a| *a = false);
            s.generation += 1;
            self.shared.cv.notify_all();
            return Ok(());
        }
        loop {
            let waited = start.elapsed();
            if s.generation != generation {
                return Ok(());
            }
            if let Some(dead) = (0..self.world_size).find(|&r| s.departed[r] && !s.arrived[r]) {
                return Err(CommError::PeerGone { op, rank: self.rank, dead, waited });
            }
            if waited >= self.shared.timeout {
                let missing = (0..self.world_size).filter(|&r| !s.arrived[r]).collect();
                return Err(CommError::Timeout { op, rank: self.rank, missing, waited });
            }
            let (guard, _) = self
                .shared
                .cv
                .wait_timeout(s, (self.shared.timeout - waited).min(Duration::from_millis(200)))
                .unwrap_or_else(|p| p.into_inner());
            s = guard;
        }
    }

    /// Publishes (address, bytes, dtype), waits for all, checks that every rank passed the same size and type,
    /// and returns every rank's slot.
    fn exchange(
        &self,
        op: &'static str,
        addr: usize,
        bytes: usize,
        dtype: Dtype,
    ) -> CommResult<Vec<(usize, usize, Dtype)>> {
        {
            let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
            st.slots[self.rank] = (addr, bytes, dtype);
            st.calls[self.rank] = Call::new(op, bytes / dtype.size(), dtype);
        }
        self.barrier_op(op)?;
        let (slots, calls) = {
            let st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
            (st.slots.clone(), st.calls.clone())
        };
        if let Err(e) = agreement::check(op, self.rank, &calls) {
            // Every rank sees the same calls, so all return this error together; the closing barrier keeps them
            // in step for the next call.
            self.barrier_op(op)?;
            return Err(e);
        }
        Ok(slots)
    }

    /// SAFETY: a published slot stays valid until the closing barrier of the same collective.
    unsafe fn view<'a>(slot: (usize, usize, Dtype)) -> &'a [u8] {
        if slot.1 == 0 {
            return &[];
        }
        std::slice::from_raw_parts(slot.0 as *const u8, slot.1)
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn window(&self, local: &mut [u8]) -> CommResult<Option<Vec<usize>>> {
        // One address space: every rank's address is valid here as it is.
        let mut addrs = vec![0i64; self.world_size];
        addrs[self.rank] = local.as_mut_ptr() as i64;
        super::Collectives::all_gather_in_place(self, &mut addrs)?;
        Ok(Some(addrs.into_iter().map(|a| a as usize).collect()))
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        const OP: &str = "all_reduce";
        let (es, n) = (buf.dtype.size(), buf.len());
        let slots = self.exchange(OP, buf.bytes.as_mut_ptr() as usize, buf.bytes.len(), buf.dtype)?;
        // Rank r alone reads and writes segment r of every buffer: it combines the segment chunk by chunk and
        // writes each chunk into every buffer at once.
        let mine = (n * self.rank / self.world_size * es)..(n * (self.rank + 1) / self.world_size * es);
        let mut scratch = self.scratch.borrow_mut();
        scratch.resize(REDUCE_CHUNK / 8, 0);
        let reduced = bytemuck::cast_slice_mut::<u64, u8>(&mut scratch);
        for a in (mine.start..mine.end).step_by(REDUCE_CHUNK) {
            let b = (a + REDUCE_CHUNK).min(mine.end);
            // SAFETY: published slots stay valid until the closing barrier; segment `mine` is this rank's alone.
            let parts: Vec<&[u8]> = slots.iter().map(|s| unsafe { &Self::view(*s)[a..b] }).collect();
            reduce_into(buf.dtype, &mut reduced[..b - a], &parts, op);
            for s in &slots {
                // SAFETY: as above; the chunk was read into `reduced` before any buffer's copy of it is written.
                unsafe { std::ptr::copy_nonoverlapping(reduced.as_ptr(), (s.0 as *mut u8).add(a), b - a) };
            }
        }
        self.barrier_op(OP)
    }

    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        const OP: &str = "reduce_scatter";
        let part = agreement::scatter_output(OP, self.rank, self.world_size, &input, &output)?;
        let slots = self.exchange(OP, input.bytes.as_ptr() as usize, input.bytes.len(), input.dtype)?;
        let pb = part * input.dtype.size();
        let r = self.rank * pb..(self.rank + 1) * pb;
        let parts: Vec<&[u8]> = slots.iter().map(|s| unsafe { &Self::view(*s)[r.clone()] }).collect();
        reduce_into(input.dtype, output.bytes, &parts, op);
        self.barrier_op(OP)
    }

    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        const OP: &str = "all_gather";
        let pb = agreement::equal_parts(OP, self.rank, self.world_size, buf.len())? * buf.dtype.size();
        let slots = self.exchange(OP, buf.bytes.as_mut_ptr() as usize, buf.bytes.len(), buf.dtype)?;
        for (k, s) in slots.iter().enumerate() {
            if k != self.rank {
                // SAFETY: part k of rank k's buffer is written by nobody during this collective.
                let src = unsafe { &Self::view(*s)[k * pb..(k + 1) * pb] };
                buf.bytes[k * pb..(k + 1) * pb].copy_from_slice(src);
            }
        }
        self.barrier_op(OP)
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        const OP: &str = "broadcast";
        agreement::root(OP, self.rank, self.world_size, root)?;
        let slots = self.exchange(OP, buf.bytes.as_mut_ptr() as usize, buf.bytes.len(), buf.dtype)?;
        if self.rank != root {
            buf.bytes.copy_from_slice(unsafe { Self::view(slots[root]) });
        }
        self.barrier_op(OP)
    }

    fn barrier(&self) -> CommResult<()> {
        self.barrier_op("barrier")
    }

    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        const OP: &str = "send";
        groups::check_peer(OP, self.rank, self.world_size, dst)?;
        let key = (self.rank, dst);
        let post = Post { addr: buf.bytes.as_ptr() as usize, len: buf.len(), dtype: buf.dtype, answer: None };
        self.lock().posts.insert(key, post);
        self.shared.cv.notify_all();
        // The buffer stays borrowed until the receiver answered (or the post is withdrawn below).
        let answer = self.wait_for(
            OP,
            dst,
            |st| match st.posts.get(&key).and_then(|p| p.answer) {
                Some(a) => {
                    st.posts.remove(&key);
                    Some(a)
                }
                None => None,
            },
            |st| {
                st.posts.remove(&key);
            },
        )?;
        answer.map_err(|(len, dtype)| CommError::P2pMismatch {
            op: OP,
            src: self.rank,
            dst,
            sent: (buf.len(), buf.dtype),
            expected: (len, dtype),
        })
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        const OP: &str = "recv";
        groups::check_peer(OP, self.rank, self.world_size, src)?;
        let key = (src, self.rank);
        let (len, dtype) = (buf.len(), buf.dtype);
        let posted = self.wait_for(
            OP,
            src,
            |st| {
                let post = st.posts.get_mut(&key).filter(|p| p.answer.is_none())?;
                if post.len != len || post.dtype != dtype {
                    post.answer = Some(Err((len, dtype)));
                    return Some(Err((post.len, post.dtype)));
                }
                Some(Ok(post.addr))
            },
            |_| {},
        )?;
        let addr = match posted {
            Ok(addr) => addr,
            Err((sent_len, sent_dtype)) => {
                self.shared.cv.notify_all();
                return Err(CommError::P2pMismatch {
                    op: OP,
                    src,
                    dst: self.rank,
                    sent: (sent_len, sent_dtype),
                    expected: (len, dtype),
                });
            }
        };
        if !buf.bytes.is_empty() {
            // SAFETY: the sender keeps its buffer borrowed, unchanged, until this receive answers below.
            let src_bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, buf.bytes.len()) };
            buf.bytes.copy_from_slice(src_bytes);
        }
        if let Some(p) = self.lock().posts.get_mut(&key) {
            p.answer = Some(Ok(()));
        }
        self.shared.cv.notify_all();
        Ok(())
    }

    fn split_group(&self, split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        let taken = split.color(self.rank).map(|c| {
            let mut st = self.lock();
            let shared =
                st.forming.entry((split.id, c)).or_insert_with(|| new_shared(split.members.len(), self.shared.timeout));
            (c, shared.clone())
        });
        // Every member has its handle once all ranks are past this barrier; the first member then tidies up.
        self.barrier_op("split")?;
        Ok(taken.map(|(c, shared)| {
            if split.rank == 0 {
                self.lock().forming.remove(&(split.id, c));
            }
            Box::new(ThreadComm::with(split.rank, split.members.len(), shared)) as Box<dyn Communicator>
        }))
    }
}
