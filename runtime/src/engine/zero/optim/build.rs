//! Builds the zerorun-optim optimizer and LR schedule named by the config.
use zerorun_optim::schedule::LrScheduler;
use zerorun_optim::{
    Adagrad, AdagradConfig, Adam, AdamConfig, Lamb, LambConfig, Lion, LionConfig, Optimizer, Sgd, SgdConfig,
};

use crate::config::{Config, OptimizerConfig};

/// The optimizer for a shard of `len` elements, its base lr and weight decay. No optimizer section: AdamW with
/// DeepSpeed's defaults.
pub fn build(config: &Config, len: usize) -> (Box<dyn Optimizer>, f64, f64) {
    if let Some((c, lr, weight_decay)) = adam(config) {
        return (Box::new(Adam::new(c, len)), lr, weight_decay);
    }
    if let Some((c, lr, weight_decay)) = sgd(config) {
        return (Box::new(Sgd::new(c, len)), lr, weight_decay);
    }
    match optimizer_config(config).as_ref() {
        OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_) | OptimizerConfig::SGD(_) => {
            unreachable!("Adam and SGD are built above")
        }
        OptimizerConfig::Adagrad(p) => {
            let c = AdagradConfig {
                eps: p.eps,
                lr_decay: p.lr_decay,
                initial_accumulator_value: p.initial_accumulator_value,
            };
            (Box::new(Adagrad::new(c, len)), p.lr, p.weight_decay)
        }
        OptimizerConfig::Lamb(p) => {
            let c = LambConfig {
                betas: (p.betas[0], p.betas[1]),
                eps: p.eps,
                bias_correction: p.bias_correction,
                eps_inside_sqrt: p.eps_inside_sqrt,
                max_coeff: p.max_coeff,
                min_coeff: p.min_coeff,
            };
            (Box::new(Lamb::new(c, len)), p.lr, p.weight_decay)
        }
        OptimizerConfig::Lion(p) => {
            (Box::new(Lion::new(LionConfig { betas: (p.betas[0], p.betas[1]) }, len)), p.lr, p.weight_decay)
        }
    }
}

/// The config's optimizer section; none: AdamW with DeepSpeed's defaults.
fn optimizer_config(config: &Config) -> std::borrow::Cow<'_, OptimizerConfig> {
    match &config.optimizer {
        Some(o) => std::borrow::Cow::Borrowed(o),
        None => std::borrow::Cow::Owned(OptimizerConfig::AdamW(crate::config::AdamParams {
            lr: 1e-3,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            bias_correction: true,
            amsgrad: false,
            adam_w_mode: true,
            torch_adam: false,
        })),
    }
}

/// The config's Adam or AdamW (its hyper-parameters, lr and weight decay); None for other optimizers.
pub fn adam(config: &Config) -> Option<(AdamConfig, f64, f64)> {
    match optimizer_config(config).as_ref() {
        OptimizerConfig::Adam(p) | OptimizerConfig::AdamW(p) => {
            let c = AdamConfig {
                betas: (p.betas[0], p.betas[1]),
                eps: p.eps,
                bias_correction: p.bias_correction,
                amsgrad: p.amsgrad,
                adam_w_mode: p.adam_w_mode,
            };
            Some((c, p.lr, p.weight_decay))
        }
        _ => None,
    }
}

/// The config's SGD (its hyper-parameters, lr and weight decay); None for other optimizers.
pub fn sgd(config: &Config) -> Option<(SgdConfig, f64, f64)> {
    match optimizer_config(config).as_ref() {
        OptimizerConfig::SGD(p) => Some((
            SgdConfig { momentum: p.momentum, dampening: p.dampening, nesterov: p.nesterov },
            p.lr,
            p.weight_decay,
        )),
        _ => None,
    }
}

pub fn scheduler(config: &Config, base_lr: f64) -> Option<LrScheduler> {
    config.scheduler.clone().map(|s| LrScheduler::new(s, base_lr))
}

/// Where the optimizer's states live (zerorun-offload's tiers: in memory, or on NVMe by sub-group).
pub(crate) type OptimizerTier = Box<dyn zerorun_offload::OptimizerTier>;
