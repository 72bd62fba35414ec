//! What is trained: a transformer described by its shape, or a model measured by a memory report.
use serde::{Deserialize, Serialize};

use crate::PlanError;

/// A decoder-only transformer (GPT or Llama style, dense or Mixtral's mixture of experts), the keys `zerorun
/// estimate --model` reads.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Transformer {
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Attention heads.
    pub heads: u64,
    /// Key/value heads (grouped-query attention); `heads` without it.
    pub kv_heads: u64,
    /// Width of the MLP's inner layer; 4 x hidden (GPT) or Llama's `intermediate_size`.
    pub ffn: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Sequence length.
    pub seq_len: u64,
    /// The output head shares the token embedding.
    pub tied: bool,
    /// Llama's layer: SwiGLU MLP (three matrices), RMSNorm, no biases, no position embedding table.
    pub gated: bool,
    /// Fused attention (FlashAttention, SDPA) keeps no s x s matrices; eager attention (the examples') keeps the
    /// softmax probabilities. Default false.
    pub flash_attention: bool,
    /// A mixture of experts (Mixtral's layer): each block's MLP is this many SwiGLU experts behind a router; 0 for
    /// a dense MLP.
    pub experts: u64,
    /// Experts each token runs (with `experts`).
    pub top_k: u64,
}

/// A model known by measured totals (`zerorun plan --from-report`, or written by hand).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measured {
    /// Parameters.
    pub params: u64,
    /// Parameters of the largest layer.
    pub largest_layer_params: u64,
    /// Bytes autograd keeps for backward per sample of a micro-batch, without recomputation.
    pub activation_bytes_per_sample: u64,
    /// Training FLOPs per sample (forward + backward); default 6 x params x seq_len.
    pub flops_per_sample: f64,
    /// Layers the model can be cut into (pipeline stages, recomputation units); default 1.
    pub layers: u64,
    /// Sequence length.
    pub seq_len: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
/// A model to plan for: a transformer by its shape, or one known by measured totals.
pub enum Model {
    /// A transformer by its shape.
    Transformer(Transformer),
    /// Measured totals.
    Measured(Measured),
}

/// The file's keys; which of the two forms it is depends on which keys are present.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    layers: Option<u64>,
    hidden: Option<u64>,
    heads: Option<u64>,
    kv_heads: Option<u64>,
    ffn: Option<u64>,
    vocab: Option<u64>,
    seq_len: Option<u64>,
    tied: Option<bool>,
    gated: Option<bool>,
    flash_attention: Option<bool>,
    experts: Option<u64>,
    top_k: Option<u64>,
    params: Option<f64>,
    largest_layer_params: Option<f64>,
    activation_bytes_per_sample: Option<f64>,
    flops_per_sample: Option<f64>,
}

