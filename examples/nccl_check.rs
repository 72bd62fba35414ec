//! The NCCL backend's conformance on a GPU machine (scripts/gpu-check.sh runs it): every op and element type
//! through `ZERORUN_BACKEND=nccl`, checked against the local reference. Without a GPU it must fail with a clear
//! message (never a panic), which it prints.
use std::time::Duration;

use zerorun::runtime::comm::env::communicator_from_env;

#[path = "../tests/common/conformance.rs"]
mod conformance;

fn main() {
    std::env::set_var("ZERORUN_BACKEND", "nccl");
    match communicator_from_env(Duration::from_secs(120)) {
        Ok(c) => conformance::run(c.as_ref()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
