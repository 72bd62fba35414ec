//! The GPT-style character model of examples/gpt.rs and its corpus: token and position embeddings, pre-norm
//! transformer blocks (causal self-attention, GELU MLP), a final norm and a linear head. Shared with the tests.
#![allow(dead_code)]
use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use zerorun::UnitModel;

use super::Rng;

#[derive(Debug, Clone, Copy)]
pub struct GptConfig {
    pub vocab: i64,
    pub block: i64,
    pub layers: i64,
    pub heads: i64,
    pub embd: i64,
}

#[derive(Debug)]
struct Block {
    ln1: nn::LayerNorm,
    attn_q: nn::Linear,
    /// No bias: a key bias only shifts every score of a query by the same amount, which softmax ignores, so its
    /// gradient is zero up to rounding noise (that Adam would amplify).
    attn_k: nn::Linear,
    attn_v: nn::Linear,
    attn_proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc: nn::Linear,
    proj: nn::Linear,
    heads: i64,
}

impl Block {
    fn new(p: nn::Path, c: &GptConfig) -> Self {
        let e = c.embd;
        Block {
            ln1: nn::layer_norm(&p / "ln1", vec![e], Default::default()),
            attn_q: nn::linear(&p / "attn_q", e, e, Default::default()),
            attn_k: nn::linear(&p / "attn_k", e, e, nn::LinearConfig { bias: false, ..Default::default() }),
            attn_v: nn::linear(&p / "attn_v", e, e, Default::default()),
            attn_proj: nn::linear(&p / "attn_proj", e, e, Default::default()),
            ln2: nn::layer_norm(&p / "ln2", vec![e], Default::default()),
            fc: nn::linear(&p / "fc", e, 4 * e, Default::default()),
            proj: nn::linear(&p / "proj", 4 * e, e, Default::default()),
            heads: c.heads,
        }
    }

    fn attention(&self, x: &Tensor) -> Tensor {
        let (b, t, c) = x.size3().unwrap();
        let hs = c / self.heads;
        let split = |l: &nn::Linear| l.forward(x).view([b, t, self.heads, hs]).transpose(1, 2);
        let (q, k, v) = (split(&self.attn_q), split(&self.attn_k), split(&self.attn_v));
        let att = q.matmul(&k.transpose(-2, -1)) * (1.0 / (hs as f64).sqrt());
        let mask = Tensor::ones([t, t], (Kind::Bool, x.device())).triu(1);
        let att = att.masked_fill(&mask, f64::NEG_INFINITY).softmax(-1, Kind::Float);
        let y = att.to_kind(v.kind()).matmul(&v).transpose(1, 2).contiguous().view([b, t, c]);
        self.attn_proj.forward(&y)
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let x = x + self.attention(&self.ln1.forward(x));
        let h = self.fc.forward(&self.ln2.forward(&x)).gelu("none");
        &x + self.proj.forward(&h)
    }
}

