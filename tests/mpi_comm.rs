//! The MPI backend under `mpirun -np 2/3/4` (as root: --allow-run-as-root; on small machines: --oversubscribe):
//! the same conformance suite as the other backends. Built with `--features mpi` (make test does).
#![cfg(feature = "mpi")]
use std::process::Command;
use std::time::Duration;

use zerorun::runtime::comm::env::communicator_from_env;

#[path = "common/conformance.rs"]
mod conformance;

#[test]
fn worker_entry() {
    if std::env::var("ZERORUN_TEST_WORKER").as_deref() == Ok("mpi-conformance") {
        let c = communicator_from_env(Duration::from_secs(120)).unwrap();
        conformance::run(c.as_ref());
    }
}

#[test]
fn mpi_conformance_at_world_sizes_2_to_4() {
    for n in 2..=4 {
        let out = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string(), "-x", "ZERORUN_TEST_WORKER"])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "worker_entry", "--nocapture", "--test-threads", "1"])
            .env("ZERORUN_TEST_WORKER", "mpi-conformance")
            .env_remove("ZERORUN_BACKEND")
            .output()
            .expect("mpirun (make setup installs openmpi-bin)");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "mpirun -np {n}:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        for r in 0..n {
            assert!(text.contains(&format!("conformance ok on rank {r}")), "-np {n}, rank {r}:\n{text}");
        }
    }
}
