//! A Llama-architecture causal LM trained with ZeRO, starting from a Hugging Face checkpoint and ending in one:
//!
//! ```text
//! zerorun launch --nproc-per-node 2 -- target/release/examples/llama --config configs/zero3.json \
//!     --hf MODEL_DIR --data tokens.safetensors --steps 100 --save-hf OUT_DIR
//! ```
//!
//! `--hf DIR` reads the shape from `DIR/config.json` (transformers' LlamaConfig) and the weights from
//! `DIR/model.safetensors` or its sharded index, each rank reading only the units it holds (at stage 3, one
//! decoder layer at a time, mapped). `--save-hf OUT` writes `OUT/config.json` and `OUT/model.safetensors` (shards
//! and an index past `--max-shard-size`), which `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads.
//!
//! The data order is a contract: `--data FILE` holds a tensor `tokens` [N, T+1] (int64 or int32). The global
//! batch of step s (1-based) is rows (s-1)·B .. s·B (mod N), B = train_batch_size; data-parallel rank r of W takes
//! rows r·B/W .. (r+1)·B/W of it, split into its micro-batches in order; each row's first T tokens are the input
//! and its last T the targets; the loss is the mean next-token cross-entropy over the micro-batch. Without
//! `--data`, the rows are the shared text corpus's bytes (T+1 bytes each, stride T).
mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use support::llama_model::{self, DecoderLayer, Groups, Head, LlamaConfig, RouterLogits, SplitAttention};
use support::*;
use tch::{nn, Kind, Tensor};
use zerorun::runtime::checkpoint::files::MappedTensors;
use zerorun::runtime::moe::ExpertParallel;
use zerorun::runtime::sequence::{self, SequenceParallel};
use zerorun::runtime::tensor_parallel::TensorParallel;
use zerorun::{
    Dim, Engine, EngineOptions, Mesh, MeshOptions, MicroBatch, PretrainedOptions, StagePlacement, UnitBuilders,
};

#[derive(Parser, Debug)]
#[command(about = "Llama with ZeRO: from a Hugging Face checkpoint to one")]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// A Hugging Face model folder: config.json and model.safetensors (or model.safetensors.index.json and its
    /// shards). Without it, the model is made from the flags below and --seed.
    #[arg(long)]
    hf: Option<PathBuf>,
    /// Token rows: a safetensors file with a tensor `tokens` [N, T+1], int64 or int32 (the order is in the
    /// module's docs). Without it: the shared corpus's bytes.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Write the trained model here at the end, as transformers' save_pretrained does (config.json and the
    /// weights in the run's dtype).
    #[arg(long)]
    save_hf: Option<PathBuf>,
    /// With --save-hf: the largest weights file before sharding (5GB, 500MB, or bytes), as transformers'
    /// `max_shard_size`.
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
    /// Decoder layers (without --hf).
    #[arg(long, default_value_t = 4)]
    layers: i64,
    /// Hidden size (without --hf).
    #[arg(long, default_value_t = 256)]
    hidden: i64,
    /// Attention heads (without --hf).
    #[arg(long, default_value_t = 8)]
    heads: i64,
    /// Key/value heads, grouped-query attention (without --hf; default: --heads).
    #[arg(long)]
    kv_heads: Option<i64>,
    /// The MLP's width (without --hf; default: 8/3 of --hidden, rounded up to a multiple of 64).
    #[arg(long)]
    ffn: Option<i64>,
    /// Vocabulary (without --hf; at least 256 to train on the corpus's bytes).
    #[arg(long, default_value_t = 256)]
    vocab: i64,
    /// Tie the output projection to the embedding (without --hf).
    #[arg(long)]
    tie_embeddings: bool,
    /// A mixture of experts (without --hf): every decoder layer's MLP becomes this many SwiGLU experts of --ffn
    /// width behind a router, as Mixtral's (model_type "mixtral", its parameter names).
    #[arg(long)]
    experts: Option<i64>,
    /// With --experts: experts per token.
    #[arg(long, default_value_t = 2)]
    top_k: i64,
    /// Split each row's sequence over this many adjacent ranks (DeepSpeed-Ulysses: attention trades the slices for
    /// heads by all-to-alls); ZeRO runs over every rank and a batch's rows over the world / S data-parallel ranks.
    /// The same as ds_config's `sequence_parallel_size` (either may say it; both must agree).
    #[arg(long)]
    sequence_parallel: Option<u64>,
    /// With --sequence-parallel: ring attention (each rank a head and a tail chunk of every row; key/value blocks
    /// travel around the ranks) instead of Ulysses. Taken anyway when the heads do not divide over the ranks.
    #[arg(long)]
    ring_attention: bool,
    /// Split every mixture-of-experts layer's experts over groups of this many adjacent ranks: each computes
    /// experts / E of them for the group's tokens, which travel to it by all-to-alls. Every rank holds every
    /// expert, and ZeRO shards them over all ranks. The same as ds_config's `expert_parallel` block
    /// (`enabled`, `autoep_size`; either may say it, both must agree).
    #[arg(long)]
    expert_parallel: Option<u64>,
    /// With --experts: the load-balancing loss's weight in the loss (transformers' router_aux_loss_coef).
    #[arg(long, default_value_t = 0.001)]
    aux_loss_coef: f64,
    /// Tokens per row of the corpus (without --data).
    #[arg(long, default_value_t = 64)]
    seq_len: i64,
    /// Cut the model into this many pipeline stages (the embedding, each decoder layer, the norm with the head as
    /// layers); ds_config's `pipeline` section picks the schedule and the cut. Untied embeddings only.
    #[arg(long)]
    pipeline_stages: Option<usize>,
    /// Split every layer across groups of this many adjacent ranks (attention heads, key/value heads, the MLP,
    /// the vocabulary); ZeRO runs over the data-parallel ranks of each group position. With --pipeline-stages:
    /// inside each stage (ranks = stages x data x tensor-parallel).
    #[arg(long)]
    tensor_parallel: Option<usize>,
}

