//! The model split by layers over pipeline stages, or inside its layers over a tensor-parallel group.
use tch::nn::{self, Module};
use tch::Tensor;

use super::*;

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

    use super::super::layers::{causal_attention, RmsNorm};
    use super::super::LlamaConfig;

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
