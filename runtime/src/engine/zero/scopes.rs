//! Stage 3 for any model: units entered as scopes of the program's own forward (FSDP2's `fully_shard` on a
//! submodule, DeepSpeed's module hooks), not walked as a chain. What a scope leaves for backward is the user's own
//! graph: no detach, no re-leaf, any dataflow between units. The engine's side is `engine/unit_scopes.rs`; this file
//! keeps the bookkeeping and the hooks' trampolines:
//!
//! - a pre-backward hook on every tensor a scope returns (`native::on_output_grad`) gathers the unit before autograd
//!   computes anything inside it (its saved views of the parameters grow back in place);
//! - a post-accumulate-grad hook on every trainable parameter counts its unit down; when all of a unit's gradients
//!   are in `.grad` the unit is reduce-scattered into this rank's shard and released, while autograd goes on;
//! - after autograd returns, units whose gradients did not all come (unused parameters, units not entered) are
//!   reduced in one fixed order, and whatever is still gathered is released.
//!
//! Every rank runs the same program, so autograd runs the same graph in the same order on each and the hooks'
//! collectives line up; the hooks act only while `engine.backward` lends them the engine.
use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;

use tch::Tensor;

use crate::engine::device::native;
use crate::engine::Engine;
use crate::error::{Error, Result};

/// What a unit's scope returns: the tensors through which autograd reaches the unit. Each one that requires grad
/// gets the hook that gathers the unit again before backward needs its parameters, so a scope must return every
/// tensor it computed that the rest of the forward uses.
pub trait UnitOutput {
    /// The tensors of the output.
    fn tensors(&self) -> Vec<&Tensor>;
}

impl UnitOutput for Tensor {
    fn tensors(&self) -> Vec<&Tensor> {
        vec![self]
    }
}

impl UnitOutput for () {
    fn tensors(&self) -> Vec<&Tensor> {
        Vec::new()
    }
}

impl UnitOutput for tch::nn::LSTMState {
    fn tensors(&self) -> Vec<&Tensor> {
        vec![&(self.0).0, &(self.0).1]
    }
}

impl UnitOutput for tch::nn::GRUState {
    fn tensors(&self) -> Vec<&Tensor> {
        vec![&self.0]
    }
}

impl<T: UnitOutput> UnitOutput for Vec<T> {
    fn tensors(&self) -> Vec<&Tensor> {
        self.iter().flat_map(UnitOutput::tensors).collect()
    }
}

impl<T: UnitOutput> UnitOutput for Option<T> {
    fn tensors(&self) -> Vec<&Tensor> {
        self.iter().flat_map(UnitOutput::tensors).collect()
    }
}

impl<T: UnitOutput, E> UnitOutput for std::result::Result<T, E> {
    fn tensors(&self) -> Vec<&Tensor> {
        self.as_ref().map_or_else(|_| Vec::new(), UnitOutput::tensors)
    }
}

macro_rules! tuple_output {
    ($($t:ident $i:tt),+) => {
        impl<$($t: UnitOutput),+> UnitOutput for ($($t,)+) {
            fn tensors(&self) -> Vec<&Tensor> {
                let mut all = Vec::new();
                $(all.extend(self.$i.tensors());)+
                all
            }
        }
    };
}
tuple_output!(A 0, B 1);
tuple_output!(A 0, B 1, C 2);
tuple_output!(A 0, B 1, C 2, D 3);

/// The order one micro-batch ran its units in: entered in forward (every entry), and first reached in backward
/// (each unit once). The next micro-batches prefetch along it, as DeepSpeed prefetches along its trace.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Trace {
    pub forward: Vec<usize>,
    pub backward: Vec<usize>,
}

/// Where this micro-batch is in the last one's order.
#[derive(Debug, Default)]
struct Follow {
    /// The last micro-batch's order (empty before the first backward).
    trace: Trace,
    /// This micro-batch's order so far.
    recording: Trace,
    /// The next positions expected in `trace`; None once this micro-batch left it.
    forward_at: Option<usize>,
    backward_at: Option<usize>,
    /// Per unit: reached in this backward.
    reached: Vec<bool>,
    /// A changed order was logged once (later ones go to the debug log).
    noticed: bool,
}

