//! Typed views of collective buffers: the element types a collective can carry, and their reductions.
//!
//! Backends move bytes; only the reduction needs the element type. `Element` ties a Rust type to its `Dtype`;
//! `BufMut` / `BufRef` are the dyn-compatible byte views the `Communicator` trait takes.
use half::{bf16, f16};

use super::ReduceOp;

/// The element types of collectives: f32, bf16, f16 for tensors, i64 for bookkeeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
    I64,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::I64 => 8,
        }
    }

    pub(crate) fn code(self) -> u64 {
        self as u64 + 1
    }
}

/// A Rust type a collective can carry.
pub trait Element: bytemuck::Pod + Send + Sync {
    const DTYPE: Dtype;
    fn add(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    /// The mean of a sum over `n` ranks.
    fn div(a: Self, n: usize) -> Self;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    #[inline(always)]
    fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    fn max(a: f32, b: f32) -> f32 {
        a.max(b)
    }
    #[inline(always)]
    fn div(a: f32, n: usize) -> f32 {
        a / n as f32
    }
}

/// 16-bit floats are combined in f32 and rounded once per step, as NCCL does.
macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: Dtype = $d;
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                <$t>::from_f32(a.to_f32() + b.to_f32())
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                <$t>::from_f32(a.to_f32().max(b.to_f32()))
            }
            #[inline(always)]
            fn div(a: $t, n: usize) -> $t {
                <$t>::from_f32(a.to_f32() / n as f32)
            }
        }
    };
}
half_element!(bf16, Dtype::Bf16);
half_element!(f16, Dtype::F16);

impl Element for i64 {
    const DTYPE: Dtype = Dtype::I64;
    #[inline(always)]
    fn add(a: i64, b: i64) -> i64 {
        a.wrapping_add(b)
    }
    #[inline(always)]
    fn max(a: i64, b: i64) -> i64 {
        a.max(b)
    }
    #[inline(always)]
    fn div(a: i64, n: usize) -> i64 {
        a / n as i64
    }
}

/// A mutable collective buffer: bytes and what they hold.
pub struct BufMut<'a> {
    pub bytes: &'a mut [u8],
    pub dtype: Dtype,
}

/// A read-only collective buffer.
pub struct BufRef<'a> {
    pub bytes: &'a [u8],
    pub dtype: Dtype,
}

