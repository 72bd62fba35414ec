//! bf16 and fp16 training: fp32 master weights per rank, gradients reduced in 16 bits and accumulated in fp32.
//! They track the fp32 run's losses; an fp16 step with an inf gradient on one rank is skipped on every rank and
//! lowers the loss scale; 16-bit parameters in an fp32 config (and the reverse) are refused by name.
use std::time::Duration;

use serde_json::json;
use tch::nn::Module;
use tch::{Kind, Tensor};
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions, StepOutcome};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

fn config(stage: u8, precision: serde_json::Value, gas: u64) -> Config {
    let mut c = json!({
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage}
    });
    if let serde_json::Value::Object(p) = precision {
        for (k, v) in p {
            c[k] = v;
        }
    }
    Config::from_value(c).unwrap()
}

/// Runs 2 thread ranks; `poison(step, rank)` says when a rank's loss is multiplied by infinity. Returns rank 0's
/// outcomes and every rank's final loss scale and skipped-step count.
fn run(config: Config, kind: Kind, poison: fn(i64, usize) -> bool) -> (Vec<StepOutcome>, Vec<(f64, u64)>) {
    let (xv, yv) = data();
    let comms = threads::group(2, Duration::from_secs(60));
    let results: Vec<(Vec<StepOutcome>, f64, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (config, xv, yv) = (config.clone(), &xv, &yv);
                s.spawn(move || {
                    let (x, y) = (
                        Tensor::from_slice(xv).view([SAMPLES, IN]).to_kind(kind),
                        Tensor::from_slice(yv).view([SAMPLES, OUT]),
                    );
                    let (mut vs, model) = init_store();
                    match kind {
                        Kind::BFloat16 => vs.bfloat16(),
                        Kind::Half => vs.half(),
                        _ => {}
                    }
                    let mut engine = Engine::new(&vs, config, Box::new(comm), EngineOptions::default()).unwrap();
                    let b = engine.batch_sizes();
                    let (rank, micro) = (engine.rank(), b.train_micro_batch_size_per_gpu as i64);
                    let mut outcomes = Vec::new();
                    for step in 0..STEPS {
                        let order = batch_indices(step);
                        for m in 0..b.gradient_accumulation_steps as i64 {
                            let first = ((m * 2 + rank as i64) * micro) as usize;
                            let idx = Tensor::from_slice(&order[first..first + micro as usize]);
                            let pred = model.forward(&x.index_select(0, &idx)).to_kind(Kind::Float);
                            let mut loss = pred.mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
                            if poison(step, rank) {
                                loss *= f64::INFINITY;
                            }
                            engine.backward(&loss).unwrap();
                            let o = engine.step().unwrap();
                            if o != StepOutcome::Accumulating {
                                outcomes.push(o);
                            }
                        }
                    }
                    (outcomes, engine.loss_scale(), engine.skipped_steps())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let scales = results.iter().map(|r| (r.1, r.2)).collect();
    (results.into_iter().next().unwrap().0, scales)
}

fn losses(outcomes: &[StepOutcome]) -> Vec<f64> {
    outcomes
        .iter()
        .map(|o| match o {
            StepOutcome::Stepped { loss, .. } | StepOutcome::Skipped { loss, .. } => *loss,
            StepOutcome::Accumulating | StepOutcome::Discarded { .. } => {
                unreachable!("no accumulation, no fault tolerance")
            }
        })
        .collect()
}

#[test]
fn bf16_and_fp16_track_the_fp32_losses() {
    let never = |_, _| false;
    for (stage, gas) in [(0, 1), (1, 2), (2, 2)] {
        let fp32 = losses(&run(config(stage, json!({}), gas), Kind::Float, never).0);
        let bf16 = losses(&run(config(stage, json!({"bf16": {"enabled": true}}), gas), Kind::BFloat16, never).0);
        let fp16 = losses(
            &run(config(stage, json!({"fp16": {"enabled": true, "initial_scale_power": 8}}), gas), Kind::Half, never).0,
        );
        assert!(fp32[STEPS as usize - 1] < 0.8 * fp32[0], "the fp32 run must learn: {fp32:?}");
        // Stated tolerance: every step's loss within 5% (bf16: 8 mantissa bits) and 2% (fp16) of fp32's.
        for (i, f) in fp32.iter().enumerate() {
            assert!((bf16[i] - f).abs() <= 0.05 * f, "stage {stage} step {i}: bf16 {} vs fp32 {f}", bf16[i]);
            assert!((fp16[i] - f).abs() <= 0.02 * f, "stage {stage} step {i}: fp16 {} vs fp32 {f}", fp16[i]);
        }
    }
}

#[test]
fn fp16_overflow_on_one_rank_skips_that_step_everywhere_and_halves_the_scale() {
    let fp16 =
        json!({"fp16": {"enabled": true, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 1000}});
    let (outcomes, scales) = run(config(2, fp16, 1), Kind::Half, |step, rank| step == 5 && rank == 1);
    for (i, o) in outcomes.iter().enumerate() {
        match (i, o) {
            (5, StepOutcome::Skipped { scale, .. }) => assert_eq!(*scale, 512.0),
            (5, other) => panic!("step 6 must be skipped: {other:?}"),
            (_, StepOutcome::Stepped { .. }) => {}
            (_, other) => panic!("step {} must be taken: {other:?}", i + 1),
        }
    }
    assert_eq!(scales, vec![(512.0, 1), (512.0, 1)], "every rank lowers its scale once and counts one skipped step");
}

#[test]
fn parameter_dtype_must_match_the_config() {
    let comm = threads::group(1, Duration::from_secs(5)).pop().unwrap();
    let (vs, _model) = init_store();
    let err =
        Engine::new(&vs, config(1, json!({"bf16": {"enabled": true}}), 1), Box::new(comm), EngineOptions::default())
            .err()
            .unwrap();
    assert_eq!(err.to_string(), "parameter `layers.0.bias`: has dtype Float; bf16.enabled is true: convert the VarStore with `vs.bfloat16()` first");
}
