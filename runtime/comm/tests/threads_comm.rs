//! The threads backend against a straightforward local reference: every op, world sizes 1-4, sizes 0, 1,
//! non-divisible and large; size mismatches and departed ranks are errors, never hangs.
use std::time::Duration;

use zerorun_comm::threads::group;
use zerorun_comm::{Collectives, CommError, Communicator, Dtype, Element, ReduceOp};

fn input(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 13) % 17) as f32 - 8.0 + rank as f32 * 0.25).collect()
}

fn on_ranks<T: Send>(world: usize, f: impl Fn(&dyn Communicator) -> T + Sync) -> Vec<T> {
    let comms = group(world, Duration::from_secs(20));
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(&c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn all_reduce_matches_the_reference() {
    for world in 1..=4 {
        for n in [0usize, 1, 7, 1000, 1 << 20] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let out = on_ranks(world, |c| {
                    let mut b = input(c.rank(), n);
                    c.all_reduce(&mut b, op).unwrap();
                    b
                });
                let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, n)).collect();
                let expect: Vec<f32> = (0..n)
                    .map(|i| {
                        let vals: Vec<f32> = inputs.iter().map(|x| x[i]).collect();
                        match op {
                            ReduceOp::Sum => vals.iter().sum(),
                            ReduceOp::Avg => vals.iter().sum::<f32>() / world as f32,
                            ReduceOp::Max => vals.iter().copied().fold(f32::NEG_INFINITY, f32::max),
                        }
                    })
                    .collect();
                for o in out {
                    assert_eq!(o, expect, "world {world}, n {n}, {op:?}");
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_all_gather_and_broadcast() {
    for world in 1..=4 {
        let part = 5;
        let n = part * world;
        let out = on_ranks(world, |c| {
            let mut shard = vec![0f32; part];
            c.reduce_scatter(&input(c.rank(), n), &mut shard, ReduceOp::Sum).unwrap();
            let mut full = vec![-1f32; n];
            full[c.rank() * part..(c.rank() + 1) * part].copy_from_slice(&shard);
            c.all_gather_in_place(&mut full).unwrap();
            let mut b = if c.rank() == world - 1 { vec![42f32; 3] } else { vec![0f32; 3] };
            c.broadcast(&mut b, world - 1).unwrap();
            c.barrier().unwrap();
            (full, b)
        });
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, n)).collect();
        let sum: Vec<f32> = (0..n).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
        for (full, b) in out {
            assert_eq!(full, sum, "reduce-scatter then all-gather is an all-reduce (world {world})");
            assert_eq!(b, vec![42f32; 3]);
        }
    }
}

#[test]
fn size_mismatch_is_an_error_on_every_rank() {
    let out = on_ranks(3, |c| {
        let mut b = vec![1f32; 4 + c.rank()];
        c.all_reduce(&mut b, ReduceOp::Sum).unwrap_err()
    });
    for (rank, e) in out.into_iter().enumerate() {
        assert_eq!(e, CommError::SizeMismatch { op: "all_reduce", rank, sizes: vec![4, 5, 6] });
    }
}

#[test]
fn a_departed_rank_is_named_not_waited_for() {
    let comms = group(3, Duration::from_secs(30));
    let start = std::time::Instant::now();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    if c.rank() == 1 {
                        drop(c); // rank 1 dies before the collective
                        return String::new();
                    }
                    let mut b = vec![0f32; 8];
                    c.all_reduce(&mut b, ReduceOp::Sum).unwrap_err().to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(start.elapsed() < Duration::from_secs(5), "survivors must not wait for the timeout");
    assert!(errs[0].starts_with("all_reduce on rank 0: rank 1 left the group"), "{}", errs[0]);
    assert!(errs[2].starts_with("all_reduce on rank 2: rank 1 left the group"), "{}", errs[2]);
}

#[test]
fn a_missing_rank_times_out_with_the_op_and_ranks() {
    let mut comms = group(2, Duration::from_millis(300));
    let _silent = comms.pop().unwrap();
    let c = comms.pop().unwrap();
    match c.barrier().unwrap_err() {
        CommError::Timeout { op, rank, missing, waited } => {
            assert_eq!((op, rank, missing), ("barrier", 0, vec![1]));
            assert!(waited >= Duration::from_millis(300));
        }
        other => panic!("{other}"),
    }
}

/// Reference combination in rank order with the element type's own arithmetic.
fn reference<T: Element>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    (0..inputs[0].len())
        .map(|i| {
            let mut acc = inputs[0][i];
            for x in &inputs[1..] {
                acc = if op == ReduceOp::Max { T::max(acc, x[i]) } else { T::add(acc, x[i]) };
            }
            if op == ReduceOp::Avg {
                T::div(acc, inputs.len())
            } else {
                acc
            }
        })
        .collect()
}

