//! 0/1 Adam (Lu et al. 2022, DeepSpeed's `ZeroOneAdam`): until `var_freeze_step` the variance is updated only on
//! steps whose gradients are averaged in full precision, at intervals that double every `var_update_scaler`
//! updates; the other steps average the gradient as signs and move only the momentum. After it, the ranks take
//! local steps and meet at intervals that double every `local_step_scaler` steps (at most `local_step_clipper`):
//! what each rank moved since the last meeting, times the frozen denominator, is averaged as signs, and the
//! momentum and the parameters are rebuilt from it.
//!
//! Unlike DeepSpeed, which adds each local move to an accumulator and subtracts it again at the meeting (rounding
//! that differs from rank to rank), zerorun keeps the parameters of the last meeting (`anchor`) and sets every
//! rank's parameters to `anchor + average / denominator`: after a meeting they are bitwise the same on every rank.
use std::ops::Range;

use super::adam::{Consts, Frozen, Momentum};
use super::{exchange_failed, f32_to_words, words_to_f32, ErrorFeedback, Exchange};
use crate::dispatch::{for_each_chunk, Kernel};
use crate::shard::{check, Grads, Group, ParamsOut};
use crate::{OptimError, Optimizer, OptimizerState, Result};

/// 0/1 Adam's hyper-parameters beside the learning rate and weight decay.
#[derive(Debug, Clone, PartialEq)]
pub struct ZeroOneAdamConfig {
    /// The moments' coefficients.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Divides the momentum by 1 - beta1^t and the variance by 1 - beta2^k (k: its updates so far).
    pub bias_correction: bool,
    /// The last step that may update the variance; local steps follow.
    pub var_freeze_step: u64,
    /// The variance-update interval doubles every this many updates.
    pub var_update_scaler: u64,
    /// The local-step interval doubles every this many steps after the freeze.
    pub local_step_scaler: u64,
    /// The largest local-step interval.
    pub local_step_clipper: u64,
}

/// Where the schedules stand (saved with the state, the same on every rank).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Schedule {
    var_interval: u64,
    var_counter: u64,
    var_updates: u64,
    local_interval: u64,
    local_counter: u64,
    /// The learning rates summed since the last meeting (bits of an f64).
    lrs: f64,
    /// Whether the last step ended with every rank's parameters the same (false between local-step meetings).
    met: bool,
}

impl Schedule {
    fn start() -> Schedule {
        Schedule {
            var_interval: 1,
            var_counter: 0,
            var_updates: 0,
            local_interval: 1,
            local_counter: 0,
            lrs: 0.0,
            met: true,
        }
    }

    fn words(&self) -> [u64; 7] {
        [
            self.var_interval,
            self.var_counter,
            self.var_updates,
            self.local_interval,
            self.local_counter,
            self.lrs.to_bits(),
            self.met as u64,
        ]
    }

    fn from_words(w: &[u64]) -> Option<Schedule> {
        (w.len() == 7).then(|| Schedule {
            var_interval: w[0],
            var_counter: w[1],
            var_updates: w[2],
            local_interval: w[3],
            local_counter: w[4],
            lrs: f64::from_bits(w[5]),
            met: w[6] != 0,
        })
    }
}

/// 0/1 Adam over one flat shard (stage 0: the whole model on every rank). State: `exp_avg`, `exp_avg_sq`, `anchor`
/// (the parameters at the last meeting), this rank's error feedback and the schedules.
pub struct ZeroOneAdam {
    /// Its hyper-parameters.
    pub config: ZeroOneAdamConfig,
    state: OptimizerState,
    exchange: Box<dyn Exchange>,
    errors: ErrorFeedback,
    schedule: Schedule,
    /// What is exchanged (the averaged gradient before the freeze, each rank's move at a meeting): kept between
    /// steps, as a fresh shard-sized buffer every step would be the step's page faults.
    scratch: Vec<f32>,
}

impl ZeroOneAdam {
    /// 0/1 Adam over `len` elements, exchanging through `exchange`.
    pub fn new(config: ZeroOneAdamConfig, len: usize, exchange: Box<dyn Exchange>) -> Self {
        let errors = ErrorFeedback::for_len(exchange.as_ref(), len);
        let state = OptimizerState::new(&["exp_avg", "exp_avg_sq", "anchor"], len, 0.0);
        ZeroOneAdam { config, state, exchange, errors, schedule: Schedule::start(), scratch: Vec::new() }
    }

    /// Whether step `t` averages the gradient in full precision and updates the variance.
    fn updates_variance(&self, t: u64) -> bool {
        t <= self.config.var_freeze_step && t % self.schedule.var_interval == 0
    }

    fn consts(&self, t: u64, variance_updates: u64, g: &Group) -> Consts {
        let (b1, b2) = self.config.betas;
        let (bc1, bc2) = if self.config.bias_correction {
            (1.0 - b1.powi(t as i32), 1.0 - b2.powi(variance_updates.max(1) as i32))
        } else {
            (1.0, 1.0)
        };
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

    /// The meeting after local steps: every rank's move since the anchor, times the denominator, averaged as signs;
    /// the momentum and the parameters rebuilt from the average.
    fn meet(&mut self, params: &mut [f32], consts: &[Consts], groups: &[Group]) -> Result<()> {
        let lrs = self.schedule.lrs as f32;
        let [_, v, anchor] = self.state.split::<3>();
        let mut moved = std::mem::take(&mut self.scratch);
        moved.resize(params.len(), 0.0);
        moved.fill(0.0);
        for (g, c) in groups.iter().zip(consts) {
            for i in g.range.clone() {
                moved[i] = (params[i] - anchor[i]) * (v[i].sqrt() / c.bias_correction2_sqrt + c.eps);
            }
        }
        self.exchange.one_bit_average(&mut moved, &mut self.errors).map_err(exchange_failed)?;
        let [m, v, anchor] = self.state.split::<3>();
        super::mask_never_moved(&mut moved, v);
        for (g, c) in groups.iter().zip(consts) {
            for i in g.range.clone() {
                let denom = v[i].sqrt() / c.bias_correction2_sqrt + c.eps;
                // The move was -lrs x the corrected momentum (plus decay): the raw momentum back from it.
                m[i] = -moved[i] / lrs * c.bias_correction1;
                params[i] = anchor[i] + moved[i] / denom;
                anchor[i] = params[i];
            }
        }
        self.schedule.lrs = 0.0;
        self.scratch = moved;
        Ok(())
    }
}

/// A variance step: both moments from the averaged gradient, then the update.
struct VarianceStep<'a>(&'a [Consts]);

