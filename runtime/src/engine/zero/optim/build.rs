//! Builds the zerorun-optim optimizer and LR schedule named by the config.
use zerorun_optim::one_bit::Exchange;
use zerorun_optim::schedule::LrScheduler;
use zerorun_optim::{
    Adagrad, AdagradConfig, Adam, AdamConfig, Lamb, LambConfig, Lion, LionConfig, OneBitAdam, OneBitAdamConfig,
    OneBitLamb, OneBitLambConfig, Optimizer, Sgd, SgdConfig, ZeroOneAdam, ZeroOneAdamConfig,
};

use tch::{Device, Kind, Tensor};
use zerorun_offload::OptimizerTier as _;
use zerorun_optim::{Group, LossScaler, LossScalerConfig};

use crate::config::{Config, OffloadDevice, OptimizerConfig, Precision};
use crate::engine::device::Residence;
use crate::engine::zero::layout::FlatLayout;
use crate::engine::zero::plan::{self, Optimized, StagePlan};
use crate::error::{Error, Result};

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
        OptimizerConfig::OneBitAdam(_) | OptimizerConfig::ZeroOneAdam(_) | OptimizerConfig::OneBitLamb(_) => {
            unreachable!("the 1-bit optimizers are built with their exchange (`one_bit`)")
        }
    }
}

/// The config's 1-bit optimizer over `len` elements, exchanging through `exchange`; None for other optimizers.
/// An optimizer with its configured learning rate and weight decay.
type Built = (Box<dyn Optimizer>, f64, f64);

