//! Adagrad, as torch.optim.Adagrad computes it (lr_decay, initial accumulator, weight decay).
use std::ops::Range;

use crate::dispatch::{for_each_chunk, Kernel};
use crate::shard::{check_range, Grads, Group, ParamsOut};
use crate::{Optimizer, OptimizerState, Result};

#[derive(Debug, Clone, PartialEq)]
/// Adagrad's hyper-parameters beside the learning rate and weight decay (in [`Group`](crate::Group)).
pub struct AdagradConfig {
    /// Added to the denominator.
    pub eps: f64,
    /// Learning-rate decay per step: lr / (1 + (step - 1) * lr_decay).
    pub lr_decay: f64,
    /// The accumulator's value before the first step.
    pub initial_accumulator_value: f64,
}

impl Default for AdagradConfig {
    fn default() -> Self {
        AdagradConfig { eps: 1e-10, lr_decay: 0.0, initial_accumulator_value: 0.0 }
    }
}

/// Adagrad over one flat shard: `sum` of squared gradients.
pub struct Adagrad {
    /// Its hyper-parameters.
    pub config: AdagradConfig,
    state: OptimizerState,
}

impl Adagrad {
    /// Adagrad over `len` elements, its accumulator at `initial_accumulator_value`.
    pub fn new(config: AdagradConfig, len: usize) -> Self {
        Adagrad { state: OptimizerState::new(&["sum"], len, config.initial_accumulator_value as f32), config }
    }
}

impl Optimizer for Adagrad {
    fn name(&self) -> &'static str {
        "Adagrad"
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
        let t = self.state.step;
        let eps = self.config.eps as f32;
        let clrs: Vec<(f32, f32)> = groups
            .iter()
            .map(|g| ((g.lr / (1.0 + (t - 1) as f64 * self.config.lr_decay)) as f32, g.weight_decay as f32))
            .collect();
        let [sum] = self.state.split_range::<1>(range);
        for_each_chunk(params, grads, groups, [sum], out, &AdagradKernel { consts: &clrs, eps });
        Ok(())
    }

    fn state(&self) -> &OptimizerState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut OptimizerState {
        &mut self.state
    }
}

struct AdagradKernel<'a> {
    /// (lr after decay, weight decay) per group.
    consts: &'a [(f32, f32)],
    eps: f32,
}

impl Kernel<1> for AdagradKernel<'_> {
    #[inline(always)]
    fn run(&self, group: usize, p: &mut [f32], g: &[f32], [sum]: [&mut [f32]; 1]) {
        let (clr, wd) = self.consts[group];
        for ((p, g), s) in p.iter_mut().zip(g).zip(sum.iter_mut()) {
            let d = g + wd * *p;
            *s += d * d;
            let std = s.sqrt() + self.eps;
            *p -= clr * (d / std);
        }
    }
}
