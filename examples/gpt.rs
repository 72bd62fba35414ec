//! A GPT-style character model in plain tch (token and position embeddings, pre-norm transformer blocks, a
//! linear head) trained with zerorun on the Shakespeare text in examples/data.
//!
//!     cargo run --release --example gpt -- --config configs/zero2.json --ranks 2 --steps 30
use std::time::Duration;

use clap::Parser;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use zerorun::runtime::engine::{no_decay_for_1d, EngineOptions};
use zerorun::Engine;

#[path = "support/mod.rs"]
mod support;
use support::*;

#[derive(Parser, Debug)]
#[command(about = "Train a small GPT on Shakespeare with zerorun")]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    layers: i64,
    /// Embedding width.
    #[arg(long, default_value_t = 64)]
    embd: i64,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: i64,
    /// Sequence length.
    #[arg(long, default_value_t = 64)]
    block: i64,
}

#[derive(Debug, Clone, Copy)]
struct GptConfig {
    vocab: i64,
    block: i64,
    layers: i64,
    heads: i64,
    embd: i64,
}

#[derive(Debug)]
struct Block {
    ln1: nn::LayerNorm,
    attn_qkv: nn::Linear,
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
            attn_qkv: nn::linear(&p / "attn_qkv", e, 3 * e, Default::default()),
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
        let qkv = self.attn_qkv.forward(x).view([b, t, 3, self.heads, hs]).permute([2, 0, 3, 1, 4]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let att = q.matmul(&k.transpose(-2, -1)) * (1.0 / (hs as f64).sqrt());
        let mask = Tensor::ones([t, t], (Kind::Bool, x.device())).triu(1);
        let att = att.masked_fill(&mask, f64::NEG_INFINITY).softmax(-1, Kind::Float);
        let y = att.matmul(&v).transpose(1, 2).contiguous().view([b, t, c]);
        self.attn_proj.forward(&y)
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let x = x + self.attention(&self.ln1.forward(x));
        let h = self.fc.forward(&self.ln2.forward(&x)).gelu("none");
        &x + self.proj.forward(&h)
    }
}

#[derive(Debug)]
struct Gpt {
    tok: nn::Embedding,
    pos: nn::Embedding,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl Gpt {
    fn new(p: nn::Path, c: &GptConfig) -> Self {
        Gpt {
            tok: nn::embedding(&p / "tok", c.vocab, c.embd, Default::default()),
            pos: nn::embedding(&p / "pos", c.block, c.embd, Default::default()),
            blocks: (0..c.layers).map(|i| Block::new(&p / "blocks" / i, c)).collect(),
            ln_f: nn::layer_norm(&p / "ln_f", vec![c.embd], Default::default()),
            head: nn::linear(&p / "head", c.embd, c.vocab, Default::default()),
        }
    }

    fn forward(&self, idx: &Tensor) -> Tensor {
        let t = idx.size()[1];
        let pos = Tensor::arange(t, (Kind::Int64, idx.device()));
        let mut x = self.tok.forward(idx) + self.pos.forward(&pos);
        for b in &self.blocks {
            x = b.forward(&x);
        }
        self.head.forward(&self.ln_f.forward(&x))
    }
}

/// The corpus as character ids.
struct Corpus {
    ids: Vec<i64>,
    vocab: i64,
}

impl Corpus {
    fn load() -> Self {
        let text = include_str!("data/shakespeare.txt");
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids = text.chars().map(|c| chars.binary_search(&c).unwrap() as i64).collect();
        Corpus { ids, vocab: chars.len() as i64 }
    }

    /// Samples `range` of global batch `step`: (inputs, targets), each [len, block].
    fn batch(&self, seed: u64, step: u64, train: u64, range: std::ops::Range<usize>, block: i64) -> (Tensor, Tensor) {
        let mut rng = Rng::new(seed, step);
        let limit = (self.ids.len() as i64 - block - 1) as u64;
        let starts: Vec<usize> = (0..train).map(|_| rng.below(limit) as usize).collect();
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for &s in &starts[range.clone()] {
            xs.extend_from_slice(&self.ids[s..s + block as usize]);
            ys.extend_from_slice(&self.ids[s + 1..s + 1 + block as usize]);
        }
        let n = range.len() as i64;
        (Tensor::from_slice(&xs).view([n, block]), Tensor::from_slice(&ys).view([n, block]))
    }
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), String> {
    let a = &args.common;
    a.check()?;
    let config = load_config(&a.config)?;
    let corpus = Corpus::load();
    let cfg = GptConfig { vocab: corpus.vocab, block: args.block, layers: args.layers, heads: args.heads, embd: args.embd };
    share_cores(a.ranks);
    let timeout = Duration::from_secs_f64(config.comms_timeout);
    let summary = run_ranks(a.ranks, timeout, |comm| {
        let (vs, model) = build_model(a.seed, a.init.as_ref(), |vs| Gpt::new(vs.root(), &cfg))?;
        let options = EngineOptions { no_weight_decay: Some(no_decay_for_1d) };
        let mut engine = Engine::new(&vs, config.clone(), comm, options).map_err(|e| e.to_string())?;
        let b = engine.batch_sizes();
        let (rank, world) = (engine.rank(), engine.world_size());
        let mut progress = Progress::new();
        for step in 0..a.steps {
            for m in 0..b.gradient_accumulation_steps {
                let range = micro_batch_range(rank, world, m, b.train_micro_batch_size_per_gpu);
                let (x, y) = corpus.batch(a.seed, step, b.train_batch_size, range, cfg.block);
                let logits = model.forward(&x);
                let loss = logits.view([-1, cfg.vocab]).cross_entropy_for_logits(&y.view([-1]));
                engine.backward(&loss).map_err(|e| e.to_string())?;
                let outcome = engine.step().map_err(|e| e.to_string())?;
                progress.record(&engine, outcome);
            }
        }
        if let Some(path) = &a.save_final {
            save_final(&engine, path)?;
        }
        let state_bytes: usize = engine.memory_bytes().iter().map(|(_, b)| b).sum();
        Ok((progress.first_loss.unwrap_or(f64::NAN), progress.last_loss, progress.median_step_s(), engine.layout().numel, state_bytes, engine.world_size()))
    })?;
    let Some((first, last, median, params, bytes, world)) = summary else { return Ok(()) };
    println!("median_step_s {median:.4}");
    let stage = config.stage();
    println!(
        "summary: {world} ranks, ZeRO stage {stage}, {params} parameters, {} optimizer steps, loss {first:.4} -> {last:.4}, model-state bytes on rank 0: {bytes}",
        a.steps
    );
    Ok(())
}
