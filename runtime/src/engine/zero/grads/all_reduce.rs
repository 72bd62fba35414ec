//! Stage 0 with `overlap_comm` (DDP's bucketed all-reduce): the `.grad` tensors are views of the staging buffer, cut
//! into buckets of about `reduce_bucket_size` elements (whole parameters, layout order); the gradient hooks count a
//! bucket down as autograd writes its gradients and, once it is complete, start its all-reduce in place on the
//! communication thread while backward goes on. Buckets start in one fixed order on every rank, the last first
//! (the hooks' [`super::hooks::Countdown`]). Waiting for them at the end of backward, the engine sums each landed
//! bucket's squares for the norm (or, with `optimizer_in_backward`, steps the bucket); the step then finds its
//! gradients reduced but for the post-factor.
//!
//! The reduction happens in the backward of the micro-step that reduces: every micro-step for 16-bit models (they
//! accumulate reduced gradients in fp32), the boundary's for fp32 models (autograd accumulates the micro-batches
//! in the views first). A second backward in that micro-step finds its predecessor's gradients reduced already:
//! they are set aside (one more gradient-sized buffer, only then) and added back after its own reduction, so the
//! sum is what one reduction of both would give.
use std::ops::Range;

use tch::Tensor;

use crate::comm::async_comm::Handle;
use crate::engine::device::views;
use crate::engine::zero::grads::GradientSync;
use crate::engine::zero::layout::FlatLayout;
use crate::engine::zero::optim::in_backward::StepPart;
use crate::engine::zero::plan;
use crate::engine::zero::plan::ReducedGradients;
use crate::error::{Error, Result};
use zerorun_optim::norm::PiecewiseSumOfSquares;

/// Stage 0's buckets: each one's parameter slots (layout order), whole parameters of at most `bucket` elements
/// together (one unit: stage 0's flat layout). The hooks' countdown counts them; [`AllReduceInBackward`] reduces
/// their elements.
pub(crate) fn bucket_slots(layout: &FlatLayout, bucket: u64) -> Vec<Range<usize>> {
    let sizes: Vec<usize> = layout.slots.iter().map(|s| s.range.len()).collect();
    let bucket_of = plan::bucket_cuts(&sizes, bucket);
    let mut slots: Vec<Range<usize>> = Vec::new();
    for (i, &b) in bucket_of.iter().enumerate() {
        match slots.get_mut(b) {
            Some(r) => r.end = i + 1,
            None => slots.push(i..i + 1),
        }
    }
    slots
}

/// Stage 0's buckets and the all-reduces in flight.
pub(crate) struct AllReduceInBackward {
    /// Each bucket's flat elements (of the staging buffer); the last one takes the padding.
    ranges: Vec<Range<usize>>,
    /// All-reduces started in this backward, in launch order, with their buckets.
    in_flight: Vec<(usize, Handle<()>)>,
    /// The gradients in the staging buffer were all-reduced (before the post-factor) by a backward of this
    /// micro-step, and the `.grad` fingerprint they left (a backward outside the engine changes it).
    reduced: Option<i64>,
    /// What earlier backwards of this micro-step reduced, set aside when another backward followed them.
    aside: Option<Tensor>,
    /// The reduced gradients' sum of squares, taken bucket by bucket as they landed (bitwise the whole buffer's),
    /// for the step's norm: only where the landed values are the step's (fp32 in the staging buffer on the host,
    /// no post-factor, nothing set aside).
    landed_sum_of_squares: Option<f64>,
}

impl AllReduceInBackward {
    /// The elements of the buckets of [`bucket_slots`]: from each one's first parameter to the next one's.
    pub fn new(layout: &FlatLayout, buckets: &[Range<usize>]) -> AllReduceInBackward {
        let starts: Vec<usize> = buckets.iter().map(|s| layout.slots[s.start].range.start).collect();
        let ranges =
            (0..starts.len()).map(|b| starts[b]..starts.get(b + 1).copied().unwrap_or(layout.padded)).collect();
        AllReduceInBackward { ranges, in_flight: Vec::new(), reduced: None, aside: None, landed_sum_of_squares: None }
    }

