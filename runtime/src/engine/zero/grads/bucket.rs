//! A gradient bucket and the one way every bucket is reduced (Megatron's bucket: it knows its staging range, starts
//! its own collective and finishes it). Stage 1's rounds, the unit walk of stages 2-3 and stage 2's hooked buckets
//! all stage their gradients into a half of the staging buffer and hand a [`Bucket`] to the [`BucketQueue`]: it
//! applies the predivide, reduce-scatters (on the communication thread when there is one) or all-reduces, and on
//! finishing applies the post-factor and lands the result ([`Landing`]): added to the fp32 accumulator, or stepped
//! at once by the optimizer in backward. With two halves, one bucket reduces while the next is staged.
use crate::engine::device::{flat_math, Residence};
use tch::Tensor;

use crate::comm::async_comm::Handle;
use crate::comm::ReduceOp;
use crate::config::{AllreduceOp, Config};
use crate::engine::counters::CommVolume;
use crate::engine::device::views;
use crate::engine::engine_comm::{EngineComm, Replicas};
use crate::engine::zero::optim::in_backward::StepPart;
use crate::error::Result;

/// How gradients are combined across ranks: `prescale_gradients` / `gradient_predivide_factor` as DeepSpeed applies
/// them (multiply by `pre` before a sum, by `post` = factor / world size after), else a plain mean. With
/// `gradient_allreduce_op` "sum" (stages 0-2; the config refuses it at 3) the ranks' gradients are summed, not
/// averaged: `post` is the factor alone. With shard groups the reduction continues across the replicas with the
/// same operation, and the world size is every data-parallel rank's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reduction {
    pub op: ReduceOp,
    pub pre: Option<f64>,
    pub post: Option<f64>,
    /// `zero_optimization.reduce_scatter`: false all-reduces each bucket and keeps this rank's part.
    pub scatter: bool,
    pub rank: usize,
    /// `async_training` local SGD / DiLoCo: gradients stay this rank's (the ranks meet by their parameters).
    pub local: bool,
    /// Where the buckets live (the engine's residence).
    pub residence: Residence,
    /// `zero_quantized_gradients`: the reduce-scatter's parts travel as int8 blocks of this many values.
    pub quantized: Option<usize>,
}

impl Reduction {
    pub fn new(config: &Config, rank: usize, world_size: usize, residence: Residence) -> Reduction {
        let f = config.gradient_predivide_factor;
        let (op, pre, post) = if config.gradient_allreduce_op == AllreduceOp::Sum {
            if f != 1.0 {
                (ReduceOp::Sum, Some(1.0 / f), Some(f))
            } else {
                (ReduceOp::Sum, None, None)
            }
        } else if config.prescale_gradients || f != 1.0 {
            (ReduceOp::Sum, Some(1.0 / f), Some(f / world_size as f64))
        } else {
            (ReduceOp::Avg, None, None)
        };
        let local = config.async_training.is_local();
        let quantized = config.zero_optimization.zero_quantized_gradients.then_some(crate::comm::quantized::BLOCK);
        Reduction { op, pre, post, scatter: config.zero_optimization.reduce_scatter, rank, local, residence, quantized }
    }
}

impl Reduction {
    /// The bucket's reduce-scatter and, with shard groups, the all-reduce of this rank's part across the replicas;
    /// with `zero_quantized_gradients` the reduce-scatter is quantized, or with shard groups the all-reduce.
    fn reduce(
        &self,
        comm: &dyn crate::comm::Communicator,
        replicas: Option<&Replicas>,
        staged: &Tensor,
        out: &Tensor,
    ) -> crate::comm::CommResult<()> {
        // With shard groups the quantized step is the one across them (a group is a host's ranks, typically).
        match (self.quantized, replicas) {
            (Some(block), None) => views::reduce_scatter_quantized(self.residence, comm, staged, out, self.op, block),
            _ => views::reduce_scatter(self.residence, comm, staged, out, self.op),
        }?;
        match replicas {
            Some(r) => r.all_reduce(self.residence, out, self.op, self.quantized),
            None => Ok(()),
        }
    }
}

/// One bucket: every rank's part of some gradients staged in `staged` (equal lengths, rank by rank); this rank's
/// reduced part lands in `out` and, with `lands_at`, goes on from there at that offset of the optimized range.
pub(crate) struct Bucket {
    pub staged: Tensor,
    pub out: Tensor,
    pub lands_at: Option<usize>,
    /// A unit split over the expert-data-parallel group: reduced there, with no replicas.
    pub over_experts: bool,
    /// Multiplies the reduced part after the post-factor: a mean over the expert-data-parallel group made a mean
    /// over every data-parallel rank (each rank's gradient of its experts already sums the tokens of its
    /// expert-parallel group).
    pub scale: Option<f64>,
}

impl Bucket {
    /// A bucket over the shard group (and its replicas).
    pub fn new(staged: Tensor, out: Tensor, lands_at: Option<usize>) -> Bucket {
        Bucket { staged, out, lands_at, over_experts: false, scale: None }
    }
}

/// Where a finished bucket's reduced part goes ([`Bucket::lands_at`]).
pub(crate) enum Landing<'a> {
    /// Added to the fp32 accumulator (gradients kept until the optimizer step).
    Accumulate(&'a Tensor),
    /// Stepped at once: stage 3's optimizer in backward.
    Step(&'a mut dyn StepPart),
}

impl Landing<'_> {
    fn land(&mut self, residence: Residence, at: usize, part: &Tensor) -> Result<()> {
        match self {
            Landing::Accumulate(acc) => {
                flat_math::accumulate(residence, &acc.narrow(0, at as i64, part.numel() as i64), part)
            }
            Landing::Step(stepper) => stepper.step_part(at, part),
        }
    }
}