fn main() {
    run_main(&Args::parse(), run);
}

/// The model's shape: from `--hf DIR/config.json`, else the flags.
fn model_config(args: &Args) -> Result<LlamaConfig, String> {
    if let Some(dir) = &args.hf {
        return LlamaConfig::from_dir(dir).map_err(|e| format!("--hf: {e}"));
    }
    let ffn = args.ffn.unwrap_or_else(|| (8 * args.hidden / 3 + 63) / 64 * 64);
    let c = LlamaConfig {
        model_type: if args.experts.is_some() { "mixtral" } else { "llama" }.into(),
        vocab_size: args.vocab,
        hidden_size: args.hidden,
        intermediate_size: ffn,
        num_hidden_layers: args.layers,
        num_attention_heads: args.heads,
        num_key_value_heads: args.kv_heads,
        head_dim: None,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        tie_word_embeddings: args.tie_embeddings,
        max_position_embeddings: 2048,
        hidden_act: "silu".into(),
        attention_bias: false,
        mlp_bias: false,
        rope_scaling: None,
        moe: match args.experts {
            None => Default::default(),
            Some(e) => llama_model::MoeKeys {
                num_local_experts: Some(e),
                num_experts_per_tok: Some(args.top_k),
                router_aux_loss_coef: Some(args.aux_loss_coef),
                output_router_logits: true,
                ..Default::default()
            },
        },
    };
    c.check()?;
    Ok(c)
}

/// Training rows: [N, T+1] token ids, mapped (`--data`) or the corpus's bytes.
enum Rows {
    File { file: MappedTensors, int32: bool, n: usize, width: usize },
    Bytes { bytes: Vec<u8>, width: usize },
}

