//! Typed views of collective buffers: the element types a collective can carry, and their reductions.
//!
//! Backends move bytes; only the reduction needs the element type. `Element` ties a Rust type to its `Dtype`;
//! `BufMut` / `BufRef` are the dyn-compatible byte views the `Communicator` trait takes.
use half::{bf16, f16};

use super::{pair_sum, ReduceOp};

/// The element types of collectives: f32, bf16, f16 for tensors, i64 for bookkeeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// 64-bit signed integer.
    I64,
}

/// A buffer in device memory (a CUDA tensor's storage): its address on CUDA device `device`, its element count and
/// type. What the engine hands a backend that reduces device memory itself (NCCL) instead of a host copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuf {
    /// The device address.
    pub ptr: u64,
    /// Elements.
    pub count: usize,
    /// Their type.
    pub dtype: Dtype,
    /// The CUDA device's index.
    pub device: usize,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::I64 => 8,
        }
    }

    /// A code for the type, as agreement checks publish it.
    pub fn code(self) -> u64 {
        self as u64 + 1
    }

    /// The type `dtype as i64` numbered (a header word of a point-to-point transfer); F32 for anything else.
    pub fn from_index(i: i64) -> Dtype {
        match i {
            1 => Dtype::Bf16,
            2 => Dtype::F16,
            3 => Dtype::I64,
            _ => Dtype::F32,
        }
    }
}

/// A Rust type a collective can carry.
pub trait Element: bytemuck::Pod + Send + Sync {
    /// The dtype of this type.
    const DTYPE: Dtype;
    /// a + b, as the collective sums.
    fn add(a: Self, b: Self) -> Self;
    /// The larger of a and b.
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
    /// The bytes.
    pub bytes: &'a mut [u8],
    /// What they hold.
    pub dtype: Dtype,
}

/// A read-only collective buffer.
pub struct BufRef<'a> {
    /// The bytes.
    pub bytes: &'a [u8],
    /// What they hold.
    pub dtype: Dtype,
}

