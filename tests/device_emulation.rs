//! The device path on this CPU (`ZERORUN_DEVICE_EMULATION=1`): the engine's buffers taken through tensor ops
//! (norm, clipping, fp32 accumulation, host staging of collectives) and the optimizer step on libtorch's fused
//! Adam/AdamW with its states, master and gradients in tensors where the model is (`DeviceOptimizer`). The tier alone
//! matches zerorun-optim's Adam (both modes, amsgrad, groups of their own lr and decay, a step in pieces, its
//! states through a checkpoint); the engine under emulation at stages 0-3, fp32 and bf16, stage 3's optimizer in
//! backward, with CPU offload (host optimizer, device buffers), ends where the host path does and resumes from
//! its checkpoints; `cpu_checkpointing` sends checkpointed inputs to host memory and back. One test function: the
//! variable is the process's.
use serde_json::{json, Value};
use tch::Tensor;
use zerorun::runtime::comm::Communicator;
use zerorun::runtime::engine::device_optimizer::DeviceOptimizer;
use zerorun::{Config, Engine, EngineOptions};
use zerorun_offload::OptimizerTier;
use zerorun_optim::{Adam, AdamConfig, Grads, Group, Optimizer, Sgd, SgdConfig};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

#[path = "common/compare.rs"]
mod compare;
use compare::max_relative_difference;

fn relative(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6) as f64;
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max) / scale
}

/// The tier against zerorun-optim's Adam and SGD on the same values: 6 steps, two groups.
fn tier_matches_the_host_adam() {
    let n = 1000;
    let values: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0).collect();
    let groups = vec![
        Group { range: 0..600, lr: 1e-2, weight_decay: 0.1 },
        Group { range: 600..n, lr: 3e-3, weight_decay: 0.0 },
    ];
    for (adam_w_mode, amsgrad) in [(true, false), (false, false), (true, true)] {
        let c = AdamConfig { betas: (0.9, 0.99), eps: 1e-8, bias_correction: true, amsgrad, adam_w_mode };
        let (mut host, mut device) =
            (Adam::new(c.clone(), n), DeviceOptimizer::adam(c.clone(), n, tch::Device::Cpu).unwrap());
        let (mut a, mut b) = (values.clone(), values.clone());
        for step in 0..6 {
            let g: Vec<f32> = (0..n).map(|i| (((i + 7 * step) * 13 % 29) as f32 - 14.0) / 10.0).collect();
            host.step(&mut a, Grads::F32(&g), &groups, None).unwrap();
            if step == 3 {
                // A step in pieces (stage 3's optimizer in backward), across the groups' boundary.
                device.begin_step().unwrap();
                device.update_range(0..450, &mut b[..450], &g[..450], &groups, None).unwrap();
                device.update_range(450..n, &mut b[450..], &g[450..], &groups, None).unwrap();
            } else {
                device.step(&mut b, &g, &groups, None).unwrap();
            }
        }
        let d = relative(&b, &a);
        assert!(d < 1e-6, "adamw {adam_w_mode}, amsgrad {amsgrad}: {d:e}");
        assert_eq!(device.name(), host.name());
        // The states as a checkpoint stores them, back into a fresh tier: the next step is the same.
        let names = device.state_names();
        let mut saved: Vec<Vec<u8>> = vec![Vec::new(); names.len()];
        for (i, s) in saved.iter_mut().enumerate() {
            device.write_state(i, s).unwrap();
        }
        let mut again = DeviceOptimizer::adam(c, n, tch::Device::Cpu).unwrap();
        again
            .import_from(6, &mut |range, out| {
                for (o, s) in out.iter_mut().zip(&saved) {
                    o.copy_from_slice(&bytemuck::cast_slice::<u8, f32>(s)[range.clone()]);
                }
                Ok(())
            })
            .unwrap();
        let g = vec![0.25f32; n];
        let mut c1 = b.clone();
        device.step(&mut b, &g, &groups, None).unwrap();
        again.step(&mut c1, &g, &groups, None).unwrap();
        assert_eq!(b, c1, "resumed from its saved states");
    }
    // SGD as tensor ops against zerorun-optim's SGD: plain, momentum with dampening, Nesterov; weight decay in one
    // group; a cycled momentum from the fourth step.
    for c in [
        SgdConfig { momentum: 0.0, dampening: 0.0, nesterov: false },
        SgdConfig { momentum: 0.9, dampening: 0.1, nesterov: false },
        SgdConfig { momentum: 0.8, dampening: 0.0, nesterov: true },
    ] {
        let (mut host, mut device) =
            (Sgd::new(c.clone(), n), DeviceOptimizer::sgd(c.clone(), n, tch::Device::Cpu).unwrap());
        let (mut a, b) = (values.clone(), Tensor::from_slice(&values));
        for step in 0..6 {
            if step == 3 {
                host.set_momentum(0.7);
                device.set_momentum(0.7);
            }
            let g: Vec<f32> = (0..n).map(|i| (((i + 5 * step) * 11 % 23) as f32 - 11.0) / 10.0).collect();
            host.step(&mut a, Grads::F32(&g), &groups, None).unwrap();
            device.step_tensors(&b, &Tensor::from_slice(&g), &groups).unwrap();
        }
        let d = relative(&Vec::<f32>::try_from(&b).unwrap(), &a);
        assert!(d < 1e-6, "{c:?}: {d:e}");
        assert_eq!(
            (device.name(), device.state_names()),
            (
                host.name(),
                zerorun_offload::OptimizerTier::state_names(&zerorun_offload::InMemory(Box::new(Sgd::new(c, 1))))
            )
        );
    }
    let no_correction = AdamConfig { bias_correction: false, ..AdamConfig::default() };
    let e = DeviceOptimizer::adam(no_correction, 4, tch::Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("optimizer.params.bias_correction"), "{e}");
}

