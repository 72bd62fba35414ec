//! One mesh of ranks that every parallelism reads (FSDP2's `DeviceMesh`, torchtitan's `ParallelDims`): named
//! dimensions, slowest first `pipe x replicate x shard x tensor` (DeepSpeed's `pipe x data x model`, its data axis
//! split in two), so a tensor-parallel group is adjacent ranks (one host), a shard group comes next, and a
//! pipeline is every `replicate x shard x tensor`-th rank. Unused dimensions have size 1.
//!
//! The groups the engine needs all come from it: the data-parallel group ZeRO shards over (`shard`), the one it
//! replicates across (`replicate`; size 1 until shard groups are asked for), the group the gradient norm and the
//! fp16 overflow verdict span (`pipe x tensor`), the pipeline neighbours (`pipe`) and the tensor-parallel group
//! the layers split their weights over (`tensor`). Tensor-parallel layers made on the mesh's group record where
//! they split each parameter ([`Placements`]); the engine built on the mesh reads them there.
use std::fmt;

use crate::comm::topology::Topology;
use crate::comm::{CommResult, Communicator};
use crate::config::{Config, PipelineConfig};
use crate::error::{Error, Result};
use crate::tensor_parallel::{Placements, TensorParallel};

/// A dimension of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// Pipeline stages.
    Pipeline,
    /// Data-parallel replicas of a shard group (the same shards, gradients all-reduced across them).
    Replicate,
    /// Data-parallel ranks ZeRO partitions the model states over.
    Shard,
    /// Tensor-parallel ranks, which split each layer's weights.
    Tensor,
}

impl Dim {
    const ALL: [Dim; 4] = [Dim::Pipeline, Dim::Replicate, Dim::Shard, Dim::Tensor];

    /// The dimension's name in group names and errors.
    pub fn name(self) -> &'static str {
        match self {
            Dim::Pipeline => "pipe",
            Dim::Replicate => "replicate",
            Dim::Shard => "shard",
            Dim::Tensor => "tensor",
        }
    }
}

/// The size of each dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshShape {
    /// Pipeline stages.
    pub pipeline: usize,
    /// Replicas of each shard group (1 without shard groups).
    pub replicate: usize,
    /// Ranks a shard group spans (ZeRO's data-parallel degree without shard groups).
    pub shard: usize,
    /// Tensor-parallel degree.
    pub tensor: usize,
}

impl fmt::Display for MeshShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pipe {} x replicate {} x shard {} x tensor {}",
            self.pipeline, self.replicate, self.shard, self.tensor
        )
    }
}

impl MeshShape {
    /// Data parallel only: every rank one of `world` shards.
    pub fn data_parallel(world: usize) -> MeshShape {
        MeshShape { pipeline: 1, replicate: 1, shard: world, tensor: 1 }
    }

    /// `world` ranks as `pipeline` stages of `tensor`-parallel groups; the rest are data parallel, sharded over
    /// groups of `shard_group` ranks and replicated across them (None: one group of all of them, plain ZeRO).
    pub fn new(
        world: usize,
        pipeline: usize,
        tensor: usize,
        shard_group: Option<usize>,
    ) -> std::result::Result<MeshShape, MeshError> {
        if pipeline == 0 || world % pipeline != 0 {
            return Err(MeshError::Stages { stages: pipeline, world });
        }
        let per_stage = world / pipeline;
        if tensor == 0 || per_stage % tensor != 0 {
            return Err(MeshError::Tensor { tensor, world, stages: pipeline, per_stage });
        }
        let data = world / (pipeline * tensor);
        let shard = shard_group.unwrap_or(data);
        if shard == 0 || data % shard != 0 {
            return Err(MeshError::Shard { shard, data });
        }
        Ok(MeshShape { pipeline, replicate: data / shard, shard, tensor })
    }

    /// The pipeline stages: `pipeline.stages`, else the program's (`program`, e.g. a flag), else 1; both given must
    /// agree.
    pub fn pipeline_stages(config: &PipelineConfig, program: Option<usize>) -> std::result::Result<usize, MeshError> {
        match (config.stages.map(|s| s as usize), program) {
            (Some(config), Some(program)) if config != program => Err(MeshError::StagesDisagree { config, program }),
            (Some(s), _) | (None, Some(s)) => Ok(s),
            (None, None) => Ok(1),
        }
    }

    /// Ranks of the mesh.
    pub fn size(&self) -> usize {
        self.pipeline * self.replicate * self.shard * self.tensor
    }

    /// Data-parallel ranks: replicas times shards.
    pub fn data(&self) -> usize {
        self.replicate * self.shard
    }

    /// The size of `dim`.
    pub fn of(&self, dim: Dim) -> usize {
        match dim {
            Dim::Pipeline => self.pipeline,
            Dim::Replicate => self.replicate,
            Dim::Shard => self.shard,
            Dim::Tensor => self.tensor,
        }
    }

