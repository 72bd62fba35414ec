//! zerorun-offload: host and NVMe tiers for flat shards.
//!
//! - [`HostBuffer`] / [`BufferPool`]: page-aligned host memory, as O_DIRECT needs, reused across steps.
//! - [`SwapFile`] and [`io`]: O_DIRECT positioned I/O in parallel blocks (`aio` settings), buffered where the
//!   filesystem refuses O_DIRECT.
//! - [`Swapper`]: asynchronous swap in / swap out by key, so I/O overlaps compute.
//! - [`preflight`]: the swap folder is checked for existence, write access and room before the first step.
//! - [`OptimizerTier`]: an optimizer's states in memory ([`InMemory`]) or on NVMe by sub-group
//!   ([`SwappedOptimizer`]), one interface for the engine.
#![warn(missing_docs)]
mod buffer;
mod error;
pub mod io;
mod optimizer_tier;
mod pool;
pub mod preflight;
mod swap_file;
mod swapped_optimizer;
mod swapper;

pub use buffer::{HostBuffer, PAGE};
pub use error::{OffloadError, Result};
pub use io::IoConfig;
pub use optimizer_tier::{FillState, InMemory, OptimizerTier, TierError};
pub use pool::BufferPool;
pub use swap_file::SwapFile;
pub use swapped_optimizer::SwappedOptimizer;
pub use swapper::{SwapHandle, Swapper};
