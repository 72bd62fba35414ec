//! Every variable of the VarStore belongs to the engine: a small ResNet-style model (convolutions, BatchNorm, a
//! residual connection) and the same model with a frozen backbone, at stages 0-3 on 2-3 thread ranks.
//! - rank 0's buffers and frozen parameters reach every rank at initialize; buffers stay equal across ranks
//!   under the default (broadcast) and `average`, and drift apart under `local`;
//! - checkpoints restore buffers and frozen parameters bitwise at another world size and stage;
//!   `exclude_frozen_parameters` leaves them out and loading keeps the model's own;
//! - `state_dict` and `zerorun consolidate` give files `VarStore::load` of the same model reads;
//! - a frozen backbone is untouched and identical on every rank, and partitioned at stage 3 (memory report);
//! - mistakes are errors with their messages: a step with no backward, one VarStore in two engines, stage 3
//!   without units on a model that does not stay gathered; `save_16bit_model` works at stage 2 with units.
use std::path::Path;
use std::time::Duration;

use serde_json::json;
use tch::nn::{self, Module, ModuleT};
use tch::{Kind, Tensor};
use zerorun::runtime::comm::{threads, Communicator};
use zerorun::{BufferSync, Config, Engine, EngineOptions, SaveOptions, UnitModel};

const BATCH: i64 = 12;
const SAMPLES: i64 = 64;

/// conv + BatchNorm, a residual conv + BatchNorm block, and a linear head: three units.
struct Net {
    stem: nn::Conv2D,
    bn1: nn::BatchNorm,
    conv: nn::Conv2D,
    bn2: nn::BatchNorm,
    head: nn::Linear,
}

impl Net {
    fn new(p: &nn::Path) -> Net {
        let c = nn::ConvConfig { padding: 1, ..Default::default() };
        Net {
            stem: nn::conv2d(p / "stem", 3, 4, 3, c),
            bn1: nn::batch_norm2d(p / "bn1", 4, Default::default()),
            conv: nn::conv2d(p / "block" / "conv", 4, 4, 3, c),
            bn2: nn::batch_norm2d(p / "block" / "bn", 4, Default::default()),
            head: nn::linear(p / "head", 4, 2, Default::default()),
        }
    }
}

impl UnitModel for Net {
    fn unit_prefixes(&self) -> Vec<Vec<String>> {
        vec![vec!["stem".into(), "bn1".into()], vec!["block".into()], vec!["head".into()]]
    }

    fn forward_unit(&self, unit: usize, x: &Tensor) -> Tensor {
        match unit {
            0 => self.bn1.forward_t(&self.stem.forward(x), true).relu(),
            1 => (x + self.bn2.forward_t(&self.conv.forward(x), true)).relu(),
            _ => self.head.forward(&x.mean_dim([2i64, 3].as_slice(), false, Kind::Float)),
        }
    }
}

/// The model built from `seed` (ranks build from different seeds, so initialize's broadcast shows); with
/// `frozen_backbone`, everything but the head has requires_grad off.
fn build(seed: i64, frozen_backbone: bool) -> (nn::VarStore, Net) {
    // libtorch's generator is process-wide: construction holds the lock `load_checkpoint` holds to restore it.
    let _g = zerorun::generator_lock();
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = Net::new(&vs.root());
    if frozen_backbone {
        for (name, t) in vs.variables() {
            if !name.starts_with("head") && t.requires_grad() {
                let _ = t.set_requires_grad(false);
            }
        }
    }
    (vs, net)
}

/// Images and labels from a private generator.
fn data() -> (Tensor, Tensor) {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    };
    let x: Vec<f32> = (0..SAMPLES * 3 * 6 * 6).map(|_| next()).collect();
    let y: Vec<i64> = (0..SAMPLES).map(|_| (next() > 0.0) as i64).collect();
    (Tensor::from_slice(&x).view([SAMPLES, 3, 6, 6]), Tensor::from_slice(&y))
}

fn config(stage: u8, world: usize) -> Config {
    let mut zero = json!({"stage": stage});
    if stage == 3 {
        zero = json!({"stage": 3, "stage3_param_persistence_threshold": 0});
    }
    Config::from_value(json!({
        "train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH / world as i64,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "zero_optimization": zero
    }))
    .unwrap()
}

