//! PowerSGD (Vogels, Karimireddy and Jaggi 2019), as PyTorch's DDP communication hook computes it
//! (`torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py`), over stage 0's flat gradient buffer: each
//! parameter's gradient seen as a matrix n x m (its first dimension by the rest) is averaged as P Q^T with P n x r
//! and Q m x r, after one step of power iteration from the last step's Q (warm start):
//!
//! 1. `M += error` (error feedback); Q orthogonalized; `P = M Q`; P all-reduced (summed); P orthogonalized;
//! 2. `Q = M^T P`, all-reduced and divided by the world size; the average is `P Q^T`, the same on every rank;
//! 3. `error = M - P Q^T` (this rank's own).
//!
//! Vectors, and matrices for which (n + m) r x `min_compression_rate` >= n m, are averaged whole, in one all-reduce.
//! The first `start_powerSGD_iter` steps average everything whole. Three all-reduces a step where PyTorch runs them
//! per bucket: zerorun's flat buffer is one bucket.
//!
//! Differences from PyTorch: Q's first values come from zerorun's own generator (splitmix64 and Box-Muller, seeded
//! by `random_seed`: the same on every rank without touching libtorch's generator); orthogonalization is always
//! Gram-Schmidt (PyTorch uses a QR factorization above rank 2); the error is kept for the compressed matrices only
//! (PyTorch's also holds `local - average` of the uncompressed ones, which averages to zero over the ranks).
use std::ops::Range;

use tch::{Kind, Tensor};

use crate::comm::{coding, Communicator, ReduceOp};
use crate::config::PowerSgd as Options;
use crate::engine::device::{views, Residence};
use crate::engine::zero::layout::FlatLayout;
use crate::error::Result;

/// One compressed gradient: where it is in the flat buffer, its matrix shape, and its Q (m x r, fp32), kept for
/// the next step's warm start.
struct Compressed {
    range: Range<usize>,
    n: i64,
    m: i64,
    q: Tensor,
}

/// PowerSGD's state over one engine's flat gradients.
pub(crate) struct PowerSgd {
    options: Options,
    /// Steps reduced so far (PyTorch's `iter`).
    iter: u64,
    compressed: Vec<Compressed>,
    /// Ranges of the flat buffer averaged whole (vectors, matrices too small to gain).
    whole: Vec<Range<usize>>,
    /// What the approximation left out of this rank's gradient (flat, fp32; zero outside compressed ranges).
    error: Option<Tensor>,
    /// Q's generator (splitmix64 state).
    rng: u64,
    /// Whether Q holds a previous step's values (warm start).
    warm: bool,
}

impl PowerSgd {
    /// PowerSGD over the trainable parameters of `layout` (stage 0: the whole flat buffer on every rank).
    pub fn new(options: Options, layout: &FlatLayout) -> PowerSgd {
        let (mut compressed, mut whole) = (Vec::new(), Vec::new());
        for slot in &layout.slots {
            let numel = slot.range.len() as i64;
            let n = slot.shape.first().copied().unwrap_or(1).max(1);
            let m = numel / n;
            let r = (options.matrix_approximation_rank as i64).min(n).min(m);
            // PyTorch's rule: compress when the factors are min_compression_rate times smaller than the matrix.
            let gains = slot.shape.len() > 1 && ((n + m) * r) as f64 * options.min_compression_rate < (n * m) as f64;
            if gains {
                compressed.push(Compressed {
                    range: slot.range.clone(),
                    n,
                    m,
                    q: Tensor::zeros([m, r], (Kind::Float, tch::Device::Cpu)),
                });
            } else {
                whole.push(slot.range.clone());
            }
        }
        let error =
            options.use_error_feedback.then(|| Tensor::zeros([layout.padded as i64], (Kind::Float, tch::Device::Cpu)));
        let rng = options.random_seed ^ 0x5eed_0f00_9e37_79b9;
        let factors: i64 = compressed.iter().map(|c| (c.n + c.m) * c.q.size()[1]).sum();
        let sent = factors as usize + whole.iter().map(Range::len).sum::<usize>();
        tracing::info!(
            compressed = compressed.len(),
            whole = whole.len(),
            elements_per_step = sent,
            of = layout.numel,
            "PowerSGD from step {}: each step all-reduces {:.1}% of the gradients' elements",
            options.start_powersgd_iter + 1,
            100.0 * sent as f64 / layout.numel.max(1) as f64
        );
        PowerSgd { options, iter: 0, compressed, whole, error, rng, warm: false }
    }

