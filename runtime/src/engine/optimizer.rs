//! Builds the zerorun-optim optimizer and LR schedule named by the config.
use zerorun_optim::schedule::LrScheduler;
use zerorun_optim::{
    Adagrad, AdagradConfig, Adam, AdamConfig, Lamb, LambConfig, Lion, LionConfig, Optimizer, Sgd, SgdConfig,
};

use crate::config::{Config, OptimizerConfig};

/// The optimizer for a shard of `len` elements, its base lr and weight decay. No optimizer section: AdamW with
/// DeepSpeed's defaults.
pub fn build(config: &Config, len: usize) -> (Box<dyn Optimizer>, f64, f64) {
    let default = OptimizerConfig::AdamW(crate::config::AdamParams {
        lr: 1e-3,
        betas: [0.9, 0.999],
        eps: 1e-8,
        weight_decay: 0.0,
        bias_correction: true,
        amsgrad: false,
        adam_w_mode: true,
        torch_adam: false,
    });
    match config.optimizer.as_ref().unwrap_or(&default) {
        OptimizerConfig::Adam(p) | OptimizerConfig::AdamW(p) => {
            let c = AdamConfig {
                betas: (p.betas[0], p.betas[1]),
                eps: p.eps,
                bias_correction: p.bias_correction,
                amsgrad: p.amsgrad,
                adam_w_mode: p.adam_w_mode,
            };
            (Box::new(Adam::new(c, len)), p.lr, p.weight_decay)
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
        OptimizerConfig::SGD(p) => {
            let c = SgdConfig { momentum: p.momentum, dampening: p.dampening, nesterov: p.nesterov };
            (Box::new(Sgd::new(c, len)), p.lr, p.weight_decay)
        }
    }
}

pub fn scheduler(config: &Config, base_lr: f64) -> Option<LrScheduler> {
    config.scheduler.clone().map(|s| LrScheduler::new(s, base_lr))
}

/// Writes every state buffer of the optimizer over a range of the optimized elements (checkpoint load).
pub(super) type FillState<'a> = dyn FnMut(std::ops::Range<usize>, &mut [&mut [f32]]) -> crate::Result<()> + 'a;

/// Where the optimizer's states live: host memory (no offload; also `offload_optimizer.device = cpu` on a CPU run,
/// where host memory is the only memory, so nothing is copied), or NVMe, swapped sub-group by sub-group.
pub(super) enum OptimizerTier {
    Memory(Box<dyn Optimizer>),
    Nvme(Box<super::swapped_optimizer::SwappedOptimizer>),
}

impl OptimizerTier {
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerTier::Memory(o) => o.name(),
            OptimizerTier::Nvme(o) => o.name(),
        }
    }

    pub fn state_names(&self) -> Vec<String> {
        match self {
            OptimizerTier::Memory(o) => o.state().buffers.iter().map(|(n, _)| n.clone()).collect(),
            OptimizerTier::Nvme(o) => o.state_names().to_vec(),
        }
    }

    /// Optimizer steps taken (bias correction's t).
    pub fn step_count(&self) -> u64 {
        match self {
            OptimizerTier::Memory(o) => o.state().step,
            OptimizerTier::Nvme(o) => o.step_count(),
        }
    }

    pub fn step(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        groups: &[zerorun_optim::Group],
        out: Option<zerorun_optim::ParamsOut<'_>>,
    ) -> crate::Result<()> {
        match self {
            OptimizerTier::Memory(o) => Ok(o.step(params, zerorun_optim::Grads::F32(grads), groups, out)?),
            OptimizerTier::Nvme(o) => o.step(params, grads, groups, out),
        }
    }

    /// The momentum a schedule cycles (see [`Optimizer::set_momentum`]).
    pub fn set_momentum(&mut self, momentum: f64) {
        match self {
            OptimizerTier::Memory(o) => o.set_momentum(momentum),
            OptimizerTier::Nvme(o) => o.set_momentum(momentum),
        }
    }

    /// State bytes in host memory between steps.
    pub fn resident_bytes(&self) -> usize {
        match self {
            OptimizerTier::Memory(o) => o.state().bytes(),
            OptimizerTier::Nvme(o) => o.resident_bytes(),
        }
    }

    /// State bytes on NVMe.
    pub fn swapped_bytes(&self) -> usize {
        match self {
            OptimizerTier::Memory(_) => 0,
            OptimizerTier::Nvme(o) => o.swapped_bytes(),
        }
    }

    /// Writes state buffer `index` (the optimizer's order, whole range) as little-endian f32: from memory, or read
    /// back from NVMe one sub-group at a time, so a checkpoint never holds the whole state.
    pub fn write_state(&mut self, index: usize, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        match self {
            OptimizerTier::Memory(o) => w.write_all(bytemuck::cast_slice(&o.state().buffers[index].1)),
            OptimizerTier::Nvme(o) => o.write_state(index, w),
        }
    }

    /// Replaces the state (checkpoint load) at optimizer step `step`: `fill(range, buffers)` writes every state
    /// buffer over `range` of the optimized elements. In memory that is one call; on NVMe one per sub-group, each
    /// written to its swap file before the next is read.
    pub fn import_from(&mut self, step: u64, fill: &mut FillState<'_>) -> crate::Result<()> {
        match self {
            OptimizerTier::Memory(o) => {
                let len = o.state().buffers.first().map_or(0, |(_, b)| b.len());
                let mut buffers: Vec<(String, zerorun_optim::AlignedVec)> = o
                    .state()
                    .buffers
                    .iter()
                    .map(|(n, _)| (n.clone(), zerorun_optim::AlignedVec::filled(len, 0.0)))
                    .collect();
                {
                    let mut out: Vec<&mut [f32]> = buffers.iter_mut().map(|(_, b)| b.as_mut_slice()).collect();
                    fill(0..len, &mut out)?;
                }
                Ok(o.state_mut().load(zerorun_optim::OptimizerState { step, buffers })?)
            }
            OptimizerTier::Nvme(o) => o.import_from(step, fill),
        }
    }
}