impl Kernel<2> for VarianceStep<'_> {
    #[inline(always)]
    fn run(&self, group: usize, p: &mut [f32], g: &[f32], [m, v]: [&mut [f32]; 2]) {
        let c = &self.0[group];
        let n = p.len();
        let (p, g, m, v) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            v[i] = c.beta2 * v[i] + c.one_minus_beta2 * g[i] * g[i];
            m[i] = c.beta1 * m[i] + c.one_minus_beta1 * g[i];
            p[i] = c.apply(p[i], m[i], v[i]);
        }
    }
}

impl Optimizer for ZeroOneAdam {
    fn name(&self) -> &'static str {
        "ZeroOneAdam"
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
        let c = self.config.clone();
        if t <= c.var_freeze_step {
            if self.updates_variance(t) {
                self.schedule.var_updates += 1;
                let consts: Vec<Consts> = groups.iter().map(|g| self.consts(t, self.schedule.var_updates, g)).collect();
                let [m, v] = self.state.split::<2>();
                for_each_chunk(params, grads, groups, [m, v], out, &VarianceStep(&consts));
                self.schedule.var_counter += 1;
                if self.schedule.var_counter == c.var_update_scaler {
                    self.schedule.var_counter = 0;
                    self.schedule.var_interval *= 2;
                }
            } else {
                // The gradient itself, averaged as signs, moves the momentum; the variance waits.
                let consts: Vec<Consts> = groups.iter().map(|g| self.consts(t, self.schedule.var_updates, g)).collect();
                let mut averaged = std::mem::take(&mut self.scratch);
                averaged.resize(n, 0.0);
                grads.load(0..n, &mut averaged);
                self.exchange.one_bit_average(&mut averaged, &mut self.errors).map_err(exchange_failed)?;
                super::mask_never_moved(&mut averaged, self.state.get("exp_avg_sq")?);
                let [m] = self.state.split::<1>();
                for_each_chunk(params, Grads::F32(&averaged), groups, [m], None, &Momentum(&consts));
                let [m, v] = self.state.split::<2>();
                for_each_chunk(params, grads, groups, [m, v], out, &Frozen(&consts));
                self.scratch = averaged;
            }
            self.schedule.met = true;
            return Ok(());
        }
        if t == c.var_freeze_step + 1 {
            // Local steps begin: from these parameters, with fresh errors (DeepSpeed zeroes them here too).
            self.errors.reset();
            let [_, _, anchor] = self.state.split::<3>();
            anchor.copy_from_slice(params);
            self.schedule.lrs = 0.0;
        }
        let consts: Vec<Consts> = groups.iter().map(|g| self.consts(t, self.schedule.var_updates, g)).collect();
        {
            let [m] = self.state.split::<1>();
            for_each_chunk(params, grads, groups, [m], None, &Momentum(&consts));
        }
        {
            let [m, v] = self.state.split::<2>();
            for_each_chunk(params, grads, groups, [m, v], None, &Frozen(&consts));
        }
        self.schedule.lrs += groups.first().map_or(0.0, |g| g.lr);
        let meets = t % self.schedule.local_interval == 0;
        if meets {
            self.meet(params, &consts, groups)?;
        }
        self.schedule.met = meets;
        if let Some(mut out) = out {
            out.store(params);
        }
        self.schedule.local_counter += 1;
        if self.schedule.local_counter == c.local_step_scaler {
            self.schedule.local_counter = 0;
            self.schedule.local_interval = (self.schedule.local_interval * 2).min(c.local_step_clipper);
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
        Err(OptimError::NotElementWise { optimizer: "ZeroOneAdam" })
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
        !self.updates_variance(self.state.step + 1)
    }

    fn ranks_differ(&self) -> Option<String> {
        (!self.schedule.met).then(|| {
            format!(
                "ZeroOneAdam: after {} steps the ranks are between local-step meetings (every {} steps now) and their parameters differ",
                self.state.step, self.schedule.local_interval
            )
        })
    }

    fn rank_state(&self) -> Vec<(String, Vec<f32>)> {
        let mut out = self.errors.saved();
        out.push(("schedule".into(), words_to_f32(&self.schedule.words())));
        out
    }

    fn load_rank_state(&mut self, name: &str, values: &[f32]) -> Result<()> {
        if self.errors.load(name, values)? {
            return Ok(());
        }
        if name == "schedule" {
            self.schedule = Schedule::from_words(&f32_to_words(values)).ok_or(OptimError::Length {
                what: "saved 0/1 Adam schedule",
                got: values.len(),
                expected: 14,
            })?;
            return Ok(());
        }
        Err(OptimError::MissingState { name: name.into() })
    }

    fn reset_rank_state(&mut self) {
        self.errors.reset();
    }
}
