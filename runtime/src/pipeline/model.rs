//! A model given as an ordered list of layer builders plus a loss (DeepSpeed's `PipelineModule` of `LayerSpec`s), so
//! each rank builds only its stage's layers and no rank ever holds the whole model.
//!
//! The values are those of building every layer in order from the same generator state: before the cut is known,
//! every layer is built once on a scratch VarStore (one at a time, then dropped) to count its parameters and note
//! the generator state it starts from; the stage's layers are then built again on the real VarStore from their own
//! starting state, and the generator is left where building the whole model leaves it. A builder must so create the
//! same variables every run and draw only from libtorch's generator (`tch::manual_seed`), as tch's initialisers do.
use std::collections::HashMap;
use std::ops::Range;

use tch::{nn, Tensor};

use super::partition::{partition, LayerInfo};
use super::placement::StagePlacement;
use super::PipelineError;
use crate::config::Partition;
use crate::engine::device::native;
use crate::error::Result;

/// A layer's forward, as its builder returns it.
pub type LayerForward<'a> = Box<dyn Fn(&Tensor) -> Tensor + 'a>;
/// The loss of the last stage's output and the labels.
pub type LossFn<'a> = Box<dyn Fn(&Tensor, &Tensor) -> Tensor + 'a>;

type PlainBuilder<'a> = Box<dyn Fn(&nn::Path) -> LayerForward<'a> + 'a>;
type TyingBuilder<'a> = Box<dyn Fn(&nn::Path) -> (LayerForward<'a>, Tensor) + 'a>;
type TiedBuilder<'a> = Box<dyn Fn(&nn::Path, &Tensor) -> LayerForward<'a> + 'a>;

/// How a layer is built.
enum Builder<'a> {
    Plain(PlainBuilder<'a>),
    /// Creates the weight tied under `key` (and returns it beside its forward).
    Tying {
        key: String,
        build: TyingBuilder<'a>,
    },
    /// Uses the weight tied under `key`.
    Tied {
        key: String,
        build: TiedBuilder<'a>,
    },
}

/// A weight shared by layers of several stages (DeepSpeed's `TiedLayerSpec`): the stage of the layer that creates it
/// owns it (its engine trains it); every other stage using it holds a replica, whose gradient goes to the owner
/// before the owner's last backward and whose value comes back after the step.
pub struct TiedWeight {
    /// The key layers share it by.
    pub key: String,
    /// The weight.
    pub tensor: Tensor,
    /// The owner's stage.
    pub owner: usize,
    /// The stages holding replicas (on the owner: all of them; on a replica's stage: none).
    pub replicas: Vec<usize>,
}

