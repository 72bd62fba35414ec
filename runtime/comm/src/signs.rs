//! The 1-bit all-reduce of DeepSpeed's 1-bit Adam, 0/1 Adam and 1-bit LAMB (Tang et al. 2021), on every backend:
//! each value travels as its sign, one bit, with one f32 scale per part, and what the signs lose is fed back into
//! the next call on both sides (error feedback), so nothing is lost over steps, only delayed.
//!
//! With `W` ranks and a vector of `n` values (padded with zeros to a multiple of `64 W`):
//! 1. **worker**: `x = values + worker_error`; `scale = ||x|| / sqrt(n)`; `worker_error = x - scale * sign(x)`
//!    (sign(0) = +1: one bit has no zero). Part `q` of the signs goes to rank `q`, with the scale
//!    ([`crate::all_to_all`]: each part straight to its rank, (W-1)/W of n/8 bytes out of every rank).
//! 2. **server** (every rank, for its own part): `server_error` plus the average of the W received parts,
//!    `sum_r scale_r/W * sign_r` (added in rank order); its scale and signs the same way, and `server_error` the remainder.
//! 3. the servers' signs and scales are all-gathered; every rank ends with the same values, `scale_q * sign` in part q.
//!
//! Per rank the wire carries 2 (W-1)/W x n/8 bytes (and 2 (W-1) scales): 1/32 of a ring all-reduce of fp32.
//! Every step of the arithmetic is this rank's own, in a fixed order, so the result is bitwise the same whatever
//! the backend (threads, shm, gloo, MPI, NCCL's host path) and whatever the thread count.
//!
//! Signs pack 64 to a word, value `j` of a part in bit `j % 64` of word `j / 64`; a part on the wire is its words,
//! then one word holding the scale's bits (the collectives move whole i64 words).
use super::{coding, BufMut, CommError, CommResult, Communicator, Dtype};

/// Values per sign word.
const WORD: usize = 64;

/// The padded length of an `n`-value vector over `world` ranks: a multiple of `64 x world`, so each rank's part
/// is whole words.
pub fn padded_len(n: usize, world: usize) -> usize {
    n.div_ceil(WORD * world) * WORD * world
}

/// Bytes one rank sends for an `n`-value vector over `world` ranks (both phases, scales included).
pub fn wire_bytes(n: usize, world: usize) -> usize {
    if world < 2 || n == 0 {
        return 0;
    }
    let part_words = padded_len(n, world) / world / WORD + 1;
    2 * (world - 1) * part_words * 8
}

/// The two error-feedback buffers of one exchanged vector: the worker's over the whole padded vector, the server's
/// over this rank's part. Each rank's are its own (they differ from rank to rank); a checkpoint saves them per rank.
#[derive(Debug, Clone, PartialEq)]
pub struct SignErrors {
    /// What this rank's signs left out of the whole vector, padded ([`padded_len`]).
    pub worker: Vec<f32>,
    /// What this rank's server signs left out of its part (padded length / world).
    pub server: Vec<f32>,
}

impl SignErrors {
    /// Zero errors for an `n`-value vector over `world` ranks.
    pub fn new(n: usize, world: usize) -> SignErrors {
        let padded = padded_len(n, world.max(1));
        SignErrors { worker: vec![0.0; padded], server: vec![0.0; padded / world.max(1)] }
    }

    /// Sets both buffers to zero (0/1 Adam, entering its local steps; a resume at another world size).
    pub fn reset(&mut self) {
        self.worker.fill(0.0);
        self.server.fill(0.0);
    }

    /// Bytes the two buffers hold.
    pub fn bytes(&self) -> usize {
        4 * (self.worker.len() + self.server.len())
    }
}