    /// Whether the next reduction is compressed.
    pub fn compresses_next(&self) -> bool {
        self.iter >= self.options.start_powersgd_iter
    }

    /// Counts a reduction the engine runs itself, when it is not compressed yet (stage 1 reduce-scatters the
    /// first `start_powerSGD_iter` steps' gradients as plain stage 1 does): true then; false when this one is to be
    /// compressed, through [`PowerSgd::average`].
    pub fn pass_uncompressed(&mut self) -> bool {
        let plain = !self.compresses_next();
        if plain {
            self.iter += 1;
        }
        plain
    }

    /// Averages `flat` (this rank's gradients in the layout, stage 0's staging buffer) over `comm`: exactly for
    /// the first `start_powerSGD_iter` calls, then as PowerSGD. Collective. Returns the elements all-reduced.
    pub fn average(&mut self, residence: Residence, comm: &dyn Communicator, flat: &Tensor) -> Result<usize> {
        let compress = self.compresses_next();
        self.iter += 1;
        if !compress || comm.world_size() == 1 {
            views::all_reduce(residence, comm, flat, ReduceOp::Avg)?;
            return Ok(flat.numel());
        }
        tch::no_grad(|| self.compressed_average(residence, comm, flat))
    }

    fn compressed_average(&mut self, residence: Residence, comm: &dyn Communicator, flat: &Tensor) -> Result<usize> {
        let _ = residence;
        let world = comm.world_size() as f64;
        let eps = self.options.orthogonalization_epsilon;
        // fp32 on the host: the buffer itself for an fp32 host model, else a copy.
        let mut g = flat.f_to_device(tch::Device::Cpu)?.f_to_kind(Kind::Float)?;
        if let Some(e) = &self.error {
            let _ = g.f_add_(e)?;
        }
        // What is averaged whole, in one all-reduce.
        let whole: Vec<Tensor> = self.whole.iter().map(|r| g.narrow(0, r.start as i64, r.len() as i64)).collect();
        let mut sent = 0;
        if !whole.is_empty() {
            let joined = Tensor::f_cat(&whole, 0)?;
            views::all_reduce(Residence::Host, comm, &joined, ReduceOp::Avg)?;
            sent += joined.numel();
            let mut at = 0;
            for (r, part) in self.whole.iter().zip(&whole) {
                part.shallow_clone().f_copy_(&joined.narrow(0, at, r.len() as i64))?;
                at += r.len() as i64;
            }
        }
        // Q: last step's (warm start) or fresh, orthogonalized; P = M Q, summed over the ranks, orthogonalized.
        if !(self.options.warm_start && self.warm) {
            for c in &self.compressed {
                let values: Vec<f32> = (0..c.q.numel()).map(|_| normal(&mut self.rng)).collect();
                c.q.shallow_clone().f_copy_(&Tensor::from_slice(&values).view([c.m, c.q.size()[1]]))?;
            }
            self.warm = true;
        }
        // The products with the thin factors run here, one pass over each matrix per product (MKL's skinny gemms
        // took several times as long on one core), in a fixed order, so every rank computes P Q^T identically.
        // SAFETY: `g` is this call's fp32 host buffer (or the engine's, untouched during the reduction), and the
        // factors are this state's own contiguous tensors; no other view of them is used while these are.
        // The factor arithmetic runs on the coding clock, the all-reduces between it on the wire's (the breakdown's
        // `compression` phase and its reduction phase).
        let values = unsafe { views::slice::<f32>(&g) };
        let ps = coding::timed(|| -> Result<Vec<Tensor>> {
            let mut ps = Vec::with_capacity(self.compressed.len());
            for c in &self.compressed {
                orthogonalize(&c.q, eps)?;
                let qt = c.q.f_tr()?.f_contiguous()?;
                let p = Tensor::f_zeros([c.n, c.q.size()[1]], (Kind::Float, tch::Device::Cpu))?;
                let m = &values[c.range.clone()];
                // SAFETY: as above.
                unsafe { times_q(m, c.m as usize, views::slice::<f32>(&qt), views::slice::<f32>(&p)) };
                ps.push(p);
            }
            Ok(ps)
        })?;
        sent += all_reduce_joined(comm, &ps, ReduceOp::Sum)?;
        // Q = M^T P, averaged: M's average is P Q^T on every rank.
        let qts = coding::timed(|| -> Result<Vec<Tensor>> {
            for p in &ps {
                orthogonalize(p, eps)?;
            }
            let mut qts = Vec::with_capacity(self.compressed.len());
            for (c, p) in self.compressed.iter().zip(&ps) {
                let qt = Tensor::f_zeros([c.q.size()[1], c.m], (Kind::Float, tch::Device::Cpu))?;
                let m = &values[c.range.clone()];
                // SAFETY: as above.
                unsafe { transposed_times_p(m, c.m as usize, views::slice::<f32>(p), views::slice::<f32>(&qt)) };
                qts.push(qt);
            }
            Ok(qts)
        })?;
        sent += all_reduce_joined(comm, &qts, ReduceOp::Sum)?;
        coding::timed(|| -> Result<()> {
            let mut row = vec![0f32; self.compressed.iter().map(|c| c.m as usize).max().unwrap_or(0)];
            for ((c, p), qt) in self.compressed.iter().zip(&ps).zip(&qts) {
                let _ = qt.shallow_clone().f_div_scalar_(world)?;
                c.q.shallow_clone().f_copy_(&qt.f_tr()?)?;
                let m = &mut values[c.range.clone()];
                // SAFETY: the error buffer is this state's own, viewed only here.
                let error = self.error.as_ref().map(|e| &mut unsafe { views::slice::<f32>(e) }[c.range.clone()]);
                // SAFETY: as above.
                unsafe {
                    approximate(m, views::slice::<f32>(p), views::slice::<f32>(qt), error, &mut row[..c.m as usize])
                };
            }
            Ok(())
        })?;
        // Back into the engine's buffer, in its dtype and on its device (nothing to do when `g` is the buffer).
        if g.data_ptr() != flat.data_ptr() {
            flat.shallow_clone().f_copy_(&g)?;
        }
        Ok(sent)
    }