#[derive(Debug)]
pub struct Gpt {
    tok: nn::Embedding,
    pos: nn::Embedding,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl Gpt {
    pub fn new(p: nn::Path, c: &GptConfig) -> Self {
        Gpt {
            tok: nn::embedding(&p / "tok", c.vocab, c.embd, Default::default()),
            pos: nn::embedding(&p / "pos", c.block, c.embd, Default::default()),
            blocks: (0..c.layers).map(|i| Block::new(&p / "blocks" / i, c)).collect(),
            ln_f: nn::layer_norm(&p / "ln_f", vec![c.embd], Default::default()),
            head: nn::linear(&p / "head", c.embd, c.vocab, Default::default()),
        }
    }

    pub fn forward(&self, idx: &Tensor) -> Tensor {
        let mut x = idx.shallow_clone();
        for u in 0..self.blocks.len() + 2 {
            x = self.forward_unit(u, &x);
        }
        x
    }
}

/// The same model as pipeline layers: the embeddings, each block, and the final norm with the head, each built
/// under the names `Gpt::new` gives them and in its order (so the initial values are the same), with the
/// cross-entropy of the logits as the loss.
pub fn pipeline_model<'a>(c: &GptConfig) -> zerorun::PipelineModel<'a> {
    let c = *c;
    let mut model = zerorun::PipelineModel::new(move |logits: &Tensor, targets: &Tensor| {
        logits.to_kind(Kind::Float).view([-1, c.vocab]).cross_entropy_for_logits(&targets.view([-1]))
    })
    .layer("embed", move |p| {
        let tok = nn::embedding(p / "tok", c.vocab, c.embd, Default::default());
        let pos = nn::embedding(p / "pos", c.block, c.embd, Default::default());
        Box::new(move |x: &Tensor| {
            let at = Tensor::arange(x.size()[1], (Kind::Int64, x.device()));
            tok.forward(x) + pos.forward(&at)
        })
    });
    for i in 0..c.layers {
        model = model.layer(format!("blocks.{i}"), move |p| {
            let block = Block::new(p / "blocks" / i, &c);
            Box::new(move |x: &Tensor| block.forward(x))
        });
    }
    model.layer("head", move |p| {
        let ln_f = nn::layer_norm(p / "ln_f", vec![c.embd], Default::default());
        let head = nn::linear(p / "head", c.embd, c.vocab, Default::default());
        Box::new(move |x: &Tensor| head.forward(&ln_f.forward(x)))
    })
}

/// [`pipeline_model`] with the head tied to the token embedding (logits = ln_f(x) · tokᵀ, no head of its own), as
/// [`Gpt::forward_tied`] computes it.
// ANCHOR: pipeline_tied
pub fn pipeline_model_tied(c: &GptConfig) -> zerorun::PipelineModel<'static> {
    let c = *c;
    let mut model = zerorun::PipelineModel::new(move |logits: &Tensor, targets: &Tensor| {
        logits.to_kind(Kind::Float).view([-1, c.vocab]).cross_entropy_for_logits(&targets.view([-1]))
    })
    .tying_layer("embed", "tok", move |p| {
        let tok = nn::embedding(p / "tok", c.vocab, c.embd, Default::default());
        let pos = nn::embedding(p / "pos", c.block, c.embd, Default::default());
        let weight = tok.ws.shallow_clone();
        let forward = Box::new(move |x: &Tensor| {
            let at = Tensor::arange(x.size()[1], (Kind::Int64, x.device()));
            tok.forward(x) + pos.forward(&at)
        });
        (forward as zerorun::LayerForward<'static>, weight)
    });
    for i in 0..c.layers {
        model = model.layer(format!("blocks.{i}"), move |p| {
            let block = Block::new(p / "blocks" / i, &c);
            Box::new(move |x: &Tensor| block.forward(x))
        });
    }
    model.tied_layer("head", "tok", move |p, tok: &Tensor| {
        let ln_f = nn::layer_norm(p / "ln_f", vec![c.embd], Default::default());
        let tok = tok.shallow_clone();
        Box::new(move |x: &Tensor| ln_f.forward(x).matmul(&tok.tr()))
    })
}
// ANCHOR_END: pipeline_tied

impl Gpt {
    /// The forward with the head tied to the token embedding (the `head` variables unused).
    pub fn forward_tied(&self, idx: &Tensor) -> Tensor {
        let mut x = self.forward_unit(0, idx);
        for u in 1..=self.blocks.len() {
            x = self.forward_unit(u, &x);
        }
        self.ln_f.forward(&x).matmul(&self.tok.ws.tr())
    }
}

/// Units for stage 3: the embeddings, each block, and the final norm with the head.
impl UnitModel for Gpt {
    fn unit_prefixes(&self) -> Vec<Vec<String>> {
        let mut units = vec![vec!["tok".to_string(), "pos".to_string()]];
        units.extend((0..self.blocks.len()).map(|i| vec![format!("blocks.{i}")]));
        units.push(vec!["ln_f".to_string(), "head".to_string()]);
        units
    }

