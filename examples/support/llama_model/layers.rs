//! The layers, the whole model and its losses, as transformers computes them.
use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use zerorun::runtime::moe::{load_balancing_loss, ExpertNames, ExpertParallel, ExpertsScope, MoeLayer};
use zerorun::runtime::sequence::SequenceParallel;

use super::*;

/// transformers' `_init_weights` for Llama: normal(0, 0.02) weights, RMSNorm weights of one.
fn weight(p: &nn::Path, name: &str, out_dim: i64, in_dim: i64) -> Tensor {
    p.var(name, &[out_dim, in_dim], nn::Init::Randn { mean: 0.0, stdev: 0.02 })
}

/// `LlamaRMSNorm`: x / sqrt(mean(x²) + eps) in fp32, back to the input's dtype, times the weight.
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(p: nn::Path, dim: i64, eps: f64) -> RmsNorm {
        RmsNorm { weight: p.var("weight", &[dim], nn::Init::Const(1.0)), eps }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let h = x.to_kind(Kind::Float);
        let variance = h.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = (h * (variance + self.eps).rsqrt()).to_kind(kind);
        &self.weight * normed
    }
}

/// The rotary embedding's cos and sin for positions 0..t, [t, head_dim], computed in fp32 (transformers'
/// `LlamaRotaryEmbedding` with the default rope type), in `kind`.
fn rotary(t: i64, head_dim: i64, theta: f64, kind: Kind, device: tch::Device) -> (Tensor, Tensor) {
    rotary_at(&Tensor::arange(t, (Kind::Int64, device)), head_dim, theta, kind)
}

/// [`rotary`] at the sequence's `positions` [t] (a ring-attention rank's tokens are not positions 0..t).
fn rotary_at(positions: &Tensor, head_dim: i64, theta: f64, kind: Kind) -> (Tensor, Tensor) {
    let device = positions.device();
    let exponents =
        Tensor::arange_start_step(0, head_dim, 2, (Kind::Int64, device)).to_kind(Kind::Float) / head_dim as f64;
    let inv_freq = Tensor::pow_scalar(theta, &exponents).reciprocal();
    let positions = positions.to_kind(Kind::Float);
    let freqs = positions.unsqueeze(1) * inv_freq.unsqueeze(0);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
}

/// (-x2, x1) of the halves of the last dimension.
fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size().last().copied().unwrap() / 2;
    Tensor::cat(&[x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)], -1)
}

/// Causal grouped-query attention of queries [b, heads, t, hd] over keys and values [b, kv_heads, t, hd], rotary
/// positions applied to both: the heads' outputs side by side, [b, t, heads · hd]. libtorch's
/// scaled_dot_product_attention, as transformers' default (`attn_implementation="sdpa"`): scores scaled by
/// hd^-1/2, each key/value head serving heads / kv_heads queries; on a CPU its flash kernel keeps a log-sum-exp per
/// query for backward rather than the t x t probabilities, so activations grow linearly with the sequence.
pub(super) fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, theta: f64) -> Tensor {
    let (b, heads, t, hd) = q.size4().unwrap();
    let kv_heads = k.size()[1];
    let (cos, sin) = rotary(t, hd, theta, q.kind(), q.device());
    let q = q * &cos + rotate_half(q) * &sin;
    let k = k * &cos + rotate_half(k) * &sin;
    let expand = |kv: &Tensor| match heads / kv_heads {
        1 => kv.shallow_clone(),
        r => kv.unsqueeze(2).expand([b, kv_heads, r, t, hd], false).reshape([b, heads, t, hd]),
    };
    let (k, v) = (expand(&k), expand(v));
    let scale = 1.0 / (hd as f64).sqrt();
    Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, scale, false)
        .transpose(1, 2)
        .contiguous()
        .view([b, t, heads * hd])
}

/// How attention meets the rest of a sequence split over a group's ranks: Ulysses (each rank a slice; all-to-alls
/// trade it for heads of the whole sequence) or ring attention (each rank a head and a tail chunk; key/value blocks
/// travel around the ring; for heads that do not divide over the group).
#[derive(Clone, Copy)]
pub enum SplitAttention<'a> {
    Ulysses(&'a SequenceParallel),
    Ring(&'a SequenceParallel),
}

/// The groups a decoder layer's parts run over besides the data-parallel ranks: attention over a
/// sequence-parallel group, the experts over an expert-parallel one.
#[derive(Clone, Copy, Default)]
pub struct Groups<'a> {
    pub sequence: Option<SplitAttention<'a>>,
    pub experts: Option<&'a ExpertParallel>,
}

