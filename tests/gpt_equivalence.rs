//! The example GPT at stages 0-3 on 1-3 thread ranks (3: uneven partitions) with and without gradient
//! accumulation ends at the parameters of a single-process tch loop with libtorch's AdamW on the same global
//! batches, within 1e-5 relative. Stage 3 runs per-block units (embeddings, each block, norm and head), also
//! with activation checkpointing.
use std::time::Duration;

use serde_json::json;
use tch::nn::{self, OptimizerConfig};
use tch::Tensor;
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions};

#[path = "common/compare.rs"]
mod compare;
use compare::{full_parameters, max_relative_difference};

#[path = "../examples/support/mod.rs"]
mod support;
use support::gpt_model::{Corpus, Gpt, GptConfig};

const GLOBAL_BATCH: u64 = 12;
const STEPS: u64 = 10;
const LR: f64 = 3e-3;
const CLIP: f64 = 1.0;

fn model(corpus: &Corpus) -> (nn::VarStore, Gpt, GptConfig) {
    let cfg = GptConfig { vocab: corpus.vocab, block: 16, layers: 2, heads: 2, embd: 32 };
    let (vs, gpt) = support::build_model(7, None, |vs| Gpt::new(vs.root(), &cfg)).unwrap();
    (vs, gpt, cfg)
}

fn loss(gpt: &Gpt, cfg: &GptConfig, corpus: &Corpus, step: u64, rows: std::ops::Range<usize>) -> Tensor {
    let (x, y) = corpus.batch(7, step, GLOBAL_BATCH, rows, cfg.block);
    gpt.forward(&x).view([-1, cfg.vocab]).cross_entropy_for_logits(&y.view([-1]))
}

fn params(vs: &nn::VarStore) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> =
        vs.variables().into_iter().map(|(n, t)| (n, Vec::<f32>::try_from(t.detach().reshape([-1])).unwrap())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn gpt_stages_0_to_3_match_single_process_adamw() {
    let corpus = Corpus::load();
    let reference = {
        let (vs, gpt, cfg) = model(&corpus);
        let mut opt =
            nn::AdamW { beta1: 0.9, beta2: 0.999, wd: 0.0, eps: 1e-8, amsgrad: false }.build(&vs, LR).unwrap();
        for step in 0..STEPS {
            let l = loss(&gpt, &cfg, &corpus, step, 0..GLOBAL_BATCH as usize);
            opt.zero_grad();
            l.backward();
            opt.clip_grad_norm(CLIP);
            opt.step();
        }
        params(&vs)
    };
    let initial = params(&model(&corpus).0);
    assert!(max_relative_difference(&initial, &reference) > 1e-3, "the reference must have trained");
    // (world size, accumulation, stage, activation checkpointing)
    let mut runs: Vec<(usize, u64, u8, bool)> = Vec::new();
    for (world, gas) in [(1usize, 1u64), (2, 2), (3, 1)] {
        runs.extend((0..=3u8).map(|stage| (world, gas, stage, false)));
    }
    runs.extend([(2, 1, 3, true), (3, 2, 3, true)]);
    {
        for (world, gas, stage, ac) in runs {
            let config = Config::from_value(json!({
                "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
                "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
                // Stage 3: nothing persistent, nothing kept for reuse, so every unit is gathered and released.
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
            }))
            .unwrap();
            let comms = threads::group(world, Duration::from_secs(60));
            let got: Vec<Vec<(String, Vec<f32>)>> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|comm| {
                        let (config, corpus) = (config.clone(), &corpus);
                        s.spawn(move || {
                            let (vs, gpt, cfg) = model(corpus);
                            let options =
                                EngineOptions { activation_checkpointing: ac, ..Default::default() }.units_of(&gpt);
                            let mut engine = Engine::new(&vs, config, Box::new(comm), options).unwrap();
                            let b = engine.batch_sizes();
                            for step in 0..STEPS {
                                for m in 0..b.gradient_accumulation_steps {
                                    let rows = support::micro_batch_range(
                                        engine.rank(),
                                        engine.world_size(),
                                        m,
                                        b.train_micro_batch_size_per_gpu,
                                    );
                                    if stage >= 2 {
                                        // Through the engine, unit by unit.
                                        let (x, y) = corpus.batch(7, step, GLOBAL_BATCH, rows, cfg.block);
                                        let logits = engine.forward(&gpt, &x).unwrap();
                                        let l = logits.view([-1, cfg.vocab]).cross_entropy_for_logits(&y.view([-1]));
                                        engine.backward_units(&gpt, &l).unwrap();
                                    } else {
                                        // A plain tch forward: stages 0-1 need nothing else.
                                        engine.backward(&loss(&gpt, &cfg, corpus, step, rows)).unwrap();
                                    }
                                    engine.step().unwrap();
                                }
                            }
                            let p = full_parameters(&mut engine);
                            if stage < 3 {
                                assert_eq!(p, params(&vs), "full_parameters are the model's own values");
                            }
                            p
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (rank, p) in got.iter().enumerate() {
                let d = max_relative_difference(p, &reference);
                assert!(
                    d <= 1e-5,
                    "world size {world}, stage {stage}, accumulation {gas}, checkpointing {ac}, rank {rank}: {d:e}"
                );
            }
        }
    }
}
