//! Llama's architecture in tch, as transformers' `LlamaForCausalLM` computes it: RMSNorm, rotary position
//! embeddings, grouped-query attention, a SwiGLU MLP, tied or untied embeddings. Variable names are transformers'
//! state-dict names, so a Hugging Face checkpoint loads by name and the trained model goes back in its form.
//! Shared by examples/llama/ and the tests.
#![allow(dead_code)]
use std::path::Path;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use zerorun::runtime::moe::{load_balancing_loss, ExpertNames, ExpertParallel, ExpertsScope, MoeLayer};
use zerorun::runtime::sequence::SequenceParallel;

/// The keys of transformers' `LlamaConfig` this model reads (config.json). Options it does not implement are
/// refused by name rather than ignored.
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
pub struct LlamaConfig {
    #[serde(default = "llama")]
    pub model_type: String,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    /// Grouped-query attention's key/value heads (the attention heads when absent).
    #[serde(default)]
    pub num_key_value_heads: Option<i64>,
    /// Per-head width (hidden / heads when absent).
    #[serde(default)]
    pub head_dim: Option<i64>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_positions")]
    pub max_position_embeddings: i64,
    #[serde(default = "silu")]
    pub hidden_act: String,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Mixtral's and Qwen3-MoE's keys (absent for Llama).
    #[serde(flatten)]
    pub moe: MoeKeys,
}

/// The mixture-of-experts keys of transformers' `MixtralConfig` and `Qwen3MoeConfig`; absent ones take that
/// model type's default.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
pub struct MoeKeys {
    /// Mixtral's experts per layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_local_experts: Option<i64>,
    /// Qwen3-MoE's experts per layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<i64>,
    /// Qwen3-MoE's expert width (the dense MLP's is `intermediate_size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_intermediate_size: Option<i64>,
    /// Qwen3-MoE: renormalise the top-k weights (Mixtral always does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_topk_prob: Option<bool>,
    /// Qwen3-MoE: every this many layers is sparse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoder_sparse_step: Option<i64>,
    /// Qwen3-MoE: layers with a dense MLP.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mlp_only_layers: Vec<i64>,
    /// The load-balancing loss's weight in the loss (when `output_router_logits`, as transformers adds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_aux_loss_coef: Option<f64>,
    #[serde(default)]
    pub output_router_logits: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_jitter_noise: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<serde_json::Value>,
    #[serde(default)]
    pub use_sliding_window: bool,
}

fn llama() -> String {
    "llama".into()
}
fn silu() -> String {
    "silu".into()
}
fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_positions() -> i64 {
    2048
}

