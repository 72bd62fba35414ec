//! Stage 3 for any model: units entered from the program's own forward with `engine.unit`. Three models that are
//! not a chain (an encoder-decoder with cross-attention in every decoder block and a tied embedding, a U-Net-like
//! conv net with skips across units, an LSTM language model) trained at stage 3 on 2 and 3 ranks end within 1e-5
//! of the same program at stage 0 on 1 rank; a parameter read outside its unit is an error naming the unit for
//! every kind of layer, never a signal; a backward outside the engine is refused by name.
use std::time::Duration;

use serde_json::{json, Value};
use tch::nn::{self, Module, ModuleT, RNN};
use tch::{Device, Kind, Tensor};
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions};

#[path = "../examples/support/scoped_models.rs"]
mod scoped_models;
use scoped_models::*;

#[path = "common/compare.rs"]
mod compare;
use compare::{full_parameters, max_relative_difference};

const GLOBAL_BATCH: i64 = 6;
const STEPS: i64 = 4;
/// Adam's epsilon: its default 1e-8 turns a rounding-level gradient (a sum over samples in another order on 3 ranks
/// than on 1) into a full-size step, which no data-parallel split reproduces; 1e-6 keeps such elements near zero.
const EPS: f64 = 1e-6;

/// libtorch's default generator is process-wide: whoever seeds and draws from it holds this lock.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
/// A checkpointed unit's run in backward sets the process-wide generator back to the forward's state for a moment:
/// the tests that checkpoint hold this alone (`write`), the others that seed and draw beside each other (`read`), so
/// a replay never moves another test's draws.
static REPLAYS: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn beside_replays() -> std::sync::RwLockReadGuard<'static, ()> {
    REPLAYS.read().unwrap_or_else(|p| p.into_inner())
}

fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    REPLAYS.write().unwrap_or_else(|p| p.into_inner())
}

fn config(stage: u64, zero: Value) -> Config {
    let mut z = json!({"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0});
    for (k, v) in zero.as_object().unwrap() {
        z[k] = v.clone();
    }
    Config::from_value(json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "eps": EPS}},
        "zero_optimization": z
    }))
    .unwrap()
}

/// A model the test trains: built on a path, its units, and the loss of a micro-batch (rows of the global batch).
trait Trained {
    fn build(p: &nn::Path) -> Self;
    fn units(&self) -> Vec<Vec<String>>;
    /// The global batch of `step` as tensors whose first dimension is the sample.
    fn batch(step: i64) -> Vec<Tensor>;
    fn loss(&self, engine: &mut Engine, batch: &[Tensor]) -> zerorun::Result<Tensor>;
}

/// Values in [0, 1) from a private generator (libtorch's is process-wide and tests run in parallel).
fn uniform(n: i64, seed: u64) -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect()
}

fn tokens(shape: [i64; 2], vocab: i64, seed: u64) -> Tensor {
    let ids: Vec<i64> = uniform(shape[0] * shape[1], seed).iter().map(|u| (u * vocab as f32) as i64).collect();
    Tensor::from_slice(&ids).view(shape)
}

const SEQ2SEQ: Seq2SeqSize = Seq2SeqSize { vocab: 11, d: 16, heads: 2, layers: 2, max_len: 8 };

impl Trained for Seq2Seq {
    fn build(p: &nn::Path) -> Self {
        Seq2Seq::new(p, SEQ2SEQ)
    }
    fn units(&self) -> Vec<Vec<String>> {
        Seq2Seq::units(self)
    }
    fn batch(step: i64) -> Vec<Tensor> {
        let source = tokens([GLOBAL_BATCH, 7], SEQ2SEQ.vocab, step as u64);
        // The target is the source reversed, after a start token 0.
        let target = Tensor::cat(&[Tensor::zeros([GLOBAL_BATCH, 1], (Kind::Int64, Device::Cpu)), source.flip([1])], 1);
        vec![source, target]
    }
    fn loss(&self, engine: &mut Engine, b: &[Tensor]) -> zerorun::Result<Tensor> {
        Seq2Seq::loss(self, engine, &b[0], &b[1])
    }
}

