//! The optimizer step where the optimized values live on a device, as libtorch kernels on tensors: Adam and AdamW
//! as its fused kernels (`native/fused_adam.cpp`: `_fused_adam_` / `_fused_adamw_`, what
//! `torch.optim.Adam(W)(fused=True)` runs on CPU and CUDA alike), SGD (momentum, dampening, Nesterov, weight
//! decay) as tensor ops, torch.optim.SGD's formula. The states are tensors on the tier's device; the engine hands
//! it the values and gradients where they live ([`DeviceOptimizer::step_tensors`]). Through the host tier
//! interface (slices) the values are staged through device copies. Under device emulation
//! (`ZERORUN_DEVICE_EMULATION=1`) the "device" is the CPU with separate buffers, so every line but the CUDA
//! copies themselves runs in `make test`.
//!
//! The Adam kernels always correct the bias; `bias_correction: false` is refused by name. Checkpoints hold the
//! same state names as zerorun-optim's Adam and SGD, so a run saved here resumes on the host optimizer and back.
use std::ffi::{c_char, c_void};
use std::ops::Range;

use tch::{Device, Kind, Tensor};
use zerorun_offload::{FillState, TierError};
use zerorun_optim::{AdamConfig, Group, ParamsOut, SgdConfig};

use crate::error::{Error, Result};

extern "C" {
    fn zerorun_fused_adam(
        p: *mut c_void,
        g: *mut c_void,
        m: *mut c_void,
        v: *mut c_void,
        max_v: *mut c_void,
        step: *mut c_void,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        amsgrad: i32,
        decoupled: i32,
        err: *mut c_char,
        err_len: i64,
    ) -> i32;
}

/// The hyper-parameters of one fused step.
#[derive(Debug, Clone, Copy)]
pub struct FusedAdamStep {
    /// The step count after this step (bias correction's t, from 1).
    pub step: u64,
    /// The learning rate.
    pub lr: f64,
    /// (beta1, beta2).
    pub betas: (f64, f64),
    /// Weight decay.
    pub weight_decay: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay (AdamW); else L2 added to the gradient (Adam).
    pub decoupled: bool,
}

/// One fused Adam(W) step of `p` (float tensors of one device and length: values, gradient, moments, and the
/// running maximum of `v` under amsgrad). libtorch's kernel; its error becomes the message.
pub fn fused_adam_step(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    max_v: Option<&Tensor>,
    h: FusedAdamStep,
) -> Result<()> {
    let step = Tensor::from(h.step as f32).to_device(p.device());
    let mut err = vec![0u8; 512];
    let handle = |t: &Tensor| t.as_ptr() as *mut c_void;
    // SAFETY: tch's handles point at live at::Tensor objects, which the shim takes; `err` is writable for its length.
    let rc = unsafe {
        zerorun_fused_adam(
            handle(p),
            handle(g),
            handle(m),
            handle(v),
            max_v.map_or(std::ptr::null_mut(), handle),
            handle(&step),
            h.lr,
            h.betas.0,
            h.betas.1,
            h.weight_decay,
            h.eps,
            (max_v.is_some()) as i32,
            h.decoupled as i32,
            err.as_mut_ptr() as *mut c_char,
            err.len() as i64,
        )
    };
    if rc != 0 {
        let text = String::from_utf8_lossy(&err[..err.iter().position(|&b| b == 0).unwrap_or(err.len())]).into_owned();
        return Err(Error::Torch(tch::TchError::Torch(format!("fused Adam step: {text}"))));
    }
    Ok(())
}

/// Which update the device path runs.
#[derive(Debug, Clone)]
enum Rule {
    Adam(AdamConfig),
    Sgd(SgdConfig),
}

