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

/// What DeepSpeed's three 1-bit optimizers share in `optimizer.params` (DS: runtime/fp16/onebit/).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OneBitCommon {
    /// `lr`.
    pub lr: f64,
    /// `betas`.
    pub betas: [f64; 2],
    /// `eps`.
    pub eps: f64,
    /// `weight_decay`: added to the update times the parameter (decoupled), as DeepSpeed's update does.
    pub weight_decay: f64,
    /// `bias_correction`: DeepSpeed accepts it and never applies it; zerorun does what it says (false gives
    /// DeepSpeed's update exactly).
    pub bias_correction: bool,
    /// `cuda_aware` (noticed: DeepSpeed's MPI backend only).
    pub cuda_aware: bool,
    /// `comm_backend_name` (noticed: zerorun's 1-bit exchange runs on the engine's own backend).
    pub comm_backend_name: String,
}

/// `OneBitAdam`'s `optimizer.params`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OneBitAdamParams {
    /// The shared keys.
    #[serde(flatten)]
    pub common: OneBitCommon,
    /// `freeze_step`: steps of plain Adam (gradients averaged in full precision) before the variance freezes and
    /// only the 1-bit momentum travels.
    pub freeze_step: u64,
}

/// `ZeroOneAdam`'s `optimizer.params`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZeroOneAdamParams {
    /// The shared keys.
    #[serde(flatten)]
    pub common: OneBitCommon,
    /// `var_freeze_step`: the last step that may update the variance.
    pub var_freeze_step: u64,
    /// `var_update_scaler`: the variance-update interval doubles every this many updates.
    pub var_update_scaler: u64,
    /// `local_step_scaler`: after `var_freeze_step`, the local-step interval doubles every this many steps.
    pub local_step_scaler: u64,
    /// `local_step_clipper`: the largest local-step interval.
    pub local_step_clipper: u64,
}

