//! Runtime CPU feature detection and the parallel tile loop every optimizer shares.
//!
//! Kernels are plain element-wise Rust loops written so LLVM vectorizes them; running them inside a
//! `#[target_feature]` function lets LLVM use AVX-512 or AVX2 when the CPU has them (detected once at run time).
//! No fused multiply-add is written or allowed to form (Rust does not contract `a * b + c`), and vector sqrt and
//! division are exact, so every level gives bitwise the same results.
use std::ops::Range;
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::shard::{Grads, Group, ParamsOut};

/// The vector instruction set the kernels run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimdLevel {
    /// AVX-512F kernels.
    Avx512,
    /// AVX2 kernels.
    Avx2,
    /// NEON kernels (aarch64).
    Neon,
    /// The portable fallback (also `ZERORUN_SIMD=scalar`).
    Scalar,
}

/// Detected once; `ZERORUN_SIMD=scalar|avx2|avx512` lowers it (for tests and benchmarks), never raises it.
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let detected = detect();
        let wanted = match std::env::var("ZERORUN_SIMD").as_deref() {
            Ok("scalar") => SimdLevel::Scalar,
            Ok("avx2") if detected == SimdLevel::Avx512 => SimdLevel::Avx2,
            _ => detected,
        };
        wanted
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> SimdLevel {
    if is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bw")
    {
        SimdLevel::Avx512
    } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        SimdLevel::Avx2
    } else {
        SimdLevel::Scalar
    }
}

#[cfg(target_arch = "aarch64")]
fn detect() -> SimdLevel {
    SimdLevel::Neon
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn detect() -> SimdLevel {
    SimdLevel::Scalar
}

/// Elements per parallel tile: 16 Ki f32 = 64 KiB per array, so a tile's arrays stay in L2.
pub(crate) const TILE: usize = 16 * 1024;
/// Elements staged at once when gradients arrive in 16 bits.
pub(crate) const STAGE: usize = 1024;

/// A mutable buffer shared by tiles that touch disjoint element ranges.
pub(crate) struct Disjoint<T> {
    ptr: *mut T,
    len: usize,
}
impl<T> Clone for Disjoint<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Disjoint<T> {}
// SAFETY: tiles take disjoint ranges only (see `for_each_chunk`).
unsafe impl<T: Send> Send for Disjoint<T> {}
unsafe impl<T: Send> Sync for Disjoint<T> {}

impl<T> Disjoint<T> {
    pub fn new(buf: &mut [T]) -> Self {
        Disjoint { ptr: buf.as_mut_ptr(), len: buf.len() }
    }

    /// SAFETY: callers take each element range at most once at a time.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range<'a>(self, r: Range<usize>) -> &'a mut [T] {
        assert!(r.start <= r.end && r.end <= self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len())
    }
}

enum Out {
    Bf16(Disjoint<half::bf16>),
    F16(Disjoint<half::f16>),
}

/// An element-wise optimizer kernel over one chunk: the group's index, the params, the gradients as f32 and the
/// `S` state buffers, all sliced to the chunk. Implementations mark `run` `#[inline(always)]`.
pub(crate) trait Kernel<const S: usize>: Sync {
    fn run(&self, group: usize, p: &mut [f32], g: &[f32], states: [&mut [f32]; S]);
}

/// The buffers of one step, shared by the tiles.
struct Step<'a, const S: usize> {
    p: Disjoint<f32>,
    states: [Disjoint<f32>; S],
    out: Option<Out>,
    grads: Grads<'a>,
}

