//! The batch rule: train_batch_size = micro batch * gradient accumulation steps * world size,
//! with missing values inferred exactly as DeepSpeed's `runtime/config.py` does (integer division).
use serde::Serialize;

use super::error::{ConfigError, Result};

/// The three batch keys as given (None = not given or "auto").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchInput {
    /// `train_batch_size`.
    pub train_batch_size: Option<u64>,
    /// `train_micro_batch_size_per_gpu`.
    pub train_micro_batch_size_per_gpu: Option<u64>,
    /// `gradient_accumulation_steps`.
    pub gradient_accumulation_steps: Option<u64>,
}

/// Batch sizes after the rule, consistent with the world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BatchSizes {
    /// Samples per optimizer step over all ranks.
    pub train_batch_size: u64,
    /// Samples per micro-batch per rank.
    pub train_micro_batch_size_per_gpu: u64,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: u64,
}

impl BatchInput {
    /// Infers the missing values for `world_size` data-parallel ranks, then checks
    /// `train == micro * gas * world_size` with every value > 0.
    pub fn resolve(&self, world_size: u64) -> Result<BatchSizes> {
        let ws = world_size;
        let div = |a: u64, b: u64| a.checked_div(b).unwrap_or(0);
        let (train, micro, gas) =
            match (self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps) {
                (Some(t), Some(m), Some(g)) => (t, m, g),
                (Some(t), Some(m), None) => (t, m, div(t, m * ws)),
                (Some(t), None, Some(g)) => (t, div(t, ws * g), g),
                (None, Some(m), Some(g)) => (m * g * ws, m, g),
                (Some(t), None, None) => (t, div(t, ws), 1),
                (None, Some(m), None) => (m * ws, m, 1),
                (None, None, _) => return Err(ConfigError::BatchMissing),
            };
        let err = |message| ConfigError::Batch { message, train, micro, gas, world_size: ws };
        // A micro-batch inferred as 0: the global batch does not give every rank a sample.
        if micro == 0 && train > 0 && ws > 0 && self.train_micro_batch_size_per_gpu.is_none() {
            return Err(err(
                "train_batch_size gives fewer samples than ranks times gradient_accumulation_steps, so a rank's micro-batch would be empty: raise train_batch_size to a multiple of them, or run fewer ranks",
            ));
        }
        if train == 0 || micro == 0 || gas == 0 || ws == 0 {
            return Err(err("every value must be > 0"));
        }
        if micro.checked_mul(gas).and_then(|x| x.checked_mul(ws)) != Some(train) {
            return Err(err(
                "train_batch_size must equal train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size",
            ));
        }
        Ok(BatchSizes {
            train_batch_size: train,
            train_micro_batch_size_per_gpu: micro,
            gradient_accumulation_steps: gas,
        })
    }
}

#[cfg(test)]
mod batch_tests {
    use super::*;

    #[test]
    fn a_batch_smaller_than_the_world_says_so() {
        let input = BatchInput { train_batch_size: Some(2), ..Default::default() };
        let e = input.resolve(3).unwrap_err().to_string();
        assert!(e.contains("fewer samples than ranks") && e.contains("world_size 3"), "{e}");
    }
}
