//! nanoGPT's model (karpathy/nanoGPT model.py) in plain tch, as its CPU Shakespeare run configures it: token and
//! position embeddings, pre-norm blocks of causal self-attention (one `c_attn` projection to queries, keys and values,
//! PyTorch's scaled-dot-product attention) and a GELU MLP, a final LayerNorm, the head tied to the token embedding;
//! no biases anywhere (LayerNorm's included), dropout 0. Its initialisation: every weight matrix and embedding
//! N(0, 0.02), the two residual projections of each block N(0, 0.02/sqrt(2·layers)), LayerNorm weights 1.
//!
//! The forward enters its units with `engine.unit`: `embed` (both embeddings and the final norm, entered again as
//! the tied head) and `h.<i>` per block, so stage 3 gathers each while it runs; below stage 3 a scope is just the
//! call. The final norm rides with the embeddings: a unit of its own would cost a gather and a reduction per step
//! for 128 values.
#![allow(dead_code)]
use tch::nn::{self, Init};
use tch::{Kind, Tensor};
use zerorun::{Engine, Result};

/// nanoGPT's `GPTConfig` (with `bias = False`).
#[derive(Debug, Clone, Copy)]
pub struct NanoGptConfig {
    pub vocab: i64,
    pub block: i64,
    pub layers: i64,
    pub heads: i64,
    pub embd: i64,
}

fn layer_norm(x: &Tensor, w: &Tensor) -> Tensor {
    x.layer_norm([w.size()[0]], Some(w), None::<&Tensor>, 1e-5, false)
}

struct NanoBlock {
    ln_1: Tensor,
    c_attn: Tensor,
    attn_proj: Tensor,
    ln_2: Tensor,
    c_fc: Tensor,
    mlp_proj: Tensor,
    heads: i64,
}

impl NanoBlock {
    fn new(p: &nn::Path, c: &NanoGptConfig) -> NanoBlock {
        let e = c.embd;
        let w = Init::Randn { mean: 0.0, stdev: 0.02 };
        // GPT-2's scaled init of the projections into the residual stream.
        let residual = Init::Randn { mean: 0.0, stdev: 0.02 / (2.0 * c.layers as f64).sqrt() };
        NanoBlock {
            ln_1: (p / "ln_1").var("weight", &[e], Init::Const(1.0)),
            c_attn: (p / "attn" / "c_attn").var("weight", &[3 * e, e], w),
            attn_proj: (p / "attn" / "c_proj").var("weight", &[e, e], residual),
            ln_2: (p / "ln_2").var("weight", &[e], Init::Const(1.0)),
            c_fc: (p / "mlp" / "c_fc").var("weight", &[4 * e, e], w),
            mlp_proj: (p / "mlp" / "c_proj").var("weight", &[e, 4 * e], residual),
            heads: c.heads,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, t, e) = x.size3().unwrap();
        let qkv = layer_norm(x, &self.ln_1).linear(&self.c_attn, None::<Tensor>);
        let split = |t_: Tensor| t_.view([b, t, self.heads, e / self.heads]).transpose(1, 2);
        let parts = qkv.split(e, 2);
        let (q, k, v) =
            (split(parts[0].shallow_clone()), split(parts[1].shallow_clone()), split(parts[2].shallow_clone()));
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, false);
        let y = y.transpose(1, 2).contiguous().view([b, t, e]);
        let x = x + y.linear(&self.attn_proj, None::<Tensor>);
        let h = layer_norm(&x, &self.ln_2).linear(&self.c_fc, None::<Tensor>).gelu("none");
        &x + h.linear(&self.mlp_proj, None::<Tensor>)
    }
}

/// nanoGPT's GPT.
pub struct NanoGpt {
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<NanoBlock>,
    ln_f: Tensor,
    pub config: NanoGptConfig,
}

impl NanoGpt {
    /// Built in nanoGPT's order (embeddings, blocks, final norm), so one seed gives one model.
    pub fn new(p: &nn::Path, c: NanoGptConfig) -> NanoGpt {
        let w = Init::Randn { mean: 0.0, stdev: 0.02 };
        let embed = p / "embed";
        NanoGpt {
            wte: (&embed / "wte").var("weight", &[c.vocab, c.embd], w),
            wpe: (&embed / "wpe").var("weight", &[c.block, c.embd], w),
            blocks: (0..c.layers).map(|i| NanoBlock::new(&(p / "h" / i), &c)).collect(),
            ln_f: (p / "ln_f").var("weight", &[c.embd], Init::Const(1.0)),
            config: c,
        }
    }

    /// The units by parameter-name prefix, in the order the forward first enters them.
    pub fn units(&self) -> Vec<Vec<String>> {
        let mut units = vec![vec!["embed".to_string(), "ln_f".to_string()]];
        units.extend((0..self.blocks.len()).map(|i| vec![format!("h.{i}")]));
        units
    }

    /// Parameters as nanoGPT's `get_num_params()` counts them: all but the position embedding (the tied head once).
    pub fn num_params(&self) -> u64 {
        let blocks: i64 = self
            .blocks
            .iter()
            .map(|b| {
                [&b.ln_1, &b.c_attn, &b.attn_proj, &b.ln_2, &b.c_fc, &b.mlp_proj]
                    .iter()
                    .map(|t| t.numel() as i64)
                    .sum::<i64>()
            })
            .sum();
        (self.wte.numel() as i64 + blocks + self.ln_f.numel() as i64) as u64
    }

    /// Logits [b, t, vocab] of token ids [b, t].
    pub fn forward(&self, engine: &mut Engine, idx: &Tensor) -> Result<Tensor> {
        let t = idx.size()[1];
        let mut x = engine.unit("embed", |_| {
            let pos = Tensor::arange(t, (Kind::Int64, idx.device()));
            Tensor::embedding(&self.wte, idx, -1, false, false) + self.wpe.index_select(0, &pos)
        })?;
        for (i, block) in self.blocks.iter().enumerate() {
            x = engine.unit(&format!("h.{i}"), |_| block.forward(&x))?;
        }
        // The head is the token embedding: its unit entered a second time.
        engine.unit("embed", |_| layer_norm(&x, &self.ln_f).matmul(&self.wte.tr()))
    }

    /// The mean cross-entropy of next-token `targets` [b, t].
    pub fn loss(&self, engine: &mut Engine, idx: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = self.forward(engine, idx)?;
        Ok(logits.view([-1, self.config.vocab]).cross_entropy_for_logits(&targets.view([-1])))
    }
}