    fn topology(&self) -> Topology {
        let axes: Vec<(&str, usize)> = Dim::ALL.iter().map(|&d| (d.name(), self.of(d))).collect();
        Topology::new(&axes).expect("every dimension has ranks")
    }
}

/// A mesh whose sizes do not fit the job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    #[error("{stages} pipeline stages x a data-parallel degree must equal the world size {world}: {world} is not a multiple of {stages}")]
    /// The stages do not divide the world.
    Stages {
        /// Stages asked for.
        stages: usize,
        /// Ranks in the job.
        world: usize,
    },
    #[error("a tensor-parallel degree of {tensor} must divide the ranks of a stage ({world} ranks over {stages} stages = {per_stage})")]
    /// The tensor-parallel degree does not divide a stage's ranks.
    Tensor {
        /// The degree.
        tensor: usize,
        /// Ranks in the job.
        world: usize,
        /// Stages.
        stages: usize,
        /// Ranks per stage.
        per_stage: usize,
    },
    #[error("a shard group of {shard} ranks must divide the {data} data-parallel ranks")]
    /// The shard group does not divide the data-parallel ranks.
    Shard {
        /// The shard group's size.
        shard: usize,
        /// Data-parallel ranks.
        data: usize,
    },
    #[error("pipeline.stages is {config} but the program asks for {program} stages; give one of them (or \"auto\")")]
    /// The config and the program ask for different numbers of stages.
    StagesDisagree {
        /// `pipeline.stages`.
        config: usize,
        /// The program's.
        program: usize,
    },
}

/// A shard group that does not divide the data-parallel ranks, as the config key's error.
fn shard_groups_error(e: MeshError) -> Error {
    let value = match &e {
        MeshError::Shard { shard, .. } => shard.to_string(),
        _ => String::new(),
    };
    crate::config::ConfigError::Invalid {
        path: "zero_optimization.mics_shard_size".into(),
        value,
        allowed: e.to_string(),
    }
    .into()
}

/// What a program says of the mesh that the config does not.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeshOptions {
    /// Pipeline stages asked for by the program (a flag); `pipeline.stages` in the config must agree.
    pub pipeline_stages: Option<usize>,
    /// The tensor-parallel degree (None or 1: none).
    pub tensor_parallel: Option<usize>,
}

/// The ranks of a job laid out over [`Dim`]s, with the job's communicator.
pub struct Mesh {
    world: Box<dyn Communicator>,
    shape: MeshShape,
    topology: Topology,
    placements: Placements,
}

impl fmt::Debug for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Mesh(rank {} of {}: {})", self.rank(), self.world_size(), self.shape)
    }
}

/// A communicator as a data-parallel mesh of its ranks.
impl From<Box<dyn Communicator>> for Mesh {
    fn from(world: Box<dyn Communicator>) -> Mesh {
        Mesh::data_parallel(world)
    }
}

impl Mesh {
    /// The mesh of `shape` over `world`'s ranks (its size must be the world size).
    pub fn new(world: Box<dyn Communicator>, shape: MeshShape) -> Result<Mesh> {
        if shape.size() != world.world_size() {
            return Err(Error::Usage(format!(
                "a mesh of {shape} has {} ranks, the communicator {}",
                shape.size(),
                world.world_size()
            )));
        }
        Ok(Mesh { topology: shape.topology(), world, shape, placements: Placements::default() })
    }

    /// Every rank of `world` one data-parallel shard: what a plain training loop runs on.
    pub fn data_parallel(world: Box<dyn Communicator>) -> Mesh {
        let shape = MeshShape::data_parallel(world.world_size());
        Mesh::new(world, shape).expect("the shape is the world's")
    }

    /// The mesh over `world` from the config (`pipeline.stages`) and what the program says: the rest of the
    /// ranks are data parallel.
    pub fn from_config(world: Box<dyn Communicator>, config: &Config, options: MeshOptions) -> Result<Mesh> {
        let placement = |e: MeshError| crate::pipeline::PipelineError::Placement(e.to_string());
        let stages = MeshShape::pipeline_stages(&config.pipeline, options.pipeline_stages).map_err(placement)?;
        let tensor = options.tensor_parallel.unwrap_or(1);
        let shard_group = config.zero_optimization.mics_shard_size.map(|s| s as usize);
        let shape = MeshShape::new(world.world_size(), stages, tensor, shard_group).map_err(|e| match e {
            e @ MeshError::Shard { .. } => shard_groups_error(e),
            e => placement(e).into(),
        })?;
        Mesh::new(world, shape)
    }

    /// [`Mesh::from_config`] over the communicator the environment names (`zerorun launch`'s or mpirun's
    /// variables; one rank without them), whose collectives time out after `comms_timeout`.
    pub fn from_env(config: &Config, options: MeshOptions) -> Result<Mesh> {
        let world = crate::gloo::communicator_from_env(std::time::Duration::from_secs_f64(config.comms_timeout))?;
        Mesh::from_config(world, config, options)
    }

