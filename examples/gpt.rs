//! A GPT-style character model in plain tch (token and position embeddings, pre-norm transformer blocks, a
//! linear head) trained with zerorun on the Shakespeare text in examples/data.
//!
//!     cargo run --release --example gpt -- --config configs/zero2.json --ranks 2 --steps 30
use std::time::Duration;

use clap::Parser;
use zerorun::runtime::engine::{no_decay_for_1d, EngineOptions};
use zerorun::Engine;

#[path = "support/mod.rs"]
mod support;
use support::gpt_model::{Corpus, Gpt, GptConfig};
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

fn main() {
    let args = Args::parse();
    zerorun::init_logging();
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
    let cfg =
        GptConfig { vocab: corpus.vocab, block: args.block, layers: args.layers, heads: args.heads, embd: args.embd };
    share_cores(a.ranks);
    let timeout = Duration::from_secs_f64(config.comms_timeout);
    let summary = run_ranks(a.ranks, timeout, |comm| {
        let (mut vs, model) = build_model(a.seed, a.init.as_ref(), |vs| Gpt::new(vs.root(), &cfg))?;
        to_config_precision(&config, &mut vs);
        let options = EngineOptions {
            no_weight_decay: Some(no_decay_for_1d),
            activation_checkpointing: a.activation_checkpointing,
            ..Default::default()
        }
        .units_of(&model);
        let mut engine = Engine::new(&vs, config.clone(), comm, options).map_err(|e| e.to_string())?;
        let b = engine.batch_sizes();
        let (rank, world) = (engine.rank(), engine.world_size());
        let mut progress = Progress::new(a.steps);
        let first = resume(a, &mut engine)?;
        for step in first..a.steps {
            for m in 0..b.gradient_accumulation_steps {
                let range = micro_batch_range(rank, world, m, b.train_micro_batch_size_per_gpu);
                let (x, y) = corpus.batch(a.seed, step, b.train_batch_size, range, cfg.block);
                let logits = engine.forward(&model, &x).map_err(|e| e.to_string())?.to_kind(tch::Kind::Float);
                let loss = logits.view([-1, cfg.vocab]).cross_entropy_for_logits(&y.view([-1]));
                engine.backward_units(&model, &loss).map_err(|e| e.to_string())?;
                let outcome = engine.step().map_err(|e| e.to_string())?;
                progress.record(&engine, outcome);
                maybe_save(a, &mut engine, outcome)?;
            }
        }
        if let Some(path) = &a.save_final {
            save_final(&mut engine, path)?;
        }
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
