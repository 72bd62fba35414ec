//! Gradient reduction at stages 0-2: stage 0 all-reduces the flat gradient buffer; stages 1-2 reduce-scatter
//! rounds of `reduce_bucket_size` elements (on the communication thread, double-buffered, with `overlap_comm`).
//! [`Engine::reduce_bucket`] is the one reduction of a bucket, shared with the unit walk of stages 2-3.
use tch::Tensor;

use super::{views, Engine};
use crate::comm::ReduceOp;
use crate::config::AllreduceOp;
use crate::error::{Error, Result};

impl Engine {
    /// Copies the gradients of flat elements `range` into `dst` (as long as the range). Padding, and parameters
    /// this step did not use (as DDP's ignore_unused_parameters), give zeros.
    fn gather_grads(&self, dst: &Tensor, range: std::ops::Range<usize>) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            let _ = dst.shallow_clone().f_zero_()?;
            let first = self.layout.slots.partition_point(|s| s.range.end <= range.start);
            for (slot, t) in self.layout.slots[first..].iter().zip(&self.params[first..]) {
                if slot.range.start >= range.end {
                    break;
                }
                let g = t.grad();
                if g.defined() {
                    let (a, b) = (slot.range.start.max(range.start), slot.range.end.min(range.end));
                    let src = g.reshape([-1]).narrow(0, (a - slot.range.start) as i64, (b - a) as i64);
                    dst.narrow(0, (a - range.start) as i64, (b - a) as i64).f_copy_(&src)?;
                }
            }
            Ok(())
        })
    }

    /// Clears the parameters' gradients for the next micro-batch, once `reduce` copied them out (without gradient
    /// views; with views the buffer is zeroed by `consume_grads` once the reduced values were used).
    fn clear_param_grads(&mut self) {
        if self.gradients.grad_buffer.is_some() {
            return;
        }
        for t in &mut self.params {
            t.zero_grad();
        }
    }

    /// Gathers and reduces the gradients: `prescale_gradients` / `gradient_predivide_factor` as DeepSpeed applies
    /// them (divide by the factor before a sum, multiply by factor / world size after), else a mean. Stage 0
    /// all-reduces everything; stages 1-2 reduce-scatter round by round into this rank's partition.
    pub(super) fn reduce(&mut self) -> Result<()> {
        let ws = self.world_size();
        let (op, pre, post) = self.reduce_factors();
        if !self.plan.partitions_optimizer() {
            // With gradient views the gradients are in `flat_grads` already.
            if self.gradients.grad_buffer.is_none() {
                self.gather_grads(&self.gradients.flat_grads, 0..self.layout.padded)?;
            }
            if let Some(pre) = pre {
                let _ = self.gradients.flat_grads.f_mul_scalar_(pre)?;
            }
            views::all_reduce(self.comm.as_ref(), &self.gradients.flat_grads, op)?;
            self.comm_volume.all_reduce_elements += self.layout.padded as u64;
            if let Some(post) = post {
                let _ = self.gradients.flat_grads.f_mul_scalar_(post)?;
            }
            self.clear_param_grads();
            return Ok(());
        }
        if self.comm.thread().is_some() && self.config.zero_optimization.reduce_scatter {
            return self.reduce_overlapped(op, pre, post);
        }
        let part = self.layout.partition_len();
        for c in (0..part).step_by(self.gradients.round_len) {
            let l = self.gradients.round_len.min(part - c);
            let staged = self.gradients.flat_grads.narrow(0, 0, (ws * l) as i64);
            self.stage_round(&staged, c, l)?;
            let out = self.reduced_slice(c, l);
            self.reduce_bucket(&staged, &out)?;
        }
        self.clear_param_grads();
        Ok(())
    }

    /// Copies round `c..c+l` of every rank's partition of the model's gradients into `staged` (`ws * l` long).
    fn stage_round(&self, staged: &Tensor, c: usize, l: usize) -> Result<()> {
        let part = self.layout.partition_len();
        for k in 0..self.world_size() {
            self.gather_grads(&staged.narrow(0, (k * l) as i64, l as i64), k * part + c..k * part + c + l)?;
        }
        Ok(())
    }

    /// Reduces one bucket (`staged`: every rank's part, equal lengths) into this rank's part `out`, with the
    /// predivide rules of [`Engine::reduce_factors`]: a reduce-scatter, or an all-reduce when `reduce_scatter` is
    /// false. Shared by the rounds of stages 1-2 and the units of stages 2-3.
    pub(super) fn reduce_bucket(&mut self, staged: &Tensor, out: &Tensor) -> Result<()> {
        let (op, pre, post) = self.reduce_factors();
        let (n, l) = (staged.numel(), out.numel());
        if let Some(pre) = pre {
            let _ = staged.shallow_clone().f_mul_scalar_(pre)?;
        }
        if self.config.zero_optimization.reduce_scatter {
            views::reduce_scatter(self.comm.as_ref(), staged, out, op)?;
            self.comm_volume.reduce_scatter_elements += n as u64;
        } else {
            views::all_reduce(self.comm.as_ref(), staged, op)?;
            self.comm_volume.all_reduce_elements += n as u64;
            out.shallow_clone().f_copy_(&staged.narrow(0, (self.rank() * l) as i64, l as i64))?;
        }
        if let Some(post) = post {
            let _ = out.shallow_clone().f_mul_scalar_(post)?;
        }
        Ok(())
    }

    /// `overlap_comm` at stages 1-2: the rounds of [`Engine::reduce`] with two staging halves, so round c's
    /// reduce-scatter runs on the communication thread while round c+1 is gathered into the other half.
    fn reduce_overlapped(&mut self, op: ReduceOp, pre: Option<f64>, post: Option<f64>) -> Result<()> {
        let ws = self.world_size();
        let part = self.layout.partition_len();
        let half = ws * self.gradients.round_len;
        let finish = |(h, out): (crate::comm::async_comm::Handle<()>, Tensor)| -> Result<()> {
            h.wait()?;
            if let Some(post) = post {
                let _ = out.shallow_clone().f_mul_scalar_(post)?;
            }
            Ok(())
        };
        let mut pending: Option<(crate::comm::async_comm::Handle<()>, Tensor)> = None;
        for (i, c) in (0..part).step_by(self.gradients.round_len).enumerate() {
            let l = self.gradients.round_len.min(part - c);
            let staged = self.gradients.flat_grads.narrow(0, ((i % 2) * half) as i64, (ws * l) as i64);
            self.stage_round(&staged, c, l)?;
            if let Some(pre) = pre {
                let _ = staged.shallow_clone().f_mul_scalar_(pre)?;
            }
            let out = self.reduced_slice(c, l);
            let thread = self.comm.thread().expect("overlap runs on the communication thread");
            // SAFETY: `staged` (this round's half) and `out` (this round's slice of the partition) are not touched
            // until the handle is waited on: the next round writes the other half, and the one after waits first.
            let handle = unsafe { thread.reduce_scatter_raw(views::buf_mut(&staged).into(), views::buf_mut(&out), op) };
            self.comm_volume.reduce_scatter_elements += (ws * l) as u64;
            if let Some(prev) = pending.replace((handle, out)) {
                finish(prev)?;
            }
        }
        if let Some(prev) = pending {
            finish(prev)?;
        }
        self.clear_param_grads();
        Ok(())
    }

    /// Where elements `c..c+l` of this rank's reduced partition go: in place in the gradient buffer (fp32 with
    /// gradient views: the round's input was copied to staging first), else the communication-dtype partition.
    fn reduced_slice(&self, c: usize, l: usize) -> Tensor {
        match (&self.gradients.grad_part, &self.gradients.grad_buffer) {
            (Some(part), _) => part.narrow(0, c as i64, l as i64),
            (None, Some(g)) => g.narrow(0, (self.optimized.range().start + c) as i64, l as i64),
            (None, None) => unreachable!("stages 1-2 have a partition buffer or gradient views"),
        }
    }

    /// The reduction's op and scale factors: `prescale_gradients` / `gradient_predivide_factor` as DeepSpeed applies
    /// them (multiply by `pre` before a sum, by `post` = factor / world size after), else a plain mean. With
    /// `gradient_allreduce_op` "sum" (stages 0-2; the config refuses it at 3) the ranks' gradients are summed, not
    /// averaged: `post` is the factor alone.
    pub(super) fn reduce_factors(&self) -> (ReduceOp, Option<f64>, Option<f64>) {
        let f = self.config.gradient_predivide_factor;
        if self.config.gradient_allreduce_op == AllreduceOp::Sum {
            let (pre, post) = if f != 1.0 { (Some(1.0 / f), Some(f)) } else { (None, None) };
            return (ReduceOp::Sum, pre, post);
        }
        if self.config.prescale_gradients || f != 1.0 {
            (ReduceOp::Sum, Some(1.0 / f), Some(f / self.world_size() as f64))
        } else {
            (ReduceOp::Avg, None, None)
        }
    }

    /// With `zero_optimization.ignore_unused_parameters` false, a trainable parameter of unit (or bucket) `i` that
    /// got no gradient in this backward is an error naming it (DeepSpeed's check for static graphs). Stages 2-3
    /// only: they see each parameter's gradient as it is reduced; the config notices the key at stages 0-1.
    pub(super) fn check_unused_parameters(&self, i: usize, grads: &[Option<Tensor>]) -> Result<()> {
        if self.config.zero_optimization.ignore_unused_parameters {
            return Ok(());
        }
        let slots = &self.layout.slots[self.units[i].span.slots.clone()];
        match slots.iter().zip(grads).find(|(_, g)| g.is_none()) {
            None => Ok(()),
            Some((slot, _)) => Err(Error::Parameter {
                name: slot.name.clone(),
                why: "got no gradient in this backward (it took no part in the loss), and zero_optimization.ignore_unused_parameters is false".into(),
            }),
        }
    }

    /// fp32 models at the boundary: reduce, and (stages 1-2) take the partition as fp32.
    pub(super) fn reduce_fp32(&mut self) -> Result<()> {
        self.reduce()?;
        if self.grads_in_flat_buffer() {
            return Ok(());
        }
        self.gradients.grad_acc.fill(0.0);
        match &self.gradients.grad_part {
            Some(part) => views::accumulate(&mut self.gradients.grad_acc, part),
            None => views::accumulate(&mut self.gradients.grad_acc, &self.gradients.flat_grads),
        }
        Ok(())
    }

    /// 16-bit models, every micro-batch: reduce, accumulate the optimized range in fp32.
    pub(super) fn reduce_micro_batch(&mut self) -> Result<()> {
        self.reduce()?;
        match &self.gradients.grad_part {
            Some(part) => views::accumulate(&mut self.gradients.grad_acc, part),
            None => views::accumulate(&mut self.gradients.grad_acc, &self.gradients.flat_grads),
        }
        self.consume_grads()
    }

    /// After the gradients were used (the optimizer step, or a micro-batch's accumulation into fp32): with gradient
    /// views, zero the buffer autograd accumulates into (without views, `reduce` cleared the `.grad` tensors).
    pub(super) fn consume_grads(&mut self) -> Result<()> {
        if let Some(g) = &self.gradients.grad_buffer {
            let _ = g.shallow_clone().f_zero_()?;
        }
        Ok(())
    }
}
