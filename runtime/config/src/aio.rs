//! `aio`: how NVMe swap files are read and written.
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::Section;

#[derive(Debug, Clone, PartialEq, Serialize)]
/// The `aio` section: the NVMe swapper's I/O.
pub struct AioConfig {
    /// Bytes per I/O request; a multiple of 4096 so O_DIRECT accepts it.
    pub block_size: u64,
    /// Requests in flight per I/O thread.
    pub queue_depth: u64,
    /// I/O threads per swap operation (old name: thread_count).
    pub intra_op_parallelism: u64,
    /// `single_submit` (noticed when true).
    pub single_submit: bool,
    /// `overlap_events` (noticed when false).
    pub overlap_events: bool,
    /// `use_gds` (refused when true).
    pub use_gds: bool,
}

impl AioConfig {
    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let block_size = s.uint("block_size", 1_048_576)?;
        let queue_depth = s.uint("queue_depth", 8)?;
        let intra = s.take_aliased(&["intra_op_parallelism", "thread_count"])?;
        let intra_op_parallelism = match intra {
            None => 1,
            Some((key, v)) => v.as_u64().ok_or_else(|| ConfigError::Type {
                path: s.path_of(key),
                expected: "a non-negative integer",
                got: super::reader::describe(&v),
            })?,
        };
        let c = AioConfig {
            block_size,
            queue_depth,
            intra_op_parallelism,
            single_submit: s.bool("single_submit", false)?,
            overlap_events: s.bool("overlap_events", true)?,
            use_gds: s.bool("use_gds", false)?,
        };
        if c.block_size == 0 || c.block_size % 4096 != 0 {
            return Err(ConfigError::Invalid {
                path: s.path_of("block_size"),
                value: c.block_size.to_string(),
                allowed: "must be a positive multiple of 4096".into(),
            });
        }
        for (key, v) in [("queue_depth", c.queue_depth), ("intra_op_parallelism", c.intra_op_parallelism)] {
            if v == 0 {
                return Err(ConfigError::Invalid {
                    path: s.path_of(key),
                    value: "0".into(),
                    allowed: "must be >= 1".into(),
                });
            }
        }
        if c.use_gds {
            return Err(ConfigError::Invalid {
                path: s.path_of("use_gds"),
                value: "true".into(),
                allowed: "GPUDirect Storage is not supported by zerorun; set it to false".into(),
            });
        }
        s.finish()?;
        Ok(c)
    }
}
