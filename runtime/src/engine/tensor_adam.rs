//! Adam and AdamW as libtorch's fused kernels on tensors (`native/fused_adam.cpp`: `_fused_adam_` /
//! `_fused_adamw_`, what `torch.optim.Adam(W)(fused=True)` runs on CPU and CUDA alike): the optimizer step where
//! the states live in device memory. The states are tensors on the tier's device; the optimized values and
//! gradients arrive in host memory and are staged through device copies, as a device engine's host-resident
//! buffers would be. Under device emulation (`ZERORUN_DEVICE_EMULATION=1` or [`super::EngineOptions`]) the
//! "device" is the CPU with separate buffers, so every line but the CUDA copies themselves runs in `make test`.
//!
//! The kernels always correct the bias; `bias_correction: false` is refused by name. Checkpoints hold the same
//! state names as zerorun-optim's Adam, so a run saved here resumes on the host optimizer and back.
use std::ffi::{c_char, c_void};
use std::ops::Range;

use tch::{Device, Kind, Tensor};
use zerorun_offload::{FillState, TierError};
use zerorun_optim::{AdamConfig, Group, ParamsOut};

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
    pub lr: f64,
    pub betas: (f64, f64),
    pub weight_decay: f64,
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

/// Adam(W) whose states are tensors on `device`, stepped by libtorch's fused kernel: zerorun-offload's
/// [`zerorun_offload::OptimizerTier`], so the engine steps, checkpoints and reports it as any other.
pub struct TensorAdam {
    config: AdamConfig,
    /// exp_avg, exp_avg_sq, and max_exp_avg_sq under amsgrad.
    states: Vec<Tensor>,
    step: u64,
    device: Device,
}

impl TensorAdam {
    /// States of `len` elements on `device` (the CPU under emulation). Refuses what the kernels cannot do.
    pub fn new(config: AdamConfig, len: usize, device: Device) -> Result<TensorAdam> {
        if !config.bias_correction {
            return Err(Error::Unsupported {
                key: "optimizer.params.bias_correction",
                value: "false".into(),
                why: "the optimizer step on device memory is libtorch's fused Adam, which always corrects the bias",
            });
        }
        let n = if config.amsgrad { 3 } else { 2 };
        let states = (0..n).map(|_| Tensor::zeros([len as i64], (Kind::Float, device))).collect();
        Ok(TensorAdam { config, states, step: 0, device })
    }

    fn len(&self) -> usize {
        self.states[0].numel()
    }

    /// The device its states live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// One step of the whole optimized range where it lives: `values` (fp32, the parameters or the master) and
    /// `grads` (fp32) are tensors on the states' device, `values` updated in place; `groups` are relative to them.
    pub fn step_tensors(&mut self, values: &Tensor, grads: &Tensor, groups: &[Group]) -> Result<()> {
        self.step += 1;
        self.update_tensors(0, values, grads, groups)
    }

    /// Steps the elements `start..start + values.numel()` of the optimized range at the current count (a step
    /// begun with `begin_step`), `values` and `grads` on the states' device: a piece of a step taken in pieces.
    pub fn update_range_tensors(
        &mut self,
        start: usize,
        values: &Tensor,
        grads: &Tensor,
        groups: &[Group],
    ) -> Result<()> {
        self.update_tensors(start, values, grads, groups)
    }

    /// Steps the elements `start..start + values.numel()` of the optimized range at the current count.
    fn update_tensors(&mut self, start: usize, values: &Tensor, grads: &Tensor, groups: &[Group]) -> Result<()> {
        let end = start + values.numel();
        for group in groups {
            let (lo, hi) = (group.range.start.max(start), group.range.end.min(end));
            if lo >= hi {
                continue;
            }
            let local = |t: &Tensor| t.narrow(0, (lo - start) as i64, (hi - lo) as i64);
            let state = |t: &Tensor| t.narrow(0, lo as i64, (hi - lo) as i64);
            let max_v = self.states.get(2).map(state);
            let h = FusedAdamStep {
                step: self.step,
                lr: group.lr,
                betas: self.config.betas,
                weight_decay: group.weight_decay,
                eps: self.config.eps,
                decoupled: self.config.adam_w_mode,
            };
            tch::no_grad(|| {
                fused_adam_step(
                    &local(values),
                    &local(grads),
                    &state(&self.states[0]),
                    &state(&self.states[1]),
                    max_v.as_ref(),
                    h,
                )
            })?;
        }
        Ok(())
    }

    /// Steps elements `range` of the optimized values at the current count: `params` and `grads` hold the range's
    /// elements (host memory), staged through copies on the tier's device; `groups` are relative to the whole.
    fn update(
        &mut self,
        range: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<()> {
        let p = Tensor::from_slice(params).to_device(self.device);
        let g = Tensor::from_slice(grads).to_device(self.device);
        self.update_tensors(range.start, &p, &g, groups)?;
        p.to_device(Device::Cpu).f_copy_data(params, params.len())?;
        if let Some(mut out) = out {
            out.store(params);
        }
        Ok(())
    }
}

fn tier(e: Error) -> TierError {
    TierError::Fill(Box::new(e))
}

impl zerorun_offload::OptimizerTier for TensorAdam {
    fn name(&self) -> &'static str {
        if self.config.adam_w_mode {
            "AdamW"
        } else {
            "Adam"
        }
    }

    fn state_names(&self) -> Vec<String> {
        ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"][..self.states.len()].iter().map(|s| s.to_string()).collect()
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
        self.update(0..params.len(), params, grads, groups, out).map_err(tier)
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
        self.update(range, params, grads, groups, out).map_err(tier)
    }

    fn set_momentum(&mut self, momentum: f64) {
        self.config.betas.0 = momentum;
    }

    /// Under emulation the "device" is host memory.
    fn resident_bytes(&self) -> usize {
        if self.device == Device::Cpu {
            self.states.len() * self.len() * 4
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
        let len = self.len();
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