/// Replaces `values` by the 1-bit average over the ranks of `comm` (module docs), updating this rank's error
/// feedback: `worker` ([`padded_len`] values) and `server` (padded length / world).
/// Collective: every rank calls it with vectors of the same length. A single rank keeps its values exactly (there
/// is nothing to exchange, as DeepSpeed's optimizers skip the call at one rank).
pub fn all_reduce(
    comm: &dyn Communicator,
    values: &mut [f32],
    worker: &mut [f32],
    server: &mut [f32],
) -> CommResult<()> {
    const OP: &str = "1-bit all_reduce";
    let (rank, world, n) = (comm.rank(), comm.world_size(), values.len());
    if world == 1 || n == 0 {
        return Ok(());
    }
    let padded = padded_len(n, world);
    if worker.len() != padded || server.len() != padded / world {
        return Err(CommError::BadArgument {
            op: OP,
            rank,
            what: format!(
                "error buffers of {} and {} values for {n} values over {world} ranks (expected {padded} and {})",
                worker.len(),
                server.len(),
                padded / world
            ),
        });
    }
    let part = padded / world;
    let part_words = part / WORD + 1;
    SCRATCH.with(|scratch| {
        // The sign words' buffers are kept between calls: a fresh allocation of them would be page faults each step.
        let mut scratch = scratch.borrow_mut();
        scratch.resize(3 * world * part_words, 0);
        let (sent, rest) = scratch.split_at_mut(world * part_words);
        let (received, gathered) = rest.split_at_mut(world * part_words);
        // 1. The worker: compensate, take signs and scale, keep the remainder.
        coding::timed(|| {
            for (e, v) in worker.iter_mut().zip(values.iter()) {
                *e += *v;
            }
            compress(worker, sent, part_words);
        });
        // 2. Each part to its server, which adds every rank's part of it (in rank order) to its error.
        crate::all_to_all::exchange_words(comm, sent, received)?;
        coding::timed(|| {
            for r in 0..world {
                let words = &received[r * part_words..(r + 1) * part_words];
                let weight = f32::from_bits(words[part_words - 1] as u32) / world as f32;
                add_signs(&words[..part_words - 1], weight, server);
            }
            // 3. The servers' signs and scales to every rank.
            compress(server, &mut gathered[rank * part_words..(rank + 1) * part_words], part_words);
        });
        comm.all_gather_buf(BufMut { bytes: bytemuck::cast_slice_mut(gathered), dtype: Dtype::I64 })?;
        coding::timed(|| {
            for (q, out) in values.chunks_mut(part).enumerate() {
                let words = &gathered[q * part_words..(q + 1) * part_words];
                write_signs(&words[..part_words - 1], f32::from_bits(words[part_words - 1] as u32), out);
            }
        });
        Ok(())
    })
}

thread_local! {
    /// Sign words of the last call on this thread, reused.
    static SCRATCH: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The first half of [`all_reduce`] over parts of any length, for an optimizer whose states are partitioned
/// (ZeRO stage 1): `worker` is `world` parts of `out.len()` values, this rank's vector already compensated (the
/// caller has added its values to its worker error); their signs and one scale travel, `worker` keeps what they
/// missed, and `out` gets the average of every rank's part `rank` as decoded, `sum_r scale_r / W * sign_r`. Each
/// part's signs are padded to whole words on their own, so the parts are the engine's partitions. Collective.
pub fn reduce_scatter_compensated(comm: &dyn Communicator, worker: &mut [f32], out: &mut [f32]) -> CommResult<()> {
    const OP: &str = "1-bit reduce_scatter";
    let (rank, world, part) = (comm.rank(), comm.world_size(), out.len());
    if worker.len() != world * part {
        return Err(CommError::BadArgument {
            op: OP,
            rank,
            what: format!("a worker error of {} for parts of {part} over {world} ranks", worker.len()),
        });
    }
    let words = part.div_ceil(WORD) + 1;
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        scratch.resize(2 * world * words, 0);
        let (sent, received) = scratch.split_at_mut(world * words);
        coding::timed(|| {
            let scale = (square_sum(worker) / worker.len().max(1) as f64).sqrt() as f32;
            for (x, w) in worker.chunks_mut(part).zip(sent.chunks_mut(words)) {
                pack(x, &mut w[..words - 1], scale);
                w[words - 1] = scale.to_bits() as u64;
            }
        });
        crate::all_to_all::exchange_words(comm, sent, received)?;
        coding::timed(|| {
            out.fill(0.0);
            for r in 0..world {
                let w = &received[r * words..(r + 1) * words];
                add_signs(&w[..words - 1], f32::from_bits(w[words - 1] as u32) / world as f32, out);
            }
        });
        Ok(())
    })
}

