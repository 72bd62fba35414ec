//! Megatron-LM's parallel linear layers over a [`TensorParallel`] group. Each rank's weights are cut from the
//! same full initial weights (tch's `nn::linear` initialisation, built whole from the generator and sliced), so a
//! model at tensor-parallel degree T starts exactly where it starts at T = 1 and the two can be compared.
use tch::nn;
use tch::Tensor;

use super::TensorParallel;
use crate::error::Result;

/// `nn::linear`'s weight and bias of `in_dim` -> `out_dim`, built whole (the generator advances as it would).
fn full_linear(in_dim: i64, out_dim: i64, bias: bool) -> (Tensor, Option<Tensor>) {
    let scratch = nn::VarStore::new(tch::Device::Cpu);
    let config = nn::LinearConfig { bias, ..Default::default() };
    let l = nn::linear(scratch.root(), in_dim, out_dim, config);
    (l.ws.detach().copy(), l.bs.map(|b| b.detach().copy()))
}

/// This rank's part of `n` (first index, length): the group's ranks split it evenly, in rank order.
fn this_part(tp: &TensorParallel, n: i64, what: &str) -> (i64, i64) {
    let (t, r) = (tp.size() as i64, tp.rank() as i64);
    assert!(n % t == 0, "{what}: {n} do not split into {t} ranks");
    (r * n / t, n / t)
}

/// Linear with its output features (the weight's rows) split across the group: `y_r = x W_r^T + b_r`. The input
/// goes through `copy_to_region` (its gradient is summed over the group backward); with `gather_output` the parts
/// are all-gathered into the whole output, else each rank keeps its part (for a row-parallel layer next).
pub struct ColumnParallelLinear {
    /// This rank's rows of the weight.
    pub weight: Tensor,
    /// This rank's part of the bias.
    pub bias: Option<Tensor>,
    /// All-gather the parts into the whole output.
    pub gather_output: bool,
}

impl ColumnParallelLinear {
    /// Variables `weight` [out/T, in] and `bias` [out/T] under `path`: this rank's rows of `nn::linear`'s, placed
    /// along dimension 0.
    pub fn new(
        path: &nn::Path,
        tp: &TensorParallel,
        in_dim: i64,
        out_dim: i64,
        bias: bool,
        gather_output: bool,
    ) -> ColumnParallelLinear {
        Self::padded(path, tp, in_dim, (out_dim, out_dim), bias, gather_output)
    }

    /// [`ColumnParallelLinear::new`] with `out_dim` features padded to `padded` (the output layer over a
    /// vocabulary that does not split evenly): built as `nn::linear(in_dim, padded)`, placed with its true size, so
    /// checkpoints and whole copies hold `out_dim` rows.
    pub fn padded(
        path: &nn::Path,
        tp: &TensorParallel,
        in_dim: i64,
        (out_dim, padded): (i64, i64),
        bias: bool,
        gather_output: bool,
    ) -> ColumnParallelLinear {
        assert!(padded >= out_dim, "ColumnParallelLinear: {out_dim} features padded to {padded}, fewer");
        let (start, part) = this_part(tp, padded, "ColumnParallelLinear: output features");
        let (w, b) = full_linear(in_dim, padded, bias);
        let place = |name: &str| match padded > out_dim {
            true => tp.place_padded(path.path(name), 0, out_dim),
            false => tp.place(path.path(name), 0),
        };
        let weight = path.var_copy("weight", &w.narrow(0, start, part));
        place("weight");
        let bias = b.map(|b| {
            place("bias");
            path.var_copy("bias", &b.narrow(0, start, part))
        });
        ColumnParallelLinear { weight, bias, gather_output }
    }

    /// The layer on an input that already went through `copy_to_region` (several column-parallel layers reading
    /// one input, as attention's query, key and value, share one copy: one all-reduce backward, not three).
    pub fn forward_copied(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, self.bias.as_ref())
    }

    /// `x W_r^T + b_r` (all-gathered with `gather_output`).
    pub fn forward(&self, tp: &TensorParallel, x: &Tensor) -> Result<Tensor> {
        let y = self.forward_copied(&tp.copy_to_region(x)?);
        if self.gather_output {
            tp.gather_from_region(&y)
        } else {
            Ok(y)
        }
    }
}

/// Linear with its input features (the weight's columns) split across the group: each rank multiplies its part
/// of the input, `reduce_from_region` sums the parts, and the bias (whole on every rank) is added once after the
/// sum. With `input_is_parallel` the input is already this rank's part (a column-parallel layer's output), else it
/// is cut with `scatter_to_region`.
pub struct RowParallelLinear {
    /// This rank's columns of the weight.
    pub weight: Tensor,
    /// The bias, whole on every rank.
    pub bias: Option<Tensor>,
    /// The input is already this rank's part.
    pub input_is_parallel: bool,
}

impl RowParallelLinear {
    /// Variables `weight` `[out, in/T]` (this rank's columns of `nn::linear`'s) and `bias` `[out]` (whole) under `path`.
    pub fn new(
        path: &nn::Path,
        tp: &TensorParallel,
        in_dim: i64,
        out_dim: i64,
        bias: bool,
        input_is_parallel: bool,
    ) -> RowParallelLinear {
        let (start, part) = this_part(tp, in_dim, "RowParallelLinear: input features");
        let (w, b) = full_linear(in_dim, out_dim, bias);
        let weight = path.var_copy("weight", &w.narrow(1, start, part));
        tp.place(path.path("weight"), 1);
        let bias = b.map(|b| path.var_copy("bias", &b));
        RowParallelLinear { weight, bias, input_is_parallel }
    }

