//! Vectorized two-input sums, the inner loop of every reduction ZeRO runs on a CPU: `dst = a + b`, or the mean
//! `(a + b) / n`, for f32, bf16 and f16 (gradients travel in one of them). The scalar element loop does 1 GB/s for
//! bf16 (a rounding branch per element); these run at memory speed.
//!
//! AVX2 (and F16C for f16), chosen at run time; without it the caller keeps its scalar loop. The results are
//! bitwise what the scalar [`Element`](super::Element) ops give: f32 adds and divides are IEEE either way, bf16 is
//! rounded to nearest even with NaNs kept quiet exactly as `half` does (`(x + 0x7fff + lsb) >> 16`, NaN:
//! `x >> 16 | 0x40`), and f16 converts with F16C, which `half` itself uses where the CPU has it. The mean of 16-bit
//! values is rounded twice (sum, then quotient), as the scalar path does.
use super::{Dtype, ReduceOp};

/// Whether [`pair_sum`] has a vector kernel for this case.
pub(crate) fn supported(dtype: Dtype, op: ReduceOp) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let cpu = match dtype {
            Dtype::F32 | Dtype::Bf16 => std::arch::is_x86_feature_detected!("avx2"),
            // `half` converts with F16C too where the CPU has it, so both paths round alike.
            Dtype::F16 => std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c"),
            Dtype::I64 => false,
        };
        cpu && matches!(op, ReduceOp::Sum | ReduceOp::Avg)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dtype, op);
        false
    }
}

/// `dst[i] = first[i] + second[i]`, divided by `divide_by` if given (the mean), over `len` elements of `dtype`.
/// `stream` writes `dst` with non-temporal stores: for an output read by someone else later, streaming it past the
/// cache saves reading each destination line in first (a quarter of a reduce-scatter's memory traffic).
///
/// # Safety
/// [`supported`] returned true for `dtype` (and Sum, or Avg when dividing); `first` and `second` are valid for
/// reads and `dst` for writes of `len` elements; `dst` is either exactly `first`, exactly `second`, or overlaps
/// neither.
pub(crate) unsafe fn pair_sum(
    dtype: Dtype,
    dst: *mut u8,
    first: *const u8,
    second: *const u8,
    len: usize,
    divide_by: Option<usize>,
    stream: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the caller's contract, and `supported` checked AVX2.
        unsafe {
            match (dtype, stream) {
                (Dtype::F32, true) => avx2::f32_sum::<true>(dst.cast(), first.cast(), second.cast(), len, divide_by),
                (Dtype::F32, false) => avx2::f32_sum::<false>(dst.cast(), first.cast(), second.cast(), len, divide_by),
                (Dtype::Bf16, true) => avx2::bf16_sum::<true>(dst.cast(), first.cast(), second.cast(), len, divide_by),
                (Dtype::Bf16, false) => {
                    avx2::bf16_sum::<false>(dst.cast(), first.cast(), second.cast(), len, divide_by)
                }
                (Dtype::F16, true) => avx2::f16_sum::<true>(dst.cast(), first.cast(), second.cast(), len, divide_by),
                (Dtype::F16, false) => avx2::f16_sum::<false>(dst.cast(), first.cast(), second.cast(), len, divide_by),
                _ => unreachable!("pair_sum on {dtype:?}: not `supported`"),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dtype, dst, first, second, len, divide_by, stream);
        unreachable!("pair_sum: not `supported` on this architecture");
    }
}

