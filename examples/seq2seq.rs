//! An encoder-decoder transformer (cross-attention to the encoder's output in every decoder block, the token
//! embedding tied to the output head) learning to reverse sequences of random tokens. Not a chain of units: its
//! forward is plain tch code that enters each unit with `engine.unit(name, ..)`, and the same program runs at every
//! ZeRO stage (`examples/support/scoped_models.rs`).
//!
//!     cargo run --release --example seq2seq -- --config configs/zero3.json --ranks 2 --steps 40
use std::time::Duration;

use clap::Parser;
use tch::{Kind, Tensor};
use zerorun::EngineOptions;

#[path = "support/mod.rs"]
mod support;
use support::scoped_models::{Seq2Seq, Seq2SeqSize};
use support::*;

#[derive(Parser, Debug)]
#[command(about = "Train an encoder-decoder transformer to reverse token sequences with zerorun")]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// Encoder blocks, and as many decoder blocks.
    #[arg(long, default_value_t = 2)]
    layers: i64,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    embd: i64,
    #[arg(long, default_value_t = 4)]
    heads: i64,
    /// Tokens of the vocabulary (0 is the decoder's start token).
    #[arg(long, default_value_t = 32)]
    vocab: i64,
    /// Tokens per source sequence.
    #[arg(long, default_value_t = 12)]
    len: i64,
}

/// Global batch `step` (or the held-out batch, `step` = u64::MAX): random sources and their reversals after a
/// start token, from the seed only.
fn batch(seed: u64, step: u64, rows: i64, len: i64, vocab: i64) -> (Tensor, Tensor) {
    let mut rng = Rng::new(seed, step);
    let ids: Vec<i64> = (0..rows * len).map(|_| 1 + rng.below(vocab as u64 - 1) as i64).collect();
    let source = Tensor::from_slice(&ids).view([rows, len]);
    let start = Tensor::zeros([rows, 1], (Kind::Int64, tch::Device::Cpu));
    let target = Tensor::cat(&[start, source.flip([1])], 1);
    (source, target)
}

fn main() {
    run_main(&Args::parse(), run);
}

fn run(args: &Args) -> Result<(), String> {
    let a = &args.common;
    a.check()?;
    if a.activation_checkpointing {
        return Err("--activation-checkpointing recomputes the units of engine.forward's walk; this model enters its units itself".into());
    }
    if args.embd % args.heads != 0 || args.vocab < 2 {
        return Err(format!("--embd {} must divide by --heads {}, and --vocab be >= 2", args.embd, args.heads));
    }
    let device = a.device()?;
    let config = load_config(&a.config)?;
    let size =
        Seq2SeqSize { vocab: args.vocab, d: args.embd, heads: args.heads, layers: args.layers, max_len: args.len + 1 };
    share_cores(a.ranks);
    let timeout = Duration::from_secs_f64(config.comms_timeout);
    let result = run_ranks(a.ranks, timeout, |comm| {
        let (mut vs, model) = build_model(a.seed, a.init.as_ref(), |vs| Seq2Seq::new(&vs.root(), size))?;
        vs.set_device(device);
        to_config_precision(&config, &mut vs);
        // ANCHOR: engine
        // The units by parameter-name prefixes; the forward enters them by name. `comm` is this rank's
        // communicator from `run_ranks` (examples/support): `zerorun::communicator_from_env(timeout)?` under
        // `zerorun launch`, `timeout` a `std::time::Duration`.
        let options = EngineOptions { units: Some(model.units()), ..Default::default() };
        let mut engine = zerorun::initialize_with(&vs, config.clone(), comm, options).map_err(|e| e.to_string())?;
        // ANCHOR_END: engine
        let b = engine.batch_sizes();
        let (rank, world) = (engine.rank(), engine.world_size());
        let mut progress = Progress::new(a.steps).in_tokens(args.len);
        let first = resume(a, &mut engine)?;
        // ANCHOR: loop
        for step in first..a.steps {
            let (source, target) = batch(a.seed, step, b.train_batch_size as i64, args.len, args.vocab);
            for m in 0..b.gradient_accumulation_steps {
                let rows = micro_batch_range(rank, world, m, b.train_micro_batch_size_per_gpu);
                let (start, n) = (rows.start as i64, rows.len() as i64);
                let (s, t) =
                    (source.narrow(0, start, n).to_device(device), target.narrow(0, start, n).to_device(device));
                let loss = model.loss(&mut engine, &s, &t).map_err(|e| e.to_string())?;
                engine.backward(&loss).map_err(|e| e.to_string())?;
                let outcome = engine.step().map_err(|e| e.to_string())?;
                progress.record(&engine, outcome);
                maybe_save(a, &mut engine, outcome)?;
            }
        }
        // ANCHOR_END: loop
        // Held-out sequences: the loss and the share of tokens the model reverses right (teacher forcing).
        let (s, t) = batch(a.seed, u64::MAX, 64, args.len, args.vocab);
        let (s, t) = (s.to_device(device), t.to_device(device));
        let (eval_loss, accuracy) = tch::no_grad(|| -> Result<(f64, f64), String> {
            let logits = model.forward(&mut engine, &s, &t.narrow(1, 0, args.len)).map_err(|e| e.to_string())?;
            let logits = logits.to_kind(Kind::Float);
            let next = t.narrow(1, 1, args.len);
            let loss = logits.reshape([-1, args.vocab]).cross_entropy_for_logits(&next.reshape([-1]));
            let right = logits.argmax(-1, false).eq_tensor(&next).to_kind(Kind::Float).mean(Kind::Float);
            Ok((loss.double_value(&[]), right.double_value(&[])))
        })?;
        if rank == 0 {
            println!("eval_loss {eval_loss:.6}");
            println!("eval_token_accuracy {accuracy:.4}");
        }
        finish_rank(a, &mut engine, &progress)
    })?;
    print_summary(result, &config, a.steps);
    Ok(())
}
