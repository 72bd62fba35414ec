//! Safe wrappers over `native/unit_storage.cpp`: the libtorch calls stage 3 needs and tch does not bind.
use std::ffi::{c_char, c_void, CStr};

use tch::Tensor;

use crate::error::{Error, Result};

extern "C" {
    fn zerorun_resize_storage(t: *mut c_void, nbytes: i64) -> *mut c_char;
    fn zerorun_storage_nbytes(t: *mut c_void) -> i64;
    fn zerorun_grad(
        roots: *const *mut c_void,
        root_grads: *const *mut c_void,
        n_roots: i32,
        inputs: *const *mut c_void,
        n_inputs: i32,
        outputs: *mut *mut c_void,
    ) -> *mut c_char;
    fn zerorun_grad_enabled() -> i32;
    fn zerorun_flops_start() -> *mut c_char;
    fn zerorun_flops_stop(flops: *mut u64, ops: *mut u64) -> *mut c_char;
    fn zerorun_set_grad(param: *mut c_void, grad: *mut c_void) -> *mut c_char;
    fn zerorun_rng_state_len() -> i64;
    fn zerorun_rng_state_get(out: *mut u8, len: i64) -> *mut c_char;
    fn zerorun_rng_state_set(input: *const u8, len: i64) -> *mut c_char;
    fn zerorun_region_allocator_init(
        alloc: extern "C" fn(usize) -> *mut c_void,
        free: extern "C" fn(*mut c_void, usize),
    );
    fn zerorun_region_empty(numel: i64, scalar_type: i32, out: *mut *mut c_void) -> *mut c_char;
    fn zerorun_on_grad_ready(
        param: *mut c_void,
        f: extern "C" fn(*mut c_void, i64),
        ctx: *mut c_void,
        index: i64,
    ) -> *mut c_char;
    fn zerorun_remove_grad_ready(param: *mut c_void);
    fn zerorun_reset_grad(param: *mut c_void);
    fn zerorun_tensor_impl(t: *mut c_void) -> *const c_void;
    fn zerorun_pin_memory(t: *mut c_void, out: *mut *mut c_void) -> *mut c_char;
    fn zerorun_is_pinned(t: *mut c_void) -> i32;
    fn zerorun_released_like(like: *mut c_void, what: *const c_char, out: *mut *mut c_void) -> *mut c_char;
    fn zerorun_point_at(var: *mut c_void, data: *mut c_void) -> *mut c_char;
    fn zerorun_on_output_grad(
        t: *mut c_void,
        f: OutputReadyFn,
        ctx: *mut c_void,
        drop: extern "C" fn(*mut c_void),
        unit: i64,
    ) -> *mut c_char;
    fn zerorun_checkpoint(
        inputs: *const *mut c_void,
        n: i64,
        params: *const *mut c_void,
        n_params: i64,
        data: *mut c_void,
        run: RunFn,
        drop: extern "C" fn(*mut c_void),
        sink: *mut c_void,
        push: extern "C" fn(*mut c_void, *mut c_void),
    ) -> *mut c_char;
    fn zerorun_tensors_push(list: *mut c_void, t: *mut c_void);
}

/// What a checkpoint calls to run its closure: `(data, inputs, n, outputs, params)`, the last two the shim's lists
/// to push to.
type RunFn = extern "C" fn(*mut c_void, *mut *mut c_void, i64, *mut c_void, *mut c_void) -> *mut c_char;

/// What a checkpointed forward's run gives: its outputs, and the parameters of the units it entered inside (their
/// gradients are taken in backward beside the unit's own).
pub struct Recomputed {
    pub outputs: Vec<Tensor>,
    pub nested_params: Vec<Tensor>,
}

/// A checkpointed forward: run once without recording, again in backward with recording. Not `Send`: libtorch runs
/// a CPU backward on the thread that called it (a device backward on its device thread while that one waits), so
/// it runs where it was made or while its thread is blocked, and modules behind an `Rc` work. An error stops the
/// forward or the backward with its message.
pub type Recompute = Box<dyn Fn(&[Tensor]) -> std::result::Result<Recomputed, String>>;

/// What a unit's output hook calls: `(ctx, unit)`, returning null to go on or a malloc'ed message that stops the
/// backward with it.
pub type OutputReadyFn = extern "C" fn(*mut c_void, i64) -> *mut c_char;