impl Rows {
    /// Opens `--data` (checking dtype, shape and every id against `vocab`), or the corpus's bytes.
    fn open(data: Option<&Path>, vocab: i64, seq_len: i64) -> Result<Rows, String> {
        let Some(path) = data else {
            if vocab < 256 {
                return Err(format!(
                    "the corpus's bytes need a vocabulary of at least 256 (it is {vocab}): give --data or --vocab 256"
                ));
            }
            let bytes = include_bytes!("data/shakespeare.txt").to_vec();
            return Ok(Rows::Bytes { bytes, width: seq_len as usize + 1 });
        };
        let at = |e: String| format!("--data {}: {e}", path.display());
        let file = MappedTensors::open(path).map_err(|e| at(e.to_string()))?;
        let (dtype, shape, bytes) = file.raw("tokens").map_err(|e| at(e.to_string()))?;
        let int32 = match dtype.as_str() {
            "I64" => false,
            "I32" => true,
            other => return Err(at(format!("tensor `tokens` is {other}: int64 or int32 token ids wanted"))),
        };
        if shape.len() != 2 || shape[1] < 2 || shape[0] == 0 {
            return Err(at(format!("tensor `tokens` is {shape:?}: [N, T+1] rows of at least 2 tokens wanted")));
        }
        let ids: Vec<i64> = if int32 {
            bytemuck::pod_collect_to_vec::<u8, i32>(bytes).into_iter().map(i64::from).collect()
        } else {
            bytemuck::pod_collect_to_vec::<u8, i64>(bytes)
        };
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id < 0 || id >= vocab) {
            let (row, col) = (i / shape[1], i % shape[1]);
            return Err(at(format!(
                "tensor `tokens` holds id {id} at row {row}, column {col}: not in the vocabulary 0..{vocab}"
            )));
        }
        Ok(Rows::File { file, int32, n: shape[0], width: shape[1] })
    }

    fn len(&self) -> usize {
        match self {
            Rows::File { n, .. } => *n,
            Rows::Bytes { bytes, width } => (bytes.len() - 1) / (width - 1),
        }
    }

    fn width(&self) -> usize {
        match self {
            Rows::File { width, .. } | Rows::Bytes { width, .. } => *width,
        }
    }

    /// Row `i` (mod N).
    fn row(&self, i: u64) -> Vec<i64> {
        let i = (i % self.len() as u64) as usize;
        let w = self.width();
        match self {
            Rows::File { file, int32, .. } => {
                let (_, _, bytes) = file.raw("tokens").expect("checked when opened");
                let size = if *int32 { 4 } else { 8 };
                let row = &bytes[i * w * size..(i + 1) * w * size];
                match int32 {
                    true => bytemuck::pod_collect_to_vec::<u8, i32>(row).into_iter().map(i64::from).collect(),
                    false => bytemuck::pod_collect_to_vec::<u8, i64>(row),
                }
            }
            Rows::Bytes { bytes, .. } => bytes[i * (w - 1)..i * (w - 1) + w].iter().map(|&b| b as i64).collect(),
        }
    }

    /// Inputs and targets [rows, T] of rows `first .. first + count`.
    fn batch(&self, first: u64, count: u64) -> (Tensor, Tensor) {
        let w = self.width() as i64;
        let ids: Vec<i64> = (first..first + count).flat_map(|i| self.row(i)).collect();
        let all = Tensor::from_slice(&ids).view([count as i64, w]);
        (all.narrow(1, 0, w - 1), all.narrow(1, 1, w - 1))
    }
}

/// The model as one builder per unit (the embedding, each decoder layer, the norm with the head), so at stage 3
/// no rank ever holds it whole; tied embeddings make it one unit. With `--hf`, the weights come from its files.
/// Sparse layers put their router logits in `router` as they run, for the load-balancing loss; with `groups`
/// each decoder layer's attention runs over the sequence-parallel group and its experts over the expert-parallel
/// one.
fn builders<'a>(c: &LlamaConfig, hf: Option<&Path>, router: &RouterLogits, groups: Groups<'a>) -> UnitBuilders<'a> {
    let c = c.clone();
    let builders = if c.tie_word_embeddings {
        let router = router.clone();
        UnitBuilders::new().unit(["model"], move |root: &nn::Path| {
            let model = llama_model::Llama::new(root, &c);
            let router = router.clone();
            Box::new(move |x: &Tensor| {
                let (logits, routed) = model.forward_in(x, groups);
                routed.into_iter().for_each(|l| router.push(l));
                logits
            })
        })
    } else {
        let layers = c.num_hidden_layers;
        let embed_config = c.clone();
        let mut b = UnitBuilders::new().unit(["model.embed_tokens"], move |root: &nn::Path| {
            let embed = llama_model::embedding(root, &embed_config);
            Box::new(move |x: &Tensor| nn::Module::forward(&embed, x))
        });
        for i in 0..layers {
            let c = c.clone();
            let router = router.clone();
            b = b.unit([format!("model.layers.{i}")], move |root: &nn::Path| {
                let layer = DecoderLayer::new(root / "model" / "layers" / i, &c, i);
                let router = router.clone();
                Box::new(move |x: &Tensor| {
                    let (out, logits) = layer.forward_in(x, groups);
                    logits.into_iter().for_each(|l| router.push(l));
                    out
                })
            });
        }
        let c = c.clone();
        b.unit(["model.norm", "lm_head"], move |root: &nn::Path| {
            let head = Head::new(root, &c, None);
            Box::new(move |x: &Tensor| head.forward(x))
        })
    };
    match hf {
        Some(dir) => builders.init_from(dir),
        None => builders,
    }
}

