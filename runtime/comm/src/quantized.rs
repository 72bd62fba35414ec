//! Block-quantized int8 all-gather (ZeRO++'s qwZ): every rank's part travels as one signed byte per value and one
//! f32 scale per block of [`BLOCK`] values (symmetric: scale = max |x| / 127, q = round(x / scale)), a quarter of
//! fp32's bytes and half of 16-bit's, and every rank dequantizes every part, its own included, so all ranks hold
//! the same values. A value comes back within half a step (scale / 2) of where it was.
//!
//! A block with NaN or an infinity comes back as NaN throughout (its scale is NaN): the run sees the non-finite
//! value as an unquantized gather would show it, in a loss that is NaN (and an fp16 run skips the step).
use std::cell::RefCell;

use half::{bf16, f16};

use super::{agreement, BufMut, BufRef, CommError, CommResult, Communicator, Dtype, Element, ReduceOp};

/// Values per scale. DeepSpeed's qwZ uses groups of a few thousand; 4096 keeps the scales 0.1% of the bytes.
pub const BLOCK: usize = 4096;

/// A float type the quantizer reads and writes.
pub trait Float: Element {
    /// As f32.
    fn to_f32(self) -> f32;
    /// From f32, rounded.
    fn from_f32(v: f32) -> Self;
}

impl Float for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl Float for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}

impl Float for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> f16 {
        f16::from_f32(v)
    }
}

/// Bytes of `len` values quantized in blocks of `block`: the values, then the scales.
pub fn packed_bytes(len: usize, block: usize) -> usize {
    len + 4 * len.div_ceil(block)
}

/// Quantizes `values` into `out` ([`packed_bytes`] long): the int8 values, then one f32 scale per block.
pub fn quantize<T: Float>(values: &[T], block: usize, out: &mut [u8]) {
    let (q, scales) = out[..packed_bytes(values.len(), block)].split_at_mut(values.len());
    for ((block_values, block_q), scale_bytes) in
        values.chunks(block).zip(q.chunks_mut(block)).zip(scales.chunks_exact_mut(4))
    {
        // Eight lanes, branch-free, so the loop vectorizes: `x * 0` is NaN exactly when x is NaN or infinite.
        const LANES: usize = 8;
        let (mut amax, mut poison) = ([0f32; LANES], [0f32; LANES]);
        let mut lanes = block_values.chunks_exact(LANES);
        for eight in &mut lanes {
            for i in 0..LANES {
                let x = eight[i].to_f32();
                amax[i] = if x.abs() > amax[i] { x.abs() } else { amax[i] };
                poison[i] += x * 0.0;
            }
        }
        for (i, v) in lanes.remainder().iter().enumerate() {
            let x = v.to_f32();
            amax[i] = if x.abs() > amax[i] { x.abs() } else { amax[i] };
            poison[i] += x * 0.0;
        }
        let amax = amax.iter().fold(0f32, |m, a| m.max(*a));
        let poisoned = poison.iter().any(|p| p.is_nan());
        let scale = if poisoned { f32::NAN } else { amax / 127.0 };
        let inverse = 1.0 / scale;
        if poisoned || scale == 0.0 {
            block_q.fill(0);
        } else if inverse.is_finite() {
            // Round to nearest (ties to even) by the float trick: adding 1.5 x 2^23 leaves an integer (|y| <= 127).
            const ROUND: f32 = 12_582_912.0;
            for (v, q) in block_values.iter().zip(block_q.iter_mut()) {
                let y = (v.to_f32() * inverse).clamp(-127.0, 127.0);
                // SAFETY: the value and the inverse are finite, so y is an integer in [-127, 127].
                *q = unsafe { ((y + ROUND) - ROUND).to_int_unchecked::<i32>() } as i8 as u8;
            }
        } else {
            // A subnormal scale, whose inverse overflows: divide instead.
            for (v, q) in block_values.iter().zip(block_q.iter_mut()) {
                *q = (v.to_f32() / scale).clamp(-127.0, 127.0).round() as i32 as i8 as u8;
            }
        }
        scale_bytes.copy_from_slice(&scale.to_le_bytes());
    }
}

