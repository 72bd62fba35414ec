//! Sequence parallelism, DeepSpeed-Ulysses: each of a group's S ranks holds `t / S` consecutive tokens of every row
//! (embeddings, norms and MLPs are token-wise and run on the slice), and attention, the one place where tokens meet,
//! trades the slices for heads: an all-to-all gives each rank the whole sequence of `heads / S` heads, any attention
//! runs there (causal, rotary positions of the whole sequence), and an all-to-all gives the slices back. Backward
//! runs the inverse all-to-alls. ZeRO shards over the data x sequence ranks (`sequence_parallel_size` in ds_config
//! makes the engine count a batch's rows over the data-parallel ranks alone), and [`sequence_loss`] gives each rank
//! the loss whose gradient, averaged over all of them, is the whole rows'.
use tch::{Kind, Tensor};

use crate::comm::{Collectives, ReduceOp};
use crate::error::{Error, Result};

/// The ranks that split each row's sequence between them (adjacent ranks of the job; rank s of the group holds
/// the s-th slice).
pub type SequenceParallel = crate::exchange::AllToAllGroup;

/// This rank's slice of `x` along dimension `dim` (the sequence's): `len / S` consecutive positions.
pub fn slice(group: &SequenceParallel, x: &Tensor, dim: i64) -> Result<Tensor> {
    let (s, rank) = (group.size() as i64, group.rank() as i64);
    let len = x.size()[dim as usize];
    if len % s != 0 {
        return Err(Error::Usage(format!(
            "sequence parallel: a sequence of {len} tokens does not split into {s} equal slices"
        )));
    }
    Ok(x.narrow(dim, rank * len / s, len / s))
}

/// One of `x`'s [b, t/S, heads, d] slices to [b, heads/S, t, d]: this rank's heads of the whole sequence.
fn to_heads(group: &SequenceParallel, x: &Tensor) -> Result<Tensor> {
    let (b, t, h, d) = x.size4().map_err(Error::Torch)?;
    let s = group.size() as i64;
    // [S (the heads' group), b, t/S, heads/S, d]: part q goes to rank q.
    let parts = x.reshape([b, t, s, h / s, d]).permute([2, 0, 1, 3, 4]).contiguous();
    let ones = vec![1i64; s as usize];
    let arrived = group.all_to_all_rows(&parts, &ones, &ones)?; // [S (the slice's rank), b, t/S, heads/S, d]
    Ok(arrived.permute([1, 3, 0, 2, 4]).reshape([b, h / s, s * t, d]))
}

/// An attention output [b, t, heads/S · d] (this rank's heads, the whole sequence) to this rank's slice of every
/// head, [b, t/S, heads · d].
fn to_slices(group: &SequenceParallel, y: &Tensor) -> Result<Tensor> {
    let (b, t, w) = y.size3().map_err(Error::Torch)?;
    let s = group.size() as i64;
    let parts = y.reshape([b, s, t / s, w]).permute([1, 0, 2, 3]).contiguous(); // part q: slice q
    let ones = vec![1i64; s as usize];
    let arrived = group.all_to_all_rows(&parts, &ones, &ones)?; // [S (the heads' rank), b, t/S, w]
    Ok(arrived.permute([1, 2, 0, 3]).reshape([b, t / s, s * w]))
}

/// Ulysses attention. `q` [b, t/S, heads, d], `k` and `v` [b, t/S, kv_heads, d] are this rank's slice (queries and
/// keys before rotary positions: `attend` applies them to the whole sequence); `attend(q, k, v)` gets this rank's
/// `heads / S` query heads of the whole sequence, [b, heads/S, t, d], with their key/value heads (`kv_heads / S`
/// of them where S divides kv_heads; otherwise each query head's own, repeated: grouped-query attention whose key
/// and value heads do not split), and returns [b, t, heads/S · d], the heads side by side. The result is this
/// rank's slice of the whole attention output, [b, t/S, heads · d]. The heads must divide by S.
pub fn ulysses_attention(
    group: &SequenceParallel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    attend: impl FnOnce(&Tensor, &Tensor, &Tensor) -> Tensor,
) -> Result<Tensor> {
    let s = group.size() as i64;
    let (heads, kv_heads) = (q.size()[2], k.size()[2]);
    if heads % s != 0 {
        return Err(Error::Usage(format!(
            "sequence parallel: {heads} attention heads do not split over {s} ranks (Ulysses trades heads for sequence)"
        )));
    }
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Error::Usage(format!(
            "sequence parallel: {heads} heads are not a multiple of {kv_heads} key/value heads"
        )));
    }
    let (k, v) = if kv_heads % s == 0 {
        (k.shallow_clone(), v.shallow_clone())
    } else {
        // Each query head's key/value head, so that every rank's heads/S query heads bring their own.
        let r = heads / kv_heads;
        (k.repeat_interleave_self_int(r, 2, None), v.repeat_interleave_self_int(r, 2, None))
    };
    let (q, k, v) = (to_heads(group, q)?, to_heads(group, &k)?, to_heads(group, &v)?);
    to_slices(group, &attend(&q, &k, &v))
}