impl Follow {
    /// Records `u` as the next of `recorded` and returns what the trace says follows it (None: no trace yet, or
    /// this micro-batch left it).
    fn next(trace: &[usize], recorded: &mut Vec<usize>, at: &mut Option<usize>, u: usize) -> Option<Vec<usize>> {
        recorded.push(u);
        let k = (*at)?;
        if trace.get(k) == Some(&u) {
            *at = Some(k + 1);
            Some(trace[k + 1..].to_vec())
        } else {
            *at = None;
            None
        }
    }
}

/// What a hook reaches: the engine while `engine.backward` runs autograd (null otherwise), and the units' names
/// (each one's first prefix, as `engine.unit` takes it), also for the error a backward outside it gets.
pub(crate) struct HookTarget {
    lent: AtomicPtr<Engine>,
    names: Vec<String>,
}

impl HookTarget {
    /// Lends `engine` (a checkpointed unit's first run, in forward, where its closure enters nested units);
    /// returns what was lent before, to restore.
    pub fn swap(&self, engine: *mut Engine) -> *mut Engine {
        self.lent.swap(engine, Ordering::AcqRel)
    }

    /// Puts back what [`HookTarget::swap`] returned.
    pub fn restore(&self, engine: *mut Engine) {
        self.lent.store(engine, Ordering::Release);
    }

    /// The engine lent now (null when none is). Whoever dereferences it holds no other reference to the engine
    /// meanwhile: the one that lent it (backward, or a checkpointed unit's forward) waits in libtorch until the
    /// closure or hook returns.
    pub fn lent(&self) -> *mut Engine {
        self.lent.load(Ordering::Acquire)
    }
}

/// The scopes' state: names, what this micro-batch's forward entered, what its backward still waits for.
pub(crate) struct Scopes {
    /// The unit of every name: every prefix of every unit.
    by_name: HashMap<String, usize>,
    /// Per unit: scopes of it open now (nested or re-entered).
    pub open: Vec<usize>,
    /// Scopes open now, of any unit (the outermost one times the forward).
    pub depth: usize,
    /// A scope ran with gradients since the last backward: the next backward is the scopes'.
    pub forward_ran: bool,
    /// `engine.backward` runs autograd now: a scope entered is a checkpointed unit's recomputation.
    pub in_backward: bool,
    /// Per unit: stays gathered after a forward scope because backward reuses it soon (the last units of the
    /// forward, `stage3_max_reuse_distance`).
    pub kept: Vec<bool>,
    /// Per layout slot (trainable parameter): its unit.
    unit_of_slot: Vec<usize>,
    /// Per unit: trainable parameters.
    trainable: Vec<usize>,
    /// Per unit: gradients still to come in this backward.
    pending: Vec<usize>,
    /// Per unit: reduced in this backward.
    pub reduced: Vec<bool>,
    /// Per unit: has frozen parameters, which no gradient hook follows: released only when backward ends.
    pub has_frozen: Vec<bool>,
    /// The first error a hook met; `backward` returns it.
    pub error: Option<Error>,
    target: Arc<HookTarget>,
    /// The units' order, traced from the last micro-batch, and this one's place in it.
    follow: Follow,
    /// The parameters carrying the gradient hooks (removed on drop).
    hooked: Vec<Tensor>,
}

impl Scopes {
    /// Installs the gradient hooks on `params` (layout order; `unit_slots[u]`: unit u's slots in it).
    pub fn install(
        prefixes: &[Vec<String>],
        params: &[Tensor],
        unit_slots: &[std::ops::Range<usize>],
        has_frozen: Vec<bool>,
        kept: Vec<bool>,
    ) -> Result<Scopes> {
        let n = prefixes.len();
        let names: Vec<String> = prefixes.iter().map(|p| p.first().cloned().unwrap_or_default()).collect();
        let mut by_name = HashMap::new();
        for (u, unit) in prefixes.iter().enumerate() {
            for p in unit {
                by_name.insert(p.clone(), u);
            }
        }
        let unit_of_slot: Vec<usize> =
            unit_slots.iter().enumerate().flat_map(|(u, slots)| slots.clone().map(move |_| u)).collect();
        let trainable: Vec<usize> = unit_slots.iter().map(|slots| slots.len()).collect();
        let target = Arc::new(HookTarget { lent: AtomicPtr::new(std::ptr::null_mut()), names });
        let scopes = Scopes {
            by_name,
            open: vec![0; n],
            depth: 0,
            forward_ran: false,
            in_backward: false,
            kept,
            unit_of_slot,
            pending: trainable.clone(),
            trainable,
            reduced: vec![false; n],
            has_frozen,
            error: None,
            target,
            follow: Follow { reached: vec![false; n], ..Follow::default() },
            hooked: params.iter().map(Tensor::shallow_clone).collect(),
        };
        let ctx = Arc::as_ptr(&scopes.target) as *mut c_void;
        for (slot, p) in scopes.hooked.iter().enumerate() {
            native::on_grad_ready(p, grad_ready, ctx, slot)?;
        }
        Ok(scopes)
    }

