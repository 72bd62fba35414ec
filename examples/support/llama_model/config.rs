//! The model's configuration: transformers' config.json keys, checked, and the sizes they give.
use std::path::Path;

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
