//! Checks what issue 11 (GPUs) builds on: a binary built on a CPU machine against the venv's libtorch runs on a
//! GPU machine against the image's libtorch, sees CUDA through tch, and runs libtorch's AdamW there.
//! Run by scripts/gpu-check.sh; prints one `key: value` line per fact.
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
    if !tch::Cuda::is_available() {
        std::process::exit(2);
    }
    let d = Device::Cuda(0);
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
