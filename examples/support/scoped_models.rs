//! Models that are not a chain of units, written as plain tch code whose forward enters its units with
//! `engine.unit(name, ..)`: an encoder-decoder transformer (cross-attention in every decoder block, one embedding
//! tied at both ends), a U-Net-like conv net (skips across units) and an LSTM language model. The same forward runs
//! at every ZeRO stage: below stage 3 a scope is just the call. Used by `examples/seq2seq.rs` and
//! `tests/unit_scopes.rs`.
#![allow(dead_code)]
use tch::nn::{self, Module, RNN};
use tch::{Kind, Tensor};
use zerorun::{Engine, Result};

/// Multi-head attention from `q_in` to `kv_in` (self-attention when they are the same), causal or not.
pub struct Attention {
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    o: nn::Linear,
    heads: i64,
}

impl Attention {
    pub fn new(p: &nn::Path, d: i64, heads: i64) -> Attention {
        let l = |n: &str, bias: bool| nn::linear(p / n, d, d, nn::LinearConfig { bias, ..Default::default() });
        // No bias on the keys: softmax ignores a shift every key shares, so its gradient is zero but for rounding.
        Attention { q: l("q", true), k: l("k", false), v: l("v", true), o: l("o", true), heads }
    }

    pub fn forward(&self, q_in: &Tensor, kv_in: &Tensor, causal: bool) -> Tensor {
        let (b, tq, d) = q_in.size3().unwrap();
        let tk = kv_in.size()[1];
        let split = |x: Tensor, t: i64| x.view([b, t, self.heads, d / self.heads]).transpose(1, 2);
        let (q, k, v) =
            (split(self.q.forward(q_in), tq), split(self.k.forward(kv_in), tk), split(self.v.forward(kv_in), tk));
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, causal, None, false);
        self.o.forward(&y.transpose(1, 2).contiguous().view([b, tq, d]))
    }
}

/// A pre-norm MLP block's feed-forward part.
pub struct FeedForward {
    up: nn::Linear,
    down: nn::Linear,
}

impl FeedForward {
    pub fn new(p: &nn::Path, d: i64) -> FeedForward {
        FeedForward {
            up: nn::linear(p / "up", d, 4 * d, Default::default()),
            down: nn::linear(p / "down", 4 * d, d, Default::default()),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.down.forward(&self.up.forward(x).gelu("none"))
    }
}

fn norm(p: &nn::Path, d: i64) -> nn::LayerNorm {
    nn::layer_norm(p, vec![d], Default::default())
}

pub struct EncoderBlock {
    ln1: nn::LayerNorm,
    attn: Attention,
    ln2: nn::LayerNorm,
    ff: FeedForward,
}

impl EncoderBlock {
    fn forward(&self, x: &Tensor) -> Tensor {
        let x = x + self.attn.forward(&self.ln1.forward(x), &self.ln1.forward(x), false);
        &x + self.ff.forward(&self.ln2.forward(&x))
    }
}

pub struct DecoderBlock {
    ln1: nn::LayerNorm,
    attn: Attention,
    ln2: nn::LayerNorm,
    cross: Attention,
    ln3: nn::LayerNorm,
    ff: FeedForward,
}

impl DecoderBlock {
    /// Reads the encoder's output `memory` in every block.
    fn forward(&self, x: &Tensor, memory: &Tensor) -> Tensor {
        let h = self.ln1.forward(x);
        let x = x + self.attn.forward(&h, &h, true);
        let x = &x + self.cross.forward(&self.ln2.forward(&x), memory, false);
        &x + self.ff.forward(&self.ln3.forward(&x))
    }
}

/// Sizes of [`Seq2Seq`].
#[derive(Clone, Copy, Debug)]
pub struct Seq2SeqSize {
    pub vocab: i64,
    pub d: i64,
    pub heads: i64,
    pub layers: i64,
    pub max_len: i64,
}

/// An encoder-decoder transformer whose token embedding is also its output head (tied).
pub struct Seq2Seq {
    tok: nn::Embedding,
    pos: Tensor,
    encoder: Vec<EncoderBlock>,
    decoder: Vec<DecoderBlock>,
    ln_f: nn::LayerNorm,
}

impl Seq2Seq {
    pub fn new(p: &nn::Path, s: Seq2SeqSize) -> Seq2Seq {
        let embed = p / "embed";
        let tok = nn::embedding(&embed / "tok", s.vocab, s.d, Default::default());
        let pos = (&embed / "pos").var("weight", &[s.max_len, s.d], nn::Init::Randn { mean: 0.0, stdev: 0.02 });
        let encoder = (0..s.layers)
            .map(|i| {
                let b = p / "enc" / i;
                EncoderBlock {
                    ln1: norm(&(&b / "ln1"), s.d),
                    attn: Attention::new(&(&b / "attn"), s.d, s.heads),
                    ln2: norm(&(&b / "ln2"), s.d),
                    ff: FeedForward::new(&(&b / "ff"), s.d),
                }
            })
            .collect();
        let decoder = (0..s.layers)
            .map(|i| {
                let b = p / "dec" / i;
                DecoderBlock {
                    ln1: norm(&(&b / "ln1"), s.d),
                    attn: Attention::new(&(&b / "attn"), s.d, s.heads),
                    ln2: norm(&(&b / "ln2"), s.d),
                    cross: Attention::new(&(&b / "cross"), s.d, s.heads),
                    ln3: norm(&(&b / "ln3"), s.d),
                    ff: FeedForward::new(&(&b / "ff"), s.d),
                }
            })
            .collect();
        Seq2Seq { tok, pos, encoder, decoder, ln_f: norm(&(p / "ln_f"), s.d) }
    }