fn ptr(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

/// Turns the shim's malloc'ed message (null: success) into a result.
fn check(message: *mut c_char, what: &str) -> Result<()> {
    if message.is_null() {
        return Ok(());
    }
    // SAFETY: the shim returns a NUL-terminated string from malloc, owned by us from here on.
    let text = unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned();
    unsafe { libc::free(message as *mut c_void) };
    Err(Error::Torch(tch::TchError::Torch(format!("{what}: {text}"))))
}

/// Resizes the storage under `t` (and under every view of it) to `nbytes`: 0 frees it, the full size makes the
/// views valid again (with undefined contents until written).
pub fn resize_storage(t: &Tensor, nbytes: usize) -> Result<()> {
    check(unsafe { zerorun_resize_storage(ptr(t), nbytes as i64) }, "resizing a unit's storage")
}

/// Bytes of the storage under `t`.
pub fn storage_nbytes(t: &Tensor) -> usize {
    unsafe { zerorun_storage_nbytes(ptr(t)) as usize }
}

/// Starts counting the FLOPs of the operators this thread runs (libtorch's profiler, `with_flops`).
pub fn flops_start() -> Result<()> {
    check(unsafe { zerorun_flops_start() }, "starting libtorch's profiler")
}

/// Stops counting: (FLOPs, operators) since [`flops_start`].
pub fn flops_stop() -> Result<(u64, u64)> {
    let (mut flops, mut ops) = (0u64, 0u64);
    check(unsafe { zerorun_flops_stop(&mut flops, &mut ops) }, "stopping libtorch's profiler")?;
    Ok((flops, ops))
}

/// Whether autograd records operations on this thread (false inside `tch::no_grad`).
pub fn grad_enabled() -> bool {
    unsafe { zerorun_grad_enabled() != 0 }
}

/// Backward from `roots` (each with its output gradient; `None` for a scalar root: a gradient of one) into
/// `inputs` only, returning their gradients (`None` where an input took no part) instead of accumulating `.grad`.
/// The graph is freed.
pub fn grad(roots: &[(&Tensor, Option<&Tensor>)], inputs: &[&Tensor]) -> Result<Vec<Option<Tensor>>> {
    let r: Vec<*mut c_void> = roots.iter().map(|(t, _)| ptr(t)).collect();
    let g: Vec<*mut c_void> = roots.iter().map(|(_, g)| g.map_or(std::ptr::null_mut(), ptr)).collect();
    let i: Vec<*mut c_void> = inputs.iter().map(|t| ptr(t)).collect();
    let mut out = vec![std::ptr::null_mut::<c_void>(); inputs.len()];
    check(
        unsafe { zerorun_grad(r.as_ptr(), g.as_ptr(), r.len() as i32, i.as_ptr(), i.len() as i32, out.as_mut_ptr()) },
        "backward of a unit",
    )?;
    Ok(out
        .into_iter()
        .map(|p| {
            // SAFETY: the shim allocated each output with `new at::Tensor`, which tch's Tensor owns and deletes.
            let t = unsafe { Tensor::from_ptr(p as *mut torch_sys::C_tensor) };
            t.defined().then_some(t)
        })
        .collect())
}

/// Makes `grad` the `.grad` of the leaf `param`; autograd accumulates into it in place from then on.
pub fn set_grad(param: &Tensor, grad: &Tensor) -> Result<()> {
    check(unsafe { zerorun_set_grad(ptr(param), ptr(grad)) }, "setting a parameter's gradient")
}

/// The state of libtorch's default CPU generator (seeded by `tch::manual_seed`; dropout draws from it).
pub fn rng_state() -> Result<Vec<u8>> {
    let len = unsafe { zerorun_rng_state_len() } as usize;
    let mut out = vec![0u8; len];
    check(unsafe { zerorun_rng_state_get(out.as_mut_ptr(), len as i64) }, "reading the CPU generator state")?;
    Ok(out)
}

/// A zeroed 1-D tensor of `len` elements of `kind` in the shared buffer region (comm/region/); its storage
/// allocates there when resized too.
pub fn region_zeros(len: usize, kind: tch::Kind) -> Result<Tensor> {
    static INIT: std::sync::Once = std::sync::Once::new();
    // SAFETY: plain function pointers with the C signatures the shim expects.
    INIT.call_once(|| unsafe {
        zerorun_region_allocator_init(crate::comm::region::region_alloc, crate::comm::region::region_free)
    });
    let mut out = std::ptr::null_mut::<c_void>();
    // c10::ScalarType numbering (tch keeps its own mapping private).
    let scalar_type = match kind {
        tch::Kind::Uint8 => 0,
        tch::Kind::Int64 => 4,
        tch::Kind::Half => 5,
        tch::Kind::Float => 6,
        tch::Kind::Double => 7,
        tch::Kind::BFloat16 => 15,
        other => return Err(Error::Usage(format!("no shared buffers of {other:?}"))),
    };
    check(unsafe { zerorun_region_empty(len as i64, scalar_type, &mut out) }, "allocating a shared buffer")?;
    // SAFETY: allocated by the shim with `new at::Tensor`, owned by tch's Tensor from here.
    let mut t = unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) };
    Ok(tch::no_grad(|| t.f_zero_())?)
}

