//! Stage 2 in a plain training loop (no units): gradient hooks reduce bucket by bucket during `engine.backward`,
//! so no parameter holds a gradient when it returns; the result is stage 1's; an unused parameter and a backward
//! run outside the engine are reduced at `step`.
use serde_json::json;
use tch::nn::Module;
use tch::Tensor;
use zerorun::{Config, Engine, EngineOptions};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

#[path = "common/compare.rs"]
mod compare;
use compare::max_relative_difference;

#[derive(Clone, Copy, PartialEq)]
enum Backward {
    /// `engine.backward(&loss)`.
    Engine,
    /// `loss.backward()` by the program itself, then `engine.step()`.
    Direct,
}

struct Run {
    params: Vec<(String, Vec<f32>)>,
    /// Parameters that still had a `.grad` right after a backward (rank 0, every micro-batch).
    grads_left: usize,
    /// `gradients_full` bytes right after a backward (rank 0, the largest seen).
    full_gradient_bytes: usize,
}

/// 2 thread ranks, 6 steps of the MLP, plus an extra parameter the model never uses when `unused`.
fn run(stage: u8, backward: Backward, unused: bool) -> Run {
    let config = Config::from_value(json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        // Buckets smaller than a weight: several buckets, some of one bias.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100}
    }))
    .unwrap();
    let mut runs: Vec<Run> = on_thread_ranks(2, |comm, x, y| {
        let config = config.clone();
        let (vs, model) = init_store();
        if unused {
            let _ = vs.root().var("unused", &[5], tch::nn::Init::Const(0.5));
        }
        let mut engine = Engine::new(&vs, config, Box::new(comm), EngineOptions::default()).unwrap();
        let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
        let rank = engine.rank();
        let (mut grads_left, mut full_gradient_bytes) = (0, 0);
        for step in 0..6 {
            let order = batch_indices(step);
            let idx = Tensor::from_slice(&order[rank * micro..(rank + 1) * micro]);
            let loss = model.forward(&x.index_select(0, &idx)).mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
            match backward {
                Backward::Engine => engine.backward(&loss).unwrap(),
                Backward::Direct => loss.backward(),
            }
            grads_left += vs.trainable_variables().iter().filter(|t| t.grad().defined()).count();
            let full = engine
                .memory_bytes()
                .into_iter()
                .find(|(n, _)| *n == zerorun::runtime::report::MemoryCategory::GradientsFull)
                .unwrap()
                .1;
            full_gradient_bytes = full_gradient_bytes.max(full);
            engine.step().unwrap();
        }
        let mut params = params_of(&vs);
        params.retain(|(n, _)| n != "unused");
        Run { params, grads_left, full_gradient_bytes }
    });
    runs.remove(0)
}

#[test]
fn plain_loop_stage2_reduces_during_backward_and_matches_stage1() {
    let stage1 = run(1, Backward::Engine, false);
    assert!(stage1.grads_left > 0 && stage1.full_gradient_bytes > 0, "stage 1 keeps the full gradients until step");
    let stage2 = run(2, Backward::Engine, false);
    assert_eq!(
        (stage2.grads_left, stage2.full_gradient_bytes),
        (0, 0),
        "every bucket was reduced and freed inside backward"
    );
    let d = max_relative_difference(&stage2.params, &stage1.params);
    assert!(d <= 1e-6, "stage 2 with hooks vs stage 1: max relative difference {d:e}");
}

#[test]
fn unused_parameters_and_backward_outside_the_engine_are_reduced_at_step() {
    let reference = run(2, Backward::Engine, false);
    // The unused parameter's bucket never completes in backward: engine.backward reduces it before returning.
    let unused = run(2, Backward::Engine, true);
    assert_eq!(unused.grads_left, 0);
    assert!(max_relative_difference(&unused.params, &reference.params) <= 1e-6);
    // A backward the engine did not run leaves the gradients in `.grad`; step reduces them, same sums.
    let direct = run(2, Backward::Direct, false);
    assert!(direct.grads_left > 0, "nothing was reduced during a backward the engine did not run");
    assert_eq!(direct.params, reference.params);
}

/// Two branches summed, `a(x) + b(x)` on rank 0 and `b(x) + a(x)` on rank 1: autograd runs the branch created
/// last first, so the ranks' buckets complete in opposite orders. The hooks must still reduce bucket i with bucket
/// i on every rank; the result is stage 1's, which reduces once after backward.
fn two_branches(stage: u8, overlap: bool) -> Vec<(String, Vec<f32>)> {
    let config = Config::from_value(json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        // One bucket per weight and per bias, of different sizes per branch.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 10, "overlap_comm": overlap}
    }))
    .unwrap();
    let mut runs = on_thread_ranks(2, |comm, x, y| {
        let _rng = rng_lock();
        tch::manual_seed(7);
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let a = tch::nn::linear(vs.root() / "a", IN, OUT, Default::default());
        let b1 = tch::nn::linear(vs.root() / "b" / 0, IN, HIDDEN, Default::default());
        let b2 = tch::nn::linear(vs.root() / "b" / 1, HIDDEN, OUT, Default::default());
        drop(_rng);
        let mut engine = Engine::new(&vs, config.clone(), Box::new(comm), EngineOptions::default()).unwrap();
        let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
        let rank = engine.rank();
        for step in 0..6 {
            let order = batch_indices(step);
            let idx = Tensor::from_slice(&order[rank * micro..(rank + 1) * micro]);
            let input = x.index_select(0, &idx);
            let out = if rank == 0 {
                let ya = a.forward(&input);
                ya + b2.forward(&b1.forward(&input).tanh())
            } else {
                let yb = b2.forward(&b1.forward(&input).tanh());
                a.forward(&input) + yb
            };
            let loss = out.mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
            engine.backward(&loss).unwrap();
            engine.step().unwrap();
        }
        params_of(&vs)
    });
    runs.remove(0)
}

