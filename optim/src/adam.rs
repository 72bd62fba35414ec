//! Adam and AdamW, as torch.optim.AdamW computes them (and DeepSpeedCPUAdam, with its `adam_w_mode`).
use std::ops::Range;

use crate::dispatch::{for_each_chunk, Kernel};
use crate::shard::{check_range, Grads, Group, ParamsOut};
use crate::{Optimizer, OptimizerState, Result};

#[derive(Debug, Clone, PartialEq)]
/// Adam's hyper-parameters beside the learning rate and weight decay (in [`Group`](crate::Group)).
pub struct AdamConfig {
    /// The moments' coefficients (beta1, beta2).
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Divides the moments by 1 - beta^step.
    pub bias_correction: bool,
    /// Keeps the largest second moment seen (AMSGrad).
    pub amsgrad: bool,
    /// true: decoupled weight decay (AdamW); false: L2 penalty added to the gradient (classic Adam).
    pub adam_w_mode: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig { betas: (0.9, 0.999), eps: 1e-8, bias_correction: true, amsgrad: false, adam_w_mode: true }
    }
}

/// Adam over one flat shard: `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad).
pub struct Adam {
    /// Its hyper-parameters.
    pub config: AdamConfig,
    state: OptimizerState,
}

impl Adam {
    /// Adam over `len` elements, its moments at zero.
    pub fn new(config: AdamConfig, len: usize) -> Self {
        let names: &[&str] =
            if config.amsgrad { &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"] } else { &["exp_avg", "exp_avg_sq"] };
        Adam { state: OptimizerState::new(names, len, 0.0), config }
    }
}

/// Per-step constants of one group, computed once in f64 and rounded to f32.
#[derive(Clone, Copy)]
struct Consts {
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    step_size: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    decay: f32,
    l2: f32,
}

impl Adam {
    fn consts(&self, t: u64, g: &Group) -> Consts {
        let (b1, b2) = self.config.betas;
        let (bc1, bc2) =
            if self.config.bias_correction { (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32)) } else { (1.0, 1.0) };
        let (lr, wd) = (g.lr, g.weight_decay);
        Consts {
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            step_size: (lr / bc1) as f32,
            bias_correction2_sqrt: bc2.sqrt() as f32,
            eps: self.config.eps as f32,
            decay: if self.config.adam_w_mode { (1.0 - lr * wd) as f32 } else { 1.0 },
            l2: if self.config.adam_w_mode { 0.0 } else { wd as f32 },
        }
    }
}

impl Optimizer for Adam {
    fn name(&self) -> &'static str {
        if self.config.adam_w_mode {
            "AdamW"
        } else {
            "Adam"
        }
    }

    fn update_range(
        &mut self,
        range: Range<usize>,
        params: &mut [f32],
        grads: Grads<'_>,
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<()> {
        let groups = check_range(self.state.shard_len(), &range, params.len(), &grads, groups, out.as_ref())?;
        let t = self.state.step;
        let consts: Vec<Consts> = groups.iter().map(|g| self.consts(t, g)).collect();
        if self.config.amsgrad {
            let [m, v, vmax] = self.state.split_range::<3>(range);
            for_each_chunk(params, grads, &groups, [m, v, vmax], out, &AmsgradKernel(&consts));
        } else {
            let [m, v] = self.state.split_range::<2>(range);
            for_each_chunk(params, grads, &groups, [m, v], out, &AdamKernel(&consts));
        }
        Ok(())
    }

    fn state(&self) -> &OptimizerState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut OptimizerState {
        &mut self.state
    }

    fn set_momentum(&mut self, momentum: f64) {
        self.config.betas.0 = momentum;
    }
}

struct AdamKernel<'a>(&'a [Consts]);
struct AmsgradKernel<'a>(&'a [Consts]);

impl Kernel<2> for AdamKernel<'_> {
    #[inline(always)]
    fn run(&self, group: usize, p: &mut [f32], g: &[f32], [m, v]: [&mut [f32]; 2]) {
        adam_kernel(&self.0[group], p, g, m, v)
    }
}

impl Kernel<3> for AmsgradKernel<'_> {
    #[inline(always)]
    fn run(&self, group: usize, p: &mut [f32], g: &[f32], [m, v, vmax]: [&mut [f32]; 3]) {
        amsgrad_kernel(&self.0[group], p, g, m, v, vmax)
    }
}

// torch: param.mul_(1 - lr*wd); exp_avg.lerp_(grad, 1-beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1-beta2);
// denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps; param.addcdiv_(exp_avg, denom, -step_size).
#[inline(always)]
fn adam_kernel(c: &Consts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let n = p.len();
    let (p, g, m, v) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let grad = g[i] + c.l2 * p[i];
        let pi = p[i] * c.decay;
        let mi = m[i] + c.one_minus_beta1 * (grad - m[i]);
        let vi = c.beta2 * v[i] + c.one_minus_beta2 * grad * grad;
        let denom = vi.sqrt() / c.bias_correction2_sqrt + c.eps;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - c.step_size * (mi / denom);
    }
}

#[inline(always)]
fn amsgrad_kernel(c: &Consts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], vmax: &mut [f32]) {
    let n = p.len();
    let (p, g, m, v, vmax) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n], &mut vmax[..n]);
    for i in 0..n {
        let grad = g[i] + c.l2 * p[i];
        let pi = p[i] * c.decay;
        let mi = m[i] + c.one_minus_beta1 * (grad - m[i]);
        let vi = c.beta2 * v[i] + c.one_minus_beta2 * grad * grad;
        let vm = vmax[i].max(vi);
        let denom = vm.sqrt() / c.bias_correction2_sqrt + c.eps;
        m[i] = mi;
        v[i] = vi;
        vmax[i] = vm;
        p[i] = pi - c.step_size * (mi / denom);
    }
}
