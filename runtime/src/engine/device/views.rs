//! Element views of contiguous CPU tensors, and the tensor kind of each precision.
use half::{bf16, f16};
use tch::{Kind, Tensor};

use crate::comm::{Collectives, CommResult, Communicator, ReduceOp};
use crate::config::{CommDataType, Precision};
use crate::engine::device::Residence;

/// The tensor kind that holds a precision's model parameters.
pub fn kind_of(p: Precision) -> Kind {
    match p {
        Precision::Fp32 => Kind::Float,
        Precision::Bf16 => Kind::BFloat16,
        Precision::Fp16 => Kind::Half,
    }
}

/// The kind gradients travel in: `communication_data_type`, else the parameters' own.
pub fn comm_kind(c: Option<CommDataType>, p: Precision) -> Kind {
    match c {
        Some(CommDataType::Fp32) => Kind::Float,
        Some(CommDataType::Bf16) => Kind::BFloat16,
        Some(CommDataType::Fp16) => Kind::Half,
        None => kind_of(p),
    }
}

/// A zeroed flat buffer of `len` elements on `device` that the engine hands to collectives: in host memory, in the
/// shared buffer region when the communicator's peers map it (`shared`), an ordinary tensor otherwise.
pub fn comm_zeros(len: usize, kind: Kind, shared: bool, device: tch::Device) -> crate::error::Result<Tensor> {
    if shared && device == tch::Device::Cpu {
        return crate::engine::device::native::region_zeros(len, kind);
    }
    Ok(Tensor::f_zeros([len as i64], (kind, device))?)
}

/// Element types a tensor is viewed as, with the kind that holds them.
pub trait ViewElement {
    const KIND: Kind;
}

impl ViewElement for f32 {
    const KIND: Kind = Kind::Float;
}

impl ViewElement for bf16 {
    const KIND: Kind = Kind::BFloat16;
}

impl ViewElement for f16 {
    const KIND: Kind = Kind::Half;
}

/// What every view checks, always (a violation is an engine bug, not bad input): CPU memory, contiguous.
fn check_viewable(t: &Tensor) {
    assert!(t.device() == tch::Device::Cpu && t.is_contiguous(), "a view of a non-contiguous or non-CPU tensor");
}

/// A contiguous CPU tensor's elements as `T` (its kind is checked).
///
/// # Safety
/// The tensor's storage is shared by every handle to it (shallow clones, views, the model's parameters), which
/// the borrow of `t` does not see. For as long as the slice lives, the caller guarantees that nothing else reads
/// or writes these elements (no other view from this module, no tensor operation on an aliasing handle, no
/// collective in flight on them) and that the storage is neither freed nor resized.
#[allow(clippy::mut_from_ref)]
pub unsafe fn slice<T: ViewElement>(t: &Tensor) -> &mut [T] {
    check_viewable(t);
    assert_eq!(t.kind(), T::KIND, "a view of the wrong element type");
    let n = t.numel();
    if n == 0 {
        return &mut [];
    }
    // SAFETY: the storage holds n contiguous elements of T (checked above); exclusivity is the caller's.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut T, n) }
}

/// A gradient buffer of any float kind the engine keeps, for the norm and the optimizer.
///
/// # Safety
/// As for [`slice`].
pub unsafe fn grads_of(t: &Tensor) -> zerorun_optim::Grads<'_> {
    // SAFETY: the caller's, as for `slice`.
    unsafe {
        match t.kind() {
            Kind::BFloat16 => zerorun_optim::Grads::Bf16(slice(t)),
            Kind::Half => zerorun_optim::Grads::F16(slice(t)),
            _ => zerorun_optim::Grads::F32(slice(t)),
        }
    }
}

/// A contiguous CPU tensor's bytes, whatever its kind.
///
/// # Safety
/// As for [`slice`].
#[allow(clippy::mut_from_ref)]
pub unsafe fn bytes(t: &Tensor) -> &mut [u8] {
    check_viewable(t);
    let n = t.numel() * t.kind().elt_size_in_bytes();
    if n == 0 {
        return &mut [];
    }
    // SAFETY: the storage holds n contiguous bytes (checked above); exclusivity is the caller's.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut u8, n) }
}