fn one_bit(config: &Config, len: usize, exchange: Option<Box<dyn Exchange>>) -> Result<Option<Built>> {
    let Some(optimizer) = &config.optimizer else { return Ok(None) };
    let Some(common) = optimizer.one_bit() else { return Ok(None) };
    let (betas, eps, bias_correction) = ((common.betas[0], common.betas[1]), common.eps, common.bias_correction);
    let built: Box<dyn Optimizer> = match optimizer {
        OptimizerConfig::OneBitAdam(p) => Box::new(OneBitAdam::new(
            OneBitAdamConfig { betas, eps, bias_correction, freeze_step: p.freeze_step },
            len,
            exchange,
        )),
        OptimizerConfig::ZeroOneAdam(p) => Box::new(ZeroOneAdam::new(
            ZeroOneAdamConfig {
                betas,
                eps,
                bias_correction,
                var_freeze_step: p.var_freeze_step,
                var_update_scaler: p.var_update_scaler,
                local_step_scaler: p.local_step_scaler,
                local_step_clipper: p.local_step_clipper,
            },
            len,
            exchange.expect("0/1 Adam runs at stage 0, with an exchange"),
        )),
        OptimizerConfig::OneBitLamb(p) => Box::new(OneBitLamb::new(
            OneBitLambConfig {
                betas,
                eps,
                bias_correction,
                freeze_step: p.freeze_step,
                max_coeff: p.max_coeff,
                min_coeff: p.min_coeff,
                coeff_beta: p.coeff_beta,
                factor_max: p.factor_max,
                factor_min: p.factor_min,
                factor_threshold: p.factor_threshold,
            },
            len,
            exchange.expect("1-bit LAMB runs at stage 0, with an exchange"),
        )),
        _ => unreachable!("one_bit() is Some for the three 1-bit optimizers only"),
    };
    Ok(Some((built, common.lr, common.weight_decay)))
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

/// The optimizer over `optimized_len` elements, in memory or with its states on NVMe, its base learning rate and
/// weight decay. The in-memory optimizer is built only without NVMe offload: its states would be the very bytes
/// NVMe offload keeps out of memory. A model on a device (`device`, or any under emulation) without optimizer
/// offload gets the device path's Adam, its states on that device.
pub(crate) fn optimizer_tier(
    config: &Config,
    optimized_len: usize,
    rank: usize,
    engine_id: usize,
    residence: Residence,
    exchange: Option<Box<dyn Exchange>>,
) -> Result<(OptimizerTier, f64, f64)> {
    let z = &config.zero_optimization;
    let device = residence.device();
    if config.optimizer.as_ref().is_some_and(|o| o.one_bit().is_some()) {
        if z.offload_optimizer.device == OffloadDevice::Nvme || residence.device_path() {
            return Err(Error::Unsupported {
                key: "optimizer.type",
                value: format!("\"{}\"", config.optimizer.as_ref().map_or("", |o| o.name())),
                why: "the 1-bit optimizers step the whole momentum in host memory: not with optimizer states on NVMe or on a device (use offload_optimizer.device \"cpu\" for a CUDA model)",
            });
        }
        let (optimizer, lr, wd) = one_bit(config, optimized_len, exchange)?.expect("the config's optimizer is 1-bit");
        return Ok((Box::new(zerorun_offload::InMemory(optimizer)), lr, wd));
    }
    let nvme = z.offload_optimizer.device == OffloadDevice::Nvme;
    let on_device = z.offload_optimizer.device == OffloadDevice::None && residence.device_path();
    let (in_memory, base_lr, weight_decay) = build(config, if nvme || on_device { 0 } else { optimized_len });
    let tier = match z.offload_optimizer.device {
        OffloadDevice::Nvme => {
            let o = &z.offload_optimizer;
            let dir = std::path::PathBuf::from(o.nvme_path.clone().expect("the config requires nvme_path for nvme"));
            let prefix = format!("zerorun-{}-{engine_id}-rank{rank}", std::process::id());
            let swapped = zerorun_offload::SwappedOptimizer::new(
                |len| build(config, len).0,
                optimized_len,
                z.sub_group_size as usize,
                &dir,
                &prefix,
                crate::engine::setup::io_config(config),
                o.buffer_count as usize,
                (o.pipeline_read, o.pipeline_write),
            )?;
            tracing::info!(rank, dir = %dir.display(), bytes = swapped.swapped_bytes(), "optimizer states on NVMe");
            Box::new(swapped) as OptimizerTier
        }
        OffloadDevice::None if on_device => {
            // The device path: the states in device memory (separate CPU tensors under emulation), the step
            // libtorch's kernels.
            use crate::engine::device::optimizer::DeviceOptimizer;
            let (tier, base_lr, weight_decay) = if let Some((adam, lr, wd)) = adam(config) {
                (DeviceOptimizer::adam(adam, optimized_len, device)?, lr, wd)
            } else if let Some((sgd, lr, wd)) = sgd(config) {
                (DeviceOptimizer::sgd(sgd, optimized_len, device)?, lr, wd)
            } else {
                return Err(Error::Unsupported {
                    key: "optimizer.type",
                    value: config.optimizer.as_ref().map_or("AdamW", |o| o.name()).to_string(),
                    why: "the optimizer step on device memory (a CUDA model, or ZERORUN_DEVICE_EMULATION) is Adam/AdamW (libtorch's fused kernels) or SGD; other optimizers step on the host with zero_optimization.offload_optimizer.device = \"cpu\"",
                });
            };
            return Ok((Box::new(tier), base_lr, weight_decay));
        }
        offload => {
            if offload == OffloadDevice::Cpu && device == Device::Cpu {
                tracing::info!(
                    rank,
                    "offload_optimizer.device = cpu: a CPU run keeps optimizer states in host memory already"
                );
            }
            Box::new(zerorun_offload::InMemory(in_memory))
        }
    };
    Ok((tier, base_lr, weight_decay))
}

/// This rank's optimizer side: the values it steps (by the plan), their fp32 master for a 16-bit model (from
/// `flat`, before the shard may move to NVMe), the optimizer and its tier, and the groups with their weight decay;
/// and where that side lives (the fp32 master and accumulator: the model's device or the host).
pub(crate) fn optimizer_shard(
    config: &Config,
    plan: &StagePlan,
    layout: &FlatLayout,
    flat: &Tensor,
    rank: usize,
    residence: Residence,
    exchange: Option<Box<dyn Exchange>>,
) -> Result<(super::OptimizerShard, Device)> {
    let device = residence.device();
    let optimized = plan.optimized(layout, rank);
    let (mut tier, base_lr, weight_decay) =
        optimizer_tier(config, optimized.len(), rank, crate::engine::next_engine_id(), residence, exchange)?;
    // The master lives with the optimizer's states: on the device for the device path's optimizer, else the host.
    let home = if super::steps_on_device(&mut tier) { device } else { Device::Cpu };
    let master = (config.precision() != Precision::Fp32)
        .then(|| -> Result<Tensor> {
            let part = crate::engine::zero::parameters::shard_values(flat, layout, rank, plan, &optimized);
            // A copy of its own (the kind changes), on the optimizer's side; pinned when that is host memory the
            // 16-bit values of a CUDA model are written back from.
            crate::engine::device::staging::pinned_for(
                part.f_to_device(home)?.f_to_kind(Kind::Float)?.f_contiguous()?,
                device,
            )
        })
        .transpose()?;
    // LAMB's trust ratios are per tensor: a group per parameter (stage 0, where the shard is the whole model).
    let per_tensor = matches!(config.optimizer, Some(OptimizerConfig::Lamb(_) | OptimizerConfig::OneBitLamb(_)));
    let runs = match &optimized {
        Optimized::Shard(_) => layout.shard_decay_runs(rank),
        Optimized::Flat(plan::FlatRange(range)) if per_tensor => layout.slot_runs(range.clone()),
        Optimized::Flat(plan::FlatRange(range)) => layout.decay_runs(range.clone()),
    };
    let groups = runs
        .into_iter()
        .map(|(range, decay)| Group { range, lr: base_lr, weight_decay: if decay { weight_decay } else { 0.0 } })
        .collect();
    let shard = super::OptimizerShard {
        optimized,
        master,
        tier,
        groups,
        base_lr,
        scheduler: None,
        scaler: None,
        in_backward: None,
    };
    Ok((shard, home))
}

/// fp16's dynamic (or static) loss scaler, as DeepSpeed configures it.
pub(crate) fn loss_scaler(config: &Config) -> Option<LossScaler> {
    config.fp16.enabled.then(|| {
        let f = &config.fp16;
        LossScaler::new(LossScalerConfig::from_fp16(
            f.loss_scale,
            f.initial_scale_power,
            f.loss_scale_window,
            f.hysteresis,
            f.consecutive_hysteresis,
            f.min_loss_scale,
        ))
    })
}