impl Model {
    /// Parses a model description; `what` names it in errors (the file's path).
    pub fn from_json(text: &str, what: &str) -> Result<Model, PlanError> {
        let f: ModelFile = serde_json::from_str(text).map_err(|e| PlanError::Input(format!("{what}: {e}")))?;
        let bad = |key: &str, why: &str| PlanError::Input(format!("{what}: \"{key}\" {why}"));
        if let Some(params) = f.params {
            let need = |v: Option<f64>, key: &str| {
                v.filter(|x| x.is_finite() && *x >= 0.0).ok_or_else(|| {
                    bad(key, "is needed with \"params\" (a measured model: params, largest_layer_params, activation_bytes_per_sample)")
                })
            };
            if params.is_nan() || params < 1.0 {
                return Err(bad("params", "must be at least 1"));
            }
            let seq_len = f.seq_len.unwrap_or(1).max(1);
            return Ok(Model::Measured(Measured {
                params: params as u64,
                largest_layer_params: need(f.largest_layer_params, "largest_layer_params")? as u64,
                activation_bytes_per_sample: need(f.activation_bytes_per_sample, "activation_bytes_per_sample")? as u64,
                flops_per_sample: f.flops_per_sample.unwrap_or(6.0 * params * seq_len as f64),
                layers: f.layers.unwrap_or(1).max(1),
                seq_len,
            }));
        }
        let need = |v: Option<u64>, key: &str| {
            v.filter(|&x| x > 0).ok_or_else(|| {
                bad(key, "is missing or 0: a transformer needs layers, hidden, heads, vocab and seq_len (or give \"params\")")
            })
        };
        let (layers, hidden, heads) = (need(f.layers, "layers")?, need(f.hidden, "hidden")?, need(f.heads, "heads")?);
        let (vocab, seq_len) = (need(f.vocab, "vocab")?, need(f.seq_len, "seq_len")?);
        if hidden % heads != 0 {
            return Err(bad("heads", &format!("({heads}) must divide \"hidden\" ({hidden})")));
        }
        let kv_heads = f.kv_heads.unwrap_or(heads);
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(bad("kv_heads", &format!("({kv_heads}) must divide \"heads\" ({heads})")));
        }
        let gated = f.gated.unwrap_or(false);
        let experts = f.experts.unwrap_or(0);
        let top_k = f.top_k.unwrap_or(if experts > 0 { 2 } else { 0 });
        if experts > 0 && !gated {
            return Err(bad("experts", "needs \"gated\": true (SwiGLU experts: Mixtral's, Qwen3-MoE's)"));
        }
        if experts > 0 && !(1..=experts).contains(&top_k) {
            return Err(bad("top_k", &format!("({top_k}) must be within 1..={experts} (\"experts\")")));
        }
        if experts == 0 && f.top_k.is_some() {
            return Err(bad("top_k", "needs \"experts\""));
        }
        Ok(Model::Transformer(Transformer {
            layers,
            hidden,
            heads,
            kv_heads,
            ffn: f.ffn.unwrap_or(4 * hidden),
            vocab,
            seq_len,
            tied: f.tied.unwrap_or(false),
            gated,
            flash_attention: f.flash_attention.unwrap_or(false),
            experts,
            top_k,
        }))
    }

    /// Parameters.
    pub fn params(&self) -> u64 {
        match self {
            Model::Transformer(t) => t.params(),
            Model::Measured(m) => m.params,
        }
    }

    /// Layers.
    pub fn layers(&self) -> u64 {
        match self {
            Model::Transformer(t) => t.layers,
            Model::Measured(m) => m.layers,
        }
    }

    /// Sequence length.
    pub fn seq_len(&self) -> u64 {
        match self {
            Model::Transformer(t) => t.seq_len,
            Model::Measured(m) => m.seq_len,
        }
    }

    /// Parameters of the largest unit stage 3 gathers whole (a block, or the embedding).
    pub fn largest_layer_params(&self) -> u64 {
        match self {
            Model::Transformer(t) => t.block_params().max(t.vocab * t.hidden),
            Model::Measured(m) => m.largest_layer_params,
        }
    }

    /// Experts of every mixture-of-experts layer (0: dense, or a measured model).
    pub fn experts(&self) -> u64 {
        match self {
            Model::Transformer(t) => t.experts,
            Model::Measured(_) => 0,
        }
    }

    /// Parameters of every layer's experts (not their routers).
    pub fn expert_params(&self) -> u64 {
        match self {
            Model::Transformer(t) => t.layers * t.experts * if t.gated { 3 } else { 2 } * t.hidden * t.ffn,
            Model::Measured(_) => 0,
        }
    }

    /// The largest unit stage 3 gathers when each layer's experts of one expert-parallel position (of `ranks`)
    /// are a unit of their own, gathered with their layer's: the layer with experts / ranks of its experts.
    pub fn largest_unit_params(&self, ranks: u64) -> u64 {
        match self {
            Model::Transformer(t) if t.experts > 0 && ranks > 1 => {
                let experts = self.expert_params() / t.layers;
                (t.block_params() - experts + experts / ranks).max(t.vocab * t.hidden)
            }
            _ => self.largest_layer_params(),
        }
    }

    /// Forward + backward FLOPs of one sample: 2 per multiply-add of every weight forward, twice that backward,
    /// plus attention's two s x s products per layer.
    pub fn flops_per_sample(&self) -> f64 {
        match self {
            Model::Transformer(t) => {
                let (s, h, l) = (t.seq_len as f64, t.hidden as f64, t.layers as f64);
                let matmul_params = l * t.block_active_matrix_params() as f64 + (t.vocab * t.hidden) as f64;
                6.0 * matmul_params * s + 3.0 * l * 4.0 * s * s * h
            }
            Model::Measured(m) => m.flops_per_sample,
        }
    }
}

impl Transformer {
    fn kv_dim(&self) -> u64 {
        self.hidden / self.heads * self.kv_heads
    }