    /// The sum over the group of `x_r W_r^T`, plus the bias.
    pub fn forward(&self, tp: &TensorParallel, x: &Tensor) -> Result<Tensor> {
        let x = if self.input_is_parallel { x.shallow_clone() } else { tp.scatter_to_region(x)? };
        let y = tp.reduce_from_region(&x.linear::<Tensor>(&self.weight, None))?;
        Ok(match &self.bias {
            Some(b) => y + b,
            None => y,
        })
    }
}

/// An embedding whose vocabulary is split across the group: rank r holds rows `[r V/T, (r + 1) V/T)`, looks up
/// the ids in its range (the others read row 0 and are zeroed), and `reduce_from_region` sums the ranks' lookups,
/// so every rank ends with the whole embedding of every id.
pub struct VocabParallelEmbedding {
    /// This rank's rows.
    pub weight: Tensor,
    /// This rank's first row (vocabulary id).
    pub start: i64,
}

impl VocabParallelEmbedding {
    /// Variable `weight` [V/T, dim] under `path`: this rank's rows of `nn::embedding`'s.
    pub fn new(path: &nn::Path, tp: &TensorParallel, vocab: i64, dim: i64) -> VocabParallelEmbedding {
        Self::padded(path, tp, (vocab, vocab), dim)
    }

    /// [`VocabParallelEmbedding::new`] with the vocabulary padded to `padded` rows so it splits evenly (ids past
    /// `vocab` never occur): built as `nn::embedding(padded, dim)`, placed with its true size, so checkpoints and
    /// whole copies hold `vocab` rows.
    pub fn padded(
        path: &nn::Path,
        tp: &TensorParallel,
        (vocab, padded): (i64, i64),
        dim: i64,
    ) -> VocabParallelEmbedding {
        assert!(padded >= vocab, "VocabParallelEmbedding: a vocabulary of {vocab} padded to {padded}, fewer");
        let (start, part) = this_part(tp, padded, "VocabParallelEmbedding: vocabulary ids");
        let scratch = nn::VarStore::new(tch::Device::Cpu);
        let full = nn::embedding(scratch.root(), padded, dim, Default::default()).ws.detach().copy();
        match padded > vocab {
            true => tp.place_padded(path.path("weight"), 0, vocab),
            false => tp.place(path.path("weight"), 0),
        }
        VocabParallelEmbedding { weight: path.var_copy("weight", &full.narrow(0, start, part)), start }
    }

    /// The embedding of every id in `ids`, whole on every rank.
    pub fn forward(&self, tp: &TensorParallel, ids: &Tensor) -> Result<Tensor> {
        let rows = self.weight.size()[0];
        let local = ids - self.start;
        let outside = local.lt(0).logical_or(&local.ge(rows));
        let looked_up = Tensor::embedding(&self.weight, &local.masked_fill(&outside, 0), -1, false, false);
        tp.reduce_from_region(&looked_up.masked_fill(&outside.unsqueeze(-1), 0.0))
    }
}

/// Cross-entropy of logits split along the vocabulary (the last dimension; this rank's part starts at `start`)
/// against `targets`, as Megatron-LM's vocab-parallel cross-entropy: the maximum, the target's logit and the sum
/// of exponentials are all-reduced, so the whole logits never exist on one rank. `vocab` is the true vocabulary:
/// the logits of ids past it (a padded layer's) take no part, so a padded model computes what the unpadded one
/// does and its padding stays inert (unlike Megatron-LM's, whose padding logits enter the softmax). Returns the mean
/// over targets, equal on every rank.
pub fn vocab_parallel_cross_entropy(
    tp: &TensorParallel,
    logits: &Tensor,
    targets: &Tensor,
    start: i64,
    vocab: i64,
) -> Result<Tensor> {
    let part = *logits.size().last().expect("logits have a vocabulary dimension");
    let (logits, targets) = (logits.reshape([-1, part]), targets.reshape([-1]));
    let logits = if start + part > vocab {
        let padding = Tensor::arange(part, (tch::Kind::Int64, logits.device())).ge(vocab - start);
        logits.masked_fill(&padding, f64::NEG_INFINITY)
    } else {
        logits
    };
    // The maximum only shifts the exponentials (its gradient cancels): taken without one.
    let local_max = logits.detach().amax(-1, true);
    // The ranks' maxima side by side ([n, T]), then the largest.
    let max = tch::no_grad(|| tp.gather_from_region(&local_max))?.amax(-1, true);
    let shifted = &logits - &max;
    let local = &targets - start;
    let outside = local.lt(0).logical_or(&local.ge(part));
    let picked = shifted.gather(1, &local.masked_fill(&outside, 0).unsqueeze(-1), false).squeeze_dim(-1);
    let target_logit = tp.reduce_from_region(&picked.masked_fill(&outside, 0.0))?;
    let sum_exp = tp.reduce_from_region(&shifted.exp().sum_dim_intlist(-1, false, logits.kind()))?;
    Ok((sum_exp.log() - target_logit).mean(logits.kind()))
}
