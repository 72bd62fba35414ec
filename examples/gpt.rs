//! A GPT-style character model in plain tch (token and position embeddings, pre-norm transformer blocks, a
//! linear head) trained with zerorun on the Shakespeare text in examples/data.
//!
//!     cargo run --release --example gpt -- --config configs/zero2.json --ranks 2 --steps 30
use std::time::Duration;

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use tch::Tensor;
use zerorun::runtime::engine::{no_decay_for_1d, EngineOptions};
use zerorun::{Config, Dim, Engine, Mesh, MeshOptions, MicroBatch, StagePlacement};

#[path = "support/mod.rs"]
mod support;
use support::gpt_model::tp::{TpGpt, TpUnits};
use support::gpt_model::{gpt_builders, held_out_sums, padded_vocab, pipeline_model, Corpus, Gpt, GptConfig};
use support::nanogpt_model::{NanoGpt, NanoGptConfig};
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
    /// Cut the model into this many pipeline stages (the embeddings, the blocks, the head as layers); the ranks
    /// are stages x data-parallel replicas. ds_config's `pipeline` section picks the schedule and the cut.
    #[arg(long)]
    pipeline_stages: Option<usize>,
    /// Split every layer across groups of this many adjacent ranks (tensor parallelism: attention heads, the MLP,
    /// the vocabulary of the embedding, head and loss); ZeRO runs over the data-parallel ranks of each group
    /// position. The embedding and head hold the vocabulary padded to a multiple of 8 (also at 1), so runs at
    /// different degrees compare; checkpoints and --save-final hold the true vocabulary, as without the flag.
    /// With --pipeline-stages: each stage's layers split so (ranks = stages x data x tensor-parallel).
    #[arg(long)]
    tensor_parallel: Option<usize>,
    /// Build the whole model before the engine shards it. By default stage 3 builds it unit by unit
    /// (`zerorun::UnitBuilders`) when ranks run as processes, so no rank ever holds it whole, start-up included;
    /// the initial weights are the same either way.
    #[arg(long)]
    whole_model: bool,
    /// Enter the model's units from this loop with `engine.unit` (units as scopes of the program's forward, the
    /// backward's hooks gathering and reducing them) instead of `engine.forward`'s walk: the same result; `zerorun
    /// bench scopes` times both.
    #[arg(long, conflicts_with_all = ["pipeline_stages", "tensor_parallel", "activation_checkpointing"])]
    scoped: bool,
    /// The text to train on, characters as tokens (default: the bundled first 300 kB of Shakespeare;
    /// examples/data/tinyshakespeare.txt is the whole corpus nanoGPT trains on).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Hold out the last F of the corpus (nanoGPT's split; never trained on) and report the loss on all of it, in
    /// non-overlapping windows of --block tokens, after the last step (`step N val loss X`).
    #[arg(long, default_value_t = 0.0)]
    val_fraction: f64,
    /// Also evaluate every N optimizer steps (needs --val-fraction).
    #[arg(long)]
    eval_every: Option<u64>,
    /// The model: this example's GPT (every parallelism), or nanoGPT's (its head tied to the token embedding, no
    /// biases, its initialisation, units entered with `engine.unit`; data parallel at every ZeRO stage).
    #[arg(long, value_enum, default_value_t = Arch::Zerorun)]
    arch: Arch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Arch {
    Zerorun,
    Nanogpt,
}

impl Args {
    /// Whether step `step` (1-based, done) is followed by an evaluation.
    fn evaluates_after(&self, step: u64) -> bool {
        self.val_fraction > 0.0
            && (step == self.common.steps || self.eval_every.is_some_and(|k| k > 0 && step % k == 0))
    }
}

/// Windows of the held-out part per forward.
const EVAL_ROWS: i64 = 64;

fn main() {
    run_main(&Args::parse(), run);
}