/// The second half, over parts of any length: this rank's `part` plus its `server` error (the same length) travels
/// as signs and one scale, the remainder stays in `server`, and every rank's decoded part is added to its place in
/// `values` (`world` parts): the same additions on every rank. Collective.
pub fn all_gather_add(comm: &dyn Communicator, part: &[f32], server: &mut [f32], values: &mut [f32]) -> CommResult<()> {
    const OP: &str = "1-bit all_gather";
    let (rank, world, len) = (comm.rank(), comm.world_size(), part.len());
    if values.len() != world * len || server.len() != len {
        return Err(CommError::BadArgument {
            op: OP,
            rank,
            what: format!(
                "{} values and a server error of {} for parts of {len} over {world} ranks",
                values.len(),
                server.len()
            ),
        });
    }
    let words = len.div_ceil(WORD) + 1;
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        scratch.resize(world * words, 0);
        let gathered = &mut scratch[..world * words];
        coding::timed(|| {
            for (e, v) in server.iter_mut().zip(part) {
                *e += *v;
            }
            compress(server, &mut gathered[rank * words..(rank + 1) * words], words);
        });
        comm.all_gather_buf(BufMut { bytes: bytemuck::cast_slice_mut(gathered), dtype: Dtype::I64 })?;
        coding::timed(|| {
            for (q, out) in values.chunks_mut(len).enumerate() {
                let w = &gathered[q * words..(q + 1) * words];
                add_signs(&w[..words - 1], f32::from_bits(w[words - 1] as u32), out);
            }
        });
        Ok(())
    })
}

/// Bytes one rank sends through [`reduce_scatter_compensated`] and [`all_gather_add`] of parts of `part_len` over `world` ranks.
pub fn sharded_wire_bytes(part_len: usize, world: usize) -> usize {
    if world < 2 {
        return 0;
    }
    2 * (world - 1) * (part_len.div_ceil(WORD) + 1) * 8
}

/// Takes the signs and scale of `x` (whole parts of `part_words - 1` sign words each, then the scale's word) into
/// `out`, and leaves in `x` what they do not carry: `x - scale * sign(x)`. Returns the scale, `||x|| / sqrt(len)`.
fn compress(x: &mut [f32], out: &mut [u64], part_words: usize) -> f32 {
    let scale = (square_sum(x) / x.len() as f64).sqrt() as f32;
    let sign_words = part_words - 1;
    for (part, words) in x.chunks_mut(sign_words * WORD).zip(out.chunks_mut(part_words)) {
        pack(part, &mut words[..sign_words], scale);
        words[sign_words] = scale.to_bits() as u64;
    }
    scale
}

/// Values summed in f32 lanes before the lanes go into the f64 total: a fixed order (so the same bits on every
/// machine and thread count) that vectorizes.
const LANES: usize = 8;
const BLOCK: usize = 4096;

/// `sum x^2`: blocks of [`BLOCK`] values summed in [`LANES`] f32 lanes, blocks added in f64.
fn square_sum(x: &[f32]) -> f64 {
    let mut total = 0f64;
    for block in x.chunks(BLOCK) {
        let mut lanes = [0f32; LANES];
        let mut it = block.chunks_exact(LANES);
        for c in &mut it {
            for k in 0..LANES {
                lanes[k] += c[k] * c[k];
            }
        }
        let tail: f32 = it.remainder().iter().map(|v| v * v).sum();
        total += lanes.iter().map(|&l| l as f64).sum::<f64>() + tail as f64;
    }
    total
}