impl<'a> BufMut<'a> {
    /// A view of `v`.
    pub fn new<T: Element>(v: &'a mut [T]) -> Self {
        BufMut { bytes: bytemuck::cast_slice_mut(v), dtype: T::DTYPE }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Whether it has no element.
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
    /// A view of `v`.
    pub fn new<T: Element>(v: &'a [T]) -> Self {
        BufRef { bytes: bytemuck::cast_slice(v), dtype: T::DTYPE }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Whether it has no element.
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
    if op != ReduceOp::Max && pair_sum::supported(dtype, ReduceOp::Sum) {
        return combine_pair_in_place(dtype, acc, part, false, ReduceOp::Sum, 1);
    }
    match dtype {
        Dtype::F32 => fold_typed::<f32>(bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(part), op),
        Dtype::Bf16 => fold_typed::<bf16>(bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(part), op),
        Dtype::F16 => fold_typed::<f16>(bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(part), op),
        Dtype::I64 => fold_typed::<i64>(bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(part), op),
    }
}

/// Writes the combination of `parts` (byte views of `dtype` elements, each at least as long as `dst`) into `dst`,
/// in rank order. `Avg` divides the sum by the number of parts.
pub fn reduce_into(dtype: Dtype, dst: &mut [u8], parts: &[&[u8]], op: ReduceOp) {
    if dst.is_empty() {
        return;
    }
    if parts.len() >= 2 && pair_sum::supported(dtype, op) {
        // The same operations in the same order as the element loop below: sum in rank order, divide once.
        let (a, b) = (&parts[0][..dst.len()], &parts[1][..dst.len()]);
        // SAFETY: supported; dst and the parts are distinct borrows of at least dst.len() bytes.
        unsafe {
            pair_sum::pair_sum(dtype, dst.as_mut_ptr(), a.as_ptr(), b.as_ptr(), dst.len() / dtype.size(), None, false)
        };
        for p in &parts[2..] {
            fold_into(dtype, dst, p, ReduceOp::Sum);
        }
        if op == ReduceOp::Avg {
            divide(dtype, dst, parts.len());
        }
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
    let (a, b): (&[T], &[T]) = (
        bytemuck::cast_slice(&a[..dst.len() * T::DTYPE.size()]),
        bytemuck::cast_slice(&b[..dst.len() * T::DTYPE.size()]),
    );
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

/// What a two-input sum divides by: `mean_of` for `Avg`, nothing for `Sum`.
fn mean_divisor(op: ReduceOp, mean_of: usize) -> Option<usize> {
    (op == ReduceOp::Avg).then_some(mean_of)
}

/// `dst = op(a, b)` for two ranks' values in one pass (`Avg` divides the sum by `mean_of`): what
/// [`reduce_into`] gives for two parts, without copying one of them first.
pub(crate) fn combine_pair(dtype: Dtype, dst: &mut [u8], a: &[u8], b: &[u8], op: ReduceOp, mean_of: usize) {
    if pair_sum::supported(dtype, op) {
        let (a, b) = (&a[..dst.len()], &b[..dst.len()]);
        // SAFETY: supported; three distinct borrows of dst.len() bytes. Streaming: the output is read by others later.
        return unsafe {
            pair_sum::pair_sum(
                dtype,
                dst.as_mut_ptr(),
                a.as_ptr(),
                b.as_ptr(),
                dst.len() / dtype.size(),
                mean_divisor(op, mean_of),
                true,
            )
        };
    }
    match dtype {
        Dtype::F32 => combine_typed::<f32>(dst, a, b, op, mean_of),
        Dtype::Bf16 => combine_typed::<bf16>(dst, a, b, op, mean_of),
        Dtype::F16 => combine_typed::<f16>(dst, a, b, op, mean_of),
        Dtype::I64 => combine_typed::<i64>(dst, a, b, op, mean_of),
    }
}

/// [`combine_pair`] where `dst` holds one of the two inputs: `dst = op(other, dst)` if `other_first`, else
/// `op(dst, other)`.
pub(crate) fn combine_pair_in_place(
    dtype: Dtype,
    dst: &mut [u8],
    other: &[u8],
    other_first: bool,
    op: ReduceOp,
    mean_of: usize,
) {
    if pair_sum::supported(dtype, op) {
        let (d, o) = (dst.as_mut_ptr(), other[..dst.len()].as_ptr());
        let (first, second) = if other_first { (o, d as *const u8) } else { (d as *const u8, o) };
        // SAFETY: supported; dst is exactly one of the inputs and `other` a distinct borrow of the same length.
        return unsafe {
            pair_sum::pair_sum(dtype, d, first, second, dst.len() / dtype.size(), mean_divisor(op, mean_of), false)
        };
    }
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
    if pair_sum::supported(dtype, ReduceOp::Avg) {
        // SAFETY: supported; dst holds dst.len() / size elements.
        return unsafe { pair_sum::divide(dtype, dst.as_mut_ptr(), dst.len() / dtype.size(), n) };
    }
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

    /// The element loop every fast path must agree with.
    fn scalar_reduce<T: Element>(parts: &[&[T]], op: ReduceOp) -> Vec<T> {
        let mut out = vec![T::zeroed(); parts[0].len()];
        let bytes: Vec<&[u8]> = parts.iter().map(|p| bytemuck::cast_slice(p)).collect();
        reduce_typed::<T>(bytemuck::cast_slice_mut(&mut out), &bytes, op);
        out
    }

    /// The two-rank folds give what the element loop gives, for every op, alignment (the vector kernels have a
    /// head and a tail) and aliasing; Sum and Avg run the vector kernels where the CPU has them, Max the loop.
    #[test]
    fn pair_folds_match_the_element_loop() {
        fn check<T: Element + PartialEq + std::fmt::Debug>(a: &[T], b: &[T]) {
            let dtype = T::DTYPE;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                for skip in 0..20 {
                    let (a, b) = (&a[skip..], &b[skip..]);
                    let (ab, bb): (&[u8], &[u8]) = (bytemuck::cast_slice(a), bytemuck::cast_slice(b));
                    let want = scalar_reduce(&[a, b], op);
                    let mut got = vec![T::zeroed(); a.len() + 1];
                    combine_pair(dtype, bytemuck::cast_slice_mut(&mut got[1..]), ab, bb, op, 2);
                    assert_eq!(&got[1..], &want[..], "{dtype:?} {op:?}, skip {skip}");
                    let mut via = vec![T::zeroed(); a.len()];
                    reduce_into(dtype, bytemuck::cast_slice_mut(&mut via), &[ab, bb], op);
                    assert_eq!(via, want, "{dtype:?} {op:?} reduce_into");
                    let mut in_place = b.to_vec();
                    combine_pair_in_place(dtype, bytemuck::cast_slice_mut(&mut in_place), ab, true, op, 2);
                    assert_eq!(in_place, want, "{dtype:?} {op:?} in place, other first");
                    let mut in_place = a.to_vec();
                    combine_pair_in_place(dtype, bytemuck::cast_slice_mut(&mut in_place), bb, false, op, 2);
                    assert_eq!(in_place, want, "{dtype:?} {op:?} in place, other second");
                }
            }
        }
        let a: Vec<f32> = (0..103).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let b: Vec<f32> = (0..103).map(|i| (i as f32 * 0.91).cos() * 2.0).collect();
        check(&a, &b);
        check(
            &a.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<_>>(),
            &b.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<_>>(),
        );
        check(
            &a.iter().map(|x| f16::from_f32(*x)).collect::<Vec<_>>(),
            &b.iter().map(|x| f16::from_f32(*x)).collect::<Vec<_>>(),
        );
    }

    /// More than two ranks: reduce_into, fold_into + divide (shm's and MPI's accumulator) and the element loop agree.
    #[test]
    fn many_rank_reductions_match_the_element_loop() {
        let parts: Vec<Vec<bf16>> =
            (0..5).map(|k| (0..77).map(|i| bf16::from_f32(((i * 7 + k * 13) as f32 * 0.3).sin())).collect()).collect();
        for n in 3..=5 {
            let views: Vec<&[bf16]> = parts[..n].iter().map(|p| &p[..]).collect();
            let bytes: Vec<&[u8]> = views.iter().map(|p| bytemuck::cast_slice(p)).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let want = scalar_reduce(&views, op);
                let mut got = vec![bf16::ZERO; 77];
                reduce_into(Dtype::Bf16, bytemuck::cast_slice_mut(&mut got), &bytes, op);
                assert_eq!(got, want, "reduce_into, {n} ranks, {op:?}");
                let mut acc = views[0].to_vec();
                for p in &bytes[1..] {
                    fold_into(Dtype::Bf16, bytemuck::cast_slice_mut(&mut acc), p, op);
                }
                if op == ReduceOp::Avg {
                    divide(Dtype::Bf16, bytemuck::cast_slice_mut(&mut acc), n);
                }
                assert_eq!(acc, want, "fold_into, {n} ranks, {op:?}");
            }
        }
    }
}