/// The loss of this rank's slice for the engine: `token_loss_sum` (the sum of this rank's token losses, with their
/// graph) and `tokens` (how many it summed) over the group give the rows' mean, `sum / tokens` of the whole
/// sequences (not a mean of the slices' means). Its value is that mean on every rank of the group; its gradient is
/// S times this rank's part of it, so that the engine's average over the data x sequence ranks is the rows' gradient
/// averaged over the data-parallel ranks (each sequence rank's gradient holds only its own tokens' terms).
pub fn sequence_loss(group: &SequenceParallel, token_loss_sum: &Tensor, tokens: i64) -> Result<Tensor> {
    // f32 as the loss is: counts below 2^24 are exact.
    let mut totals = [token_loss_sum.detach().to_kind(Kind::Float).double_value(&[]) as f32, tokens as f32];
    group.comm().all_reduce(&mut totals[..], ReduceOp::Sum).map_err(Error::from)?;
    let (sum, count) = (f64::from(totals[0]), f64::from(totals[1]));
    let scaled = token_loss_sum.to_kind(Kind::Float) * (group.size() as f64 / count);
    Ok(&scaled + (Tensor::from(sum / count).to_kind(Kind::Float) - scaled.detach()))
}

extern "C" {
    fn zerorun_ring_attention(
        q: *mut std::ffi::c_void,
        k: *mut std::ffi::c_void,
        v: *mut std::ffi::c_void,
        pq: *mut std::ffi::c_void,
        pk: *mut std::ffi::c_void,
        scale: f64,
        ranks: i64,
        shift: Shift,
        group: *mut std::ffi::c_void,
        out: *mut *mut std::ffi::c_void,
    ) -> *mut std::ffi::c_char;
}

type Shift =
    extern "C" fn(*mut std::ffi::c_void, *mut std::ffi::c_void, *mut std::ffi::c_void) -> *mut std::ffi::c_char;

/// The positions of the sequence this rank holds under [`ring_slice`]: of `2 S` equal chunks of `len` positions,
/// chunk `r` and chunk `2 S - 1 - r` (a head and a tail, so that every rank has the same causal work: the early
/// chunk sees few keys, the late one many).
pub fn ring_positions(group: &SequenceParallel, len: i64) -> Result<Tensor> {
    let (s, r) = (group.size() as i64, group.rank() as i64);
    if len % (2 * s) != 0 {
        return Err(Error::Usage(format!(
            "ring attention: a sequence of {len} tokens does not split into {} equal chunks (2 per rank)",
            2 * s
        )));
    }
    let chunk = len / (2 * s);
    let head = Tensor::arange_start(r * chunk, (r + 1) * chunk, (Kind::Int64, tch::Device::Cpu));
    let tail = Tensor::arange_start((2 * s - 1 - r) * chunk, (2 * s - r) * chunk, (Kind::Int64, tch::Device::Cpu));
    Ok(Tensor::cat(&[head, tail], 0))
}

/// This rank's tokens of `x` along `dim` for ring attention: the positions [`ring_positions`] names, in order.
pub fn ring_slice(group: &SequenceParallel, x: &Tensor, dim: i64) -> Result<Tensor> {
    let positions = ring_positions(group, x.size()[dim as usize])?;
    Ok(x.index_select(dim, &positions.to_device(x.device())))
}