    /// This mesh with its data-parallel ranks in shard groups of `size` (`mics_shard_size`; None: as it is).
    /// A mesh laid out with shard groups already keeps them; one without (a communicator taken as a mesh) is
    /// laid out again, its placements kept.
    pub fn with_shard_groups(self, size: Option<u64>) -> Result<Mesh> {
        let shape = self.shape;
        match size.map(|s| s as usize) {
            Some(size) if shape.replicate == 1 && size != shape.shard => {
                let world = self.world.world_size();
                let shape =
                    MeshShape::new(world, shape.pipeline, shape.tensor, Some(size)).map_err(shard_groups_error)?;
                Ok(Mesh { topology: shape.topology(), shape, ..self })
            }
            _ => Ok(self),
        }
    }

    /// The size of each dimension.
    pub fn shape(&self) -> MeshShape {
        self.shape
    }

    /// This rank in the job.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.world.world_size()
    }

    /// This rank's index along `dim`.
    pub fn coordinate(&self, dim: Dim) -> usize {
        self.topology.coordinate(self.rank(), dim.name()).expect("the rank is in the mesh")
    }

    /// The group of the ranks that differ from this one only along `dims` (collective: every rank of the mesh
    /// asks for the same groups in the same order). Named after the dimensions and this rank's fixed coordinates.
    pub fn group(&self, dims: &[Dim]) -> CommResult<Box<dyn Communicator>> {
        let names: Vec<&str> = dims.iter().map(|d| d.name()).collect();
        self.topology.communicator(self.world.as_ref(), &names)
    }

    /// The tensor-parallel group for the model's layers (collective). The layers record their parameters'
    /// placements in it, which an engine built on this mesh reads.
    pub fn tensor_parallel(&self) -> Result<TensorParallel> {
        Ok(TensorParallel::with_placements(self.group(&[Dim::Tensor])?, self.placements.clone()))
    }

    /// Where the tensor-parallel layers made on this mesh split their parameters.
    pub fn placements(&self) -> &Placements {
        &self.placements
    }

    /// The job's communicator.
    pub fn world(&self) -> &dyn Communicator {
        self.world.as_ref()
    }

    /// The job's communicator, taken out of the mesh.
    pub fn into_world(self) -> Box<dyn Communicator> {
        self.world
    }
}

/// The groups of adjacent data-parallel ranks a model's layers run over (sequence parallelism's, expert
/// parallelism's), refused where the mesh has other dimensions (`why` says which).
pub(crate) fn refuse_adjacent_groups(config: &Config, why: &'static str) -> Result<()> {
    let groups = [
        ("sequence_parallel_size", config.sequence_parallel_size),
        ("expert_parallel.autoep_size", config.expert_parallel.size()),
    ];
    match groups.into_iter().find(|(_, size)| *size > 1) {
        Some((key, size)) => Err(Error::Unsupported { key, value: size.to_string(), why }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_ranks_are_adjacent_then_shards_then_replicas_then_stages() {
        let shape = MeshShape::new(16, 2, 2, Some(2)).unwrap();
        assert_eq!(shape, MeshShape { pipeline: 2, replicate: 2, shard: 2, tensor: 2 });
        let t = shape.topology();
        let group = |rank, dims: &[Dim]| t.group_of(rank, &dims.iter().map(|d| d.name()).collect::<Vec<_>>()).unwrap();
        assert_eq!(group(5, &[Dim::Tensor]), vec![4, 5]);
        assert_eq!(group(5, &[Dim::Shard]), vec![5, 7]);
        assert_eq!(group(5, &[Dim::Replicate]), vec![1, 5]);
        assert_eq!(group(5, &[Dim::Replicate, Dim::Shard]), vec![1, 3, 5, 7]);
        assert_eq!(group(5, &[Dim::Pipeline]), vec![5, 13]);
        assert_eq!(group(5, &[Dim::Pipeline, Dim::Tensor]), vec![4, 5, 12, 13]);
    }

    #[test]
    fn shapes_that_do_not_divide_the_world_are_refused() {
        assert_eq!(
            MeshShape::new(6, 2, 2, None).unwrap_err().to_string(),
            "a tensor-parallel degree of 2 must divide the ranks of a stage (6 ranks over 2 stages = 3)"
        );
        assert_eq!(
            MeshShape::new(3, 2, 1, None).unwrap_err().to_string(),
            "2 pipeline stages x a data-parallel degree must equal the world size 3: 3 is not a multiple of 2"
        );
        assert_eq!(
            MeshShape::new(8, 1, 2, Some(3)).unwrap_err().to_string(),
            "a shard group of 3 ranks must divide the 4 data-parallel ranks"
        );
        assert_eq!(MeshShape::new(8, 1, 1, None).unwrap(), MeshShape::data_parallel(8));
    }
}