fn run(args: &Args) -> Result<(), String> {
    let a = &args.common;
    a.check()?;
    let config = load_config(&a.config)?;
    if args.eval_every.is_some() && args.val_fraction <= 0.0 {
        return Err("--eval-every needs a held-out part: give --val-fraction F (nanoGPT's is 0.1)".into());
    }
    let corpus = Corpus::from_args(args.data.as_deref())?.hold_out(args.val_fraction, args.block)?;
    let cfg =
        GptConfig { vocab: corpus.vocab, block: args.block, layers: args.layers, heads: args.heads, embd: args.embd };
    share_cores(a.ranks);
    let device = a.device()?;
    if device != tch::Device::Cpu && (args.pipeline_stages.is_some() || args.tensor_parallel.is_some()) {
        return Err("--device cuda trains the data-parallel GPT; with --pipeline-stages or --tensor-parallel this example runs on the CPU only".into());
    }
    if args.arch == Arch::Nanogpt {
        if args.pipeline_stages.is_some() || args.tensor_parallel.is_some() || a.activation_checkpointing {
            return Err("--arch nanogpt trains data parallel (every ZeRO stage); --pipeline-stages, --tensor-parallel and --activation-checkpointing run --arch zerorun".into());
        }
        return run_nanogpt(args, &config, &corpus);
    }
    if let Some(stages) = args.pipeline_stages {
        return run_pipeline(args, &config, &corpus, cfg, stages);
    }
    if let Some(t) = args.tensor_parallel {
        return run_tensor_parallel(args, &config, &corpus, cfg, t);
    }
    let timeout = Duration::from_secs_f64(config.comms_timeout);
    // Unit by unit needs the generator to itself while the engine packs: ranks as processes (`zerorun launch`).
    let by_units = config.stage() == 3 && a.ranks == 1 && !args.whole_model;
    let summary = run_ranks(a.ranks, timeout, |comm| {
        let options = EngineOptions {
            no_weight_decay: Some(no_decay_for_1d),
            activation_checkpointing: a.activation_checkpointing,
            ..Default::default()
        };
        let (_vs, model, mut engine): (tch::nn::VarStore, Box<dyn zerorun::UnitModel>, Engine) = if by_units {
            tch::manual_seed(a.seed as i64);
            let vs = tch::nn::VarStore::new(device);
            let builders = gpt_builders(&cfg);
            let builders = match &a.init {
                Some(path) => builders.init_from(path),
                None => builders,
            };
            let (engine, model) =
                Engine::from_builders(&vs, config.clone(), comm, options, builders).map_err(|e| e.to_string())?;
            (vs, Box::new(model), engine)
        } else {
            let (mut vs, model) = build_model(a.seed, a.init.as_ref(), |vs| Gpt::new(vs.root(), &cfg))?;
            vs.set_device(device);
            to_config_precision(&config, &mut vs);
            let engine = zerorun::initialize_with(&vs, config.clone(), comm, options.units_of(&model))
                .map_err(|e| e.to_string())?;
            (vs, Box::new(model), engine)
        };
        let model = model.as_ref();
        // MFU in the step lines: PaLM's FLOPs per token, nanoGPT's N (all but the position embedding).
        let n = engine.layout().numel as u64 - (cfg.block * cfg.embd) as u64;
        let (l, h, e, t) = (cfg.layers as u64, cfg.heads as u64, cfg.embd as u64, cfg.block as u64);
        engine.set_throughput(zerorun::Throughput {
            tokens_per_sample: t,
            flops_per_token: zerorun::Throughput::transformer_flops_per_token(n, l, h, e / h, t),
            peak_flops_per_rank: None,
        });
        let b = engine.batch_sizes();
        let (rank, world) = (engine.rank(), engine.world_size());
        let mut progress = Progress::new(a.steps).in_tokens(cfg.block);
        let first = resume(a, &mut engine)?;
        for step in first..a.steps {
            for m in 0..b.gradient_accumulation_steps {
                let range = micro_batch_range(rank, world, m, b.train_micro_batch_size_per_gpu);
                let (x, y) = corpus.batch(a.seed, step, b.train_batch_size, range, cfg.block);
                let (x, y) = (x.to_device(device), y.to_device(device));
                let logits = if args.scoped {
                    forward_scoped(&mut engine, model, &x)?
                } else {
                    engine.forward(model, &x).map_err(|e| e.to_string())?
                };
                let loss =
                    logits.to_kind(tch::Kind::Float).view([-1, cfg.vocab]).cross_entropy_for_logits(&y.view([-1]));
                if args.scoped {
                    engine.backward(&loss).map_err(|e| e.to_string())?;
                } else {
                    engine.backward_units(model, &loss).map_err(|e| e.to_string())?;
                }
                let outcome = engine.step().map_err(|e| e.to_string())?;
                progress.record(&engine, outcome);
                maybe_save(a, &mut engine, outcome)?;
            }
            if args.evaluates_after(step + 1) {
                let ranks = (rank, world);
                evaluate_held_out(&mut engine, &corpus, cfg.block, ranks, rank == 0, step + 1, |e, x, y| {
                    let x = x.to_device(device);
                    let logits = match args.scoped {
                        true => forward_scoped(e, model, &x)?,
                        false => e.forward(model, &x).map_err(|e| e.to_string())?,
                    };
                    Ok(token_loss_sum(&logits, &y.to_device(device), cfg.vocab))
                })?;
            }
        }
        if let Some(path) = &a.save_final {
            save_final(&mut engine, path)?;
        }
        // Bounded staleness: every step applied, one model on every rank (nothing to do in other modes).
        engine.finish().map_err(|e| e.to_string())?;
        finish_reports(&mut engine)?;
        let state_bytes: usize = engine.memory_bytes().iter().map(|(_, b)| b).sum();
        Ok((
            progress.first_loss.unwrap_or(f64::NAN),
            progress.last_loss,
            progress.median_step_s(),
            engine.layout().numel,
            state_bytes,
            engine.world_size(),
        ))
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

/// The summed cross-entropy of `logits` [b, t, vocab] against `targets` [b, t].
fn token_loss_sum(logits: &Tensor, targets: &Tensor, vocab: i64) -> f64 {
    let loss = logits.to_kind(tch::Kind::Float).view([-1, vocab]).cross_entropy_for_logits(&targets.view([-1]));
    loss.double_value(&[]) * targets.numel() as f64
}

/// After step `step`: the held-out loss through `engine`, as an evaluation (stage 3 keeps nothing for backward);
/// `loss_sum(engine, x, y)` is a chunk's summed token loss, `ranks` this rank's place among the data-parallel ranks
/// that share the windows out. Reported by [`report_val_loss`].
fn evaluate_held_out(
    engine: &mut Engine,
    corpus: &Corpus,
    block: i64,
    ranks: (usize, usize),
    print: bool,
    step: u64,
    mut loss_sum: impl FnMut(&mut Engine, &Tensor, &Tensor) -> Result<f64, String>,
) -> Result<(), String> {
    let loss = engine
        .evaluate(|e| {
            let mut sums = held_out_sums(corpus, block, ranks, EVAL_ROWS, |x, y| loss_sum(e, x, y))
                .map_err(zerorun::Error::Usage)?;
            // The ratio of the ranks' means of the sums is the ratio of the sums.
            e.data_parallel_mean(&mut sums)?;
            Ok(sums[0] as f64 / sums[1] as f64)
        })
        .map_err(|e| e.to_string())?;
    report_val_loss(engine, print, step, loss)
}

/// `step N val loss X` (when `print`), and `Train/Samples/eval_loss` to the monitors.
fn report_val_loss(engine: &mut Engine, print: bool, step: u64, loss: f64) -> Result<(), String> {
    if print {
        println!("step {step} val loss {loss:.4}");
    }
    engine.record_eval_loss(loss).map_err(|e| e.to_string())
}

/// `--arch nanogpt`: nanoGPT's model, its units entered from its own forward (`engine.unit`), data parallel at
/// every ZeRO stage; step lines carry MFU (PaLM's 6N + 12·L·H·Q·T FLOPs per token, nanoGPT's N).
fn run_nanogpt(args: &Args, config: &zerorun::Config, corpus: &Corpus) -> Result<(), String> {
    let a = &args.common;
    let device = a.device()?;
    let c = NanoGptConfig {
        vocab: corpus.vocab,
        block: args.block,
        layers: args.layers,
        heads: args.heads,
        embd: args.embd,
    };
    if c.embd % c.heads != 0 {
        return Err(format!("--embd {} must divide by --heads {}", c.embd, c.heads));
    }
    let timeout = Duration::from_secs_f64(config.comms_timeout);
    let result = run_ranks(a.ranks, timeout, |comm| {
        let (mut vs, model) = build_model(a.seed, a.init.as_ref(), |vs| NanoGpt::new(&vs.root(), c))?;
        vs.set_device(device);
        to_config_precision(config, &mut vs);
        let options =
            EngineOptions { units: Some(model.units()), no_weight_decay: Some(no_decay_for_1d), ..Default::default() };
        let mut engine = zerorun::initialize_with(&vs, config.clone(), comm, options).map_err(|e| e.to_string())?;
        let (l, h, e) = (c.layers as u64, c.heads as u64, c.embd as u64);
        engine.set_throughput(zerorun::Throughput {
            tokens_per_sample: c.block as u64,
            flops_per_token: zerorun::Throughput::transformer_flops_per_token(
                model.num_params(),
                l,
                h,
                e / h,
                c.block as u64,
            ),
            peak_flops_per_rank: None,
        });
        let b = engine.batch_sizes();
        let (rank, world) = (engine.rank(), engine.world_size());
        let mut progress = Progress::new(a.steps).in_tokens(c.block);
        let first = resume(a, &mut engine)?;
        for step in first..a.steps {
            for m in 0..b.gradient_accumulation_steps {
                let range = micro_batch_range(rank, world, m, b.train_micro_batch_size_per_gpu);
                let (x, y) = corpus.batch(a.seed, step, b.train_batch_size, range, c.block);
                let (x, y) = (x.to_device(device), y.to_device(device));
                let loss = model.loss(&mut engine, &x, &y).map_err(|e| e.to_string())?;
                engine.backward(&loss).map_err(|e| e.to_string())?;
                let outcome = engine.step().map_err(|e| e.to_string())?;
                progress.record(&engine, outcome);
                maybe_save(a, &mut engine, outcome)?;
            }
            if args.evaluates_after(step + 1) {
                evaluate_held_out(&mut engine, corpus, c.block, (rank, world), rank == 0, step + 1, |e, x, y| {
                    let logits = model.forward(e, &x.to_device(device)).map_err(|e| e.to_string())?;
                    Ok(token_loss_sum(&logits, &y.to_device(device), c.vocab))
                })?;
            }
        }
        finish_rank(a, &mut engine, &progress)
    })?;
    print_summary(result, config, a.steps);
    Ok(())
}

/// `--pipeline-stages P`: the same model as layers, each rank building and training only its stage's.
fn run_pipeline(args: &Args, config: &Config, corpus: &Corpus, cfg: GptConfig, stages: usize) -> Result<(), String> {
    use zerorun::runtime::tensor_parallel::TensorParallel;
    let a = &args.common;
    if a.activation_checkpointing {
        return Err("--pipeline-stages runs without --activation-checkpointing (stage 3's) for now".into());
    }
    let cfg = match args.tensor_parallel {
        Some(t) => tensor_parallel_model(cfg, t)?,
        None => cfg,
    };
    let timeout = Duration::from_secs_f64(config.comms_timeout);
    let summary = run_ranks(a.ranks, timeout, |comm| {
        // pipe x data x tensor: each stage's tensor-parallel group is adjacent ranks of the stage.
        // ANCHOR: pipeline
        let options = MeshOptions { pipeline_stages: Some(stages), tensor_parallel: args.tensor_parallel };
        let mesh = Mesh::from_config(comm, config, options).map_err(|e| e.to_string())?;
        let placement = StagePlacement::of(&mesh, &config.pipeline);
        let tp = match args.tensor_parallel {
            Some(_) => Some(mesh.tensor_parallel().map_err(|e| e.to_string())?),
            None => None,
        };
        let model = match &tp {
            Some(tp) => gpt_model::tp::pipeline_model(&cfg, tp),
            None => pipeline_model(&cfg),
        };
        // With tensor parallelism the stage's slices are cut from --init's whole weights after building.
        let whole_init = if tp.is_some() { None } else { a.init.as_ref() };
        let (mut vs, stage) =
            build_model(a.seed, whole_init, |vs| model.build_stage(vs, &placement, &config.pipeline.partition))?;
        let stage = stage.map_err(|e| e.to_string())?;
        if let (Some(tp), Some(path)) = (&tp, &a.init) {
            zerorun::runtime::engine::load_mapped_slices(&vs, path, tp.rank(), tp.size(), tp.placements())
                .map_err(|e| format!("--init {}: {e}", path.display()))?;
        }
        to_config_precision(config, &mut vs);
        let options = EngineOptions { no_weight_decay: Some(no_decay_for_1d), ..Default::default() };
        let mut pipe =
            zerorun::initialize_pipeline(&vs, config.clone(), mesh, stage, options).map_err(|e| e.to_string())?;
        let b = pipe.engine().batch_sizes();
        let (first, last) = (placement.takes_inputs(), placement.takes_labels());
        let mut progress = Progress::new(a.steps).in_tokens(cfg.block);
        let world = placement.stages * placement.data_parallel * args.tensor_parallel.unwrap_or(1);
        let first_step = resume_with(a, placement.rank == 0, world, |dir| {
            pipe.load_checkpoint(dir, None).map_err(|e| e.to_string())?;
            Ok(pipe.engine().global_steps())
        })?;
        for step in first_step..a.steps {
            let mut micro_batches = (0..b.gradient_accumulation_steps).map(|m| {
                let range = micro_batch_range(
                    placement.data_index,
                    placement.data_parallel,
                    m,
                    b.train_micro_batch_size_per_gpu,
                );
                let (x, y) = corpus.batch(a.seed, step, b.train_batch_size, range, cfg.block);
                MicroBatch { inputs: first.then_some(x), labels: last.then_some(y) }
            });
            let outcome = pipe.train_batch(&mut micro_batches).map_err(|e| e.to_string())?;
            // ANCHOR_END: pipeline
            progress.record_for(placement.rank == 0, b.train_batch_size, outcome);
            if let (Some(dir), Some(every)) = (&a.checkpoint_dir, a.save_every) {
                if (step + 1) % every == 0 {
                    pipe.save_checkpoint(dir, None).map_err(|e| e.to_string())?;
                }
            }
            if args.evaluates_after(step + 1) {
                let m = b.gradient_accumulation_steps as i64;
                let loss = pipeline_held_out_loss(&mut pipe, corpus, cfg.block, m, (first, last))?;
                report_val_loss(pipe.engine_mut(), placement.rank == 0, step + 1, loss)?;
            }
        }
        // Asynchronous training ends with every rank holding the final values (a no-op when synchronous).
        pipe.finish().map_err(|e| e.to_string())?;
        if let Some(path) = &a.save_final {
            let params = pipe.full_parameters().map_err(|e| e.to_string())?;
            // The first stage's ranks hold the whole pipeline's slices: their tensor-parallel groups join them.
            let params = match &tp {
                Some(tp) if placement.stage == 0 => whole_parameters(tp, params)?,
                _ => params,
            };
            if placement.rank == 0 {
                Tensor::write_safetensors(&params, path)
                    .map_err(|e| format!("--save-final {}: {e}", path.display()))?;
            }
        }
        if let Some(files) = pipe.finish_memory_report().map_err(|e| e.to_string())? {
            if let (Some(table), Some(svg)) = (files.table, files.svg) {
                println!("{table}");
                println!("memory report: {} (and memory_rank*.json, memory.png)", svg.display());
            }
        }
        if config.wall_clock_breakdown && placement.data_index == 0 {
            println!("{}", pipe.wall_clock_summary());
        }
        println!("peak_rss_bytes {}", zerorun::runtime::report::memory::rss().1);
        Ok((
            progress.first_loss.unwrap_or(f64::NAN),
            progress.last_loss,
            progress.median_step_s(),
            pipe.engine().layout().numel,
            tp.as_ref().map(TensorParallel::counts),
        ))
    })?;
    let Some((first, last, median, params, counts)) = summary else { return Ok(()) };
    println!("median_step_s {median:.4}");
    if let Some(c) = counts {
        println!(
            "tensor_parallel_collectives all_reduce {} all_gather {} reduce_scatter {}",
            c.all_reduce, c.all_gather, c.reduce_scatter
        );
    }
    println!(
        "summary: {stages} pipeline stages, ZeRO stage {} per stage, {params} parameters on stage 0, {} optimizer steps, loss {first:.4} -> {last:.4}",
        config.stage(),
        a.steps
    );
    Ok(())
}

/// The held-out loss through a pipeline: every replica runs every window (`eval_batch` averages over the replicas,
/// which then agree), `m` equal micro-batches a call (`gradient_accumulation_steps`; with m > 1 the last
/// windows that do not fill m micro-batches, fewer than m, are left out).
fn pipeline_held_out_loss(
    pipe: &mut zerorun::PipelineEngine,
    corpus: &Corpus,
    block: i64,
    m: i64,
    (first, last): (bool, bool),
) -> Result<f64, String> {
    let (x, y) = corpus.held_out_windows(block);
    let windows = x.size()[0];
    let (mut sum, mut counted, mut at) = (0.0, 0i64, 0i64);
    while windows - at >= m {
        let per = EVAL_ROWS.min((windows - at) / m);
        let mut parts = (0..m).map(|i| {
            let (xs, ys) = (x.narrow(0, at + i * per, per), y.narrow(0, at + i * per, per));
            MicroBatch { inputs: first.then_some(xs), labels: last.then_some(ys) }
        });
        let loss = tch::no_grad(|| pipe.eval_batch(&mut parts)).map_err(|e| e.to_string())?;
        sum += loss * (m * per) as f64;
        counted += m * per;
        at += m * per;
    }
    Ok(sum / counted.max(1) as f64)
}

/// The model at tensor-parallel degree `t`: what splits must split (the vocabulary padded to a multiple of 8).
fn tensor_parallel_model(cfg: GptConfig, t: usize) -> Result<GptConfig, String> {
    if t == 0 || cfg.heads % t as i64 != 0 || (4 * cfg.embd) % t as i64 != 0 {
        return Err(format!(
            "--tensor-parallel {t} must divide --heads ({}) and the MLP width ({})",
            cfg.heads,
            4 * cfg.embd
        ));
    }
    let padded = padded_vocab(cfg.vocab);
    if padded % t as i64 != 0 {
        return Err(format!("--tensor-parallel {t} must divide the padded vocabulary ({padded})"));
    }
    Ok(cfg)
}

/// Every parameter whole: the tensor-parallel slices gathered along the dimension they split, padding left out.
/// Collective over the group.
fn whole_parameters(
    tp: &zerorun::runtime::tensor_parallel::TensorParallel,
    params: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>, String> {
    tch::no_grad(|| -> Result<Vec<(String, Tensor)>, zerorun::Error> {
        params
            .into_iter()
            .map(|(name, p)| {
                let whole = tp.gather_whole(&name, &p)?;
                Ok((name, whole))
            })
            .collect()
    })
    .map_err(|e| e.to_string())
}

/// `--tensor-parallel T`: groups of T adjacent ranks split every layer ([`TpGpt`]); each rank's engine runs ZeRO
/// over the ranks at its position in the other groups (the data-parallel group), and agrees on the gradient norm
/// with its tensor-parallel group, counting the parameters every member holds whole (norms, biases after a sum, the
/// position embedding) once.
fn run_tensor_parallel(args: &Args, config: &Config, corpus: &Corpus, cfg: GptConfig, t: usize) -> Result<(), String> {
    let a = &args.common;
    let cfg = tensor_parallel_model(cfg, t)?;
    let timeout = Duration::from_secs_f64(config.comms_timeout);
    let summary = run_ranks(a.ranks, timeout, |comm| {
        // Tensor-parallel groups are adjacent ranks (one host's), data-parallel groups every t-th. The layers
        // record their splits on the mesh, where the engine reads them.
        let options = MeshOptions { tensor_parallel: Some(t), ..Default::default() };
        let mesh = Mesh::from_config(comm, config, options).map_err(|e| e.to_string())?;
        let (rank, world) = (mesh.rank(), mesh.world_size());
        let (data_index, data_size) = (mesh.coordinate(Dim::Shard), mesh.shape().data());
        let tp = mesh.tensor_parallel().map_err(|e| e.to_string())?;
        // Built from the seed under the examples' build lock (thread ranks share libtorch's generator).
        let (mut vs, model) = build_model(a.seed, None, |vs| TpGpt::new(vs.root(), &tp, &cfg))?;
        if let Some(path) = &a.init {
            // Whole weights by name (a T = 1 run's --save-final, or `zerorun consolidate`'s): this rank's slices.
            zerorun::runtime::engine::load_mapped_slices(&vs, path, tp.rank(), t, tp.placements())
                .map_err(|e| format!("--init {}: {e}", path.display()))?;
        }
        to_config_precision(config, &mut vs);
        // The units of the plain GPT: stage 3 gathers one at a time over the data-parallel ranks.
        let units = TpUnits { model: &model, tp: &tp };
        let options = EngineOptions {
            no_weight_decay: Some(no_decay_for_1d),
            activation_checkpointing: a.activation_checkpointing,
            ..Default::default()
        }
        .units_of(&units);
        // The norm over the group (whole parameters counted once) and checkpoints of slices by their place.
        let mut engine = zerorun::initialize_with(&vs, config.clone(), mesh, options).map_err(|e| e.to_string())?;
        let b = engine.batch_sizes();
        let mut progress = Progress::new(a.steps).in_tokens(cfg.block);
        let first = resume(a, &mut engine)?;
        for step in first..a.steps {
            for m in 0..b.gradient_accumulation_steps {
                let range = micro_batch_range(data_index, data_size, m, b.train_micro_batch_size_per_gpu);
                let (x, y) = corpus.batch(a.seed, step, b.train_batch_size, range, cfg.block);
                let logits = engine.forward(&units, &x).map_err(|e| e.to_string())?;
                let loss = model.loss(&tp, &logits, &y).map_err(|e| e.to_string())?;
                engine.backward_units(&units, &loss).map_err(|e| e.to_string())?;
                let outcome = engine.step().map_err(|e| e.to_string())?;
                progress.record_for(rank == 0, b.train_batch_size, outcome);
                maybe_save(a, &mut engine, outcome)?;
            }
            if args.evaluates_after(step + 1) {
                // The tensor-parallel group runs the same windows (its collectives split every layer); the
                // data-parallel ranks share them out.
                let ranks = (data_index, data_size);
                evaluate_held_out(&mut engine, corpus, cfg.block, ranks, rank == 0, step + 1, |e, x, y| {
                    let logits = e.forward(&units, x).map_err(|e| e.to_string())?;
                    let loss = model.loss(&tp, &logits, y).map_err(|e| e.to_string())?;
                    Ok(loss.double_value(&[]) * y.numel() as f64)
                })?;
            }
        }
        if let Some(path) = &a.save_final {
            let whole = whole_parameters(&tp, engine.full_parameters().map_err(|e| e.to_string())?)?;
            if rank == 0 {
                Tensor::write_safetensors(&whole, path).map_err(|e| format!("--save-final {}: {e}", path.display()))?;
            }
        }
        // Bounded staleness: every step applied, one model on every rank (nothing to do in other modes).
        engine.finish().map_err(|e| e.to_string())?;
        finish_reports(&mut engine)?;
        let counts = tp.counts();
        Ok((progress.first_loss.unwrap_or(f64::NAN), progress.last_loss, progress.median_step_s(), counts, world))
    })?;
    let Some((first, last, median, counts, world)) = summary else { return Ok(()) };
    println!("median_step_s {median:.4}");
    println!(
        "tensor_parallel_collectives all_reduce {} all_gather {} reduce_scatter {}",
        counts.all_reduce, counts.all_gather, counts.reduce_scatter
    );
    println!(
        "summary: {world} ranks, tensor parallel {t}, ZeRO stage {} over {} data-parallel ranks, {} optimizer steps, loss {first:.4} -> {last:.4}",
        config.stage(),
        world / t,
        a.steps
    );
    Ok(())
}