/// Ring attention (context parallelism): causal attention of this rank's queries `q` [b, heads, t, d] over the
/// whole sequence's keys and values, each rank holding `k`, `v` [b, kv_heads, t, d] of its own tokens, at
/// `positions` (`[t]`) of the sequence (rotary positions already applied to q and k). The key/value blocks travel around
/// the group's ring with an online softmax (S - 1 hops forward, S backward, the gradients riding with their blocks),
/// so no rank holds the whole sequence's keys, and the heads need not divide by S (where Ulysses needs them to).
/// Returns this rank's output, [b, t, heads · d]. `positions` from [`ring_positions`] balance the causal work.
pub fn ring_attention(
    group: &SequenceParallel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &Tensor,
) -> Result<Tensor> {
    let (b, heads, t, d) = q.size4().map_err(Error::Torch)?;
    let kv_heads = k.size()[1];
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Error::Usage(format!(
            "ring attention: {heads} heads are not a multiple of {kv_heads} key/value heads"
        )));
    }
    let (k, v) = match heads / kv_heads {
        1 => (k.shallow_clone(), v.shallow_clone()),
        r => (k.repeat_interleave_self_int(r, 1, None), v.repeat_interleave_self_int(r, 1, None)),
    };
    let positions = positions.to_kind(Kind::Int64).to_device(q.device());
    let mut out: *mut std::ffi::c_void = std::ptr::null_mut();
    let group_ptr = group as *const SequenceParallel as *mut std::ffi::c_void;
    // SAFETY: live tensors; `group` outlives every graph through this operator (the caller's contract, as for the
    // all-to-all of rows).
    let message = unsafe {
        zerorun_ring_attention(
            q.as_ptr() as *mut _,
            k.as_ptr() as *mut _,
            v.as_ptr() as *mut _,
            positions.as_ptr() as *mut _,
            positions.as_ptr() as *mut _,
            1.0 / (d as f64).sqrt(),
            group.size() as i64,
            ring_shift,
            group_ptr,
            &mut out,
        )
    };
    if !message.is_null() {
        // SAFETY: a NUL-terminated string from malloc, ours to free.
        let text = unsafe { std::ffi::CStr::from_ptr(message) }.to_string_lossy().into_owned();
        unsafe { libc::free(message as *mut std::ffi::c_void) };
        return Err(Error::Torch(tch::TchError::Torch(format!("ring attention: {text}"))));
    }
    // SAFETY: the shim allocated the result with `new at::Tensor`, which tch's Tensor owns from here.
    let o = unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) };
    Ok(o.transpose(1, 2).reshape([b, t, heads * d]))
}

/// The shim's ring shift: `send` to the next rank of the group, `recv` from the previous one (host memory; a device
/// tensor travels through host copies). Returns null or a malloc'ed message.
extern "C" fn ring_shift(
    group: *mut std::ffi::c_void,
    send: *mut std::ffi::c_void,
    recv: *mut std::ffi::c_void,
) -> *mut std::ffi::c_char {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> std::result::Result<(), String> {
        crate::comm::coding::EXCHANGE.timed(|| ring_shift_now(group, send, recv))
    }));
    let text = match result {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(e)) => e,
        Err(_) => "the ring shift panicked".to_string(),
    };
    let c = std::ffi::CString::new(text.replace('\0', " ")).unwrap_or_default();
    // SAFETY: strdup copies into malloc'ed memory, which the shim frees.
    unsafe { libc::strdup(c.as_ptr()) }
}

/// [`ring_shift`]'s work.
fn ring_shift_now(
    group: *mut std::ffi::c_void,
    send: *mut std::ffi::c_void,
    recv: *mut std::ffi::c_void,
) -> std::result::Result<(), String> {
    {
        // SAFETY: `group` is the live group `ring_attention` passed; the tensors are the shim's, borrowed for this
        // call (ManuallyDrop: tch must not delete them).
        let group = unsafe { &*(group as *const SequenceParallel) };
        let (send, recv) = unsafe {
            (
                std::mem::ManuallyDrop::new(Tensor::from_ptr(send as *mut torch_sys::C_tensor)),
                std::mem::ManuallyDrop::new(Tensor::from_ptr(recv as *mut torch_sys::C_tensor)),
            )
        };
        let (host_send, host_recv) = match send.device() {
            tch::Device::Cpu => (send.shallow_clone(), recv.shallow_clone()),
            _ => (send.to_device(tch::Device::Cpu), recv.to_device(tch::Device::Cpu)),
        };
        let dtype = match host_send.kind() {
            Kind::Float => crate::comm::Dtype::F32,
            Kind::BFloat16 => crate::comm::Dtype::Bf16,
            Kind::Half => crate::comm::Dtype::F16,
            Kind::Int64 => crate::comm::Dtype::I64,
            other => return Err(format!("the ring cannot carry {other:?} tensors")),
        };
        let (n, rank) = (group.size(), group.rank());
        // SAFETY: two distinct contiguous host buffers of the shim's, untouched by anything else during the call.
        unsafe {
            let out = crate::comm::BufRef { bytes: crate::engine::device::views::bytes(&host_send), dtype };
            let into = crate::comm::BufMut { bytes: crate::engine::device::views::bytes(&host_recv), dtype };
            group.comm().send_recv_buf(out, (rank + 1) % n, into, (rank + n - 1) % n).map_err(|e| e.to_string())?;
        }
        if recv.device() != tch::Device::Cpu {
            tch::no_grad(|| recv.shallow_clone().f_copy_(&host_recv)).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}