    fn forward_unit(&self, unit: usize, x: &Tensor) -> Tensor {
        if unit == 0 {
            let pos = Tensor::arange(x.size()[1], (Kind::Int64, x.device()));
            self.tok.forward(x) + self.pos.forward(&pos)
        } else if unit <= self.blocks.len() {
            self.blocks[unit - 1].forward(x)
        } else {
            self.head.forward(&self.ln_f.forward(x))
        }
    }
}

/// The same model as one builder per unit, creating the variables in `Gpt::new`'s order under its names, so the
/// initial values are the same from the same seed. At stage 3 (`Engine::from_builders`) each unit is sharded as
/// soon as it is made: no rank ever holds the whole model, start-up included.
pub fn gpt_builders(c: &GptConfig) -> zerorun::UnitBuilders<'static> {
    let c = *c;
    let embeddings = move |p: &nn::Path| -> zerorun::UnitForward<'static> {
        let tok = nn::embedding(p / "tok", c.vocab, c.embd, Default::default());
        let pos = nn::embedding(p / "pos", c.block, c.embd, Default::default());
        Box::new(move |x: &Tensor| {
            let ids = Tensor::arange(x.size()[1], (Kind::Int64, x.device()));
            tok.forward(x) + pos.forward(&ids)
        })
    };
    let builders = zerorun::UnitBuilders::new().unit(["tok", "pos"], embeddings);
    let builders = (0..c.layers).fold(builders, |b, i| {
        b.unit([format!("blocks.{i}")], move |p: &nn::Path| -> zerorun::UnitForward<'static> {
            let block = Block::new(p / "blocks" / i, &c);
            Box::new(move |x: &Tensor| block.forward(x))
        })
    });
    builders.unit(["ln_f", "head"], move |p: &nn::Path| -> zerorun::UnitForward<'static> {
        let ln_f = nn::layer_norm(p / "ln_f", vec![c.embd], Default::default());
        let head = nn::linear(p / "head", c.embd, c.vocab, Default::default());
        Box::new(move |x: &Tensor| head.forward(&ln_f.forward(x)))
    })
}

/// The corpus as character ids.
pub struct Corpus {
    pub ids: Vec<i64>,
    pub vocab: i64,
    /// Tokens before the held-out part (all of them without one): batches are drawn from here only.
    pub train_len: usize,
}

impl Corpus {
    /// The bundled 300 kB of Shakespeare.
    pub fn load() -> Self {
        Corpus::from_text(include_str!("../data/shakespeare.txt"))
    }

    /// Characters as tokens: the vocabulary is the text's distinct characters, sorted (nanoGPT's
    /// shakespeare_char/prepare.py).
    pub fn from_text(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids: Vec<i64> = text.chars().map(|c| chars.binary_search(&c).unwrap() as i64).collect();
        Corpus { train_len: ids.len(), ids, vocab: chars.len() as i64 }
    }

    /// `--data PATH`, or the bundled text.
    pub fn from_args(path: Option<&std::path::Path>) -> Result<Self, String> {
        match path {
            None => Ok(Corpus::load()),
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| format!("--data {}: {e}", p.display()))?;
                if text.chars().count() < 2 {
                    return Err(format!("--data {}: needs at least two characters", p.display()));
                }
                Ok(Corpus::from_text(&text))
            }
        }
    }

    /// Holds out the last `fraction` of the tokens (nanoGPT's split: `data[int(n*0.9):]` for 0.1), never trained on.
    pub fn hold_out(mut self, fraction: f64, block: i64) -> Result<Self, String> {
        if !(0.0..1.0).contains(&fraction) {
            return Err(format!("--val-fraction {fraction} must be in [0, 1)"));
        }
        let n = self.ids.len();
        let train_len = (n as f64 * (1.0 - fraction)) as usize;
        if fraction > 0.0 && (train_len <= block as usize + 1 || n - train_len <= block as usize) {
            return Err(format!(
                "--val-fraction {fraction} leaves {train_len} training and {} held-out tokens of {n}; each needs more than --block {block}",
                n - train_len
            ));
        }
        self.train_len = train_len;
        Ok(self)
    }

    /// Samples `range` of global batch `step`: (inputs, targets), each [len, block], from the training part.
    pub fn batch(
        &self,
        seed: u64,
        step: u64,
        train: u64,
        range: std::ops::Range<usize>,
        block: i64,
    ) -> (Tensor, Tensor) {
        let mut rng = Rng::new(seed, step);
        let limit = (self.train_len as i64 - block - 1) as u64;
        let starts: Vec<usize> = (0..train).map(|_| rng.below(limit) as usize).collect();
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for &s in &starts[range.clone()] {
            xs.extend_from_slice(&self.ids[s..s + block as usize]);
            ys.extend_from_slice(&self.ids[s + 1..s + 1 + block as usize]);
        }
        let n = range.len() as i64;
        (Tensor::from_slice(&xs).view([n, block]), Tensor::from_slice(&ys).view([n, block]))
    }

    /// The held-out part as non-overlapping windows of `block` tokens: (inputs, targets), each [windows, block].
    pub fn held_out_windows(&self, block: i64) -> (Tensor, Tensor) {
        let held = &self.ids[self.train_len..];
        let n = (held.len().saturating_sub(1) / block as usize) as i64;
        let x = Tensor::from_slice(&held[..(n * block) as usize]).view([n, block]);
        let y = Tensor::from_slice(&held[1..1 + (n * block) as usize]).view([n, block]);
        (x, y)
    }
}

