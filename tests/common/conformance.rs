//! The collective conformance suite, run by every backend's test as a worker on each rank: every op and element
//! type at several sizes (0, 1, non-divisible, 64 MiB + 4 bytes: larger than a staging slot), checked against a
//! local reference.
use zerorun::runtime::comm::{Collectives, Communicator, Element, ReduceOp};

pub fn input(rank: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 13 + salt) % 17) as f32 - 8.0 + rank as f32 * 0.25).collect()
}

/// The reference: element `i` of every rank's input combined in rank order.
fn reduced(inputs: &[Vec<f32>], i: usize, op: ReduceOp) -> f32 {
    let vals = inputs.iter().map(|x| x[i]);
    match op {
        ReduceOp::Sum => vals.sum::<f32>(),
        ReduceOp::Avg => vals.sum::<f32>() / inputs.len() as f32,
        ReduceOp::Max => vals.fold(f32::NEG_INFINITY, f32::max),
    }
}

/// Every op at several sizes, checked on every rank; prints `conformance ok on rank R` at the end.
pub fn run(c: &dyn Communicator) {
    let (rank, world) = (c.rank(), c.world_size());
    for n in [0usize, 1, 7, 1000, 16_777_217] {
        for (salt, op) in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max].into_iter().enumerate() {
            let mut b = input(rank, n, salt);
            c.all_reduce(&mut b, op).unwrap();
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, n, salt)).collect();
            for (i, v) in b.iter().enumerate() {
                assert_eq!(*v, reduced(&inputs, i, op), "all_reduce {op:?} n {n} at {i}");
            }
        }
        let full = n - n % world;
        let part = full / world;
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, full, 5)).collect();
        let mut shard = vec![0f32; part];
        c.reduce_scatter(&inputs[rank], &mut shard, ReduceOp::Sum).unwrap();
        for i in 0..part {
            let e: f32 = inputs.iter().map(|x| x[rank * part + i]).sum();
            assert_eq!(shard[i], e, "reduce_scatter n {full} at {i}");
        }
        let mut gathered = vec![-1f32; full];
        gathered[rank * part..(rank + 1) * part].copy_from_slice(&inputs[rank][rank * part..(rank + 1) * part]);
        c.all_gather_in_place(&mut gathered).unwrap();
        for k in 0..world {
            assert_eq!(
                &gathered[k * part..(k + 1) * part],
                &inputs[k][k * part..(k + 1) * part],
                "all_gather part {k}"
            );
        }
        let mut b = if rank == world - 1 { input(99, n, 1) } else { vec![0f32; n] };
        c.broadcast(&mut b, world - 1).unwrap();
        assert_eq!(b, input(99, n, 1), "broadcast n {n}");
    }
    if c.prefers_shared_buffers() {
        shared_buffers(c);
    }
    check_dtype::<half::bf16>(c, half::bf16::from_f32);
    check_dtype::<half::f16>(c, half::f16::from_f32);
    check_dtype::<i64>(c, |x| (x * 4.0) as i64);
    // A size mismatch is an error on every rank, and the group stays usable.
    let mut b = vec![1f32; 4 + rank];
    let e = c.all_reduce(&mut b, ReduceOp::Sum);
    if world > 1 {
        assert!(e.unwrap_err().to_string().contains("buffer sizes differ between ranks"));
    }
    c.barrier().unwrap();
    one_bit(c);
    all_to_all(c);
    println!("conformance ok on rank {rank} (shared buffers {})", c.prefers_shared_buffers());
}

/// The same ops on buffers in the shm backend's shared region, which peers read through their mapping: on every
/// rank, then on even ranks only (peers of odd ranks fall back to process_vm_readv per peer).
fn shared_buffers(c: &dyn Communicator) {
    use zerorun::runtime::comm::region::SharedBuffer;
    let (rank, world) = (c.rank(), c.world_size());
    for everywhere in [true, false] {
        let in_region = everywhere || rank % 2 == 0;
        let alloc = |len: usize| -> (Option<SharedBuffer>, Vec<f32>) {
            if in_region {
                (Some(SharedBuffer::zeroed(len * 4)), Vec::new())
            } else {
                (None, vec![0f32; len])
            }
        };
        for n in [1000usize, 16_777_217] {
            let full = n - n % world;
            let part = full / world;
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, full, 7)).collect();
            let (mut mem, mut heap) = alloc(full);
            assert_eq!(
                mem.as_ref().is_some_and(|m| m.in_region()),
                in_region,
                "rank {rank}: the buffer is where it was asked to be"
            );
            let buf: &mut [f32] = match mem.as_mut() {
                Some(m) => m.as_slice_mut(),
                None => &mut heap,
            };
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                buf.copy_from_slice(&inputs[rank]);
                c.all_reduce(buf, op).unwrap();
                for (i, v) in buf.iter().enumerate() {
                    assert_eq!(
                        *v,
                        reduced(&inputs, i, op),
                        "shared all_reduce {op:?} n {full} at {i} (everywhere {everywhere})"
                    );
                }
            }
            buf.copy_from_slice(&inputs[rank]);
            let mut shard = vec![0f32; part];
            c.reduce_scatter(buf, &mut shard, ReduceOp::Sum).unwrap();
            for i in 0..part {
                let e: f32 = inputs.iter().map(|x| x[rank * part + i]).sum();
                assert_eq!(shard[i], e, "shared reduce_scatter n {full} at {i}");
            }
            buf.fill(-1.0);
            buf[rank * part..(rank + 1) * part].copy_from_slice(&inputs[rank][rank * part..(rank + 1) * part]);
            c.all_gather_in_place(buf).unwrap();
            for k in 0..world {
                assert_eq!(
                    &buf[k * part..(k + 1) * part],
                    &inputs[k][k * part..(k + 1) * part],
                    "shared all_gather part {k}"
                );
            }
            if rank == 0 {
                buf.copy_from_slice(&inputs[1 % world]);
            }
            c.broadcast(buf, 0).unwrap();
            assert_eq!(buf, &inputs[1 % world][..], "shared broadcast n {full}");
        }
    }
}

