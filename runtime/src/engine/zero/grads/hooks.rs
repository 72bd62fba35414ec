//! Stage 2 for plain training loops (no units given): the parameters are cut into buckets of about
//! `reduce_bucket_size` elements (whole parameters, in layout order), laid out like units, and a post-accumulate-grad
//! hook on every parameter counts down its bucket. When autograd has written the last gradient of a bucket, the
//! bucket is reduce-scattered into this rank's fp32 shard and those `.grad` tensors are freed, while backward goes
//! on: no rank ever holds the full gradients (DeepSpeed's stage 2 with its gradient hooks). Buckets launch in one
//! fixed order on every rank, the last bucket first (backward usually reaches the layers in reverse), never in
//! autograd's completion order, which can differ between ranks (two branches summed in another order): a bucket
//! that is complete waits, its gradients held, until every bucket before it in that order has launched. The
//! reduction is the unit walk's ([`GradientSync::reduce_unit`]); with `overlap_comm` it runs on the communication
//! thread from one of two staging halves while autograd goes on. Stage 0 with `overlap_comm` counts its buckets
//! down the same way and all-reduces each in place instead (`all_reduce.rs`).
//!
//! The hooks reach only what the reduction needs ([`GradientSync`]: the gradient buffers, the communicator, the
//! layout), lent by `engine.backward` for the duration of autograd's run; outside it they do nothing, and a
//! backward the engine did not run leaves its gradients in `.grad` for `step` to reduce.
use std::cell::Cell;
use std::ffi::c_void;
use std::ops::Range;

use tch::Tensor;

use crate::engine::device::native;
use crate::engine::zero::grads::GradientSync;
use crate::error::{Error, Result};

/// The buckets' countdown in the current backward.
pub(crate) struct Countdown {
    /// Each parameter's bucket (unit), by layout slot.
    bucket_of: Vec<usize>,
    /// Per bucket: its parameters' slots.
    slots: Vec<std::ops::Range<usize>>,
    /// Per bucket: gradients still to come in this backward.
    pending: Vec<usize>,
    /// Per bucket: all its gradients came in this backward, and it has not launched yet.
    complete: Vec<bool>,
    /// Buckets launched in this backward: the first `launched` of the launch order (last bucket first).
    launched: usize,
    /// The first error a hook met (it cannot return one through autograd); `backward` returns it.
    error: Option<Error>,
}

impl Countdown {
    /// `buckets`: each bucket's parameter slots, in layout order.
    pub fn new(buckets: Vec<Range<usize>>) -> Countdown {
        Countdown {
            bucket_of: buckets.iter().enumerate().flat_map(|(b, s)| s.clone().map(move |_| b)).collect(),
            pending: buckets.iter().map(|s| s.len()).collect(),
            complete: vec![false; buckets.len()],
            slots: buckets,
            launched: 0,
            error: None,
        }
    }

    /// A new backward's count (after one that an error cut short, the counts are not where it left them).
    fn restart(&mut self) {
        for (pending, slots) in self.pending.iter_mut().zip(&self.slots) {
            *pending = slots.len();
        }
        self.complete.fill(false);
        self.launched = 0;
        self.error = None;
    }

    /// The order buckets launch in on every rank: the last one first.
    fn launch_order(&self) -> impl Iterator<Item = usize> {
        (0..self.complete.len()).rev()
    }

    /// The next bucket to launch, if it is complete.
    fn next_ready(&self) -> Option<usize> {
        self.launch_order().nth(self.launched).filter(|&b| self.complete[b])
    }
}

/// What a hook reaches while `engine.backward` runs autograd: a [`GradientSync`] lent for that call (null otherwise).
struct HookTarget {
    lent: Cell<*mut GradientSync<'static>>,
}

/// The hooks installed on the model's parameters. Dropping it removes them.
pub(crate) struct GradHooks {
    params: Vec<Tensor>,
    target: Box<HookTarget>,
}

extern "C" fn grad_ready(ctx: *mut c_void, slot: i64) {
    // SAFETY: ctx is the GradHooks' boxed target, alive until the hooks are removed (GradHooks::drop).
    let target = unsafe { &*(ctx as *const HookTarget) };
    let lent = target.lent.get();
    if lent.is_null() {
        return;
    }
    // SAFETY: `GradHooks::lend` set it from a `&mut GradientSync` that lives, and is used by nothing else, until
    // autograd's run returns; autograd runs a CPU backward's hooks on the calling thread, one at a time.
    let sync = unsafe { &mut *lent };
    // The reduction's buffers are the engine's, though autograd's backward calls it.
    let _owner = crate::report::allocations::owned_by(crate::report::allocations::Owner::Engine);
    // A panic must not unwind into libtorch's C++ frames.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sync.on_grad_ready(slot as usize)));
    let error = match result {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(_) => Error::Usage("a gradient hook panicked".into()),
    };
    sync.countdown().error.get_or_insert(error);
}