impl LlamaConfig {
    /// Reads and checks `DIR/config.json`; the error names the file and the key.
    pub fn from_dir(dir: &Path) -> Result<LlamaConfig, String> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let config: LlamaConfig =
            serde_json::from_str(&text).map_err(|e| format!("{}: not a Llama config.json: {e}", path.display()))?;
        config.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(config)
    }

    /// Refuses what this model does not compute.
    pub fn check(&self) -> Result<(), String> {
        if !["llama", "mixtral", "qwen3_moe"].contains(&self.model_type.as_str()) {
            return Err(format!(
                "model_type {:?} is not supported: this example implements Llama, Mixtral and Qwen3-MoE (model_type \"llama\", \"mixtral\", \"qwen3_moe\")",
                self.model_type
            ));
        }
        if let Some(e) = self.experts() {
            let k = self.top_k();
            if e < 1 || k < 1 || k > e {
                return Err(format!("num_experts_per_tok ({k}) must be within 1..={e} experts"));
            }
            if self.moe.router_jitter_noise.is_some_and(|j| j != 0.0) {
                return Err("router_jitter_noise is not supported (0 only)".into());
            }
        }
        let window = self.moe.sliding_window.as_ref().filter(|v| !v.is_null());
        let windowed = match self.model_type.as_str() {
            "qwen3_moe" => self.moe.use_sliding_window,
            _ => window.is_some(),
        };
        if windowed {
            return Err(format!(
                "sliding_window {} is not supported (full causal attention only)",
                window.map_or("set".into(), |w| w.to_string())
            ));
        }
        if let Some(scaling) = self.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            return Err(format!("rope_scaling {scaling} is not supported (only the default rotary embedding)"));
        }
        if self.hidden_act != "silu" {
            return Err(format!("hidden_act {:?} is not supported (Llama's is \"silu\")", self.hidden_act));
        }
        if self.attention_bias || self.mlp_bias {
            return Err("attention_bias and mlp_bias are not supported (Llama has no biases)".into());
        }
        let heads = self.num_attention_heads;
        if heads <= 0 || self.kv_heads() <= 0 || heads % self.kv_heads() != 0 {
            return Err(format!(
                "num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({})",
                self.kv_heads()
            ));
        }
        if self.head_dim.is_none() && self.hidden_size % heads != 0 {
            return Err(format!("hidden_size ({}) must divide into num_attention_heads ({heads})", self.hidden_size));
        }
        if self.head_dim() % 2 != 0 {
            return Err(format!("head_dim ({}) must be even (rotary embeddings rotate pairs)", self.head_dim()));
        }
        Ok(())
    }

    pub fn kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> i64 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Experts per sparse layer (None for Llama).
    pub fn experts(&self) -> Option<i64> {
        match self.model_type.as_str() {
            "mixtral" => Some(self.moe.num_local_experts.unwrap_or(8)),
            "qwen3_moe" => Some(self.moe.num_experts.unwrap_or(128)),
            _ => None,
        }
    }

    /// Experts each token goes to.
    pub fn top_k(&self) -> i64 {
        self.moe.num_experts_per_tok.unwrap_or(if self.model_type == "mixtral" { 2 } else { 8 })
    }

    /// Whether decoder layer `i` has experts (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`).
    pub fn sparse_layer(&self, i: i64) -> bool {
        match self.model_type.as_str() {
            "mixtral" => true,
            "qwen3_moe" => {
                let step = self.moe.decoder_sparse_step.unwrap_or(1);
                !self.moe.mlp_only_layers.contains(&i) && self.experts().unwrap_or(0) > 0 && (i + 1) % step == 0
            }
            _ => false,
        }
    }

    /// An expert's width.
    pub fn expert_ffn(&self) -> i64 {
        match self.model_type.as_str() {
            "qwen3_moe" => self.moe.moe_intermediate_size.unwrap_or(768),
            _ => self.intermediate_size,
        }
    }

    /// The load-balancing loss's weight in the training loss: 0 unless `output_router_logits` (transformers adds
    /// it only then).
    pub fn aux_loss_coef(&self) -> f64 {
        match self.experts() {
            Some(_) if self.moe.output_router_logits => self.moe.router_aux_loss_coef.unwrap_or(0.001),
            _ => 0.0,
        }
    }

    /// The config.json transformers writes for this shape (for a model made here, without `--hf`).
    pub fn to_json(&self) -> serde_json::Value {
        let architecture = match self.model_type.as_str() {
            "mixtral" => "MixtralForCausalLM",
            "qwen3_moe" => "Qwen3MoeForCausalLM",
            _ => "LlamaForCausalLM",
        };
        let mut json = serde_json::json!({
            "architectures": [architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.kv_heads(),
            "head_dim": self.head_dim(),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
        });
        if let (Some(map), serde_json::Value::Object(moe)) =
            (json.as_object_mut(), serde_json::to_value(&self.moe).expect("keys serialize"))
        {
            map.extend(moe);
        }
        json
    }

    /// Parameters of the model.
    pub fn parameters(&self) -> i64 {
        let (h, hd) = (self.hidden_size, self.head_dim());
        let attention = h * hd * (2 * self.num_attention_heads + 2 * self.kv_heads());
        let qk_norms = if self.model_type == "qwen3_moe" { 2 * hd } else { 0 };
        let layers: i64 = (0..self.num_hidden_layers)
            .map(|i| {
                let mlp = match self.experts() {
                    Some(e) if self.sparse_layer(i) => e * h + e * 3 * h * self.expert_ffn(),
                    _ => 3 * h * self.intermediate_size,
                };
                attention + qk_norms + mlp + 2 * h
            })
            .sum();
        let head = if self.tie_word_embeddings { 0 } else { self.vocab_size * h };
        self.vocab_size * h + layers + h + head
    }
}

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
fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, theta: f64) -> Tensor {
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
                    None => moe.forward(&n),
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
    embed: nn::Embedding,
    layers: Vec<DecoderLayer>,
    head: Head,
}

