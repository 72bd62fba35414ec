//! The layer: route, bring each token's rows to its experts (on this rank, or across the expert-parallel group),
//! run the experts, bring the outputs back and sum each token's top-k outputs by their weights.
//!
//! Dropless by default: the (token, choice) slots are sorted by expert (a stable sort, so tokens keep their order
//! within an expert), every slot is computed, and transformers' block gives the same output op for op (each token's
//! outputs are added in expert order, from zero). With a [`Capacity`] (DeepSpeed-MoE's `capacity_factor`,
//! `min_capacity`, `drop_tokens`) an expert takes at most `ceil(tokens * k / experts * factor)` slots per call, the
//! first ones in token order; the others pass nothing (the block's residual carries their token), and the count is
//! reported and logged.
use tch::{nn, Kind, Tensor};

use super::{ExpertNames, ExpertParallel, Router, SwiGluExperts};
use crate::error::{Error, Result};

/// DeepSpeed-MoE's capacity: slots an expert takes per call, `max(min_capacity, ceil(tokens * k / experts *
/// factor))`, on the tokens this rank routes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// `capacity_factor` in training (`eval_capacity_factor` when evaluating: the caller picks).
    pub factor: f64,
    /// `min_capacity`.
    pub min: i64,
}

impl Capacity {
    /// Slots per expert for `slots` (tokens x k) over `experts`.
    pub fn per_expert(&self, slots: i64, experts: i64) -> i64 {
        ((slots as f64 / experts as f64 * self.factor).ceil() as i64).max(self.min)
    }
}

/// One call's result.
#[derive(Debug)]
pub struct MoeOutput {
    /// The layer's output, shaped as its input.
    pub output: Tensor,
    /// The router's logits, [tokens, experts]: for [`super::load_balancing_loss`].
    pub router_logits: Tensor,
    /// Slots each expert was chosen for on this rank's tokens (before any drop), `[experts]`.
    pub tokens_per_expert: Vec<i64>,
    /// Slots over capacity, which passed nothing (0 when dropless).
    pub dropped: i64,
}

/// Where a rank runs its experts' computation (given as a closure): at stage 3 with expert parallelism, inside
/// the engine's unit of its experts (`&mut |experts| engine.unit(&name, |_| experts())`).
pub type ExpertsScope<'a> = dyn FnMut(&dyn Fn() -> Tensor) -> Result<Tensor> + 'a;

/// A sparse mixture-of-experts block: Mixtral's `block_sparse_moe`, Qwen3-MoE's `mlp`.
#[derive(Debug)]
pub struct MoeLayer {
    /// The router (`gate.weight`).
    pub router: Router,
    /// Every expert of the layer (each rank holds them all; an expert-parallel group divides their compute).
    pub experts: SwiGluExperts,
    /// Every expert of the layer (across the group).
    pub num_experts: i64,
    /// DeepSpeed's capacity; None is dropless.
    pub capacity: Option<Capacity>,
}

impl MoeLayer {
    /// A layer under `path` (`gate.weight`, `experts.{i}.{names}.weight`) holding every expert: the router and
    /// each expert initialised as `nn::linear`'s, in that order.
    pub fn new(path: &nn::Path, names: ExpertNames, hidden: i64, ffn: i64, experts: i64, top_k: i64) -> MoeLayer {
        let router = Router::new(path, hidden, experts, top_k, true);
        let experts_here = SwiGluExperts::new(path, names, hidden, ffn, experts);
        MoeLayer { router, experts: experts_here, num_experts: experts, capacity: None }
    }

    /// With Qwen3-MoE's `norm_topk_prob` (Mixtral renormalises always).
    pub fn normalize_top_k(mut self, normalize: bool) -> MoeLayer {
        self.router.normalize = normalize;
        self
    }

    /// With DeepSpeed's capacity (tokens over it dropped).
    pub fn with_capacity(mut self, capacity: Capacity) -> MoeLayer {
        self.capacity = Some(capacity);
        self
    }

    /// The layer on `x` [..., hidden], every expert on this rank.
    pub fn forward(&self, x: &Tensor) -> Result<MoeOutput> {
        self.run(x, None, &mut |experts| Ok(experts()))
    }