/// The values `packed` (made by [`quantize`] from `out.len()` values) stands for.
pub fn dequantize<T: Float>(packed: &[u8], block: usize, out: &mut [T]) {
    let (q, scales) = packed[..packed_bytes(out.len(), block)].split_at(out.len());
    for ((block_out, block_q), scale_bytes) in out.chunks_mut(block).zip(q.chunks(block)).zip(scales.chunks_exact(4)) {
        let scale = f32::from_le_bytes(scale_bytes.try_into().expect("four bytes"));
        for (o, q) in block_out.iter_mut().zip(block_q) {
            *o = T::from_f32(f32::from(*q as i8) * scale);
        }
    }
}

/// Adds the values `packed` (made by [`quantize`] from `sum.len()` values) stands for to `sum`, in one pass: a
/// quantized reduce-scatter's sum without a dequantized copy.
fn dequantize_add(packed: &[u8], block: usize, sum: &mut [f32]) {
    let (q, scales) = packed[..packed_bytes(sum.len(), block)].split_at(sum.len());
    for ((block_sum, block_q), scale_bytes) in sum.chunks_mut(block).zip(q.chunks(block)).zip(scales.chunks_exact(4)) {
        let scale = f32::from_le_bytes(scale_bytes.try_into().expect("four bytes"));
        for (s, q) in block_sum.iter_mut().zip(block_q) {
            *s += f32::from(*q as i8) * scale;
        }
    }
}

thread_local! {
    /// The packed parts of the last gather, reused (u64 words: the collective carries them as i64).
    static PACKED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// All-gathers `buf` (f32, bf16 or f16; `comm.world_size()` equal parts, this rank's part contributed) with every
/// part quantized in blocks of `block` on the way. Every rank ends with the same dequantized values, its own part's
/// included. Collective over `comm`: the same length, type and block on every rank.
pub fn all_gather(comm: &dyn Communicator, buf: BufMut<'_>, block: usize) -> CommResult<()> {
    const OP: &str = "quantized all_gather";
    let part = agreement::equal_parts(OP, comm.rank(), comm.world_size(), buf.len())?;
    match buf.dtype {
        Dtype::F32 => all_gather_typed::<f32>(comm, bytemuck::cast_slice_mut(buf.bytes), part, block),
        Dtype::Bf16 => all_gather_typed::<bf16>(comm, bytemuck::cast_slice_mut(buf.bytes), part, block),
        Dtype::F16 => all_gather_typed::<f16>(comm, bytemuck::cast_slice_mut(buf.bytes), part, block),
        Dtype::I64 => Err(CommError::BadArgument {
            op: OP,
            rank: comm.rank(),
            what: "integers are not quantized: gather them whole".into(),
        }),
    }
}

fn all_gather_typed<T: Float>(comm: &dyn Communicator, values: &mut [T], part: usize, block: usize) -> CommResult<()> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let words = packed_bytes(part, block).div_ceil(8);
    PACKED.with(|packed| {
        let mut packed = packed.borrow_mut();
        if packed.len() < n * words {
            packed.resize(n * words, 0);
        }
        let parts = &mut packed[..n * words];
        let own: &mut [u8] = bytemuck::cast_slice_mut(&mut parts[rank * words..(rank + 1) * words]);
        quantize(&values[rank * part..(rank + 1) * part], block, own);
        comm.all_gather_buf(BufMut { bytes: bytemuck::cast_slice_mut(parts), dtype: Dtype::I64 })?;
        for (from, to) in parts.chunks(words).zip(values.chunks_mut(part)) {
            dequantize(bytemuck::cast_slice(from), block, to);
        }
        Ok(())
    })
}

