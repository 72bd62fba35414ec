//! Groups and point-to-point on thread ranks (the shm and MPI backends run the same suite in shm_comm.rs and
//! mpi_comm.rs): world sizes 1-4, and two groups used at once from two threads of every rank.
use std::time::Duration;

use zerorun::runtime::comm::threads::group;
use zerorun::runtime::comm::{Collectives, Communicator, ReduceOp};

#[path = "common/conformance.rs"]
mod conformance;
#[path = "common/groups.rs"]
mod groups;

fn on_ranks(world: usize, f: impl Fn(&dyn Communicator) + Sync) {
    let comms = group(world, Duration::from_secs(60));
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(&c))
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
}

#[test]
fn threads_point_to_point_and_groups_at_world_sizes_1_to_4() {
    for world in 1..=4 {
        on_ranks(world, |c| {
            groups::point_to_point(c);
            groups::groups(c);
        });
    }
}

#[test]
fn two_groups_used_at_once_from_two_threads_never_mix() {
    on_ranks(4, |c| {
        let rank = c.rank();
        let pairs = c.split(Some((rank / 2) as u32), rank as i64).unwrap().unwrap();
        let everyone = c.new_group(&[0, 1, 2, 3]).unwrap().unwrap();
        std::thread::scope(|s| {
            s.spawn(move || {
                for i in 0..200 {
                    let mut v = vec![(rank + i) as f32; 1000];
                    pairs.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                    let pair: usize = (0..4).filter(|r| r / 2 == rank / 2).map(|r| r + i).sum();
                    assert!(v.iter().all(|&x| x == pair as f32), "pairs round {i}");
                    let peer = rank ^ 1;
                    let mut got = [0f32; 3];
                    if rank % 2 == 0 {
                        pairs.send(&[i as f32; 3], pairs.rank() ^ 1).unwrap();
                        pairs.recv(&mut got, pairs.rank() ^ 1).unwrap();
                    } else {
                        pairs.recv(&mut got, pairs.rank() ^ 1).unwrap();
                        pairs.send(&[i as f32; 3], pairs.rank() ^ 1).unwrap();
                    }
                    assert_eq!(got, [i as f32; 3], "pair message {i} from {peer}");
                }
            });
            s.spawn(move || {
                for i in 0..200 {
                    let mut v = vec![(rank * 10 + i) as f32; 777];
                    everyone.all_reduce(&mut v, ReduceOp::Max).unwrap();
                    assert!(v.iter().all(|&x| x == (30 + i) as f32), "everyone round {i}");
                }
            });
        });
        c.barrier().unwrap();
    });
}

#[test]
fn a_peer_that_leaves_is_named_by_the_waiting_receive() {
    let mut comms = group(2, Duration::from_secs(30));
    let second = comms.pop().unwrap();
    let first = comms.pop().unwrap();
    drop(second);
    let e = first.recv(&mut [0f32; 4], 1).unwrap_err().to_string();
    assert!(e.contains("recv on rank 0: rank 1 left the group"), "{e}");
    let e = first.send(&[0f32; 4], 1).unwrap_err().to_string();
    assert!(e.contains("send on rank 0: rank 1 left the group"), "{e}");
}

#[test]
fn a_receive_with_no_send_times_out_naming_the_peer() {
    let comms = group(2, Duration::from_millis(300));
    let e = comms[0].recv(&mut [0f32; 4], 1).unwrap_err().to_string();
    assert!(e.contains("recv on rank 0: timed out after") && e.contains("waiting for ranks [1]"), "{e}");
}
