//! The group and point-to-point conformance suite, run on every rank by each backend's test (beside
//! conformance.rs): rings and pairs of every element type at sizes 0, 1, odd and 64 MiB, a mismatch that fails
//! both ends, splits and `new_group` whose groups pass the collective suite, their names in errors, and the
//! topology's groups. The including file declares `mod conformance;` too.
use zerorun::runtime::comm::topology::Topology;
use zerorun::runtime::comm::{Collectives, Communicator, Element, ReduceOp};

fn values<T: Element>(from: usize, to: usize, n: usize, make: fn(f32) -> T) -> Vec<T> {
    (0..n).map(|i| make(((i * 5 + from * 11 + to * 3) % 23) as f32 - 11.0)).collect()
}

/// Sends to the next rank and receives from the previous one (even ranks send first, so the rendezvous of a
/// blocking send never waits in a circle).
fn ring<T: Element + PartialEq + std::fmt::Debug + Default>(c: &dyn Communicator, n: usize, make: fn(f32) -> T) {
    let (rank, world) = (c.rank(), c.world_size());
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let out = values(rank, next, n, make);
    let mut got = vec![T::default(); n];
    if rank % 2 == 0 {
        c.send(&out, next).unwrap();
        c.recv(&mut got, prev).unwrap();
    } else {
        c.recv(&mut got, prev).unwrap();
        c.send(&out, next).unwrap();
    }
    assert_eq!(got, values(prev, rank, n, make), "ring of {n} elements on rank {rank}");
}

/// The same ring in one call: `send_recv` has both directions in flight where the backend can.
fn ring_in_one_call(c: &dyn Communicator, n: usize) {
    let (rank, world) = (c.rank(), c.world_size());
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let out = values(rank, next, n, |x| x);
    let mut got = vec![0f32; n];
    c.send_recv(&out, next, &mut got, prev).unwrap();
    assert_eq!(got, values(prev, rank, n, |x| x), "send_recv ring of {n} elements on rank {rank}");
}

/// Point-to-point: rings of every type and size, a pair exchanging back and forth, and a mismatch that is an
/// error on both ends while the group stays usable.
pub fn point_to_point(c: &dyn Communicator) {
    let (rank, world) = (c.rank(), c.world_size());
    if world < 2 {
        return;
    }
    for n in [0usize, 1, 7, 1001, 16 * 1024 * 1024 + 1] {
        ring::<f32>(c, n, |x| x);
    }
    ring::<half::bf16>(c, 1001, half::bf16::from_f32);
    ring::<half::f16>(c, 1001, half::f16::from_f32);
    ring::<i64>(c, 1001, |x| x as i64);
    for n in [0usize, 1, 1001, 16 * 1024 * 1024 + 1] {
        ring_in_one_call(c, n);
    }
    // A pair, many times over: each message is the one sent (no mixing across calls).
    if rank < 2 {
        let peer = 1 - rank;
        for round in 0..20 {
            let mine: Vec<f32> = (0..33).map(|i| (round * 100 + i + rank * 1000) as f32).collect();
            let mut theirs = vec![0f32; 33];
            if rank == 0 {
                c.send(&mine, peer).unwrap();
                c.recv(&mut theirs, peer).unwrap();
            } else {
                c.recv(&mut theirs, peer).unwrap();
                c.send(&mine, peer).unwrap();
            }
            let expect: Vec<f32> = (0..33).map(|i| (round * 100 + i + peer * 1000) as f32).collect();
            assert_eq!(theirs, expect, "pair round {round}");
        }
        // Sizes differ: both ends fail, naming both sides.
        let e = if rank == 0 { c.send(&[1f32; 4], 1) } else { c.recv(&mut [0f32; 5], 0) };
        let text = e.unwrap_err().to_string();
        assert!(
            text.contains("from rank 0 to rank 1: the send has 4 F32 elements and the receive expects 5 F32 elements"),
            "rank {rank}: {text}"
        );
        // So do types.
        let e = if rank == 0 { c.send(&[1f32; 4], 1) } else { c.recv(&mut [0i64; 4], 0) };
        assert!(e.unwrap_err().to_string().contains("the send has 4 F32 elements and the receive expects 4 I64"));
        // In one call too: rank 1 expects 5 of rank 0's 4, and both ends fail naming that direction.
        let (mine, mut theirs) = ([1f32; 4], vec![0f32; 4 + rank]);
        let text = c.send_recv(&mine, peer, &mut theirs, peer).unwrap_err().to_string();
        assert!(
            text.contains("from rank 0 to rank 1: the send has 4 F32 elements and the receive expects 5 F32 elements"),
            "rank {rank}: {text}"
        );
    }
    let e = c.send(&[1f32], rank).unwrap_err().to_string();
    assert!(e.contains("cannot send to or from itself"), "{e}");
    c.barrier().unwrap();
}