    /// The state a checkpoint keeps: `powersgd_error` (this rank's), `powersgd_q` (every Q, the same on every
    /// rank) and `powersgd_schedule` (the step count, bitwise).
    pub fn saved(&self) -> Vec<(String, Vec<f32>)> {
        let mut out = Vec::new();
        if let Some(e) = &self.error {
            out.push(("powersgd_error".to_string(), Vec::<f32>::try_from(e).unwrap_or_default()));
        }
        let qs: Vec<f32> =
            self.compressed.iter().flat_map(|c| Vec::<f32>::try_from(c.q.reshape([-1])).unwrap_or_default()).collect();
        out.push(("powersgd_q".to_string(), qs));
        let words = [self.iter, self.rng, self.warm as u64];
        out.push((
            "powersgd_schedule".to_string(),
            words.iter().flat_map(|w| [f32::from_bits(*w as u32), f32::from_bits((*w >> 32) as u32)]).collect(),
        ));
        out
    }

    /// Restores one buffer [`PowerSgd::saved`] named; false for names that are not PowerSGD's.
    pub fn load(&mut self, name: &str, values: &[f32]) -> Result<bool> {
        let wrong = |expected: usize| {
            crate::error::Error::Usage(format!(
                "the checkpoint's `{name}` has {} values, this run's PowerSGD {expected}: another model or rank",
                values.len()
            ))
        };
        match name {
            "powersgd_error" => {
                let Some(e) = &self.error else { return Ok(true) };
                if values.len() != e.numel() {
                    return Err(wrong(e.numel()));
                }
                e.shallow_clone().f_copy_(&Tensor::from_slice(values))?;
            }
            "powersgd_q" => {
                let total: usize = self.compressed.iter().map(|c| c.q.numel()).sum();
                if values.len() != total {
                    return Err(wrong(total));
                }
                let mut at = 0;
                for c in &self.compressed {
                    let k = c.q.numel();
                    c.q.shallow_clone().f_copy_(&Tensor::from_slice(&values[at..at + k]).view([c.m, c.q.size()[1]]))?;
                    at += k;
                }
            }
            "powersgd_schedule" => {
                if values.len() != 6 {
                    return Err(wrong(6));
                }
                let w: Vec<u64> =
                    values.chunks(2).map(|c| c[0].to_bits() as u64 | (c[1].to_bits() as u64) << 32).collect();
                (self.iter, self.rng, self.warm) = (w[0], w[1], w[2] != 0);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Zeroes this rank's error (a resume at another world size).
    pub fn reset_error(&mut self) {
        if let Some(e) = &self.error {
            let _ = e.shallow_clone().f_zero_();
        }
    }
}

/// What PowerSGD cannot run with, refused at initialize by name (the config refuses stages 2-3 itself): shard
/// groups, and a 16-bit model where the optimizer is partitioned.
pub(crate) fn check(
    config: &crate::Config,
    plan: &crate::engine::zero::plan::StagePlan,
    precision: crate::config::Precision,
    replicas: usize,
) -> Result<()> {
    if config.gradient_compression.powersgd().is_none() {
        return Ok(());
    }
    let refuse = |why: &'static str| {
        Err(crate::error::Error::Unsupported { key: "gradient_compression.type", value: "\"powersgd\"".into(), why })
    };
    if replicas > 1 {
        return refuse("PowerSGD averages over one group of every data-parallel rank; shard groups (mics_shard_size) split it in two levels");
    }
    if plan.partitions_optimizer() && precision != crate::config::Precision::Fp32 {
        return refuse("at stage 1 a 16-bit model's gradients are reduce-scattered every micro-batch, in its dtype, into an fp32 partition; PowerSGD averages the whole fp32 gradient once a step: train fp32, or at stage 0");
    }
    Ok(())
}

/// `p = M q` for M (rows of `cols` values) and q given transposed (`qt`, r rows of `cols`): p is rows x r.
fn times_q(m: &[f32], cols: usize, qt: &[f32], p: &mut [f32]) {
    let r = qt.len() / cols;
    for (i, row) in m.chunks_exact(cols).enumerate() {
        for k in 0..r {
            p[i * r + k] = dot(row, &qt[k * cols..(k + 1) * cols]);
        }
    }
}

/// `qt = (M^T p)^T`: for every row i of M, `qt[k] += p[i][k] * row` (qt starts at zero).
fn transposed_times_p(m: &[f32], cols: usize, p: &[f32], qt: &mut [f32]) {
    let r = qt.len() / cols;
    for (i, row) in m.chunks_exact(cols).enumerate() {
        for k in 0..r {
            axpy(&mut qt[k * cols..(k + 1) * cols], p[i * r + k], row);
        }
    }
}

/// Row by row: `approx = p[i] qt`; `error = M - approx` (when kept); `M = approx`. `row` is scratch of `cols`.
fn approximate(m: &mut [f32], p: &[f32], qt: &[f32], mut error: Option<&mut [f32]>, row: &mut [f32]) {
    let cols = row.len();
    let r = qt.len() / cols;
    for (i, values) in m.chunks_exact_mut(cols).enumerate() {
        row.fill(0.0);
        for k in 0..r {
            axpy(row, p[i * r + k], &qt[k * cols..(k + 1) * cols]);
        }
        if let Some(e) = error.as_deref_mut() {
            for ((e, v), a) in e[i * cols..(i + 1) * cols].iter_mut().zip(values.iter()).zip(row.iter()) {
                *e = v - a;
            }
        }
        values.copy_from_slice(row);
    }
}

/// `sum a_j b_j` in eight f32 lanes (a fixed order that vectorizes).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            lanes[k] += x[k] * y[k];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `y += a x`.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// All-reduces `parts` (fp32 tensors) as one joined buffer and writes the result back into them; returns the
/// elements reduced.
fn all_reduce_joined(comm: &dyn Communicator, parts: &[Tensor], op: ReduceOp) -> Result<usize> {
    if parts.is_empty() {
        return Ok(0);
    }
    let flat: Vec<Tensor> = parts.iter().map(|p| p.reshape([-1])).collect();
    let joined = Tensor::f_cat(&flat, 0)?;
    views::all_reduce(Residence::Host, comm, &joined, op)?;
    let mut at = 0;
    for p in parts {
        let k = p.numel() as i64;
        p.shallow_clone().f_copy_(&joined.narrow(0, at, k).view(p.size().as_slice()))?;
        at += k;
    }
    Ok(joined.numel())
}

/// Gram-Schmidt on the columns of `m` in place (PyTorch's `_orthogonalize_gram_schmidt`): each column divided by
/// its norm (plus `eps`), then removed from the columns after it.
fn orthogonalize(m: &Tensor, eps: f64) -> Result<()> {
    let cols = m.size()[1];
    for i in 0..cols {
        let col = m.narrow(1, i, 1);
        let norm = col.f_norm()?;
        let _ = col.shallow_clone().f_div_(&(norm + eps))?;
        if i + 1 < cols {
            let rest = m.narrow(1, i + 1, cols - i - 1);
            let dots = col.f_mul(&rest)?.f_sum_dim_intlist(0, true, Kind::Float)?;
            let _ = rest.shallow_clone().f_sub_(&col.f_mul(&dots)?)?;
        }
    }
    Ok(())
}

/// A standard normal value (Box-Muller over splitmix64), the same sequence on every rank for one seed.
fn normal(state: &mut u64) -> f32 {
    let mut next = || {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let (u, v) = (next().max(f64::MIN_POSITIVE), next());
    ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::threads;

    /// Every rank's gradient of the matrix is u_r v^T (the same v): their average is rank 1, and one power
    /// iteration of rank 1 gives it exactly (PyTorch's test of its hook uses such gradients); the vector is averaged
    /// whole. The 8 x 2 matrix is too small to gain and is averaged whole too.
    #[test]
    fn a_rank_one_average_comes_back_exactly_and_small_tensors_whole() {
        let layout = FlatLayout::new(
            &[("w".into(), vec![16, 32], true), ("b".into(), vec![16], false), ("s".into(), vec![8, 2], true)],
            1,
        );
        let options = Options { matrix_approximation_rank: 1, start_powersgd_iter: 0, ..Options::default() };
        let v: Vec<f32> = (0..32).map(|j| ((j * 7 % 11) as f32 - 5.0) / 5.0).collect();
        let grads = |r: usize| -> Vec<f32> {
            let mut g = vec![0f32; layout.padded];
            for i in 0..16 {
                for j in 0..32 {
                    g[i * 32 + j] = (i as f32 + 1.0 + r as f32 * 0.5) * v[j];
                }
            }
            for i in 0..16 + 16 {
                g[512 + i] = (i * (r + 1)) as f32;
            }
            g
        };
        let world = 3;
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = threads::group(world, std::time::Duration::from_secs(20))
                .into_iter()
                .map(|c| {
                    let (layout, grads) = (&layout, &grads);
                    s.spawn(move || {
                        let mut p = PowerSgd::new(options, layout);
                        let flat = Tensor::from_slice(&grads(c.rank()));
                        p.average(Residence::Host, &c, &flat).unwrap();
                        Vec::<f32>::try_from(flat).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let expected: Vec<f32> =
            (0..layout.padded).map(|k| (0..world).map(|r| grads(r)[k]).sum::<f32>() / world as f32).collect();
        for got in &results {
            let worst = got.iter().zip(&expected).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0f32, f32::max);
            assert!(worst < 1e-5, "relative difference {worst}");
            assert_eq!(got, &results[0], "every rank ends with the same values");
        }
    }
}