/// One tile: chunks of `STAGE` elements through the kernel, then into the 16-bit copy.
#[inline(always)]
fn tile_body<const S: usize, K: Kernel<S>>(kernel: &K, step: &Step<'_, S>, group: usize, tile: Range<usize>) {
    let mut staged = [0f32; STAGE];
    for start in tile.clone().step_by(STAGE) {
        let r = start..(start + STAGE).min(tile.end);
        // f32 gradients are read in place; 16-bit and scaled ones are widened or scaled into an L1-resident buffer.
        let g: &[f32] = match step.grads {
            Grads::F32(g) => &g[r.clone()],
            _ => {
                let g = &mut staged[..r.len()];
                step.grads.load(r.clone(), g);
                g
            }
        };
        // SAFETY: tiles are disjoint ranges of the shard (groups do not overlap), and so are the chunks within a
        // tile; every buffer has the shard's length (checked by the caller).
        let (pr, sr) = unsafe { (step.p.range(r.clone()), step.states.map(|s| s.range(r.clone()))) };
        kernel.run(group, pr, g, sr);
        match &step.out {
            Some(Out::Bf16(o)) => {
                let o = unsafe { o.range(r.clone()) };
                for (d, s) in o.iter_mut().zip(pr.iter()) {
                    *d = half::bf16::from_bits(bf16_bits(*s));
                }
            }
            Some(Out::F16(o)) => {
                let o = unsafe { o.range(r.clone()) };
                half::slice::HalfFloatSliceExt::convert_from_f32_slice(o, pr);
            }
            None => {}
        }
    }
}

/// `tile_body` compiled for the detected instruction set. LLVM inlines `tile_body` and the `#[inline(always)]`
/// kernel into each `#[target_feature]` clone; a closure would not do, since a closure body is not force-inlined
/// and keeps the baseline instruction set.
fn run_tile<const S: usize, K: Kernel<S>>(kernel: &K, step: &Step<'_, S>, group: usize, tile: Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx2,fma,f16c")]
        unsafe fn avx512<const S: usize, K: Kernel<S>>(k: &K, s: &Step<'_, S>, g: usize, t: Range<usize>) {
            tile_body(k, s, g, t)
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn avx2<const S: usize, K: Kernel<S>>(k: &K, s: &Step<'_, S>, g: usize, t: Range<usize>) {
            tile_body(k, s, g, t)
        }
        match simd_level() {
            // SAFETY: the level was detected on this CPU (or lowered by the user).
            SimdLevel::Avx512 => unsafe { avx512(kernel, step, group, tile) },
            SimdLevel::Avx2 => unsafe { avx2(kernel, step, group, tile) },
            _ => tile_body(kernel, step, group, tile),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    tile_body(kernel, step, group, tile)
}

/// Splits every group into tiles and runs `kernel` over them in parallel, writing updated params to `out`.
pub(crate) fn for_each_chunk<const S: usize, K: Kernel<S>>(
    params: &mut [f32],
    grads: Grads<'_>,
    groups: &[Group],
    states: [&mut [f32]; S],
    out: Option<ParamsOut<'_>>,
    kernel: &K,
) {
    let step = Step {
        p: Disjoint::new(params),
        states: states.map(Disjoint::new),
        out: out.map(|o| match o {
            ParamsOut::Bf16(o) => Out::Bf16(Disjoint::new(o)),
            ParamsOut::F16(o) => Out::F16(Disjoint::new(o)),
        }),
        grads,
    };
    let tiles: Vec<(usize, Range<usize>)> = groups
        .iter()
        .enumerate()
        .flat_map(|(gi, g)| {
            (g.range.start..g.range.end).step_by(TILE).map(move |s| (gi, s..(s + TILE).min(g.range.end)))
        })
        .collect();
    tiles.par_iter().for_each(|(gi, tile)| run_tile(kernel, &step, *gi, tile.clone()));
}

/// f32 to bf16 bits, rounding to nearest even and quieting NaNs (the same values as `half::bf16::from_f32`),
/// written without branches so it vectorizes.
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let quiet = ((b >> 16) as u16) | 0x0040;
    if (b & 0x7fff_ffff) > 0x7f80_0000 {
        quiet
    } else {
        rounded
    }
}
