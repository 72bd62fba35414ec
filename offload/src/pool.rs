//! `BufferPool`: hands out page-aligned buffers and takes them back for reuse, bounded in bytes kept idle.
use std::sync::Mutex;

use crate::buffer::HostBuffer;

/// Aligned host buffers kept for reuse, up to a byte budget, so a swap does not allocate each time.
pub struct BufferPool {
    idle: Mutex<Vec<HostBuffer>>,
    /// Idle bytes kept for reuse; buffers returned beyond this are freed.
    max_idle_bytes: usize,
}

impl BufferPool {
    /// A pool that keeps at most `max_idle_bytes` of idle buffers.
    pub fn new(max_idle_bytes: usize) -> BufferPool {
        BufferPool { idle: Mutex::new(Vec::new()), max_idle_bytes }
    }

    /// A buffer of at least `bytes`: the smallest idle one that fits, else a new one. Reused buffers keep their
    /// old contents (callers overwrite what they read).
    pub fn take(&self, bytes: usize) -> HostBuffer {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let best = idle
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= bytes)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => idle.swap_remove(i),
            None => HostBuffer::new(bytes),
        }
    }

    /// Returns a buffer for reuse (freed if the pool is full).
    pub fn give_back(&self, buffer: HostBuffer) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let held: usize = idle.iter().map(HostBuffer::capacity).sum();
        if held + buffer.capacity() <= self.max_idle_bytes {
            idle.push(buffer);
        }
    }

    /// Bytes held idle.
    pub fn idle_bytes(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).iter().map(HostBuffer::capacity).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PAGE;

    #[test]
    fn buffers_are_page_aligned_and_reused() {
        let b = HostBuffer::new(5000);
        assert_eq!(b.capacity(), 2 * PAGE);
        assert_eq!(b.as_slice().as_ptr() as usize % PAGE, 0);
        assert!(b.as_slice().iter().all(|x| *x == 0));
        let pool = BufferPool::new(3 * PAGE);
        let p = b.as_slice().as_ptr();
        pool.give_back(b);
        assert_eq!(pool.idle_bytes(), 2 * PAGE);
        // A request that fits reuses the idle buffer; a larger one allocates.
        let again = pool.take(100);
        assert_eq!(again.as_slice().as_ptr(), p);
        let big = pool.take(10 * PAGE);
        assert_eq!(big.capacity(), 10 * PAGE);
        // Beyond the idle bound, returned buffers are freed.
        pool.give_back(big);
        assert_eq!(pool.idle_bytes(), 0);
        pool.give_back(again);
        assert_eq!(pool.idle_bytes(), 2 * PAGE);
        assert_eq!(HostBuffer::new(0).capacity(), PAGE);
    }
}
