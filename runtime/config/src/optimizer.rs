//! `optimizer`: `{type, params}` with DeepSpeed's names and defaults.
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::{quoted_list, Section};

/// Adam and AdamW. DeepSpeed's rule: type "AdamW" always decouples weight decay; type "Adam" does too unless
/// `adam_w_mode` is false. `adam_w_mode` here is the effective value.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdamParams {
    /// `lr`.
    pub lr: f64,
    /// `betas`.
    pub betas: [f64; 2],
    /// `eps`.
    pub eps: f64,
    /// `weight_decay`.
    pub weight_decay: f64,
    /// `bias_correction`.
    pub bias_correction: bool,
    /// `amsgrad`.
    pub amsgrad: bool,
    /// `adam_w_mode`: decoupled weight decay (AdamW).
    pub adam_w_mode: bool,
    /// `torch_adam` (noticed).
    pub torch_adam: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
/// Adagrad's `optimizer.params`.
pub struct AdagradParams {
    /// `lr`.
    pub lr: f64,
    /// `eps`.
    pub eps: f64,
    /// `weight_decay`.
    pub weight_decay: f64,
    /// `lr_decay`.
    pub lr_decay: f64,
    /// `initial_accumulator_value`.
    pub initial_accumulator_value: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
/// Lamb's `optimizer.params`.
pub struct LambParams {
    /// `lr`.
    pub lr: f64,
    /// `betas`.
    pub betas: [f64; 2],
    /// `eps`.
    pub eps: f64,
    /// `weight_decay`.
    pub weight_decay: f64,
    /// `bias_correction`.
    pub bias_correction: bool,
    /// `eps_inside_sqrt`.
    pub eps_inside_sqrt: bool,
    /// `max_grad_norm` (refused when non-zero: use `gradient_clipping`).
    pub max_grad_norm: f64,
    /// Upper bound of the trust ratio.
    pub max_coeff: f64,
    /// Lower bound of the trust ratio.
    pub min_coeff: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
/// Lion's `optimizer.params`.
pub struct LionParams {
    /// `lr`.
    pub lr: f64,
    /// `betas`.
    pub betas: [f64; 2],
    /// `weight_decay`.
    pub weight_decay: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
/// SGD's `optimizer.params`.
pub struct SgdParams {
    /// `lr`.
    pub lr: f64,
    /// `momentum`.
    pub momentum: f64,
    /// `dampening`.
    pub dampening: f64,
    /// `weight_decay`.
    pub weight_decay: f64,
    /// `nesterov`.
    pub nesterov: bool,
}

/// The `optimizer` section, serialized back as `{"type": ..., "params": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", content = "params")]
pub enum OptimizerConfig {
    /// Adam; decoupled weight decay unless `adam_w_mode` is false.
    Adam(AdamParams),
    /// AdamW.
    AdamW(AdamParams),
    /// Adagrad.
    Adagrad(AdagradParams),
    /// Lamb (stage 0 only: refused under sharding).
    Lamb(LambParams),
    /// Lion.
    Lion(LionParams),
    /// SGD.
    SGD(SgdParams),
}

/// Optimizers ZeRO (stage >= 1) accepts without `zero_allow_untested_optimizer`, as DeepSpeed does.
pub const ZERO_SUPPORTED: &[&str] = &["Adam", "AdamW", "Adagrad", "Lion"];

impl OptimizerConfig {
    /// The name `optimizer.type` takes.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerConfig::Adam(_) => "Adam",
            OptimizerConfig::AdamW(_) => "AdamW",
            OptimizerConfig::Adagrad(_) => "Adagrad",
            OptimizerConfig::Lamb(_) => "Lamb",
            OptimizerConfig::Lion(_) => "Lion",
            OptimizerConfig::SGD(_) => "SGD",
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerConfig::Adam(p) | OptimizerConfig::AdamW(p) => p.lr,
            OptimizerConfig::Adagrad(p) => p.lr,
            OptimizerConfig::Lamb(p) => p.lr,
            OptimizerConfig::Lion(p) => p.lr,
            OptimizerConfig::SGD(p) => p.lr,
        }
    }

