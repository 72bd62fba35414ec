//! A model given as an ordered list of layer builders plus a loss (DeepSpeed's `PipelineModule` of `LayerSpec`s), so
//! each rank builds only its stage's layers and no rank ever holds the whole model.
//!
//! The values are those of building every layer in order from the same generator state: before the cut is known,
//! every layer is built once on a scratch VarStore (one at a time, then dropped) to count its parameters and note
//! the generator state it starts from; the stage's layers are then built again on the real VarStore from their own
//! starting state, and the generator is left where building the whole model leaves it. A builder must so create the
//! same variables every run and draw only from libtorch's generator (`tch::manual_seed`), as tch's initialisers do.
use std::ops::Range;

use tch::{nn, Tensor};

use super::partition::{partition, LayerInfo};
use super::placement::StagePlacement;
use super::PipelineError;
use crate::config::Partition;
use crate::engine::native;
use crate::error::Result;

/// A layer's forward, as its builder returns it.
pub type LayerForward<'a> = Box<dyn Fn(&Tensor) -> Tensor + 'a>;
/// The loss of the last stage's output and the labels.
pub type LossFn<'a> = Box<dyn Fn(&Tensor, &Tensor) -> Tensor + 'a>;
type LayerBuilder<'a> = Box<dyn Fn(&nn::Path) -> LayerForward<'a> + 'a>;

/// The whole model as builders: layers in execution order, and the loss.
pub struct PipelineModel<'a> {
    layers: Vec<(String, LayerBuilder<'a>)>,
    loss: LossFn<'a>,
}

impl<'a> PipelineModel<'a> {
    /// A model whose last layer's output goes to `loss(output, labels)`.
    pub fn new(loss: impl Fn(&Tensor, &Tensor) -> Tensor + 'a) -> Self {
        PipelineModel { layers: Vec::new(), loss: Box::new(loss) }
    }

    /// Appends a layer: its name (in logs, the memory report and `pipeline.partition`'s `type:REGEX`) and a builder
    /// that creates its variables under the path it is given (the VarStore's root; name them as the whole model
    /// would, so checkpoints and `--save-final` files are the same whatever the cut) and returns its forward.
    pub fn layer(mut self, name: impl Into<String>, build: impl Fn(&nn::Path) -> LayerForward<'a> + 'a) -> Self {
        self.layers.push((name.into(), Box::new(build)));
        self
    }

    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// Builds the layers of `placement`'s stage on `vs` (which should hold nothing else), cutting the model by
    /// `how`. With thread ranks, hold a lock around it: the generator is the process's.
    pub fn build_stage(self, vs: &nn::VarStore, placement: &StagePlacement, how: &Partition) -> Result<StageModel<'a>> {
        if self.layers.is_empty() {
            return Err(PipelineError::Model("PipelineModel has no layer".into()).into());
        }
        let mut starts = Vec::with_capacity(self.layers.len());
        let mut infos = Vec::with_capacity(self.layers.len());
        for (name, build) in &self.layers {
            starts.push(native::rng_state()?);
            let scratch = nn::VarStore::new(tch::Device::Cpu);
            let _forward = build(&scratch.root());
            let parameters = scratch.trainable_variables().iter().map(|t| t.numel()).sum();
            infos.push(LayerInfo { name: name.clone(), parameters });
        }
        let end = native::rng_state()?;
        let cut = partition(&infos, placement.stages * placement.chunks, how).map_err(PipelineError::from)?;
        let ranges: Vec<Range<usize>> =
            (0..placement.chunks).map(|c| cut[placement.virtual_stage(c)].clone()).collect();
        let mut chunks = Vec::with_capacity(ranges.len());
        for range in &ranges {
            let mut forwards = Vec::with_capacity(range.len());
            for i in range.clone() {
                native::set_rng_state(&starts[i])?;
                forwards.push((self.layers[i].1)(&vs.root()));
            }
            chunks.push(forwards);
        }
        native::set_rng_state(&end)?;
        let loss = placement.is_last(placement.chunks - 1).then_some(self.loss);
        if placement.rank == 0 {
            let stages: Vec<String> = cut
                .iter()
                .map(|r| {
                    let p: usize = infos[r.clone()].iter().map(|l| l.parameters).sum();
                    format!("{}..{} ({} parameters)", infos[r.start].name, infos[r.end - 1].name, p)
                })
                .collect();
            tracing::info!(stages = placement.stages, chunks = placement.chunks, cut = %stages.join(" | "), "pipeline partition");
        }
        Ok(StageModel { chunks, loss, ranges, cut, layers: infos })
    }
}

/// One stage's part of the model: its chunks' layers (one chunk but under interleaved schedules), and the loss on
/// the last stage.
pub struct StageModel<'a> {
    chunks: Vec<Vec<LayerForward<'a>>>,
    loss: Option<LossFn<'a>>,
    ranges: Vec<Range<usize>>,
    cut: Vec<Range<usize>>,
    layers: Vec<LayerInfo>,
}

impl StageModel<'_> {
    /// Runs the layers of this stage's `chunk` in order.
    pub fn forward(&self, chunk: usize, input: &Tensor) -> Tensor {
        let mut x = input.shallow_clone();
        for f in &self.chunks[chunk] {
            x = f(&x);
        }
        x
    }

    /// The loss (last stage only).
    pub fn loss(&self, output: &Tensor, labels: &Tensor) -> Option<Tensor> {
        self.loss.as_ref().map(|l| l(output, labels))
    }

    /// This stage's layers, chunk by chunk (indices into the whole model).
    pub fn layers(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Every virtual stage's layers (`chunk * stages + stage`).
    pub fn cut(&self) -> &[Range<usize>] {
        &self.cut
    }

    /// Every layer's name and trainable parameters.
    pub fn layer_infos(&self) -> &[LayerInfo] {
        &self.layers
    }
}