    /// The units: the embedding (with the positions and the final norm), each encoder and decoder block.
    pub fn units(&self) -> Vec<Vec<String>> {
        let mut units = vec![vec!["embed".to_string(), "ln_f".to_string()]];
        units.extend((0..self.encoder.len()).map(|i| vec![format!("enc.{i}")]));
        units.extend((0..self.decoder.len()).map(|i| vec![format!("dec.{i}")]));
        units
    }

    fn embed(&self, ids: &Tensor) -> Tensor {
        let t = ids.size()[1];
        self.tok.forward(ids) + self.pos.narrow(0, 0, t)
    }

    /// Next-token logits of `target_in` (teacher forcing) given `source`.
    // ANCHOR: scoped_forward
    pub fn forward(&self, engine: &mut Engine, source: &Tensor, target_in: &Tensor) -> Result<Tensor> {
        let mut h = engine.unit("embed", |_| self.embed(source))?;
        for (i, block) in self.encoder.iter().enumerate() {
            h = engine.unit(&format!("enc.{i}"), |_| block.forward(&h))?;
        }
        let memory = h;
        // The embedding again: the same unit entered a second time in one forward.
        let mut y = engine.unit("embed", |_| self.embed(target_in))?;
        for (i, block) in self.decoder.iter().enumerate() {
            y = engine.unit(&format!("dec.{i}"), |_| block.forward(&y, &memory))?;
        }
        // The head is the token embedding, transposed: a third entry of its unit.
        engine.unit("embed", |_| self.ln_f.forward(&y).matmul(&self.tok.ws.tr()))
    }
    // ANCHOR_END: scoped_forward

