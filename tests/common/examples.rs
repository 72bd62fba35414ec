//! The examples as programs: `cargo test --all-targets` builds them as test harnesses only, so a test that runs
//! one builds it here first (the test's profile and target folder).
use std::path::PathBuf;
use std::process::Command;

/// Builds example `name` and returns its executable.
pub fn example(name: &str) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "--example", name])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success(), "cargo build --example {name} failed");
    std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().join("examples").join(name)
}