fn config(extra: Value) -> Config {
    let mut v = json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 4}},
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    Config::from_value(v).unwrap()
}

/// `ranks` thread ranks for `steps`, loading from / saving to a checkpoint; rank 0's parameters.
fn train(
    ranks: usize,
    c: &Config,
    steps: std::ops::Range<i64>,
    load: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
) -> Vec<(String, Vec<f32>)> {
    train_with(ranks, c, steps, load, save, false).0
}

/// [`train`], with activation checkpointing when `checkpointing`; also rank 0's bytes of checkpointed inputs
/// sent to host memory.
fn train_with(
    ranks: usize,
    c: &Config,
    steps: std::ops::Range<i64>,
    load: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
    checkpointing: bool,
) -> (Vec<(String, Vec<f32>)>, u64) {
    let bf16 = c.bf16.enabled;
    on_thread_ranks(ranks, |comm, x, y| {
        let rank = comm.rank();
        // One unit per layer: stage 3 gathers them one by one; other stages run them in order.
        let (mut vs, model) = init_layers(&[IN, HIDDEN, HIDDEN, OUT]);
        if bf16 {
            vs.bfloat16();
        }
        let options =
            EngineOptions { activation_checkpointing: checkpointing, ..EngineOptions::default().units_of(&model) };
        let mut engine = Engine::new(&vs, c.clone(), Box::new(comm), options).unwrap();
        if let Some(dir) = load {
            engine.load_checkpoint(dir, None).unwrap();
        }
        let micro = engine.batch_sizes().train_micro_batch_size_per_gpu as usize;
        let x = if bf16 { x.to_kind(tch::Kind::BFloat16) } else { x };
        for step in steps.clone() {
            let rows = batch_indices(step);
            let idx = tch::Tensor::from_slice(&rows[rank * micro..(rank + 1) * micro]);
            let pred = engine.forward(&model, &x.index_select(0, &idx)).unwrap().to_kind(tch::Kind::Float);
            let loss = pred.mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
            engine.backward_units(&model, &loss).unwrap();
            engine.step().unwrap();
        }
        if let Some(dir) = save {
            engine.save_checkpoint(dir, None).unwrap();
        }
        // Through the engine: at stage 3 the VarStore's tensors of a released unit hold no values (reading them is
        // an error naming the unit).
        (compare::full_parameters(&mut engine), engine.inputs_sent_to_host_bytes())
    })
    .swap_remove(0)
}