/// Sign bits of `x` into `words` (bit j of word w: value 64 w + j is not negative; NaN counts as not negative), and
/// `x -= scale * sign(x)`.
fn pack(x: &mut [f32], words: &mut [u64], scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked above).
        return unsafe { pack_avx2(x, words, scale) };
    }
    for (chunk, word) in x.chunks_mut(WORD).zip(words.iter_mut()) {
        let mut bits = 0u64;
        for (j, v) in chunk.iter_mut().enumerate() {
            let positive = not_negative(*v);
            bits |= (positive as u64) << j;
            *v -= if positive { scale } else { -scale };
        }
        *word = bits;
    }
}

/// What one sign bit says: not below zero (0 counts as +1, as DeepSpeed's sign; NaN too, which the error then
/// carries, so a NaN shows as it would in an uncompressed reduction).
#[inline(always)]
fn not_negative(v: f32) -> bool {
    v.partial_cmp(&0.0) != Some(std::cmp::Ordering::Less)
}

/// [`pack`] with AVX2: eight compares, one movemask and one blend per eight values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_avx2(x: &mut [f32], words: &mut [u64], scale: f32) {
    use std::arch::x86_64::*;
    let (zero, plus, minus) = (_mm256_setzero_ps(), _mm256_set1_ps(scale), _mm256_set1_ps(-scale));
    for (chunk, word) in x.chunks_mut(WORD).zip(words.iter_mut()) {
        let mut bits = 0u64;
        let whole = chunk.len() / 8 * 8;
        for (k, eight) in chunk[..whole].chunks_exact_mut(8).enumerate() {
            let v = _mm256_loadu_ps(eight.as_ptr());
            let negative = _mm256_cmp_ps::<_CMP_LT_OQ>(v, zero);
            bits |= ((!_mm256_movemask_ps(negative) as u64) & 0xff) << (8 * k);
            _mm256_storeu_ps(eight.as_mut_ptr(), _mm256_sub_ps(v, _mm256_blendv_ps(plus, minus, negative)));
        }
        for (j, v) in chunk.iter_mut().enumerate().skip(whole) {
            let positive = not_negative(*v);
            bits |= (positive as u64) << j;
            *v -= if positive { scale } else { -scale };
        }
        *word = bits;
    }
}

/// Eight values of plus or minus one for each byte of signs (bit k: value k): what unpacking multiplies by.
fn sign_table() -> &'static [[f32; 8]; 256] {
    static TABLE: std::sync::OnceLock<[[f32; 8]; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| std::array::from_fn(|k| if b >> k & 1 == 1 { 1.0 } else { -1.0 })))
}

/// `out[j] += weight * sign_j` for the signs in `words`.
fn add_signs(words: &[u64], weight: f32, out: &mut [f32]) {
    let table = sign_table();
    for (word, chunk) in words.iter().zip(out.chunks_mut(WORD)) {
        for (k, eight) in chunk.chunks_mut(8).enumerate() {
            let signs = &table[(word >> (8 * k)) as usize & 0xff];
            for (o, s) in eight.iter_mut().zip(signs) {
                *o += s * weight;
            }
        }
    }
}

/// `out[j] = scale * sign_j` for the signs in `words` (the last part may be cut short: padding is dropped).
fn write_signs(words: &[u64], scale: f32, out: &mut [f32]) {
    let table = sign_table();
    for (word, chunk) in words.iter().zip(out.chunks_mut(WORD)) {
        for (k, eight) in chunk.chunks_mut(8).enumerate() {
            let signs = &table[(word >> (8 * k)) as usize & 0xff];
            for (o, s) in eight.iter_mut().zip(signs) {
                *o = s * scale;
            }
        }
    }
}

