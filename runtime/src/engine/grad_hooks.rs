//! Stage 2 for plain training loops (no units given): the parameters are cut into buckets of about
//! `reduce_bucket_size` elements (whole parameters, in layout order), laid out like units, and a post-accumulate-grad
//! hook on every parameter counts down its bucket. When autograd has written the last gradient of a bucket, the
//! engine reduce-scatters the bucket into this rank's fp32 shard and frees those `.grad` tensors, while backward
//! goes on: no rank ever holds the full gradients (DeepSpeed's stage 2 with its gradient hooks). Buckets launch in
//! one fixed order on every rank, the last bucket first (backward usually reaches the layers in reverse), never in
//! autograd's completion order, which can differ between ranks (two branches summed in another order): a bucket
//! that is complete waits, its gradients held, until every bucket before it in that order has launched. With
//! `overlap_comm` the reduce-scatter runs on the communication thread from one of two staging halves while autograd
//! goes on, and its result is added to the shard when that half is needed again or backward ends.
use std::cell::Cell;
use std::ffi::c_void;

use tch::Tensor;

use super::{native, views, Engine, UnitSpan};
use crate::comm::async_comm::Handle;
use crate::comm::BufRef;
use crate::error::{Error, Result};

/// What the hooks reach: the engine while `engine.backward` runs it (null otherwise: a backward the engine does not
/// run leaves the gradients in `.grad`, and `step` reduces them).
struct HookTarget {
    engine: Cell<*mut Engine>,
}

/// The hooks of one engine and the buckets' countdown. Dropping it removes the hooks.
pub(super) struct GradHooks {
    params: Vec<Tensor>,
    target: Box<HookTarget>,
    /// Each parameter's bucket (unit), by layout slot.
    bucket_of: Vec<usize>,
    /// Per bucket: gradients still to come in this backward.
    pending: Vec<usize>,
    /// Per bucket: all its gradients came in this backward, and it has not launched yet.
    complete: Vec<bool>,
    /// Buckets launched in this backward: the first `launched` of the launch order (last bucket first).
    launched: usize,
    /// The first error a hook met (it cannot return one through autograd); `backward` returns it.
    error: Option<Error>,
    /// `overlap_comm`: per staging half, the bucket whose reduce-scatter is in flight from it.
    in_flight: [Option<(usize, Handle<()>)>; 2],
    next_half: usize,
}

extern "C" fn grad_ready(ctx: *mut c_void, slot: i64) {
    // SAFETY: ctx is the GradHooks' boxed target, alive until the hooks are removed (GradHooks::drop).
    let target = unsafe { &*(ctx as *const HookTarget) };
    let engine = target.engine.get();
    if engine.is_null() {
        return;
    }
    // SAFETY: set by `Engine::backward_hooked` from its `&mut self` for the duration of the backward call, during
    // which nothing else touches the engine.
    let engine = unsafe { &mut *engine };
    // A panic must not unwind into libtorch's C++ frames.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.on_grad_ready(slot as usize)));
    let error = match result {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(_) => Error::Usage("a gradient hook panicked".into()),
    };
    engine.grad_hooks.as_mut().expect("hooked mode").error.get_or_insert(error);
}

impl GradHooks {
    /// Installs a hook on every parameter (layout order); the buckets are the layout's units.
    pub fn install(params: &[Tensor], buckets: &[UnitSpan]) -> Result<GradHooks> {
        let bucket_of = buckets.iter().enumerate().flat_map(|(b, u)| u.slots.clone().map(move |_| b)).collect();
        let target = Box::new(HookTarget { engine: Cell::new(std::ptr::null_mut()) });
        let hooks = GradHooks {
            params: params.iter().map(Tensor::shallow_clone).collect(),
            target,
            bucket_of,
            pending: buckets.iter().map(|u| u.slots.len()).collect(),
            complete: vec![false; buckets.len()],
            launched: 0,
            error: None,
            in_flight: [None, None],
            next_half: 0,
        };
        let ctx = &*hooks.target as *const HookTarget as *mut c_void;
        for (slot, p) in hooks.params.iter().enumerate() {
            native::on_grad_ready(p, grad_ready, ctx, slot)?;
        }
        Ok(hooks)
    }
}

impl Drop for GradHooks {
    fn drop(&mut self) {
        for p in &self.params {
            native::remove_grad_ready(p);
        }
    }
}

impl Engine {
    /// Runs `backward` (autograd over the user's graph) with the hooks pointed at this engine, then reduces the
    /// buckets whose gradients did not all come (unused parameters).
    pub(super) fn backward_hooked(&mut self, backward: impl FnOnce() -> Result<()>) -> Result<()> {
        let me: *mut Engine = self;
        self.grad_hooks.as_ref().expect("hooked mode").target.engine.set(me);
        let ran = backward();
        // SAFETY: `me` came from `self` above, and nothing used `self` since (the hooks ran through `me`).
        let this = unsafe { &mut *me };
        this.grad_hooks.as_ref().expect("hooked mode").target.engine.set(std::ptr::null_mut());
        ran?;
        if let Some(e) = this.grad_hooks.as_mut().expect("hooked mode").error.take() {
            return Err(e);
        }
        this.finish_hooked_reduction()
    }

    fn on_grad_ready(&mut self, slot: usize) -> Result<()> {
        let hooks = self.grad_hooks.as_mut().expect("hooked mode");
        let b = hooks.bucket_of[slot];
        hooks.pending[b] = hooks.pending[b].saturating_sub(1);
        if hooks.pending[b] == 0 {
            hooks.complete[b] = true;
        }
        // Launch every complete bucket at the head of the order.
        loop {
            let hooks = self.grad_hooks.as_ref().expect("hooked mode");
            match Self::launch_order(hooks.complete.len()).nth(hooks.launched) {
                Some(next) if hooks.complete[next] => self.launch_bucket(next)?,
                _ => return Ok(()),
            }
        }
    }

