//! Thread ranks laid out as hosts, for the tests of what runs across hosts.
#![allow(dead_code)]
use std::time::Duration;

use zerorun::runtime::comm::hierarchical::Hierarchical;
use zerorun::runtime::comm::{threads, Communicator};

/// `hosts` x `per_host` thread ranks whose collectives (and splits) run in two levels, as across hosts: a thread
/// group per host inside, one per place on the hosts across.
pub fn two_level_comms(hosts: usize, per_host: usize) -> Vec<Box<dyn Communicator>> {
    let t = Duration::from_secs(60);
    let n = hosts * per_host;
    let mut worlds: Vec<Option<_>> = threads::group(n, t).into_iter().map(Some).collect();
    let mut locals: Vec<Option<_>> = (0..hosts).flat_map(|_| threads::group(per_host, t)).map(Some).collect();
    let mut crosses: Vec<Vec<Option<_>>> =
        (0..per_host).map(|_| threads::group(hosts, t).into_iter().map(Some).collect()).collect();
    (0..n)
        .map(|r| {
            let (world, local) = (worlds[r].take().unwrap(), locals[r].take().unwrap());
            let cross = crosses[r % per_host][r / per_host].take().unwrap();
            Box::new(Hierarchical::new(Box::new(world), Box::new(local), Box::new(cross)).unwrap())
                as Box<dyn Communicator>
        })
        .collect()
}
