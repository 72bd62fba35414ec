//! Ranks laid out over named axes, row-major with the last axis fastest, as DeepSpeed's `ProcessTopology`:
//! `Topology::new(&[("pipe", 2), ("data", 2), ("model", 2)])` puts ranks 0 and 1 in one model-parallel pair, ranks
//! 0 and 2 in one data-parallel pair, ranks 0 and 4 in one pipeline. Putting the tensor-parallel axis last keeps its
//! ranks adjacent, so `zerorun launch` places them on one host. Pure arithmetic: the groups a rank joins along an
//! axis (or several) are lists of ranks, which the communicators turn into sub-groups.
use std::fmt;

use super::{groups, CommError, CommResult, Communicator};

/// A topology that cannot be built or does not fit: names the axes and numbers involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error("topology {axes}: the axes multiply to {product} ranks, but the world has {world_size}")]
    /// The axes' sizes do not multiply to the world size.
    Size {
        /// The axes, as given.
        axes: String,
        /// Their product.
        product: usize,
        /// The world's ranks.
        world_size: usize,
    },
    #[error("topology {axes}: no axis `{axis}`")]
    /// An axis named that is not one of the topology's.
    UnknownAxis {
        /// The axes.
        axes: String,
        /// The name asked for.
        axis: String,
    },
    #[error("topology {axes}: axis `{axis}` {what}")]
    /// An axis given wrongly (size 0, named twice).
    Axis {
        /// The axes.
        axes: String,
        /// The axis.
        axis: String,
        /// What is wrong.
        what: String,
    },
    #[error("topology {axes}: rank {rank} is not below {world_size}")]
    /// A rank outside the world.
    Rank {
        /// The axes.
        axes: String,
        /// The rank.
        rank: usize,
        /// The world's ranks.
        world_size: usize,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
/// Ranks laid out over named axes, the last fastest (DeepSpeed's ProcessTopology): coordinates, and the group of every rank that shares the other axes' coordinates.
pub struct Topology {
    axes: Vec<(String, usize)>,
}

impl fmt::Display for Topology {
    /// `pipe=2 x data=2 x model=2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.axes.iter().map(|(n, s)| format!("{n}={s}")).collect();
        write!(f, "{}", parts.join(" x "))
    }
}

impl Topology {
    /// Axes in order, the last fastest. Every axis has a distinct name and at least one rank.
    pub fn new(axes: &[(&str, usize)]) -> Result<Topology, TopologyError> {
        let t = Topology { axes: axes.iter().map(|(n, s)| (n.to_string(), *s)).collect() };
        for (i, (name, size)) in t.axes.iter().enumerate() {
            let bad = |what: &str| TopologyError::Axis { axes: t.to_string(), axis: name.clone(), what: what.into() };
            if *size == 0 {
                return Err(bad("has no rank"));
            }
            if t.axes[..i].iter().any(|(n, _)| n == name) {
                return Err(bad("is given twice"));
            }
        }
        Ok(t)
    }

    /// The ranks the axes describe (their product).
    pub fn size(&self) -> usize {
        self.axes.iter().map(|(_, s)| s).product()
    }

    /// The axes' product must be the world size.
    pub fn check_world_size(&self, world_size: usize) -> Result<(), TopologyError> {
        if self.size() == world_size {
            return Ok(());
        }
        Err(TopologyError::Size { axes: self.to_string(), product: self.size(), world_size })
    }

    /// The axes by name and size, in order.
    pub fn axes(&self) -> impl Iterator<Item = (&str, usize)> {
        self.axes.iter().map(|(n, s)| (n.as_str(), *s))
    }

    fn axis(&self, name: &str) -> Result<usize, TopologyError> {
        self.axes
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| TopologyError::UnknownAxis { axes: self.to_string(), axis: name.into() })
    }

    fn check_rank(&self, rank: usize) -> Result<(), TopologyError> {
        if rank < self.size() {
            return Ok(());
        }
        Err(TopologyError::Rank { axes: self.to_string(), rank, world_size: self.size() })
    }

    /// `rank`'s coordinate on every axis, in axis order.
    pub fn coordinates(&self, rank: usize) -> Result<Vec<usize>, TopologyError> {
        self.check_rank(rank)?;
        let mut rest = rank;
        let mut out = vec![0; self.axes.len()];
        for (i, (_, size)) in self.axes.iter().enumerate().rev() {
            out[i] = rest % size;
            rest /= size;
        }
        Ok(out)
    }

    /// `rank`'s coordinate on `axis`.
    pub fn coordinate(&self, rank: usize, axis: &str) -> Result<usize, TopologyError> {
        let i = self.axis(axis)?;
        Ok(self.coordinates(rank)?[i])
    }

    /// The rank at `coordinates` (one per axis, by name, every axis given).
    pub fn rank_at(&self, coordinates: &[(&str, usize)]) -> Result<usize, TopologyError> {
        let mut rank = 0;
        for (name, size) in &self.axes {
            let at = coordinates.iter().find(|(n, _)| n == name).map(|(_, c)| *c).ok_or_else(|| {
                TopologyError::Axis { axes: self.to_string(), axis: name.clone(), what: "has no coordinate".into() }
            })?;
            if at >= *size {
                return Err(TopologyError::Axis {
                    axes: self.to_string(),
                    axis: name.clone(),
                    what: format!("has {size} ranks; coordinate {at} is outside"),
                });
            }
            rank = rank * size + at;
        }
        for (name, _) in coordinates {
            self.axis(name)?;
        }
        Ok(rank)
    }

    /// The ranks that share `rank`'s coordinates on every axis but `axes`, in rank order: its group along them
    /// (along `data`: its data-parallel group; along `data` and `model`: every rank of its pipeline stage).
    pub fn group_of(&self, rank: usize, axes: &[&str]) -> Result<Vec<usize>, TopologyError> {
        let varying: Vec<usize> = axes.iter().map(|a| self.axis(a)).collect::<Result<_, _>>()?;
        let mine = self.coordinates(rank)?;
        let mut out = Vec::new();
        for r in 0..self.size() {
            let c = self.coordinates(r)?;
            if c.iter().zip(&mine).enumerate().all(|(i, (a, b))| a == b || varying.contains(&i)) {
                out.push(r);
            }
        }
        Ok(out)
    }

    /// Every group along `axes`: the ranks split into groups of [`Topology::group_of`], ordered by their first rank.
    pub fn groups(&self, axes: &[&str]) -> Result<Vec<Vec<usize>>, TopologyError> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        for r in 0..self.size() {
            if !out.iter().any(|g| g.contains(&r)) {
                out.push(self.group_of(r, axes)?);
            }
        }
        Ok(out)
    }
}

