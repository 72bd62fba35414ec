//! Element views of contiguous CPU tensors, and the tensor kind of each precision.
use half::{bf16, f16};
use tch::{Kind, Tensor};

use crate::comm::{Collectives, CommResult, Communicator, ReduceOp};
use crate::config::{CommDataType, Precision};

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

/// A zeroed flat buffer of `len` elements that the engine hands to collectives: in the shared buffer region
/// when the communicator's peers map it (`shared`), an ordinary tensor otherwise.
pub fn comm_zeros(len: usize, kind: Kind, shared: bool) -> crate::error::Result<Tensor> {
    if shared {
        return super::native::region_zeros(len, kind);
    }
    Ok(Tensor::zeros([len as i64], (kind, tch::Device::Cpu)))
}

/// A contiguous CPU tensor's elements as `T`.
///
/// SAFETY (for callers): the tensor must be contiguous, on the CPU, of `T`'s kind, and outlive the slice; the
/// engine only calls this on its own flat buffers.
#[allow(clippy::mut_from_ref)]
pub fn slice<T>(t: &Tensor) -> &mut [T] {
    debug_assert!(t.is_contiguous() && t.kind().elt_size_in_bytes() == std::mem::size_of::<T>());
    let n = t.numel();
    if n == 0 {
        return &mut [];
    }
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut T, n) }
}

/// A contiguous CPU tensor's bytes, whatever its kind (see [`slice`] for the conditions).
#[allow(clippy::mut_from_ref)]
pub fn bytes(t: &Tensor) -> &mut [u8] {
    debug_assert!(t.is_contiguous());
    let n = t.numel() * t.kind().elt_size_in_bytes();
    if n == 0 {
        return &mut [];
    }
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut u8, n) }
}

/// A contiguous CPU tensor as a collective buffer (see [`slice`] for the conditions).
pub fn buf_mut(t: &Tensor) -> crate::comm::BufMut<'_> {
    let dtype = match t.kind() {
        Kind::BFloat16 => crate::comm::Dtype::Bf16,
        Kind::Half => crate::comm::Dtype::F16,
        _ => crate::comm::Dtype::F32,
    };
    let bytes = t.numel() * t.kind().elt_size_in_bytes();
    let bytes: &mut [u8] =
        if bytes == 0 { &mut [] } else { unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut u8, bytes) } };
    crate::comm::BufMut { bytes, dtype }
}

/// Runs a collective on a flat tensor of any supported kind.
pub fn all_reduce(comm: &dyn Communicator, t: &Tensor, op: ReduceOp) -> CommResult<()> {
    match t.kind() {
        Kind::BFloat16 => comm.all_reduce(slice::<bf16>(t), op),
        Kind::Half => comm.all_reduce(slice::<f16>(t), op),
        _ => comm.all_reduce(slice::<f32>(t), op),
    }
}

pub fn broadcast(comm: &dyn Communicator, t: &Tensor, root: usize) -> CommResult<()> {
    match t.kind() {
        Kind::BFloat16 => comm.broadcast(slice::<bf16>(t), root),
        Kind::Half => comm.broadcast(slice::<f16>(t), root),
        _ => comm.broadcast(slice::<f32>(t), root),
    }
}

pub fn all_gather(comm: &dyn Communicator, t: &Tensor) -> CommResult<()> {
    match t.kind() {
        Kind::BFloat16 => comm.all_gather_in_place(slice::<bf16>(t)),
        Kind::Half => comm.all_gather_in_place(slice::<f16>(t)),
        _ => comm.all_gather_in_place(slice::<f32>(t)),
    }
}

/// Reduce-scatter of a flat tensor into `out` (a tensor of the same kind, one partition long).
pub fn reduce_scatter(comm: &dyn Communicator, t: &Tensor, out: &Tensor, op: ReduceOp) -> CommResult<()> {
    match t.kind() {
        Kind::BFloat16 => comm.reduce_scatter(slice::<bf16>(t), slice::<bf16>(out), op),
        Kind::Half => comm.reduce_scatter(slice::<f16>(t), slice::<f16>(out), op),
        _ => comm.reduce_scatter(slice::<f32>(t), slice::<f32>(out), op),
    }
}

/// `acc[i] += t[i]` in f32, whatever `t`'s kind.
pub fn accumulate(acc: &mut [f32], t: &Tensor) {
    match t.kind() {
        Kind::BFloat16 => acc.iter_mut().zip(slice::<bf16>(t).iter()).for_each(|(a, g)| *a += g.to_f32()),
        Kind::Half => acc.iter_mut().zip(slice::<f16>(t).iter()).for_each(|(a, g)| *a += g.to_f32()),
        _ => acc.iter_mut().zip(slice::<f32>(t).iter()).for_each(|(a, g)| *a += *g),
    }
}