/// Calls `f(ctx, index)` each time autograd has accumulated `param`'s gradient (a post-accumulate-grad hook on
/// the tensor, replacing any earlier one). `ctx` must stay valid until [`remove_grad_ready`].
pub fn on_grad_ready(param: &Tensor, f: extern "C" fn(*mut c_void, i64), ctx: *mut c_void, index: usize) -> Result<()> {
    check(unsafe { zerorun_on_grad_ready(ptr(param), f, ctx, index as i64) }, "registering a gradient hook")
}

pub fn remove_grad_ready(param: &Tensor) {
    unsafe { zerorun_remove_grad_ready(ptr(param)) }
}

/// Frees `param`'s `.grad` (`param.grad = None`).
pub fn reset_grad(param: &Tensor) {
    unsafe { zerorun_reset_grad(ptr(param)) }
}

/// libtorch's CPU generator is the process's: thread ranks share it. The engine holds this lock while it sets
/// the generator where no collective follows (`load_checkpoint` restoring a rank's saved state, stage 3's rank 0
/// building a unit again); a program whose thread ranks seed and then draw holds it across the seed and the
/// draws, so no rank's restore lands between them. (A checkpointed unit's recomputation sets it too, across a
/// forward that may gather: that one cannot hold a lock other ranks wait on.)
pub fn generator_lock() -> std::sync::MutexGuard<'static, ()> {
    static GENERATOR: std::sync::Mutex<()> = std::sync::Mutex::new(());
    GENERATOR.lock().unwrap_or_else(|p| p.into_inner())
}

/// Restores a state from [`rng_state`].
pub fn set_rng_state(state: &[u8]) -> Result<()> {
    check(unsafe { zerorun_rng_state_set(state.as_ptr(), state.len() as i64) }, "restoring the CPU generator state")
}

/// The identity of a variable: its TensorImpl, shared by every shallow clone and kept by `set_data`.
pub fn tensor_identity(t: &Tensor) -> usize {
    unsafe { zerorun_tensor_impl(ptr(t)) as usize }
}

/// A page-locked copy of the host tensor `t`. Not tch's `pin_memory(device)`: libtorch 2.11 warns on every call
/// that names a device, once per staged buffer.
pub fn pin_memory(t: &Tensor) -> Result<Tensor> {
    let mut out = std::ptr::null_mut::<c_void>();
    check(unsafe { zerorun_pin_memory(ptr(t), &mut out) }, "page-locking a host buffer")?;
    // SAFETY: allocated by the shim with `new at::Tensor`, owned by tch's Tensor from here.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// Whether the host tensor `t` is page-locked (no device named, as in [`pin_memory`]).
pub fn is_pinned(t: &Tensor) -> bool {
    unsafe { zerorun_is_pinned(ptr(t)) != 0 }
}

/// A tensor shaped and typed like `like` that every libtorch operator refuses with `zerorun: {what} [operator]`
/// (`native/unit_scopes.cpp`): what a stage-3 parameter points at between its unit's scopes.
pub fn released_like(like: &Tensor, what: &str) -> Result<Tensor> {
    let what = std::ffi::CString::new(what.replace('\0', " ")).expect("no NUL left");
    let mut out = std::ptr::null_mut::<c_void>();
    check(unsafe { zerorun_released_like(ptr(like), what.as_ptr(), &mut out) }, "making a released parameter")?;
    // SAFETY: allocated by the shim with `new at::Tensor`, owned by tch's Tensor from here.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// Points the variable `var` at `data` (its storage, shape and device), keeping the variable's identity, autograd
/// state and version counter: `set_data` without its same-backend check, so a parameter moves between its unit's
/// buffer and a [`released_like`] tensor.
pub fn point_at(var: &Tensor, data: &Tensor) -> Result<()> {
    check(unsafe { zerorun_point_at(ptr(var), ptr(data)) }, "pointing a parameter at its values")
}

/// Calls `f(ctx, unit)` before autograd computes anything that `t` (which requires grad) was computed from. The
/// hook owns `ctx` and calls `drop(ctx)` when it goes with its graph.
pub fn on_output_grad(
    t: &Tensor,
    f: OutputReadyFn,
    ctx: *mut c_void,
    drop: extern "C" fn(*mut c_void),
    unit: usize,
) -> Result<()> {
    check(unsafe { zerorun_on_output_grad(ptr(t), f, ctx, drop, unit as i64) }, "registering a unit's backward hook")
}

/// A malloc'ed copy of `text`, for a hook's message to the shim (which frees it).
pub fn malloc_message(text: &str) -> *mut c_char {
    let bytes = text.as_bytes();
    // SAFETY: a fresh allocation of len + 1 bytes, filled and NUL-terminated here; the shim frees it.
    unsafe {
        let m = libc::malloc(bytes.len() + 1) as *mut u8;
        if m.is_null() {
            return std::ptr::null_mut();
        }
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), m, bytes.len());
        *m.add(bytes.len()) = 0;
        m as *mut c_char
    }
}