/// This rank's share of the next-token loss over every held-out window, as `[summed loss, tokens]`: the windows
/// dealt to the data-parallel ranks in chunks of `rows`, `loss_sum(x, y)` a chunk's summed token loss (a forward of
/// the rank's model). Every rank runs as many chunks (one with none left reruns its first and counts nothing), so
/// the collectives of stage 3's gathers and of pipelines match. The loss is the ratio of the ranks' means of the two.
pub fn held_out_sums(
    corpus: &Corpus,
    block: i64,
    (rank, ranks): (usize, usize),
    rows: i64,
    mut loss_sum: impl FnMut(&Tensor, &Tensor) -> Result<f64, String>,
) -> Result<[f32; 2], String> {
    let (x, y) = corpus.held_out_windows(block);
    let windows = x.size()[0];
    let chunks = (windows + rows - 1) / rows;
    let calls = (chunks + ranks as i64 - 1) / ranks as i64;
    let (mut sum, mut tokens) = (0.0f64, 0.0f64);
    for call in 0..calls {
        let chunk = call * ranks as i64 + rank as i64;
        let counted = chunk < chunks;
        let start = if counted { chunk * rows } else { 0 };
        let n = rows.min(windows - start);
        let (cx, cy) = (x.narrow(0, start, n), y.narrow(0, start, n));
        let s = loss_sum(&cx, &cy)?;
        if counted {
            sum += s;
            tokens += (n * block) as f64;
        }
    }
    Ok([sum as f32, tokens as f32])
}

/// The vocabulary padded to a multiple of 8 (Megatron-LM's `make_vocab_size_divisible_by`), so that it splits
/// over tensor-parallel degrees 1, 2, 4 and 8 alike; the padded ids never occur.
pub fn padded_vocab(vocab: i64) -> i64 {
    (vocab + 7) / 8 * 8
}

/// The model split across a tensor-parallel group.
pub mod tp {
    use tch::nn::{self, Module};
    use tch::{Kind, Tensor};
    use zerorun::runtime::tensor_parallel::{
        vocab_parallel_cross_entropy, ColumnParallelLinear, RowParallelLinear, TensorParallel, VocabParallelEmbedding,
    };

    use super::GptConfig;

    /// A block with its heads split across the group: query, key and value column-parallel on one copy of the
    /// normalized input, the attention's output row-parallel; the MLP column- then row-parallel. Two all-reduces
    /// forward (the two row-parallel sums) and two backward (the two copies).
    struct TpBlock {
        ln1: nn::LayerNorm,
        attn_q: ColumnParallelLinear,
        attn_k: ColumnParallelLinear,
        attn_v: ColumnParallelLinear,
        attn_proj: RowParallelLinear,
        ln2: nn::LayerNorm,
        fc: ColumnParallelLinear,
        proj: RowParallelLinear,
        heads: i64,
    }