impl GradHooks {
    /// Installs a hook on every parameter (layout order).
    pub fn install(params: &[Tensor]) -> Result<GradHooks> {
        let hooks = GradHooks {
            params: params.iter().map(Tensor::shallow_clone).collect(),
            target: Box::new(HookTarget { lent: Cell::new(std::ptr::null_mut()) }),
        };
        let ctx = &*hooks.target as *const HookTarget as *mut c_void;
        for (slot, p) in hooks.params.iter().enumerate() {
            native::on_grad_ready(p, grad_ready, ctx, slot)?;
        }
        Ok(hooks)
    }

    /// Runs `backward` (autograd over the user's graph) with the hooks reducing through `sync`, then launches the
    /// buckets whose gradients did not all come (unused parameters) and finishes what is in flight.
    pub fn lend(&self, sync: &mut GradientSync<'_>, backward: impl FnOnce() -> Result<()>) -> Result<()> {
        sync.countdown().restart();
        let lent: *mut GradientSync<'_> = sync;
        // The lifetime is erased for the cell; the pointer is cleared below, before `sync`'s borrow ends.
        self.target.lent.set(lent.cast());
        let ran = backward();
        self.target.lent.set(std::ptr::null_mut());
        ran?;
        if let Some(e) = sync.countdown().error.take() {
            return Err(e);
        }
        sync.finish_hooked_reduction()
    }
}

impl Drop for GradHooks {
    fn drop(&mut self) {
        for p in &self.params {
            native::remove_grad_ready(p);
        }
    }
}

impl GradientSync<'_> {
    fn countdown(&mut self) -> &mut Countdown {
        self.gradients.countdown.as_mut().expect("hooked mode has a countdown")
    }

    fn on_grad_ready(&mut self, slot: usize) -> Result<()> {
        let countdown = self.countdown();
        let b = countdown.bucket_of[slot];
        countdown.pending[b] = countdown.pending[b].saturating_sub(1);
        if countdown.pending[b] == 0 {
            countdown.complete[b] = true;
        }
        // Launch every complete bucket at the head of the order.
        while let Some(b) = self.countdown().next_ready() {
            self.launch_bucket(b)?;
        }
        Ok(())
    }

    /// Reduces bucket `b`, the next in the launch order, and resets its countdown: stage 0 all-reduces it in place
    /// in the buffer its `.grad` tensors are views of; stage 2 reduce-scatters it from its parameters' `.grad` (a
    /// missing one counts as zeros) and frees them.
    fn launch_bucket(&mut self, b: usize) -> Result<()> {
        let slots = self.countdown().slots[b].clone();
        if self.gradients.all_reduce_in_backward.is_some() {
            self.start_bucket_all_reduce(b)?;
        } else {
            self.reduce_scatter_bucket(b, slots.clone())?;
        }
        let countdown = self.countdown();
        countdown.complete[b] = false;
        countdown.pending[b] = slots.len();
        countdown.launched += 1;
        Ok(())
    }

    fn reduce_scatter_bucket(&mut self, b: usize, slots: Range<usize>) -> Result<()> {
        let params = &self.params[slots.clone()];
        let grads: Vec<Option<Tensor>> = params
            .iter()
            .map(|p| {
                let g = p.grad();
                g.defined().then_some(g)
            })
            .collect();
        self.reduce_unit(b, &grads)?;
        for p in &self.params[slots] {
            native::reset_grad(p);
        }
        Ok(())
    }

    /// Ends a backward's reduction: launches, in order, every bucket not launched yet (some of its parameters took
    /// no part in the graph: zeros where a gradient is missing), waits for what is in flight, and starts the next
    /// backward's count. Every rank calls it at the same point, so every rank reduces every bucket.
    pub fn finish_hooked_reduction(&mut self) -> Result<()> {
        let countdown = self.countdown();
        let rest: Vec<usize> = countdown.launch_order().skip(countdown.launched).collect();
        for b in rest {
            self.launch_bucket(b)?;
        }
        self.countdown().launched = 0;
        if self.gradients.all_reduce_in_backward.is_some() {
            return self.finish_bucket_all_reduces();
        }
        self.drain()
    }

    /// Stage 2: whether gradients wait in `.grad` for a reduction: a backward ran outside `engine.backward` (the
    /// hooks only count inside it). `engine.backward` leaves none.
    pub fn gradients_wait_in_grad(&self) -> bool {
        self.params.iter().any(|p| p.grad().defined())
    }
}