fn check_dtype<T: Element + PartialEq + std::fmt::Debug>(make: fn(f32) -> T) {
    for world in 1..=4 {
        let n = 1003;
        let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, n).into_iter().map(make).collect()).collect();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let out = on_ranks(world, |c| {
                let mut b = inputs[c.rank()].clone();
                c.all_reduce(&mut b, op).unwrap();
                b
            });
            let expect = reference(&inputs, op);
            for o in out {
                assert_eq!(o, expect, "{:?} world {world} {op:?}", T::DTYPE);
            }
        }
    }
    // A different element type on one rank is an error on every rank.
    let out = on_ranks(2, |c| {
        if c.rank() == 0 {
            c.all_reduce(&mut [make(1.0); 4], ReduceOp::Sum).unwrap_err()
        } else {
            c.all_reduce(&mut [1f32; 4], ReduceOp::Sum).unwrap_err()
        }
    });
    assert!(matches!(&out[0], CommError::DtypeMismatch { .. }) || T::DTYPE == Dtype::F32, "{:?}", out[0]);
}

#[test]
fn every_element_type_reduces_like_the_reference() {
    check_dtype::<half::bf16>(half::bf16::from_f32);
    check_dtype::<half::f16>(half::f16::from_f32);
    check_dtype::<i64>(|x| (x * 4.0) as i64);
}

#[test]
fn async_collectives_run_in_order_while_the_caller_works() {
    use zerorun_comm::async_comm::CommThread;
    let comms = group(3, Duration::from_secs(20));
    let results: Vec<(Vec<f32>, Vec<f32>, bool)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let rank = c.rank();
                    let t = CommThread::spawn(Box::new(c));
                    let a = t.all_reduce(input(rank, 3000), ReduceOp::Sum);
                    let b = t.all_gather({
                        let mut v = vec![0f32; 9];
                        v[rank * 3..rank * 3 + 3].copy_from_slice(&[rank as f32; 3]);
                        v
                    });
                    // Work on the caller's thread while both are queued or running.
                    let busy: f64 = (0..100_000).map(|i| (i as f64).sqrt()).sum();
                    let mut b = b;
                    while !b.is_done() {
                        std::thread::yield_now();
                    }
                    (a.wait().unwrap(), b.wait().unwrap(), busy > 0.0)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let inputs: Vec<Vec<f32>> = (0..3).map(|r| input(r, 3000)).collect();
    let sum: Vec<f32> = (0..3000).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
    for (a, b, worked) in results {
        assert_eq!(a, sum);
        assert_eq!(b, vec![0., 0., 0., 1., 1., 1., 2., 2., 2.]);
        assert!(worked);
    }
}

#[test]
fn async_wait_timeout_hands_the_pending_collective_back() {
    use zerorun_comm::async_comm::CommThread;
    let mut comms = group(2, Duration::from_secs(20));
    let late = comms.pop().unwrap();
    let t = CommThread::spawn(Box::new(comms.pop().unwrap()));
    let h = t.all_reduce(vec![1f32; 4], ReduceOp::Sum);
    // Rank 1 has not joined: the handle comes back unfinished.
    let h = match h.wait_timeout(Duration::from_millis(100)) {
        Err(h) => h,
        Ok(r) => panic!("finished without its peer: {r:?}"),
    };
    let peer = std::thread::spawn(move || {
        let mut b = vec![2f32; 4];
        late.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        b
    });
    assert_eq!(h.wait().unwrap(), vec![3f32; 4]);
    assert_eq!(peer.join().unwrap(), vec![3f32; 4]);
}
