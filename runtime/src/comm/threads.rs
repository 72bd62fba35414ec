//! Ranks as threads of one process: buffers are exchanged by address between barrier phases.
//!
//! Each collective is three steps: every rank publishes its buffer's address, waits until all have (phase A),
//! reads what it needs from the others, waits until all have read (phase B), then returns. Writes go only to a
//! rank's own buffer, or to a part of another's that only this rank produces, so no two threads race.
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{reduce_into, CommError, CommResult, Communicator, ReduceOp};

struct State {
    /// Barrier generation and arrivals in the current one.
    generation: u64,
    arrived: Vec<bool>,
    /// Ranks whose communicator was dropped (thread finished or panicked).
    departed: Vec<bool>,
    /// Published buffers: (address, length) per rank.
    slots: Vec<(usize, usize)>,
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
}

/// Creates the handles of a group of `world_size` thread ranks; give one to each thread.
pub fn group(world_size: usize, timeout: Duration) -> Vec<ThreadComm> {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            generation: 0,
            arrived: vec![false; world_size],
            departed: vec![false; world_size],
            slots: vec![(0, 0); world_size],
        }),
        cv: Condvar::new(),
        timeout,
    });
    (0..world_size).map(|rank| ThreadComm { rank, world_size, shared: shared.clone() }).collect()
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let mut s = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        s.departed[self.rank] = true;
        self.shared.cv.notify_all();
    }
}

impl ThreadComm {
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
            let (guard, _) = self.shared.cv.wait_timeout(s, (self.shared.timeout - waited).min(Duration::from_millis(200))).unwrap_or_else(|p| p.into_inner());
            s = guard;
        }
    }

    /// Publishes (addr, len), waits for all, and returns every rank's slot.
    fn exchange(&self, op: &'static str, addr: usize, len: usize) -> CommResult<Vec<(usize, usize)>> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner()).slots[self.rank] = (addr, len);
        self.barrier_op(op)?;
        let slots = self.shared.state.lock().unwrap_or_else(|p| p.into_inner()).slots.clone();
        Ok(slots)
    }

    fn check_sizes(&self, op: &'static str, slots: &[(usize, usize)]) -> CommResult<()> {
        if slots.iter().any(|s| s.1 != slots[0].1) {
            // Every rank sees the same slots, so all return this error together; the closing barrier keeps
            // them in step for the next call.
            let sizes = slots.iter().map(|s| s.1).collect();
            self.barrier_op(op)?;
            return Err(CommError::SizeMismatch { op, rank: self.rank, sizes });
        }
        Ok(())
    }

    /// SAFETY: a published slot stays valid until the closing barrier of the same collective.
    unsafe fn view<'a>(slot: (usize, usize)) -> &'a [f32] {
        if slot.1 == 0 {
            return &[];
        }
        std::slice::from_raw_parts(slot.0 as *const f32, slot.1)
    }

    fn check_parts(&self, op: &'static str, len: usize) -> CommResult<usize> {
        if len % self.world_size != 0 {
            return Err(CommError::BadArgument { op, rank: self.rank, what: format!("{len} elements do not split into {} equal parts", self.world_size) });
        }
        Ok(len / self.world_size)
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> CommResult<()> {
        const OP: &str = "all_reduce";
        let slots = self.exchange(OP, buf.as_mut_ptr() as usize, buf.len())?;
        self.check_sizes(OP, &slots)?;
        // Rank r combines segment r into a private buffer, then (after everyone has read) writes it everywhere.
        let n = buf.len();
        let seg = |r: usize| (n * r / self.world_size)..(n * (r + 1) / self.world_size);
        let mine = seg(self.rank);
        let mut reduced = vec![0f32; mine.len()];
        if !reduced.is_empty() {
            let parts: Vec<&[f32]> = slots.iter().map(|s| unsafe { &Self::view(*s)[mine.clone()] }).collect();
            reduce_into(&mut reduced, &parts, op);
        }
        self.barrier_op(OP)?;
        for s in &slots {
            // SAFETY: segment `mine` of every buffer is written by this rank only, between the two barriers.
            let dst = unsafe { std::slice::from_raw_parts_mut((s.0 as *mut f32).add(mine.start), mine.len()) };
            if !dst.is_empty() {
                dst.copy_from_slice(&reduced);
            }
        }
        self.barrier_op(OP)
    }

    fn reduce_scatter(&self, input: &[f32], output: &mut [f32], op: ReduceOp) -> CommResult<()> {
        const OP: &str = "reduce_scatter";
        let part = self.check_parts(OP, input.len())?;
        if output.len() != part {
            return Err(CommError::BadArgument { op: OP, rank: self.rank, what: format!("output has {} elements, expected {part}", output.len()) });
        }
        let slots = self.exchange(OP, input.as_ptr() as usize, input.len())?;
        self.check_sizes(OP, &slots)?;
        let r = self.rank * part..(self.rank + 1) * part;
        if part > 0 {
            let parts: Vec<&[f32]> = slots.iter().map(|s| unsafe { &Self::view(*s)[r.clone()] }).collect();
            reduce_into(output, &parts, op);
        }
        self.barrier_op(OP)
    }

    fn all_gather_in_place(&self, buf: &mut [f32]) -> CommResult<()> {
        const OP: &str = "all_gather";
        let part = self.check_parts(OP, buf.len())?;
        let slots = self.exchange(OP, buf.as_mut_ptr() as usize, buf.len())?;
        self.check_sizes(OP, &slots)?;
        for (k, s) in slots.iter().enumerate() {
            if k != self.rank {
                // SAFETY: part k of rank k's buffer is written by nobody during this collective.
                let src = unsafe { &Self::view(*s)[k * part..(k + 1) * part] };
                buf[k * part..(k + 1) * part].copy_from_slice(src);
            }
        }
        self.barrier_op(OP)
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> CommResult<()> {
        const OP: &str = "broadcast";
        if root >= self.world_size {
            return Err(CommError::BadArgument { op: OP, rank: self.rank, what: format!("root {root} is not a rank of {}", self.world_size) });
        }
        let slots = self.exchange(OP, buf.as_mut_ptr() as usize, buf.len())?;
        self.check_sizes(OP, &slots)?;
        if self.rank != root {
            buf.copy_from_slice(unsafe { Self::view(slots[root]) });
        }
        self.barrier_op(OP)
    }

    fn barrier(&self) -> CommResult<()> {
        self.barrier_op("barrier")
    }
}
