//! What the engine counts for its reports: elements its collectives moved, bytes of gathered parameters.

/// Elements moved by the engine's collectives since it started (counted by the caller's rank).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommVolume {
    pub all_gather_elements: u64,
    pub reduce_scatter_elements: u64,
    pub all_reduce_elements: u64,
}

/// Bytes of gathered full parameters: now, at most over the run, and at most in the current optimizer step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GatheredBytes {
    pub current: usize,
    pub peak: usize,
    pub step_peak: usize,
}

impl GatheredBytes {
    pub(super) fn add(&mut self, bytes: usize) {
        self.current += bytes;
        self.peak = self.peak.max(self.current);
        self.step_peak = self.step_peak.max(self.current);
    }
}