    impl TpBlock {
        fn new(p: nn::Path, tp: &TensorParallel, c: &GptConfig) -> Self {
            let e = c.embd;
            let column =
                |name: &str, out: i64, bias: bool| ColumnParallelLinear::new(&(&p / name), tp, e, out, bias, false);
            TpBlock {
                ln1: nn::layer_norm(&p / "ln1", vec![e], Default::default()),
                attn_q: column("attn_q", e, true),
                attn_k: column("attn_k", e, false),
                attn_v: column("attn_v", e, true),
                attn_proj: RowParallelLinear::new(&(&p / "attn_proj"), tp, e, e, true, true),
                ln2: nn::layer_norm(&p / "ln2", vec![e], Default::default()),
                fc: column("fc", 4 * e, true),
                proj: RowParallelLinear::new(&(&p / "proj"), tp, 4 * e, e, true, true),
                heads: c.heads / tp.size() as i64,
            }
        }

        fn forward(&self, tp: &TensorParallel, x: &Tensor) -> Result<Tensor, zerorun::Error> {
            let (b, t, _) = x.size3().unwrap();
            let h = tp.copy_to_region(&self.ln1.forward(x))?;
            let local = self.attn_q.weight.size()[0];
            let hs = local / self.heads;
            let split = |l: &ColumnParallelLinear| l.forward_copied(&h).view([b, t, self.heads, hs]).transpose(1, 2);
            let (q, k, v) = (split(&self.attn_q), split(&self.attn_k), split(&self.attn_v));
            let att = q.matmul(&k.transpose(-2, -1)) * (1.0 / (hs as f64).sqrt());
            let mask = Tensor::ones([t, t], (Kind::Bool, x.device())).triu(1);
            let att = att.masked_fill(&mask, f64::NEG_INFINITY).softmax(-1, Kind::Float);
            let y = att.to_kind(v.kind()).matmul(&v).transpose(1, 2).contiguous().view([b, t, local]);
            let x = x + self.attn_proj.forward(tp, &y)?;
            let h = self.fc.forward_copied(&tp.copy_to_region(&self.ln2.forward(&x))?).gelu("none");
            Ok(&x + self.proj.forward(tp, &h)?)
        }
    }

    /// The GPT of `Gpt::new` (the same names, built in the same order) at tensor-parallel degree T: the vocabulary-
    /// parallel token embedding, replicated position embedding and norms, [`TpBlock`]s, and a column-parallel head
    /// whose logits go to the vocabulary-parallel cross-entropy. The embedding and the head hold the vocabulary
    /// padded to a multiple of 8 ([`super::padded_vocab`], at every T, so runs at different degrees compute the
    /// same); their placements carry its true size, so checkpoints and whole copies hold `Gpt`'s tensors.
    pub struct TpGpt {
        tok: VocabParallelEmbedding,
        pos: nn::Embedding,
        blocks: Vec<TpBlock>,
        ln_f: nn::LayerNorm,
        head: ColumnParallelLinear,
        /// The true vocabulary (the embedding and head hold it padded).
        vocab: i64,
    }

    impl TpGpt {
        /// T must divide the padded vocabulary.
        pub fn new(p: nn::Path, tp: &TensorParallel, c: &GptConfig) -> Self {
            let vocab = (c.vocab, super::padded_vocab(c.vocab));
            TpGpt {
                tok: VocabParallelEmbedding::padded(&(&p / "tok"), tp, vocab, c.embd),
                pos: nn::embedding(&p / "pos", c.block, c.embd, Default::default()),
                blocks: (0..c.layers).map(|i| TpBlock::new(&p / "blocks" / i, tp, c)).collect(),
                ln_f: nn::layer_norm(&p / "ln_f", vec![c.embd], Default::default()),
                head: ColumnParallelLinear::padded(&(&p / "head"), tp, c.embd, vocab, true, false),
                vocab: c.vocab,
            }
        }

        /// The mean cross-entropy of this rank's part of the logits against the next characters `targets`, equal on
        /// every rank of the group.
        pub fn loss(&self, tp: &TensorParallel, logits: &Tensor, targets: &Tensor) -> Result<Tensor, zerorun::Error> {
            vocab_parallel_cross_entropy(tp, &logits.to_kind(Kind::Float), targets, self.tok.start, self.vocab)
        }

