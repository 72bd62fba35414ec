//! 1-bit LAMB (Li et al. 2021, DeepSpeed's `OneBitLamb`): LAMB on averaged gradients for `freeze_step` steps, its
//! trust ratio (the parameter's norm over the update's, clamped to [`min_coeff`, `max_coeff`]) followed by a moving
//! average (`coeff_beta`); then the variance frozen and the momenta, each scaled to a common magnitude, averaged
//! over the ranks one sign bit per value. A compressed step's trust ratio is the frozen average times a factor
//! that tracks how far the frozen variance is from a fresh one (kept from the gradient the exchanged momentum
//! implies), clamped to [`factor_min`, `factor_max`] and to `factor_threshold` of its last value.
//!
//! Every group is one parameter tensor (the engine gives LAMB-type optimizers a group per tensor): LAMB's norms
//! are per tensor. As in zerorun's 1-bit Adam, `bias_correction` does what it says (DeepSpeed's LAMB reads and
//! ignores it), the first step is a step, and the exchanged momentum is masked where the frozen variance is zero.
use std::ops::Range;

use super::{exchange_failed, f32_to_words, mask_never_moved, words_to_f32, ErrorFeedback, Exchange};
use crate::shard::{check, Grads, Group, ParamsOut};
use crate::{OptimError, Optimizer, OptimizerState, Result};

/// 1-bit LAMB's hyper-parameters beside the learning rate and weight decay.
#[derive(Debug, Clone, PartialEq)]
pub struct OneBitLambConfig {
    /// The moments' coefficients.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Divides the moments by 1 - beta^t (the frozen variance's t stops at the freeze).
    pub bias_correction: bool,
    /// Steps of plain LAMB before the momentum travels as signs.
    pub freeze_step: u64,
    /// Bounds of the trust ratio.
    pub max_coeff: f64,
    /// Lower bound of the trust ratio.
    pub min_coeff: f64,
    /// The trust ratio's moving average in the warm-up.
    pub coeff_beta: f64,
    /// Bounds of the compression stage's factor.
    pub factor_max: f64,
    /// Lower bound of that factor.
    pub factor_min: f64,
    /// The factor's largest relative change per step.
    pub factor_threshold: f64,
}

/// Per tensor: the trust ratio's average (frozen at the freeze), the last factor, the momentum's scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TensorScalars {
    coeff_freeze: f64,
    last_factor: f64,
    scaling: f64,
}

/// 1-bit LAMB over one flat shard (stage 0), a group per tensor. State: `exp_avg`, `exp_avg_sq`,
/// `exp_avg_sq_fresh`, this rank's error feedback, and per tensor its scalars.
pub struct OneBitLamb {
    /// Its hyper-parameters.
    pub config: OneBitLambConfig,
    state: OptimizerState,
    exchange: Box<dyn Exchange>,
    errors: ErrorFeedback,
    scalars: Vec<TensorScalars>,
    /// The momentum before this step's update (what the gradient is rebuilt from): scratch, kept between steps.
    last_momentum: Vec<f32>,
}

impl OneBitLamb {
    /// 1-bit LAMB over `len` elements, exchanging through `exchange`.
    pub fn new(config: OneBitLambConfig, len: usize, exchange: Box<dyn Exchange>) -> Self {
        let errors = ErrorFeedback::for_len(exchange.as_ref(), len);
        let state = OptimizerState::new(&["exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"], len, 0.0);
        OneBitLamb { config, state, exchange, errors, scalars: Vec::new(), last_momentum: Vec::new() }
    }

    fn corrections(&self, t: u64) -> (f64, f64, f64) {
        let (b1, b2) = self.config.betas;
        if !self.config.bias_correction {
            return (1.0, 1.0, 1.0);
        }
        let frozen = t.min(self.config.freeze_step);
        (1.0 - b1.powi(t as i32), 1.0 - b2.powi(frozen as i32), 1.0 - b2.powi(t as i32))
    }