impl Llama {
    pub fn new(root: &nn::Path, c: &LlamaConfig) -> Llama {
        let embed = embedding(root, c);
        let layers = (0..c.num_hidden_layers).map(|i| DecoderLayer::new(root / "model" / "layers" / i, c, i)).collect();
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

/// Stage 3 with expert parallelism: the model's units as scopes of its own forward, each layer's experts of one
/// expert-parallel position a unit of their own (split by the engine over the ranks at that position), and the
/// forward that enters them: the embedding, each layer (its attention, norms and router), inside it this rank's
/// experts, then the norm with the head. Untied embeddings.
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
    /// the engine's ranks; the experts' all-to-alls over `groups.experts`).
    pub fn forward_units(
        &self,
        engine: &mut zerorun::Engine,
        units: &ScopedUnits,
        ids: &Tensor,
        groups: Groups<'_>,
    ) -> Result<(Tensor, Vec<Tensor>), zerorun::Error> {
        let mut h = engine.unit("model.embed_tokens", |_| self.embed.forward(ids))?;
        let mut router = Vec::new();
        for (layer, (name, mine)) in self.layers.iter().zip(&units.layers) {
            let (out, logits) = engine.unit(name, |e| match mine {
                Some(mine) => layer.forward_scoped(&h, groups, &mut |experts| e.unit(mine, |_| experts())),
                None => layer.forward_in(&h, groups),
            })?;
            h = out;
            router.extend(logits);
        }
        Ok((engine.unit("model.norm", |_| self.head.forward(&h))?, router))
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

/// The model as pipeline layers (the embedding, each decoder layer, the norm with the head), transformers' names,
/// the loss the mean next-token cross-entropy. Untied only: the embedding and the head sit on different stages.
pub fn pipeline_model<'a>(c: &LlamaConfig) -> zerorun::PipelineModel<'a> {
    let c = c.clone();
    let mut model = zerorun::PipelineModel::new(loss).layer("model.embed_tokens", {
        let c = c.clone();
        move |p: &nn::Path| {
            let embed = embedding(p, &c);
            Box::new(move |x: &Tensor| embed.forward(x))
        }
    });
    for i in 0..c.num_hidden_layers {
        let c = c.clone();
        model = model.layer(format!("model.layers.{i}"), move |p: &nn::Path| {
            let layer = DecoderLayer::new(p / "model" / "layers" / i, &c, i);
            Box::new(move |x: &Tensor| layer.forward(x))
        });
    }
    model.layer("head", move |p: &nn::Path| {
        let head = Head::new(p, &c, None);
        Box::new(move |x: &Tensor| head.forward(x))
    })
}

/// The model split across a tensor-parallel group (Megatron-LM's layout): query, key and value column-parallel by
/// heads (T divides the attention and the key/value heads), the output projection row-parallel; gate and up
/// column-parallel, down row-parallel (T divides the MLP's width); the embedding and the head vocabulary-parallel
/// (padded to a multiple of T when it does not split, the padding inert), the norms whole. The names are
/// transformers', each layer's split recorded where it is made, so a run starts from a Hugging Face folder
/// (`load_mapped_slices`) and its whole tensors go back to one.
pub mod tp {
    use tch::nn;
    use tch::{Kind, Tensor};
    use zerorun::runtime::tensor_parallel::{
        vocab_parallel_cross_entropy, ColumnParallelLinear, RowParallelLinear, TensorParallel, VocabParallelEmbedding,
    };

    use super::{causal_attention, LlamaConfig, RmsNorm};

    /// What T must divide; tied embeddings are refused (the head and the embedding split differently).
    pub fn check(c: &LlamaConfig, t: usize) -> Result<(), String> {
        let t = t as i64;
        if c.tie_word_embeddings {
            return Err("--tensor-parallel: tied embeddings are not supported (untie them, or run without)".into());
        }
        for (what, n) in [
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", c.kv_heads()),
            ("intermediate_size", c.intermediate_size),
        ] {
            if t == 0 || n % t != 0 {
                return Err(format!("--tensor-parallel {t} must divide {what} ({n})"));
            }
        }
        Ok(())
    }

    /// The vocabulary and what the parallel layers hold of it: padded to a multiple of T.
    fn vocab(c: &LlamaConfig, tp: &TensorParallel) -> (i64, i64) {
        let t = tp.size() as i64;
        (c.vocab_size, (c.vocab_size + t - 1) / t * t)
    }

    fn column(p: &nn::Path, tp: &TensorParallel, name: &str, in_dim: i64, out_dim: i64) -> ColumnParallelLinear {
        ColumnParallelLinear::new(&(p / name), tp, in_dim, out_dim, false, false)
    }

    /// A decoder layer with this rank's heads and part of the MLP: two all-reduces forward (the row-parallel sums)
    /// and two backward (the copies).
    pub struct TpDecoderLayer {
        input_layernorm: RmsNorm,
        q_proj: ColumnParallelLinear,
        k_proj: ColumnParallelLinear,
        v_proj: ColumnParallelLinear,
        o_proj: RowParallelLinear,
        post_attention_layernorm: RmsNorm,
        gate_proj: ColumnParallelLinear,
        up_proj: ColumnParallelLinear,
        down_proj: RowParallelLinear,
        heads: i64,
        kv_heads: i64,
        head_dim: i64,
        theta: f64,
    }

    impl TpDecoderLayer {
        pub fn new(p: nn::Path, tp: &TensorParallel, c: &LlamaConfig) -> TpDecoderLayer {
            let (h, hd, t) = (c.hidden_size, c.head_dim(), tp.size() as i64);
            let (attn, mlp) = (&p / "self_attn", &p / "mlp");
            TpDecoderLayer {
                input_layernorm: RmsNorm::new(&p / "input_layernorm", h, c.rms_norm_eps),
                q_proj: column(&attn, tp, "q_proj", h, c.num_attention_heads * hd),
                k_proj: column(&attn, tp, "k_proj", h, c.kv_heads() * hd),
                v_proj: column(&attn, tp, "v_proj", h, c.kv_heads() * hd),
                o_proj: RowParallelLinear::new(&(&attn / "o_proj"), tp, c.num_attention_heads * hd, h, false, true),
                post_attention_layernorm: RmsNorm::new(&p / "post_attention_layernorm", h, c.rms_norm_eps),
                gate_proj: column(&mlp, tp, "gate_proj", h, c.intermediate_size),
                up_proj: column(&mlp, tp, "up_proj", h, c.intermediate_size),
                down_proj: RowParallelLinear::new(&(&mlp / "down_proj"), tp, c.intermediate_size, h, false, true),
                heads: c.num_attention_heads / t,
                kv_heads: c.kv_heads() / t,
                head_dim: hd,
                theta: c.rope_theta,
            }
        }

        fn attention(&self, tp: &TensorParallel, x: &Tensor) -> Result<Tensor, zerorun::Error> {
            let (b, t, _) = x.size3().unwrap();
            let hd = self.head_dim;
            let copied = tp.copy_to_region(x)?;
            let heads =
                |l: &ColumnParallelLinear, n: i64| l.forward_copied(&copied).view([b, t, n, hd]).transpose(1, 2);
            let (q, k, v) = (
                heads(&self.q_proj, self.heads),
                heads(&self.k_proj, self.kv_heads),
                heads(&self.v_proj, self.kv_heads),
            );
            self.o_proj.forward(tp, &causal_attention(&q, &k, &v, self.theta))
        }

        pub fn forward(&self, tp: &TensorParallel, x: &Tensor) -> Result<Tensor, zerorun::Error> {
            let h = x + self.attention(tp, &self.input_layernorm.forward(x))?;
            let n = tp.copy_to_region(&self.post_attention_layernorm.forward(&h))?;
            let gated = self.gate_proj.forward_copied(&n).silu() * self.up_proj.forward_copied(&n);
            Ok(&h + self.down_proj.forward(tp, &gated)?)
        }
    }

    /// The vocabulary-parallel embedding (`model.embed_tokens`).
    pub fn embedding(root: &nn::Path, tp: &TensorParallel, c: &LlamaConfig) -> VocabParallelEmbedding {
        VocabParallelEmbedding::padded(&(root / "model" / "embed_tokens"), tp, vocab(c, tp), c.hidden_size)
    }

    /// The final norm and this rank's part of the head's logits.
    pub struct TpHead {
        norm: RmsNorm,
        lm_head: ColumnParallelLinear,
    }

    impl TpHead {
        pub fn new(root: &nn::Path, tp: &TensorParallel, c: &LlamaConfig) -> TpHead {
            let norm = RmsNorm::new(root / "model" / "norm", c.hidden_size, c.rms_norm_eps);
            let lm_head =
                ColumnParallelLinear::padded(&(root / "lm_head"), tp, c.hidden_size, vocab(c, tp), false, false);
            TpHead { norm, lm_head }
        }

        pub fn forward(&self, tp: &TensorParallel, x: &Tensor) -> Result<Tensor, zerorun::Error> {
            self.lm_head.forward(tp, &self.norm.forward(x))
        }
    }

    /// The mean next-token cross-entropy of this rank's part of the logits (its vocabulary rows from `start`).
    pub fn loss(
        tp: &TensorParallel,
        c: &LlamaConfig,
        logits: &Tensor,
        targets: &Tensor,
    ) -> Result<Tensor, zerorun::Error> {
        let start = tp.rank() as i64 * (vocab(c, tp).1 / tp.size() as i64);
        vocab_parallel_cross_entropy(tp, &logits.to_kind(Kind::Float), targets, start, c.vocab_size)
    }

    /// The whole split model as the engine's units (those of [`super::unit_prefixes`]).
    pub struct TpLlama<'a> {
        embed: VocabParallelEmbedding,
        layers: Vec<TpDecoderLayer>,
        head: TpHead,
        pub tp: &'a TensorParallel,
        pub config: LlamaConfig,
    }

    impl<'a> TpLlama<'a> {
        pub fn new(root: &nn::Path, tp: &'a TensorParallel, c: &LlamaConfig) -> TpLlama<'a> {
            TpLlama {
                embed: embedding(root, tp, c),
                layers: (0..c.num_hidden_layers)
                    .map(|i| TpDecoderLayer::new(root / "model" / "layers" / i, tp, c))
                    .collect(),
                head: TpHead::new(root, tp, c),
                tp,
                config: c.clone(),
            }
        }
    }

    impl zerorun::UnitModel for TpLlama<'_> {
        fn unit_prefixes(&self) -> Vec<Vec<String>> {
            super::unit_prefixes(&self.config)
        }

        /// A failed collective panics (the unit interface returns a tensor): under `zerorun launch` the job ends.
        fn forward_unit(&self, unit: usize, x: &Tensor) -> Tensor {
            let out = if unit == 0 {
                self.embed.forward(self.tp, x)
            } else if unit <= self.layers.len() {
                self.layers[unit - 1].forward(self.tp, x)
            } else {
                self.head.forward(self.tp, x)
            };
            out.unwrap_or_else(|e| panic!("tensor parallel, unit {unit}: {e}"))
        }
    }

    /// [`super::pipeline_model`] split across `tp`. A failed collective panics.
    pub fn pipeline_model<'a>(c: &LlamaConfig, tp: &'a TensorParallel) -> zerorun::PipelineModel<'a> {
        let c = c.clone();
        let failed = |what: &str, e: zerorun::Error| -> Tensor { panic!("tensor parallel, {what}: {e}") };
        let loss_config = c.clone();
        let mut model = zerorun::PipelineModel::new(move |logits: &Tensor, targets: &Tensor| {
            loss(tp, &loss_config, logits, targets).unwrap_or_else(|e| failed("loss", e))
        })
        .layer("model.embed_tokens", {
            let c = c.clone();
            move |p: &nn::Path| {
                let embed = embedding(p, tp, &c);
                Box::new(move |x: &Tensor| embed.forward(tp, x).unwrap_or_else(|e| failed("embedding", e)))
            }
        });
        for i in 0..c.num_hidden_layers {
            let c = c.clone();
            model = model.layer(format!("model.layers.{i}"), move |p: &nn::Path| {
                let layer = TpDecoderLayer::new(p / "model" / "layers" / i, tp, &c);
                Box::new(move |x: &Tensor| layer.forward(tp, x).unwrap_or_else(|e| failed("layer", e)))
            });
        }
        model.layer("head", move |p: &nn::Path| {
            let head = TpHead::new(p, tp, &c);
            Box::new(move |x: &Tensor| head.forward(tp, x).unwrap_or_else(|e| failed("head", e)))
        })
    }
}