impl Trained for UNet {
    fn build(p: &nn::Path) -> Self {
        UNet::new(p)
    }
    fn units(&self) -> Vec<Vec<String>> {
        UNet::units()
    }
    fn batch(step: i64) -> Vec<Tensor> {
        let x = Tensor::from_slice(&uniform(GLOBAL_BATCH * 64, 100 + step as u64)).view([GLOBAL_BATCH, 1, 8, 8]);
        // Denoising a smooth target.
        let y = (&x * 3.0).sin();
        vec![x, y]
    }
    fn loss(&self, engine: &mut Engine, b: &[Tensor]) -> zerorun::Result<Tensor> {
        Ok(self.forward(engine, &b[0])?.mse_loss(&b[1], tch::Reduction::Mean))
    }
}

impl Trained for LstmLm {
    fn build(p: &nn::Path) -> Self {
        LstmLm::new(p, 13, 8, 12)
    }
    fn units(&self) -> Vec<Vec<String>> {
        LstmLm::units()
    }
    fn batch(step: i64) -> Vec<Tensor> {
        vec![tokens([GLOBAL_BATCH, 9], 13, 200 + step as u64)]
    }
    fn loss(&self, engine: &mut Engine, b: &[Tensor]) -> zerorun::Result<Tensor> {
        LstmLm::loss(self, engine, &b[0])
    }
}

/// Named parameter values, sorted by name.
type Params = Vec<(String, Vec<f32>)>;

/// What a rank ended with: its final full parameters, its last loss, its peak of gathered parameter bytes and its
/// units' bytes, largest first.
type Ended = (Params, f64, usize, Vec<usize>);

/// Trains `M` on `world` thread ranks with `config`.
fn train<M: Trained>(world: usize, config: Config) -> Vec<Ended> {
    on_ranks(world, |comm| {
        let config = config.clone();
        let vs = nn::VarStore::new(Device::Cpu);
        let model = {
            let _rng = RNG.lock().unwrap_or_else(|p| p.into_inner());
            tch::manual_seed(7);
            M::build(&vs.root())
        };
        let options = EngineOptions { units: Some(model.units()), ..Default::default() };
        let mut engine = Engine::new(&vs, config, Box::new(comm), options).unwrap();
        let (rank, micro) = (engine.rank() as i64, engine.batch_sizes().train_micro_batch_size_per_gpu as i64);
        let mut last = f64::NAN;
        for step in 0..STEPS {
            let batch: Vec<Tensor> = M::batch(step).iter().map(|t| t.narrow(0, rank * micro, micro)).collect();
            let loss = model.loss(&mut engine, &batch).unwrap();
            engine.backward(&loss).unwrap();
            if let zerorun::StepOutcome::Stepped { loss, .. } = engine.step().unwrap() {
                last = loss;
            }
        }
        let mut unit_bytes: Vec<usize> = engine.layout().units.iter().map(|u| u.range.len() * 4).collect();
        unit_bytes.sort_unstable_by(|a, b| b.cmp(a));
        let peak = engine.gathered_bytes().peak;
        (full_parameters(&mut engine), last, peak, unit_bytes)
    })
}

fn stage3_matches_stage0<M: Trained>(what: &str) {
    let _beside = beside_replays();
    let reference = train::<M>(1, config(0, json!({}))).remove(0);
    assert!(reference.1.is_finite(), "{what}: the reference trained");
    for (world, zero) in [
        (2, json!({"overlap_comm": true, "stage3_prefetch_bucket_size": 1})),
        (3, json!({"overlap_comm": false})),
        (2, json!({"stage3_param_persistence_threshold": 100, "stage3_max_reuse_distance": 1000000})),
    ] {
        let runs = train::<M>(world, config(3, zero.clone()));
        for (rank, (params, loss, peak, unit_bytes)) in runs.iter().enumerate() {
            // Units are released as soon as their gradients are reduced, in forward as soon as they exit: never
            // more than two gathered at once (without persistence or reuse), and one more while the next is
            // prefetched along the traced order (overlap_comm, one unit per bucket).
            if zero.get("stage3_max_reuse_distance").is_none() {
                let prefetching = zero["overlap_comm"] == json!(true);
                let bound: usize = unit_bytes.iter().take(if prefetching { 3 } else { 2 }).sum();
                assert!(
                    *peak <= bound,
                    "{what} on {world} ranks ({zero}): {peak} bytes gathered at once, bound {bound}"
                );
            }
            let d = max_relative_difference(params, &reference.0);
            assert!(d <= 1e-5, "{what}, stage 3 on {world} ranks ({zero}), rank {rank}: parameters differ by {d:e}");
            assert!(
                (loss - reference.1).abs() <= 1e-5 * reference.1.abs().max(1.0),
                "{what}: loss {loss} vs {}",
                reference.1
            );
        }
    }
}

