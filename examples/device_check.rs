//! The engine with its model on a device against the same run on the host: one small MLP (a unit per layer),
//! trained 6 steps by thread ranks sharing the device (collectives staged through host memory), at stages 0-3,
//! fp32 and bf16, with CPU offload of the optimizer and of the parameters, and stage 3's optimizer in backward.
//! Prints one Markdown table (the max relative difference of rank 0's weights from the host run, and the CUDA
//! allocator's peak) and exits 0 when every row is within its bound, 1 otherwise.
//!
//! Run by scripts/gpu-check.sh on the GPU machine. Without CUDA it runs the same table with the device path
//! emulated on the CPU (`ZERORUN_DEVICE_EMULATION=1`: the engine's tensor paths on CPU tensors) and exits 2 when
//! every row passes, so `make test` runs it too.
//!
//! Under `zerorun launch` (RANK set) it is one rank of a job instead: the processes share the GPU (each
//! `zerorun::local_device()`, LOCAL_RANK modulo the GPUs) and reduce through the launcher's backend (shm: host
//! staged), at stage 3; rank 0 prints one row against the same run by thread ranks on the host.
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions};

// The engine tests' MLP (a unit per layer), its data and its batches.
#[path = "../tests/common/mlp.rs"]
mod mlp;
use mlp::{batch_indices, data, init_layers, Layers, GLOBAL_BATCH, HIDDEN, IN, OUT, SAMPLES};

const STEPS: i64 = 6;

/// Every rank's model from the tests' seed on the CPU (the generator's values do not depend on the device), then
/// moved to `device`.
fn model(device: Device) -> (tch::nn::VarStore, Layers) {
    let (mut vs, layers) = init_layers(&[IN, HIDDEN, HIDDEN, OUT]);
    vs.set_device(device);
    (vs, layers)
}

fn config(ranks: usize, extra: &Value) -> Config {
    let mut v = json!({
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH as usize / ranks,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    Config::from_value(v).unwrap()
}

type Weights = Vec<(String, Vec<f32>)>;

/// One rank of `ranks` training on `device` through `comm`: its weights by name, on the host, and the CUDA
/// allocator's peak there.
fn run_rank(
    comm: Box<dyn zerorun::runtime::comm::Communicator>,
    ranks: usize,
    device: Device,
    c: &Config,
    (xv, yv): (&[f32], &[f32]),
) -> (Weights, Option<u64>) {
    let rank = comm.rank();
    let bf16 = c.bf16.enabled;
    let (mut vs, layers) = model(device);
    if bf16 {
        vs.bfloat16();
    }
    let options = EngineOptions::default().units_of(&layers);
    let mut engine = Engine::new(&vs, c.clone(), comm, options).unwrap();
    let kind = if bf16 { Kind::BFloat16 } else { Kind::Float };
    let x = Tensor::from_slice(xv).view([SAMPLES, IN]).to_device(device).to_kind(kind);
    let y = Tensor::from_slice(yv).view([SAMPLES, OUT]).to_device(device);
    let micro = GLOBAL_BATCH as usize / ranks;
    for step in 0..STEPS {
        let rows = batch_indices(step);
        let idx = Tensor::from_slice(&rows[rank * micro..(rank + 1) * micro]).to_device(device);
        let pred = engine.forward(&layers, &x.index_select(0, &idx)).unwrap();
        let loss = pred.to_kind(Kind::Float).mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
        engine.backward_units(&layers, &loss).unwrap();
        engine.step().unwrap();
    }
    let peak = zerorun::cuda::device_memory(device).map(|m| m.allocated_peak);
    // Through the engine (collective): at stage 3 a released unit's tensors in the VarStore hold no values.
    let mut weights: Weights = engine
        .full_parameters()
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(&t.to_kind(Kind::Float).to_device(Device::Cpu).view([-1])).unwrap()))
        .collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    (weights, peak)
}