/// The whole model as builders: layers in execution order, and the loss.
pub struct PipelineModel<'a> {
    layers: Vec<(String, Builder<'a>)>,
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
        self.layers.push((name.into(), Builder::Plain(Box::new(build))));
        self
    }

    /// Appends a layer that creates a weight later layers share under `key` (the token embedding a language model's
    /// head reuses): its builder returns its forward and that weight.
    pub fn tying_layer(
        mut self,
        name: impl Into<String>,
        key: impl Into<String>,
        build: impl Fn(&nn::Path) -> (LayerForward<'a>, Tensor) + 'a,
    ) -> Self {
        self.layers.push((name.into(), Builder::Tying { key: key.into(), build: Box::new(build) }));
        self
    }

    /// Appends a layer that uses the weight an earlier [`PipelineModel::tying_layer`] shares under `key`; its
    /// builder gets that weight (the same tensor on the owner's stage, a replica kept equal to it elsewhere).
    pub fn tied_layer(
        mut self,
        name: impl Into<String>,
        key: impl Into<String>,
        build: impl Fn(&nn::Path, &Tensor) -> LayerForward<'a> + 'a,
    ) -> Self {
        self.layers.push((name.into(), Builder::Tied { key: key.into(), build: Box::new(build) }));
        self
    }

    /// Layers in the model.
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// Builds the layers of `placement`'s stage on `vs` (which should hold nothing else), cutting the model by
    /// `how`. With thread ranks, hold a lock around it: the generator is the process's.
    pub fn build_stage(self, vs: &nn::VarStore, placement: &StagePlacement, how: &Partition) -> Result<StageModel<'a>> {
        if self.layers.is_empty() {
            return Err(PipelineError::Model("PipelineModel has no layer".into()).into());
        }
        let bad = |what: String| -> crate::error::Error { PipelineError::Model(what).into() };
        // Where each key's weight is created.
        let mut tying: HashMap<String, usize> = HashMap::new();
        for (i, (name, b)) in self.layers.iter().enumerate() {
            match b {
                Builder::Tying { key, .. } if tying.insert(key.clone(), i).is_some() => {
                    return Err(bad(format!("two layers create the tied weight `{key}` (the second: `{name}`)")));
                }
                Builder::Tied { key, .. } if !tying.contains_key(key) => {
                    return Err(bad(format!(
                        "layer `{name}` uses the tied weight `{key}`, which no earlier tying_layer creates"
                    )))
                }
                _ => {}
            }
        }
        let mut starts = Vec::with_capacity(self.layers.len());
        let mut infos = Vec::with_capacity(self.layers.len());
        // The scratch build's tied weights, for the scratch builds of the layers that use them.
        let mut scratch_tied: HashMap<String, Tensor> = HashMap::new();
        for (name, b) in &self.layers {
            starts.push(native::rng_state()?);
            let scratch = nn::VarStore::new(tch::Device::Cpu);
            match b {
                Builder::Plain(build) => drop(build(&scratch.root())),
                Builder::Tying { key, build } => {
                    let (_forward, weight) = build(&scratch.root());
                    scratch_tied.insert(key.clone(), weight);
                }
                Builder::Tied { key, build } => drop(build(&scratch.root(), &scratch_tied[key])),
            }
            let parameters = scratch.trainable_variables().iter().map(|t| t.numel()).sum();
            infos.push(LayerInfo { name: name.clone(), parameters });
        }
        drop(scratch_tied);
        let end = native::rng_state()?;
        let cut = partition(&infos, placement.stages * placement.chunks, how).map_err(PipelineError::from)?;
        let stage_of_layer =
            |i: usize| cut.iter().position(|r| r.contains(&i)).expect("the cut covers every layer") % placement.stages;
        let ranges: Vec<Range<usize>> =
            (0..placement.chunks).map(|c| cut[placement.virtual_stage(c)].clone()).collect();
        // The same on every rank: whether some tied weight is used on another stage than its owner's.
        let cross_stage_ties = self.layers.iter().enumerate().any(
            |(j, (_, b))| matches!(b, Builder::Tied { key, .. } if stage_of_layer(j) != stage_of_layer(tying[key])),
        );
        let mut tied: Vec<TiedWeight> = Vec::new();
        let mut chunks = Vec::with_capacity(ranges.len());
        for range in &ranges {
            let mut forwards = Vec::with_capacity(range.len());
            for i in range.clone() {
                native::set_rng_state(&starts[i])?;
                forwards.push(match &self.layers[i].1 {
                    Builder::Plain(build) => build(&vs.root()),
                    Builder::Tying { key, build } => {
                        let (forward, weight) = build(&vs.root());
                        let mut replicas: Vec<usize> = self
                            .layers
                            .iter()
                            .enumerate()
                            .filter(|(_, (_, b))| matches!(b, Builder::Tied { key: k, .. } if k == key))
                            .map(|(j, _)| stage_of_layer(j))
                            .filter(|&s| s != placement.stage)
                            .collect();
                        replicas.sort_unstable();
                        replicas.dedup();
                        tied.push(TiedWeight { key: key.clone(), tensor: weight, owner: placement.stage, replicas });
                        forward
                    }
                    Builder::Tied { key, build } => {
                        if !tied.iter().any(|t| &t.key == key) {
                            // Not created on this stage: a replica, from the owner's initial values.
                            let owner_layer = tying[key];
                            native::set_rng_state(&starts[owner_layer])?;
                            let scratch = nn::VarStore::new(tch::Device::Cpu);
                            let Builder::Tying { build: make, .. } = &self.layers[owner_layer].1 else {
                                unreachable!("tying maps keys to tying layers")
                            };
                            let (_forward, weight) = make(&scratch.root());
                            let replica = weight.detach().copy().set_requires_grad(true);
                            tied.push(TiedWeight {
                                key: key.clone(),
                                tensor: replica,
                                owner: stage_of_layer(owner_layer),
                                replicas: Vec::new(),
                            });
                            native::set_rng_state(&starts[i])?;
                        }
                        let weight = &tied.iter().find(|t| &t.key == key).expect("made above").tensor;
                        build(&vs.root(), weight)
                    }
                });
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
            // A summary the user sees at the default log level (`zerorun::init_logging` shows this target).
            tracing::info!(target: "zerorun::summary", stages = placement.stages, chunks = placement.chunks, cut = %stages.join(" | "), "pipeline partition");
        }
        Ok(StageModel { chunks, loss, ranges, cut, layers: infos, tied, cross_stage_ties })
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
    /// The tied weights this stage uses: owned (trained here) or replicas.
    tied: Vec<TiedWeight>,
    /// Whether any tied weight of the model is used on another stage than its owner's (the same on every rank).
    cross_stage_ties: bool,
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

    /// The tied weights this stage owns or holds a replica of, in the order the layers use them.
    pub fn tied(&self) -> &[TiedWeight] {
        &self.tied
    }

    /// Whether any tied weight of the model crosses stages (every rank knows it).
    pub fn ties_cross_stages(&self) -> bool {
        self.cross_stage_ties
    }

    /// Every layer's name and trainable parameters.
    pub fn layer_infos(&self) -> &[LayerInfo] {
        &self.layers
    }
}