impl SplitAttention<'_> {
    /// This rank's tokens of `x` along `dim`.
    pub fn part(&self, x: &Tensor, dim: i64) -> Result<Tensor, zerorun::Error> {
        match self {
            SplitAttention::Ulysses(g) => zerorun::runtime::sequence::slice(g, x, dim),
            SplitAttention::Ring(g) => zerorun::runtime::sequence::ring_slice(g, x, dim),
        }
    }

    pub fn group(&self) -> &SequenceParallel {
        match self {
            SplitAttention::Ulysses(g) | SplitAttention::Ring(g) => g,
        }
    }
}

/// A decoder layer's feed-forward part: Llama's SwiGLU MLP (`mlp.{gate,up,down}_proj`), or a sparse mixture of
/// experts (Mixtral's `block_sparse_moe`, Qwen3-MoE's `mlp`: a router and SwiGLU experts, zerorun's `MoeLayer`).
pub enum FeedForward {
    Dense { gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor },
    Experts(MoeLayer),
}

/// One decoder layer: pre-norm grouped-query attention with rotary positions (Qwen3-MoE: each head's queries and
/// keys RMS-normed first), then a pre-norm feed-forward part, each added to the residual stream.
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    post_attention_layernorm: RmsNorm,
    feed_forward: FeedForward,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    theta: f64,
}

impl DecoderLayer {
    /// Variables under `p` (`model.layers.{i}`), in transformers' order of creation.
    pub fn new(p: nn::Path, c: &LlamaConfig, i: i64) -> DecoderLayer {
        let (h, hd) = (c.hidden_size, c.head_dim());
        let attn = &p / "self_attn";
        let q_proj = weight(&(&attn / "q_proj"), "weight", c.num_attention_heads * hd, h);
        let k_proj = weight(&(&attn / "k_proj"), "weight", c.kv_heads() * hd, h);
        let v_proj = weight(&(&attn / "v_proj"), "weight", c.kv_heads() * hd, h);
        let o_proj = weight(&(&attn / "o_proj"), "weight", h, c.num_attention_heads * hd);
        let (q_norm, k_norm) = match c.model_type.as_str() {
            "qwen3_moe" => (
                Some(RmsNorm::new(&attn / "q_norm", hd, c.rms_norm_eps)),
                Some(RmsNorm::new(&attn / "k_norm", hd, c.rms_norm_eps)),
            ),
            _ => (None, None),
        };
        let feed_forward = match c.experts() {
            Some(experts) if c.sparse_layer(i) => {
                let (block, names) = match c.model_type.as_str() {
                    "mixtral" => (&p / "block_sparse_moe", ExpertNames::Mixtral),
                    _ => (&p / "mlp", ExpertNames::GateUpDown),
                };
                let layer = MoeLayer::new(&block, names, h, c.expert_ffn(), experts, c.top_k())
                    .normalize_top_k(c.model_type == "mixtral" || c.moe.norm_topk_prob.unwrap_or(false));
                // transformers' initialisation (normal(0, 0.02)), in the order the layer made them.
                tch::no_grad(|| {
                    let _ = layer.router.weight.shallow_clone().normal_(0.0, 0.02);
                    for w in layer.experts.weights.iter().flatten() {
                        let _ = w.shallow_clone().normal_(0.0, 0.02);
                    }
                });
                FeedForward::Experts(layer)
            }
            _ => {
                let mlp = &p / "mlp";
                FeedForward::Dense {
                    gate_proj: weight(&(&mlp / "gate_proj"), "weight", c.intermediate_size, h),
                    up_proj: weight(&(&mlp / "up_proj"), "weight", c.intermediate_size, h),
                    down_proj: weight(&(&mlp / "down_proj"), "weight", h, c.intermediate_size),
                }
            }
        };
        DecoderLayer {
            input_layernorm: RmsNorm::new(&p / "input_layernorm", h, c.rms_norm_eps),
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            post_attention_layernorm: RmsNorm::new(&p / "post_attention_layernorm", h, c.rms_norm_eps),
            feed_forward,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: hd,
            theta: c.rope_theta,
        }
    }