#[test]
fn an_encoder_decoder_with_a_tied_embedding_at_stage_3_matches_stage_0() {
    stage3_matches_stage0::<Seq2Seq>("encoder-decoder");
}

#[test]
fn a_unet_with_skips_across_units_at_stage_3_matches_stage_0() {
    stage3_matches_stage0::<UNet>("U-Net");
}

#[test]
fn an_lstm_language_model_at_stage_3_matches_stage_0() {
    stage3_matches_stage0::<LstmLm>("LSTM");
}

/// Runs `rank(comm)` on `world` thread ranks (60 s timeout); what each returned, in rank order.
fn on_ranks<R: Send>(world: usize, rank: impl Fn(threads::ThreadComm) -> R + Sync) -> Vec<R> {
    let comms = threads::group(world, Duration::from_secs(60));
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|comm| s.spawn(|| rank(comm))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A call that must fail.
type Call<'a> = Box<dyn Fn() + 'a>;

/// The message of a panic that `f` ends in (tch's non-`f_` calls panic with libtorch's error).
fn panic_message(f: impl FnOnce()) -> String {
    let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("the call must fail");
    e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

#[test]
fn a_parameter_read_outside_its_unit_is_an_error_naming_the_unit_for_every_kind_of_layer() {
    on_ranks(2, |comm| {
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let _rng = RNG.lock().unwrap_or_else(|p| p.into_inner());
        let lin = nn::linear(&root / "lin", 4, 4, Default::default());
        let emb = nn::embedding(&root / "emb", 10, 4, Default::default());
        let ln = nn::layer_norm(&root / "ln", vec![4], Default::default());
        let conv = nn::conv2d(&root / "conv", 2, 3, 3, Default::default());
        let bn = nn::batch_norm2d(&root / "bn", 2, Default::default());
        let rnn_config = nn::RNNConfig { batch_first: true, ..Default::default() };
        let lstm = nn::lstm(&root / "lstm", 4, 5, rnn_config);
        let gru = nn::gru(&root / "gru", 4, 5, rnn_config);
        let attn = Attention::new(&(&root / "attn"), 4, 2);
        let units: Vec<Vec<String>> =
            ["lin", "emb", "ln", "conv", "bn", "lstm", "gru", "attn"].iter().map(|u| vec![u.to_string()]).collect();
        let options = EngineOptions { units: Some(units), ..Default::default() };
        drop(_rng);
        let mut engine = Engine::new(&vs, config(3, json!({})), Box::new(comm), options).unwrap();
        let x = Tensor::ones([2, 3, 4], (Kind::Float, Device::Cpu));
        let img = Tensor::ones([1, 2, 5, 5], (Kind::Float, Device::Cpu));
        let ids = Tensor::from_slice(&[1i64, 2, 3]);
        let cases: Vec<(&str, Call)> = vec![
            ("lin", Box::new(|| drop(lin.forward(&x)))),
            ("lin", Box::new(|| drop(x.matmul(&lin.ws)))),
            ("emb", Box::new(|| drop(emb.forward(&ids)))),
            ("ln", Box::new(|| drop(ln.forward(&x)))),
            ("conv", Box::new(|| drop(conv.forward(&img)))),
            ("bn", Box::new(|| drop(bn.forward_t(&img, true)))),
            ("lstm", Box::new(|| drop(lstm.seq(&x)))),
            ("gru", Box::new(|| drop(gru.seq(&x)))),
            ("attn", Box::new(|| drop(attn.forward(&x, &x, true)))),
        ];
        for (unit, call) in &cases {
            let m = panic_message(call);
            // tch's panic quotes the error in Debug form.
            assert!(
                m.contains(&format!("of unit `{unit}` is released"))
                    && m.contains(&format!("engine.unit(\\\"{unit}\\\"")),
                "unit {unit}: {m}"
            );
        }
        // Operators that reach a released parameter only through a tensor they made from it cannot name it.
        for call in [
            Box::new(|| drop(lin.ws.sum(Kind::Float))) as Call,
            Box::new(|| drop(format!("{:?}", lin.ws.to_kind(Kind::Double)))),
        ] {
            let m = panic_message(call);
            assert!(m.contains("released stage-3 parameter") && m.contains("engine.unit("), "{m}");
        }
        // Inside their units the same calls work.
        let y = engine.unit("lstm", |_| lstm.seq(&x)).unwrap();
        assert_eq!(y.0.size(), [2, 3, 5]);
        let y = engine.unit("attn", |_| attn.forward(&x, &x, true)).unwrap();
        assert_eq!(y.size(), [2, 3, 4]);
        // An unknown unit is named with the ones there are.
        let e = engine.unit("decoder", |_| ()).unwrap_err().to_string();
        assert!(e.contains("engine.unit(\"decoder\", ..): no unit has that name"), "{e}");
        // A backward the engine does not run reaches a released unit: refused by name, not a signal.
        let y = engine.unit("lin", |_| lin.forward(&x)).unwrap();
        let e = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
        assert!(e.contains("unit `lin` is sharded") && e.contains("engine.backward(&loss)"), "{e}");
    });
}

/// `config(3, ..)` with the top-level keys in `top` replaced.
fn config_with(zero: Value, top: Value) -> Config {
    let mut v = serde_json::to_value(config(3, zero)).unwrap();
    for (k, x) in top.as_object().unwrap() {
        v[k] = x.clone();
    }
    Config::from_value(v).unwrap()
}

#[test]
fn scopes_step_in_backward_and_from_nvme_like_the_ordinary_step() {
    let _beside = beside_replays();
    // The optimizer in backward steps each unit as its reduction lands, from a gradient hook: bitwise the
    // ordinary step (no clipping: it needs the whole gradient's norm first).
    let ordinary = train::<Seq2Seq>(2, config_with(json!({}), json!({"gradient_clipping": 0.0})));
    let in_backward =
        train::<Seq2Seq>(2, config_with(json!({}), json!({"gradient_clipping": 0.0, "optimizer_in_backward": true})));
    assert_eq!(max_relative_difference(&in_backward[0].0, &ordinary[0].0), 0.0, "optimizer in backward");
    // Parameters and optimizer states on NVMe: units are read back for each gather, in forward and in backward.
    let dir = std::env::temp_dir().join(format!("zerorun-scopes-nvme-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let nvme = json!({"device": "nvme", "nvme_path": dir.to_str().unwrap()});
    let on_nvme = train::<UNet>(2, config(3, json!({"offload_param": nvme, "offload_optimizer": nvme})));
    let in_memory = train::<UNet>(2, config(3, json!({})));
    std::fs::remove_dir_all(&dir).ok();
    assert!(max_relative_difference(&on_nvme[0].0, &in_memory[0].0) <= 1e-6, "NVMe");
}

/// Four 8 x 8 linear units run in the order `schedule(step)`; every rank's final parameters and, per step, the
/// gathered bytes seen inside unit `b`.
fn train_reordered(world: usize, config: Config, schedule: fn(i64) -> [&'static str; 4]) -> Vec<Ended> {
    on_ranks(world, |comm| {
        let config = config.clone();
        let vs = nn::VarStore::new(Device::Cpu);
        let names = ["a", "b", "c", "d"];
        let layers: Vec<nn::Linear> = {
            let _rng = RNG.lock().unwrap_or_else(|p| p.into_inner());
            tch::manual_seed(11);
            names.iter().map(|n| nn::linear(vs.root() / *n, 8, 8, Default::default())).collect()
        };
        let units = names.iter().map(|n| vec![n.to_string()]).collect();
        let options = EngineOptions { units: Some(units), ..Default::default() };
        let mut engine = Engine::new(&vs, config, Box::new(comm), options).unwrap();
        let (rank, micro) = (engine.rank() as i64, engine.batch_sizes().train_micro_batch_size_per_gpu as i64);
        let mut inside_b = Vec::new();
        let mut last = f64::NAN;
        for step in 0..STEPS {
            let x = Tensor::from_slice(&uniform(GLOBAL_BATCH * 8, 300 + step as u64)).view([GLOBAL_BATCH, 8]);
            let x = x.narrow(0, rank * micro, micro);
            let mut h = x.shallow_clone();
            for name in schedule(step) {
                let layer = &layers[names.iter().position(|n| *n == name).unwrap()];
                h = engine
                    .unit(name, |engine| {
                        if name == "b" {
                            inside_b.push(engine.gathered_bytes().current);
                        }
                        layer.forward(&h).tanh()
                    })
                    .unwrap();
            }
            let loss = (&h - x.sin()).square().mean(Kind::Float);
            engine.backward(&loss).unwrap();
            if let zerorun::StepOutcome::Stepped { loss, .. } = engine.step().unwrap() {
                last = loss;
            }
        }
        (full_parameters(&mut engine), last, 0, inside_b)
    })
}

#[test]
fn later_micro_batches_prefetch_along_the_traced_order_and_a_changed_order_is_retraced() {
    let _beside = beside_replays();
    let schedule = |step| if step < 2 { ["a", "b", "c", "d"] } else { ["a", "c", "b", "d"] };
    let reference = train_reordered(1, config(0, json!({})), schedule).remove(0);
    let zero = json!({"overlap_comm": true, "stage3_prefetch_bucket_size": 1});
    for (rank, (params, _, _, inside_b)) in train_reordered(2, config(3, zero), schedule).iter().enumerate() {
        let d = max_relative_difference(params, &reference.0);
        assert!(d <= 1e-5, "rank {rank}: {d:e}");
        // A unit is 8 x 8 + 8 floats = 288 bytes. Step 0 has no trace: only b is gathered inside b. Step 1
        // follows step 0's trace: c was prefetched when b was entered. Step 2 leaves it at its second unit (c
        // instead of b): no prefetch, nothing wrong. Step 3 follows step 2's order: b is last but one, d is next.
        let unit = 288;
        assert_eq!(inside_b[0], unit, "rank {rank}: step 0");
        assert_eq!(inside_b[1], 2 * unit, "rank {rank}: step 1 prefetched c");
        assert_eq!(inside_b[2], unit, "rank {rank}: step 2 left the trace");
        assert_eq!(inside_b[3], 2 * unit, "rank {rank}: step 3 prefetched d along the new trace");
    }
}

/// Three residual blocks (linear, then dropout with probability `p`), checkpointed or not; every rank's final
/// parameters and how many times the checkpointed forwards ran.
fn train_checkpointed(world: usize, config: Config, checkpointed: bool, p: f64) -> Vec<(Params, usize)> {
    use std::cell::Cell;
    use std::rc::Rc;
    on_ranks(world, |comm| {
        let config = config.clone();
        let vs = nn::VarStore::new(Device::Cpu);
        let blocks: Vec<Rc<nn::Linear>> = {
            let _rng = RNG.lock().unwrap_or_else(|p| p.into_inner());
            tch::manual_seed(5);
            (0..3).map(|i| Rc::new(nn::linear(vs.root() / "blocks" / i, 8, 8, Default::default()))).collect()
        };
        let units = (0..3).map(|i| vec![format!("blocks.{i}")]).collect();
        let options = EngineOptions { units: Some(units), ..Default::default() };
        let mut engine = Engine::new(&vs, config, Box::new(comm), options).unwrap();
        let (rank, micro) = (engine.rank() as i64, engine.batch_sizes().train_micro_batch_size_per_gpu as i64);
        let runs = Rc::new(Cell::new(0usize));
        for step in 0..STEPS {
            let x = Tensor::from_slice(&uniform(GLOBAL_BATCH * 8, 400 + step as u64)).view([GLOBAL_BATCH, 8]);
            let x = x.narrow(0, rank * micro, micro);
            let mut h = x.shallow_clone();
            // Dropout draws from the process-wide generator: one rank at a time (world 1 only).
            let _rng = (p > 0.0).then(|| RNG.lock().unwrap_or_else(|p| p.into_inner()));
            if p > 0.0 {
                tch::manual_seed(100 + step);
            }
            for (i, block) in blocks.iter().enumerate() {
                let name = format!("blocks.{i}");
                let (b, runs) = (Rc::clone(block), Rc::clone(&runs));
                let f = move |xs: &[Tensor]| {
                    runs.set(runs.get() + 1);
                    &xs[0] + b.forward(&xs[0]).tanh().dropout(p, true)
                };
                h = if checkpointed {
                    engine.unit_checkpointed(&name, &[&h], f).unwrap()
                } else {
                    engine.unit(&name, |_| f(&[h.shallow_clone()])).unwrap()
                };
            }
            let loss = (&h - x.cos()).square().mean(Kind::Float);
            engine.backward(&loss).unwrap();
            engine.step().unwrap();
        }
        (full_parameters(&mut engine), runs.get())
    })
}

#[test]
fn a_checkpointed_unit_is_recomputed_in_backward_and_trains_as_the_plain_one() {
    let _alone = alone();
    let reference = train_checkpointed(1, config(0, json!({})), false, 0.0).remove(0);
    assert_eq!(reference.1, 3 * STEPS as usize, "each block ran once per step");
    for (world, zero) in [(2, json!({"overlap_comm": true})), (3, json!({"overlap_comm": false}))] {
        for (rank, (params, runs)) in train_checkpointed(world, config(3, zero.clone()), true, 0.0).iter().enumerate() {
            assert_eq!(*runs, 2 * 3 * STEPS as usize, "rank {rank}: each block ran again in backward");
            let d = max_relative_difference(params, &reference.0);
            assert!(d <= 1e-5, "checkpointed, stage 3 on {world} ranks ({zero}), rank {rank}: {d:e}");
        }
    }
    // Dropout draws the same masks in backward's run as in forward's: the same training as without checkpointing.
    let plain = train_checkpointed(1, config(0, json!({})), false, 0.3).remove(0);
    let checkpointed = train_checkpointed(1, config(3, json!({})), true, 0.3).remove(0);
    assert_eq!(max_relative_difference(&checkpointed.0, &plain.0), 0.0, "dropout replayed");
}

/// Two blocks, each a mixing linear (its own unit) with a second linear nested inside it (another unit, as a
/// layer's experts are), returning the block's output and a side loss term (as a router's logits feed the
/// load-balancing loss); checkpointed with the nested unit entered through `NestedUnits`, or entered plainly.
/// Every rank's final parameters.
fn train_nested(world: usize, config: Config, checkpointed: bool) -> Vec<Params> {
    use std::rc::Rc;
    on_ranks(world, |comm| {
        let config = config.clone();
        let vs = nn::VarStore::new(Device::Cpu);
        let blocks: Vec<(Rc<nn::Linear>, Rc<nn::Linear>)> = {
            let _rng = RNG.lock().unwrap_or_else(|p| p.into_inner());
            tch::manual_seed(9);
            (0..2)
                .map(|i| {
                    let p = vs.root() / "blocks" / i;
                    let mix = nn::linear(&p / "mix", 8, 8, Default::default());
                    (Rc::new(mix), Rc::new(nn::linear(&p / "inner", 8, 8, Default::default())))
                })
                .collect()
        };
        let units = (0..2).flat_map(|i| [vec![format!("blocks.{i}.mix")], vec![format!("blocks.{i}.inner")]]).collect();
        let options = EngineOptions { units: Some(units), ..Default::default() };
        let mut engine = Engine::new(&vs, config, Box::new(comm), options).unwrap();
        let (rank, micro) = (engine.rank() as i64, engine.batch_sizes().train_micro_batch_size_per_gpu as i64);
        for step in 0..STEPS {
            let x = Tensor::from_slice(&uniform(GLOBAL_BATCH * 8, 700 + step as u64)).view([GLOBAL_BATCH, 8]);
            let x = x.narrow(0, rank * micro, micro);
            let (mut h, mut side) = (x.shallow_clone(), Vec::new());
            for (i, (mix, inner)) in blocks.iter().enumerate() {
                let (outer, nested) = (format!("blocks.{i}.mix"), format!("blocks.{i}.inner"));
                let (m, n) = (Rc::clone(mix), Rc::clone(inner));
                let block = move |xs: &[Tensor], enter: &mut dyn FnMut(&Tensor) -> zerorun::Result<Tensor>| {
                    let a = m.forward(&xs[0]).tanh();
                    let e = enter(&a)?;
                    Ok(vec![&xs[0] + &e, a.square().mean(Kind::Float)])
                };
                let out = if checkpointed {
                    engine
                        .unit_checkpointed_with(&outer, &[&h], move |xs, units| {
                            block(xs, &mut |a| units.unit(&nested, || n.forward(a).sin()))
                        })
                        .unwrap()
                } else {
                    let h = h.shallow_clone();
                    engine
                        .unit(&outer, |engine| block(&[h], &mut |a| engine.unit(&nested, |_| n.forward(a).sin())))
                        .unwrap()
                        .unwrap()
                };
                h = out[0].shallow_clone();
                side.push(out[1].shallow_clone());
            }
            let loss = (&h - x.cos()).square().mean(Kind::Float) + 0.5 * Tensor::stack(&side, 0).sum(Kind::Float);
            engine.backward(&loss).unwrap();
            engine.step().unwrap();
        }
        full_parameters(&mut engine)
    })
}

#[test]
fn a_checkpointed_unit_with_a_unit_nested_inside_and_two_outputs_trains_as_the_plain_one() {
    let _alone = alone();
    let reference = train_nested(1, config(0, json!({})), false).remove(0);
    // Stage 3 and stage 2 gather the nested unit through the lent engine; stage 1 finds its parameters by name.
    for (world, stage, zero) in [
        (2, 3, json!({"overlap_comm": true})),
        (3, 3, json!({"overlap_comm": false})),
        (2, 2, json!({})),
        (2, 1, json!({})),
    ] {
        for (rank, params) in train_nested(world, config(stage, zero.clone()), true).iter().enumerate() {
            let d = max_relative_difference(params, &reference);
            assert!(
                d <= 1e-5,
                "checkpointed with a nested unit, stage {stage} on {world} ranks ({zero}), rank {rank}: {d:e}"
            );
        }
    }
}

/// A checkpointed unit, or a unit nested in one, that no unit and no parameter is named by is an error naming it
/// at every stage (a name that trains nothing would leave its parameters without gradients).
#[test]
fn a_checkpointed_or_nested_unit_of_no_name_is_an_error_naming_it() {
    for stage in [1, 3] {
        let errors = on_ranks(1, |comm| {
            let vs = nn::VarStore::new(Device::Cpu);
            // Its initial values draw from the process-wide generator, which the other tests seed and draw from.
            let lin = {
                let _rng = RNG.lock().unwrap_or_else(|p| p.into_inner());
                std::rc::Rc::new(nn::linear(vs.root() / "a", 4, 4, Default::default()))
            };
            let options = EngineOptions { units: Some(vec![vec!["a".into()]]), ..Default::default() };
            let mut engine = Engine::new(&vs, config(stage, json!({})), Box::new(comm), options).unwrap();
            let x = Tensor::ones([1, 4], (Kind::Float, Device::Cpu));
            let outer = engine.unit_checkpointed("b", &[&x], |xs| xs[0].shallow_clone()).unwrap_err().to_string();
            let l = std::rc::Rc::clone(&lin);
            let nested = engine
                .unit_checkpointed_with("a", &[&x], move |xs, units| Ok(vec![units.unit("c", || l.forward(&xs[0]))?]))
                .unwrap_err()
                .to_string();
            (outer, nested)
        });
        let (outer, nested) = &errors[0];
        assert!(outer.contains("\"b\""), "stage {stage}: {outer}");
        assert!(nested.contains("\"c\""), "stage {stage}: {nested}");
    }
}
