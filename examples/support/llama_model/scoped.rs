//! The model entered unit by unit from its own forward (stage 3 with its experts split over their own ranks).
use std::rc::Rc;
use tch::nn::Module;

use tch::Tensor;
use zerorun::runtime::moe::{ExpertParallel, MoeLayer};

use super::*;

/// A mixture of experts entered unit by unit from its own forward: each layer's experts of one expert-parallel
/// position a unit of their own (at stage 3 split by the engine over the ranks at that position; with one position,
/// a layer's experts are one unit), and the forward that enters them: the embedding, each layer (its attention,
/// norms and router, checkpointed or not), inside it this rank's experts, then the norm with the head. Untied
/// embeddings.
pub struct ScopedUnits {
    /// Every unit's prefixes (the engine's `EngineOptions::units`): whole parameter names for a layer's dense part,
    /// `...experts.{i}` for its experts.
    pub prefixes: Vec<Vec<String>>,
    /// Per layer: the name its unit is entered by, and this rank's experts' unit (None: a dense layer).
    layers: Vec<(String, Option<String>)>,
}

impl ScopedUnits {
    /// The units of a model whose variables are `names`, with this rank at position `position` of expert-parallel
    /// groups of `ranks`.
    pub fn new(c: &LlamaConfig, names: &[String], position: usize, ranks: usize) -> ScopedUnits {
        let mut prefixes = vec![vec!["model.embed_tokens".to_string()]];
        let mut layers = Vec::new();
        for i in 0..c.num_hidden_layers {
            let under = format!("model.layers.{i}.");
            let mut dense: Vec<String> = Vec::new();
            let mut experts_path: Option<String> = None;
            for n in names.iter().filter(|n| n.starts_with(&under)) {
                match n.find(".experts.") {
                    Some(at) => experts_path = Some(n[..at].to_string()),
                    None => dense.push(n.clone()),
                }
            }
            dense.sort();
            let entered = dense[0].clone();
            prefixes.push(dense);
            let mine = experts_path.map(|path| {
                let units = MoeLayer::expert_units(&path, c.experts().expect("a layer with experts"), ranks);
                let mine = units[position][0].clone();
                prefixes.extend(units);
                mine
            });
            layers.push((entered, mine));
        }
        prefixes.push(vec!["model.norm".to_string(), "lm_head".to_string()]);
        ScopedUnits { prefixes, layers }
    }
}

impl Llama {
    /// Logits and the router logits of token ids `ids`, each part entered as its unit of `units` (collective over
    /// the engine's ranks; the experts' all-to-alls over `experts`). With `checkpointed` each decoder layer is
    /// recomputed in backward, its experts' unit entered again inside it, its router's logits a second output
    /// that keeps its gradient for the load-balancing loss.
    pub fn forward_units(
        &self,
        engine: &mut zerorun::Engine,
        units: &ScopedUnits,
        ids: &Tensor,
        experts: Option<&Rc<ExpertParallel>>,
        checkpointed: bool,
    ) -> Result<(Tensor, Vec<Tensor>), zerorun::Error> {
        let groups = Groups { sequence: None, experts: experts.map(|g| &**g) };
        let mut h = engine.unit("model.embed_tokens", |_| self.embed.forward(ids))?;
        let mut router = Vec::new();
        for (layer, (name, mine)) in self.layers.iter().zip(&units.layers) {
            let (out, logits) = if checkpointed {
                let (layer, mine, experts) = (Rc::clone(layer), mine.clone(), experts.cloned());
                let mut outputs = engine.unit_checkpointed_with(name, &[&h], move |xs, nested| {
                    let groups = Groups { sequence: None, experts: experts.as_deref() };
                    let (out, logits) = match &mine {
                        Some(mine) => layer.forward_scoped(&xs[0], groups, &mut |f| nested.unit(mine, f)),
                        None => layer.forward_in(&xs[0], groups),
                    };
                    Ok(std::iter::once(out).chain(logits).collect())
                })?;
                let out = outputs.remove(0);
                (out, outputs.pop())
            } else {
                engine.unit(name, |e| match mine {
                    Some(mine) => layer.forward_scoped(&h, groups, &mut |experts| e.unit(mine, |_| experts())),
                    None => layer.forward_in(&h, groups),
                })?
            };
            h = out;
            router.extend(logits);
        }
        Ok((engine.unit("model.norm", |_| self.head.forward(&h))?, router))
    }
}