/// `t` and `out` are two buffers, not views of one storage range (a collective reads one while writing the other).
fn check_disjoint(t: &Tensor, out: &Tensor) {
    let (a, b) = (t.data_ptr() as usize, out.data_ptr() as usize);
    let (la, lb) = (t.numel() * t.kind().elt_size_in_bytes(), out.numel() * out.kind().elt_size_in_bytes());
    assert!(a + la <= b || b + lb <= a, "a collective's input and output overlap");
}

// The collectives below take `&Tensor` and hold their views only for the call, which blocks until the collective
// is done: SAFETY for each is that the engine runs nothing else on these buffers meanwhile (one thread drives a
// rank's engine; its communication thread is waited on before a buffer it uses is touched).

/// A staging step's error, naming what failed.
fn staging_error(what: &'static str) -> impl FnOnce(crate::error::Error) -> crate::comm::CommError {
    move |e| crate::comm::CommError::BadArgument { op: "stage", rank: 0, what: format!("{what}: {e}") }
}

/// `t` takes `host`'s values back (the staging's second copy); `host` is flat, `t` of any shape.
fn copy_back(t: &Tensor, host: &Tensor) -> CommResult<()> {
    tch::no_grad(|| t.shallow_clone().f_copy_(&host.f_view(t.size().as_slice())?))
        .map_err(|e| staging_error("copying a collective's result back")(e.into()))
}

/// `t` as device memory for a backend that reduces it where it is: a contiguous tensor on a CUDA device. None
/// for host tensors (and under emulation, whose "device" is host memory) and non-contiguous ones (staged).
fn device_buf(t: &Tensor) -> Option<crate::comm::DeviceBuf> {
    let tch::Device::Cuda(device) = t.device() else { return None };
    if !t.is_contiguous() {
        return None;
    }
    let dtype = match t.kind() {
        Kind::BFloat16 => crate::comm::Dtype::Bf16,
        Kind::Half => crate::comm::Dtype::F16,
        Kind::Int64 => crate::comm::Dtype::I64,
        _ => crate::comm::Dtype::F32,
    };
    Some(crate::comm::DeviceBuf { ptr: t.data_ptr() as u64, count: t.numel(), dtype, device })
}

/// The one route of an in-place collective on `t`: on its device memory when the backend reduces it there
/// (`on_device_memory`, NCCL), else on host views (`on_host`) of a staged host copy (the device paths) or of `t`
/// itself.
fn in_place(
    residence: Residence,
    t: &Tensor,
    on_device_memory: impl FnOnce(crate::comm::DeviceBuf) -> CommResult<bool>,
    on_host: impl FnOnce(&Tensor) -> CommResult<()>,
) -> CommResult<()> {
    if let Some(buf) = device_buf(t) {
        if on_device_memory(buf)? {
            return Ok(());
        }
    }
    if !residence.on_device(t) {
        return on_host(t);
    }
    let host =
        crate::engine::device::staging::host_copy(t).map_err(staging_error("copying a tensor to host memory"))?;
    on_host(host.values())?;
    copy_back(t, host.values())
}

/// Runs a collective on a flat tensor of any supported kind (see [`in_place`]).
pub fn all_reduce(residence: Residence, comm: &dyn Communicator, t: &Tensor, op: ReduceOp) -> CommResult<()> {
    // SAFETY (both): the engine's buffer or this call's host copy, untouched by anything else during the blocking
    // call.
    in_place(
        residence,
        t,
        |buf| unsafe { comm.all_reduce_device(buf, op) },
        |h| unsafe { all_reduce_views(comm, h, op) },
    )
}

