//! Lion (Chen et al. 2023), as DeepSpeed's CPU Lion computes it: sign of an interpolated momentum.
use std::ops::Range;

use crate::dispatch::{for_each_chunk, Kernel};
use crate::shard::{check_range, Grads, Group, ParamsOut};
use crate::{Optimizer, OptimizerState, Result};

#[derive(Debug, Clone, PartialEq)]
/// Lion's hyper-parameters beside the learning rate and weight decay (in [`Group`](crate::Group)).
pub struct LionConfig {
    /// The interpolation (beta1) and momentum (beta2) coefficients.
    pub betas: (f64, f64),
}

impl Default for LionConfig {
    fn default() -> Self {
        LionConfig { betas: (0.9, 0.99) }
    }
}

/// Lion over one flat shard: `exp_avg`.
pub struct Lion {
    /// Its hyper-parameters.
    pub config: LionConfig,
    state: OptimizerState,
}

impl Lion {
    /// Lion over `len` elements, its momentum at zero.
    pub fn new(config: LionConfig, len: usize) -> Self {
        Lion { state: OptimizerState::new(&["exp_avg"], len, 0.0), config }
    }
}

/// torch.sign: -1, 0 or 1 (0 stays 0).
#[inline(always)]
fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

impl Optimizer for Lion {
    fn name(&self) -> &'static str {
        "Lion"
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
        let (b1, b2) = self.config.betas;
        let (c1, k1, c2, k2) = (b1 as f32, (1.0 - b1) as f32, b2 as f32, (1.0 - b2) as f32);
        let consts: Vec<(f32, f32)> =
            groups.iter().map(|g| (g.lr as f32, (1.0 - g.lr * g.weight_decay) as f32)).collect();
        let [m] = self.state.split_range::<1>(range);
        for_each_chunk(params, grads, groups, [m], out, &LionKernel { consts: &consts, c1, k1, c2, k2 });
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

struct LionKernel<'a> {
    /// (lr, 1 - lr * weight decay) per group.
    consts: &'a [(f32, f32)],
    c1: f32,
    k1: f32,
    c2: f32,
    k2: f32,
}

impl Kernel<1> for LionKernel<'_> {
    #[inline(always)]
    fn run(&self, group: usize, p: &mut [f32], g: &[f32], [m]: [&mut [f32]; 1]) {
        let (lr, decay) = self.consts[group];
        for ((p, g), m) in p.iter_mut().zip(g).zip(m.iter_mut()) {
            let c = self.c1 * *m + self.k1 * g;
            *p = *p * decay - lr * sign(c);
            *m = self.c2 * *m + self.k2 * g;
        }
    }
}