    fn warmup(&mut self, params: &mut [f32], grads: Grads<'_>, groups: &[Group], t: u64) {
        let c = self.config.clone();
        let (b1, b2) = (c.betas.0 as f32, c.betas.1 as f32);
        let (bc1, bc2, _) = self.corrections(t);
        let (bc1, bc2_sqrt, eps) = (bc1 as f32, (bc2 as f32).sqrt(), c.eps as f32);
        let [m, v, fresh] = self.state.split::<3>();
        for (g, s) in groups.iter().zip(self.scalars.iter_mut()) {
            let r = g.range.clone();
            let mut grad = vec![0f32; r.len()];
            grads.load(r.clone(), &mut grad);
            let (p, m, v) = (&mut params[r.clone()], &mut m[r.clone()], &mut v[r.clone()]);
            let wd = g.weight_decay as f32;
            let (mut w2, mut u2) = (0f64, 0f64);
            for i in 0..p.len() {
                m[i] = b1 * m[i] + (1.0 - b1) * grad[i];
                v[i] = b2 * v[i] + (1.0 - b2) * grad[i] * grad[i];
                let u = (m[i] / bc1) / (v[i].sqrt() / bc2_sqrt + eps) + wd * p[i];
                w2 += (p[i] as f64).powi(2);
                u2 += (u as f64).powi(2);
            }
            let coeff =
                if w2 > 0.0 && u2 > 0.0 { (w2.sqrt() / u2.sqrt()).clamp(c.min_coeff, c.max_coeff) } else { 1.0 };
            if coeff != 1.0 {
                s.coeff_freeze = c.coeff_beta * s.coeff_freeze + (1.0 - c.coeff_beta) * coeff;
            }
            let step = (g.lr * coeff) as f32;
            for i in 0..p.len() {
                let u = (m[i] / bc1) / (v[i].sqrt() / bc2_sqrt + eps) + wd * p[i];
                p[i] -= step * u;
            }
            if t == c.freeze_step {
                fresh[r.clone()].copy_from_slice(v);
            }
        }
    }

    fn compressed(&mut self, params: &mut [f32], grads: Grads<'_>, groups: &[Group], t: u64) -> Result<()> {
        let c = self.config.clone();
        let (b1, b2) = (c.betas.0 as f32, c.betas.1 as f32);
        let n = params.len();
        if t == c.freeze_step + 1 {
            // Each tensor's momentum scaled to the tensors' mean magnitude, so one scale per exchanged part does
            // not drown the small ones (DeepSpeed's `scaling_coeff`, computed once).
            let m = self.state.get("exp_avg")?;
            let scales: Vec<f64> = groups
                .iter()
                .map(|g| {
                    let sq: f64 = m[g.range.clone()].iter().map(|&x| (x as f64).powi(2)).sum();
                    (sq / g.range.len().max(1) as f64).sqrt()
                })
                .collect();
            let united = scales.iter().sum::<f64>() / scales.len().max(1) as f64;
            for (s, scale) in self.scalars.iter_mut().zip(&scales) {
                s.scaling = if *scale > 0.0 { united / scale } else { 1.0 };
            }
        }
        let mut last = std::mem::take(&mut self.last_momentum);
        last.resize(n, 0.0);
        {
            let [m] = self.state.split::<1>();
            last.copy_from_slice(m);
            for (g, s) in groups.iter().zip(&self.scalars) {
                let r = g.range.clone();
                let mut grad = vec![0f32; r.len()];
                grads.load(r.clone(), &mut grad);
                let scaling = s.scaling as f32;
                for (m, g) in m[r].iter_mut().zip(&grad) {
                    *m = (b1 * *m + (1.0 - b1) * g) * scaling;
                }
            }
            self.exchange.one_bit_average(m, &mut self.errors).map_err(exchange_failed)?;
        }
        let (bc1, bc2, bc2_fresh) = self.corrections(t);
        let (bc1, bc2_sqrt, fresh_sqrt, eps) =
            (bc1 as f32, (bc2 as f32).sqrt(), (bc2_fresh as f32).sqrt(), c.eps as f32);
        let [m, v, fresh] = self.state.split::<3>();
        mask_never_moved(m, v);
        for (g, s) in groups.iter().zip(self.scalars.iter_mut()) {
            let r = g.range.clone();
            let (p, m, v, fresh, last) =
                (&mut params[r.clone()], &mut m[r.clone()], &v[r.clone()], &mut fresh[r.clone()], &last[r]);
            let wd = g.weight_decay as f32;
            let scaling = s.scaling as f32;
            let (mut prelim2, mut u2, mut factor) = (0f64, 0f64, 0f64);
            for i in 0..p.len() {
                m[i] /= scaling;
                // The gradient the averaged momentum implies, for the fresh variance.
                let rebuilt = (m[i] - b1 * last[i]) / (1.0 - b1);
                fresh[i] = b2 * fresh[i] + (1.0 - b2) * rebuilt * rebuilt;
                let denom = v[i].sqrt() / bc2_sqrt + eps;
                let prelim = (m[i] / bc1) / denom;
                let u = prelim + wd * p[i];
                prelim2 += (prelim as f64).powi(2);
                u2 += (u as f64).powi(2);
                let real = fresh[i].sqrt() / fresh_sqrt + eps;
                factor = factor.max((denom / real) as f64);
            }
            if wd > 0.0 && u2 > 0.0 {
                let ratio = (prelim2.sqrt() / u2.sqrt()).min(1.0);
                factor = factor * ratio + (1.0 - ratio);
            }
            factor = factor.clamp(c.factor_min, c.factor_max);
            factor =
                factor.clamp(s.last_factor * (1.0 - c.factor_threshold), s.last_factor * (1.0 + c.factor_threshold));
            s.last_factor = factor;
            let step = (g.lr * s.coeff_freeze * factor) as f32;
            for i in 0..p.len() {
                let denom = v[i].sqrt() / bc2_sqrt + eps;
                let u = (m[i] / bc1) / denom + wd * p[i];
                p[i] -= step * u;
            }
        }
        self.last_momentum = last;
        Ok(())
    }
}