/// A bucket whose collective was started: on the communication thread (a handle), or done in line.
struct Started {
    bucket: Bucket,
    handle: Option<Handle<()>>,
}

impl Bucket {
    /// Predivides and starts the collective: a reduce-scatter, on the communication thread when the engine has one,
    /// or an all-reduce when `reduce_scatter` is off (in line, then this rank's part copied out).
    fn start(self, comm: &EngineComm, how: &Reduction, volume: &mut CommVolume) -> Result<Started> {
        let (n, l) = (self.staged.numel(), self.out.numel());
        if let Some(pre) = how.pre {
            let _ = self.staged.shallow_clone().f_mul_scalar_(pre)?;
        }
        let replicas = comm.replicas().filter(|_| !self.over_experts);
        let (group, thread) = (comm.over(self.over_experts), comm.thread_over(self.over_experts));
        if let Some(r) = replicas {
            volume.all_reduce_elements += l as u64;
            tracing::trace!(elements = l, replicas = r.count(), "bucket part all-reduced across the shard groups");
        }
        if !how.scatter {
            views::all_reduce(how.residence, group, &self.staged, how.op)?;
            volume.all_reduce_elements += n as u64;
            // This rank's part by its place in the group the bucket was reduced over (an expert-data-parallel
            // group's ranks number from 0 there).
            let own = group.rank() * l;
            self.out.shallow_clone().f_copy_(&self.staged.f_narrow(0, own as i64, l as i64)?)?;
            if let Some(r) = replicas {
                r.all_reduce(how.residence, &self.out, how.op, None)?;
            }
            return Ok(Started { bucket: self, handle: None });
        }
        volume.reduce_scatter_elements += n as u64;
        let handle = match thread {
            Some(thread) => {
                // The job holds its own handles to both tensors, so their storage outlives it; the queue does not
                // touch this half or this output again before `finish` waits.
                let (staged, out, how) = (self.staged.shallow_clone(), self.out.shallow_clone(), *how);
                let replicas = replicas.cloned();
                Some(thread.submit("reduce_scatter", move |c| how.reduce(c, replicas.as_ref(), &staged, &out)))
            }
            None => {
                how.reduce(group, replicas, &self.staged, &self.out)?;
                None
            }
        };
        Ok(Started { bucket: self, handle })
    }
}

impl Started {
    /// Waits for the collective, applies the post-factor and lands the part.
    fn finish(self, how: &Reduction, landing: &mut Landing<'_>) -> Result<()> {
        if let Some(handle) = self.handle {
            handle.wait()?;
        }
        let out = &self.bucket.out;
        if let Some(post) = how.post {
            let _ = out.shallow_clone().f_mul_scalar_(post)?;
        }
        if let Some(scale) = self.bucket.scale {
            let _ = out.shallow_clone().f_mul_scalar_(scale)?;
        }
        if let Some(at) = self.bucket.lands_at {
            landing.land(how.residence, at, out)?;
        }
        Ok(())
    }
}

/// The staging buffer in one or two halves, and the bucket in flight from each: a half is staged again only after
/// its last bucket finished.
pub(crate) struct BucketQueue {
    staging: Tensor,
    halves: usize,
    in_flight: [Option<Started>; 2],
    next: usize,
}

impl BucketQueue {
    pub fn new(staging: Tensor, halves: usize) -> BucketQueue {
        assert!(halves == 1 || halves == 2, "one or two staging halves");
        BucketQueue { staging, halves, in_flight: [None, None], next: 0 }
    }

    /// The whole staging buffer (stage 0 all-reduces it; the model's gradients are views of it there).
    pub fn staging(&self) -> &Tensor {
        &self.staging
    }

    /// One or two.
    pub fn halves(&self) -> usize {
        self.halves
    }

    /// Elements of one half.
    pub fn half_len(&self) -> usize {
        self.staging.numel() / self.halves
    }

    /// Which half the next bucket stages into.
    pub fn next_half(&self) -> usize {
        self.next
    }

    /// The next bucket's staging: `len` elements of the next half, once the bucket in flight from it finished.
    pub fn claim(&mut self, len: usize, how: &Reduction, landing: &mut Landing<'_>) -> Result<Tensor> {
        if let Some(prev) = self.in_flight[self.next].take() {
            prev.finish(how, landing)?;
        }
        Ok(self.staging.narrow(0, (self.next * self.half_len()) as i64, len as i64))
    }

    /// Starts `bucket` (staged in the half `claim` gave) and moves on to the other half.
    pub fn launch(
        &mut self,
        bucket: Bucket,
        comm: &EngineComm,
        how: &Reduction,
        volume: &mut CommVolume,
        landing: &mut Landing<'_>,
    ) -> Result<()> {
        let started = bucket.start(comm, how, volume)?;
        if started.handle.is_none() {
            started.finish(how, landing)?;
        } else {
            self.in_flight[self.next] = Some(started);
        }
        self.next = (self.next + 1) % self.halves;
        Ok(())
    }

    /// Finishes every bucket in flight, in launch order.
    pub fn drain(&mut self, how: &Reduction, landing: &mut Landing<'_>) -> Result<()> {
        for k in 0..self.halves {
            let half = (self.next + k) % self.halves;
            if let Some(prev) = self.in_flight[half].take() {
                prev.finish(how, landing)?;
            }
        }
        self.next = 0;
        Ok(())
    }
}
