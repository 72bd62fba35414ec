//! SGD with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD computes it.
use std::ops::Range;

use crate::dispatch::{for_each_chunk, Kernel};
use crate::shard::{check_range, Grads, Group, ParamsOut};
use crate::{Optimizer, OptimizerState, Result};

#[derive(Debug, Clone, PartialEq, Default)]
/// SGD's hyper-parameters beside the learning rate and weight decay (in [`Group`](crate::Group)).
pub struct SgdConfig {
    /// Momentum (0: none).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// SGD over one flat shard: `momentum_buffer` when momentum is on.
pub struct Sgd {
    /// Its hyper-parameters.
    pub config: SgdConfig,
    state: OptimizerState,
}

impl Sgd {
    /// SGD over `len` elements, its momentum buffer at zero.
    pub fn new(config: SgdConfig, len: usize) -> Self {
        let names: &[&str] = if config.momentum != 0.0 { &["momentum_buffer"] } else { &[] };
        Sgd { state: OptimizerState::new(names, len, 0.0), config }
    }
}

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        "SGD"
    }

    fn update_range(
        &mut self,
        range: Range<usize>,
        params: &mut [f32],
        grads: Grads<'_>,
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<()> {
        let groups = &check_range(self.state.shard_len(), &range, params.len(), &grads, groups, out.as_ref())?[..];
        let first = self.state.step == 1;
        let SgdConfig { momentum, dampening, nesterov } = self.config.clone();
        let consts: Vec<(f32, f32)> = groups.iter().map(|g| (g.lr as f32, g.weight_decay as f32)).collect();
        if momentum == 0.0 {
            for_each_chunk(params, grads, groups, [], out, &PlainKernel(&consts));
        } else {
            let [buf] = self.state.split_range::<1>(range);
            let k = MomentumKernel {
                consts: &consts,
                momentum: momentum as f32,
                keep: (1.0 - dampening) as f32,
                nesterov,
                first,
            };
            for_each_chunk(params, grads, groups, [buf], out, &k);
        }
        Ok(())
    }

    fn state(&self) -> &OptimizerState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut OptimizerState {
        &mut self.state
    }

    /// Only an SGD built with momentum has the buffer a cycled momentum applies to; plain SGD stays plain.
    fn set_momentum(&mut self, momentum: f64) {
        if self.config.momentum != 0.0 {
            self.config.momentum = momentum;
        }
    }
}

struct PlainKernel<'a>(&'a [(f32, f32)]);

impl Kernel<0> for PlainKernel<'_> {
    #[inline(always)]
    fn run(&self, group: usize, p: &mut [f32], g: &[f32], _: [&mut [f32]; 0]) {
        let (lr, wd) = self.0[group];
        for (p, g) in p.iter_mut().zip(g) {
            let d = g + wd * *p;
            *p -= lr * d;
        }
    }
}

struct MomentumKernel<'a> {
    consts: &'a [(f32, f32)],
    momentum: f32,
    /// 1 - dampening.
    keep: f32,
    nesterov: bool,
    /// torch: the buffer starts as a copy of the first gradient.
    first: bool,
}

impl Kernel<1> for MomentumKernel<'_> {
    #[inline(always)]
    fn run(&self, group: usize, p: &mut [f32], g: &[f32], [buf]: [&mut [f32]; 1]) {
        let (lr, wd) = self.consts[group];
        let (momentum, keep) = (self.momentum, self.keep);
        for ((p, g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
            let d = g + wd * *p;
            *b = if self.first { d } else { momentum * *b + keep * d };
            let d = if self.nesterov { d + momentum * *b } else { *b };
            *p -= lr * d;
        }
    }
}