/// `dst[i] /= n` over `len` elements of `dtype` (the mean after a sum over `n` ranks), as `Element::div` does.
///
/// # Safety
/// [`supported`] returned true for `dtype` (with `Avg`); `dst` is valid for reads and writes of `len` elements.
pub(crate) unsafe fn divide(dtype: Dtype, dst: *mut u8, len: usize, n: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's contract, and `supported` checked AVX2.
    unsafe {
        match dtype {
            Dtype::F32 => avx2::f32_divide(dst.cast(), len, n),
            Dtype::Bf16 => avx2::bf16_divide(dst.cast(), len, n),
            Dtype::F16 => avx2::f16_divide(dst.cast(), len, n),
            _ => unreachable!("divide on {dtype:?}: not `supported`"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dtype, dst, len, n);
        unreachable!("divide: not `supported` on this architecture");
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::{bf16, f16};

    use super::super::Element;

    /// How far ahead of the loads each loop prefetches both inputs, once per cache line. The hardware prefetcher
    /// stops at 4 KiB page boundaries (the shared region has no huge pages), which leaves too few lines in flight
    /// for two input streams. Measured on 2 ranks, 64-256 MiB reduce-scatter, in alternating runs: bf16 from 28-36%
    /// of memcpy without to 48-64% at 1-2 KiB (47-50% at 4 KiB); f32 from 41-55% without to 49-59% at 512 bytes
    /// (worse at 2 KiB and beyond). f16 does the work of bf16 and takes its distance.
    const F32_PREFETCH_BYTES: usize = 512;
    const HALF_PREFETCH_BYTES: usize = 2048;

    /// Asks for the lines at `a` and `b` (which may lie past the inputs' ends: a prefetch never faults).
    #[inline(always)]
    fn prefetch<T>(a: *const T, b: *const T) {
        // SAFETY: prefetching has no memory effects and accepts any address.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(a.cast());
            _mm_prefetch::<_MM_HINT_T0>(b.cast());
        }
    }

    /// The loop every sum shares: element by element with the scalar [`Element`] ops up to the 32-byte alignment
    /// of `dst` (streaming stores need it), then 32-byte blocks of `dst` from `block(i)` (the block at element `i`),
    /// prefetching both inputs `prefetch_bytes` ahead once per line, then the tail element by element.
    ///
    /// # Safety
    /// As [`pair_sum`](super::pair_sum); `block(i)` reads only elements `i..i + 32 / size_of::<T>()` of the inputs.
    #[inline(always)]
    unsafe fn sum_blocks<T: Element, const STREAM: bool>(
        dst: *mut T,
        a: *const T,
        b: *const T,
        len: usize,
        divide_by: Option<usize>,
        prefetch_bytes: usize,
        block: impl Fn(usize) -> __m256i,
    ) {
        let (per_block, per_line, ahead) = (32 / size_of::<T>(), 64 / size_of::<T>(), prefetch_bytes / size_of::<T>());
        let scalar = |i: usize| {
            // SAFETY: i < len (the caller's contract covers all three).
            unsafe {
                let s = T::add(*a.add(i), *b.add(i));
                *dst.add(i) = divide_by.map_or(s, |n| T::div(s, n));
            }
        };
        let head = dst.align_offset(32).min(len);
        (0..head).for_each(scalar);
        let body_end = head + (len - head) / per_block * per_block;
        for i in (head..body_end).step_by(per_block) {
            // SAFETY: i + per_block <= len; dst + i is 32-byte aligned. `block` loads before the store.
            unsafe {
                if i % per_line == 0 {
                    prefetch(a.wrapping_add(i + ahead), b.wrapping_add(i + ahead));
                }
                let v = block(i);
                if STREAM {
                    _mm256_stream_si256(dst.add(i).cast(), v);
                } else {
                    _mm256_store_si256(dst.add(i).cast(), v);
                }
            }
        }
        if STREAM {
            // SAFETY: no preconditions.
            unsafe { _mm_sfence() };
        }
        (body_end..len).for_each(scalar);
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn f32_sum<const STREAM: bool>(
        dst: *mut f32,
        a: *const f32,
        b: *const f32,
        len: usize,
        divide_by: Option<usize>,
    ) {
        let n = divide_by.map(|n| _mm256_set1_ps(n as f32));
        let block = |i: usize| {
            // SAFETY: sum_blocks's contract: 8 elements at i.
            unsafe {
                let s = _mm256_add_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)));
                _mm256_castps_si256(n.map_or(s, |n| _mm256_div_ps(s, n)))
            }
        };
        // SAFETY: the caller's contract.
        unsafe { sum_blocks::<f32, STREAM>(dst, a, b, len, divide_by, F32_PREFETCH_BYTES, block) }
    }

    /// f32 to bf16 bits in the low half of each 32-bit lane, rounded as `half::bf16::from_f32`.
    #[inline(always)]
    unsafe fn round(v: __m256) -> __m256i {
        // SAFETY: register-only AVX2 operations (the enclosing function enables AVX2).
        unsafe {
            let x = _mm256_castps_si256(v);
            let high = _mm256_srli_epi32(x, 16);
            let lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
            let rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
            let quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
            let is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            _mm256_blendv_epi8(rounded, quiet_nan, is_nan)
        }
    }

    /// 16 bf16 values as two vectors of 8 f32: interleaving zeros below each bf16 widens it (bf16 is f32's upper
    /// half). unpacklo takes elements 0-3 and 8-11 (per 128-bit lane), unpackhi 4-7 and 12-15; `_mm256_packus_epi32`
    /// of the two rounded halves puts them back in order (values are at most 0xffff, so its unsigned saturation
    /// never bites).
    #[inline(always)]
    unsafe fn widen(v: __m256i) -> (__m256, __m256) {
        // SAFETY: register-only AVX2 operations.
        unsafe {
            let zero = _mm256_setzero_si256();
            (_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)))
        }
    }

    /// (a + b) [/ n] of 8 lanes already widened to f32, as bf16 bits in 32-bit lanes.
    #[inline(always)]
    unsafe fn sum8(a: __m256, b: __m256, divisor: Option<__m256>) -> __m256i {
        // SAFETY: register-only AVX2 operations.
        unsafe {
            let s = round(_mm256_add_ps(a, b));
            match divisor {
                None => s,
                Some(n) => round(_mm256_div_ps(_mm256_castsi256_ps(_mm256_slli_epi32(s, 16)), n)),
            }
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bf16_sum<const STREAM: bool>(
        dst: *mut bf16,
        a: *const bf16,
        b: *const bf16,
        len: usize,
        divide_by: Option<usize>,
    ) {
        let n = divide_by.map(|n| _mm256_set1_ps(n as f32));
        let block = |i: usize| {
            // SAFETY: sum_blocks's contract: 16 elements at i.
            unsafe {
                let (a_lo, a_hi) = widen(_mm256_loadu_si256(a.add(i).cast()));
                let (b_lo, b_hi) = widen(_mm256_loadu_si256(b.add(i).cast()));
                _mm256_packus_epi32(sum8(a_lo, b_lo, n), sum8(a_hi, b_hi, n))
            }
        };
        // SAFETY: the caller's contract.
        unsafe { sum_blocks::<bf16, STREAM>(dst, a, b, len, divide_by, HALF_PREFETCH_BYTES, block) }
    }

    /// The loop every divide shares: 32-byte blocks of `dst` from `block(i)` (the quotients of the block at element
    /// `i`), then the tail element by element with [`Element::div`].
    ///
    /// # Safety
    /// As [`divide`](super::divide); `block(i)` reads only elements `i..i + 32 / size_of::<T>()`.
    #[inline(always)]
    unsafe fn divide_blocks<T: Element>(dst: *mut T, len: usize, n: usize, block: impl Fn(usize) -> __m256i) {
        let per_block = 32 / size_of::<T>();
        let body_end = len / per_block * per_block;
        for i in (0..body_end).step_by(per_block) {
            // SAFETY: i + per_block <= len.
            unsafe { _mm256_storeu_si256(dst.add(i).cast(), block(i)) };
        }
        // SAFETY: i < len.
        (body_end..len).for_each(|i| unsafe { *dst.add(i) = T::div(*dst.add(i), n) });
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn f32_divide(dst: *mut f32, len: usize, n: usize) {
        let nv = _mm256_set1_ps(n as f32);
        // SAFETY (block): divide_blocks's contract: 8 elements at i.
        let block = |i: usize| unsafe { _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(dst.add(i)), nv)) };
        // SAFETY: the caller's contract.
        unsafe { divide_blocks(dst, len, n, block) }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bf16_divide(dst: *mut bf16, len: usize, n: usize) {
        let nv = _mm256_set1_ps(n as f32);
        let block = |i: usize| {
            // SAFETY: divide_blocks's contract: 16 elements at i.
            unsafe {
                let (lo, hi) = widen(_mm256_loadu_si256(dst.add(i).cast()));
                _mm256_packus_epi32(round(_mm256_div_ps(lo, nv)), round(_mm256_div_ps(hi, nv)))
            }
        };
        // SAFETY: the caller's contract.
        unsafe { divide_blocks(dst, len, n, block) }
    }

    /// (a + b) [/ n] of 8 f16 lanes, converted with F16C (round to nearest even, as `half` does with it).
    #[inline(always)]
    unsafe fn f16_sum8(a: *const f16, b: *const f16, divisor: Option<__m256>) -> __m128i {
        // SAFETY: the caller reads 8 elements at a and b; F16C is enabled by the calling function.
        unsafe {
            let s = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_add_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(a.cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(b.cast())),
            ));
            match divisor {
                None => s,
                Some(n) => _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_div_ps(_mm256_cvtph_ps(s), n)),
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_sum<const STREAM: bool>(
        dst: *mut f16,
        a: *const f16,
        b: *const f16,
        len: usize,
        divide_by: Option<usize>,
    ) {
        let n = divide_by.map(|n| _mm256_set1_ps(n as f32));
        // SAFETY (block): sum_blocks's contract: 16 elements at i.
        let block = |i: usize| unsafe {
            _mm256_set_m128i(f16_sum8(a.add(i + 8), b.add(i + 8), n), f16_sum8(a.add(i), b.add(i), n))
        };
        // SAFETY: the caller's contract.
        unsafe { sum_blocks::<f16, STREAM>(dst, a, b, len, divide_by, HALF_PREFETCH_BYTES, block) }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_divide(dst: *mut f16, len: usize, n: usize) {
        let nv = _mm256_set1_ps(n as f32);
        // SAFETY (both): divide_blocks's contract: 16 elements at i.
        let half = |p: *mut f16| unsafe {
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_div_ps(_mm256_cvtph_ps(_mm_loadu_si128(p.cast())), nv))
        };
        let block = |i: usize| unsafe { _mm256_set_m128i(half(dst.add(i + 8)), half(dst.add(i))) };
        // SAFETY: the caller's contract.
        unsafe { divide_blocks(dst, len, n, block) }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::reduce_into;

    /// A deterministic stream of bit patterns (xorshift), so every class of value turns up: NaNs with payloads,
    /// infinities, subnormals, rounding ties.
    fn bits(seed: u64, n: usize) -> Vec<u64> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            })
            .collect()
    }

    fn check<T: crate::Element + PartialEq + std::fmt::Debug>(a: &[T], b: &[T]) {
        let dtype = T::DTYPE;
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            if !supported(dtype, op) {
                return; // no AVX2 here: the scalar loop runs instead, and the callers' tests cover it
            }
            for mean_of in [2, 3] {
                let parts: [&[u8]; 2] = [bytemuck::cast_slice(a), bytemuck::cast_slice(b)];
                // The scalar reference, element by element as the backends combine without the kernels.
                let mut want = vec![T::zeroed(); a.len()];
                for (i, w) in want.iter_mut().enumerate() {
                    let s = T::add(a[i], b[i]);
                    *w = if op == ReduceOp::Avg { T::div(s, mean_of) } else { s };
                }
                if mean_of == 2 {
                    let mut via_reduce = vec![T::zeroed(); a.len()];
                    reduce_into(dtype, bytemuck::cast_slice_mut(&mut via_reduce), &parts, ReduceOp::Sum);
                    if op == ReduceOp::Sum {
                        assert_eq!(bytemuck::cast_slice::<T, u8>(&via_reduce), bytemuck::cast_slice::<T, u8>(&want));
                    }
                }
                if op == ReduceOp::Avg {
                    let mut divided = a.to_vec();
                    unsafe { divide(dtype, divided.as_mut_ptr().cast(), a.len(), mean_of) };
                    let want: Vec<T> = a.iter().map(|x| T::div(*x, mean_of)).collect();
                    assert_eq!(
                        bytemuck::cast_slice::<T, u8>(&divided),
                        bytemuck::cast_slice::<T, u8>(&want),
                        "{dtype:?} divide by {mean_of}"
                    );
                }
                // Every head offset (alignment), both store kinds, out of place and in place on either input.
                for skip in 0..17 {
                    let (a, b, want) = (&a[skip..], &b[skip..], &want[skip..]);
                    for stream in [false, true] {
                        let mut storage = vec![T::zeroed(); a.len() + 16];
                        let out = &mut storage[skip..skip + a.len()];
                        unsafe {
                            pair_sum(
                                dtype,
                                out.as_mut_ptr().cast(),
                                a.as_ptr().cast(),
                                b.as_ptr().cast(),
                                a.len(),
                                (op == ReduceOp::Avg).then_some(mean_of),
                                stream,
                            )
                        };
                        assert_eq!(
                            bytemuck::cast_slice::<T, u8>(out),
                            bytemuck::cast_slice::<T, u8>(want),
                            "{dtype:?} {op:?}/{mean_of} skip {skip} stream {stream}"
                        );
                        let mut in_first = a.to_vec();
                        unsafe {
                            pair_sum(
                                dtype,
                                in_first.as_mut_ptr().cast(),
                                in_first.as_ptr().cast(),
                                b.as_ptr().cast(),
                                a.len(),
                                (op == ReduceOp::Avg).then_some(mean_of),
                                stream,
                            )
                        };
                        assert_eq!(
                            bytemuck::cast_slice::<T, u8>(&in_first),
                            bytemuck::cast_slice::<T, u8>(want),
                            "in place on the first"
                        );
                        let mut in_second = b.to_vec();
                        unsafe {
                            pair_sum(
                                dtype,
                                in_second.as_mut_ptr().cast(),
                                a.as_ptr().cast(),
                                in_second.as_ptr().cast(),
                                a.len(),
                                (op == ReduceOp::Avg).then_some(mean_of),
                                stream,
                            )
                        };
                        assert_eq!(
                            bytemuck::cast_slice::<T, u8>(&in_second),
                            bytemuck::cast_slice::<T, u8>(want),
                            "in place on the second"
                        );
                    }
                }
            }
        }
    }

    /// Random bit patterns (every NaN payload, infinities, subnormals, ties) give the scalar ops' bits.
    #[test]
    fn vector_sums_are_bitwise_the_scalar_ones() {
        let n = 4099;
        let a: Vec<bf16> = bits(1, n).iter().map(|x| bf16::from_bits(*x as u16)).collect();
        let b: Vec<bf16> = bits(2, n).iter().map(|x| bf16::from_bits((*x >> 20) as u16)).collect();
        check(&a, &b);
        let a: Vec<f32> = bits(3, n).iter().map(|x| f32::from_bits(*x as u32)).collect();
        let b: Vec<f32> = bits(4, n).iter().map(|x| f32::from_bits((*x >> 29) as u32)).collect();
        check(&a, &b);
        let a: Vec<half::f16> = bits(5, n).iter().map(|x| half::f16::from_bits(*x as u16)).collect();
        let b: Vec<half::f16> = bits(6, n).iter().map(|x| half::f16::from_bits((*x >> 20) as u16)).collect();
        check(&a, &b);
        // Ordinary gradient-like values, where the bits of a bf16 sum depend on the rounding of every tie.
        let a: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i as f32 * 0.37).sin() * 1e-3)).collect();
        let b: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i as f32 * 0.11).cos() * 1e-3)).collect();
        check(&a, &b);
    }
}