/// The same arithmetic with every rank's vector in one process: what [`all_reduce`] gives each rank, for tests
/// (DeepSpeed's `torch_sim` in its backend tests). `values[r]` and `errors[r]` are rank r's; every `values[r]` ends
/// with the result.
pub fn simulate(values: &mut [Vec<f32>], errors: &mut [SignErrors]) {
    let world = values.len();
    if world < 2 {
        return;
    }
    let n = values[0].len();
    let padded = padded_len(n, world);
    let part = padded / world;
    let part_words = part / WORD + 1;
    let mut sent = vec![vec![0u64; world * part_words]; world];
    for r in 0..world {
        for (e, v) in errors[r].worker.iter_mut().zip(&values[r]) {
            *e += *v;
        }
        compress(&mut errors[r].worker, &mut sent[r], part_words);
    }
    let mut gathered = vec![0u64; world * part_words];
    for q in 0..world {
        for s in &sent {
            let words = &s[q * part_words..(q + 1) * part_words];
            let weight = f32::from_bits(words[part_words - 1] as u32) / world as f32;
            add_signs(&words[..part_words - 1], weight, &mut errors[q].server);
        }
        compress(&mut errors[q].server, &mut gathered[q * part_words..(q + 1) * part_words], part_words);
    }
    for v in values.iter_mut() {
        for (q, out) in v.chunks_mut(part).enumerate() {
            let words = &gathered[q * part_words..(q + 1) * part_words];
            write_signs(&words[..part_words - 1], f32::from_bits(words[part_words - 1] as u32), out);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::threads::{self, ThreadComm};

    fn on_threads<T: Send + 'static>(world: usize, f: impl Fn(&ThreadComm) -> T + Send + Sync + 'static) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = threads::group(world, Duration::from_secs(20))
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(&c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn vectors(world: usize, n: usize, seed: u32) -> Vec<Vec<f32>> {
        (0..world)
            .map(|r| {
                (0..n)
                    .map(|i| {
                        let x = (i as u32).wrapping_mul(2654435761).wrapping_add(seed + 97 * r as u32);
                        (x % 2001) as f32 / 1000.0 - 1.0
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_rank_ends_with_the_simulated_values_bitwise() {
        for (world, n) in [(2, 1000), (3, 130), (4, 4096), (6, 700), (2, 1)] {
            let inputs = vectors(world, n, 7);
            let mut expected = inputs.clone();
            let mut sim_errors: Vec<SignErrors> = (0..world).map(|_| SignErrors::new(n, world)).collect();
            // Two calls: the second carries the first's errors.
            simulate(&mut expected, &mut sim_errors);
            let mut again = inputs.clone();
            simulate(&mut again, &mut sim_errors);
            let inputs_for = inputs.clone();
            let results = on_threads(world, move |comm| {
                let inputs = &inputs_for;
                let mut errors = SignErrors::new(n, world);
                let mut v = inputs[comm.rank()].clone();
                all_reduce(comm, &mut v, &mut errors.worker, &mut errors.server).unwrap();
                let first = v.clone();
                let mut v = inputs[comm.rank()].clone();
                all_reduce(comm, &mut v, &mut errors.worker, &mut errors.server).unwrap();
                (first, v, errors)
            });
            for (r, (first, second, errors)) in results.into_iter().enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&first), bits(&expected[r]), "world {world} n {n} rank {r}");
                assert_eq!(bits(&second), bits(&again[r]), "world {world} n {n} rank {r}, second call");
                assert_eq!(errors, sim_errors[r]);
            }
        }
    }

    #[test]
    fn values_are_signs_times_part_scales_and_errors_hold_the_rest() {
        let (world, n) = (2, 256);
        let inputs = vectors(world, n, 3);
        let mut out = inputs.clone();
        let mut errors: Vec<SignErrors> = (0..world).map(|_| SignErrors::new(n, world)).collect();
        simulate(&mut out, &mut errors);
        // One magnitude per part.
        for part in out[0].chunks(n / world) {
            let m = part[0].abs();
            assert!(m > 0.0 && part.iter().all(|x| x.abs() == m));
        }
        // The worker's error is what its signs missed: input = scale * sign + error.
        let scale = {
            let s: f64 = inputs[0].iter().map(|&v| (v as f64).powi(2)).sum();
            (s / n as f64).sqrt() as f32
        };
        for (i, &x) in inputs[0].iter().enumerate() {
            let sign = if x < 0.0 { -1.0 } else { 1.0 };
            assert!((x - (scale * sign + errors[0].worker[i])).abs() < 1e-6);
        }
    }

    #[test]
    fn error_feedback_makes_the_running_sum_exact_up_to_the_errors() {
        // Over many calls the sum of the outputs tracks the sum of the true averages: the difference is bounded by
        // the error buffers, which do not grow.
        let (world, n) = (2, 128);
        let mut errors: Vec<SignErrors> = (0..world).map(|_| SignErrors::new(n, world)).collect();
        let (mut out_sum, mut true_sum) = (vec![0f64; n], vec![0f64; n]);
        for step in 0..200 {
            let inputs = vectors(world, n, step);
            for i in 0..n {
                true_sum[i] += inputs.iter().map(|v| v[i] as f64).sum::<f64>() / world as f64;
            }
            let mut out = inputs;
            simulate(&mut out, &mut errors);
            for i in 0..n {
                out_sum[i] += out[0][i] as f64;
            }
        }
        let worst = (0..n).map(|i| (out_sum[i] - true_sum[i]).abs()).fold(0.0, f64::max);
        assert!(worst < 5.0, "the outputs' running sum drifted {worst} from the averages' (200 calls)");
    }

    #[test]
    fn wire_bytes_are_a_32nd_of_fp32s_ring() {
        let n = 1 << 20;
        // A ring all-reduce of fp32 sends 2 (W-1)/W x 4n bytes out of each rank: 4n at two ranks.
        assert_eq!(wire_bytes(n, 2), 4 * n / 32 + 2 * 8);
        assert_eq!(wire_bytes(n, 1), 0);
    }

    #[test]
    fn the_halves_decode_what_was_sent_and_every_rank_gathers_the_same() {
        // Parts of 100 (not whole words): the reduce-scatter gives each rank the average of the signs sent for its
        // part; the all-gather hands every rank every part's decoded signs.
        let (world, part) = (3, 100);
        let inputs = vectors(world, world * part, 11);
        let results = on_threads(world, move |comm| {
            let r = comm.rank();
            let mut worker = inputs[r].clone();
            let mut out = vec![0f32; part];
            reduce_scatter_compensated(comm, &mut worker, &mut out).unwrap();
            let mut server = vec![0f32; part];
            let mut whole = vec![0f32; world * part];
            all_gather_add(comm, &out, &mut server, &mut whole).unwrap();
            (out, server, whole)
        });
        for (r, (out, server, whole)) in results.iter().enumerate() {
            // What was gathered for part r is out + 0 (no earlier error) less what the server kept.
            for i in 0..part {
                assert!((whole[r * part + i] + server[i] - out[i]).abs() < 1e-6);
            }
            assert_eq!(whole, &results[0].2, "rank {r} gathered another vector");
            // The reduce-scatter's output is the mean of three signs times scales: finite, and not all zero.
            assert!(out.iter().all(|v| v.is_finite()) && out.iter().any(|v| *v != 0.0));
        }
    }

    #[test]
    fn wrong_error_buffers_are_named() {
        let r = on_threads(2, |comm| {
            let mut errors = SignErrors::new(10, 3);
            all_reduce(comm, &mut [1.0; 10], &mut errors.worker, &mut errors.server).unwrap_err().to_string()
        });
        assert!(r[0].contains("error buffers of 192 and 64 values for 10 values over 2 ranks"), "{}", r[0]);
    }
}
