//! The optimizers that communicate themselves: DeepSpeed's 1-bit Adam (Tang et al. 2021), 0/1 Adam (Lu et al.
//! 2022) and 1-bit LAMB (Li et al. 2021). After a warm-up of plain Adam on averaged gradients the variance stops changing, the update becomes
//! linear in the momentum, and what the ranks exchange is the momentum (or, for 0/1 Adam, the gradient and later
//! the accumulated update) as one sign bit per value through an [`Exchange`], with error feedback so that what one
//! step's signs leave out is added to the next step's. The engine keeps the gradients of such a step on their rank
//! ([`crate::Optimizer::keeps_gradients_local`]).
//!
//! Where zerorun differs from DeepSpeed (read in DS: deepspeed/runtime/fp16/onebit/): the first step is a step
//! (DeepSpeed's first call only allocates and drops its gradient); `bias_correction` does what it says (DeepSpeed
//! reads and ignores it: set it false for DeepSpeed's update); the error-feedback buffers and 0/1 Adam's schedule are
//! saved in checkpoints per rank and restored at the same world size (DeepSpeed resets them on every load).
mod adam;
mod lamb;
mod zero_one;

pub use adam::{OneBitAdam, OneBitAdamConfig};
pub use lamb::{OneBitLamb, OneBitLambConfig};
pub use zero_one::{ZeroOneAdam, ZeroOneAdamConfig};

/// The data-parallel ranks, as a compressing optimizer sees them: the engine implements it over its group.
pub trait Exchange: Send {
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// Lengths of the worker and server error buffers of an `n`-value vector (the worker's is padded).
    fn error_lens(&self, n: usize) -> (usize, usize);
    /// Replaces `values` (the same length on every rank) by their average over the ranks, each value sent as one
    /// sign bit with a scale per part; `errors` carry what the signs left out to the next call. Every rank ends
    /// with the same values. Collective.
    fn one_bit_average(&mut self, values: &mut [f32], errors: &mut ErrorFeedback) -> Result<(), String>;
    /// Bytes this rank sent through the exchange so far (for the step's traffic report).
    fn bytes_sent(&self) -> u64;
}

/// The two error-feedback buffers of one exchanged vector (see [`Exchange::one_bit_average`]): this rank's own,
/// different on every rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ErrorFeedback {
    /// What this rank's signs of the whole (padded) vector left out.
    pub worker: Vec<f32>,
    /// What this rank's signs of its part, as the part's server, left out.
    pub server: Vec<f32>,
}

impl ErrorFeedback {
    /// Zero buffers of the exchange's lengths for an `n`-value vector.
    pub fn for_len(exchange: &dyn Exchange, n: usize) -> ErrorFeedback {
        let (w, s) = exchange.error_lens(n);
        ErrorFeedback { worker: vec![0.0; w], server: vec![0.0; s] }
    }

    /// Both to zero.
    pub fn reset(&mut self) {
        self.worker.fill(0.0);
        self.server.fill(0.0);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.worker.len() + self.server.len())
    }

    /// As named buffers for a checkpoint (`<prefix>worker_error`, `<prefix>server_error`).
    pub(crate) fn saved(&self) -> Vec<(String, Vec<f32>)> {
        vec![("worker_error".into(), self.worker.clone()), ("server_error".into(), self.server.clone())]
    }

    /// Restores a buffer [`ErrorFeedback::saved`] named; false when the name is not one of them.
    pub(crate) fn load(&mut self, name: &str, values: &[f32]) -> crate::Result<bool> {
        let buf = match name {
            "worker_error" => &mut self.worker,
            "server_error" => &mut self.server,
            _ => return Ok(false),
        };
        if buf.len() != values.len() {
            return Err(crate::OptimError::Length {
                what: "saved error-feedback buffer",
                got: values.len(),
                expected: buf.len(),
            });
        }
        buf.copy_from_slice(values);
        Ok(true)
    }
}

/// Zeroes `values` where the variance `v` is exactly zero: elements whose gradient was zero at every step that
/// updated the variance (the flat buffer's padding, parameters that never received a gradient, as BERT's position
/// embeddings past the sequence length). One bit cannot say zero, so the exchange hands such elements plus or
/// minus a scale, and with a zero variance that would be divided by `eps`: this is DeepSpeed's `exp_avg_mask`,
/// found instead of asked for.
pub(crate) fn mask_never_moved(values: &mut [f32], v: &[f32]) {
    for (x, v) in values.iter_mut().zip(v) {
        if *v == 0.0 {
            *x = 0.0;
        }
    }
}

/// A failed exchange as this crate's error.
pub(crate) fn exchange_failed(what: String) -> crate::OptimError {
    crate::OptimError::Exchange { what }
}

/// Scalars kept bitwise in f32 buffers for a checkpoint: each u64 as two u32 halves.
pub(crate) fn words_to_f32(words: &[u64]) -> Vec<f32> {
    words.iter().flat_map(|w| [f32::from_bits(*w as u32), f32::from_bits((*w >> 32) as u32)]).collect()
}

/// The inverse of [`words_to_f32`].
pub(crate) fn f32_to_words(values: &[f32]) -> Vec<u64> {
    values.chunks(2).map(|c| c[0].to_bits() as u64 | (c.get(1).map_or(0, |h| h.to_bits()) as u64) << 32).collect()
}
