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
//!
//! This file holds the flags, the model's units and the data-parallel run; `rows.rs` the token rows, `axes.rs` the
//! sequence- and expert-parallel degrees, `model_parallel.rs` the tensor-parallel and pipeline runs, `hf_files.rs`
//! the Hugging Face files read and written.
#[path = "../support/mod.rs"]
mod support;

mod axes;
mod hf_files;
mod model_parallel;
mod rows;

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use axes::{expert_parallel, sequence_parallel};
use clap::Parser;
use hf_files::save_hf;
use model_parallel::Run;
use rows::Rows;
use support::llama_model::{self, DecoderLayer, Groups, Head, LlamaConfig, RouterLogits, SplitAttention};
use support::*;
use tch::{nn, Tensor};
use zerorun::runtime::moe::ExpertParallel;
use zerorun::runtime::sequence::{self, SequenceParallel};
use zerorun::{Engine, EngineOptions, UnitBuilders};

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
    /// experts / E of them for the group's tokens, which travel to it by all-to-alls. At stages 1-3 each layer's
    /// experts of one position are a unit split over that position's ranks (the model is built whole first; stage
    /// 3 also gathers them there alone); at stage 0 every rank holds every expert. The same as ds_config's
    /// `expert_parallel` block (`enabled`, `autoep_size`; either may say it, both must agree).
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

/// The model a data-parallel run trains: built unit by unit and walked by the engine, or (a mixture of experts
/// split over expert-parallel positions, or checkpointed) built whole and run through scopes, each layer's experts
/// of one position a unit of their own.
enum Model<'a> {
    Built(zerorun::BuiltModel<'a>),
    Scoped(llama_model::Llama, llama_model::ScopedUnits),
}

/// How many expert-parallel positions the scoped model's expert units follow, for a mixture of experts that runs
/// through scopes; None: the model runs as built units (dense, tied embeddings, sequence parallelism).
/// - E at stages 1-3 with `--expert-parallel` E above 1: the engine reduces and steps a rank's experts (at stage
///   3 also gathers them) only among the ranks that compute them.
/// - 1 with `--activation-checkpointing` otherwise: a checkpointed layer's router logits leave it with their
///   gradient (the load-balancing loss), which the built units' recomputation cannot give.
///
/// Where the engine cannot split the experts yet (hpZ, MiCS, quantized weights, tied embeddings), every rank holds
/// every expert as at stage 0, which is said once.
fn expert_positions(config: &zerorun::Config, c: &LlamaConfig, ep: u64, sp: u64, a: &CommonArgs) -> Option<usize> {
    if c.experts().is_none() || sp > 1 {
        return None;
    }
    let z = &config.zero_optimization;
    let wanted = config.stage() >= 1 && ep > 1;
    let why = if c.tie_word_embeddings {
        "tied embeddings"
    } else if z.zero_hpz_partition_size > 1 || z.zero_quantized_weights || z.mics_shard_size.is_some() {
        "hpZ, MiCS or quantized weights"
    } else if wanted {
        return Some(ep as usize);
    } else {
        return a.activation_checkpointing.then_some(1);
    };
    if wanted {
        tracing::warn!("{why}: every rank holds every expert (ZeRO splits them over all ranks); without it, stages 1-3 split each rank's experts over the ranks that compute them");
    }
    (!c.tie_word_embeddings && a.activation_checkpointing).then_some(1)
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
            e => Some(Rc::new(ExpertParallel::adjacent(comm.as_ref(), e as usize).map_err(|e| e.to_string())?)),
        };
        let groups = Groups { sequence: split, experts: experts.as_deref() };
        let (mut engine, model) = if let Some(positions) = expert_positions(&config, &c, ep, sp, a) {
            // A mixture of experts through scopes: the whole model is built, then each layer's experts of one
            // position are a unit (at stages 1-3 split over that position's ranks), entered from the model's own
            // forward, each layer checkpointed there with --activation-checkpointing.
            let whole = llama_model::Llama::new(&vs.root(), &c);
            if let Some(dir) = &args.hf {
                zerorun::runtime::engine::load_mapped(&vs, dir).map_err(|e| format!("--hf {}: {e}", dir.display()))?;
            }
            let names: Vec<String> = vs.variables().into_keys().collect();
            let position = experts.as_ref().map_or(0, |g| g.rank()) % positions;
            let units = llama_model::ScopedUnits::new(&c, &names, position, positions);
            let options =
                EngineOptions { units: Some(units.prefixes.clone()), activation_checkpointing: false, ..options };
            let engine = Engine::new(&vs, config.clone(), comm, options).map_err(|e| e.to_string())?;
            (engine, Model::Scoped(whole, units))
        } else {
            let built = builders(&c, args.hf.as_deref(), &router, groups);
            let (engine, model) =
                Engine::from_builders(&vs, config.clone(), comm, options, built).map_err(|e| e.to_string())?;
            (engine, Model::Built(model))
        };
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
                let logits = match &model {
                    Model::Built(model) => engine.forward(model, &x.to_device(device)),
                    Model::Scoped(model, units) => {
                        let checkpointed = a.activation_checkpointing;
                        let ids = x.to_device(device);
                        model.forward_units(&mut engine, units, &ids, experts.as_ref(), checkpointed).map(
                            |(logits, routed)| {
                                routed.into_iter().for_each(|l| router.push(l));
                                logits
                            },
                        )
                    }
                }
                .map_err(|e| e.to_string())?;
                let loss = match &split {
                    None => llama_model::loss_with_aux(&c, &logits, &y.to_device(device), &router.take()),
                    Some(split) => {
                        let sum = llama_model::token_loss_sum(&logits, &y.to_device(device));
                        sequence::sequence_loss(split.group(), &sum, y.numel() as i64).map_err(|e| e.to_string())?
                    }
                };
                match &model {
                    Model::Built(model) => engine.backward_units(model, &loss),
                    Model::Scoped(..) => engine.backward(&loss),
                }
                .map_err(|e| e.to_string())?;
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
