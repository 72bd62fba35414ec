//! Where a rank sits in a pipeline: ranks laid out as `pipe x data x model` (model fastest, then data, as
//! DeepSpeed's `PipeModelDataParallelTopology` and Megatron-LM's order), so a tensor-parallel group is adjacent
//! ranks (one host), a stage's data-parallel replicas come next, and a pipeline is every `data x model`-th rank.
//! Without tensor parallelism the model axis has one rank and the layout is DeepSpeed's `pipe x data`.
use crate::comm::topology::Topology;
use crate::config::PipelineConfig;
use crate::mesh::{Mesh, MeshError, MeshShape};

use super::PipelineError;

fn placement(e: MeshError) -> PipelineError {
    PipelineError::Placement(e.to_string())
}

#[derive(Debug, Clone, PartialEq, Eq)]
/// Where this rank sits in a pipeline: its stage, its data-parallel and tensor-parallel indices.
pub struct StagePlacement {
    /// Pipeline stages.
    pub stages: usize,
    /// Chunks of layers per stage (interleaved schedules; else 1): chunk `c` of stage `s` is virtual stage
    /// `c * stages + s`.
    pub chunks: usize,
    /// This rank's stage.
    pub stage: usize,
    /// Ranks per stage (the data-parallel degree).
    pub data_parallel: usize,
    /// This rank's index in its stage's data-parallel group.
    pub data_index: usize,
    /// Ranks that split each layer of a stage (the tensor-parallel degree; 1 without tensor parallelism).
    pub tensor_parallel: usize,
    /// This rank's index in its tensor-parallel group.
    pub model_index: usize,
    /// This rank in the job.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
}

impl StagePlacement {
    /// The stages come from `pipeline.stages`, else from the program (`program_stages`, e.g. a flag), else 1; both
    /// given must agree. Stages times the data-parallel degree must be the world size.
    pub fn new(
        config: &PipelineConfig,
        program_stages: Option<usize>,
        rank: usize,
        world_size: usize,
    ) -> Result<StagePlacement, PipelineError> {
        let stages = MeshShape::pipeline_stages(config, program_stages).map_err(placement)?;
        let shape = MeshShape::new(world_size, stages, 1, None).map_err(placement)?;
        Ok(StagePlacement::in_shape(shape, config.chunks(), rank))
    }

    /// This rank's place in the pipeline of `mesh` (its `pipe` dimension; the data-parallel index counts replicas
    /// and shards together).
    pub fn of(mesh: &Mesh, config: &PipelineConfig) -> StagePlacement {
        StagePlacement::in_shape(mesh.shape(), config.chunks(), mesh.rank())
    }

    /// This placement with each stage's layers split across `tensor_parallel` adjacent ranks: the ranks of a stage
    /// are `data x model`, so the data-parallel degree is the stage's ranks over `tensor_parallel`.
    pub fn with_tensor_parallel(self, tensor_parallel: usize) -> Result<StagePlacement, PipelineError> {
        let shape = MeshShape::new(self.world_size, self.stages, tensor_parallel, None).map_err(placement)?;
        Ok(StagePlacement::in_shape(shape, self.chunks, self.rank))
    }

    /// Rank `rank` of a mesh of `shape` (row-major, the tensor dimension fastest, as [`Mesh`] lays ranks out).
    fn in_shape(shape: MeshShape, chunks: usize, rank: usize) -> StagePlacement {
        let per_stage = shape.data() * shape.tensor;
        StagePlacement {
            stages: shape.pipeline,
            chunks: chunks.max(1),
            stage: rank / per_stage,
            data_parallel: shape.data(),
            data_index: rank % per_stage / shape.tensor,
            tensor_parallel: shape.tensor,
            model_index: rank % shape.tensor,
            rank,
            world_size: shape.size(),
        }
    }

    /// The `pipe x data x model` topology.
    pub fn topology(&self) -> Topology {
        Topology::new(&[("pipe", self.stages), ("data", self.data_parallel), ("model", self.tensor_parallel)])
            .expect("every axis has ranks")
    }

    /// Whether this rank's micro-batches need their inputs (the first stage's do).
    pub fn takes_inputs(&self) -> bool {
        self.stage == 0
    }

    /// Whether this rank's micro-batches need their labels (the last stage's do).
    pub fn takes_labels(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// Whether this rank's `chunk` is the model's first part (it takes the inputs).
    pub fn is_first(&self, chunk: usize) -> bool {
        self.stage == 0 && chunk == 0
    }

    /// Whether this rank's `chunk` is the model's last part (it computes the loss).
    pub fn is_last(&self, chunk: usize) -> bool {
        self.stage + 1 == self.stages && chunk + 1 == self.chunks
    }

    /// The virtual stage of this rank's `chunk`.
    pub fn virtual_stage(&self, chunk: usize) -> usize {
        chunk * self.stages + self.stage
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_laid_out_pipe_by_data() {
        let c = PipelineConfig::default();
        let at = |rank| StagePlacement::new(&c, Some(2), rank, 4).unwrap();
        assert_eq!((at(0).stage, at(0).data_index), (0, 0));
        assert_eq!((at(1).stage, at(1).data_index), (0, 1));
        assert_eq!((at(3).stage, at(3).data_index), (1, 1));
        assert_eq!(at(2).topology().group_of(2, &["pipe"]).unwrap(), vec![0, 2]);
    }

    #[test]
    fn tensor_parallel_ranks_are_adjacent_within_a_stage() {
        let c = PipelineConfig::default();
        let at = |rank| StagePlacement::new(&c, Some(2), rank, 8).unwrap().with_tensor_parallel(2).unwrap();
        // Rank 5: stage 1, data index 0, model index 1.
        let p = at(5);
        assert_eq!((p.stage, p.data_index, p.model_index, p.data_parallel), (1, 0, 1, 2));
        let t = p.topology();
        assert_eq!(t.group_of(5, &["model"]).unwrap(), vec![4, 5]);
        assert_eq!(t.group_of(5, &["data"]).unwrap(), vec![5, 7]);
        assert_eq!(t.group_of(5, &["pipe"]).unwrap(), vec![1, 5]);
        assert_eq!(t.group_of(5, &["pipe", "model"]).unwrap(), vec![0, 1, 4, 5]);
        assert_eq!(
            StagePlacement::new(&c, Some(2), 0, 6).unwrap().with_tensor_parallel(2).unwrap_err().to_string(),
            "pipeline: a tensor-parallel degree of 2 must divide the ranks of a stage (6 ranks over 2 stages = 3)"
        );
    }

    #[test]
    fn stages_must_divide_the_world_and_agree() {
        let c = PipelineConfig::default();
        assert_eq!(
            StagePlacement::new(&c, Some(2), 0, 3).unwrap_err().to_string(),
            "pipeline: 2 pipeline stages x a data-parallel degree must equal the world size 3: 3 is not a multiple of 2"
        );
        let c = PipelineConfig { stages: Some(4), ..Default::default() };
        assert!(StagePlacement::new(&c, Some(2), 0, 4).unwrap_err().to_string().contains("pipeline.stages is 4"));
        assert_eq!(StagePlacement::new(&c, None, 0, 4).unwrap().stages, 4);
    }
}
