//! 1-bit Adam: Adam on averaged gradients for `freeze_step` steps, then the variance frozen and the momentum,
//! updated from this rank's own gradient, averaged over the ranks one sign bit per value.
use std::ops::Range;

use super::{exchange_failed, ErrorFeedback, Exchange};
use crate::dispatch::{for_each_chunk, Kernel};
use crate::shard::{check, Grads, Group, ParamsOut};
use crate::{OptimError, Optimizer, OptimizerState, Result};

/// 1-bit Adam's hyper-parameters beside the learning rate and weight decay (in [`Group`]).
#[derive(Debug, Clone, PartialEq)]
pub struct OneBitAdamConfig {
    /// The moments' coefficients.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Divides the momentum by 1 - beta1^t and the variance by 1 - beta2^t (t frozen with the variance).
    pub bias_correction: bool,
    /// Steps of plain Adam on averaged gradients; from the next step on the momentum travels as signs.
    pub freeze_step: u64,
}

/// 1-bit Adam over one flat shard (the whole model: every rank steps all of it, stage 0; or at stages 1-2 the
/// engine's sharded form). State: `exp_avg`, `exp_avg_sq`, and this rank's error feedback.
pub struct OneBitAdam {
    /// Its hyper-parameters.
    pub config: OneBitAdamConfig,
    state: OptimizerState,
    /// None: the sharded form (ZeRO stage 1), where the engine averages the gradient as signs before the step and
    /// gathers the step's change as signs after it; the momentum here is then exact.
    exchange: Option<Box<dyn Exchange>>,
    errors: ErrorFeedback,
}

impl OneBitAdam {
    /// 1-bit Adam over `len` elements, exchanging its momentum through `exchange` (stage 0), or over a partition
    /// whose gradient and change the engine exchanges (`None`, stage 1).
    pub fn new(config: OneBitAdamConfig, len: usize, exchange: Option<Box<dyn Exchange>>) -> Self {
        let errors = exchange.as_deref().map(|e| ErrorFeedback::for_len(e, len)).unwrap_or_default();
        OneBitAdam { config, state: OptimizerState::new(&["exp_avg", "exp_avg_sq"], len, 0.0), exchange, errors }
    }

    /// Whether step `t` (from 1) exchanges the momentum compressed.
    fn compresses(&self, t: u64) -> bool {
        t > self.config.freeze_step
    }

    fn consts(&self, t: u64, g: &Group) -> Consts {
        let (b1, b2) = self.config.betas;
        // The variance stops at the freeze: its correction stops with it.
        let tv = t.min(self.config.freeze_step.max(1));
        let (bc1, bc2) =
            if self.config.bias_correction { (1.0 - b1.powi(t as i32), 1.0 - b2.powi(tv as i32)) } else { (1.0, 1.0) };
        Consts {
            beta1: b1 as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            bias_correction1: bc1 as f32,
            bias_correction2_sqrt: bc2.sqrt() as f32,
            eps: self.config.eps as f32,
            lr: g.lr as f32,
            decay: g.weight_decay as f32,
        }
    }
}

/// Per-step constants of one group, computed in f64 and rounded once.
#[derive(Clone, Copy)]
pub(crate) struct Consts {
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub bias_correction1: f32,
    pub bias_correction2_sqrt: f32,
    pub eps: f32,
    pub lr: f32,
    pub decay: f32,
}

impl Consts {
    /// DeepSpeed's update: `p -= lr * (m / (sqrt(v) + eps) + wd * p)`, the moments bias-corrected.
    #[inline(always)]
    pub fn apply(&self, p: f32, m: f32, v: f32) -> f32 {
        let denom = v.sqrt() / self.bias_correction2_sqrt + self.eps;
        let update = (m / self.bias_correction1) / denom + self.decay * p;
        p - self.lr * update
    }
}

/// Warm-up: both moments from the averaged gradient, then the update.
pub(crate) struct Warmup<'a>(pub &'a [Consts]);
/// The momentum alone, from this rank's gradient (before it is exchanged).
pub(crate) struct Momentum<'a>(pub &'a [Consts]);
/// The update from the exchanged momentum and the frozen variance.
pub(crate) struct Frozen<'a>(pub &'a [Consts]);

impl Kernel<2> for Warmup<'_> {
    #[inline(always)]
    fn run(&self, group: usize, p: &mut [f32], g: &[f32], [m, v]: [&mut [f32]; 2]) {
        let c = &self.0[group];
        let n = p.len();
        let (p, g, m, v) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            m[i] = c.beta1 * m[i] + c.one_minus_beta1 * g[i];
            v[i] = c.beta2 * v[i] + c.one_minus_beta2 * g[i] * g[i];
            p[i] = c.apply(p[i], m[i], v[i]);
        }
    }
}

impl Kernel<1> for Momentum<'_> {
    #[inline(always)]
    fn run(&self, group: usize, _p: &mut [f32], g: &[f32], [m]: [&mut [f32]; 1]) {
        let c = &self.0[group];
        let n = m.len();
        let (g, m) = (&g[..n], &mut m[..n]);
        for i in 0..n {
            m[i] = c.beta1 * m[i] + c.one_minus_beta1 * g[i];
        }
    }
}

impl Kernel<2> for Frozen<'_> {
    #[inline(always)]
    fn run(&self, group: usize, p: &mut [f32], _g: &[f32], [m, v]: [&mut [f32]; 2]) {
        let c = &self.0[group];
        let n = p.len();
        let (p, m, v) = (&mut p[..n], &m[..n], &v[..n]);
        for i in 0..n {
            p[i] = c.apply(p[i], m[i], v[i]);
        }
    }
}

impl Optimizer for OneBitAdam {
    fn name(&self) -> &'static str {
        "OneBitAdam"
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
        self.state.step += 1;
        let t = self.state.step;
        let consts: Vec<Consts> = groups.iter().map(|g| self.consts(t, g)).collect();
        if !self.compresses(t) {
            let [m, v] = self.state.split::<2>();
            for_each_chunk(params, grads, groups, [m, v], out, &Warmup(&consts));
            return Ok(());
        }
        {
            let [m] = self.state.split::<1>();
            for_each_chunk(params, grads, groups, [m], None, &Momentum(&consts));
        }
        if let Some(exchange) = self.exchange.as_mut() {
            let [m] = self.state.split::<1>();
            exchange.one_bit_average(m, &mut self.errors).map_err(exchange_failed)?;
        }
        let [m, v] = self.state.split::<2>();
        super::mask_never_moved(m, v);
        for_each_chunk(params, grads, groups, [m, v], out, &Frozen(&consts));
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
        // The compressed step exchanges the whole momentum before any element can be updated.
        Err(OptimError::NotElementWise { optimizer: "OneBitAdam" })
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
        self.compresses(self.state.step + 1)
    }

    fn rank_state(&self) -> Vec<(String, Vec<f32>)> {
        match self.exchange {
            Some(_) => self.errors.saved(),
            None => Vec::new(),
        }
    }

    fn load_rank_state(&mut self, name: &str, values: &[f32]) -> Result<()> {
        if self.errors.load(name, values)? {
            return Ok(());
        }
        Err(OptimError::MissingState { name: name.into() })
    }

    fn reset_rank_state(&mut self) {
        self.errors.reset();
    }
}