impl<'a> BufMut<'a> {
    pub fn new<T: Element>(v: &'a mut [T]) -> Self {
        BufMut { bytes: bytemuck::cast_slice_mut(v), dtype: T::DTYPE }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

impl<'a> From<BufMut<'a>> for BufRef<'a> {
    fn from(b: BufMut<'a>) -> Self {
        BufRef { bytes: b.bytes, dtype: b.dtype }
    }
}

impl<'a> BufRef<'a> {
    pub fn new<T: Element>(v: &'a [T]) -> Self {
        BufRef { bytes: bytemuck::cast_slice(v), dtype: T::DTYPE }
    }

    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// `acc[i] = op(acc[i], part[i])` (Avg folds as a sum; the division comes once at the end).
fn fold_typed<T: Element>(acc: &mut [T], part: &[T], op: ReduceOp) {
    let part = &part[..acc.len()];
    match op {
        ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(part).for_each(|(d, x)| *d = T::add(*d, *x)),
        ReduceOp::Max => acc.iter_mut().zip(part).for_each(|(d, x)| *d = T::max(*d, *x)),
    }
}

fn reduce_typed<T: Element>(dst: &mut [u8], parts: &[&[u8]], op: ReduceOp) {
    let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
    let n = dst.len();
    dst.copy_from_slice(&bytemuck::cast_slice::<u8, T>(parts[0])[..n]);
    for p in &parts[1..] {
        fold_typed(dst, bytemuck::cast_slice(p), op);
    }
    if op == ReduceOp::Avg {
        let k = parts.len();
        dst.iter_mut().for_each(|d| *d = T::div(*d, k));
    }
}

/// Folds one more rank's values into an accumulator: `acc[i] = op(acc[i], part[i])`, with Avg as a sum (follow
/// with [`divide`]).
pub(crate) fn fold_into(dtype: Dtype, acc: &mut [u8], part: &[u8], op: ReduceOp) {
    match dtype {
        Dtype::F32 => fold_typed::<f32>(bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(part), op),
        Dtype::Bf16 => fold_typed::<bf16>(bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(part), op),
        Dtype::F16 => fold_typed::<f16>(bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(part), op),
        Dtype::I64 => fold_typed::<i64>(bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(part), op),
    }
}

/// Writes the combination of `parts` (byte views of `dtype` elements, each at least as long as `dst`) into `dst`,
/// in rank order. `Avg` divides the sum by the number of parts.
pub(crate) fn reduce_into(dtype: Dtype, dst: &mut [u8], parts: &[&[u8]], op: ReduceOp) {
    if dst.is_empty() {
        return;
    }
    match dtype {
        Dtype::F32 => reduce_typed::<f32>(dst, parts, op),
        Dtype::Bf16 => reduce_typed::<bf16>(dst, parts, op),
        Dtype::F16 => reduce_typed::<f16>(dst, parts, op),
        Dtype::I64 => reduce_typed::<i64>(dst, parts, op),
    }
}

#[inline(always)]
fn pair<T: Element>(x: T, y: T, op: ReduceOp, mean_of: usize) -> T {
    match op {
        ReduceOp::Sum => T::add(x, y),
        ReduceOp::Avg => T::div(T::add(x, y), mean_of),
        ReduceOp::Max => T::max(x, y),
    }
}

fn combine_typed<T: Element>(dst: &mut [u8], a: &[u8], b: &[u8], op: ReduceOp, mean_of: usize) {
    let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
    let (a, b): (&[T], &[T]) = (bytemuck::cast_slice(&a[..dst.len() * T::DTYPE.size()]), bytemuck::cast_slice(&b[..dst.len() * T::DTYPE.size()]));
    dst.iter_mut().zip(a.iter().zip(b)).for_each(|(d, (x, y))| *d = pair(*x, *y, op, mean_of));
}

fn combine_in_place_typed<T: Element>(dst: &mut [u8], other: &[u8], other_first: bool, op: ReduceOp, mean_of: usize) {
    let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
    let other: &[T] = bytemuck::cast_slice(&other[..dst.len() * T::DTYPE.size()]);
    if other_first {
        dst.iter_mut().zip(other).for_each(|(d, x)| *d = pair(*x, *d, op, mean_of));
    } else {
        dst.iter_mut().zip(other).for_each(|(d, x)| *d = pair(*d, *x, op, mean_of));
    }
}

/// `dst = op(a, b)` for two ranks' values in one pass (`Avg` divides the sum by `mean_of`): what
/// [`reduce_into`] gives for two parts, without copying one of them first.
pub(crate) fn combine_pair(dtype: Dtype, dst: &mut [u8], a: &[u8], b: &[u8], op: ReduceOp, mean_of: usize) {
    #[cfg(target_arch = "x86_64")]
    if dtype == Dtype::F32 && op == ReduceOp::Sum {
        let n = dst.len();
        return sum_f32_streaming(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(&a[..n]), bytemuck::cast_slice(&b[..n]));
    }
    match dtype {
        Dtype::F32 => combine_typed::<f32>(dst, a, b, op, mean_of),
        Dtype::Bf16 => combine_typed::<bf16>(dst, a, b, op, mean_of),
        Dtype::F16 => combine_typed::<f16>(dst, a, b, op, mean_of),
        Dtype::I64 => combine_typed::<i64>(dst, a, b, op, mean_of),
    }
}

/// `dst = a + b` with non-temporal stores: the output is written once and read by someone else later, so
/// streaming it past the cache saves reading each destination line in first (a quarter of the traffic of a
/// reduce-scatter, which is bound by memory bandwidth). A whole cache line per iteration with AVX where the CPU
/// has it (fewer instructions in flight per line while two loads stream), SSE (baseline x86_64) otherwise.
#[cfg(target_arch = "x86_64")]
fn sum_f32_streaming(dst: &mut [f32], a: &[f32], b: &[f32]) {
    // A scalar head up to 64-byte (cache line) alignment, streaming stores over whole lines, a scalar tail.
    let head = dst.as_ptr().align_offset(64).min(dst.len());
    for i in 0..head {
        dst[i] = a[i] + b[i];
    }
    let body = (dst.len() - head) / 16 * 16;
    let (d, a2, b2) = (&mut dst[head..head + body], &a[head..head + body], &b[head..head + body]);
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX (checked above).
        unsafe { sum_lines_avx(d, a2, b2) };
    } else {
        // SAFETY: SSE is part of x86_64.
        unsafe { sum_lines_sse(d, a2, b2) };
    }
    for i in head + body..dst.len() {
        dst[i] = a[i] + b[i];
    }
}

/// `dst = a + b` over whole 64-byte lines; `dst` is 64-byte aligned and all three have the same length, a multiple
/// of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn sum_lines_avx(dst: &mut [f32], a: &[f32], b: &[f32]) {
    use std::arch::x86_64::{_mm256_add_ps, _mm256_loadu_ps, _mm256_stream_ps, _mm_sfence};
    let (d, a, b) = (dst.as_mut_ptr(), a.as_ptr(), b.as_ptr());
    for i in (0..dst.len()).step_by(16) {
        // SAFETY: i + 16 <= len for all three (the caller's contract); d + i is 32-byte aligned.
        unsafe {
            let lo = _mm256_add_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)));
            let hi = _mm256_add_ps(_mm256_loadu_ps(a.add(i + 8)), _mm256_loadu_ps(b.add(i + 8)));
            _mm256_stream_ps(d.add(i), lo);
            _mm256_stream_ps(d.add(i + 8), hi);
        }
    }
    _mm_sfence();
}

