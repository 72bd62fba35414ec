//! Parallel block I/O on a swap file: a request is cut into `block_size` blocks written or read with positioned
//! I/O by `intra_op_parallelism x queue_depth` workers, each with one blocking request in flight, so the device
//! sees `queue_depth` requests per I/O thread as with libaio. Blocking pread/pwrite on O_DIRECT files keeps an NVMe
//! queue busy without libaio; `single_submit` and `overlap_events` are libaio submission details with no
//! counterpart here and are accepted as is.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::{OffloadError, Result};
use crate::swap_file::SwapFile;

/// The `aio` section of ds_config, as the I/O engine uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoConfig {
    /// Bytes per request (a multiple of 4 KiB).
    pub block_size: usize,
    /// Requests in flight per I/O thread.
    pub queue_depth: usize,
    /// I/O threads per operation.
    pub intra_op_parallelism: usize,
}

impl Default for IoConfig {
    /// DeepSpeed's `aio` defaults.
    fn default() -> Self {
        IoConfig { block_size: 1 << 20, queue_depth: 8, intra_op_parallelism: 1 }
    }
}

impl IoConfig {
    /// Workers issuing blocking requests: `queue_depth` per I/O thread, at most 64.
    pub fn workers(&self) -> usize {
        (self.queue_depth.max(1) * self.intra_op_parallelism.max(1)).clamp(1, 64)
    }

    fn block(&self) -> usize {
        (self.block_size.max(4096) / 4096) * 4096
    }
}

fn run_blocks(cfg: &IoConfig, len: usize, op: impl Fn(std::ops::Range<usize>) -> Result<()> + Sync) -> Result<()> {
    let block = cfg.block();
    let blocks = len.div_ceil(block);
    if blocks <= 1 {
        return op(0..len);
    }
    let next = AtomicUsize::new(0);
    let first_error: Mutex<Option<OffloadError>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..cfg.workers().min(blocks) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= blocks || first_error.lock().map(|e| e.is_some()).unwrap_or(true) {
                    break;
                }
                let r = i * block..((i + 1) * block).min(len);
                if let Err(e) = op(r) {
                    first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                    break;
                }
            });
        }
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Writes `buf` at `offset` of `file` in parallel blocks. `buf` and `offset` must be 4 KiB aligned for O_DIRECT.
pub fn write(cfg: &IoConfig, file: &SwapFile, offset: u64, buf: &[u8]) -> Result<()> {
    let f = file.open_for(true)?;
    let ptr = buf.as_ptr() as usize;
    run_blocks(cfg, buf.len(), |r| {
        // SAFETY: blocks are disjoint sub-ranges of `buf`, which outlives the scope.
        let part = unsafe { std::slice::from_raw_parts((ptr + r.start) as *const u8, r.len()) };
        file.write_at(&f, offset + r.start as u64, part)
    })?;
    if !file.is_direct() {
        file.sync(&f)?;
    }
    Ok(())
}

/// Reads `buf.len()` bytes at `offset` of `file` in parallel blocks.
pub fn read(cfg: &IoConfig, file: &SwapFile, offset: u64, buf: &mut [u8]) -> Result<()> {
    let f = file.open_for(false)?;
    let ptr = buf.as_mut_ptr() as usize;
    run_blocks(cfg, buf.len(), |r| {
        // SAFETY: blocks are disjoint sub-ranges of `buf`, each written by one thread.
        let part = unsafe { std::slice::from_raw_parts_mut((ptr + r.start) as *mut u8, r.len()) };
        file.read_at(&f, offset + r.start as u64, part)
    })
}
