//! All-to-all with parts of any length (MPI's alltoallv): what a mixture-of-experts layer sends its experts' ranks
//! (each gets the tokens routed to its experts, a different number every step) and what sequence parallelism trades
//! heads for sequence with. The default here moves each part once, straight to its rank: one send and one receive
//! with each peer in turn, so every rank moves exactly what it sends and receives and nothing else (gathering whole
//! inputs, the older default, moved world-size times the bytes). Backends that can keep every transfer in flight at
//! once (gloo) or have one of their own (MPI) override [`Communicator::all_to_all_v_buf`].
use super::{agreement, BufMut, BufRef, CommError, CommResult, Communicator, Dtype};

/// The checks every backend makes before an all-to-all of parts: one count per rank on each side, counts that add
/// up to the buffers' lengths, one element type. Returns the parts' element offsets (send, receive), each with a
/// last entry, the total.
pub fn offsets(
    op: &'static str,
    rank: usize,
    world_size: usize,
    input: &BufRef<'_>,
    send: &[usize],
    output: &BufMut<'_>,
    recv: &[usize],
) -> CommResult<(Vec<usize>, Vec<usize>)> {
    let bad = |what: String| CommError::BadArgument { op, rank, what };
    for (side, counts, len) in [("send", send, input.len()), ("receive", recv, output.len())] {
        if counts.len() != world_size {
            return Err(bad(format!("{} {side} counts for a group of {world_size} ranks", counts.len())));
        }
        let total: usize = counts.iter().sum();
        if total != len {
            return Err(bad(format!("{side} counts add up to {total} elements, the buffer holds {len}")));
        }
    }
    if output.dtype != input.dtype {
        return Err(bad(format!("output holds {:?} elements, the input {:?}", output.dtype, input.dtype)));
    }
    let starts = |counts: &[usize]| {
        std::iter::once(0).chain(counts.iter().scan(0, |at, c| Some(std::mem::replace(at, *at + c) + c))).collect()
    };
    Ok((starts(send), starts(recv)))
}

/// Every rank's counts and element type, agreed before any part moves: one all-gather of each rank's call (the
/// collective, its element type) and both its count lists. Anything that disagrees (another collective, another
/// type, what rank p sends rank q against what q expects from p) is the same error on every rank, so no transfer
/// waits for a part that never comes. Returns what every rank sends every rank: rank p's count for rank q at
/// `p * world_size + q`.
pub fn agree<C: Communicator + ?Sized>(
    comm: &C,
    op: &'static str,
    send: &[usize],
    recv: &[usize],
    dtype: Dtype,
) -> CommResult<Vec<usize>> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let w = 3 + 2 * n;
    let mut all = vec![0i64; n * w];
    let row = &mut all[rank * w..(rank + 1) * w];
    for (x, c) in row.iter_mut().zip(agreement::Call::new(op, 0, dtype).words()) {
        *x = c as i64;
    }
    for (x, c) in row[3..].iter_mut().zip(send.iter().chain(recv)) {
        *x = *c as i64;
    }
    comm.all_gather_buf(BufMut::new(&mut all))?;
    let rows: Vec<&[i64]> = all.chunks(w).collect();
    let calls: Vec<agreement::Call> =
        rows.iter().map(|r| agreement::Call::from_words(&[r[0] as u64, r[1] as u64, r[2] as u64])).collect();
    agreement::check(op, rank, &calls)?;
    for (p, q) in (0..n).flat_map(|p| (0..n).map(move |q| (p, q))) {
        let (sends, expects) = (rows[p][3 + q], rows[q][3 + n + p]);
        if sends != expects {
            return Err(CommError::BadArgument {
                op,
                rank,
                what: format!("rank {p} sends rank {q} {sends} elements, which expects {expects}"),
            });
        }
    }
    Ok(rows.iter().flat_map(|r| r[3..3 + n].iter().map(|&c| c as usize)).collect())
}

/// [`Communicator::all_to_all_v_buf`] from point-to-point transfers: part q of `input` (`send[q]` elements) goes to
/// rank q, and part r of `output` (`recv[r]` elements) comes from rank r; this rank's own part is copied. In round
/// k this rank sends to rank + k and receives from rank - k. Sends are rendezvous, so the order matters: round k's
/// transfers form cycles, and ranks at even places of their cycle send first, the others receive first. Where a
/// rank's parity is its place's parity (an even world, an odd k) the backend's `send_recv_buf` runs, which has both
/// in flight at once where it can. The counts are [`agree`]d first.
pub fn pairwise<C: Communicator + ?Sized>(
    comm: &C,
    input: BufRef<'_>,
    send: &[usize],
    output: BufMut<'_>,
    recv: &[usize],
) -> CommResult<()> {
    const OP: &str = "all_to_all";
    let (rank, world) = (comm.rank(), comm.world_size());
    let (sends, recvs) = offsets(OP, rank, world, &input, send, &output, recv)?;
    let (es, dtype) = (input.dtype.size(), input.dtype);
    agree(comm, OP, send, recv, dtype)?;
    let part = |starts: &[usize], q: usize| starts[q] * es..starts[q + 1] * es;
    output.bytes[part(&recvs, rank)].copy_from_slice(&input.bytes[part(&sends, rank)]);
    for k in 1..world {
        let (dst, src) = ((rank + k) % world, (rank + world - k) % world);
        let out = BufRef { bytes: &input.bytes[part(&sends, dst)], dtype };
        let into = BufMut { bytes: &mut output.bytes[part(&recvs, src)], dtype };
        // Agreed counts: an empty part is no transfer on either end (a chain of waits that ends sooner).
        match (out.bytes.is_empty(), into.bytes.is_empty()) {
            (true, true) => {}
            (false, true) => comm.send_buf(out, dst)?,
            (true, false) => comm.recv_buf(into, src)?,
            _ if world % 2 == 0 && k % 2 == 1 => comm.send_recv_buf(out, dst, into, src)?,
            _ if place_in_cycle(rank, world, k) % 2 == 0 => {
                comm.send_buf(out, dst)?;
                comm.recv_buf(into, src)?;
            }
            _ => {
                comm.recv_buf(into, src)?;
                comm.send_buf(out, dst)?;
            }
        }
    }
    Ok(())
}

