//! zerorun-offload: host and NVMe tiers for flat shards.
//!
//! What is here so far: page-aligned host buffers (what O_DIRECT reads and writes need) and a pool that reuses
//! them, so the swapper of the NVMe tier does not allocate in the training loop. Swap files, the asynchronous
//! swapper and the preflight checks build on these.
mod buffer;
mod pool;

pub use buffer::{HostBuffer, PAGE};
pub use pool::BufferPool;