fn values(vars: &[(String, Tensor)]) -> Vec<(String, Vec<f32>)> {
    vars.iter()
        .map(|(n, t)| (n.clone(), Vec::<f32>::try_from(t.detach().to_kind(Kind::Float).reshape([-1])).unwrap()))
        .collect()
}

/// Every variable of `vs` by name, as f32 values.
fn snapshot(vs: &nn::VarStore) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    values(&v)
}

fn is_buffer(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}

/// Trains `steps` steps with this rank's half of every global batch.
fn train(engine: &mut Engine, net: &Net, steps: i64) {
    let (x, y) = data();
    let (rank, world) = (engine.rank() as i64, engine.world_size() as i64);
    let per_rank = BATCH / world;
    for step in 0..steps {
        let rows: Vec<i64> = (0..per_rank).map(|i| (step * BATCH + rank * per_rank + i) % SAMPLES).collect();
        let idx = Tensor::from_slice(&rows);
        let out = engine.forward(net, &x.index_select(0, &idx)).unwrap();
        let loss = out.cross_entropy_for_logits(&y.index_select(0, &idx));
        engine.backward(&loss).unwrap();
        engine.step().unwrap();
    }
}

/// Runs `f(rank's comm)` on `world` thread ranks; results in rank order.
fn on_ranks<R: Send>(world: usize, f: impl Fn(threads::ThreadComm) -> R + Sync) -> Vec<R> {
    let comms = threads::group(world, Duration::from_secs(60));
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn engine(vs: &nn::VarStore, net: &Net, stage: u8, comm: threads::ThreadComm, sync: BufferSync) -> Engine {
    let world = comm.world_size();
    let options = EngineOptions::default().units_of(net).buffers(sync);
    Engine::new(vs, config(stage, world), Box::new(comm), options).unwrap()
}

type Values = Vec<(String, Vec<f32>)>;

/// (after initialize, after training) snapshots of every variable on each rank.
fn run(stage: u8, world: usize, sync: BufferSync, frozen: bool) -> Vec<(Values, Values)> {
    on_ranks(world, |comm| {
        let rank = comm.rank();
        let (vs, net) = build(100 + rank as i64, frozen);
        let mut e = engine(&vs, &net, stage, comm, sync);
        let start = e.state_dict().unwrap();
        train(&mut e, &net, 4);
        (values(&start), values(&e.state_dict().unwrap()))
    })
}

#[test]
fn ranks_start_from_rank_0_and_buffers_stay_equal_at_every_stage() {
    let (rank0_vs, _) = build(100, false);
    let rank0 = snapshot(&rank0_vs);
    for stage in 0..=3u8 {
        let runs = run(stage, 2, BufferSync::Broadcast, false);
        for (r, (start, end)) in runs.iter().enumerate() {
            assert_eq!(start, &rank0, "stage {stage}: rank {r} does not start from rank 0's variables");
            assert_eq!(end, &runs[0].1, "stage {stage}: rank {r}'s variables differ from rank 0's after training");
        }
        let buffers_moved = runs[0].1.iter().zip(&rank0).any(|(a, b)| is_buffer(&a.0) && a.1 != b.1);
        assert!(buffers_moved, "stage {stage}: training did not update the running statistics");
    }
}

#[test]
fn local_buffers_drift_apart_and_averaged_ones_agree() {
    let buffers = |v: &[(String, Vec<f32>)]| v.iter().filter(|(n, _)| is_buffer(n)).cloned().collect::<Vec<_>>();
    let local = run(1, 2, BufferSync::Local, false);
    assert_ne!(buffers(&local[0].1), buffers(&local[1].1), "each rank sees other data: local buffers must differ");
    let averaged = run(1, 2, BufferSync::Average, false);
    assert_eq!(buffers(&averaged[0].1), buffers(&averaged[1].1));
    let broadcast = run(1, 2, BufferSync::Broadcast, false);
    assert_ne!(buffers(&averaged[0].1), buffers(&broadcast[0].1), "averaging must differ from taking rank 0's");
}

/// Saves at (`stage`, `world`), then loads into a model built from another seed at (`stage2`, `world2`): every
/// variable comes back bitwise (trainable ones through the fp32 master; buffers and frozen ones as saved).
fn round_trip(dir: &Path, frozen: bool, (stage, world): (u8, usize), (stage2, world2): (u8, usize)) {
    let saved = on_ranks(world, |comm| {
        let rank = comm.rank();
        let (vs, net) = build(7 + rank as i64, frozen);
        let mut e = engine(&vs, &net, stage, comm, BufferSync::Broadcast);
        train(&mut e, &net, 3);
        e.save_checkpoint(dir, None).unwrap();
        values(&e.state_dict().unwrap())
    });
    let loaded = on_ranks(world2, |comm| {
        let (vs, net) = build(999, frozen);
        let mut e = engine(&vs, &net, stage2, comm, BufferSync::Broadcast);
        e.load_checkpoint(dir, None).unwrap();
        values(&e.state_dict().unwrap())
    });
    for (r, l) in loaded.iter().enumerate() {
        assert_eq!(
            l, &saved[0],
            "stage {stage} x{world} -> stage {stage2} x{world2}: rank {r} did not restore every variable"
        );
    }
}

#[test]
fn checkpoints_restore_buffers_and_frozen_parameters_at_any_world_size_and_stage() {
    let tmp = std::env::temp_dir().join(format!("zerorun-model-state-{}", std::process::id()));
    round_trip(&tmp.join("a"), false, (1, 2), (3, 3));
    round_trip(&tmp.join("b"), false, (3, 2), (0, 1));
    round_trip(&tmp.join("c"), true, (3, 3), (2, 2));
    round_trip(&tmp.join("d"), true, (0, 2), (3, 2));
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn exclude_frozen_parameters_leaves_them_out_and_loading_keeps_the_models() {
    let dir = std::env::temp_dir().join(format!("zerorun-exclude-frozen-{}", std::process::id()));
    on_ranks(2, |comm| {
        let (vs, net) = build(3, true);
        let mut e = engine(&vs, &net, 3, comm, BufferSync::Broadcast);
        train(&mut e, &net, 2);
        e.save_checkpoint_with(&dir, &SaveOptions { tag: Some("t".into()), exclude_frozen_parameters: true }).unwrap();
    });
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("t/manifest.json")).unwrap()).unwrap();
    assert_eq!(m["frozen"], json!([]));
    assert_eq!(m["frozen_excluded"], json!(true));
    assert_eq!(m["buffers"].as_array().unwrap().len(), 4, "{}", m["buffers"]);
    let (fresh_vs, _) = build(55, true);
    let fresh = snapshot(&fresh_vs);
    let loaded = on_ranks(2, |comm| {
        let (vs, net) = build(55, true);
        let mut e = engine(&vs, &net, 3, comm, BufferSync::Broadcast);
        e.load_checkpoint(&dir, None).unwrap();
        values(&e.state_dict().unwrap())
    });
    for (name, v) in &loaded[0] {
        let own = &fresh.iter().find(|(n, _)| n == name).unwrap().1;
        let frozen = !name.starts_with("head") && !is_buffer(name);
        assert_eq!(
            frozen,
            v == own,
            "`{name}`: frozen parameters keep the model's values, the rest come from the checkpoint"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn state_dict_and_consolidate_give_files_varstore_load_reads() {
    let dir = std::env::temp_dir().join(format!("zerorun-state-dict-{}", std::process::id()));
    for (stage, frozen) in [(3u8, false), (2, true), (3, true)] {
        let ck = dir.join(format!("ck{stage}{frozen}"));
        let states = on_ranks(2, |comm| {
            let (vs, net) = build(11, frozen);
            let mut e = engine(&vs, &net, stage, comm, BufferSync::Broadcast);
            train(&mut e, &net, 3);
            e.save_checkpoint(&ck, None).unwrap();
            let sd = e.state_dict().unwrap();
            if e.rank() == 0 {
                Tensor::write_safetensors(&sd, dir.join("sd.safetensors")).unwrap();
            }
            values(&sd)
        });
        // state_dict: every variable, loadable by the user's own model.
        let (mut vs, _) = build(12, frozen);
        vs.load(dir.join("sd.safetensors")).unwrap();
        assert_eq!(snapshot(&vs), states[0], "stage {stage}, frozen {frozen}: state_dict");
        // consolidate: the same, from the checkpoint alone.
        let out = dir.join("consolidated.safetensors");
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .arg("consolidate")
            .arg(&ck)
            .arg(&out)
            .output()
            .unwrap();
        assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
        let (mut vs, _) = build(13, frozen);
        vs.load(&out).unwrap();
        assert_eq!(snapshot(&vs), states[0], "stage {stage}, frozen {frozen}: consolidate");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_frozen_backbone_is_untouched_identical_everywhere_and_sharded_at_stage_3() {
    let (rank0_vs, _) = build(100, true);
    let rank0 = snapshot(&rank0_vs);
    let backbone = |v: &[(String, Vec<f32>)]| {
        v.iter().filter(|(n, _)| !n.starts_with("head") && !is_buffer(n)).cloned().collect::<Vec<_>>()
    };
    for stage in 0..=3u8 {
        let runs = run(stage, 2, BufferSync::Broadcast, true);
        for (start, end) in &runs {
            assert_eq!(backbone(start), backbone(&rank0), "stage {stage}: the frozen backbone starts from rank 0's");
            assert_eq!(backbone(end), backbone(&rank0), "stage {stage}: the frozen backbone must not move");
        }
        let head =
            |v: &[(String, Vec<f32>)]| v.iter().filter(|(n, _)| n.starts_with("head")).cloned().collect::<Vec<_>>();
        assert_ne!(head(&runs[0].1), head(&rank0), "stage {stage}: the head trains");
    }
    // The memory report: frozen values by rank at stage 3 are this rank's shard (units padded to the world size).
    let frozen_numel: usize =
        rank0.iter().filter(|(n, _)| !n.starts_with("head") && !is_buffer(n)).map(|(_, v)| v.len()).sum();
    for world in [2usize, 3] {
        let reports = on_ranks(world, |comm| {
            let (vs, net) = build(100, true);
            let mut e = engine(&vs, &net, 3, comm, BufferSync::Broadcast);
            train(&mut e, &net, 2);
            e.memory_report()
        });
        for r in &reports {
            let frozen = r.categories["frozen_parameters"].current_bytes as usize;
            let share = frozen_numel * 4 / world;
            assert!(
                frozen >= share && frozen <= share + 2 * world * 4,
                "x{world}: frozen_parameters {frozen} vs share {share}"
            );
            assert_eq!(r.categories["buffers"].current_bytes, 4 * 4 * 4, "two BatchNorms of 4 channels, mean and var");
            let m = &r.model_states;
            let err = (m.measured_bytes as f64 - m.estimated_bytes as f64).abs() / m.estimated_bytes as f64;
            assert!(err < 0.1, "x{world}: measured {} vs estimated {}", m.measured_bytes, m.estimated_bytes);
        }
    }
}

#[test]
fn step_without_backward_is_an_error() {
    on_ranks(1, |comm| {
        let (vs, net) = build(1, false);
        let mut e = engine(&vs, &net, 1, comm, BufferSync::Broadcast);
        let err = e.step().unwrap_err().to_string();
        assert_eq!(err, "engine.step() at an accumulation boundary with no backward since the last step: there are no gradients to apply (call `engine.backward(&loss)` before `engine.step()`)");
        train(&mut e, &net, 1);
        assert!(e.step().is_err(), "a second step after the last backward");
        assert_eq!(e.global_steps(), 1);
    });
}

#[test]
fn a_direct_backward_in_a_plain_loop_is_not_mistaken_for_none() {
    on_ranks(1, |comm| {
        let (x, y) = data();
        let (vs, net) = build(1, false);
        let mut e = Engine::new(&vs, config(0, 1), Box::new(comm), EngineOptions::default()).unwrap();
        let h = (0..3).fold(x.narrow(0, 0, BATCH), |h, u| net.forward_unit(u, &h));
        h.cross_entropy_for_logits(&y.narrow(0, 0, BATCH)).backward();
        assert!(matches!(e.step().unwrap(), zerorun::StepOutcome::Stepped { .. }));
    });
}

#[test]
fn one_varstore_in_two_live_engines_is_an_error_two_varstores_are_fine() {
    let comms = threads::group(1, Duration::from_secs(10));
    let comm = comms.into_iter().next().unwrap();
    let (vs, net) = build(1, false);
    let first = engine(&vs, &net, 0, comm, BufferSync::Broadcast);
    let again = threads::group(1, Duration::from_secs(10)).pop().unwrap();
    let err = Engine::new(&vs, config(0, 1), Box::new(again), EngineOptions::default()).unwrap_err().to_string();
    assert!(
        err.starts_with("variable `")
            && err.ends_with("already belongs to a live zerorun engine: one VarStore, one engine (drop the first engine before wrapping its VarStore again; two models, as in a GAN, need two VarStores)"),
        "{err}"
    );
    // A second model on its own VarStore (a GAN's discriminator) is fine, and so is re-wrapping after a drop.
    let (vs2, net2) = build(2, false);
    let second =
        engine(&vs2, &net2, 0, threads::group(1, Duration::from_secs(10)).pop().unwrap(), BufferSync::Broadcast);
    drop(first);
    drop(second);
    let _again = engine(&vs, &net, 0, threads::group(1, Duration::from_secs(10)).pop().unwrap(), BufferSync::Broadcast);
}

#[test]
fn stage_3_without_units_is_refused_unless_the_model_stays_gathered() {
    let (vs, _) = build(1, false);
    let comm = threads::group(1, Duration::from_secs(10)).pop().unwrap();
    let err = Engine::new(&vs, config(3, 1), Box::new(comm), EngineOptions::default()).unwrap_err().to_string();
    assert!(err.starts_with("stage 3 partitions the parameters and gathers a unit's only while it runs, but the engine was built without the model's units: name them (`EngineOptions::units`, each unit's parameter-name prefixes) and enter each with `engine.unit(name, ..)`"), "{err}");
    assert!(err.contains("stage3_param_persistence_threshold = 0, under which the model would stay gathered"), "{err}");
    // Under the persistence threshold the model stays gathered and a plain loop works.
    let small = Config::from_value(json!({"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 3}})).unwrap();
    let comm = threads::group(1, Duration::from_secs(10)).pop().unwrap();
    assert!(Engine::new(&vs, small, Box::new(comm), EngineOptions::default()).is_ok());
}

#[test]
fn save_16bit_model_works_at_stage_2_with_units_and_holds_every_variable() {
    let path = std::env::temp_dir().join(format!("zerorun-16bit-{}.safetensors", std::process::id()));
    on_ranks(2, |comm| {
        let (vs, net) = build(4, true);
        let mut e = engine(&vs, &net, 2, comm, BufferSync::Broadcast);
        train(&mut e, &net, 2);
        e.save_16bit_model(&path).unwrap();
    });
    let (mut vs, _) = build(5, true);
    vs.load(&path).unwrap();
    let names: Vec<String> = snapshot(&vs).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), 14, "{names:?}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn load_mapped_reads_a_whole_model_tensor_by_tensor_and_names_what_differs() {
    let path = std::env::temp_dir().join(format!("zerorun-load-mapped-{}.safetensors", std::process::id()));
    let (vs, _) = build(21, true);
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&vars, &path).unwrap();
    let (other, _) = build(22, true);
    assert_ne!(snapshot(&other), snapshot(&vs));
    zerorun::runtime::engine::load_mapped(&other, &path).unwrap();
    assert_eq!(snapshot(&other), snapshot(&vs));
    // A model with another head: the first differing variable is named.
    let bigger = nn::VarStore::new(tch::Device::Cpu);
    let _ = nn::linear(bigger.root() / "head", 4, 3, Default::default());
    let e = zerorun::runtime::engine::load_mapped(&bigger, &path).unwrap_err().to_string();
    assert!(
        e.ends_with("the checkpoint does not match the model: `head.bias` is [2] in the file and [3] in the model"),
        "{e}"
    );
    let missing = nn::VarStore::new(tch::Device::Cpu);
    let _ = nn::linear(missing.root() / "tail", 4, 3, Default::default());
    let e = zerorun::runtime::engine::load_mapped(&missing, &path).unwrap_err().to_string();
    assert!(e.contains("tensor `tail.bias`"), "{e}");
    let _ = std::fs::remove_file(&path);
}