unsafe fn all_reduce_views(comm: &dyn Communicator, t: &Tensor, op: ReduceOp) -> CommResult<()> {
    match t.kind() {
        Kind::BFloat16 => comm.all_reduce(slice::<bf16>(t), op),
        Kind::Half => comm.all_reduce(slice::<f16>(t), op),
        _ => comm.all_reduce(slice::<f32>(t), op),
    }
}

pub fn broadcast(residence: Residence, comm: &dyn Communicator, t: &Tensor, root: usize) -> CommResult<()> {
    // SAFETY (both): as in `all_reduce`.
    in_place(
        residence,
        t,
        |buf| unsafe { comm.broadcast_device(buf, root) },
        |h| unsafe { broadcast_views(comm, h, root) },
    )
}

unsafe fn broadcast_views(comm: &dyn Communicator, t: &Tensor, root: usize) -> CommResult<()> {
    match t.kind() {
        Kind::BFloat16 => comm.broadcast(slice::<bf16>(t), root),
        Kind::Half => comm.broadcast(slice::<f16>(t), root),
        _ => comm.broadcast(slice::<f32>(t), root),
    }
}

pub fn all_gather(residence: Residence, comm: &dyn Communicator, t: &Tensor) -> CommResult<()> {
    // SAFETY (both): as in `all_reduce`.
    in_place(residence, t, |buf| unsafe { comm.all_gather_device(buf) }, |h| unsafe { all_gather_views(comm, h) })
}

unsafe fn all_gather_views(comm: &dyn Communicator, t: &Tensor) -> CommResult<()> {
    match t.kind() {
        Kind::BFloat16 => comm.all_gather_in_place(slice::<bf16>(t)),
        Kind::Half => comm.all_gather_in_place(slice::<f16>(t)),
        _ => comm.all_gather_in_place(slice::<f32>(t)),
    }
}

/// [`all_gather`] among this host's ranks only (hpZ's secondary partition; see
/// [`Communicator::host_all_gather_buf`]): `t` is the host's ranks' equal parts.
pub fn all_gather_in_host(residence: Residence, comm: &dyn Communicator, t: &Tensor) -> CommResult<()> {
    // SAFETY: as in `all_reduce`.
    in_place(residence, t, |_| Ok(false), |h| comm.host_all_gather_buf(unsafe { buf_of(h) }))
}

/// A host tensor of floats as a collective buffer.
///
/// # Safety
/// As [`slice`]: nothing else reads or writes `t` while the buffer lives.
unsafe fn buf_of(t: &Tensor) -> crate::comm::BufMut<'_> {
    use crate::comm::BufMut;
    match t.kind() {
        Kind::BFloat16 => BufMut::new(slice::<bf16>(t)),
        Kind::Half => BufMut::new(slice::<f16>(t)),
        _ => BufMut::new(slice::<f32>(t)),
    }
}

/// The all-to-all of parts of any length ([`crate::comm::Communicator::all_to_all_v_buf`]) from one host tensor of
/// floats into another: `send[q]` elements of `input` to rank q, `recv[p]` from rank p into `output`.
pub fn all_to_all_v(
    comm: &dyn Communicator,
    input: &Tensor,
    send: &[usize],
    output: &Tensor,
    recv: &[usize],
) -> CommResult<()> {
    check_disjoint(input, output);
    // SAFETY: the caller's two buffers (disjoint, checked), untouched by anything else during the blocking call.
    unsafe { comm.all_to_all_v_buf(buf_of(input).into(), send, buf_of(output), recv) }
}

/// [`all_gather`] with every rank's part block-quantized to int8 on the way (`zero_quantized_weights`; see
/// [`crate::comm::quantized`]). On host memory: a device tensor is staged through a host copy.
pub fn all_gather_quantized(residence: Residence, comm: &dyn Communicator, t: &Tensor, block: usize) -> CommResult<()> {
    // SAFETY: as in `all_reduce`.
    in_place(residence, t, |_| Ok(false), |h| crate::comm::quantized::all_gather(comm, unsafe { buf_of(h) }, block))
}