/// Splits and new groups: each group passes the collective and point-to-point suites, knows its size, order and
/// name, and names itself in its errors.
pub fn groups(c: &dyn Communicator) {
    let (rank, world) = (c.rank(), c.world_size());
    // By parity, ranked in reverse.
    let g = c.split(Some((rank % 2) as u32), -(rank as i64)).unwrap().expect("every rank has a color");
    let members: Vec<usize> = (0..world).filter(|r| r % 2 == rank % 2).rev().collect();
    assert_eq!(g.world_size(), members.len());
    assert_eq!(g.rank(), members.iter().position(|&r| r == rank).unwrap());
    assert_eq!(g.group_name(), format!("world/color{}", rank % 2));
    // The group's sum is over its members only.
    let mut v = [rank as f32];
    g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v[0], members.iter().sum::<usize>() as f32);
    super::conformance::run(g.as_ref());
    point_to_point(g.as_ref());
    // An error inside the group names it.
    if g.world_size() > 1 {
        let mut b = vec![0f32; 2 + g.rank()];
        let e = g.all_reduce(&mut b, ReduceOp::Sum).unwrap_err().to_string();
        assert!(e.starts_with(&format!("group world/color{}: ", rank % 2)), "{e}");
    }
    // A group of some ranks, listed last first; the others get none.
    let listed: Vec<usize> = if world > 1 { vec![world - 1, 0] } else { vec![0] };
    match c.new_group(&listed).unwrap() {
        Some(h) => {
            assert!(listed.contains(&rank));
            assert_eq!(h.rank(), listed.iter().position(|&r| r == rank).unwrap());
            assert_eq!(h.group_name(), format!("world{listed:?}").replace(' ', ""));
            let mut v = [rank as f32 + 1.0];
            h.all_reduce(&mut v, ReduceOp::Max).unwrap();
            assert_eq!(v[0], world as f32);
            // A group of a group.
            let inner = h.split(Some(0), 0).unwrap().unwrap();
            assert_eq!(inner.world_size(), h.world_size());
            assert!(inner.group_name().starts_with(&h.group_name()), "{}", inner.group_name());
            inner.barrier().unwrap();
        }
        None => assert!(!listed.contains(&rank)),
    }
    // A group of three (at world size 4: one rank left out) passes the collective suite too.
    if world == 4 {
        match c.new_group(&[0, 1, 2]).unwrap() {
            Some(three) => {
                assert_eq!(three.world_size(), 3);
                super::conformance::run(three.as_ref());
            }
            None => assert_eq!(rank, 3),
        }
    }
    // Ranks that join no group get none, the others theirs.
    let only_first = c.split((rank == 0).then_some(7), 0).unwrap();
    assert_eq!(only_first.is_some(), rank == 0);
    // A bad list is an error on every rank.
    let e = c.new_group(&[0, 0]).err().expect("a list with a rank twice is an error").to_string();
    assert!(e.contains("rank 0 is listed twice"), "{e}");
    // The topology's groups: with 4 ranks, data-parallel pairs inside model-parallel pairs.
    if world == 4 {
        let t = Topology::new(&[("data", 2), ("model", 2)]).unwrap();
        let data = t.communicator(c, &["data"]).unwrap();
        assert_eq!(data.world_size(), 2);
        assert_eq!(data.group_name(), format!("world/data(model={})", rank % 2));
        let mut v = [rank as f32];
        data.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v[0], (rank % 2 + rank % 2 + 2) as f32);
        let model = t.communicator(c, &["model"]).unwrap();
        let mut v = [rank as f32];
        model.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v[0], ((rank / 2) * 4 + 1) as f32);
        let e = Topology::new(&[("data", 3)])
            .unwrap()
            .communicator(c, &["data"])
            .err()
            .expect("a topology of 3 on 4 ranks is an error")
            .to_string();
        assert!(e.contains("multiply to 3 ranks, but the world has 4"), "{e}");
    }
    c.barrier().unwrap();
    println!("groups ok on rank {rank}");
}
