//! `zerorun config show`: exit codes, stdout and stderr as a user sees them.
use std::process::Command;

fn zerorun(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn show_resolves_every_shipped_config_as_json() {
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/configs")).unwrap() {
        let path = entry.unwrap().path();
        let (code, stdout, stderr) =
            zerorun(&["config", "show", path.to_str().unwrap(), "--world-size", "2", "--json"]);
        assert_eq!(code, 0, "{}: {stderr}", path.display());
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let (t, m, g) = (
            v["train_batch_size"].as_u64().unwrap(),
            v["train_micro_batch_size_per_gpu"].as_u64().unwrap(),
            v["gradient_accumulation_steps"].as_u64().unwrap(),
        );
        assert_eq!(t, m * g * 2, "{}", path.display());
        assert!(v["zero_optimization"]["overlap_comm"].is_boolean(), "defaults are filled in");
    }
}

#[test]
fn show_rejects_a_bad_key_by_name_on_stderr() {
    let dir = std::env::temp_dir().join(format!("zerorun-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"train_batch_size": 8, "zero_optimization": {"stgae": 2}}"#).unwrap();
    let (code, stdout, stderr) = zerorun(&["config", "show", bad.to_str().unwrap(), "--world-size", "2"]);
    assert_ne!(code, 0);
    assert!(stdout.is_empty(), "nothing on stdout: {stdout}");
    assert_eq!(stderr.trim(), "error: unknown key `zero_optimization.stgae`; did you mean `zero_optimization.stage`?");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn show_without_json_names_stage_and_precision() {
    let (code, stdout, _) = zerorun(&["config", "show", "configs/zero2_bf16.json", "--world-size", "3"]);
    assert_eq!(code, 0);
    assert!(stdout.starts_with("# configs/zero2_bf16.json resolved for world size 3: stage 2, bf16"), "{stdout}");
    let (code, _, stderr) = zerorun(&["config", "show", "configs/zero2.json", "--world-size", "0"]);
    assert_ne!(code, 0);
    assert_eq!(stderr.trim(), "error: --world-size must be >= 1");
}

/// The guide's configuration reference is what `zerorun config keys --markdown` prints (regenerate it with
/// `make docs`), and the JSON form lists the same keys.
#[test]
fn the_guides_config_reference_is_the_commands_output() {
    let (code, markdown, err) = zerorun(&["config", "keys", "--markdown"]);
    assert_eq!(code, 0, "{err}");
    let page = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/book/src/configuration/keys.md");
    let checked_in = std::fs::read_to_string(page).unwrap();
    assert!(
        checked_in == markdown,
        "{page} differs from `zerorun config keys --markdown`: run `make docs` (or redirect the command into it)"
    );
    let (code, json, err) = zerorun(&["config", "keys", "--json"]);
    assert_eq!(code, 0, "{err}");
    let keys: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    let rows = markdown.lines().filter(|l| l.starts_with("| `")).count();
    assert_eq!(keys.len(), rows);
    let stage = keys.iter().find(|k| k["path"] == "zero_optimization.stage").unwrap();
    assert_eq!(stage["status"], "acted");
    assert_eq!(stage["default"], 0);
    assert!(keys.iter().any(|k| k["status"] == "refused" && k["path"] == "aio.use_gds"));
}