    /// The `.grad` fingerprint a backward of this micro-step left after reducing the staging buffer, if one did;
    /// taken by the step's reduction, which then only applies the post-factor.
    pub fn take_reduced(&mut self) -> Option<i64> {
        self.reduced.take()
    }

    /// After a backward whose hooks reduced every bucket: the staging buffer holds the micro-step's reduced
    /// gradients, and the `.grad` tensors have `fingerprint` ([`super::fingerprint`]).
    pub fn mark_reduced(&mut self, fingerprint: i64) {
        self.reduced = Some(fingerprint);
    }

    /// Before a backward that will reduce in its hooks: what an earlier backward that failed left in flight is
    /// waited for, and if an earlier one of this micro-step reduced the staging buffer, its values are set aside
    /// and the buffer zeroed, so autograd writes only this backward's gradients.
    pub fn before_backward(&mut self, staging: &Tensor) -> Result<()> {
        self.landed_sum_of_squares = None;
        for (_, h) in self.in_flight.drain(..) {
            // That backward returned its error already.
            let _ = h.wait();
        }
        if self.reduced.take().is_none() {
            return Ok(());
        }
        tch::no_grad(|| -> Result<()> {
            let aside = match self.aside.take() {
                Some(aside) => aside,
                None => staging.f_zeros_like()?,
            };
            let _ = aside.shallow_clone().f_add_(staging)?;
            self.aside = Some(aside);
            let _ = staging.shallow_clone().f_zero_()?;
            Ok(())
        })
    }

    /// The sum of squares of the gradients this micro-step's backward reduced, taken as they landed, if it was.
    pub fn take_landed_sum_of_squares(&mut self) -> Option<f64> {
        self.landed_sum_of_squares.take()
    }

    /// The step all-reduced the staging buffer itself: what a backward summed as its buckets landed is not the
    /// step's.
    pub fn forget_landed(&mut self) {
        self.landed_sum_of_squares = None;
    }

    /// After the reduction (this backward's, or the step's): adds what earlier backwards set aside.
    pub fn add_aside(&mut self, staging: &Tensor) -> Result<()> {
        if let Some(aside) = self.aside.take() {
            let _ = tch::no_grad(|| staging.shallow_clone().f_add_(&aside))?;
        }
        Ok(())
    }
}

