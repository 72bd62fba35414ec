//! What the engine counts: its progress through the run, the elements its collectives moved, the bytes of gathered
//! parameters.

/// Elements moved by the engine's collectives since it started (counted by the caller's rank).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommVolume {
    /// By all-gathers.
    pub all_gather_elements: u64,
    /// By reduce-scatters.
    pub reduce_scatter_elements: u64,
    /// By all-reduces.
    pub all_reduce_elements: u64,
}

/// Bytes of gathered full parameters: now, at most over the run, and at most in the current optimizer step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GatheredBytes {
    /// Now.
    pub current: usize,
    /// At most over the run.
    pub peak: usize,
    /// At most in the current optimizer step.
    pub step_peak: usize,
}

impl GatheredBytes {
    pub(super) fn add(&mut self, bytes: usize) {
        self.current += bytes;
        self.peak = self.peak.max(self.current);
        self.step_peak = self.step_peak.max(self.current);
    }
}

/// Where the run is: micro-batches and optimizer steps so far, and the loss of the current step's micro-batches.
#[derive(Debug, Clone, Default)]
pub(super) struct Progress {
    pub micro_steps: u64,
    /// `micro_steps` at the last accumulation boundary (the micro-batches per step change with fault tolerance).
    pub micro_at_boundary: u64,
    /// Optimizer steps taken, skipped ones included (as DeepSpeed counts them).
    pub global_steps: u64,
    pub global_samples: u64,
    /// Steps skipped because gradients overflowed.
    pub skipped_steps: u64,
    /// Sum and count of this step's micro-batch losses (this rank's).
    pub loss_sum: f64,
    pub loss_count: u64,
    /// Backwards run through the engine this step, with or without a loss (a pipeline stage's comes from the next
    /// stage's gradient).
    pub backwards: u64,
    /// When this step's first backward began (for `steps_per_print`'s throughput).
    pub step_started: Option<std::time::Instant>,
}
