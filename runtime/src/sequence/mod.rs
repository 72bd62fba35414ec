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
