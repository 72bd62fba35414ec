//! The router: a bias-free linear map from a token to one logit per expert, a softmax in fp32 and the top k
//! (transformers' Mixtral and Qwen3-MoE blocks, op for op), and the load-balancing loss transformers adds to the
//! language-model loss (`router_aux_loss_coef` times it).
use tch::{nn, Kind, Tensor};

/// Each token's experts and weights.
#[derive(Debug)]
pub struct Routing {
    /// The gate's logits, [tokens, experts], in the model's dtype: what [`load_balancing_loss`] reads.
    pub logits: Tensor,
    /// The top-k experts of each token, [tokens, k], best first.
    pub experts: Tensor,
    /// Their weights, [tokens, k], in the model's dtype: the softmax's top-k probabilities, renormalised to sum to
    /// one when the router says so.
    pub weights: Tensor,
}

/// A top-k softmax router.
#[derive(Debug)]
pub struct Router {
    /// The gate's weight, [experts, hidden] (`gate.weight`).
    pub weight: Tensor,
    /// Experts per token.
    pub top_k: i64,
    /// Top-k weights renormalised to sum to one: Mixtral always, Qwen3-MoE as `norm_topk_prob` says.
    pub normalize: bool,
    /// The auxiliary-loss-free balancing bias (DeepSeek-V3), `[experts]`, fp32: added to the probabilities to choose
    /// the experts only (the weights stay the probabilities), moved by [`Router::update_bias`], not by gradients.
    pub bias: Option<Tensor>,
}

impl Router {
    /// `gate.weight` [experts, hidden] under `path`, initialised as `nn::linear`'s.
    pub fn new(path: &nn::Path, hidden: i64, experts: i64, top_k: i64, normalize: bool) -> Router {
        assert!(top_k >= 1 && top_k <= experts, "router: top_k {top_k} must be within 1..={experts} experts");
        let gate = nn::linear(path / "gate", hidden, experts, nn::LinearConfig { bias: false, ..Default::default() });
        Router { weight: gate.ws, top_k, normalize, bias: None }
    }

    /// Experts the router chooses among.
    pub fn experts(&self) -> i64 {
        self.weight.size()[0]
    }

    /// Turns on the auxiliary-loss-free balancing bias (zeros at first).
    pub fn with_bias(mut self) -> Router {
        self.bias = Some(Tensor::zeros([self.experts()], (Kind::Float, self.weight.device())));
        self
    }

    /// Routes the tokens `x` [tokens, hidden].
    pub fn route(&self, x: &Tensor) -> Routing {
        let logits = x.matmul(&self.weight.tr());
        let probs = logits.softmax(-1, Kind::Float);
        let (weights, experts) = match &self.bias {
            None => probs.topk(self.top_k, -1, true, true),
            Some(b) => {
                let (_, experts) = tch::no_grad(|| (&probs + b).topk(self.top_k, -1, true, true));
                (probs.gather(-1, &experts, false), experts)
            }
        };
        let weights = if self.normalize { &weights / weights.sum_dim_intlist(-1, true, Kind::Float) } else { weights };
        Routing { logits, experts, weights: weights.to_kind(x.kind()) }
    }

    /// DeepSeek-V3's bias update: each expert's bias moves by `rate` toward balance, up when it received fewer
    /// than the mean tokens, down when more. `tokens_per_expert` (`[experts]`) is what the step routed: summed over the
    /// data-parallel ranks first, so that every rank's bias moves alike.
    pub fn update_bias(&self, tokens_per_expert: &Tensor, rate: f64) {
        if let Some(b) = &self.bias {
            let load = tokens_per_expert.to_kind(Kind::Float).to_device(b.device());
            let step = (load.mean(Kind::Float) - load).sign() * rate;
            tch::no_grad(|| {
                let _ = b.shallow_clone().g_add_(&step);
            });
        }
    }
}

/// transformers' `load_balancing_loss_func` without an attention mask: over every layer's router logits together
/// (concatenated), the fraction of tokens that chose each expert among their top k ([k, experts]) times each
/// expert's mean probability, summed, times the number of experts. Its gradient flows through the probabilities.
pub fn load_balancing_loss(logits: &[&Tensor], experts: i64, top_k: i64) -> Tensor {
    let all = Tensor::cat(logits, 0);
    let probs = all.softmax(-1, all.kind());
    let (_, chosen) = probs.topk(top_k, -1, true, true);
    let mask = chosen.one_hot(experts).to_kind(Kind::Float);
    let tokens_per_expert = mask.mean_dim(0, false, Kind::Float);
    let prob_per_expert = probs.mean_dim(0, false, probs.kind());
    (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum(probs.kind()) * experts as f64
}
