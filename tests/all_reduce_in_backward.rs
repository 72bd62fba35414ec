//! Stage 0 with `overlap_comm` (its default): gradient hooks all-reduce each bucket in place while backward goes on
//! (DDP's bucketed all-reduce). The parameters end bitwise where the all-reduce after backward leaves them, in fp32
//! and bf16, with accumulation; two backwards in one step (the second finds the first's gradients reduced) end
//! where one reduction of both does; a backward run by the program itself is reduced at `step`, and one that adds
//! to gradients the engine reduced already is refused by name.
use serde_json::json;
use tch::nn::Module;
use tch::{Kind, Tensor};
use zerorun::{Config, Engine, EngineOptions};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

#[path = "common/compare.rs"]
mod compare;
use compare::max_relative_difference;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Backwards {
    /// One `engine.backward` per micro-batch.
    One,
    /// Two per micro-batch, each of half the rows (the loss halved).
    TwoHalves,
    /// `loss.backward()` by the program itself.
    Direct,
    /// `engine.backward` on the first half, then `loss.backward()` on the second, then `engine.step`.
    EngineThenDirect,
}

fn config(overlap: bool, gas: u64, bf16: bool) -> Config {
    Config::from_value(json!({
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        // Buckets smaller than a weight: several buckets, one of a bias alone.
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 100, "overlap_comm": overlap}
    }))
    .unwrap()
}

/// 2 thread ranks, every step of the MLP; rank 0's parameters (the ranks' are compared), or the first error.
fn run(config: Config, backwards: Backwards) -> Result<Vec<(String, Vec<f32>)>, String> {
    let bf16 = config.bf16.enabled;
    let mut results = on_thread_ranks(2, |comm, x, y| -> Result<Vec<(String, Vec<f32>)>, String> {
        let (mut vs, model) = init_store();
        if bf16 {
            vs.bfloat16();
        }
        let x = if bf16 { x.to_kind(Kind::BFloat16) } else { x };
        let mut engine =
            Engine::new(&vs, config.clone(), Box::new(comm), EngineOptions::default()).map_err(|e| e.to_string())?;
        let b = engine.batch_sizes();
        let (rank, micro) = (engine.rank() as i64, b.train_micro_batch_size_per_gpu as i64);
        let loss_of = |rows: &[i64], weight: f64| {
            let idx = Tensor::from_slice(rows);
            let pred = model.forward(&x.index_select(0, &idx)).to_kind(Kind::Float);
            pred.mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean) * weight
        };
        for step in 0..STEPS {
            let order = batch_indices(step);
            for m in 0..b.gradient_accumulation_steps as i64 {
                let first = ((m * 2 + rank) * micro) as usize;
                let rows = &order[first..first + micro as usize];
                let (a, z) = rows.split_at(rows.len() / 2);
                match backwards {
                    Backwards::One => engine.backward(&loss_of(rows, 1.0)).map_err(|e| e.to_string())?,
                    Backwards::TwoHalves => {
                        engine.backward(&loss_of(a, 0.5)).map_err(|e| e.to_string())?;
                        engine.backward(&loss_of(z, 0.5)).map_err(|e| e.to_string())?;
                    }
                    Backwards::Direct => {
                        let scale = 1.0 / b.gradient_accumulation_steps as f64;
                        loss_of(rows, scale).backward();
                    }
                    Backwards::EngineThenDirect => {
                        engine.backward(&loss_of(a, 0.5)).map_err(|e| e.to_string())?;
                        loss_of(z, 0.5 / b.gradient_accumulation_steps as f64).backward();
                    }
                }
                engine.step().map_err(|e| e.to_string())?;
            }
        }
        Ok(params_of(&vs))
    });
    let first = results.remove(0)?;
    assert_eq!(Ok(&first), results[0].as_ref(), "the ranks disagree ({backwards:?})");
    Ok(first)
}

#[test]
fn buckets_all_reduced_in_backward_end_bitwise_where_the_reduction_after_backward_does() {
    let start = params_of(&init_store().0);
    for (gas, bf16) in [(1, false), (2, false), (2, true)] {
        let after = run(config(false, gas, bf16), Backwards::One).unwrap();
        assert!(max_relative_difference(&after, &start) > 1e-3, "the run must have trained");
        let during = run(config(true, gas, bf16), Backwards::One).unwrap();
        assert_eq!(during, after, "accumulation {gas}, bf16 {bf16}");
    }
}

#[test]
fn two_backwards_in_one_step_end_where_one_reduction_of_both_does() {
    for (gas, bf16, bound) in [(1, false, 1e-6), (2, false, 1e-6), (1, true, 1e-2)] {
        let after = run(config(false, gas, bf16), Backwards::TwoHalves).unwrap();
        let during = run(config(true, gas, bf16), Backwards::TwoHalves).unwrap();
        let d = max_relative_difference(&during, &after);
        assert!(d <= bound, "accumulation {gas}, bf16 {bf16}: max relative difference {d:e}");
    }
}

#[test]
fn a_backward_outside_the_engine_is_reduced_at_step_or_refused_after_one_inside() {
    let after = run(config(false, 1, false), Backwards::Direct).unwrap();
    assert_eq!(run(config(true, 1, false), Backwards::Direct).unwrap(), after);
    let err = run(config(true, 1, false), Backwards::EngineThenDirect).unwrap_err();
    assert!(
        err.contains("gradients were added after stage 0 all-reduced this step's in engine.backward (zero_optimization.overlap_comm)")
            && err.contains("set overlap_comm false"),
        "{err}"
    );
    // Without the all-reduce in backward, the same loop is reduced at step.
    run(config(false, 1, false), Backwards::EngineThenDirect).unwrap();
}