/// `activation_checkpointing.cpu_checkpointing` at stage 3: on the device path the checkpointed inputs of every
/// unit but the last go to host memory and come back for the recomputation (every micro-batch: the first two
/// units' inputs), and training is the same, bitwise, as with them kept where the model is; on a host run it has
/// no effect.
fn cpu_checkpointing_sends_the_checkpointed_inputs_to_host_memory() {
    let base = json!({"zero_optimization": {"stage": 3}});
    let mut offloaded = base.clone();
    offloaded["activation_checkpointing"] = json!({"partition_activations": true, "cpu_checkpointing": true});
    let (kept, to_host) = (config(base), config(offloaded));
    let steps = 0..6;
    let (reference, none) = with_emulation(true, || train_with(3, &kept, steps.clone(), None, None, true));
    assert_eq!(none, 0, "without cpu_checkpointing nothing goes to host memory");
    let (moved, sent) = with_emulation(true, || train_with(3, &to_host, steps.clone(), None, None, true));
    assert_eq!(moved, reference, "the inputs that went to host memory and back recompute the same units");
    let micro = (GLOBAL_BATCH / 3) as u64;
    assert_eq!(sent, steps.end as u64 * micro * (IN + HIDDEN) as u64 * 4, "units 0 and 1's inputs, every step");
    let (_, on_host_run) = with_emulation(false, || train_with(3, &to_host, steps.clone(), None, None, true));
    assert_eq!(on_host_run, 0, "a host run keeps its inputs where they are");
}

fn with_emulation<R>(on: bool, f: impl FnOnce() -> R) -> R {
    std::env::set_var("ZERORUN_DEVICE_EMULATION", if on { "1" } else { "0" });
    let r = f();
    std::env::remove_var("ZERORUN_DEVICE_EMULATION");
    r
}

#[test]
fn the_device_path_steps_checkpoints_and_trains_as_the_host_path() {
    tier_matches_the_host_adam();
    cpu_checkpointing_sends_the_checkpointed_inputs_to_host_memory();
    let steps = 0..8;
    let nvme = std::env::temp_dir().to_string_lossy().into_owned();
    for (stage, extra) in [
        (0, json!({})),
        (1, json!({})),
        (2, json!({"bf16": {"enabled": true}})),
        (2, json!({})),
        (3, json!({})),
        (3, json!({"bf16": {"enabled": true}})),
        (3, json!({"optimizer_in_backward": true, "gradient_clipping": 0.0})),
        (2, json!({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})),
        (
            3,
            json!({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}),
        ),
        // max_in_cpu 0: every chunk in a swap file, read through the swap buffers.
        (
            3,
            json!({"zero_optimization": {"stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": nvme.clone(), "max_in_cpu": 0}}}),
        ),
        (
            3,
            json!({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": nvme.clone()}}}),
        ),
    ] {
        let mut e = extra.clone();
        if e.get("zero_optimization").is_none() {
            e["zero_optimization"] = json!({"stage": stage});
        }
        let c = config(e);
        let host = with_emulation(false, || train(3, &c, steps.clone(), None, None));
        let device = with_emulation(true, || train(3, &c, steps.clone(), None, None));
        let d = max_relative_difference(&device, &host);
        let bound = if c.bf16.enabled { 1e-2 } else { 1e-5 };
        assert!(d < bound, "stage {stage} {extra}: device path {d:e} from the host path");
        // Saved halfway under emulation and resumed: where the uninterrupted emulated run ends.
        let dir = std::env::temp_dir().join(format!("zerorun-emulation-{}-{stage}", std::process::id()));
        let resumed = with_emulation(true, || {
            train(3, &c, 0..4, None, Some(&dir));
            train(2, &c, 4..8, Some(&dir), None)
        });
        std::fs::remove_dir_all(&dir).unwrap();
        let d = max_relative_difference(&resumed, &device);
        assert!(d < bound, "stage {stage} {extra}: resumed at 2 ranks {d:e} from the uninterrupted run");
    }
    // Another optimizer on the device path is refused by name; with its states offloaded it steps on the host.
    let lion = json!({"type": "Lion", "params": {"lr": 1e-3}});
    let refused = with_emulation(true, || {
        let c = config(json!({"optimizer": lion.clone(), "zero_optimization": {"stage": 1}}));
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let _m = mlp(vs.root());
        let comm = zerorun::runtime::comm::threads::group(1, std::time::Duration::from_secs(10)).pop().unwrap();
        Engine::new(&vs, c, Box::new(comm), EngineOptions::default()).unwrap_err().to_string()
    });
    assert!(
        refused.contains("optimizer.type") && refused.contains("Adam/AdamW (libtorch's fused kernels) or SGD"),
        "{refused}"
    );
}