fn run(args: &Args) -> Result<(), String> {
    let a = &args.common;
    a.check()?;
    if a.init.is_some() {
        return Err("--init: give the weights as --hf DIR (config.json and model.safetensors)".into());
    }
    let mut config = load_config(&a.config)?;
    let c = model_config(args)?;
    let (sp, ring) = sequence_parallel(args, &mut config, &c)?;
    let ep = expert_parallel(args, &mut config, &c)?;
    // No data to read when no step runs (a conversion: --steps 0 --save-hf).
    let rows = match a.steps {
        0 => None,
        _ => Some(Rows::open(args.data.as_deref(), c.vocab_size, args.seq_len)?),
    };
    let max_shard_bytes = zerorun::runtime::checkpoint::hf::parse_size(&args.max_shard_size)
        .map_err(|e| format!("--max-shard-size {e}"))?;
    let kind = config_kind(&config);
    if config.stage() == 3 && c.tie_word_embeddings {
        tracing::warn!("tied embeddings: the embedding serves both ends of the model, so stage 3 gathers the whole model as one unit");
    }
    share_cores(a.ranks);
    let device = a.device()?;
    if let Some(t) = args.tensor_parallel {
        llama_model::tp::check(&c, t)?;
    }
    if args.pipeline_stages.is_some() || args.tensor_parallel.is_some() {
        if c.experts().is_some() {
            return Err(format!(
                "--pipeline-stages and --tensor-parallel: not with a mixture of experts in this example (model_type {:?})",
                c.model_type
            ));
        }
        if device != tch::Device::Cpu {
            return Err("--pipeline-stages and --tensor-parallel run on the CPU only in this example".into());
        }
        let run = Run { args, config: &config, model: &c, rows: rows.as_ref(), kind, max_shard_bytes };
        return match args.pipeline_stages {
            Some(stages) => run.pipeline(stages),
            None => run.tensor_parallel(args.tensor_parallel.expect("checked")),
        };
    }
    let timeout = Duration::from_secs_f64(config.comms_timeout);
    let summary = run_ranks(a.ranks, timeout, |comm| {
        tch::manual_seed(a.seed as i64);
        let vs = nn::VarStore::new(device);
        let options = EngineOptions { activation_checkpointing: a.activation_checkpointing, ..Default::default() };
        let router = RouterLogits::default();
        // Adjacent ranks split each row's sequence; the engine runs over all of them.
        let group = match sp {
            1 => None,
            s => Some(SequenceParallel::adjacent(comm.as_ref(), s as usize).map_err(|e| e.to_string())?),
        };
        let split = group.as_ref().map(|g| match ring {
            true => SplitAttention::Ring(g),
            false => SplitAttention::Ulysses(g),
        });
        // Adjacent ranks split the experts; the engine runs over all of them.
        let experts = match ep {
            1 => None,
            e => Some(ExpertParallel::adjacent(comm.as_ref(), e as usize).map_err(|e| e.to_string())?),
        };
        let groups = Groups { sequence: split, experts: experts.as_ref() };
        let built = builders(&c, args.hf.as_deref(), &router, groups);
        let (mut engine, model) =
            Engine::from_builders(&vs, config.clone(), comm, options, built).map_err(|e| e.to_string())?;
        let b = engine.batch_sizes();
        // The data-parallel rank and ranks: sequence groups share their rows.
        let (rank, world) = (engine.rank() as u64 / sp, engine.world_size() as u64 / sp);
        let (global, micro) = (b.train_batch_size, b.train_micro_batch_size_per_gpu);
        let mut progress = Progress::new(a.steps).in_tokens(args.seq_len);
        let first = resume(a, &mut engine)?;
        let rows = rows.as_ref();
        for step in first..a.steps {
            let rows = rows.expect("opened when steps run");
            // Step s = step + 1 takes rows step·B .. (step+1)·B; this rank its share, micro-batch by micro-batch.
            let base = step * global + rank * (global / world);
            for m in 0..b.gradient_accumulation_steps {
                let (x, y) = rows.batch(base + m * micro, micro);
                router.take(); // a recomputation's (activation checkpointing) from the last backward
                let (x, y) = match &split {
                    None => (x, y),
                    Some(split) => {
                        let cut = |t: &Tensor| split.part(t, 1).map_err(|e| e.to_string());
                        (cut(&x)?, cut(&y)?)
                    }
                };
                let logits = engine.forward(&model, &x.to_device(device)).map_err(|e| e.to_string())?;
                let loss = match &split {
                    None => llama_model::loss_with_aux(&c, &logits, &y.to_device(device), &router.take()),
                    Some(split) => {
                        let sum = llama_model::token_loss_sum(&logits, &y.to_device(device));
                        sequence::sequence_loss(split.group(), &sum, y.numel() as i64).map_err(|e| e.to_string())?
                    }
                };
                engine.backward_units(&model, &loss).map_err(|e| e.to_string())?;
                let outcome = engine.step().map_err(|e| e.to_string())?;
                progress.record(&engine, outcome);
                maybe_save(a, &mut engine, outcome)?;
            }
        }
        engine.finish().map_err(|e| e.to_string())?;
        if let Some(path) = &a.save_final {
            save_final(&mut engine, path)?;
        }
        if let Some(out) = &args.save_hf {
            save_hf(&mut engine, args.hf.as_deref(), &c, out, kind, max_shard_bytes)?;
        }
        finish_reports(&mut engine)?;
        Ok((
            progress.first_loss.unwrap_or(f64::NAN),
            progress.last_loss,
            progress.median_step_s(),
            engine.layout().numel,
        ))
    })?;
    let Some((first, last, median, params)) = summary else { return Ok(()) };
    println!("median_step_s {median:.4}");
    println!(
        "summary: Llama {} layers x {} hidden, {params} parameters, ZeRO stage {}, {} optimizer steps, loss {first:.4} -> {last:.4}",
        c.num_hidden_layers,
        c.hidden_size,
        config.stage(),
        a.steps
    );
    Ok(())
}

