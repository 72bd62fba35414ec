//! A program in a crate of its own, outside this workspace, written from the README alone: the files of the
//! README's "A crate of your own" (`<!-- user-crate:PATH -->` before each block), with `/path/to/zerorun` replaced
//! by this checkout, build offline and run without LD_LIBRARY_PATH, alone and under `zerorun launch`.
use std::path::{Path, PathBuf};
use std::process::Command;

/// The README's blocks marked `<!-- user-crate:PATH -->`, as (PATH, text).
fn readme_files(readme: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = readme;
    while let Some(at) = rest.find("<!-- user-crate:") {
        rest = &rest[at + "<!-- user-crate:".len()..];
        let path = rest[..rest.find(" -->").expect("marker ends")].to_string();
        let open = rest.find("```").expect("a code block follows the marker");
        let body_start = open + rest[open..].find('\n').expect("fence line") + 1;
        let body_len = rest[body_start..].find("```").expect("the block closes");
        out.push((path, rest[body_start..body_start + body_len].to_string()));
        rest = &rest[body_start + body_len..];
    }
    out
}

/// A command with none of the environment this test runs in that would help it: no cargo variables from the
/// outer `cargo test`, no LIBTORCH, no library path.
fn clean(mut cmd: Command) -> Command {
    for (k, _) in std::env::vars() {
        let cargo_own = k.starts_with("CARGO_") && k != "CARGO_HOME";
        if cargo_own || k.starts_with("LIBTORCH") || k == "LD_LIBRARY_PATH" || k == "RUSTFLAGS" {
            cmd.env_remove(&k);
        }
    }
    cmd
}

#[test]
fn a_crate_of_its_own_builds_from_the_readme_and_runs_without_ld_library_path() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let files = readme_files(&readme);
    let names: Vec<&str> = files.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(names, ["Cargo.toml", ".cargo/config.toml", "build.rs", "src/main.rs"]);
    // Outside the workspace (a crate under it would belong to it); the same directory every run, so cargo's
    // build of it is incremental after the first.
    // One directory per checkout (two checkouts' test runs must not write each other's crate).
    let checkout = {
        use std::hash::{Hash, Hasher};
        let mut h = std::hash::DefaultHasher::new();
        root.hash(&mut h);
        h.finish()
    };
    let dir = std::env::temp_dir().join(format!("zerorun-user-crate-{checkout:016x}"));
    for (path, text) in &files {
        let file = dir.join(path);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, text.replace("/path/to/zerorun", root.to_str().unwrap())).unwrap();
    }
    // The same versions as this workspace: the build is offline, from what is in cargo's cache already.
    std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    let target: PathBuf = root.join("target").join("user-crate");
    let mut build = clean(Command::new(env!("CARGO")));
    build.args(["build", "--offline", "--quiet"]).current_dir(&dir).env("CARGO_TARGET_DIR", &target);
    let out = build.output().unwrap();
    assert!(out.status.success(), "the crate does not build:\n{}", String::from_utf8_lossy(&out.stderr));
    let program = target.join("debug").join("my-trainer");

    let out = clean(Command::new(&program)).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.lines().filter(|l| l.starts_with("rank 0 of 1: step ")).count(), 4, "{stdout}");

    let mut launch = clean(Command::new(env!("CARGO_BIN_EXE_zerorun")));
    launch.args(["launch", "--nproc-per-node", "2", "--"]).arg(&program);
    let out = launch.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for rank in 0..2 {
        let steps = stdout.lines().filter(|l| l.contains(&format!("rank {rank} of 2: step "))).count();
        assert_eq!(steps, 4, "rank {rank} under zerorun launch: {stdout}");
    }
}