    /// Attention of `x` [b, t, hidden]; with a sequence-parallel group `x` is this rank's part of the sequence,
    /// and the heads meet the whole sequence by Ulysses' all-to-alls or around the ring.
    fn attention(&self, x: &Tensor, sp: Option<SplitAttention<'_>>) -> Tensor {
        let (b, t, _) = x.size3().unwrap();
        // [b, t, n, head_dim], each head's queries and keys normed first (Qwen3).
        let heads = |w: &Tensor, n: i64, norm: &Option<RmsNorm>| {
            let y = x.linear::<Tensor>(w, None).view([b, t, n, self.head_dim]);
            match norm {
                Some(norm) => norm.forward(&y),
                None => y,
            }
        };
        let (q, k, v) = (
            heads(&self.q_proj, self.heads, &self.q_norm),
            heads(&self.k_proj, self.kv_heads, &self.k_norm),
            heads(&self.v_proj, self.kv_heads, &None),
        );
        let attend = |q: &Tensor, k: &Tensor, v: &Tensor| causal_attention(q, k, v, self.theta);
        let out = match sp {
            None => attend(&q.transpose(1, 2), &k.transpose(1, 2), &v.transpose(1, 2)),
            Some(SplitAttention::Ulysses(g)) => zerorun::runtime::sequence::ulysses_attention(g, &q, &k, &v, attend)
                .unwrap_or_else(|e| panic!("sequence parallel attention: {e}")),
            Some(SplitAttention::Ring(g)) => {
                // This rank's head-and-tail chunks, rotated at their positions of the whole sequence.
                let positions = zerorun::runtime::sequence::ring_positions(g, t * g.size() as i64)
                    .unwrap_or_else(|e| panic!("ring attention: {e}"))
                    .to_device(x.device());
                let (cos, sin) = rotary_at(&positions, self.head_dim, self.theta, q.kind());
                let rope = |y: &Tensor| {
                    let y = y.transpose(1, 2);
                    &y * &cos + rotate_half(&y) * &sin
                };
                zerorun::runtime::sequence::ring_attention(g, &rope(&q), &rope(&k), &v.transpose(1, 2), &positions)
                    .unwrap_or_else(|e| panic!("ring attention: {e}"))
            }
        };
        out.linear::<Tensor>(&self.o_proj, None)
    }

    /// The layer's output, and its router's logits [tokens, experts] when it has experts.
    pub fn forward_routed(&self, x: &Tensor) -> (Tensor, Option<Tensor>) {
        self.forward_in(x, Groups::default())
    }

    /// [`DecoderLayer::forward_routed`] over `groups`: on this rank's part of the sequence of a sequence-parallel
    /// group, the experts computed over an expert-parallel group.
    pub fn forward_in(&self, x: &Tensor, groups: Groups<'_>) -> (Tensor, Option<Tensor>) {
        self.forward_scoped(x, groups, &mut |experts| Ok(experts()))
    }

    /// [`DecoderLayer::forward_in`] with this rank's experts computed inside `scope` (at stage 3 with expert
    /// parallelism, the engine's unit of this rank's experts: `MoeLayer::forward_parallel_scoped`).
    pub fn forward_scoped(&self, x: &Tensor, groups: Groups<'_>, scope: &mut ExpertsScope) -> (Tensor, Option<Tensor>) {
        let h = x + self.attention(&self.input_layernorm.forward(x), groups.sequence);
        let n = self.post_attention_layernorm.forward(&h);
        match &self.feed_forward {
            FeedForward::Dense { gate_proj, up_proj, down_proj } => {
                let gated = n.linear::<Tensor>(gate_proj, None).silu() * n.linear::<Tensor>(up_proj, None);
                (&h + gated.linear::<Tensor>(down_proj, None), None)
            }
            FeedForward::Experts(moe) => {
                let out = match groups.experts {
                    None => moe.forward_scoped(&n, scope),
                    Some(g) => moe.forward_parallel_scoped(g, &n, scope),
                }
                .unwrap_or_else(|e| panic!("mixture of experts: {e}"));
                (&h + out.output, Some(out.router_logits))
            }
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.forward_routed(x).0
    }
}

/// Where each decoder layer's router logits go during a forward, for the load-balancing loss: shared by the
/// layers' units and the loss (cleared before each forward).
#[derive(Clone, Default)]
pub struct RouterLogits(std::sync::Arc<std::sync::Mutex<Vec<Tensor>>>);

impl RouterLogits {
    pub fn push(&self, logits: Tensor) {
        self.0.lock().unwrap().push(logits);
    }

    /// The logits since the last take, emptied.
    pub fn take(&self) -> Vec<Tensor> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// transformers' training loss: the mean next-token cross-entropy, plus `router_aux_loss_coef` times the
/// load-balancing loss over every sparse layer's router logits (when `output_router_logits`).
pub fn loss_with_aux(c: &LlamaConfig, logits: &Tensor, targets: &Tensor, router: &[Tensor]) -> Tensor {
    let ce = loss(logits, targets);
    match c.experts() {
        Some(e) if c.aux_loss_coef() != 0.0 && !router.is_empty() => {
            let all: Vec<&Tensor> = router.iter().collect();
            ce + load_balancing_loss(&all, e, c.top_k()).to_kind(Kind::Float) * c.aux_loss_coef()
        }
        _ => ce,
    }
}

/// The token embedding (`model.embed_tokens`).
pub fn embedding(root: &nn::Path, c: &LlamaConfig) -> nn::Embedding {
    let config = nn::EmbeddingConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: 0.02 }, ..Default::default() };
    nn::embedding(root / "model" / "embed_tokens", c.vocab_size, c.hidden_size, config)
}