    /// [`forward`](Self::forward) with the experts computed inside `scope`: at ZeRO stage 3, the unit of the
    /// layer's experts entered there (`&mut |experts| engine.unit(&name, |_| experts())`), as
    /// [`forward_parallel_scoped`](Self::forward_parallel_scoped) does over a group.
    pub fn forward_scoped(&self, x: &Tensor, scope: &mut ExpertsScope) -> Result<MoeOutput> {
        self.run(x, None, scope)
    }

    /// The layer on `x` [..., hidden] over the expert-parallel `group` of E ranks: every rank of the group calls
    /// it (the all-to-alls pair up), each with its own tokens, and rank g computes experts `g * experts / E ..
    /// (g + 1) * experts / E` for every token of the group that chose them.
    ///
    /// Every rank builds every expert's parameters (the same names and values on every rank). Inside a unit with
    /// other parameters (or at stage 0) the ZeRO engine treats them as any data-parallel parameter: its
    /// reduction adds the ranks' gradients, in which an expert's come only from the rank that computed it (the
    /// others have none, zeros), and divides by the data-parallel degree: the gradient of the whole batch's loss.
    /// At stages 1-3 with each position's experts a unit of their own ([`MoeLayer::expert_units`],
    /// [`forward_parallel_scoped`](Self::forward_parallel_scoped)) the engine splits such a unit over the ranks at
    /// that position only; the other ranks keep none of its values. Each rank runs experts / E experts on E times the rows per call (its share of the
    /// group's slots: on average as many as without the group).
    pub fn forward_parallel(&self, group: &ExpertParallel, x: &Tensor) -> Result<MoeOutput> {
        self.run(x, Some(group), &mut |experts| Ok(experts()))
    }

    /// [`forward_parallel`](Self::forward_parallel) with this rank's experts computed inside `scope`: at ZeRO
    /// stage 3 with `expert_parallel`, the unit of this rank's experts entered there (`scope` gets the computation
    /// and returns it run, e.g. `&mut |experts| engine.unit(&name, |_| experts())`), so the engine gathers only
    /// those experts, over the ranks that hold them ([`MoeLayer::expert_units`] names the units).
    pub fn forward_parallel_scoped(
        &self,
        group: &ExpertParallel,
        x: &Tensor,
        scope: &mut ExpertsScope,
    ) -> Result<MoeOutput> {
        self.run(x, Some(group), scope)
    }

    /// The units of a layer under `path` (its parameters' prefix, `model.layers.3.mlp`) with `experts` experts
    /// over expert-parallel groups of `ranks`: one per position, its experts' prefixes (`path.experts.{i}`). Put
    /// them in `EngineOptions::units` beside the model's other units; position g's name (its first prefix) is what
    /// the ranks at position g enter.
    pub fn expert_units(path: &str, experts: i64, ranks: usize) -> Vec<Vec<String>> {
        let per = experts as usize / ranks.max(1);
        (0..ranks).map(|g| (g * per..(g + 1) * per).map(|i| format!("{path}.experts.{i}")).collect()).collect()
    }

    /// The name this rank enters its experts' unit by (position `group.rank()` of [`MoeLayer::expert_units`]).
    pub fn own_expert_unit(path: &str, experts: i64, group: &ExpertParallel) -> String {
        Self::expert_units(path, experts, group.size())[group.rank()][0].clone()
    }