    /// The order buckets launch in on every rank: the last one first.
    fn launch_order(buckets: usize) -> impl Iterator<Item = usize> {
        (0..buckets).rev()
    }

    /// Reduces bucket `b`, the next in the launch order, and counts it launched.
    fn launch_bucket(&mut self, b: usize) -> Result<()> {
        self.reduce_bucket_of_hooks(b)?;
        let hooks = self.grad_hooks.as_mut().expect("hooked mode");
        hooks.complete[b] = false;
        hooks.launched += 1;
        Ok(())
    }

    /// Reduces bucket `b` from the parameters' `.grad` (a missing one counts as zeros), frees them and resets the
    /// countdown.
    fn reduce_bucket_of_hooks(&mut self, b: usize) -> Result<()> {
        let grads: Vec<Option<Tensor>> = self.units[b]
            .params()
            .iter()
            .map(|p| {
                let g = p.grad();
                g.defined().then_some(g)
            })
            .collect();
        let t = std::time::Instant::now();
        if self.overlapped_hooks() {
            self.check_unused_parameters(b, &grads)?;
            self.reduce_bucket_async(b, &grads)?;
        } else {
            self.reduce_unit(b, &grads)?;
        }
        self.times.add(crate::report::Phase::ReduceScatter, t.elapsed());
        for p in self.units[b].params() {
            native::reset_grad(p);
        }
        self.grad_hooks.as_mut().expect("hooked mode").pending[b] = self.units[b].params().len();
        Ok(())
    }

    /// Ends a backward's reduction: launches, in order, every bucket not launched yet (some of its parameters took
    /// no part in the graph: zeros where a gradient is missing), waits for what is in flight, and starts the next
    /// backward's count. Every rank calls it at the same point, so every rank reduces every bucket.
    pub(super) fn finish_hooked_reduction(&mut self) -> Result<()> {
        let buckets = self.units.len();
        let launched = self.grad_hooks.as_ref().expect("hooked mode").launched;
        for b in Self::launch_order(buckets).skip(launched).collect::<Vec<_>>() {
            self.launch_bucket(b)?;
        }
        self.grad_hooks.as_mut().expect("hooked mode").launched = 0;
        for half in 0..2 {
            self.finish_half(half)?;
        }
        Ok(())
    }

    /// Whether gradients wait in `.grad` for a reduction: a backward ran outside `engine.backward` (the hooks
    /// only count inside it). `engine.backward` leaves none.
    pub(super) fn gradients_wait_in_grad(&self) -> bool {
        self.params.iter().any(|p| p.grad().defined())
    }

    /// Whether bucket reductions run on the communication thread (`overlap_comm`, reduce-scatter).
    fn overlapped_hooks(&self) -> bool {
        self.comm.thread().is_some() && self.config.zero_optimization.reduce_scatter
    }

    /// Stages bucket `b` into the next staging half (after finishing what that half still had in flight) and
    /// starts its reduce-scatter on the communication thread.
    fn reduce_bucket_async(&mut self, b: usize, grads: &[Option<Tensor>]) -> Result<()> {
        let half = self.grad_hooks.as_ref().expect("hooked mode").next_half;
        self.finish_half(half)?;
        let ws = self.world_size();
        let span = self.units[b].span.clone();
        let (len, chunk) = (span.range.len(), span.chunk_len(ws));
        let (stage_half, part_half) = (
            self.gradients.flat_grads.numel() / 2,
            self.gradients.grad_part.as_ref().expect("buckets have a gradient part").numel() / 2,
        );
        let staged = self.gradients.flat_grads.narrow(0, (half * stage_half) as i64, len as i64);
        self.stage_unit_round(b, grads, &staged, 0, chunk)?;
        let (op, pre, _) = self.reduce_factors();
        if let Some(pre) = pre {
            let _ = staged.shallow_clone().f_mul_scalar_(pre)?;
        }
        let part =
            self.gradients.grad_part.as_ref().expect("checked").narrow(0, (half * part_half) as i64, chunk as i64);
        let thread = self.comm.thread().expect("overlap runs on the communication thread");
        // SAFETY: the half is this bucket's until `finish_half` waits on the handle; the engine drops its
        // communication thread (joining it) before these buffers.
        let handle =
            unsafe { thread.reduce_scatter_raw(BufRef::from(views::buf_mut(&staged)), views::buf_mut(&part), op) };
        self.comm_volume.reduce_scatter_elements += len as u64;
        let hooks = self.grad_hooks.as_mut().expect("hooked mode");
        hooks.in_flight[half] = Some((b, handle));
        hooks.next_half = 1 - half;
        Ok(())
    }

    /// Waits for the reduce-scatter in flight from staging half `half`, if any, and adds its result to the shard.
    fn finish_half(&mut self, half: usize) -> Result<()> {
        let Some((b, handle)) = self.grad_hooks.as_mut().expect("hooked mode").in_flight[half].take() else {
            return Ok(());
        };
        handle.wait()?;
        let ws = self.world_size();
        let (chunk, offset) = (self.units[b].span.chunk_len(ws), self.units[b].shard_offset);
        let part_half = self.gradients.grad_part.as_ref().expect("buckets have a gradient part").numel() / 2;
        let part =
            self.gradients.grad_part.as_ref().expect("checked").narrow(0, (half * part_half) as i64, chunk as i64);
        if let Some(post) = self.reduce_factors().2 {
            let _ = part.shallow_clone().f_mul_scalar_(post)?;
        }
        views::accumulate(&mut self.gradients.grad_acc[offset..offset + chunk], &part);
        Ok(())
    }
}