    /// How events and logs name unit `u`: its name, or its index where the name is empty (the whole model).
    pub fn label(&self, u: usize) -> String {
        match self.target.names[u].as_str() {
            "" => u.to_string(),
            name => name.to_string(),
        }
    }

    /// The unit `name` enters: one of its prefixes.
    pub fn unit_named(&self, name: &str) -> Result<usize> {
        self.by_name.get(name).copied().ok_or_else(|| {
            Error::Usage(format!(
                "engine.unit(\"{name}\", ..): no unit has that name; the units are {:?} (EngineOptions::units: a unit is named by any of its prefixes)",
                self.target.names
            ))
        })
    }

    /// Registers the hook that gathers `unit` before autograd computes anything `t` came from.
    pub fn hook_output(&self, t: &Tensor, unit: usize) -> Result<()> {
        let ctx = Arc::into_raw(Arc::clone(&self.target)) as *mut c_void;
        native::on_output_grad(t, output_ready, ctx, drop_target, unit)
    }

    /// [`Scopes::hook_output`] on every tensor of a scope's output that requires grad.
    pub fn hook_outputs(&self, out: &impl UnitOutput, unit: usize) -> Result<()> {
        for t in out.tensors() {
            if t.defined() && t.requires_grad() {
                self.hook_output(t, unit)?;
            }
        }
        Ok(())
    }

    /// A scope of `unit` opens.
    pub fn open_scope(&mut self, unit: usize) {
        self.open[unit] += 1;
        self.depth += 1;
    }

    /// A scope of `unit` closes; returns how many stay open.
    pub fn close_scope(&mut self, unit: usize) -> usize {
        self.open[unit] -= 1;
        self.depth -= 1;
        self.open[unit]
    }

    /// A new backward's count.
    pub fn begin_backward(&mut self) {
        self.pending.copy_from_slice(&self.trainable);
        self.reduced.fill(false);
        self.error = None;
        self.follow.reached.fill(false);
    }

    /// Unit `u` entered in a forward with gradients: the units the trace says come after it, to prefetch (None
    /// before the first trace, or once this micro-batch's order left it).
    pub fn entered(&mut self, u: usize) -> Option<Vec<usize>> {
        let f = &mut self.follow;
        if f.recording.forward.is_empty() {
            f.forward_at = (!f.trace.forward.is_empty()).then_some(0);
            f.backward_at = (!f.trace.backward.is_empty()).then_some(0);
        }
        Follow::next(&f.trace.forward, &mut f.recording.forward, &mut f.forward_at, u)
    }

    /// Unit `u` reached in backward (its first output hook): whether for the first time in this backward, and
    /// the units the trace says come after it.
    pub fn reached(&mut self, u: usize) -> (bool, Option<Vec<usize>>) {
        let f = &mut self.follow;
        if std::mem::replace(&mut f.reached[u], true) {
            return (false, None);
        }
        (true, Follow::next(&f.trace.backward, &mut f.recording.backward, &mut f.backward_at, u))
    }

    /// The micro-batch's backward ended: its order becomes the trace. Returns a description of the change when
    /// the order differs from the last trace's (None when it is the same, or the first).
    pub fn retrace(&mut self) -> Option<String> {
        let f = &mut self.follow;
        let recorded = std::mem::take(&mut f.recording);
        let changed = !f.trace.forward.is_empty() && recorded != f.trace;
        let note = changed.then(|| {
            let name = |v: &[usize]| v.iter().map(|&u| self.target.names[u].as_str()).collect::<Vec<_>>().join(", ");
            format!(
                "forward [{}] then backward [{}], traced before as forward [{}] then backward [{}]",
                name(&recorded.forward),
                name(&recorded.backward),
                name(&f.trace.forward),
                name(&f.trace.backward)
            )
        });
        f.trace = recorded;
        f.forward_at = None;
        f.backward_at = None;
        note
    }