impl Topology {
    /// This rank's communicator along `axes`: a split of `comm` (collective: every rank of `comm` calls it with the
    /// same axes), named by the axes and the coordinates its ranks share, e.g. `data(pipe=1,model=0)`.
    pub fn communicator(&self, comm: &dyn Communicator, axes: &[&str]) -> CommResult<Box<dyn Communicator>> {
        let rank = comm.rank();
        let bad = |e: TopologyError| CommError::BadArgument { op: "topology", rank, what: e.to_string() };
        self.check_world_size(comm.world_size()).map_err(bad)?;
        let groups = self.groups(axes).map_err(bad)?;
        let color = groups.iter().position(|g| g.contains(&rank)).expect("every rank is in one group");
        let key = groups[color].iter().position(|&r| r == rank).expect("in its group");
        let coords = self.coordinates(rank).map_err(bad)?;
        let fixed: Vec<String> = self
            .axes
            .iter()
            .zip(&coords)
            .filter(|((name, _), _)| !axes.contains(&name.as_str()))
            .map(|((name, _), c)| format!("{name}={c}"))
            .collect();
        let name = format!("{}({})", axes.join("+"), fixed.join(","));
        let made = groups::split(comm, Some(color as u32), key as i64, None, Some(name))?;
        Ok(made.expect("every rank has a color"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three_d() -> Topology {
        Topology::new(&[("pipe", 2), ("data", 2), ("model", 2)]).unwrap()
    }

    #[test]
    fn ranks_and_coordinates_are_row_major_with_the_last_axis_fastest() {
        let t = three_d();
        assert_eq!(t.size(), 8);
        assert_eq!(t.coordinates(5).unwrap(), vec![1, 0, 1]);
        for r in 0..8 {
            let c = t.coordinates(r).unwrap();
            assert_eq!(t.rank_at(&[("model", c[2]), ("pipe", c[0]), ("data", c[1])]).unwrap(), r);
        }
        assert_eq!(t.coordinate(6, "data").unwrap(), 1);
        assert_eq!(t.to_string(), "pipe=2 x data=2 x model=2");
    }

    #[test]
    fn groups_along_an_axis_or_several_partition_the_ranks() {
        let t = three_d();
        // Tensor-parallel pairs are adjacent ranks (one host); data-parallel pairs are 2 apart; pipelines 4 apart.
        assert_eq!(t.groups(&["model"]).unwrap(), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        assert_eq!(t.groups(&["data"]).unwrap(), vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]);
        assert_eq!(t.group_of(5, &["pipe"]).unwrap(), vec![1, 5]);
        assert_eq!(t.group_of(5, &["data", "model"]).unwrap(), vec![4, 5, 6, 7]);
        assert_eq!(t.group_of(3, &[]).unwrap(), vec![3]);
        assert_eq!(t.groups(&["pipe", "data", "model"]).unwrap(), vec![(0..8).collect::<Vec<_>>()]);
        // A 3 x 2 topology: groups need not be powers of two.
        let t = Topology::new(&[("data", 3), ("model", 2)]).unwrap();
        assert_eq!(t.groups(&["data"]).unwrap(), vec![vec![0, 2, 4], vec![1, 3, 5]]);
    }

    #[test]
    fn mistakes_are_errors_naming_the_numbers() {
        let t = three_d();
        assert_eq!(
            t.check_world_size(6).unwrap_err().to_string(),
            "topology pipe=2 x data=2 x model=2: the axes multiply to 8 ranks, but the world has 6"
        );
        assert!(t.check_world_size(8).is_ok());
        assert_eq!(
            t.group_of(0, &["tensor"]).unwrap_err().to_string(),
            "topology pipe=2 x data=2 x model=2: no axis `tensor`"
        );
        assert_eq!(
            t.coordinates(8).unwrap_err().to_string(),
            "topology pipe=2 x data=2 x model=2: rank 8 is not below 8"
        );
        assert_eq!(
            t.rank_at(&[("pipe", 0), ("data", 2), ("model", 0)]).unwrap_err().to_string(),
            "topology pipe=2 x data=2 x model=2: axis `data` has 2 ranks; coordinate 2 is outside"
        );
        assert_eq!(
            Topology::new(&[("data", 2), ("data", 2)]).unwrap_err().to_string(),
            "topology data=2 x data=2: axis `data` is given twice"
        );
        assert_eq!(Topology::new(&[("pipe", 0)]).unwrap_err().to_string(), "topology pipe=0: axis `pipe` has no rank");
    }
}