    /// fp32 optimizer-state values kept per parameter (Adam: m and v).
    pub fn states_per_param(&self) -> usize {
        match self {
            OptimizerConfig::Adam(p) | OptimizerConfig::AdamW(p) => 2 + usize::from(p.amsgrad),
            OptimizerConfig::Lamb(_) => 2,
            OptimizerConfig::Adagrad(_) | OptimizerConfig::Lion(_) => 1,
            OptimizerConfig::SGD(p) => usize::from(p.momentum != 0.0),
        }
    }

    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let type_path = s.path_of("type");
        let Some(name) = s.opt_string("type")? else {
            return Err(ConfigError::Missing { path: type_path, when: "when an optimizer section is given".into() });
        };
        const KNOWN: &[&str] = &["Adam", "AdamW", "Adagrad", "Lamb", "Lion", "SGD"];
        // DeepSpeed matches its own optimizer names case-insensitively; other names go to torch.optim, case-sensitive.
        let canonical = match name.to_ascii_lowercase().as_str() {
            "adam" => "Adam",
            "adamw" => "AdamW",
            "adagrad" => "Adagrad",
            "lamb" => "Lamb",
            "lion" => "Lion",
            _ if name == "SGD" => "SGD",
            _ => {
                return Err(ConfigError::Invalid {
                    path: type_path,
                    value: format!("\"{name}\""),
                    allowed: format!("one of {}", quoted_list(KNOWN)),
                })
            }
        };
        let mut p = s.section("params")?;
        let config = match canonical {
            "Adam" | "AdamW" => {
                if p.take("max_grad_norm").is_some() {
                    return Err(ConfigError::Conflict {
                        path: p.path_of("max_grad_norm"),
                        message: "not supported for Adam; use the top-level `gradient_clipping`".into(),
                    });
                }
                let mut params = AdamParams {
                    lr: p.float("lr", 1e-3)?,
                    betas: p.float_pair("betas", [0.9, 0.999])?,
                    eps: p.float("eps", 1e-8)?,
                    weight_decay: p.float("weight_decay", 0.0)?,
                    bias_correction: p.bool("bias_correction", true)?,
                    amsgrad: p.bool("amsgrad", false)?,
                    adam_w_mode: p.bool("adam_w_mode", true)?,
                    torch_adam: p.bool("torch_adam", false)?,
                };
                check_common(&p, params.lr, Some(params.betas), Some(params.eps), params.weight_decay)?;
                if canonical == "AdamW" {
                    params.adam_w_mode = true;
                    OptimizerConfig::AdamW(params)
                } else {
                    OptimizerConfig::Adam(params)
                }
            }
            "Adagrad" => {
                let params = AdagradParams {
                    lr: p.float("lr", 1e-2)?,
                    eps: p.float("eps", 1e-10)?,
                    weight_decay: p.float("weight_decay", 0.0)?,
                    lr_decay: p.float("lr_decay", 0.0)?,
                    initial_accumulator_value: p.float("initial_accumulator_value", 0.0)?,
                };
                check_common(&p, params.lr, None, Some(params.eps), params.weight_decay)?;
                OptimizerConfig::Adagrad(params)
            }
            "Lamb" => {
                let params = LambParams {
                    lr: p.float("lr", 1e-3)?,
                    betas: p.float_pair("betas", [0.9, 0.999])?,
                    eps: p.float("eps", 1e-8)?,
                    weight_decay: p.float("weight_decay", 0.0)?,
                    bias_correction: p.bool("bias_correction", true)?,
                    eps_inside_sqrt: p.bool("eps_inside_sqrt", false)?,
                    max_grad_norm: p.float("max_grad_norm", 0.0)?,
                    max_coeff: p.float("max_coeff", 10.0)?,
                    min_coeff: p.float("min_coeff", 0.01)?,
                };
                check_common(&p, params.lr, Some(params.betas), Some(params.eps), params.weight_decay)?;
                if params.min_coeff > params.max_coeff {
                    return Err(ConfigError::Invalid {
                        path: p.path_of("min_coeff"),
                        value: params.min_coeff.to_string(),
                        allowed: format!("must be <= max_coeff ({})", params.max_coeff),
                    });
                }
                OptimizerConfig::Lamb(params)
            }
            "Lion" => {
                let params = LionParams {
                    lr: p.float("lr", 1e-4)?,
                    betas: p.float_pair("betas", [0.9, 0.99])?,
                    weight_decay: p.float("weight_decay", 0.0)?,
                };
                check_common(&p, params.lr, Some(params.betas), None, params.weight_decay)?;
                OptimizerConfig::Lion(params)
            }
            _ => {
                let params = SgdParams {
                    lr: p.float("lr", 1e-3)?,
                    momentum: p.float("momentum", 0.0)?,
                    dampening: p.float("dampening", 0.0)?,
                    weight_decay: p.float("weight_decay", 0.0)?,
                    nesterov: p.bool("nesterov", false)?,
                };
                check_common(&p, params.lr, None, None, params.weight_decay)?;
                if params.nesterov && (params.momentum <= 0.0 || params.dampening != 0.0) {
                    return Err(ConfigError::Conflict {
                        path: p.path_of("nesterov"),
                        message: "Nesterov momentum requires momentum > 0 and dampening 0".into(),
                    });
                }
                OptimizerConfig::SGD(params)
            }
        };
        p.finish()?;
        s.finish()?;
        Ok(config)
    }
}

fn check_common(p: &Section, lr: f64, betas: Option<[f64; 2]>, eps: Option<f64>, weight_decay: f64) -> Result<()> {
    let bad = |key: &str, value: String, allowed: &str| ConfigError::Invalid {
        path: p.path_of(key),
        value,
        allowed: allowed.into(),
    };
    if !(lr >= 0.0 && lr.is_finite()) {
        return Err(bad("lr", lr.to_string(), "must be a finite number >= 0"));
    }
    if let Some([b1, b2]) = betas {
        if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            return Err(bad("betas", format!("[{b1}, {b2}]"), "each beta must be in [0, 1)"));
        }
    }
    if let Some(eps) = eps {
        if eps.is_nan() || eps < 0.0 {
            return Err(bad("eps", eps.to_string(), "must be >= 0"));
        }
    }
    if weight_decay.is_nan() || weight_decay < 0.0 {
        return Err(bad("weight_decay", weight_decay.to_string(), "must be >= 0"));
    }
    Ok(())
}