    fn run(&self, x: &Tensor, group: Option<&ExpertParallel>, scope: &mut ExpertsScope) -> Result<MoeOutput> {
        let shape = x.size();
        let hidden = *shape.last().ok_or_else(|| Error::Usage("mixture of experts: a scalar input".into()))?;
        if self.experts.count() != self.num_experts {
            return Err(Error::Usage(format!(
                "mixture of experts: the layer has {} experts but holds {}: every rank holds every expert",
                self.num_experts,
                self.experts.count()
            )));
        }
        if let Some(g) = group {
            if self.num_experts % g.size() as i64 != 0 {
                return Err(Error::Usage(format!(
                    "mixture of experts: {} experts do not split over an expert-parallel group of {} ranks",
                    self.num_experts,
                    g.size()
                )));
            }
        }
        let x = x.reshape([-1, hidden]);
        let routing = self.router.route(&x);
        let k = self.router.top_k;
        let (e, tokens) = (self.num_experts, x.size()[0]);
        // The (token, choice) slots sorted by expert; which token each is.
        let flat = routing.experts.reshape([-1]);
        let order = flat.argsort_stable(true, 0, false);
        let chosen = flat.bincount::<Tensor>(None, e);
        let tokens_per_expert = Vec::<i64>::try_from(&chosen).map_err(Error::Torch)?;
        let (order, per_expert, dropped) = match self.capacity {
            None => (order, tokens_per_expert.clone(), 0),
            Some(c) => {
                let cap = c.per_expert(tokens * k, e);
                // A slot's place among its expert's slots (they are consecutive after the sort).
                let starts = chosen.cumsum(0, Kind::Int64) - &chosen;
                let sorted_expert = flat.index_select(0, &order);
                let place =
                    Tensor::arange(tokens * k, (Kind::Int64, x.device())) - starts.index_select(0, &sorted_expert);
                let keep = place.lt(cap);
                let kept: Vec<i64> = tokens_per_expert.iter().map(|n| (*n).min(cap)).collect();
                let dropped = tokens_per_expert.iter().sum::<i64>() - kept.iter().sum::<i64>();
                if dropped > 0 {
                    tracing::debug!(dropped, capacity = cap, "mixture of experts: slots over capacity pass nothing");
                }
                (order.masked_select(&keep), kept, dropped)
            }
        };
        let token = order.divide_scalar_mode(k, "floor");
        let rows = x.index_select(0, &token);
        let outputs = match group {
            None => scope(&|| self.experts.forward_grouped(&rows, &per_expert, 0))?,
            Some(g) => self.through_group(g, &rows, &per_expert, scope)?,
        };
        let weights = routing.weights.reshape([-1]).index_select(0, &order).unsqueeze(1);
        let output = x.zeros_like().index_add(0, &token, &(outputs * weights));
        Ok(MoeOutput {
            output: output.reshape(shape.as_slice()),
            router_logits: routing.logits,
            tokens_per_expert,
            dropped,
        })
    }

    /// Rows sorted by expert (`per_expert[i]` for global expert i) to the ranks that compute their experts,
    /// through those experts, and back in the same order.
    fn through_group(
        &self,
        g: &ExpertParallel,
        rows: &Tensor,
        per_expert: &[i64],
        scope: &mut ExpertsScope,
    ) -> Result<Tensor> {
        // This rank computes `held` of the experts, from `first`.
        let (n, held) = (g.size(), (self.num_experts as usize) / g.size());
        let first = g.rank() * held;
        // What each rank sends each other: the counts for the receiver's experts.
        let arriving = g.exchange_counts(per_expert, held)?;
        let send: Vec<i64> = per_expert.chunks(held).map(|c| c.iter().sum()).collect();
        let recv: Vec<i64> = arriving.chunks(held).map(|c| c.iter().sum()).collect();
        let received = g.all_to_all_rows(rows, &send, &recv)?;
        // Arrived source by source, each sorted by expert: regrouped expert by expert (each expert's rows in
        // source order), and the inverse order for the way back.
        let mut start = 0i64;
        let mut segments = vec![(0i64, 0i64); n * held];
        for p in 0..n {
            for e in 0..held {
                let len = arriving[p * held + e];
                segments[p * held + e] = (start, len);
                start += len;
            }
        }
        let mut grouped = Vec::with_capacity(start as usize);
        for e in 0..held {
            for p in 0..n {
                let (s, len) = segments[p * held + e];
                grouped.extend(s..s + len);
            }
        }
        let device = rows.device();
        let index = Tensor::from_slice(&grouped).to_device(device);
        let rows_per_held: Vec<i64> = (0..held).map(|e| (0..n).map(|p| arriving[p * held + e]).sum()).collect();
        let grouped_rows = received.index_select(0, &index);
        let computed = scope(&|| self.experts.forward_grouped(&grouped_rows, &rows_per_held, first))?;
        let back = computed.zeros_like().index_copy(0, &index, &computed);
        g.all_to_all_rows(&back, &recv, &send)
    }
}