        /// Unit `unit` of [`TpUnits`]: the embeddings, a block, or the final norm with this rank's part of the
        /// head (its part of the logits).
        fn forward_unit(&self, tp: &TensorParallel, unit: usize, x: &Tensor) -> Result<Tensor, zerorun::Error> {
            if unit == 0 {
                let at = Tensor::arange(x.size()[1], (Kind::Int64, x.device()));
                Ok(self.tok.forward(tp, x)? + self.pos.forward(&at))
            } else if unit <= self.blocks.len() {
                self.blocks[unit - 1].forward(tp, x)
            } else {
                self.head.forward(tp, &self.ln_f.forward(x))
            }
        }
    }

    /// [`super::pipeline_model`] split across the tensor-parallel group `tp`: the same layers (names, order,
    /// initial values) built from [`TpGpt`]'s parts, the loss the vocabulary-parallel cross-entropy. T must divide
    /// the padded vocabulary. A failed collective panics (a layer's forward returns a tensor).
    pub fn pipeline_model<'a>(c: &GptConfig, tp: &'a TensorParallel) -> zerorun::PipelineModel<'a> {
        let c = *c;
        let failed = |what: &str, e: zerorun::Error| -> Tensor { panic!("tensor parallel, {what}: {e}") };
        let vocab = (c.vocab, super::padded_vocab(c.vocab));
        let start = tp.rank() as i64 * (vocab.1 / tp.size() as i64);
        let mut model = zerorun::PipelineModel::new(move |logits: &Tensor, targets: &Tensor| {
            vocab_parallel_cross_entropy(tp, &logits.to_kind(Kind::Float), targets, start, c.vocab)
                .unwrap_or_else(|e| failed("loss", e))
        })
        .layer("embed", move |p| {
            let tok = VocabParallelEmbedding::padded(&(p / "tok"), tp, vocab, c.embd);
            let pos = nn::embedding(p / "pos", c.block, c.embd, Default::default());
            Box::new(move |x: &Tensor| {
                let at = Tensor::arange(x.size()[1], (Kind::Int64, x.device()));
                tok.forward(tp, x).unwrap_or_else(|e| failed("embedding", e)) + pos.forward(&at)
            })
        });
        for i in 0..c.layers {
            model = model.layer(format!("blocks.{i}"), move |p| {
                let block = TpBlock::new(p / "blocks" / i, tp, &c);
                Box::new(move |x: &Tensor| block.forward(tp, x).unwrap_or_else(|e| failed("block", e)))
            });
        }
        model.layer("head", move |p| {
            let ln_f = nn::layer_norm(p / "ln_f", vec![c.embd], Default::default());
            let head = ColumnParallelLinear::padded(&(p / "head"), tp, c.embd, vocab, true, false);
            Box::new(move |x: &Tensor| head.forward(tp, &ln_f.forward(x)).unwrap_or_else(|e| failed("head", e)))
        })
    }

    /// [`TpGpt`] as the engine's units (those of `Gpt`), with its group: stage 3 gathers one unit at a time over
    /// the data-parallel ranks while the tensor-parallel collectives run inside each unit. A failed collective in a
    /// unit panics (the unit interface returns a tensor), which ends the rank and, under `zerorun launch`, the job.
    pub struct TpUnits<'a> {
        pub model: &'a TpGpt,
        pub tp: &'a TensorParallel,
    }

    impl zerorun::UnitModel for TpUnits<'_> {
        fn unit_prefixes(&self) -> Vec<Vec<String>> {
            let mut units = vec![vec!["tok".to_string(), "pos".to_string()]];
            units.extend((0..self.model.blocks.len()).map(|i| vec![format!("blocks.{i}")]));
            units.push(vec!["ln_f".to_string(), "head".to_string()]);
            units
        }

        fn forward_unit(&self, unit: usize, x: &Tensor) -> Tensor {
            self.model.forward_unit(self.tp, unit, x).unwrap_or_else(|e| panic!("tensor parallel, unit {unit}: {e}"))
        }
    }
}
