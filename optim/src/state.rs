//! Optimizer state as plain data: a step count and named fp32 buffers, element-aligned with the shard.
//! Element range `r` of the shard maps to range `r` of every buffer, so checkpoints can reshard it.
use serde::{Deserialize, Serialize};

use crate::aligned::AlignedVec;
use crate::{OptimError, Result};

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
/// An optimizer's state: named f32 buffers of the shard's length (`exp_avg`, `exp_avg_sq`, ...), as checkpoints save them.
pub struct OptimizerState {
    /// Optimizer steps taken (the `t` of bias correction).
    pub step: u64,
    /// Named buffers (`exp_avg`, `exp_avg_sq`, ...), each as long as the shard.
    pub buffers: Vec<(String, AlignedVec)>,
}

impl OptimizerState {
    /// Buffers named `names`, each `len` elements of `init`.
    pub fn new(names: &[&str], len: usize, init: f32) -> Self {
        OptimizerState {
            step: 0,
            buffers: names.iter().map(|n| (n.to_string(), AlignedVec::filled(len, init))).collect(),
        }
    }

    /// The buffer `name`.
    pub fn get(&self, name: &str) -> Result<&[f32]> {
        self.buffers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_slice())
            .ok_or_else(|| OptimError::MissingState { name: name.into() })
    }

    /// The buffer `name`, mutable.
    pub fn get_mut(&mut self, name: &str) -> Result<&mut [f32]> {
        self.buffers
            .iter_mut()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_mut_slice())
            .ok_or_else(|| OptimError::MissingState { name: name.into() })
    }

    /// Bytes held by the buffers.
    pub fn bytes(&self) -> usize {
        self.buffers.iter().map(|(_, b)| b.len() * 4).sum()
    }

    /// Replaces the state with `other`, checking that it has the same buffers of the same length.
    pub fn load(&mut self, other: OptimizerState) -> Result<()> {
        for (name, buf) in &self.buffers {
            let theirs = other.get(name)?;
            if theirs.len() != buf.len() {
                return Err(OptimError::Length {
                    what: "loaded optimizer state buffer",
                    got: theirs.len(),
                    expected: buf.len(),
                });
            }
        }
        *self = other;
        Ok(())
    }

    /// Elements of the shard the buffers cover (None for a state without buffers, e.g. SGD without momentum).
    pub fn shard_len(&self) -> Option<usize> {
        self.buffers.first().map(|(_, b)| b.len())
    }

    /// Elements `range` of the first `N` buffers, mutably, for a kernel over part of the shard.
    pub(crate) fn split_range<const N: usize>(&mut self, range: std::ops::Range<usize>) -> [&mut [f32]; N] {
        let mut it = self.buffers.iter_mut().map(|(_, b)| &mut b.as_mut_slice()[range.clone()]);
        std::array::from_fn(|_| it.next().expect("state has the kernel's buffers"))
    }

    /// The first `N` buffers, mutably, for a kernel.
    pub(crate) fn split<const N: usize>(&mut self) -> [&mut [f32]; N] {
        let mut it = self.buffers.iter_mut().map(|(_, b)| b.as_mut_slice());
        std::array::from_fn(|_| it.next().expect("state has the kernel's buffers"))
    }
}