/// All-reduce of a flat tensor whose traffic is int8 blocks of `block` values (ZeRO++ qgZ across shard groups;
/// see [`crate::comm::quantized::all_reduce`]).
pub fn all_reduce_quantized(
    residence: Residence,
    comm: &dyn Communicator,
    t: &Tensor,
    op: ReduceOp,
    block: usize,
) -> CommResult<()> {
    // SAFETY: as in `all_reduce`.
    in_place(residence, t, |_| Ok(false), |h| crate::comm::quantized::all_reduce(comm, unsafe { buf_of(h) }, op, block))
}

/// Reduce-scatter of a flat tensor into `out` (a tensor of the same kind, one partition long).
pub fn reduce_scatter(
    residence: Residence,
    comm: &dyn Communicator,
    t: &Tensor,
    out: &Tensor,
    op: ReduceOp,
) -> CommResult<()> {
    check_disjoint(t, out);
    if let (Some(input), Some(output)) = (device_buf(t), device_buf(out)) {
        // SAFETY: as in `all_reduce`; the two buffers are disjoint (checked).
        if unsafe { comm.reduce_scatter_device(input, output, op) }? {
            return Ok(());
        }
    }
    on_host_pair(residence, t, out, |t, out| {
        // SAFETY: the engine's buffers or this call's host copies, disjoint (checked), untouched by anything else
        // during the blocking call.
        unsafe {
            match t.kind() {
                Kind::BFloat16 => comm.reduce_scatter(slice::<bf16>(t), slice::<bf16>(out), op),
                Kind::Half => comm.reduce_scatter(slice::<f16>(t), slice::<f16>(out), op),
                _ => comm.reduce_scatter(slice::<f32>(t), slice::<f32>(out), op),
            }
        }
    })
}

/// [`reduce_scatter`] with the parts that travel quantized to int8 blocks (`zero_quantized_gradients`; see
/// [`crate::comm::quantized`]). On host memory: device tensors are staged through host copies.
pub fn reduce_scatter_quantized(
    residence: Residence,
    comm: &dyn Communicator,
    t: &Tensor,
    out: &Tensor,
    op: ReduceOp,
    block: usize,
) -> CommResult<()> {
    check_disjoint(t, out);
    on_host_pair(residence, t, out, |t, out| {
        // SAFETY: as in `reduce_scatter`.
        let (input, output) = unsafe { (buf_of(t), buf_of(out)) };
        comm.reduce_scatter_quantized_buf(input.into(), output, op, block)
    })
}

/// Runs `f` on `t` and `out` where they are in host memory, else on host copies (the output's copied back).
fn on_host_pair(
    residence: Residence,
    t: &Tensor,
    out: &Tensor,
    f: impl FnOnce(&Tensor, &Tensor) -> CommResult<()>,
) -> CommResult<()> {
    if residence.on_device(t) || residence.on_device(out) {
        let host =
            crate::engine::device::staging::host_copy(t).map_err(staging_error("copying a tensor to host memory"))?;
        let host_out = crate::engine::device::staging::host_buffer(out.numel(), out.kind(), out.device())
            .map_err(staging_error("a host buffer for a collective's output"))?;
        f(host.values(), host_out.values())?;
        return copy_back(out, host_out.values());
    }
    f(t, out)
}

/// `acc[i] += t[i]` in f32, whatever `t`'s kind.
pub fn accumulate(acc: &mut [f32], t: &Tensor) {
    // SAFETY: `acc` is Rust-owned memory, so not `t`'s; the view lives for this call only.
    unsafe { accumulate_views(acc, t) }
}

unsafe fn accumulate_views(acc: &mut [f32], t: &Tensor) {
    match t.kind() {
        Kind::BFloat16 => acc.iter_mut().zip(slice::<bf16>(t).iter()).for_each(|(a, g)| *a += g.to_f32()),
        Kind::Half => acc.iter_mut().zip(slice::<f16>(t).iter()).for_each(|(a, g)| *a += g.to_f32()),
        _ => acc.iter_mut().zip(slice::<f32>(t).iter()).for_each(|(a, g)| *a += *g),
    }
}