    /// Weight-matrix parameters of one block: attention's, and the MLP's (every expert's and the router's in a
    /// mixture of experts).
    pub fn block_matrix_params(&self) -> u64 {
        self.attention_matrix_params() + self.mlp_matrix_params(self.experts.max(1))
    }

    /// The weight-matrix parameters one token's forward multiplies in a block: with experts, its `top_k` experts'
    /// and the router's.
    pub fn block_active_matrix_params(&self) -> u64 {
        self.attention_matrix_params() + self.mlp_matrix_params(self.top_k.max(1))
    }

    fn attention_matrix_params(&self) -> u64 {
        let h = self.hidden;
        2 * h * h + 2 * h * self.kv_dim()
    }

    /// `experts` MLPs, and the router when the block has experts.
    fn mlp_matrix_params(&self, experts: u64) -> u64 {
        let one = if self.gated { 3 } else { 2 } * self.hidden * self.ffn;
        experts * one + self.hidden * self.experts
    }

    /// Every parameter of one block: GPT-2's has biases and two LayerNorms (12 h^2 + 13 h at ffn = 4h), Llama's two
    /// RMSNorm weights only.
    pub fn block_params(&self) -> u64 {
        let h = self.hidden;
        if self.gated {
            self.block_matrix_params() + 2 * h
        } else {
            self.block_matrix_params() + (h + 2 * self.kv_dim()) + h + self.ffn + h + 4 * h
        }
    }

    /// Parameters of this shape.
    pub fn params(&self) -> u64 {
        let h = self.hidden;
        let embed = self.vocab * h + if self.gated { 0 } else { self.seq_len * h };
        let final_norm = if self.gated { h } else { 2 * h };
        let head = if self.tied { 0 } else { self.vocab * h + if self.gated { 0 } else { self.vocab } };
        self.layers * self.block_params() + embed + final_norm + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_and_llama_parameter_counts() {
        // GPT-2 small: 12 x 768, vocabulary 50257, 1024 positions, tied: 124.4M.
        let gpt2 = Model::from_json(
            r#"{"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "seq_len": 1024, "tied": true}"#,
            "m",
        )
        .unwrap();
        assert_eq!(gpt2.params(), 124_439_808);
        // Llama-2 7B: 32 x 4096, ffn 11008, vocabulary 32000, untied: 6,738,415,616.
        let llama = Model::from_json(
            r#"{"layers": 32, "hidden": 4096, "heads": 32, "ffn": 11008, "vocab": 32000, "seq_len": 4096, "gated": true}"#,
            "m",
        )
        .unwrap();
        assert_eq!(llama.params(), 6_738_415_616);
        // Mixtral 8x7B: 46,702,792,704 parameters, 12,879,925,248 of them a token's (2 of 8 experts).
        let mixtral = Model::from_json(
            r#"{"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 32000,
                "seq_len": 4096, "gated": true, "experts": 8, "top_k": 2}"#,
            "m",
        )
        .unwrap();
        assert_eq!(mixtral.params(), 46_702_792_704);
        let Model::Transformer(t) = &mixtral else { unreachable!() };
        let active = t.layers * (t.block_active_matrix_params() + 2 * t.hidden) + 2 * t.vocab * t.hidden + t.hidden;
        assert_eq!(active, 12_879_925_248);
    }

    #[test]
    fn bad_descriptions_name_the_key() {
        let err = |t: &str| Model::from_json(t, "m.json").unwrap_err().to_string();
        assert!(err(r#"{"layers": 2, "hidden": 64, "heads": 3, "vocab": 10, "seq_len": 8}"#)
            .contains("m.json: \"heads\" (3) must divide \"hidden\" (64)"));
        assert!(err(r#"{"layers": 2, "hidden": 64, "heads": 4, "vocab": 10}"#).contains("\"seq_len\" is missing"));
        assert!(err(r#"{"params": 1e6}"#).contains("\"largest_layer_params\" is needed"));
        assert!(err(r#"{"layrs": 2}"#).contains("unknown field `layrs`"));
        let moe = r#"{"layers": 2, "hidden": 64, "heads": 4, "vocab": 10, "seq_len": 8, "experts": 4"#;
        assert!(err(&format!("{moe}}}")).contains("\"experts\" needs \"gated\": true"));
        assert!(err(&format!("{moe}, \"gated\": true, \"top_k\": 5}}")).contains("\"top_k\" (5) must be within 1..=4"));
    }
}