/// An optimizer whose states are tensors on `device`, stepped by libtorch's kernels: zerorun-offload's
/// [`zerorun_offload::OptimizerTier`], so the engine steps, checkpoints and reports it as any other.
pub struct DeviceOptimizer {
    rule: Rule,
    /// Adam: exp_avg, exp_avg_sq, and max_exp_avg_sq under amsgrad. SGD: momentum_buffer when momentum is on.
    states: Vec<Tensor>,
    len: usize,
    step: u64,
    device: Device,
}

impl DeviceOptimizer {
    /// Adam(W) with states of `len` elements on `device` (the CPU under emulation). Refuses what the kernels
    /// cannot do.
    pub fn adam(config: AdamConfig, len: usize, device: Device) -> Result<DeviceOptimizer> {
        if !config.bias_correction {
            return Err(Error::Unsupported {
                key: "optimizer.params.bias_correction",
                value: "false".into(),
                why: "the optimizer step on device memory is libtorch's fused Adam, which always corrects the bias",
            });
        }
        let n = if config.amsgrad { 3 } else { 2 };
        Self::with_states(Rule::Adam(config), n, len, device)
    }

    /// SGD with its momentum buffer (when momentum is on) of `len` elements on `device`.
    pub fn sgd(config: SgdConfig, len: usize, device: Device) -> Result<DeviceOptimizer> {
        let n = usize::from(config.momentum != 0.0);
        Self::with_states(Rule::Sgd(config), n, len, device)
    }

    fn with_states(rule: Rule, n: usize, len: usize, device: Device) -> Result<DeviceOptimizer> {
        let states = (0..n)
            .map(|_| Tensor::f_zeros([len as i64], (Kind::Float, device)))
            .collect::<std::result::Result<_, _>>()?;
        Ok(DeviceOptimizer { rule, states, len, step: 0, device })
    }

    /// The device its states live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// One step of the whole optimized range where it lives: `values` (fp32, the parameters or the master) and
    /// `grads` (fp32) are tensors on the states' device, `values` updated in place; `groups` are relative to them.
    pub fn step_tensors(&mut self, values: &Tensor, grads: &Tensor, groups: &[Group]) -> Result<()> {
        self.step += 1;
        self.update_range_tensors(0, values, grads, groups)
    }

    /// Steps the elements `start..start + values.numel()` of the optimized range at the current count (a whole
    /// step from `step_tensors`, or a piece of one begun with `begin_step`); `values` and `grads` on the states'
    /// device.
    pub fn update_range_tensors(
        &mut self,
        start: usize,
        values: &Tensor,
        grads: &Tensor,
        groups: &[Group],
    ) -> Result<()> {
        let end = start + values.numel();
        for group in groups {
            let (lo, hi) = (group.range.start.max(start), group.range.end.min(end));
            if lo >= hi {
                continue;
            }
            let local = |t: &Tensor| t.narrow(0, (lo - start) as i64, (hi - lo) as i64);
            let states: Vec<Tensor> = self.states.iter().map(|t| t.narrow(0, lo as i64, (hi - lo) as i64)).collect();
            let (p, g) = (local(values), local(grads));
            tch::no_grad(|| match &self.rule {
                Rule::Adam(c) => {
                    let h = FusedAdamStep {
                        step: self.step,
                        lr: group.lr,
                        betas: c.betas,
                        weight_decay: group.weight_decay,
                        eps: c.eps,
                        decoupled: c.adam_w_mode,
                    };
                    fused_adam_step(&p, &g, &states[0], &states[1], states.get(2), h)
                }
                Rule::Sgd(c) => sgd_step(c, self.step == 1, &p, &g, states.first(), group),
            })?;
        }
        Ok(())
    }
}