    /// Whether a changed order was logged already (and marks it logged).
    pub fn noticed_before(&mut self) -> bool {
        std::mem::replace(&mut self.follow.noticed, true)
    }

    /// The traced order (the last micro-batch's).
    pub fn trace(&self) -> &Trace {
        &self.follow.trace
    }

    /// A gradient of `slot` came: whether its unit has all of its gradients now (and was not reduced yet).
    pub fn count_down(&mut self, slot: usize) -> Option<usize> {
        let u = self.unit_of_slot[slot];
        self.pending[u] = self.pending[u].saturating_sub(1);
        (self.pending[u] == 0 && !self.reduced[u]).then_some(u)
    }

    /// Whether unit `u` has trainable parameters.
    pub fn trains(&self, u: usize) -> bool {
        self.trainable[u] > 0
    }

    /// Lends `engine` to the hooks until [`Scopes::unlend`].
    pub fn lend(&self, engine: *mut Engine) {
        self.target.lent.store(engine, Ordering::Release);
    }

    /// What the hooks reach, for a checkpointed unit's closure to enter the units nested in it from.
    pub fn target(&self) -> Arc<HookTarget> {
        Arc::clone(&self.target)
    }

    pub fn unlend(&self) {
        self.target.lent.store(std::ptr::null_mut(), Ordering::Release);
    }
}

impl Drop for Scopes {
    fn drop(&mut self) {
        for p in &self.hooked {
            native::remove_grad_ready(p);
        }
        self.unlend();
    }
}

/// The engine lent to the hooks, if `engine.backward` runs.
fn lent(ctx: *mut c_void) -> (&'static HookTarget, Option<&'static mut Engine>) {
    // SAFETY: ctx is a HookTarget kept alive by the hook that holds it (an Arc reference, or the Scopes' own for
    // the gradient hooks, removed before it goes).
    let target = unsafe { &*(ctx as *const HookTarget) };
    let engine = target.lent.load(Ordering::Acquire);
    // SAFETY: `engine.backward` lent a `&mut Engine` that nothing else uses until autograd's run returns; autograd
    // runs a CPU backward's hooks on the calling thread, one at a time.
    (target, (!engine.is_null()).then(|| unsafe { &mut *engine }))
}

extern "C" fn output_ready(ctx: *mut c_void, unit: i64) -> *mut c_char {
    let unit = unit as usize;
    let (target, engine) = lent(ctx);
    let Some(engine) = engine else {
        return native::malloc_message(&format!(
            "zerorun: unit `{}` is sharded (ZeRO stage 3): run this backward through `engine.backward(&loss)`, which gathers each unit before autograd needs it",
            target.names[unit]
        ));
    };
    let _owner = crate::report::allocations::owned_by(crate::report::allocations::Owner::Engine);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.scope_output_ready(unit)));
    let error = match result {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(e)) => e,
        Err(_) => Error::Usage(format!("gathering unit `{}` for backward panicked", target.names[unit])),
    };
    let text = format!("zerorun: {error}");
    engine.scope_error(error);
    native::malloc_message(&text)
}

extern "C" fn drop_target(ctx: *mut c_void) {
    // SAFETY: `hook_output` made ctx with Arc::into_raw; the hook calls this once, when it goes.
    drop(unsafe { Arc::from_raw(ctx as *const HookTarget) });
}

extern "C" fn grad_ready(ctx: *mut c_void, slot: i64) {
    let (_, Some(engine)) = lent(ctx) else { return };
    let _owner = crate::report::allocations::owned_by(crate::report::allocations::Owner::Engine);
    // A panic must not unwind into libtorch's C++ frames.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.scope_grad_ready(slot as usize)));
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => engine.scope_error(e),
        Err(_) => engine.scope_error(Error::Usage("a gradient hook panicked".into())),
    }
}