/// All-reduce and reduce-scatter of another element type, over more elements than a staging slot holds.
pub fn check_dtype<T: Element + PartialEq + std::fmt::Debug>(c: &dyn Communicator, make: fn(f32) -> T) {
    let (rank, world) = (c.rank(), c.world_size());
    let n = 9_000_000 - 9_000_000 % world;
    let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, n, 3).into_iter().map(make).collect()).collect();
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        let fold = |i: usize| {
            let mut acc = inputs[0][i];
            for x in &inputs[1..] {
                acc = if op == ReduceOp::Max { T::max(acc, x[i]) } else { T::add(acc, x[i]) };
            }
            if op == ReduceOp::Avg {
                T::div(acc, world)
            } else {
                acc
            }
        };
        let mut b = inputs[rank].clone();
        c.all_reduce(&mut b, op).unwrap();
        for (i, v) in b.iter().enumerate() {
            assert_eq!(*v, fold(i), "{:?} all_reduce {op:?} at {i}", T::DTYPE);
        }
        let part = n / world;
        let mut shard = vec![make(0.0); part];
        c.reduce_scatter(&inputs[rank], &mut shard, op).unwrap();
        for (i, v) in shard.iter().enumerate() {
            assert_eq!(*v, fold(rank * part + i), "{:?} reduce_scatter {op:?} at {i}", T::DTYPE);
        }
    }
}

/// The 1-bit all-reduce (`signs::all_reduce`, the 1-bit optimizers' exchange): bitwise what a one-process
/// simulation of every rank gives, over two calls (the second carrying the first's errors), at sizes that are and
/// are not whole words of every rank's part. Every backend runs the same arithmetic in the same order.
fn one_bit(c: &dyn Communicator) {
    use zerorun::runtime::comm::signs::{self, SignErrors};
    let (rank, world) = (c.rank(), c.world_size());
    for n in [1usize, 1000, 100_003] {
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, n, 11)).collect();
        let mut sim_errors: Vec<SignErrors> = (0..world).map(|_| SignErrors::new(n, world)).collect();
        let mut errors = SignErrors::new(n, world);
        for call in 0..2 {
            let mut expected = inputs.clone();
            signs::simulate(&mut expected, &mut sim_errors);
            let mut v = inputs[rank].clone();
            signs::all_reduce(c, &mut v, &mut errors.worker, &mut errors.server).unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(bits(&v) == bits(&expected[rank]), "1-bit all_reduce n {n} call {call}: not the simulation's bits");
        }
        assert_eq!(errors, sim_errors[rank], "1-bit all_reduce n {n}: error feedback");
    }
}

/// The all-to-all of equal parts, and of parts of every length (empty ones and 16 MiB ones among them): rank r sends
/// rank q `len(r, q)` elements valued by both; counts that disagree between two ranks are an error on every rank,
/// and the group stays usable.
fn all_to_all(c: &dyn Communicator) {
    let (rank, world) = (c.rank(), c.world_size());
    let value = |from: usize, to: usize, i: usize| (from * 1000 + to * 10) as f32 + (i % 7) as f32;
    let mut equal = vec![-1f32; 3 * world];
    let sent: Vec<f32> = (0..world).flat_map(|q| (0..3).map(move |i| value(rank, q, i))).collect();
    c.all_to_all_buf(zerorun::runtime::comm::BufRef::new(&sent), zerorun::runtime::comm::BufMut::new(&mut equal))
        .unwrap();
    let expected: Vec<f32> = (0..world).flat_map(|p| (0..3).map(move |i| value(p, rank, i))).collect();
    assert_eq!(equal, expected, "all_to_all of equal parts");
    for big in [false, true] {
        let len = |from: usize, to: usize| match (from + 2 * to) % 3 {
            0 => 0,
            1 => 5 + from,
            _ if big => (4 << 20) + to,
            _ => 1000 + to,
        };
        let send: Vec<usize> = (0..world).map(|q| len(rank, q)).collect();
        let recv: Vec<usize> = (0..world).map(|p| len(p, rank)).collect();
        let input: Vec<f32> = (0..world).flat_map(|q| (0..send[q]).map(move |i| value(rank, q, i))).collect();
        let mut output = vec![-1f32; recv.iter().sum()];
        c.all_to_all_v(&input, &send, &mut output, &recv).unwrap();
        let expected: Vec<f32> = (0..world).flat_map(|p| (0..recv[p]).map(move |i| value(p, rank, i))).collect();
        assert!(output == expected, "all_to_all_v (big {big}) on rank {rank}");
    }
    if world > 1 {
        // Rank 0 expects one element more from rank 1 than rank 1 sends.
        let send = vec![1usize; world];
        let mut recv = vec![1usize; world];
        if rank == 0 {
            recv[1] = 2;
        }
        let input = vec![0f32; world];
        let mut output = vec![0f32; recv.iter().sum()];
        let e = c.all_to_all_v(&input, &send, &mut output, &recv).unwrap_err().to_string();
        if rank <= 1 {
            assert!(e.contains("all_to_all") && e.contains(&format!("rank {rank}")), "{e}");
        }
        c.barrier().unwrap();
    }
}