impl Optimizer for OneBitLamb {
    fn name(&self) -> &'static str {
        "OneBitLamb"
    }

    fn step(
        &mut self,
        params: &mut [f32],
        grads: Grads<'_>,
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<()> {
        let n = params.len();
        if self.state.shard_len() != Some(n) {
            return Err(OptimError::Length {
                what: "optimizer state",
                got: self.state.shard_len().unwrap_or(0),
                expected: n,
            });
        }
        check(n, &grads, groups, out.as_ref())?;
        if self.scalars.len() != groups.len() {
            self.scalars = vec![TensorScalars { coeff_freeze: 0.0, last_factor: 1.0, scaling: 1.0 }; groups.len()];
        }
        self.state.step += 1;
        let t = self.state.step;
        if t <= self.config.freeze_step {
            self.warmup(params, grads, groups, t);
        } else {
            self.compressed(params, grads, groups, t)?;
        }
        if let Some(mut out) = out {
            out.store(params);
        }
        Ok(())
    }

    fn update_range(
        &mut self,
        _range: Range<usize>,
        _params: &mut [f32],
        _grads: Grads<'_>,
        _groups: &[Group],
        _out: Option<ParamsOut<'_>>,
    ) -> Result<()> {
        Err(OptimError::NotElementWise { optimizer: "OneBitLamb" })
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

    fn keeps_gradients_local(&self) -> bool {
        self.state.step + 1 > self.config.freeze_step
    }

    fn rank_state(&self) -> Vec<(String, Vec<f32>)> {
        let mut out = self.errors.saved();
        let words: Vec<u64> = self
            .scalars
            .iter()
            .flat_map(|s| [s.coeff_freeze.to_bits(), s.last_factor.to_bits(), s.scaling.to_bits()])
            .collect();
        out.push(("lamb_scalars".into(), words_to_f32(&words)));
        out
    }

    fn load_rank_state(&mut self, name: &str, values: &[f32]) -> Result<()> {
        if self.errors.load(name, values)? {
            return Ok(());
        }
        match name {
            "lamb_scalars" => {
                let w = f32_to_words(values);
                self.scalars = w
                    .chunks_exact(3)
                    .map(|c| TensorScalars {
                        coeff_freeze: f64::from_bits(c[0]),
                        last_factor: f64::from_bits(c[1]),
                        scaling: f64::from_bits(c[2]),
                    })
                    .collect();
                Ok(())
            }
            _ => Err(OptimError::MissingState { name: name.into() }),
        }
    }

    fn reset_rank_state(&mut self) {
        self.errors.reset();
    }
}
