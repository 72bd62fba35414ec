//! A GPT-style character model in plain tch (token and position embeddings, pre-norm transformer blocks, a
//! linear head) trained with zerorun on the Shakespeare text in examples/data.
//!
//!     cargo run --release --example gpt -- --config configs/zero2.json --ranks 2 --steps 30
use std::time::Duration;

use clap::Parser;
use tch::Tensor;
use zerorun::runtime::engine::{no_decay_for_1d, EngineOptions};
use zerorun::{Config, Dim, Engine, Mesh, MeshOptions, MicroBatch, StagePlacement};

#[path = "support/mod.rs"]
mod support;
use support::gpt_model::tp::{TpGpt, TpUnits};
use support::gpt_model::{gpt_builders, padded_vocab, pipeline_model, Corpus, Gpt, GptConfig};
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
}

fn main() {
    run_main(&Args::parse(), run);
}

fn run(args: &Args) -> Result<(), String> {
    let a = &args.common;
    a.check()?;
    let config = load_config(&a.config)?;
    let corpus = Corpus::load();
    let cfg =
        GptConfig { vocab: corpus.vocab, block: args.block, layers: args.layers, heads: args.heads, embd: args.embd };
    share_cores(a.ranks);
    let device = a.device()?;
    if device != tch::Device::Cpu && (args.pipeline_stages.is_some() || args.tensor_parallel.is_some()) {
        return Err("--device cuda trains the data-parallel GPT; with --pipeline-stages or --tensor-parallel this example runs on the CPU only".into());
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