/// A degree a flag and a ds_config key may both give: the flag where the key is 1 (its default), the key where
/// the flag is absent; both given must agree.
fn agreed(flag: Option<u64>, key: u64, flag_name: &str, key_name: &str) -> Result<u64, String> {
    match (flag, key) {
        (Some(flag), 1) => Ok(flag),
        (Some(flag), key) if flag != key => {
            Err(format!("{flag_name} {flag} and ds_config's {key_name} {key} disagree"))
        }
        (_, key) => Ok(key),
    }
}

/// The sequence-parallel degree: `--sequence-parallel` and ds_config's `sequence_parallel_size` (either, or both
/// agreeing), written into the config the engine reads. Checked against the model's heads and the other flags.
/// Returns (S, ring attention): ring when asked, or when the heads do not divide over S (Ulysses needs them to).
fn sequence_parallel(args: &Args, config: &mut zerorun::Config, c: &LlamaConfig) -> Result<(u64, bool), String> {
    let s =
        agreed(args.sequence_parallel, config.sequence_parallel_size, "--sequence-parallel", "sequence_parallel_size")?;
    if s <= 1 {
        if args.ring_attention {
            return Err("--ring-attention: needs --sequence-parallel S (or sequence_parallel_size) above 1".into());
        }
        return Ok((1, false));
    }
    let ring = args.ring_attention || c.num_attention_heads % s as i64 != 0;
    if ring && !args.ring_attention {
        tracing::info!(
            heads = c.num_attention_heads,
            ranks = s,
            "the heads do not divide over the sequence-parallel ranks: ring attention rather than Ulysses"
        );
    }
    let parts = if ring { 2 * s } else { s };
    if args.seq_len % parts as i64 != 0 && args.data.is_none() {
        return Err(format!("--sequence-parallel {s}: --seq-len {} does not split into {parts} parts", args.seq_len));
    }
    if c.experts().is_some() || args.pipeline_stages.is_some() || args.tensor_parallel.is_some() {
        return Err(format!(
            "--sequence-parallel {s}: not with experts, --pipeline-stages or --tensor-parallel in this example yet"
        ));
    }
    config.sequence_parallel_size = s;
    Ok((s, ring))
}