/// The final norm and the output projection: `lm_head.weight`, or the embedding's weight when tied.
pub struct Head {
    norm: RmsNorm,
    lm_head: Tensor,
}

impl Head {
    /// `tied`: the embedding's weight (tie_word_embeddings), else a new `lm_head.weight`.
    pub fn new(root: &nn::Path, c: &LlamaConfig, tied: Option<&Tensor>) -> Head {
        let norm = RmsNorm::new(root / "model" / "norm", c.hidden_size, c.rms_norm_eps);
        let lm_head = match tied {
            Some(w) => w.shallow_clone(),
            None => weight(&(root / "lm_head"), "weight", c.vocab_size, c.hidden_size),
        };
        Head { norm, lm_head }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.norm.forward(x).linear::<Tensor>(&self.lm_head, None)
    }
}

/// The model's units for ZeRO stage 3 (parameter-name prefixes, in execution order): the embedding, one per
/// decoder layer, the final norm with the head. Tied embeddings use the embedding at both ends, which a unit walk
/// cannot gather twice: the whole model is then one unit.
pub fn unit_prefixes(c: &LlamaConfig) -> Vec<Vec<String>> {
    if c.tie_word_embeddings {
        return vec![vec!["model".to_string()]];
    }
    let mut units = vec![vec!["model.embed_tokens".to_string()]];
    units.extend((0..c.num_hidden_layers).map(|i| vec![format!("model.layers.{i}")]));
    units.push(vec!["model.norm".to_string(), "lm_head".to_string()]);
    units
}

/// The whole model built at once (for tests and tools that hold it whole).
pub struct Llama {
    pub(super) embed: nn::Embedding,
    /// Shared: a checkpointed layer's recomputation holds its own.
    pub(super) layers: Vec<std::rc::Rc<DecoderLayer>>,
    pub(super) head: Head,
}

impl Llama {
    pub fn new(root: &nn::Path, c: &LlamaConfig) -> Llama {
        let embed = embedding(root, c);
        let layers =
            (0..c.num_hidden_layers).map(|i| DecoderLayer::new(root / "model" / "layers" / i, c, i).into()).collect();
        let head = Head::new(root, c, c.tie_word_embeddings.then_some(&embed.ws));
        Llama { embed, layers, head }
    }

    /// Logits [b, t, vocab] of token ids [b, t].
    pub fn forward(&self, ids: &Tensor) -> Tensor {
        self.forward_routed(ids).0
    }

    /// Logits and the sparse layers' router logits, in layer order.
    pub fn forward_routed(&self, ids: &Tensor) -> (Tensor, Vec<Tensor>) {
        self.forward_in(ids, Groups::default())
    }

    /// [`Llama::forward_routed`] of this rank's part of the sequence of a sequence-parallel group.
    pub fn forward_in(&self, ids: &Tensor, groups: Groups<'_>) -> (Tensor, Vec<Tensor>) {
        let mut h = self.embed.forward(ids);
        let mut router = Vec::new();
        for layer in &self.layers {
            let (out, logits) = layer.forward_in(&h, groups);
            h = out;
            router.extend(logits);
        }
        (self.head.forward(&h), router)
    }
}

/// The summed next-token cross-entropy of `logits` [b, t, vocab] against `targets` [b, t], in fp32 (a sequence
/// slice's part of the rows' loss).
pub fn token_loss_sum(logits: &Tensor, targets: &Tensor) -> Tensor {
    let vocab = *logits.size().last().unwrap();
    logits.to_kind(Kind::Float).reshape([-1, vocab]).cross_entropy_loss::<Tensor>(
        &targets.reshape([-1]),
        None,
        tch::Reduction::Sum,
        -100,
        0.0,
    )
}

/// The mean next-token cross-entropy of `logits` [b, t, vocab] against `targets` [b, t], in fp32.
pub fn loss(logits: &Tensor, targets: &Tensor) -> Tensor {
    let vocab = *logits.size().last().unwrap();
    logits.to_kind(Kind::Float).reshape([-1, vocab]).cross_entropy_for_logits(&targets.reshape([-1]))
}