/// One SGD step of `p` with gradient `g` (fp32 tensors of one device), torch.optim.SGD's update: d = g + wd p;
/// with momentum the buffer takes d on the first step, else momentum buf + (1 - dampening) d, and d becomes the
/// buffer (or d + momentum buf, Nesterov); p -= lr d.
fn sgd_step(c: &SgdConfig, first: bool, p: &Tensor, g: &Tensor, buf: Option<&Tensor>, group: &Group) -> Result<()> {
    let d = if group.weight_decay != 0.0 { g.f_add(&p.f_mul_scalar(group.weight_decay)?)? } else { g.shallow_clone() };
    let d = match buf {
        Some(buf) => {
            if first {
                buf.shallow_clone().f_copy_(&d)?;
            } else {
                let _ = buf.shallow_clone().f_mul_scalar_(c.momentum)?.f_add_(&d.f_mul_scalar(1.0 - c.dampening)?)?;
            }
            if c.nesterov {
                d.f_add(&buf.f_mul_scalar(c.momentum)?)?
            } else {
                buf.shallow_clone()
            }
        }
        None => d,
    };
    let _ = p.shallow_clone().f_sub_(&d.f_mul_scalar(group.lr)?)?;
    Ok(())
}

fn tier(e: Error) -> TierError {
    TierError::Fill(Box::new(e))
}

impl zerorun_offload::OptimizerTier for DeviceOptimizer {
    fn name(&self) -> &'static str {
        match &self.rule {
            Rule::Adam(c) if c.adam_w_mode => "AdamW",
            Rule::Adam(_) => "Adam",
            Rule::Sgd(_) => "SGD",
        }
    }

    fn state_names(&self) -> Vec<String> {
        let names: &[&str] = match self.rule {
            Rule::Adam(_) => &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
            Rule::Sgd(_) => &["momentum_buffer"],
        };
        names[..self.states.len()].iter().map(|s| s.to_string()).collect()
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn step(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> std::result::Result<(), TierError> {
        self.step += 1;
        self.update_range(0..params.len(), params, grads, groups, out)
    }

    fn begin_step(&mut self) -> std::result::Result<(), TierError> {
        self.step += 1;
        Ok(())
    }

    fn update_range(
        &mut self,
        range: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> std::result::Result<(), TierError> {
        // Host slices (the tier interface): staged through copies on the states' device.
        let mut staged = || -> Result<()> {
            let p = Tensor::from_slice(params).to_device(self.device);
            let g = Tensor::from_slice(grads).to_device(self.device);
            self.update_range_tensors(range.start, &p, &g, groups)?;
            p.to_device(Device::Cpu).f_copy_data(params, params.len())?;
            Ok(())
        };
        staged().map_err(tier)?;
        if let Some(mut out) = out {
            out.store(params);
        }
        Ok(())
    }

    /// Adam's beta1; SGD's momentum when it has a buffer (plain SGD stays plain, as on the host).
    fn set_momentum(&mut self, momentum: f64) {
        match &mut self.rule {
            Rule::Adam(c) => c.betas.0 = momentum,
            Rule::Sgd(c) if c.momentum != 0.0 => c.momentum = momentum,
            Rule::Sgd(_) => {}
        }
    }

    /// Under emulation the "device" is host memory.
    fn resident_bytes(&self) -> usize {
        if self.device == Device::Cpu {
            self.states.len() * self.len * 4
        } else {
            0
        }
    }

    fn swapped_bytes(&self) -> usize {
        0
    }

    fn write_state(&mut self, index: usize, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        let host = Vec::<f32>::try_from(&self.states[index].to_device(Device::Cpu)).map_err(std::io::Error::other)?;
        w.write_all(bytemuck::cast_slice(&host))
    }

    fn import_from(&mut self, step: u64, fill: &mut FillState<'_>) -> std::result::Result<(), TierError> {
        let len = self.len;
        let mut host: Vec<Vec<f32>> = self.states.iter().map(|_| vec![0f32; len]).collect();
        {
            let mut out: Vec<&mut [f32]> = host.iter_mut().map(|b| b.as_mut_slice()).collect();
            fill(0..len, &mut out)?;
        }
        for (state, values) in self.states.iter_mut().zip(&host) {
            *state = Tensor::from_slice(values).to_device(self.device);
        }
        self.step = step;
        Ok(())
    }
}
