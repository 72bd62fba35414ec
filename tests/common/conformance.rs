//! The collective conformance suite, run by every backend's test as a worker on each rank: every op and element
//! type at several sizes (0, 1, non-divisible, 64 MiB + 4 bytes: larger than a staging slot), checked against a
//! local reference.
use zerorun::runtime::comm::{Collectives, Communicator, Element, ReduceOp};

pub fn input(rank: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 13 + salt) % 17) as f32 - 8.0 + rank as f32 * 0.25).collect()
}


/// Every op at several sizes, checked on every rank; prints `conformance ok on rank R` at the end.
pub fn run(c: &dyn Communicator) {
    let (rank, world) = (c.rank(), c.world_size());
    for n in [0usize, 1, 7, 1000, 16_777_217] {
        for (salt, op) in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max].into_iter().enumerate() {
            let mut b = input(rank, n, salt);
            c.all_reduce(&mut b, op).unwrap();
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, n, salt)).collect();
            for i in 0..n {
                let vals = inputs.iter().map(|x| x[i]);
                let e = match op {
                    ReduceOp::Sum => vals.sum::<f32>(),
                    ReduceOp::Avg => vals.sum::<f32>() / world as f32,
                    ReduceOp::Max => vals.fold(f32::NEG_INFINITY, f32::max),
                };
                assert_eq!(b[i], e, "all_reduce {op:?} n {n} at {i}");
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
            assert_eq!(&gathered[k * part..(k + 1) * part], &inputs[k][k * part..(k + 1) * part], "all_gather part {k}");
        }
        let mut b = if rank == world - 1 { input(99, n, 1) } else { vec![0f32; n] };
        c.broadcast(&mut b, world - 1).unwrap();
        assert_eq!(b, input(99, n, 1), "broadcast n {n}");
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
    println!("conformance ok on rank {rank}");
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

