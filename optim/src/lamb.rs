//! LAMB (You et al. 2019), as DeepSpeed's FusedLamb computes it: an Adam update scaled per group by the trust
//! ratio ||w|| / ||update||, clamped to [min_coeff, max_coeff].
//!
//! The norms are per parameter tensor. When a tensor is split across ranks, each rank holds part of it: the
//! engine passes a `reduce` callback that sums the per-group squared norms over ranks before they are used.
use rayon::prelude::*;

use crate::dispatch::{Disjoint, STAGE, TILE};
use crate::shard::{check, Grads, Group, ParamsOut};
use crate::{Optimizer, OptimizerState, Result};

#[derive(Debug, Clone, PartialEq)]
/// Lamb's hyper-parameters beside the learning rate and weight decay (in [`Group`](crate::Group)).
pub struct LambConfig {
    /// The moments' coefficients (beta1, beta2).
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Divides the moments by 1 - beta^step.
    pub bias_correction: bool,
    /// Adds eps inside the square root of the second moment.
    pub eps_inside_sqrt: bool,
    /// Upper bound of the trust ratio.
    pub max_coeff: f64,
    /// Lower bound of the trust ratio.
    pub min_coeff: f64,
}

impl Default for LambConfig {
    fn default() -> Self {
        LambConfig {
            betas: (0.9, 0.999),
            eps: 1e-8,
            bias_correction: true,
            eps_inside_sqrt: false,
            max_coeff: 10.0,
            min_coeff: 0.01,
        }
    }
}

/// LAMB over one flat shard: `exp_avg`, `exp_avg_sq`. The trust ratio of the last step is kept per group.
pub struct Lamb {
    /// Its hyper-parameters.
    pub config: LambConfig,
    state: OptimizerState,
    /// Trust ratios of the last step, one per group.
    pub last_coeffs: Vec<f64>,
}

impl Lamb {
    /// Lamb over `len` elements, its moments at zero.
    pub fn new(config: LambConfig, len: usize) -> Self {
        Lamb { state: OptimizerState::new(&["exp_avg", "exp_avg_sq"], len, 0.0), config, last_coeffs: Vec::new() }
    }