impl GradientSync<'_> {
    fn in_backward(&mut self) -> &mut AllReduceInBackward {
        self.gradients.all_reduce_in_backward.as_mut().expect("stage 0's all-reduce in backward")
    }

    /// Starts bucket `b`'s all-reduce in place on the communication thread (the predivide first).
    pub(super) fn start_bucket_all_reduce(&mut self, b: usize) -> Result<()> {
        let how = self.gradients.how;
        let range = self.in_backward().ranges[b].clone();
        let bucket = self.gradients.queue.staging().narrow(0, range.start as i64, range.len() as i64);
        if let Some(pre) = how.pre {
            let _ = bucket.shallow_clone().f_mul_scalar_(pre)?;
        }
        self.volume.all_reduce_elements += range.len() as u64;
        let thread = self.comm.thread().ok_or_else(|| {
            Error::Usage("stage 0's all-reduce in backward runs on the communication thread, and there is none".into())
        })?;
        // The job holds its own handle to the bucket's storage; autograd does not write this bucket again in this
        // backward (all its gradients came), and the step waits for the job before reading it.
        let handle = thread.submit("all_reduce", move |c| views::all_reduce(how.residence, c, &bucket, how.op));
        self.in_backward().in_flight.push((b, handle));
        Ok(())
    }

    /// Waits for this backward's all-reduces (in launch order) and adds what earlier backwards of the micro-step
    /// set aside; the engine then marks the buffer reduced ([`AllReduceInBackward::mark_reduced`]). With the
    /// optimizer in backward each bucket is stepped as it lands, post-factor applied, while the ones after it are
    /// still on the wire (nothing is set aside then: a second backward before the step is refused).
    pub(super) fn finish_bucket_all_reduces(&mut self) -> Result<()> {
        let started = std::time::Instant::now();
        let mut stepping = std::time::Duration::ZERO;
        let handles = std::mem::take(&mut self.in_backward().in_flight);
        let staging = self.gradients.queue.staging().shallow_clone();
        // The norm's sum of squares, bucket by bucket while the later ones are on the wire (else the step's pass).
        let mut landed = self.sums_as_landing().then(|| PiecewiseSumOfSquares::new(staging.numel()));
        let base = staging.data_ptr() as *const f32;
        let mut first_error = None;
        for (b, h) in handles {
            if let Err(e) = h.wait() {
                first_error.get_or_insert(e.into());
            }
            if first_error.is_some() {
                continue;
            }
            if let Some(sum) = landed.as_mut() {
                let range = self.in_backward().ranges[b].clone();
                sum.add_final(range, |r| {
                    // SAFETY: fp32 elements of the host staging buffer (`sums_as_landing`), read-only, whose
                    // all-reduces have landed: the comm thread writes only the buckets still in flight, and nothing
                    // else writes these before the step.
                    zerorun_optim::Grads::F32(unsafe { std::slice::from_raw_parts(base.add(r.start), r.len()) })
                });
            }
            if self.stepper.is_none() {
                continue;
            }
            let t = std::time::Instant::now();
            if let Err(e) = self.step_bucket(b) {
                first_error.get_or_insert(e);
            }
            stepping += t.elapsed();
        }
        // Stepping in backward is backward's time, as at stage 3; the wait for the wire is the reduction's.
        self.times.add(crate::report::Phase::ReduceScatter, started.elapsed().saturating_sub(stepping));
        if let Some(e) = first_error {
            return Err(e);
        }
        self.in_backward().landed_sum_of_squares = landed.and_then(|s| s.total());
        self.in_backward().add_aside(&staging)
    }

    /// Whether the values landing are the step's gradients, so their sum of squares can be taken as they land:
    /// fp32 reduced in the staging buffer, on the host (the device path takes its norm in one kernel), with no
    /// post-factor still to apply, nothing set aside to add, no optimizer in backward (which sums what it steps).
    fn sums_as_landing(&mut self) -> bool {
        let g = &*self.gradients;
        g.reduced == ReducedGradients::Staging
            && g.queue.staging().kind() == tch::Kind::Float
            && g.how.post.is_none()
            && !g.how.residence.device_path()
            && self.stepper.is_none()
            && self.in_backward().aside.is_none()
    }

    /// Steps bucket `b`, all-reduced: its post-factor, then its elements of the parameters (stage 0 optimizes the
    /// whole flat range, so the bucket's flat elements are the optimizer's).
    fn step_bucket(&mut self, b: usize) -> Result<()> {
        let range = self.in_backward().ranges[b].clone();
        let bucket = self.gradients.queue.staging().narrow(0, range.start as i64, range.len() as i64);
        if let Some(post) = self.gradients.how.post {
            let _ = bucket.shallow_clone().f_mul_scalar_(post)?;
        }
        self.stepper.as_mut().expect("checked by the caller").step_part(range.start, &bucket)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_take_whole_parameters_and_their_elements_cover_the_buffer() {
        let specs: Vec<(String, Vec<i64>, bool)> =
            [4, 4, 4, 10, 1].iter().enumerate().map(|(i, &n)| (format!("p{i}"), vec![n], true)).collect();
        let layout = FlatLayout::new(&specs, 2);
        let buckets = bucket_slots(&layout, 8);
        assert_eq!(buckets, vec![0..2, 2..3, 3..4, 4..5]);
        let a = AllReduceInBackward::new(&layout, &buckets);
        // 23 elements padded to 24 at world size 2: the last bucket takes the padding.
        assert_eq!(a.ranges, vec![0..8, 8..12, 12..22, 22..24]);
    }
}