/// An all-reduce whose traffic is int8 blocks: a quantized [`reduce_scatter`] of `buf` (padded to a multiple of
/// the ranks with zeros), then a quantized [`all_gather`] of the reduced parts, so every rank ends with the same
/// values, within a quantization step of the reduce-scatter's and one of the gather's. A maximum, and integers,
/// are all-reduced unquantized. Collective over `comm`.
pub fn all_reduce(comm: &dyn Communicator, buf: BufMut<'_>, op: ReduceOp, block: usize) -> CommResult<()> {
    if op == ReduceOp::Max || buf.dtype == Dtype::I64 {
        return comm.all_reduce_buf(buf, op);
    }
    match buf.dtype {
        Dtype::F32 => all_reduce_typed::<f32>(comm, bytemuck::cast_slice_mut(buf.bytes), op, block),
        Dtype::Bf16 => all_reduce_typed::<bf16>(comm, bytemuck::cast_slice_mut(buf.bytes), op, block),
        Dtype::F16 => all_reduce_typed::<f16>(comm, bytemuck::cast_slice_mut(buf.bytes), op, block),
        Dtype::I64 => unreachable!("reduced unquantized above"),
    }
}

fn all_reduce_typed<T: Float>(comm: &dyn Communicator, values: &mut [T], op: ReduceOp, block: usize) -> CommResult<()> {
    let (rank, n) = (comm.rank(), comm.world_size());
    if n == 1 {
        return Ok(());
    }
    let part = values.len().div_ceil(n);
    if values.len() == n * part {
        // Whole parts: this rank's reduced part goes into place and the all-gather fills the rest (one part of
        // scratch, no padded copies).
        let mut mine = vec![T::from_f32(0.0); part];
        reduce_scatter_typed(comm, values, &mut mine, part, op, block)?;
        values[rank * part..(rank + 1) * part].copy_from_slice(&mine);
        return all_gather_typed(comm, values, part, block);
    }
    let mut padded = vec![T::from_f32(0.0); n * part];
    padded[..values.len()].copy_from_slice(values);
    let mut reduced = vec![T::from_f32(0.0); n * part];
    reduce_scatter_typed(comm, &padded, &mut reduced[rank * part..(rank + 1) * part], part, op, block)?;
    all_gather_typed(comm, &mut reduced, part, block)?;
    let len = values.len();
    values.copy_from_slice(&reduced[..len]);
    Ok(())
}

