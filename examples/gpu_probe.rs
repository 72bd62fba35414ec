//! Checks what the GPU work builds on: a binary built on a CPU machine against the venv's libtorch runs on a GPU
//! machine against the image's libtorch, sees CUDA through tch, runs libtorch's AdamW there, and the engine's
//! device-path optimizer (`DeviceOptimizer`: the fused kernel on device tensors) matches the host one.
//! Run by scripts/gpu-check.sh; prints one `key: value` line per fact. Without CUDA it checks the device path on
//! the CPU and exits 2.
use std::time::Instant;

use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() {
    // libtorch_cuda is loaded on demand (zerorun links none), before anything asks libtorch about CUDA.
    match zerorun::cuda::load() {
        Ok(()) => println!("cuda_backend_loaded: true"),
        Err(e) => println!("cuda_backend_loaded: false ({e})"),
    }
    println!("cuda_available: {}", tch::Cuda::is_available());
    println!("cuda_devices: {}", tch::Cuda::device_count());
    println!("cudnn_available: {}", tch::Cuda::cudnn_is_available());
    let d = if tch::Cuda::is_available() { Device::Cuda(0) } else { Device::Cpu };
    println!("device_adam_max_relative_difference ({d:?}): {:e}", device_adam_vs_host(d));
    if !tch::Cuda::is_available() {
        std::process::exit(2);
    }
    let a = Tensor::randn([4096, 4096], (Kind::BFloat16, d));
    let _ = a.matmul(&a);
    tch::Cuda::synchronize(0);
    let t = Instant::now();
    for _ in 0..10 {
        let _ = a.matmul(&a);
    }
    tch::Cuda::synchronize(0);
    let secs = t.elapsed().as_secs_f64() / 10.0;
    println!("bf16_matmul_4096_tflops: {:.1}", 2.0 * 4096f64.powi(3) / secs / 1e12);
    for n in [1i64 << 24, 1 << 27] {
        let vs = nn::VarStore::new(d);
        let p = vs.root().var("p", &[n], nn::Init::Const(0.5));
        let mut opt = nn::AdamW::default().build(&vs, 1e-3).unwrap();
        (&p * 0.01).sum(Kind::Float).backward();
        opt.step();
        tch::Cuda::synchronize(0);
        let t = Instant::now();
        for _ in 0..10 {
            opt.step();
        }
        tch::Cuda::synchronize(0);
        println!("libtorch_adamw_cuda_params_per_s_{n}: {:.3e}", n as f64 * 10.0 / t.elapsed().as_secs_f64());
    }
}

/// The engine's device-path Adam (states on `d`, the values staged through copies) against zerorun-optim's host
/// Adam over 1M elements in two groups and 5 steps: the largest difference relative to the values' scale.
fn device_adam_vs_host(d: Device) -> f64 {
    use zerorun::runtime::engine::device_optimizer::DeviceOptimizer;
    use zerorun_offload::OptimizerTier;
    use zerorun_optim::{Adam, AdamConfig, Grads, Group, Optimizer};
    let n = 1 << 20;
    let c = AdamConfig::default();
    let groups = vec![
        Group { range: 0..n / 2, lr: 1e-3, weight_decay: 0.01 },
        Group { range: n / 2..n, lr: 3e-4, weight_decay: 0.0 },
    ];
    let (mut host, mut device) = (Adam::new(c.clone(), n), DeviceOptimizer::adam(c, n, d).expect("Adam on the device"));
    let mut a: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) / 50.0).collect();
    let mut b = a.clone();
    for step in 0..5 {
        let g: Vec<f32> = (0..n).map(|i| (((i + step) % 31) as f32 - 15.0) / 10.0).collect();
        host.step(&mut a, Grads::F32(&g), &groups, None).expect("host step");
        device.step(&mut b, &g, &groups, None).expect("device step");
    }
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    a.iter().zip(&b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max) / scale
}
