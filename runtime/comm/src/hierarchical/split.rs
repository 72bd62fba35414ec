//! Which level a sub-group of a two-level communicator runs at: inside a host (the host's group), across hosts at
//! one place (the cross-host group), whole hosts (two levels itself), or the flat group for anything else.
use super::Hierarchical;
use crate::groups::Split;
use crate::{CommResult, Communicator};

impl Hierarchical {
    /// Groups inside hosts split the host's group (shared memory: MiCS's shard group of a host's ranks), groups of
    /// ranks with one place on their hosts split the cross-host group (its replicas), groups of whole hosts (an
    /// expert-parallel group of E = 2K adjacent ranks) are two-level themselves (the flat group's split, this host's
    /// ranks inside and the group's hosts across), and any other splits the flat group. Every rank decides alike
    /// from the colors.
    pub(super) fn split_by_level(&self, split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        match level_of(split, self.per_host()) {
            Some(Level::InHost) => self.local.split_group(&restrict(split, true, self.per_host(), self.world.rank())),
            Some(Level::AcrossHosts) => {
                self.cross.split_group(&restrict(split, false, self.per_host(), self.world.rank()))
            }
            Some(Level::WholeHosts) => self.split_whole_hosts(split),
            None => self.world.split_group(split),
        }
    }

    /// [`Communicator::split_group`] of groups that are whole hosts: every rank splits the flat group, its host's
    /// group (whole) and its cross-host group (the group's hosts), so the new group runs in two levels too. A
    /// group whose ranks the keys put out of host order keeps the flat split alone.
    fn split_whole_hosts(&self, split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        let (k, rank) = (self.per_host(), self.world.rank());
        let (host, place) = (rank / k, rank % k);
        let world = self.world.split_group(split)?;
        let color = split.colors[rank];
        let inside = Split {
            colors: split.colors[host * k..(host + 1) * k].to_vec(),
            members: if color.is_some() { (0..k).collect() } else { Vec::new() },
            rank: if color.is_some() { place } else { 0 },
            name: format!("{}.inside", split.name),
            id: split.id,
        };
        let hosts: Vec<usize> = split.members.iter().filter(|&&r| r % k == place).map(|&r| r / k).collect();
        let across = Split {
            colors: (0..self.hosts()).map(|g| split.colors[g * k + place]).collect(),
            rank: hosts.iter().position(|&g| g == host).unwrap_or(0),
            members: hosts,
            // Every place's cross-host group meets apart on the job's store (the same color at every place).
            name: format!("{}.across{place}", split.name),
            id: split.id,
        };
        let local = self.local.split_group(&inside)?;
        let cross = self.cross.split_group(&across)?;
        let in_host_order = split.members.windows(2).all(|w| w[0] < w[1]);
        match (world, local, cross) {
            (Some(world), Some(local), Some(cross)) if in_host_order && local.world_size() > 1 => {
                let two = Hierarchical::new(world, local, cross)?;
                tracing::info!(
                    rank = two.rank(),
                    group = %split.name,
                    hosts = two.hosts(),
                    per_host = k,
                    two_level_all_to_all = self.two_level_all_to_all,
                    "a group of whole hosts: two levels"
                );
                Ok(Some(Box::new(two.with_two_level_all_to_all(self.two_level_all_to_all))))
            }
            (world, _, _) => Ok(world),
        }
    }
}

/// Which level a split's groups all lie in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    /// Every group's ranks are on one host.
    InHost,
    /// Every group's ranks have one place on their hosts (each on another host).
    AcrossHosts,
    /// Every host's ranks are in one group (or none): each group is whole hosts.
    WholeHosts,
}