    /// One step; `reduce` receives `[w_sq(g0), u_sq(g0), w_sq(g1), ...]` (this shard's squared norms, f64) and
    /// must replace them by their sum over the ranks that share the groups' tensors.
    pub fn step_with_reduce(
        &mut self,
        params: &mut [f32],
        grads: Grads<'_>,
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
        reduce: &mut dyn FnMut(&mut [f64]),
    ) -> Result<()> {
        check(params.len(), &grads, groups, out.as_ref())?;
        self.state.step += 1;
        let t = self.state.step as i32;
        let c = self.config.clone();
        let (b1, b2) = c.betas;
        let (bc1, bc2) = if c.bias_correction { (1.0 - b1.powi(t), 1.0 - b2.powi(t)) } else { (1.0, 1.0) };
        let (bc1, bc2, eps) = (bc1 as f32, bc2 as f32, c.eps as f32);
        let (c1, k1, c2, k2) = (b1 as f32, (1.0 - b1) as f32, b2 as f32, (1.0 - b2) as f32);
        let update = move |m: f32, v: f32, p: f32, wd: f32| -> f32 {
            let (mh, vh) = (m / bc1, v / bc2);
            let denom = if c.eps_inside_sqrt { (vh + eps).sqrt() } else { vh.sqrt() + eps };
            mh / denom + wd * p
        };
        let [m, v] = self.state.split::<2>();
        let (pd, md, vd) = (Disjoint::new(params), Disjoint::new(m), Disjoint::new(v));

        // Pass 1: moments, and the squared norms of params and updates per group (summed tile by tile in a fixed
        // order, so the result does not depend on the thread count).
        let mut norms = vec![0f64; groups.len() * 2];
        for (gi, group) in groups.iter().enumerate() {
            let wd = group.weight_decay as f32;
            let tiles: Vec<_> = (group.range.start..group.range.end)
                .step_by(TILE)
                .map(|s| s..(s + TILE).min(group.range.end))
                .collect();
            let partial: Vec<(f64, f64)> = tiles
                .par_iter()
                .map(|tile| {
                    {
                        let (mut w2, mut u2) = (0f64, 0f64);
                        let mut g = [0f32; STAGE];
                        for s in tile.clone().step_by(STAGE) {
                            let r = s..(s + STAGE).min(tile.end);
                            let g = &mut g[..r.len()];
                            grads.load(r.clone(), g);
                            // SAFETY: tiles and chunks are disjoint ranges of the shard.
                            let (p, m, v) = unsafe { (pd.range(r.clone()), md.range(r.clone()), vd.range(r.clone())) };
                            for i in 0..g.len() {
                                m[i] = c1 * m[i] + k1 * g[i];
                                v[i] = c2 * v[i] + k2 * g[i] * g[i];
                                let u = update(m[i], v[i], p[i], wd);
                                w2 += (p[i] as f64) * (p[i] as f64);
                                u2 += (u as f64) * (u as f64);
                            }
                        }
                        (w2, u2)
                    }
                })
                .collect();
            for (w2, u2) in partial {
                norms[2 * gi] += w2;
                norms[2 * gi + 1] += u2;
            }
        }
        reduce(&mut norms);
        self.last_coeffs = (0..groups.len())
            .map(|gi| {
                let (w, u) = (norms[2 * gi].sqrt(), norms[2 * gi + 1].sqrt());
                if w > 0.0 && u > 0.0 {
                    (w / u).clamp(c.min_coeff, c.max_coeff)
                } else {
                    1.0
                }
            })
            .collect();

        // Pass 2: apply the scaled update (recomputed from the new moments; params are still the old ones).
        let coeffs = &self.last_coeffs;
        let mut out = out;
        for (gi, group) in groups.iter().enumerate() {
            let step = (group.lr * coeffs[gi]) as f32;
            let wd = group.weight_decay as f32;
            let r = group.range.clone();
            // SAFETY: groups are disjoint (checked); one group at a time here.
            let (p, m, v) = unsafe { (pd.range(r.clone()), md.range(r.clone()), vd.range(r.clone())) };
            p.par_chunks_mut(TILE).zip(m.par_chunks(TILE)).zip(v.par_chunks(TILE)).for_each(|((p, m), v)| {
                for i in 0..p.len() {
                    let u = update(m[i], v[i], p[i], wd);
                    p[i] -= step * u;
                }
            });
            match out.as_mut() {
                Some(ParamsOut::Bf16(o)) => o[r.clone()]
                    .iter_mut()
                    .zip(p.iter())
                    .for_each(|(d, s)| *d = half::bf16::from_bits(crate::dispatch::bf16_bits(*s))),
                Some(ParamsOut::F16(o)) => half::slice::HalfFloatSliceExt::convert_from_f32_slice(&mut o[r.clone()], p),
                None => {}
            }
        }
        Ok(())
    }
}

impl Optimizer for Lamb {
    fn name(&self) -> &'static str {
        "Lamb"
    }

    fn step(
        &mut self,
        params: &mut [f32],
        grads: Grads<'_>,
        groups: &[Group],
        out: Option<ParamsOut<'_>>,
    ) -> Result<()> {
        self.step_with_reduce(params, grads, groups, out, &mut |_| {})
    }

    fn update_range(
        &mut self,
        _range: std::ops::Range<usize>,
        _params: &mut [f32],
        _grads: Grads<'_>,
        _groups: &[Group],
        _out: Option<ParamsOut<'_>>,
    ) -> Result<()> {
        Err(crate::OptimError::NotElementWise { optimizer: "Lamb" })
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