#[test]
fn buckets_launch_in_one_order_on_every_rank_whatever_order_backward_completes_them() {
    let stage1 = two_branches(1, false);
    for overlap in [false, true] {
        let stage2 = two_branches(2, overlap);
        let d = max_relative_difference(&stage2, &stage1);
        assert!(d <= 1e-6, "stage 2 hooks (overlap {overlap}) vs stage 1 with rank-dependent backward order: {d:e}");
    }
}

/// `engine.set_requires_gradient_sync(false)` (FSDP2's call, what a pipeline stage uses): the micro-batches before
/// the last keep their gradients in `.grad` and run no collective; the last backward reduces the sum once. The run
/// ends where the default one (a reduction per micro-batch) does, within the sums' rounding.
#[test]
fn gradient_sync_off_until_the_last_micro_batch_reduces_once_and_matches() {
    let config = Config::from_value(json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 2, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 100}
    }))
    .unwrap();
    let train = |defer: bool| -> Vec<(String, Vec<f32>)> {
        let mut runs = on_thread_ranks(2, |comm, x, y| {
            let (vs, model) = init_store();
            let mut engine = Engine::new(&vs, config.clone(), Box::new(comm), EngineOptions::default()).unwrap();
            let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
            let rank = engine.rank();
            for step in 0..6 {
                let order = batch_indices(step);
                for m in 0..2 {
                    let at = (m * 2 + rank) * micro;
                    let idx = Tensor::from_slice(&order[at..at + micro]);
                    let loss = model
                        .forward(&x.index_select(0, &idx))
                        .mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
                    let last = engine.is_gradient_accumulation_boundary();
                    if defer {
                        engine.set_requires_gradient_sync(last);
                    }
                    let reduced_before = engine.comm_volume().reduce_scatter_elements;
                    engine.backward(&loss).unwrap();
                    let held = vs.trainable_variables().iter().filter(|t| t.grad().defined()).count();
                    let reduced = engine.comm_volume().reduce_scatter_elements - reduced_before;
                    if defer && !last {
                        assert_eq!(held, vs.trainable_variables().len(), "step {step}: gradients stay in .grad");
                        assert_eq!(reduced, 0, "step {step}: no collective before the last micro-batch");
                    } else {
                        assert_eq!(held, 0, "step {step} micro-batch {m}: the hooks reduced every gradient");
                        assert!(reduced > 0, "step {step} micro-batch {m}: reduced");
                    }
                    engine.step().unwrap();
                }
            }
            params_of(&vs)
        });
        runs.remove(0)
    };
    let (every, once) = (train(false), train(true));
    let diff = max_relative_difference(&once, &every);
    assert!(diff < 1e-5, "reduced once vs per micro-batch: {diff}");
}

/// `reduce_bucket_size` left out (or "auto") at stage 2 in a plain loop: the buckets are an eighth of the model, at
/// least 1M elements (DeepSpeed's 5e8 would make any model under 500M parameters one bucket, reduced after the
/// last gradient); a value written in the config is used as written, and stage 1 keeps DeepSpeed's default.
#[test]
fn a_bare_stage_2_config_sizes_its_buckets_from_the_model() {
    let bucket_of = |zero: serde_json::Value, elements: i64| {
        let config = Config::from_value(json!({"train_batch_size": 2, "zero_optimization": zero})).unwrap();
        on_thread_ranks(2, |comm, _, _| {
            let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            let _ = vs.root().var("a", &[elements / 2], tch::nn::Init::Const(0.1));
            let _ = vs.root().var("b", &[elements / 2], tch::nn::Init::Const(0.1));
            let engine = Engine::new(&vs, config.clone(), Box::new(comm), EngineOptions::default()).unwrap();
            engine.config().zero_optimization.reduce_bucket_size
        })
        .remove(0)
    };
    assert_eq!(bucket_of(json!({"stage": 2}), 1000), 1 << 20);
    assert_eq!(bucket_of(json!({"stage": 2, "reduce_bucket_size": "auto"}), 16_000_000), 2_000_000);
    assert_eq!(bucket_of(json!({"stage": 2, "reduce_bucket_size": 300}), 16_000_000), 300);
    assert_eq!(bucket_of(json!({"stage": 1}), 16_000_000), 500_000_000);
}
