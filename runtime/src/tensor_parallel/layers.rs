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

/// Linear with its output features (the weight's rows) split across the group: `y_r = x W_r^T + b_r`. The input
/// goes through `copy_to_region` (its gradient is summed over the group backward); with `gather_output` the parts
/// are all-gathered into the whole output, else each rank keeps its part (for a row-parallel layer next).
pub struct ColumnParallelLinear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub gather_output: bool,
}

impl ColumnParallelLinear {
    /// Variables `weight` [out/T, in] and `bias` [out/T] under `path`: this rank's rows of `nn::linear`'s.
    pub fn new(
        path: &nn::Path,
        tp: &TensorParallel,
        in_dim: i64,
        out_dim: i64,
        bias: bool,
        gather_output: bool,
    ) -> ColumnParallelLinear {
        let (t, r) = (tp.size() as i64, tp.rank() as i64);
        assert!(out_dim % t == 0, "ColumnParallelLinear: {out_dim} output features do not split into {t} ranks");
        let part = out_dim / t;
        let (w, b) = full_linear(in_dim, out_dim, bias);
        let weight = path.var_copy("weight", &w.narrow(0, r * part, part));
        let bias = b.map(|b| path.var_copy("bias", &b.narrow(0, r * part, part)));
        ColumnParallelLinear { weight, bias, gather_output }
    }

    pub fn forward(&self, tp: &TensorParallel, x: &Tensor) -> Result<Tensor> {
        let y = tp.copy_to_region(x)?.linear(&self.weight, self.bias.as_ref());
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
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub input_is_parallel: bool,
}

impl RowParallelLinear {
    /// Variables `weight` [out, in/T] (this rank's columns of `nn::linear`'s) and `bias` [out] (whole) under `path`.
    pub fn new(
        path: &nn::Path,
        tp: &TensorParallel,
        in_dim: i64,
        out_dim: i64,
        bias: bool,
        input_is_parallel: bool,
    ) -> RowParallelLinear {
        let (t, r) = (tp.size() as i64, tp.rank() as i64);
        assert!(in_dim % t == 0, "RowParallelLinear: {in_dim} input features do not split into {t} ranks");
        let part = in_dim / t;
        let (w, b) = full_linear(in_dim, out_dim, bias);
        let weight = path.var_copy("weight", &w.narrow(1, r * part, part));
        let bias = b.map(|b| path.var_copy("bias", &b));
        RowParallelLinear { weight, bias, input_is_parallel }
    }

    pub fn forward(&self, tp: &TensorParallel, x: &Tensor) -> Result<Tensor> {
        let x = if self.input_is_parallel { x.shallow_clone() } else { tp.scatter_to_region(x)? };
        let y = tp.reduce_from_region(&x.linear::<Tensor>(&self.weight, None))?;
        Ok(match &self.bias {
            Some(b) => y + b,
            None => y,
        })
    }
}