/// [`sum_lines_avx`] with SSE.
#[cfg(target_arch = "x86_64")]
unsafe fn sum_lines_sse(dst: &mut [f32], a: &[f32], b: &[f32]) {
    use std::arch::x86_64::{_mm_add_ps, _mm_loadu_ps, _mm_sfence, _mm_stream_ps};
    let (d, a, b) = (dst.as_mut_ptr(), a.as_ptr(), b.as_ptr());
    for i in (0..dst.len()).step_by(4) {
        // SAFETY: as in sum_lines_avx; d + i is 16-byte aligned.
        unsafe { _mm_stream_ps(d.add(i), _mm_add_ps(_mm_loadu_ps(a.add(i)), _mm_loadu_ps(b.add(i)))) };
    }
    // SAFETY: no preconditions.
    unsafe { _mm_sfence() };
}

/// [`combine_pair`] where `dst` holds one of the two inputs: `dst = op(other, dst)` if `other_first`, else
/// `op(dst, other)`.
pub(crate) fn combine_pair_in_place(dtype: Dtype, dst: &mut [u8], other: &[u8], other_first: bool, op: ReduceOp, mean_of: usize) {
    match dtype {
        Dtype::F32 => combine_in_place_typed::<f32>(dst, other, other_first, op, mean_of),
        Dtype::Bf16 => combine_in_place_typed::<bf16>(dst, other, other_first, op, mean_of),
        Dtype::F16 => combine_in_place_typed::<f16>(dst, other, other_first, op, mean_of),
        Dtype::I64 => combine_in_place_typed::<i64>(dst, other, other_first, op, mean_of),
    }
}

fn divide_typed<T: Element>(dst: &mut [u8], n: usize) {
    bytemuck::cast_slice_mut::<u8, T>(dst).iter_mut().for_each(|d| *d = T::div(*d, n));
}

/// Divides every element by `n` (the mean after a sum over `n` ranks).
pub(crate) fn divide(dtype: Dtype, dst: &mut [u8], n: usize) {
    match dtype {
        Dtype::F32 => divide_typed::<f32>(dst, n),
        Dtype::Bf16 => divide_typed::<bf16>(dst, n),
        Dtype::F16 => divide_typed::<f16>(dst, n),
        Dtype::I64 => divide_typed::<i64>(dst, n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both instruction sets of the streaming sum give the scalar sum (only one of them runs in `combine_pair`
    /// on a given CPU).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn streaming_sums_match_scalar_on_both_instruction_sets() {
        let a: Vec<f32> = (0..64).map(|i| i as f32 * 0.25 - 3.0).collect();
        let b: Vec<f32> = (0..64).map(|i| (i as f32).sqrt()).collect();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let mut storage = vec![0f32; 64 + 16];
        let at = storage.as_ptr().align_offset(64);
        let dst = &mut storage[at..at + 64];
        // SAFETY: dst is 64-byte aligned, all three are 64 long.
        unsafe { sum_lines_sse(dst, &a, &b) };
        assert_eq!(dst, &want[..]);
        if std::arch::is_x86_feature_detected!("avx") {
            dst.fill(0.0);
            // SAFETY: as above, and the CPU has AVX.
            unsafe { sum_lines_avx(dst, &a, &b) };
            assert_eq!(dst, &want[..]);
        }
    }

    /// The two-rank folds give what `reduce_into` gives, for every op, element type of the backends' tests,
    /// alignment (the streaming f32 sum has a head and a tail) and aliasing.
    #[test]
    fn pair_folds_match_reduce_into() {
        let a: Vec<f32> = (0..103).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let b: Vec<f32> = (0..103).map(|i| (i as f32 * 0.91).cos() * 2.0).collect();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            for skip in 0..4 {
                let (a, b) = (&a[skip..], &b[skip..]);
                let (ab, bb): (&[u8], &[u8]) = (bytemuck::cast_slice(a), bytemuck::cast_slice(b));
                let mut want = vec![0f32; a.len()];
                reduce_into(Dtype::F32, bytemuck::cast_slice_mut(&mut want), &[ab, bb], op);
                let mut got = vec![0f32; a.len() + 1];
                combine_pair(Dtype::F32, bytemuck::cast_slice_mut(&mut got[1..]), ab, bb, op, 2);
                assert_eq!(&got[1..], &want[..], "{op:?}, skip {skip}");
                let mut in_place = b.to_vec();
                combine_pair_in_place(Dtype::F32, bytemuck::cast_slice_mut(&mut in_place), ab, true, op, 2);
                assert_eq!(in_place, want, "{op:?} in place, other first");
                let mut in_place = a.to_vec();
                combine_pair_in_place(Dtype::F32, bytemuck::cast_slice_mut(&mut in_place), bb, false, op, 2);
                assert_eq!(in_place, want, "{op:?} in place, other second");
            }
        }
    }
}