/// [`Communicator::all_to_all_buf`]'s default: [`pairwise`] with `world_size` equal parts.
pub fn equal_parts<C: Communicator + ?Sized>(comm: &C, input: BufRef<'_>, output: BufMut<'_>) -> CommResult<()> {
    let world = comm.world_size();
    let part = agreement::exchange_output("all_to_all", comm.rank(), world, &input, &output)?;
    let counts = vec![part; world];
    pairwise(comm, input, &counts, output, &counts)
}

/// All-to-all of `words`-long parts of u64 words (the 1-bit all-reduce's packed signs).
pub fn exchange_words(comm: &dyn Communicator, sent: &[u64], received: &mut [u64]) -> CommResult<()> {
    equal_parts(
        comm,
        BufRef { bytes: bytemuck::cast_slice(sent), dtype: Dtype::I64 },
        BufMut { bytes: bytemuck::cast_slice_mut(received), dtype: Dtype::I64 },
    )
}

/// Where `rank` sits in its cycle of the shift by `k` on a ring of `world`: the cycle starts at
/// `rank % gcd(world, k)` and steps by k.
fn place_in_cycle(rank: usize, world: usize, k: usize) -> usize {
    let mut place = 0;
    let mut x = rank % gcd(world, k);
    while x != rank {
        x = (x + k) % world;
        place += 1;
    }
    place
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::threads;
    use std::time::Duration;

    /// Rank r sends (r + q) % 3 elements to rank q, each valued 1000 r + q; rank q expects them in rank order.
    fn counts(r: usize, q: usize) -> usize {
        (r + 2 * q) % 3
    }

    #[test]
    fn parts_of_every_length_reach_their_rank() {
        for world in [1usize, 2, 3, 4, 5] {
            let comms = threads::group(world, Duration::from_secs(10));
            std::thread::scope(|s| {
                for c in comms {
                    s.spawn(move || {
                        let r = c.rank();
                        let send: Vec<usize> = (0..world).map(|q| counts(r, q)).collect();
                        let recv: Vec<usize> = (0..world).map(|p| counts(p, r)).collect();
                        let input: Vec<f32> = (0..world).flat_map(|q| vec![(1000 * r + q) as f32; send[q]]).collect();
                        let mut output = vec![-1.0f32; recv.iter().sum()];
                        pairwise(&c, BufRef::new(&input), &send, BufMut::new(&mut output), &recv).unwrap();
                        let expected: Vec<f32> =
                            (0..world).flat_map(|p| vec![(1000 * p + r) as f32; recv[p]]).collect();
                        assert_eq!(output, expected, "rank {r} of {world}");
                    });
                }
            });
        }
    }

    #[test]
    fn counts_two_ranks_disagree_on_are_an_error_on_every_rank() {
        let comms = threads::group(3, Duration::from_secs(10));
        std::thread::scope(|s| {
            for c in comms {
                s.spawn(move || {
                    // Rank 2 expects two elements from rank 1, which sends one.
                    let recv = if c.rank() == 2 { vec![1, 2, 1] } else { vec![1; 3] };
                    let input = [0.0f32; 3];
                    let mut output = vec![0.0f32; recv.iter().sum()];
                    let e = pairwise(&c, BufRef::new(&input), &[1; 3], BufMut::new(&mut output), &recv).unwrap_err();
                    assert!(e.to_string().contains("rank 1 sends rank 2 1 elements, which expects 2"), "{e}");
                });
            }
        });
    }

    #[test]
    fn counts_that_do_not_add_up_are_refused_by_name() {
        let comms = threads::group(2, Duration::from_secs(5));
        let c = &comms[0];
        let input = [0.0f32; 3];
        let mut output = [0.0f32; 3];
        let e = pairwise(c, BufRef::new(&input), &[1, 1], BufMut::new(&mut output), &[2, 1]).unwrap_err();
        assert!(e.to_string().contains("send counts add up to 2 elements, the buffer holds 3"), "{e}");
        let e = pairwise(c, BufRef::new(&input), &[3], BufMut::new(&mut output), &[2, 1]).unwrap_err();
        assert!(e.to_string().contains("1 send counts for a group of 2 ranks"), "{e}");
    }
}