/// The expert-parallel degree: `--expert-parallel` and ds_config's `expert_parallel` block (either, or both
/// agreeing), written into the config the engine checks. It must divide every sparse layer's experts.
fn expert_parallel(args: &Args, config: &mut zerorun::Config, c: &LlamaConfig) -> Result<u64, String> {
    let e = agreed(
        args.expert_parallel,
        config.expert_parallel.size(),
        "--expert-parallel",
        "expert_parallel.autoep_size",
    )?;
    if let Some(preset) = &config.expert_parallel.preset_model {
        if *preset != c.model_type {
            return Err(format!(
                "ds_config's expert_parallel.preset_model {preset:?} is not the model's model_type {:?}",
                c.model_type
            ));
        }
    }
    if e == 0 {
        return Err("--expert-parallel 0: at least 1 rank per group".into());
    }
    if e == 1 {
        return Ok(1);
    }
    let Some(experts) = c.experts() else {
        return Err(format!("--expert-parallel {e}: the model has no experts (model_type {:?})", c.model_type));
    };
    if experts % e as i64 != 0 {
        return Err(format!("--expert-parallel {e}: the {experts} experts of a layer do not split over {e} ranks"));
    }
    config.expert_parallel.enabled = true;
    config.expert_parallel.autoep_size = e;
    Ok(e)
}

