//! The data-parallel groups an engine runs on: the shard group ZeRO partitions over and, with shard groups (MiCS),
//! the replicas of this rank's shard, split from the engine's communicator; and what shard groups cannot run with.
use tch::nn;

use crate::comm::Communicator;
use crate::config::Config;
use crate::engine::parallel::placement::Placement;
use crate::engine::zero::variables;
use crate::error::{Error, Result};
use crate::mesh::{Dim, Mesh};

/// The data-parallel groups an engine runs on: the shard group ZeRO partitions over and, with shard groups
/// (MiCS), the replicas of this rank's shard, with the mesh they were split from (kept alive with them).
pub(crate) struct DataGroups {
    pub shard: Box<dyn Communicator>,
    pub replicas: Option<Box<dyn Communicator>>,
    pub mesh: Option<Mesh>,
}

impl DataGroups {
    /// `comm`'s ranks as the config lays them out: in shard groups when `mics_shard_size` is less than its size
    /// (collective), else `comm` itself.
    pub fn of(comm: Box<dyn Communicator>, config: &Config) -> Result<DataGroups> {
        match config.zero_optimization.mics_shard_size {
            Some(size) if size as usize != comm.world_size() => {
                DataGroups::of_mesh(Mesh::from(comm).with_shard_groups(Some(size))?)
            }
            _ => Ok(DataGroups { shard: comm, replicas: None, mesh: None }),
        }
    }

    /// The shard and replicas' groups of a data-parallel `mesh` with shard groups (collective).
    pub(super) fn of_mesh(mesh: Mesh) -> Result<DataGroups> {
        let shape = mesh.shape();
        if shape.data() != mesh.world_size() || Placement::records_slices(&mesh) {
            return Err(Error::Unsupported {
                key: "zero_optimization.mics_shard_size",
                value: shape.shard.to_string(),
                why: "shard groups run on a data-parallel mesh; with pipeline stages or tensor parallelism they are not built yet",
            });
        }
        let shard = mesh.group(&[Dim::Shard])?;
        let replicas = mesh.group(&[Dim::Replicate])?;
        if mesh.rank() == 0 {
            tracing::info!(
                groups = shape.replicate,
                ranks = shape.shard,
                "shard groups (MiCS): ZeRO partitions over each group of consecutive ranks, gradients all-reduced across the groups"
            );
        }
        Ok(DataGroups { shard, replicas: Some(replicas), mesh: Some(mesh) })
    }

    /// Every replica starts from the first group's values of `vs`: broadcast across the replicas here, then inside
    /// each group from its first rank (as every engine starts). Collective.
    pub fn start_replicas_alike(&self, vs: &nn::VarStore) -> Result<()> {
        let Some(replicas) = &self.replicas else { return Ok(()) };
        let mut vars: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        variables::broadcast_values(replicas.as_ref(), &vars.iter().map(|(_, t)| t).collect::<Vec<_>>())
    }

    /// Another group of the replicas (collective), for a builder's start: the engine takes the first.
    pub fn replicas_again(&self) -> Result<Option<Box<dyn Communicator>>> {
        match (&self.mesh, &self.replicas) {
            (Some(mesh), Some(_)) => Ok(Some(mesh.group(&[Dim::Replicate])?)),
            _ => Ok(None),
        }
    }
}

/// What shard groups cannot run with: asynchronous training's meetings and bounded staleness work on one group.
/// (`replicas`: the shard groups in the job, 1 without them.)
pub(super) fn check_shard_groups(config: &Config, world_size: usize, replicas: usize) -> Result<()> {
    let Some(size) = config.zero_optimization.mics_shard_size else { return Ok(()) };
    let key = "zero_optimization.mics_shard_size";
    if replicas == 1 && size as usize != world_size {
        return Err(Error::Unsupported {
            key,
            value: size.to_string(),
            why: "the engine's communicator was not split into shard groups (an internal path that does not lay them out)",
        });
    }
    if replicas > 1 && config.async_training.is_async() {
        return Err(Error::Unsupported {
            key,
            value: size.to_string(),
            why: "asynchronous training (local SGD, DiLoCo, bounded staleness) meets over one group; shard groups need synchronous steps",
        });
    }
    Ok(())
}
