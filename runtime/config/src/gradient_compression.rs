//! `gradient_compression` (zerorun's own section): how the data-parallel gradients travel compressed. `powersgd`
//! is PyTorch's PowerSGD communication hook (Vogels et al. 2019) with its `PowerSGDState` options under the same
//! names: each gradient matrix averaged as a rank-r product P Q^T (two all-reduces of the thin factors), error
//! feedback and warm start on by default, vectors and matrices that would not shrink by `min_compression_rate`
//! averaged whole. The 1-bit optimizers are the other compression, an `optimizer.type`.
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::Section;

/// PowerSGD's options (PyTorch's `PowerSGDState` names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PowerSgd {
    /// `matrix_approximation_rank`: r of the P Q^T approximation.
    pub matrix_approximation_rank: u64,
    /// `start_powerSGD_iter`: optimizer steps averaged exactly before compression starts.
    #[serde(rename = "start_powerSGD_iter")]
    pub start_powersgd_iter: u64,
    /// `min_compression_rate`: a matrix n x m is compressed when (n + m) r x rate < n m.
    pub min_compression_rate: f64,
    /// `use_error_feedback`: what the approximation missed is added to the next step's gradient.
    pub use_error_feedback: bool,
    /// `warm_start`: Q starts each step from the last step's.
    pub warm_start: bool,
    /// `orthogonalization_epsilon`: added to the column norms when orthogonalizing.
    pub orthogonalization_epsilon: f64,
    /// `random_seed`: Q's first values, the same on every rank.
    pub random_seed: u64,
}

impl Default for PowerSgd {
    fn default() -> Self {
        PowerSgd {
            matrix_approximation_rank: 1,
            start_powersgd_iter: 1_000,
            min_compression_rate: 2.0,
            use_error_feedback: true,
            warm_start: true,
            orthogonalization_epsilon: 0.0,
            random_seed: 0,
        }
    }
}

/// The `gradient_compression` section.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum GradientCompression {
    /// Gradients travel whole (in `communication_data_type`).
    #[default]
    None,
    /// PowerSGD.
    #[serde(rename = "powersgd")]
    PowerSgd(PowerSgd),
}

impl GradientCompression {
    /// PowerSGD's options, if it is on.
    pub fn powersgd(&self) -> Option<&PowerSgd> {
        match self {
            GradientCompression::PowerSgd(p) => Some(p),
            GradientCompression::None => None,
        }
    }

    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let kind = s.choice("type", &["none", "powersgd"], "none")?;
        let d = PowerSgd::default();
        let config = match kind {
            "powersgd" => {
                let p = PowerSgd {
                    matrix_approximation_rank: s.uint("matrix_approximation_rank", d.matrix_approximation_rank)?,
                    start_powersgd_iter: s.uint("start_powerSGD_iter", d.start_powersgd_iter)?,
                    min_compression_rate: s.float("min_compression_rate", d.min_compression_rate)?,
                    use_error_feedback: s.bool("use_error_feedback", d.use_error_feedback)?,
                    warm_start: s.bool("warm_start", d.warm_start)?,
                    orthogonalization_epsilon: s.float("orthogonalization_epsilon", d.orthogonalization_epsilon)?,
                    random_seed: s.uint("random_seed", d.random_seed)?,
                };
                let bad = |key: &str, value: String, allowed: &str| ConfigError::Invalid {
                    path: s.path_of(key),
                    value,
                    allowed: allowed.into(),
                };
                if p.matrix_approximation_rank == 0 {
                    return Err(bad("matrix_approximation_rank", "0".into(), "must be >= 1"));
                }
                if !(p.min_compression_rate >= 1.0 && p.min_compression_rate.is_finite()) {
                    return Err(bad(
                        "min_compression_rate",
                        p.min_compression_rate.to_string(),
                        "must be a finite number >= 1",
                    ));
                }
                if !(p.orthogonalization_epsilon >= 0.0 && p.orthogonalization_epsilon.is_finite()) {
                    return Err(bad(
                        "orthogonalization_epsilon",
                        p.orthogonalization_epsilon.to_string(),
                        "must be a finite number >= 0",
                    ));
                }
                GradientCompression::PowerSgd(p)
            }
            _ => GradientCompression::None,
        };
        s.finish()?;
        Ok(config)
    }
}