/// Runs `f` on `inputs` as an activation checkpoint (`native/unit_scopes.cpp`): now without recording anything but
/// the inputs, and again in backward, with recording, followed by a backward of that graph into `inputs`, `params`
/// (the parameters `f` reads, which it captures) and the parameters of the units `f` entered inside; the
/// parameters' gradients reach `.grad` through autograd's accumulation, once. Returns `f`'s outputs.
pub fn checkpoint(inputs: &[&Tensor], params: &[Tensor], f: Recompute) -> Result<Vec<Tensor>> {
    let handles: Vec<*mut c_void> = inputs.iter().map(|t| ptr(t)).collect();
    let param_handles: Vec<*mut c_void> = params.iter().map(ptr).collect();
    let data = Box::into_raw(Box::new(f)) as *mut c_void;
    let mut outputs: Vec<Tensor> = Vec::new();
    // The shim owns `data` from here: it drops it through `drop_recompute` when the graph goes (or on an error).
    check(
        unsafe {
            zerorun_checkpoint(
                handles.as_ptr(),
                handles.len() as i64,
                param_handles.as_ptr(),
                param_handles.len() as i64,
                data,
                run_recompute,
                drop_recompute,
                &mut outputs as *mut Vec<Tensor> as *mut c_void,
                push_output,
            )
        },
        "a checkpointed unit",
    )?;
    Ok(outputs)
}

extern "C" fn push_output(sink: *mut c_void, t: *mut c_void) {
    // SAFETY: `sink` is `checkpoint`'s Vec, alive for the call; `t` was made by the shim with `new at::Tensor`,
    // owned by tch's Tensor from here.
    unsafe { (*(sink as *mut Vec<Tensor>)).push(Tensor::from_ptr(t as *mut torch_sys::C_tensor)) };
}

extern "C" fn run_recompute(
    data: *mut c_void,
    inputs: *mut *mut c_void,
    n: i64,
    outputs: *mut c_void,
    params: *mut c_void,
) -> *mut c_char {
    // SAFETY: `data` is the Recompute `checkpoint` boxed; the shim keeps it alive while it calls.
    let f = unsafe { &*(data as *const Recompute) };
    // SAFETY: the shim made each handle with `new at::Tensor` for us to own.
    let inputs: Vec<Tensor> =
        (0..n as usize).map(|i| unsafe { Tensor::from_ptr(*inputs.add(i) as *mut torch_sys::C_tensor) }).collect();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&inputs))) {
        Ok(Ok(run)) => {
            // SAFETY: `outputs` and `params` are the shim's lists, alive for the call; it copies each tensor.
            for t in &run.outputs {
                unsafe { zerorun_tensors_push(outputs, ptr(t)) };
            }
            for t in &run.nested_params {
                unsafe { zerorun_tensors_push(params, ptr(t)) };
            }
            std::ptr::null_mut()
        }
        Ok(Err(why)) => malloc_message(&why),
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            malloc_message(&format!("a checkpointed unit's forward panicked: {why}"))
        }
    }
}

extern "C" fn drop_recompute(data: *mut c_void) {
    // SAFETY: made by Box::into_raw in `checkpoint`; the shim calls this once.
    drop(unsafe { Box::from_raw(data as *mut Recompute) });
}