thread_local! {
    /// The packed parts a quantized reduce-scatter sends and receives, and its f32 sum, reused: fresh buffers of
    /// this size are fresh pages every call, and faulting them in cost more than the quantizing.
    static EXCHANGE: RefCell<(Vec<u64>, Vec<u64>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// A reduce-scatter (ZeRO++ qgZ) whose parts travel to their ranks quantized in blocks of `block` values and are
/// summed in f32, in rank order, after dequantizing; this rank's own part is added exactly. A maximum, and
/// integers, are reduced unquantized.
pub fn reduce_scatter<C: Communicator + ?Sized>(
    comm: &C,
    input: BufRef<'_>,
    output: BufMut<'_>,
    op: ReduceOp,
    block: usize,
) -> CommResult<()> {
    const OP: &str = "quantized reduce_scatter";
    if op == ReduceOp::Max || input.dtype == Dtype::I64 {
        return comm.reduce_scatter_buf(input, output, op);
    }
    let (rank, n) = (comm.rank(), comm.world_size());
    let part = agreement::scatter_output(OP, rank, n, &input, &output)?;
    fn typed<'a, T: Float>(input: &'a BufRef<'_>, output: BufMut<'a>) -> (&'a [T], &'a mut [T]) {
        (bytemuck::cast_slice(input.bytes), bytemuck::cast_slice_mut(output.bytes))
    }
    match input.dtype {
        Dtype::F32 => {
            let (i, o) = typed::<f32>(&input, output);
            reduce_scatter_typed(comm, i, o, part, op, block)
        }
        Dtype::Bf16 => {
            let (i, o) = typed::<bf16>(&input, output);
            reduce_scatter_typed(comm, i, o, part, op, block)
        }
        Dtype::F16 => {
            let (i, o) = typed::<f16>(&input, output);
            reduce_scatter_typed(comm, i, o, part, op, block)
        }
        Dtype::I64 => unreachable!("reduced unquantized above"),
    }
}

fn reduce_scatter_typed<T: Float, C: Communicator + ?Sized>(
    comm: &C,
    input: &[T],
    output: &mut [T],
    part: usize,
    op: ReduceOp,
    block: usize,
) -> CommResult<()> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let words = packed_bytes(part, block).div_ceil(8);
    EXCHANGE.with(|exchange| {
        let (sent, received, sum) = &mut *exchange.borrow_mut();
        for v in [&mut *sent, &mut *received] {
            if v.len() < n * words {
                v.resize(n * words, 0);
            }
        }
        let (sent, received) = (&mut sent[..n * words], &mut received[..n * words]);
        for (q, packed) in sent.chunks_mut(words).enumerate() {
            if q != rank {
                quantize(&input[q * part..(q + 1) * part], block, bytemuck::cast_slice_mut(packed));
            }
        }
        comm.all_to_all_buf(
            BufRef { bytes: bytemuck::cast_slice(sent), dtype: Dtype::I64 },
            BufMut { bytes: bytemuck::cast_slice_mut(received), dtype: Dtype::I64 },
        )?;
        // Summed from zero in rank order, this rank's part exactly.
        sum.clear();
        sum.resize(part, 0.0);
        for (r, packed) in received.chunks(words).enumerate() {
            if r == rank {
                sum.iter_mut().zip(&input[rank * part..(rank + 1) * part]).for_each(|(s, x)| *s += x.to_f32());
            } else {
                dequantize_add(bytemuck::cast_slice(packed), block, sum);
            }
        }
        let mean = op == ReduceOp::Avg;
        output.iter_mut().zip(sum.iter()).for_each(|(o, s)| *o = T::from_f32(if mean { s / n as f32 } else { *s }));
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::threads;

    fn round_trip<T: Float>(values: &[T], block: usize) -> Vec<T> {
        let mut packed = vec![0u8; packed_bytes(values.len(), block)];
        quantize(values, block, &mut packed);
        let mut out = vec![T::from_f32(0.0); values.len()];
        dequantize(&packed, block, &mut out);
        out
    }

    /// Pseudo-random values in [-scale, scale] (splitmix64).
    fn noise(len: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    #[test]
    fn every_value_comes_back_within_half_a_step_of_its_block() {
        // Blocks of very different magnitudes, and a length that is not a multiple of the block.
        let block = 64;
        let mut values = noise(1000, 1, 1.0);
        values[64..128].iter_mut().for_each(|v| *v *= 1e-6);
        values[128..192].iter_mut().for_each(|v| *v *= 3e4);
        let back = round_trip(&values, block);
        for (b, (vals, outs)) in values.chunks(block).zip(back.chunks(block)).enumerate() {
            let step = vals.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (v, o) in vals.iter().zip(outs) {
                assert!((v - o).abs() <= step * 0.5 * (1.0 + 1e-5), "block {b}: {v} came back as {o}, step {step}");
            }
            let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                outs.iter().any(|o| (o.abs() - amax).abs() <= amax * 1e-6),
                "block {b}: its largest value is exact"
            );
        }
        assert_eq!(packed_bytes(1000, 64), 1000 + 4 * 16);
    }

    #[test]
    fn subnormal_blocks_round_trip_too() {
        let values: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) * 1e-42).collect();
        let back = round_trip(&values, 100);
        let step = 50e-42f32 / 127.0;
        for (v, o) in values.iter().zip(&back) {
            assert!(o.is_finite() && (v - o).abs() <= step, "{v} came back as {o}");
        }
    }

    #[test]
    fn zero_blocks_stay_zero_and_non_finite_blocks_become_nan() {
        let mut values = vec![0f32; 300];
        values[150] = 2.0;
        values[260] = f32::INFINITY;
        let back = round_trip(&values, 100);
        assert!(back[..100].iter().all(|v| *v == 0.0), "a zero block");
        assert_eq!(back[150], 2.0);
        assert!(back[100..200].iter().enumerate().all(|(i, v)| i == 50 || *v == 0.0));
        assert!(back[200..].iter().all(|v| v.is_nan()), "the block with an infinity");
        values[260] = f32::NAN;
        assert!(round_trip(&values, 100)[200..].iter().all(|v| v.is_nan()), "the block with a NaN");
    }

    #[test]
    fn bf16_and_fp16_values_round_trip_within_half_a_step_plus_their_rounding() {
        let values = noise(5000, 7, 3.0);
        for (name, back, unit) in [
            (
                "bf16",
                round_trip(&values.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<_>>(), BLOCK)
                    .iter()
                    .map(|v| v.to_f32())
                    .collect::<Vec<_>>(),
                2f32.powi(-8),
            ),
            (
                "fp16",
                round_trip(&values.iter().map(|v| f16::from_f32(*v)).collect::<Vec<_>>(), BLOCK)
                    .iter()
                    .map(|v| v.to_f32())
                    .collect(),
                2f32.powi(-11),
            ),
        ] {
            for (block, (vals, outs)) in values.chunks(BLOCK).zip(back.chunks(BLOCK)).enumerate() {
                let step = vals.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                for (v, o) in vals.iter().zip(outs) {
                    // Rounded to the type on the way in, quantized, rounded again on the way out.
                    let bound = step * 0.5 * (1.0 + 2.0 * unit) + 2.0 * unit * v.abs().max(o.abs());
                    assert!((v - o).abs() <= bound, "{name} block {block}: {v} came back as {o}");
                }
            }
        }
    }

    #[test]
    fn the_gather_gives_every_rank_the_same_dequantized_values_at_a_quarter_of_the_bytes() {
        let (n, part) = (3, 5000);
        let handles: Vec<_> = threads::group(n, Duration::from_secs(20))
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let r = c.rank();
                    let mut buf = vec![0f32; n * part];
                    buf[r * part..(r + 1) * part].copy_from_slice(&noise(part, r as u64, 0.1));
                    all_gather(&c, BufMut::new(&mut buf), BLOCK).unwrap();
                    buf
                })
            })
            .collect();
        let results: Vec<Vec<f32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(results.windows(2).all(|w| w[0] == w[1]), "every rank ends with the same values");
        for r in 0..n {
            let original = noise(part, r as u64, 0.1);
            assert_eq!(&results[0][r * part..(r + 1) * part], round_trip(&original, BLOCK).as_slice(), "part {r}");
        }
        assert!(
            packed_bytes(part, BLOCK) as f64 <= 0.26 * (4 * part) as f64,
            "int8 and a scale per block: a quarter of fp32"
        );
    }

    /// Runs `f` on `n` thread ranks and returns their results in rank order.
    fn on_threads<R: Send + 'static>(n: usize, f: impl Fn(&dyn Communicator) -> R + Send + Copy + 'static) -> Vec<R> {
        let handles: Vec<_> =
            threads::group(n, Duration::from_secs(20)).into_iter().map(|c| std::thread::spawn(move || f(&c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_to_all_sends_each_part_to_its_rank() {
        let n = 3;
        let results = on_threads(n, move |c| {
            let r = c.rank() as f32;
            let input: Vec<f32> = (0..n * 2).map(|i| r * 100.0 + i as f32).collect();
            let mut output = vec![0f32; n * 2];
            c.all_to_all_buf(BufRef::new(&input), BufMut::new(&mut output)).unwrap();
            output
        });
        for (rank, out) in results.iter().enumerate() {
            let want: Vec<f32> = (0..n).flat_map(|r| [0, 1].map(|j| (r * 100 + rank * 2 + j) as f32)).collect();
            assert_eq!(out, &want, "rank {rank}");
        }
    }

    #[test]
    fn the_quantized_reduce_scatter_is_within_half_a_step_per_peer_of_the_exact_sum() {
        let (n, part) = (3, 5000);
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let results = on_threads(n, move |c| {
                let input = noise(n * part, c.rank() as u64 + 10, 1.0);
                let mut out = vec![0f32; part];
                c.reduce_scatter_quantized_buf(BufRef::new(&input), BufMut::new(&mut out), op, BLOCK).unwrap();
                out
            });
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| noise(n * part, r as u64 + 10, 1.0)).collect();
            for (rank, out) in results.iter().enumerate() {
                for (i, o) in out.iter().enumerate() {
                    let at = rank * part + i;
                    let exact: f32 = inputs.iter().map(|v| v[at]).sum();
                    // Each peer's value is within half its block's step (at most 1 / 127 / 2 here) of its own.
                    let bound = (n - 1) as f32 * 0.5 / 127.0 + 1e-5;
                    let (exact, bound) =
                        if op == ReduceOp::Avg { (exact / n as f32, bound / n as f32) } else { (exact, bound) };
                    assert!((o - exact).abs() <= bound, "{op:?}, rank {rank}, element {i}: {o} against {exact}");
                }
            }
        }
    }

    #[test]
    fn a_reused_sum_buffer_gives_what_a_fresh_one_gives() {
        // The thread's buffers are reused: a smaller reduce-scatter after a larger one must not see its sums.
        let (n, small) = (2, 3000);
        let reduce = move |c: &dyn Communicator, part: usize, seed: u64| {
            let input = noise(n * part, c.rank() as u64 + seed, 1.0);
            let mut out = vec![0f32; part];
            c.reduce_scatter_quantized_buf(BufRef::new(&input), BufMut::new(&mut out), ReduceOp::Sum, BLOCK).unwrap();
            out
        };
        let fresh = on_threads(n, move |c| reduce(c, small, 40));
        let reused = on_threads(n, move |c| {
            reduce(c, 5000, 30);
            reduce(c, small, 40)
        });
        assert_eq!(reused, fresh);
    }

    #[test]
    fn the_quantized_all_reduce_gives_every_rank_the_same_values_near_the_exact_sum() {
        // A length that is not a multiple of the ranks (the padding must not leak into the values) and one that
        // is (reduced in place).
        let n = 3;
        for (len, op) in [(10_001, ReduceOp::Sum), (10_001, ReduceOp::Avg), (9_999, ReduceOp::Sum)] {
            let results = on_threads(n, move |c| {
                let mut values = noise(len, c.rank() as u64 + 20, 1.0);
                all_reduce(c, BufMut::new(&mut values), op, BLOCK).unwrap();
                values
            });
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| noise(len, r as u64 + 20, 1.0)).collect();
            for (rank, out) in results.iter().enumerate() {
                assert_eq!(out, &results[0], "{op:?}: rank {rank} differs from rank 0");
            }
            let mut worst = 0f32;
            for (i, o) in results[0].iter().enumerate() {
                let exact: f32 = inputs.iter().map(|v| v[i]).sum();
                // The reduce-scatter's half step per peer, then the gather's half step of a block whose maximum
                // is at most the sum's (n x 1).
                let bound = (n - 1) as f32 * 0.5 / 127.0 + n as f32 * 0.5 / 127.0 + 1e-5;
                let (exact, bound) =
                    if op == ReduceOp::Avg { (exact / n as f32, bound / n as f32) } else { (exact, bound) };
                assert!((o - exact).abs() <= bound, "{op:?}, element {i}: {o} against {exact}");
                worst = worst.max((o - exact).abs());
            }
            assert!(worst > 0.0, "{op:?}, {len}: quantization changed nothing");
        }
    }

    #[test]
    fn integers_are_refused() {
        let c = threads::group(1, Duration::from_secs(1)).pop().unwrap();
        let mut v = vec![1i64; 4];
        let e = all_gather(&c, BufMut::new(&mut v), BLOCK).unwrap_err();
        assert!(e.to_string().contains("integers are not quantized"), "{e}");
    }
}