/// `OneBitLamb`'s `optimizer.params`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OneBitLambParams {
    /// The shared keys.
    #[serde(flatten)]
    pub common: OneBitCommon,
    /// `freeze_step`: steps of plain LAMB before the 1-bit momentum.
    pub freeze_step: u64,
    /// `max_coeff`: upper bound of the trust ratio.
    pub max_coeff: f64,
    /// `min_coeff`: lower bound of the trust ratio.
    pub min_coeff: f64,
    /// `coeff_beta`: the trust ratio's moving average during the warm-up (frozen after it).
    pub coeff_beta: f64,
    /// `factor_max`: upper bound of the compression stage's scaling factor.
    pub factor_max: f64,
    /// `factor_min`: lower bound of that factor.
    pub factor_min: f64,
    /// `factor_threshold`: the factor's largest relative change per step.
    pub factor_threshold: f64,
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
    /// 1-bit Adam (stage 0).
    OneBitAdam(OneBitAdamParams),
    /// 0/1 Adam (stage 0).
    ZeroOneAdam(ZeroOneAdamParams),
    /// 1-bit LAMB (stage 0).
    OneBitLamb(OneBitLambParams),
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
            OptimizerConfig::OneBitAdam(_) => "OneBitAdam",
            OptimizerConfig::ZeroOneAdam(_) => "ZeroOneAdam",
            OptimizerConfig::OneBitLamb(_) => "OneBitLamb",
        }
    }

    /// The shared keys of a 1-bit optimizer (OneBitAdam, ZeroOneAdam, OneBitLamb); None for the others.
    pub fn one_bit(&self) -> Option<&OneBitCommon> {
        match self {
            OptimizerConfig::OneBitAdam(p) => Some(&p.common),
            OptimizerConfig::ZeroOneAdam(p) => Some(&p.common),
            OptimizerConfig::OneBitLamb(p) => Some(&p.common),
            _ => None,
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
            OptimizerConfig::OneBitAdam(OneBitAdamParams { common, .. })
            | OptimizerConfig::ZeroOneAdam(ZeroOneAdamParams { common, .. })
            | OptimizerConfig::OneBitLamb(OneBitLambParams { common, .. }) => common.lr,
        }
    }

    /// fp32 optimizer-state values kept per parameter (Adam: m and v).
    pub fn states_per_param(&self) -> usize {
        match self {
            OptimizerConfig::Adam(p) | OptimizerConfig::AdamW(p) => 2 + usize::from(p.amsgrad),
            OptimizerConfig::Lamb(_) => 2,
            OptimizerConfig::Adagrad(_) | OptimizerConfig::Lion(_) => 1,
            OptimizerConfig::SGD(p) => usize::from(p.momentum != 0.0),
            // m and v; 0/1 Adam's momentum accumulator (the parameters' last synchronised values); 1-bit LAMB's
            // fresh variance. The error-feedback buffers are counted apart (`one_bit_error_values`).
            OptimizerConfig::OneBitAdam(_) => 2,
            OptimizerConfig::ZeroOneAdam(_) | OptimizerConfig::OneBitLamb(_) => 3,
        }
    }

    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let type_path = s.path_of("type");
        let Some(name) = s.opt_string("type")? else {
            return Err(ConfigError::Missing { path: type_path, when: "when an optimizer section is given".into() });
        };
        const KNOWN: &[&str] =
            &["Adam", "AdamW", "Adagrad", "Lamb", "Lion", "SGD", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"];
        // DeepSpeed matches its own optimizer names case-insensitively; other names go to torch.optim, case-sensitive.
        let canonical = match name.to_ascii_lowercase().as_str() {
            "adam" => "Adam",
            "adamw" => "AdamW",
            "adagrad" => "Adagrad",
            "lamb" => "Lamb",
            "lion" => "Lion",
            "onebitadam" => "OneBitAdam",
            "zerooneadam" => "ZeroOneAdam",
            "onebitlamb" => "OneBitLamb",
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
            "OneBitAdam" => OptimizerConfig::OneBitAdam(OneBitAdamParams {
                common: one_bit_common(&mut p)?,
                freeze_step: freeze_step(&mut p)?,
            }),
            "ZeroOneAdam" => {
                let params = ZeroOneAdamParams {
                    common: one_bit_common(&mut p)?,
                    var_freeze_step: p.uint("var_freeze_step", 100_000)?,
                    var_update_scaler: p.uint("var_update_scaler", 16)?,
                    local_step_scaler: p.uint("local_step_scaler", 32_678)?,
                    local_step_clipper: p.uint("local_step_clipper", 16)?,
                };
                for (key, v) in [
                    ("var_update_scaler", params.var_update_scaler),
                    ("local_step_scaler", params.local_step_scaler),
                    ("local_step_clipper", params.local_step_clipper),
                ] {
                    if v == 0 {
                        return Err(ConfigError::Invalid {
                            path: p.path_of(key),
                            value: "0".into(),
                            allowed: "must be >= 1".into(),
                        });
                    }
                }
                OptimizerConfig::ZeroOneAdam(params)
            }
            "OneBitLamb" => {
                let params = OneBitLambParams {
                    common: one_bit_common(&mut p)?,
                    freeze_step: freeze_step(&mut p)?,
                    max_coeff: p.float("max_coeff", 10.0)?,
                    min_coeff: p.float("min_coeff", 0.01)?,
                    coeff_beta: p.float("coeff_beta", 0.9)?,
                    factor_max: p.float("factor_max", 4.0)?,
                    factor_min: p.float("factor_min", 0.5)?,
                    factor_threshold: p.float("factor_threshold", 0.1)?,
                };
                let bad = |key: &str, value: f64, allowed: String| ConfigError::Invalid {
                    path: p.path_of(key),
                    value: value.to_string(),
                    allowed,
                };
                if !(params.min_coeff > 0.0 && params.min_coeff <= params.max_coeff) {
                    return Err(bad(
                        "min_coeff",
                        params.min_coeff,
                        format!("must be in (0, max_coeff = {}]", params.max_coeff),
                    ));
                }
                if !(params.factor_min > 0.0 && params.factor_min <= params.factor_max) {
                    return Err(bad(
                        "factor_min",
                        params.factor_min,
                        format!("must be in (0, factor_max = {}]", params.factor_max),
                    ));
                }
                if !(0.0..1.0).contains(&params.coeff_beta) {
                    return Err(bad("coeff_beta", params.coeff_beta, "must be in [0, 1)".into()));
                }
                if !(params.factor_threshold >= 0.0 && params.factor_threshold.is_finite()) {
                    return Err(bad(
                        "factor_threshold",
                        params.factor_threshold,
                        "must be a finite number >= 0".into(),
                    ));
                }
                OptimizerConfig::OneBitLamb(params)
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

/// `freeze_step` (DeepSpeed's default 100000): at least 1, the warm-up is where the variance is estimated.
fn freeze_step(p: &mut Section) -> Result<u64> {
    let steps = p.uint("freeze_step", 100_000)?;
    if steps == 0 {
        return Err(ConfigError::Invalid {
            path: p.path_of("freeze_step"),
            value: "0".into(),
            allowed: "must be >= 1: the warm-up's steps estimate the variance the compressed steps then keep".into(),
        });
    }
    Ok(steps)
}

/// The keys all three 1-bit optimizers read, DeepSpeed's defaults; `amsgrad` true and `max_grad_norm` are
/// refused as DeepSpeed refuses them.
fn one_bit_common(p: &mut Section) -> Result<OneBitCommon> {
    if p.take("max_grad_norm").is_some() {
        return Err(ConfigError::Conflict {
            path: p.path_of("max_grad_norm"),
            message:
                "not supported by the 1-bit optimizers (DeepSpeed raises too); use the top-level `gradient_clipping`"
                    .into(),
        });
    }
    if p.bool("amsgrad", false)? {
        return Err(ConfigError::Conflict {
            path: p.path_of("amsgrad"),
            message: "the 1-bit optimizers freeze the variance; AMSGrad's running maximum has no meaning there (DeepSpeed raises too)".into(),
        });
    }
    // Stored by DeepSpeed as `eps_mode` and never read: accepted, with no effect either way.
    let _ = p.bool("eps_inside_sqrt", false)?;
    let common = OneBitCommon {
        lr: p.float("lr", 1e-3)?,
        betas: p.float_pair("betas", [0.9, 0.999])?,
        eps: p.float("eps", 1e-8)?,
        weight_decay: p.float("weight_decay", 0.0)?,
        bias_correction: p.bool("bias_correction", true)?,
        cuda_aware: p.bool("cuda_aware", false)?,
        comm_backend_name: p.opt_string("comm_backend_name")?.unwrap_or_else(|| "nccl".into()),
    };
    const BACKENDS: &[&str] = &["nccl", "mpi", "hccl", "compressed"];
    if !BACKENDS.contains(&common.comm_backend_name.as_str()) {
        return Err(ConfigError::Invalid {
            path: p.path_of("comm_backend_name"),
            value: format!("\"{}\"", common.comm_backend_name),
            allowed: format!(
                "one of {} (DeepSpeed's; zerorun uses the engine's backend for any)",
                quoted_list(BACKENDS)
            ),
        });
    }
    check_common(p, common.lr, Some(common.betas), Some(common.eps), common.weight_decay)?;
    Ok(common)
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
