//! The NCCL backend (feature `nccl`) on a machine without a GPU: a clear error naming what is missing, never a
//! panic. (On a GPU machine scripts/gpu-check.sh runs the full conformance suite through it.)
#![cfg(feature = "nccl")]
use std::time::Duration;

use zerorun::runtime::comm::env::communicator_from_env;

#[test]
fn without_a_gpu_nccl_is_a_clear_error() {
    std::env::set_var("ZERORUN_BACKEND", "nccl");
    let has_driver = ["libcuda.so", "libcuda.so.1"]
        .iter()
        .any(|l| std::path::Path::new("/usr/lib/x86_64-linux-gnu").join(l).exists());
    match communicator_from_env(Duration::from_secs(5)) {
        Err(e) if !has_driver => {
            assert_eq!(
                e.to_string(),
                "rendezvous of rank 0 of 1 at NCCL: no CUDA driver (libcuda.so) on this machine: NCCL needs a GPU"
            )
        }
        Err(e) => assert!(e.to_string().contains("NCCL"), "{e}"),
        Ok(c) => assert_eq!(c.world_size(), 1),
    }
}
