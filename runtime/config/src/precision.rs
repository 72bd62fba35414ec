//! `fp16` and `bf16` sections: mixed precision and loss scaling.
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::Section;

/// `fp16`: 16-bit model weights with fp32 master weights and (dynamic) loss scaling.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fp16Config {
    /// Train in fp16.
    pub enabled: bool,
    /// `auto_cast` (noticed when true).
    pub auto_cast: bool,
    /// 0 means dynamic loss scaling; any other value is a static scale.
    pub loss_scale: f64,
    /// The dynamic scale starts at 2^initial_scale_power.
    pub initial_scale_power: u32,
    /// Steps without overflow before the scale doubles.
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale is lowered.
    pub hysteresis: u32,
    /// Refill the hysteresis after every step without overflow.
    pub consecutive_hysteresis: bool,
    /// The dynamic scale never goes below this.
    pub min_loss_scale: f64,
}

impl Default for Fp16Config {
    fn default() -> Self {
        Fp16Config {
            enabled: false,
            auto_cast: false,
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_loss_scale: 1.0,
        }
    }
}

/// `bf16` (alias `bfloat16`): bf16 model weights with fp32 master weights; no loss scaling.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bf16Config {
    /// Train in bf16.
    pub enabled: bool,
    /// Skip a step whose gradients are not finite.
    pub check_grad_overflow: bool,
}

impl Default for Bf16Config {
    fn default() -> Self {
        Bf16Config { enabled: false, check_grad_overflow: true }
    }
}

/// The precision of the model's parameters, derived from the two sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32.
    Fp32,
    /// fp16.
    Fp16,
    /// bf16.
    Bf16,
}

impl Precision {
    /// Bytes per parameter.
    pub fn bytes(self) -> usize {
        match self {
            Precision::Fp32 => 4,
            Precision::Fp16 | Precision::Bf16 => 2,
        }
    }
}

impl Fp16Config {
    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let d = Fp16Config::default();
        let c = Fp16Config {
            enabled: s.bool("enabled", d.enabled)?,
            auto_cast: s.bool("auto_cast", d.auto_cast)?,
            loss_scale: s.float("loss_scale", d.loss_scale)?,
            initial_scale_power: s.uint("initial_scale_power", d.initial_scale_power as u64)?.min(u32::MAX as u64)
                as u32,
            loss_scale_window: s.uint("loss_scale_window", d.loss_scale_window)?,
            hysteresis: s.uint("hysteresis", d.hysteresis as u64)?.min(u32::MAX as u64) as u32,
            consecutive_hysteresis: s.bool("consecutive_hysteresis", d.consecutive_hysteresis)?,
            min_loss_scale: s.float("min_loss_scale", d.min_loss_scale)?,
        };
        let bad = |key: &str, value: String, allowed: &str| ConfigError::Invalid {
            path: s.path_of(key),
            value,
            allowed: allowed.into(),
        };
        if c.loss_scale < 0.0 {
            return Err(bad("loss_scale", c.loss_scale.to_string(), "must be >= 0 (0 = dynamic)"));
        }
        if c.initial_scale_power > 63 {
            return Err(bad("initial_scale_power", c.initial_scale_power.to_string(), "must be <= 63"));
        }
        if c.loss_scale_window == 0 {
            return Err(bad("loss_scale_window", "0".into(), "must be >= 1"));
        }
        if c.hysteresis == 0 {
            return Err(bad("hysteresis", "0".into(), "must be >= 1"));
        }
        if c.min_loss_scale <= 0.0 {
            return Err(bad("min_loss_scale", c.min_loss_scale.to_string(), "must be > 0"));
        }
        s.finish()?;
        Ok(c)
    }
}

impl Bf16Config {
    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let d = Bf16Config::default();
        let c = Bf16Config {
            enabled: s.bool("enabled", d.enabled)?,
            check_grad_overflow: s.bool("check_grad_overflow", d.check_grad_overflow)?,
        };
        s.finish()?;
        Ok(c)
    }
}