/// Rank 0's weights after `ranks` thread ranks trained on `device`, and the allocator's peak there during this
/// run (all ranks together: they share the device).
fn train(device: Device, ranks: usize, c: &Config) -> (Weights, Option<u64>) {
    zerorun::cuda::reset_peak(device);
    let (xv, yv) = data();
    let comms = threads::group(ranks, std::time::Duration::from_secs(60));
    let mut out: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (xv, yv) = (&xv, &yv);
                s.spawn(move || run_rank(Box::new(comm), ranks, device, c, (xv, yv)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    out.swap_remove(0)
}

/// One rank with NCCL on the GPU: its collectives on the tensors' device memory.
#[cfg(feature = "nccl")]
fn train_nccl(device: Device, c: &Config) -> (Weights, Option<u64>) {
    let Device::Cuda(index) = device else { unreachable!("NCCL runs on a CUDA device") };
    let id = zerorun::runtime::comm::nccl::unique_id().unwrap();
    let comm = zerorun::runtime::comm::nccl::NcclComm::new(index, 0, 1, id).unwrap();
    let (xv, yv) = data();
    zerorun::cuda::reset_peak(device);
    run_rank(Box::new(comm), 1, device, c, (&xv, &yv))
}

fn max_relative_difference(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f64 {
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| {
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6) as f64;
            x.iter().zip(y).map(|(p, q)| (p - q).abs() as f64).fold(0.0, f64::max) / scale
        })
        .fold(0.0, f64::max)
}

fn set_emulation(on: bool) {
    std::env::set_var("ZERORUN_DEVICE_EMULATION", if on { "1" } else { "0" });
}

/// One rank of a launched job (see the module's doc): stage 3, fp32.
fn launched() -> i32 {
    let _ = zerorun::cuda::load();
    let cuda = zerorun::cuda::available();
    let device = if cuda { zerorun::local_device() } else { Device::Cpu };
    set_emulation(!cuda);
    let comm = zerorun::communicator_from_env(std::time::Duration::from_secs(120)).unwrap();
    let (rank, ranks) = (comm.rank(), comm.world_size());
    let c = config(ranks, &json!({"zero_optimization": {"stage": 3}}));
    let (xv, yv) = data();
    let (on_device, peak) = run_rank(comm, ranks, device, &c, (&xv, &yv));
    if rank != 0 {
        return 0;
    }
    set_emulation(false);
    let (host, _) = train(Device::Cpu, ranks, &c);
    let d = max_relative_difference(&on_device, &host);
    let peak = peak.map_or("-".into(), |b| format!("{:.2} MiB", b as f64 / (1 << 20) as f64));
    let verdict = if d < 1e-5 { "" } else { " FAILED" };
    println!("| stage 3, {ranks} processes ({}) | {ranks} | {d:.2e}{verdict} | 1e-5 | {peak} |", zerorun_backend());
    i32::from(d >= 1e-5)
}

fn zerorun_backend() -> String {
    std::env::var("ZERORUN_BACKEND").unwrap_or_else(|_| "shm".into())
}

fn main() {
    if std::env::var_os("RANK").is_some() {
        std::process::exit(launched());
    }
    let _ = zerorun::cuda::load();
    let cuda = zerorun::cuda::available();
    let device = if cuda { zerorun::local_device() } else { Device::Cpu };
    let cases: [(&str, usize, Value); 10] = [
        ("stage 0, fp32", 1, json!({"zero_optimization": {"stage": 0}})),
        ("stage 1, fp32", 2, json!({"zero_optimization": {"stage": 1}})),
        ("stage 2, fp32", 2, json!({"zero_optimization": {"stage": 2}})),
        ("stage 3, fp32", 2, json!({"zero_optimization": {"stage": 3}})),
        ("stage 2, bf16", 2, json!({"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}})),
        ("stage 3, bf16", 2, json!({"zero_optimization": {"stage": 3}, "bf16": {"enabled": true}})),
        (
            "stage 2, optimizer offloaded to cpu",
            2,
            json!({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),
        ),
        (
            "stage 3, optimizer and parameters offloaded to cpu",
            2,
            json!({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}),
        ),
        (
            "stage 3, parameters on NVMe (max_in_cpu 0)",
            2,
            json!({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": std::env::temp_dir(), "max_in_cpu": 0}}}),
        ),
        (
            "stage 3, optimizer in backward",
            2,
            json!({"zero_optimization": {"stage": 3}, "optimizer_in_backward": true, "gradient_clipping": 0.0}),
        ),
    ];
    let place = if cuda { format!("{device:?}") } else { "CPU, device path emulated".into() };
    println!("| case ({place} vs the host) | ranks | max relative difference | bound | CUDA allocated peak |");
    println!("|---|---|---|---|---|");
    let mut failed = 0;
    for (name, ranks, extra) in cases {
        let c = config(ranks, &extra);
        set_emulation(false);
        let (host, _) = train(Device::Cpu, ranks, &c);
        set_emulation(!cuda);
        let (on_device, peak) = train(device, ranks, &c);
        set_emulation(false);
        let d = max_relative_difference(&on_device, &host);
        let bound = if c.bf16.enabled { 1e-2 } else { 1e-5 };
        let verdict = if d < bound { "" } else { " FAILED" };
        failed += (d >= bound) as usize;
        let peak = peak.map_or("-".into(), |b| format!("{:.2} MiB", b as f64 / (1 << 20) as f64));
        println!("| {name} | {ranks} | {d:.2e}{verdict} | {bound:e} | {peak} |");
    }
    #[cfg(feature = "nccl")]
    if cuda {
        // NCCL at world size 1 on the tensors' device memory (`views.rs` hands NCCL the pointers).
        let c = config(1, &json!({"zero_optimization": {"stage": 2}}));
        let (host, _) = train(Device::Cpu, 1, &c);
        let (on_device, peak) = train_nccl(device, &c);
        let d = max_relative_difference(&on_device, &host);
        failed += (d >= 1e-5) as usize;
        let verdict = if d < 1e-5 { "" } else { " FAILED" };
        let peak = peak.map_or("-".into(), |b| format!("{:.2} MiB", b as f64 / (1 << 20) as f64));
        println!("| stage 2, NCCL on device memory | 1 | {d:.2e}{verdict} | 1e-5 | {peak} |");
    }
    println!("device_check_failed_rows: {failed}");
    std::process::exit(if failed > 0 {
        1
    } else if cuda {
        0
    } else {
        2
    });
}
