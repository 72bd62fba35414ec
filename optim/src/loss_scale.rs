//! fp16 loss scaling, static and dynamic, with DeepSpeed's hysteresis rules (`runtime/fp16/loss_scaler.py`).
use serde::{Deserialize, Serialize};

use crate::{OptimError, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
/// fp16 loss scaling, as DeepSpeed's `fp16` section configures it.
pub struct LossScalerConfig {
    /// false: a static scale that never changes (overflowing steps are still skipped).
    pub dynamic: bool,
    /// The first scale (2^`initial_scale_power`, or the static `loss_scale`).
    pub initial_scale: f64,
    /// The factor the scale grows and shrinks by (2).
    pub scale_factor: f64,
    /// Steps without overflow before the scale grows.
    pub scale_window: u64,
    /// The scale never goes below this.
    pub min_scale: f64,
    /// Overflows tolerated before the scale shrinks ("delayed shift").
    pub hysteresis: u32,
    /// Reset the hysteresis after every good step rather than only when the scale grows.
    pub consecutive_hysteresis: bool,
}

impl LossScalerConfig {
    /// DeepSpeed's fp16 section: `loss_scale` 0 means dynamic from 2^initial_scale_power.
    pub fn from_fp16(
        loss_scale: f64,
        initial_scale_power: u32,
        window: u64,
        hysteresis: u32,
        consecutive: bool,
        min_loss_scale: f64,
    ) -> Self {
        LossScalerConfig {
            dynamic: loss_scale == 0.0,
            initial_scale: if loss_scale == 0.0 { 2f64.powi(initial_scale_power as i32) } else { loss_scale },
            scale_factor: 2.0,
            scale_window: window,
            min_scale: min_loss_scale,
            hysteresis,
            consecutive_hysteresis: consecutive,
        }
    }

    /// No loss scaling (fp32 and bf16 runs).
    pub fn none() -> Self {
        LossScalerConfig {
            dynamic: false,
            initial_scale: 1.0,
            scale_factor: 2.0,
            scale_window: 1,
            min_scale: 1.0,
            hysteresis: 1,
            consecutive_hysteresis: false,
        }
    }
}

/// The scaler's mutable state, for checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScalerState {
    /// The scale now.
    pub cur_scale: f64,
    /// Steps seen.
    pub cur_iter: u64,
    /// The step of the last overflow (-1: none yet).
    pub last_overflow_iter: i64,
    /// Overflows still tolerated before the scale shrinks.
    pub cur_hysteresis: u32,
}

#[derive(Debug, Clone, PartialEq)]
/// The dynamic loss scaler: skips a step whose gradients overflowed and adjusts the scale.
pub struct LossScaler {
    /// Its settings.
    pub config: LossScalerConfig,
    /// Its state.
    pub state: LossScalerState,
}

/// What to do with the step whose gradients were checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepDecision {
    /// The gradients are finite: take the step.
    Apply,
    /// They overflowed: skip it (the scale was lowered).
    Skip,
}

impl LossScaler {
    /// A scaler at `config.initial_scale`.
    pub fn new(config: LossScalerConfig) -> Self {
        let state = LossScalerState {
            cur_scale: config.initial_scale,
            cur_iter: 0,
            last_overflow_iter: -1,
            cur_hysteresis: config.hysteresis,
        };
        LossScaler { config, state }
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.state.cur_scale
    }

    /// Records whether this step's gradients overflowed (agreed by all ranks) and says whether to apply it.
    /// An overflow at the minimum scale is an error: training cannot make progress.
    pub fn update(&mut self, overflow: bool) -> Result<StepDecision> {
        let c = &self.config;
        let s = &mut self.state;
        if !c.dynamic {
            s.cur_iter += 1;
            return Ok(if overflow { StepDecision::Skip } else { StepDecision::Apply });
        }
        if overflow {
            if c.hysteresis == 1 || s.cur_hysteresis == 1 {
                if s.cur_scale <= c.min_scale {
                    return Err(OptimError::LossScaleAtMinimum { scale: s.cur_scale, min: c.min_scale });
                }
                s.cur_scale = (s.cur_scale / c.scale_factor).max(c.min_scale);
            } else {
                s.cur_hysteresis -= 1;
            }
            s.last_overflow_iter = s.cur_iter as i64;
        } else {
            if c.consecutive_hysteresis {
                s.cur_hysteresis = c.hysteresis;
            }
            if (s.cur_iter as i64 - s.last_overflow_iter) % c.scale_window as i64 == 0 {
                if !c.consecutive_hysteresis {
                    s.cur_hysteresis = c.hysteresis;
                }
                s.cur_scale *= c.scale_factor;
            }
        }
        s.cur_iter += 1;
        Ok(if overflow { StepDecision::Skip } else { StepDecision::Apply })
    }
}