    /// Mean cross-entropy of the next target token.
    pub fn loss(&self, engine: &mut Engine, source: &Tensor, target: &Tensor) -> Result<Tensor> {
        let t = target.size()[1];
        let logits = self.forward(engine, source, &target.narrow(1, 0, t - 1))?;
        let v = logits.size()[2];
        Ok(logits.reshape([-1, v]).cross_entropy_for_logits(&target.narrow(1, 1, t - 1).reshape([-1])))
    }
}

/// A small U-Net: two levels down, one up, the first level's features skipped across to the last unit.
pub struct UNet {
    down0: nn::Conv2D,
    down1: nn::Conv2D,
    norm1: nn::GroupNorm,
    mid: nn::Conv2D,
    up1: nn::ConvTranspose2D,
    up0: nn::Conv2D,
}

impl UNet {
    pub fn new(p: &nn::Path) -> UNet {
        let same = nn::ConvConfig { padding: 1, ..Default::default() };
        UNet {
            down0: nn::conv2d(p / "down0", 1, 4, 3, same),
            down1: nn::conv2d(p / "down1", 4, 8, 3, nn::ConvConfig { padding: 1, stride: 2, ..Default::default() }),
            norm1: nn::group_norm(p / "down1" / "norm", 2, 8, Default::default()),
            mid: nn::conv2d(p / "mid", 8, 8, 3, same),
            up1: nn::conv_transpose2d(p / "up1", 8, 4, 2, nn::ConvTransposeConfig { stride: 2, ..Default::default() }),
            up0: nn::conv2d(p / "up0", 8, 1, 3, same),
        }
    }

    pub fn units() -> Vec<Vec<String>> {
        ["down0", "down1", "mid", "up1", "up0"].iter().map(|u| vec![u.to_string()]).collect()
    }

    pub fn forward(&self, engine: &mut Engine, x: &Tensor) -> Result<Tensor> {
        let s0 = engine.unit("down0", |_| self.down0.forward(x).relu())?;
        let s1 = engine.unit("down1", |_| self.norm1.forward(&self.down1.forward(&s0)).relu())?;
        // Two outputs; the second skips a unit.
        let (m, skip) = engine.unit("mid", |_| {
            let m = self.mid.forward(&s1).relu();
            (&m + &s1, m)
        })?;
        let u1 = engine.unit("up1", |_| self.up1.forward(&(m - skip * 0.5)).relu())?;
        // The skip across units: down0's features meet up1's.
        engine.unit("up0", |_| self.up0.forward(&Tensor::cat(&[&u1, &s0], 1)))
    }
}

/// A character LSTM language model: embedding -> 2-layer LSTM -> head.
pub struct LstmLm {
    embed: nn::Embedding,
    lstm: nn::LSTM,
    head: nn::Linear,
}

impl LstmLm {
    pub fn new(p: &nn::Path, vocab: i64, d: i64, hidden: i64) -> LstmLm {
        let config = nn::RNNConfig { num_layers: 2, batch_first: true, ..Default::default() };
        LstmLm {
            embed: nn::embedding(p / "embed", vocab, d, Default::default()),
            lstm: nn::lstm(p / "lstm", d, hidden, config),
            head: nn::linear(p / "head", hidden, vocab, Default::default()),
        }
    }

    pub fn units() -> Vec<Vec<String>> {
        ["embed", "lstm", "head"].iter().map(|u| vec![u.to_string()]).collect()
    }

    pub fn forward(&self, engine: &mut Engine, ids: &Tensor) -> Result<Tensor> {
        let e = engine.unit("embed", |_| self.embed.forward(ids))?;
        let (h, _state) = engine.unit("lstm", |_| self.lstm.seq(&e))?;
        engine.unit("head", |_| self.head.forward(&h))
    }

    /// Mean cross-entropy of each next character.
    pub fn loss(&self, engine: &mut Engine, ids: &Tensor) -> Result<Tensor> {
        let t = ids.size()[1];
        let logits = self.forward(engine, &ids.narrow(1, 0, t - 1))?;
        let v = logits.size()[2];
        Ok(logits.reshape([-1, v]).cross_entropy_for_logits(&ids.narrow(1, 1, t - 1).reshape([-1])))
    }
}

/// Kind of the inputs of the models above.
pub const IDS: Kind = Kind::Int64;