/// The level every group of `split` lies in (ranks are `per_host` to a host), or None when they span both.
fn level_of(split: &Split, per_host: usize) -> Option<Level> {
    let same = |key: &dyn Fn(usize) -> usize| {
        let mut first: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        split.colors.iter().enumerate().all(|(r, c)| match c {
            Some(c) => *first.entry(*c).or_insert_with(|| key(r)) == key(r),
            None => true,
        })
    };
    if same(&|r| r / per_host) {
        Some(Level::InHost)
    } else if same(&|r| r % per_host) {
        Some(Level::AcrossHosts)
    } else if split.colors.chunks(per_host).all(|host| host.iter().all(|c| *c == host[0])) {
        Some(Level::WholeHosts)
    } else {
        None
    }
}

/// `split` as the split of the host's group holding `rank` (`in_host`) or of its cross-host group, its ranks
/// numbered in that group.
fn restrict(split: &Split, in_host: bool, per_host: usize, rank: usize) -> Split {
    let (host, place) = (rank / per_host, rank % per_host);
    let (parents, index): (Vec<usize>, fn(usize, usize) -> usize) = match in_host {
        true => ((host * per_host..(host + 1) * per_host).collect(), |r, k| r % k),
        false => ((place..split.colors.len()).step_by(per_host).collect(), |r, k| r / k),
    };
    Split {
        colors: parents.iter().map(|&r| split.colors[r]).collect(),
        members: split.members.iter().map(|&r| index(r, per_host)).collect(),
        rank: split.rank,
        name: split.name.clone(),
        id: split.id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hierarchical::tests::on_ranks;
    use crate::{Collectives, ReduceOp};

    #[test]
    fn splits_inside_hosts_or_across_them_use_that_level() {
        let split = |colors: Vec<Option<u32>>, rank: usize| {
            let mine = colors[rank];
            let members: Vec<usize> = (0..colors.len()).filter(|&r| mine.is_some() && colors[r] == mine).collect();
            let at = members.iter().position(|&r| r == rank).unwrap_or(0);
            Split { colors, members, rank: at, name: "g".into(), id: 7 }
        };
        // 3 hosts x 2: a color per host, a color per place, and groups that span both.
        let by_host: Vec<Option<u32>> = (0..6).map(|r| Some(r as u32 / 2)).collect();
        let by_place: Vec<Option<u32>> = (0..6).map(|r| Some(r as u32 % 2)).collect();
        let mixed: Vec<Option<u32>> = (0..6).map(|r| Some(r as u32 % 3)).collect();
        assert_eq!(level_of(&split(by_host.clone(), 3), 2), Some(Level::InHost));
        assert_eq!(level_of(&split(by_place.clone(), 3), 2), Some(Level::AcrossHosts));
        assert_eq!(level_of(&split(mixed, 3), 2), None);
        let two_hosts: Vec<Option<u32>> = (0..6).map(|r| Some(u32::from(r >= 4))).collect();
        assert_eq!(level_of(&split(two_hosts, 3), 2), Some(Level::WholeHosts));
        // Rank 3 is place 1 of host 1: its host's group numbers it 1, its cross-host group 1.
        let within = restrict(&split(by_host, 3), true, 2, 3);
        assert_eq!((within.colors, within.members, within.rank), (vec![Some(1), Some(1)], vec![0, 1], 1));
        let across = restrict(&split(by_place, 3), false, 2, 3);
        assert_eq!((across.colors, across.members, across.rank), (vec![Some(1); 3], vec![0, 1, 2], 1));
        // Ranks left out of every group do not decide the level.
        let some: Vec<Option<u32>> = (0..6).map(|r| (r != 2).then_some(r as u32 / 2)).collect();
        assert_eq!(level_of(&split(some, 0), 2), Some(Level::InHost));
    }

    #[test]
    fn groups_split_by_host_and_by_place_reduce_over_their_members() {
        let sums = on_ranks(3, 2, |two, _| {
            let r = two.rank();
            let host = two.split(Some(r as u32 / 2), r as i64).unwrap().unwrap();
            let place = two.split(Some(r as u32 % 2), r as i64).unwrap().unwrap();
            let mixed = two.split(Some(r as u32 % 3), r as i64).unwrap().unwrap();
            let mut sums = Vec::new();
            for g in [&host, &place, &mixed] {
                let mut v = [r as f32];
                g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                sums.push((g.rank(), g.world_size(), v[0]));
            }
            sums
        });
        for (r, s) in sums.iter().enumerate() {
            let host_sum = (r / 2 * 2) as f32 * 2.0 + 1.0;
            let place_sum = (0..3).map(|h| (h * 2 + r % 2) as f32).sum::<f32>();
            let mixed_sum = (r % 3 + r % 3 + 3) as f32;
            assert_eq!(s, &vec![(r % 2, 2, host_sum), (r / 2, 3, place_sum), (r / 3, 2, mixed_sum)], "rank {r}");
        }
    }

    /// Groups of whole hosts (4 hosts x 2 in groups of two hosts, as an expert-parallel group of 4 adjacent ranks
    /// is) run in two levels themselves, and their all-to-all and all-reduce give the flat results.
    #[test]
    fn groups_of_whole_hosts_are_two_level_groups() {
        let results = on_ranks(4, 2, |two, _| {
            let r = two.rank();
            let g = two.split(Some(r as u32 / 4), r as i64).unwrap().unwrap();
            let mut v = [r as f32];
            g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            let send = vec![r + 1; 4];
            let recv: Vec<usize> = (0..4).map(|s| r / 4 * 4 + s + 1).collect();
            let input: Vec<f32> = (0..4).flat_map(|d| vec![(r * 10 + d) as f32; r + 1]).collect();
            let mut out = vec![0f32; recv.iter().sum()];
            g.all_to_all_v(&input, &send, &mut out, &recv).unwrap();
            (g.rank(), g.world_size(), g.host_layout(), v[0], out)
        });
        for (r, (rank, size, layout, sum, out)) in results.into_iter().enumerate() {
            let first = r / 4 * 4;
            assert_eq!((rank, size, layout), (r % 4, 4, Some((r % 2, 2))), "rank {r}: a two-level group of 2 x 2");
            assert_eq!(sum, (first..first + 4).sum::<usize>() as f32);
            let want: Vec<f32> = (first..first + 4).flat_map(|s| vec![(s * 10 + r % 4) as f32; s + 1]).collect();
            assert_eq!(out, want, "rank {r}'s all-to-all");
        }
    }

    /// Hosts 0 and 2 of 3 in one group, host 1 in none: a two-level group of 2 hosts, and no group on host 1. The
    /// same hosts keyed in reverse order are not numbered host by host: a flat group.
    #[test]
    fn whole_hosts_left_out_get_no_group_and_reversed_keys_stay_flat() {
        let results = on_ranks(3, 2, |two, _| {
            let r = two.rank();
            let color = (r / 2 != 1).then_some(0);
            let ordered = two.split(color, r as i64).unwrap();
            let reversed = two.split(color, -(r as i64)).unwrap();
            let layout =
                |g: &Option<Box<dyn Communicator>>| g.as_ref().map(|g| (g.rank(), g.world_size(), g.host_layout()));
            let mut v = [r as f32];
            if let Some(g) = &ordered {
                g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            }
            (layout(&ordered), layout(&reversed), v[0])
        });
        for (r, (ordered, reversed, sum)) in results.into_iter().enumerate() {
            if r / 2 == 1 {
                assert_eq!((ordered, reversed), (None, None), "rank {r} is on the host left out");
                continue;
            }
            let at = if r < 2 { r } else { r - 2 };
            assert_eq!(ordered, Some((at, 4, Some((r % 2, 2)))), "rank {r}: two levels of 2 hosts x 2");
            assert_eq!(reversed, Some((3 - at, 4, None)), "rank {r}: reversed keys, a flat group");
            assert_eq!(sum, [0, 1, 4, 5].iter().sum::<usize>() as f32, "the sum over ranks 0, 1, 4 and 5");
        }
    }
}
