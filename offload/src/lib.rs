//! zerorun-offload: host and NVMe tiers for flat shards.
//!
//! - [`HostBuffer`] / [`BufferPool`]: page-aligned host memory, as O_DIRECT needs, reused across steps.
//! - [`SwapFile`] and [`io`]: O_DIRECT positioned I/O in parallel blocks (`aio` settings), buffered where the
//!   filesystem refuses O_DIRECT.
//! - [`Swapper`]: asynchronous swap in / swap out by key, so I/O overlaps compute.
//! - [`preflight`]: the swap folder is checked for existence, write access and room before the first step.
mod buffer;
mod error;
pub mod io;
mod pool;
pub mod preflight;
mod swap_file;
mod swapper;

pub use buffer::{HostBuffer, PAGE};
pub use error::{OffloadError, Result};
pub use io::IoConfig;
pub use pool::BufferPool;
pub use swap_file::SwapFile;
pub use swapper::{SwapHandle, Swapper};