/// `--save-hf OUT`: the weights as transformers writes them and the config.json (`--hf`'s, or this shape's).
fn save_hf(
    engine: &mut Engine,
    hf: Option<&Path>,
    c: &LlamaConfig,
    out: &Path,
    kind: Kind,
    max_shard_bytes: u64,
) -> Result<(), String> {
    let at = |e: String| format!("--save-hf {}: {e}", out.display());
    let source = match hf {
        Some(dir) => dir.join("config.json"),
        None => {
            // This shape's config.json, written first; save_pretrained sets its dtype.
            let path = out.join("config.json");
            if engine.rank() == 0 {
                std::fs::create_dir_all(out).map_err(|e| at(e.to_string()))?;
                let text = serde_json::to_string_pretty(&c.to_json()).expect("config serializes");
                std::fs::write(&path, text).map_err(|e| at(e.to_string()))?;
            }
            path
        }
    };
    let options = PretrainedOptions { config: Some(&source), kind, max_shard_bytes };
    let files = engine.save_pretrained(out, &options).map_err(|e| at(e.to_string()))?;
    if engine.rank() == 0 {
        println!(
            "saved for transformers: {}",
            files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(())
}

/// What a pipeline or tensor-parallel run reads.
struct Run<'a> {
    args: &'a Args,
    config: &'a zerorun::Config,
    model: &'a LlamaConfig,
    rows: Option<&'a Rows>,
    kind: Kind,
    max_shard_bytes: u64,
}

impl Run<'_> {
    /// This data-parallel rank's micro-batch `m` of step `step` (0-based), by the data contract.
    fn micro_batch(&self, b: zerorun::config::BatchSizes, step: u64, m: u64, data: (usize, usize)) -> (Tensor, Tensor) {
        let (global, micro) = (b.train_batch_size, b.train_micro_batch_size_per_gpu);
        let base = step * global + data.0 as u64 * (global / data.1 as u64);
        self.rows.expect("opened when steps run").batch(base + m * micro, micro)
    }

    /// `--save-hf` of whole tensors assembled by the caller (rank 0 writes).
    fn write_hf(&self, whole: &[(String, Tensor)], rank: usize) -> Result<(), String> {
        let Some(out) = &self.args.save_hf else { return Ok(()) };
        if rank != 0 {
            return Ok(());
        }
        let at = |e: String| format!("--save-hf {}: {e}", out.display());
        let source = match &self.args.hf {
            Some(dir) => dir.join("config.json"),
            None => {
                std::fs::create_dir_all(out).map_err(|e| at(e.to_string()))?;
                let path = out.join("config.json");
                let text = serde_json::to_string_pretty(&self.model.to_json()).expect("config serializes");
                std::fs::write(&path, text).map_err(|e| at(e.to_string()))?;
                path
            }
        };
        let options =
            PretrainedOptions { config: Some(&source), kind: self.kind, max_shard_bytes: self.max_shard_bytes };
        let files = zerorun::runtime::engine::write_pretrained(out, whole, &options).map_err(|e| at(e.to_string()))?;
        println!(
            "saved for transformers: {}",
            files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        );
        Ok(())
    }

    /// The starting weights: `--hf`'s, each rank cutting its slices (tensor parallel) or reading its stage's.
    fn load(&self, vs: &nn::VarStore, tp: Option<&TensorParallel>) -> Result<(), String> {
        let Some(dir) = &self.args.hf else { return Ok(()) };
        let loaded = match tp {
            Some(tp) => zerorun::runtime::engine::load_mapped_slices(vs, dir, tp.rank(), tp.size(), tp.placements()),
            None => zerorun::runtime::engine::load_mapped(vs, dir),
        };
        loaded.map_err(|e| format!("--hf {}: {e}", dir.display()))
    }

    /// `--tensor-parallel T` without pipeline stages: groups of T adjacent ranks split every layer; each rank's
    /// engine runs ZeRO over the ranks at its position in the other groups.
    fn tensor_parallel(&self, t: usize) -> Result<(), String> {
        let a = &self.args.common;
        let timeout = Duration::from_secs_f64(self.config.comms_timeout);
        let summary = run_ranks(a.ranks, timeout, |comm| {
            let options = MeshOptions { tensor_parallel: Some(t), ..Default::default() };
            let mesh = Mesh::from_config(comm, self.config, options).map_err(|e| e.to_string())?;
            let rank = mesh.rank();
            let data = (mesh.coordinate(Dim::Shard), mesh.shape().data());
            let tp = mesh.tensor_parallel().map_err(|e| e.to_string())?;
            let (mut vs, model) =
                build_model(a.seed, None, |vs| llama_model::tp::TpLlama::new(&vs.root(), &tp, self.model))?;
            self.load(&vs, Some(&tp))?;
            to_config_precision(self.config, &mut vs);
            let options = EngineOptions { activation_checkpointing: a.activation_checkpointing, ..Default::default() }
                .units_of(&model);
            let mut engine =
                zerorun::initialize_with(&vs, self.config.clone(), mesh, options).map_err(|e| e.to_string())?;
            let b = engine.batch_sizes();
            let mut progress = Progress::new(a.steps).in_tokens(self.args.seq_len);
            let first = resume(a, &mut engine)?;
            for step in first..a.steps {
                for m in 0..b.gradient_accumulation_steps {
                    let (x, y) = self.micro_batch(b, step, m, data);
                    let logits = engine.forward(&model, &x).map_err(|e| e.to_string())?;
                    let loss = llama_model::tp::loss(&tp, self.model, &logits, &y).map_err(|e| e.to_string())?;
                    engine.backward_units(&model, &loss).map_err(|e| e.to_string())?;
                    let outcome = engine.step().map_err(|e| e.to_string())?;
                    progress.record_for(rank == 0, b.train_batch_size, outcome);
                    maybe_save(a, &mut engine, outcome)?;
                }
            }
            engine.finish().map_err(|e| e.to_string())?;
            if self.args.save_hf.is_some() {
                let whole = whole_parameters(&tp, engine.full_parameters().map_err(|e| e.to_string())?)?;
                self.write_hf(&whole, rank)?;
            }
            finish_reports(&mut engine)?;
            Ok((progress.first_loss.unwrap_or(f64::NAN), progress.last_loss, progress.median_step_s()))
        })?;
        let Some((first, last, median)) = summary else { return Ok(()) };
        println!("median_step_s {median:.4}");
        println!(
            "summary: Llama {} layers x {} hidden, tensor parallel {t}, ZeRO stage {}, {} optimizer steps, loss {first:.4} -> {last:.4}",
            self.model.num_hidden_layers,
            self.model.hidden_size,
            self.config.stage(),
            a.steps
        );
        Ok(())
    }

    /// `--pipeline-stages P` (with `--tensor-parallel T` inside each stage): each rank builds and trains only its
    /// stage's layers.
    fn pipeline(&self, stages: usize) -> Result<(), String> {
        let a = &self.args.common;
        if a.activation_checkpointing {
            return Err("--pipeline-stages runs without --activation-checkpointing (stage 3's)".into());
        }
        if self.model.tie_word_embeddings {
            return Err("--pipeline-stages: tied embeddings are not supported (the embedding and the head sit on different stages)".into());
        }
        let timeout = Duration::from_secs_f64(self.config.comms_timeout);
        let summary = run_ranks(a.ranks, timeout, |comm| {
            let options = MeshOptions { pipeline_stages: Some(stages), tensor_parallel: self.args.tensor_parallel };
            let mesh = Mesh::from_config(comm, self.config, options).map_err(|e| e.to_string())?;
            let placement = StagePlacement::of(&mesh, &self.config.pipeline);
            let tp = match self.args.tensor_parallel {
                Some(_) => Some(mesh.tensor_parallel().map_err(|e| e.to_string())?),
                None => None,
            };
            let model = match &tp {
                Some(tp) => llama_model::tp::pipeline_model(self.model, tp),
                None => llama_model::pipeline_model(self.model),
            };
            let partition = &self.config.pipeline.partition;
            let (mut vs, stage) = build_model(a.seed, None, |vs| model.build_stage(vs, &placement, partition))?;
            let stage = stage.map_err(|e| e.to_string())?;
            self.load(&vs, tp.as_ref())?;
            to_config_precision(self.config, &mut vs);
            let mut pipe =
                zerorun::initialize_pipeline(&vs, self.config.clone(), mesh, stage, EngineOptions::default())
                    .map_err(|e| e.to_string())?;
            let b = pipe.engine().batch_sizes();
            let (first, last) = (placement.takes_inputs(), placement.takes_labels());
            let data = (placement.data_index, placement.data_parallel);
            let mut progress = Progress::new(a.steps).in_tokens(self.args.seq_len);
            let world = placement.stages * placement.data_parallel * self.args.tensor_parallel.unwrap_or(1);
            let first_step = resume_with(a, placement.rank == 0, world, |dir| {
                pipe.load_checkpoint(dir, None).map_err(|e| e.to_string())?;
                Ok(pipe.engine().global_steps())
            })?;
            for step in first_step..a.steps {
                let mut micro_batches = (0..b.gradient_accumulation_steps).map(|m| {
                    let (x, y) = self.micro_batch(b, step, m, data);
                    MicroBatch { inputs: first.then_some(x), labels: last.then_some(y) }
                });
                let outcome = pipe.train_batch(&mut micro_batches).map_err(|e| e.to_string())?;
                progress.record_for(placement.rank == 0, b.train_batch_size, outcome);
                if let (Some(dir), Some(every)) = (&a.checkpoint_dir, a.save_every) {
                    if (step + 1) % every == 0 {
                        pipe.save_checkpoint(dir, None).map_err(|e| e.to_string())?;
                    }
                }
            }
            pipe.finish().map_err(|e| e.to_string())?;
            if self.args.save_hf.is_some() {
                // Stage 0's ranks receive every stage's parameters; their tensor-parallel groups make them whole.
                let params = pipe.full_parameters().map_err(|e| e.to_string())?;
                let params = match &tp {
                    Some(tp) if placement.stage == 0 => whole_parameters(tp, params)?,
                    _ => params,
                };
                self.write_hf(&params, placement.rank)?;
            }
            println!("peak_rss_bytes {}", zerorun::runtime::report::memory::rss().1);
            Ok((progress.first_loss.unwrap_or(f64::NAN), progress.last_loss, progress.median_step_s()))
        })?;
        let Some((first, last, median)) = summary else { return Ok(()) };
        println!("median_step_s {median:.4}");
        println!(
            "summary: Llama {} layers x {} hidden, {stages} pipeline stages, tensor parallel {}, ZeRO stage {} per stage, {} optimizer steps, loss {first:.4} -> {last:.4}",
            self.model.num_hidden_layers,
            self.model.hidden_size,
            self.args.tensor_parallel.unwrap_or(1),
            self.config.stage(),
            a.steps
        );
        Ok(())
    }
}

/// Every parameter whole: the tensor-parallel slices gathered along the dimension they split, padding left out.
/// Collective over the group.
fn whole_parameters(tp: &TensorParallel, params: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>, String> {
    params
        .into_iter()
        .map(|(name, p)| tp.gather_whole(&name, &p).map(|w| (name, w)).map_err(|e| e.to_string()))
        .collect()
}
