//! SGD with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD computes it.
use crate::dispatch::for_each_chunk;
use crate::shard::{check, Grads, Group, ParamsOut};
use crate::{Optimizer, OptimizerState, Result};

#[derive(Debug, Clone, PartialEq, Default)]
pub struct SgdConfig {
    pub momentum: f32,
    pub dampening: f32,
    pub nesterov: bool,
}

/// SGD over one flat shard: `momentum_buffer` when momentum is on.
pub struct Sgd {
    pub config: SgdConfig,
    state: OptimizerState,
}

impl Sgd {
    pub fn new(config: SgdConfig, len: usize) -> Self {
        let names: &[&str] = if config.momentum != 0.0 { &["momentum_buffer"] } else { &[] };
        Sgd { state: OptimizerState::new(names, len, 0.0), config }
    }
}

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        "SGD"
    }

    fn step(&mut self, params: &mut [f32], grads: Grads<'_>, groups: &[Group], out: Option<ParamsOut<'_>>) -> Result<()> {
        check(params.len(), &grads, groups, out.as_ref())?;
        self.state.step += 1;
        let first = self.state.step == 1;
        let SgdConfig { momentum, dampening, nesterov } = self.config.clone();
        if momentum == 0.0 {
            for_each_chunk(params, grads, groups, [], out, |gi, p, g, []| {
                let (lr, wd) = (groups[gi].lr, groups[gi].weight_decay);
                for (p, g) in p.iter_mut().zip(g) {
                    let d = g + wd * *p;
                    *p -= lr * d;
                }
            });
        } else {
            let [buf] = self.state.split::<1>();
            for_each_chunk(params, grads, groups, [buf], out, |gi, p, g, [buf]| {
                let (lr, wd) = (groups[gi].lr, groups[gi].weight_decay);
                for ((p, g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
                    let d = g + wd * *p;
                    // torch: the buffer starts as a copy of the first gradient.
                    *b = if first { d } else { momentum * *b + (1.0 - dampening) * d };
                    let d = if nesterov { d + momentum * *b } else { *b };
                    *p -= lr * d;
                }
            });
        }
        Ok(())
    }

    fn state(&self) -> &OptimizerState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut OptimizerState {
        &mut self.state
    }
}
