//! The NCCL backend's conformance on a GPU machine (scripts/gpu-check.sh runs it): every op and element type
//! through `ZERORUN_BACKEND=nccl`, checked against the local reference, on host buffers (staged) and on CUDA
//! tensors' device memory (the engine's path for a CUDA model). Without a GPU it must fail with a clear message
//! (never a panic), which it prints.
use std::time::Duration;

use zerorun::runtime::comm::env::communicator_from_env;

#[path = "../tests/common/conformance.rs"]
mod conformance;

fn main() {
    std::env::set_var("ZERORUN_BACKEND", "nccl");
    match communicator_from_env(Duration::from_secs(120)) {
        Ok(c) => {
            conformance::run(c.as_ref());
            device_memory(c.as_ref());
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

/// The four collectives on CUDA tensors through `*_device` (device pointers, no host copy), f32, bf16 and f16,
/// small integers so every reduction is exact; prints one line per op and kind.
fn device_memory(c: &dyn zerorun::runtime::comm::Communicator) {
    use tch::{Device, Kind, Tensor};
    use zerorun::runtime::comm::{DeviceBuf, Dtype, ReduceOp};
    let _ = zerorun::cuda::load();
    let Device::Cuda(device) = zerorun::local_device() else {
        println!("device_memory: no CUDA device; skipped");
        return;
    };
    let (rank, world) = (c.rank(), c.world_size());
    let n = 4 * world as i64;
    let part = n / world as i64;
    let buf = |t: &Tensor, dtype| DeviceBuf { ptr: t.data_ptr() as u64, count: t.numel(), dtype, device };
    let on = |kind| (kind, Device::Cuda(device));
    for (kind, dtype) in [(Kind::Float, Dtype::F32), (Kind::BFloat16, Dtype::Bf16), (Kind::Half, Dtype::F16)] {
        let host = |t: &Tensor| Vec::<f32>::try_from(&t.to_kind(Kind::Float).to_device(Device::Cpu)).unwrap();
        // all_reduce: every rank adds rank + 1.
        let t = Tensor::full([n], (rank + 1) as f64, on(kind));
        assert!(unsafe { c.all_reduce_device(buf(&t, dtype), ReduceOp::Sum) }.unwrap(), "NCCL took no device path");
        let expected = (world * (world + 1) / 2) as f32;
        assert!(host(&t).iter().all(|&v| v == expected), "all_reduce {kind:?}: {:?}", host(&t));
        // reduce_scatter: element i of rank r's input is i + r; rank r keeps part r summed.
        let input = (Tensor::arange(n, on(Kind::Float)) + rank as f64).to_kind(kind);
        let output = Tensor::zeros([part], on(kind));
        assert!(unsafe { c.reduce_scatter_device(buf(&input, dtype), buf(&output, dtype), ReduceOp::Sum) }.unwrap());
        let got = host(&output);
        for (j, v) in got.iter().enumerate() {
            let i = rank as i64 * part + j as i64;
            let want: i64 = (0..world as i64).map(|r| i + r).sum();
            assert_eq!(*v, want as f32, "reduce_scatter {kind:?} at {j}");
        }
        // all_gather in place: part r holds r + 1.
        let t = Tensor::zeros([n], on(kind));
        let _ = t.narrow(0, rank as i64 * part, part).fill_((rank + 1) as f64);
        assert!(unsafe { c.all_gather_device(buf(&t, dtype)) }.unwrap());
        let got = host(&t);
        for (i, v) in got.iter().enumerate() {
            assert_eq!(*v, (i as i64 / part + 1) as f32, "all_gather {kind:?} at {i}");
        }
        // broadcast from rank 0.
        let t = Tensor::full([n], (rank + 1) as f64, on(kind));
        assert!(unsafe { c.broadcast_device(buf(&t, dtype), 0) }.unwrap());
        assert!(host(&t).iter().all(|&v| v == 1.0), "broadcast {kind:?}");
        println!("device_memory {kind:?}: all_reduce, reduce_scatter, all_gather, broadcast ok");
    }
}
