//! Watching a run (guide: "Watching a run"): DeepSpeed's monitors read back by PyPI `tensorboard`'s
//! EventAccumulator and as CSV, equal to the step lines at step = samples seen; a run killed mid-way leaves readable
//! files; the communication logger's bytes per step at stage 3 are the ZeRO arithmetic; the held-out loss is the
//! same at every stage; the HTML memory report renders in headless Chromium with every category named.
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Value};

#[path = "common/examples.rs"]
mod examples;

fn venv_python() -> PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(python.is_file(), "{} (make setup installs torch and tensorboard there)", python.display());
    python
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zerorun-monitors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_config(dir: &Path, config: &Value) -> PathBuf {
    let path = dir.join("ds_config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

/// The GPT example's model for these tests: 2 x 32, 2 heads, block 16.
const SMALL_GPT: [&str; 8] = ["--layers", "2", "--embd", "32", "--heads", "2", "--block", "16"];

/// A small GPT run of the example (`--ranks` thread ranks), its stdout.
fn gpt(config: &Path, cwd: &Path, extra: &[&str]) -> String {
    gpt_sized(config, cwd, &SMALL_GPT, extra)
}

/// [`gpt`] with the model's size flags given.
fn gpt_sized(config: &Path, cwd: &Path, model: &[&str], extra: &[&str]) -> String {
    let out = Command::new(examples::example("gpt"))
        .args(["--config", config.to_str().unwrap()])
        .args(model)
        .args(extra)
        .current_dir(cwd)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    text
}

/// `step N loss X` lines: (N, X).
fn step_losses(text: &str) -> Vec<(u64, f64)> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "step").then_some(())?;
            let n = w.next()?.parse().ok()?;
            (w.next()? == "loss").then_some(())?;
            Some((n, w.next()?.parse().ok()?))
        })
        .collect()
}

/// Every scalar tag of the run folder as EventAccumulator reads it: tag -> [(step, value)].
fn tensorboard_scalars(dir: &Path) -> serde_json::Map<String, Value> {
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"#;
    let out = Command::new(venv_python()).args(["-c", script, dir.to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str::<Value>(text.lines().last().unwrap()).unwrap().as_object().unwrap().clone()
}

fn series(scalars: &serde_json::Map<String, Value>, tag: &str) -> Vec<(u64, f64)> {
    let v = scalars.get(tag).unwrap_or_else(|| panic!("no {tag} among {:?}", scalars.keys().collect::<Vec<_>>()));
    v.as_array().unwrap().iter().map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap())).collect()
}

#[test]
fn tensorboard_and_csv_hold_deepspeeds_tags_at_steps_of_samples_equal_to_the_step_lines() {
    let dir = temp_dir("tb");
    let config = json!({
        "train_batch_size": 8,
        "wall_clock_breakdown": true,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 3},
        "tensorboard": {"enabled": true, "output_path": "logs", "job_name": "tb"},
        "csv_monitor": {"enabled": true, "output_path": "logs", "job_name": "csv"},
    });
    let cfg = write_config(&dir, &config);
    let text = gpt(&cfg, &dir, &["--ranks", "2", "--steps", "6", "--val-fraction", "0.1", "--eval-every", "3"]);
    let lines = step_losses(&text);
    assert_eq!(lines.len(), 6, "{text}");
    // Rank 0 alone writes: one event file.
    let files: Vec<_> = std::fs::read_dir(dir.join("logs/tb")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].to_string_lossy().starts_with("events.out.tfevents."), "{files:?}");
    let tb = tensorboard_scalars(&dir.join("logs/tb"));
    let loss = series(&tb, "Train/Samples/train_loss");
    assert_eq!(loss.len(), 6);
    for ((step, value), (n, printed)) in loss.iter().zip(&lines) {
        assert_eq!(*step, n * 8, "step = samples seen");
        assert!((value - printed).abs() <= 1e-5, "step {n}: tensorboard {value} vs printed {printed}");
    }
    // The lr each step used: DeepSpeed's linear WarmupLR over 4 iterations (iteration -1 and 0 at 0, then 1/4,
    // 2/4, 3/4 of 0.003, then 0.003).
    let lr: Vec<f64> = series(&tb, "Train/Samples/lr").iter().map(|p| p.1).collect();
    for (got, want) in lr.iter().zip([0.0, 0.0, 0.00075, 0.0015, 0.00225, 0.003]) {
        assert!((got - want).abs() <= 1e-7, "lr {lr:?}");
    }
    for tag in ["forward", "backward", "backward_inner", "backward_allreduce", "step"] {
        let s = series(&tb, &format!("Train/Samples/elapsed_time_ms_{tag}"));
        assert!(s.len() == 6 && s.iter().all(|p| p.1 >= 0.0), "{tag}: {s:?}");
    }
    // zerorun's own beside them; eval_loss at the evaluations (steps 3 and 6), equal to the printed lines.
    for tag in [
        "Train/Samples/grad_norm",
        "Train/Samples/tokens_per_s",
        "Train/Samples/mfu",
        "Memory/peak_rss_bytes",
        "Memory/parameters",
    ] {
        assert_eq!(series(&tb, tag).len(), 6, "{tag}");
    }
    // MFU against the rank's measured matmul peak: a share, above 0 (the example gives PaLM's FLOPs per token).
    assert!(
        series(&tb, "Train/Samples/mfu").iter().all(|p| p.1 > 0.0 && p.1 < 2.0),
        "{:?}",
        tb.get("Train/Samples/mfu")
    );
    let eval = series(&tb, "Train/Samples/eval_loss");
    let printed: Vec<f64> =
        text.lines().filter_map(|l| l.split(" val loss ").nth(1).map(|v| v.trim().parse().unwrap())).collect();
    assert_eq!(eval.iter().map(|p| p.0).collect::<Vec<_>>(), vec![24, 48]);
    for (e, p) in eval.iter().zip(&printed) {
        assert!((e.1 - p).abs() <= 1e-4, "eval {eval:?} vs printed {printed:?}");
    }
    // CSV: DeepSpeed's file names and header, the same rows.
    let csv = std::fs::read_to_string(dir.join("logs/csv/Train_Samples_train_loss.csv")).unwrap();
    let mut rows = csv.lines();
    assert_eq!(rows.next(), Some("step,train_loss"));
    for (row, (n, printed)) in rows.zip(&lines) {
        let (step, value) = row.split_once(',').unwrap();
        assert_eq!(step.parse::<u64>().unwrap(), n * 8);
        assert!((value.parse::<f64>().unwrap() - printed).abs() <= 1e-5, "{row}");
    }
    let lr_csv = std::fs::read_to_string(dir.join("logs/csv/Train_Samples_lr.csv")).unwrap();
    assert!(lr_csv.starts_with("step,lr\n8,0\n16,0\n24,0.00075\n32,0.0015\n"), "{lr_csv}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_killed_mid_way_leaves_readable_event_and_csv_files() {
    let dir = temp_dir("kill");
    let config = json!({
        "train_batch_size": 4,
        "zero_optimization": {"stage": 2},
        "tensorboard": {"enabled": true, "output_path": dir.join("logs"), "job_name": "run"},
        "csv_monitor": {"enabled": true, "output_path": dir.join("logs"), "job_name": "run"},
    });
    let cfg = write_config(&dir, &config);
    let mut child = Command::new(examples::example("gpt"))
        .args(["--config", cfg.to_str().unwrap()])
        .args(SMALL_GPT)
        .args(["--steps", "100000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    use std::io::BufRead;
    let mut seen = 0;
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        if line.unwrap().starts_with("step ") {
            seen += 1;
            if seen == 12 {
                break;
            }
        }
    }
    child.kill().unwrap(); // SIGKILL: nothing is flushed on the way out
    child.wait().unwrap();
    let tb = tensorboard_scalars(&dir.join("logs/run"));
    let steps = series(&tb, "Train/Samples/train_loss");
    assert!(steps.len() >= 11, "at most the step being written is lost: {} of 12", steps.len());
    for (i, (step, _)) in steps.iter().enumerate() {
        assert_eq!(*step, (i as u64 + 1) * 4);
    }
    let csv = std::fs::read_to_string(dir.join("logs/run/Train_Samples_train_loss.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert!(rows.len() >= 11, "{csv}");
    assert!(rows.iter().all(|r| r.split(',').count() == 2 && r.split(',').all(|f| f.parse::<f64>().is_ok())), "{csv}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn comms_logger_bytes_per_step_at_stage_3_are_three_times_the_parameters_over_the_ranks() {
    let dir = temp_dir("comms");
    // No persistent parameter and no unit kept from forward for backward beyond the last (always kept: backward
    // starts with it): every other unit gathered in forward and in backward, every unit reduce-scattered once.
    let config = json!({
        "train_batch_size": 8,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
        "comms_logger": {"enabled": true},
    });
    let cfg = write_config(&dir, &config);
    let steps = 2;
    let model = ["--layers", "4", "--embd", "128", "--heads", "4", "--block", "16"];
    let text = gpt_sized(&cfg, &dir, &model, &["--ranks", "2", "--steps", &steps.to_string()]);
    let line = text.lines().find(|l| l.starts_with("bus bytes per optimizer step")).unwrap_or_else(|| panic!("{text}"));
    let bytes: f64 = line.split(": ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    let params: f64 = text
        .lines()
        .find_map(|l| l.split(" parameters,").next().filter(|_| l.starts_with("summary:")))
        .and_then(|s| s.rsplit(", ").next())
        .unwrap()
        .parse()
        .unwrap();
    let want = 3.0 * params * 4.0 * (2.0 - 1.0) / 2.0;
    assert!(
        (bytes - want).abs() / want <= 0.01,
        "{bytes} bytes per step, the arithmetic {want} ({params} fp32 parameters)\n{text}"
    );
    // Exactly: the rows' counts per step are 2 gathers of every unit but the last (1) and 1 reduce-scatter each.
    let rows: Vec<(String, f64, u64)> = text
        .lines()
        .skip_while(|l| !l.starts_with("Comm. Op"))
        .skip(1)
        .take_while(|l| !l.starts_with("bus bytes"))
        .scan(String::new(), |op, l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let (name, rest) = if l.starts_with(' ') { (op.clone(), &w[..]) } else { (w[0].to_string(), &w[1..]) };
            *op = name.clone();
            let unit = match rest[1] {
                "B" => 1.0,
                "KB" => 1024.0,
                "MB" => 1048576.0,
                u => panic!("{u}"),
            };
            Some((name, rest[0].parse::<f64>().unwrap() * unit, rest[3].parse().unwrap()))
        })
        .collect();
    let gathers: Vec<u64> = rows.iter().filter(|r| r.0 == "all_gather").map(|r| r.2 / steps).collect();
    let scatters: Vec<u64> = rows.iter().filter(|r| r.0 == "reduce_scatter").map(|r| r.2 / steps).collect();
    assert!(scatters.iter().all(|c| *c == 1 || *c == 4), "one reduce-scatter per unit and step: {rows:?}");
    assert_eq!(gathers.iter().filter(|c| **c == 1).count(), 1, "the last unit, kept: {rows:?}");
    for op in ["all_gather", "reduce_scatter", "all_reduce"] {
        assert!(rows.iter().any(|r| r.0 == op), "{op} row\n{text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_held_out_loss_is_the_same_at_every_stage_and_scoped() {
    let dir = temp_dir("eval");
    let val = |stage: u8, extra: &[&str]| -> Vec<String> {
        let cfg = write_config(&dir, &json!({"train_batch_size": 8, "zero_optimization": {"stage": stage}}));
        let text = gpt(&cfg, &dir, &[&["--steps", "4", "--val-fraction", "0.1", "--eval-every", "2"], extra].concat());
        text.lines().filter(|l| l.contains(" val loss ")).map(str::to_string).collect()
    };
    let reference = val(0, &["--ranks", "1"]);
    assert_eq!(reference.len(), 2, "{reference:?}");
    assert!(reference[0].starts_with("step 2 val loss ") && reference[1].starts_with("step 4 val loss "));
    for (stage, extra) in [(1, &["--ranks", "2"][..]), (3, &["--ranks", "2"]), (3, &["--ranks", "2", "--scoped"])] {
        assert_eq!(val(stage, extra), reference, "stage {stage} {extra:?}");
    }
    let err = Command::new(examples::example("gpt"))
        .args(["--config", write_config(&dir, &json!({"train_batch_size": 8})).to_str().unwrap(), "--eval-every", "2"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&err.stderr).contains("--eval-every needs a held-out part"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_html_memory_report_renders_in_headless_chromium_with_every_category_named() {
    let dir = temp_dir("html");
    let cfg = write_config(&dir, &json!({"train_batch_size": 8, "zero_optimization": {"stage": 3}}));
    let zr = env!("CARGO_BIN_EXE_zerorun");
    let out = Command::new(zr)
        .args(["launch", "--nproc-per-node", "2", "--memory-report"])
        .arg(dir.join("report"))
        .arg("--")
        .arg(examples::example("gpt"))
        .args([
            "--config",
            cfg.to_str().unwrap(),
            "--layers",
            "2",
            "--embd",
            "32",
            "--heads",
            "2",
            "--block",
            "16",
            "--steps",
            "3",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let page = dir.join("page/memory.html");
    let out = Command::new(zr).args(["report"]).arg(dir.join("report")).arg("--html").arg(&page).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(!html.contains("http://") && !html.contains("https://"), "self-contained: no network");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report/memory_rank0.json")).unwrap()).unwrap();
    let chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .expect("Debian's chromium (make setup installs it)");
    let profile = dir.join("chromium-profile");
    let dom = Command::new(chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"])
        .args(["--disable-background-networking", "--disable-component-update", "--disable-sync"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--virtual-time-budget=2000", "--dump-dom"])
        .arg(format!("file://{}", page.display()))
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout);
    // The script ran (it counts the charts: two per rank) and every category of the report is in the legend.
    assert!(dom.contains(r#"data-rendered="4""#), "{}", &dom[..dom.len().min(2000)]);
    for category in report["categories"].as_object().unwrap().keys() {
        assert!(dom.contains(&format!(r#"<li data-category="{category}">"#)), "{category} named");
    }
    for name in ["activations", "floor", "unaccounted", "Rank 0", "Rank 1", "What would help"] {
        assert!(dom.contains(name), "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A number as the profiler prints it ("1.70M", "612.00 K"): its value.
fn count(text: &str) -> f64 {
    let t = text.trim();
    let (num, scale) = match t.chars().last() {
        Some('T') => (&t[..t.len() - 1], 1e12),
        Some('G') => (&t[..t.len() - 1], 1e9),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('K') => (&t[..t.len() - 1], 1e3),
        _ => (t, 1.0),
    };
    num.trim().parse::<f64>().unwrap_or_else(|_| panic!("{text}")) * scale
}

#[test]
fn flops_profiler_counts_each_units_forward_from_the_shapes_libtorch_ran() {
    let dir = temp_dir("flops");
    let profile = dir.join("profile.txt");
    let config = json!({
        "train_batch_size": 8,
        "zero_optimization": {"stage": 3},
        "flops_profiler": {"enabled": true, "profile_step": 2, "detailed": true, "output_file": profile,
                           "recompute_fwd_factor": 1.0},
    });
    let cfg = write_config(&dir, &config);
    gpt(&cfg, &dir, &["--ranks", "2", "--steps", "3"]);
    let text = std::fs::read_to_string(&profile).unwrap();
    assert!(text.contains("zerorun flops profiler: step 2"), "{text}");
    // A block's forward (E = 32, 2 heads, block 16, 4 samples a rank): its linears 2 x tokens x 12 E^2 (q, k, v and
    // the projection E^2 each, the MLP 8 E^2) and attention's two batched matmuls 2 x 2 x b t^2 E.
    let (e, t, b) = (32.0, 16.0, 4.0);
    let want = 2.0 * b * t * 12.0 * e * e + 4.0 * b * t * t * e;
    let row = |name: &str| -> Vec<String> {
        let line =
            text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name}\n{text}"));
        line.split_whitespace().map(str::to_string).collect()
    };
    for unit in ["blocks.0", "blocks.1"] {
        let got = count(&row(unit)[3]);
        assert!((got - want).abs() / want < 0.01, "{unit}: {got} FLOPs, the shapes give {want}\n{text}");
    }
    assert!(count(&row("tok")[1]) > 0.0 && count(&row("ln_f")[3]) > 0.0, "{text}");
    // With recompute_fwd_factor 1 the step counts (1 + 2 + 1) x the forward.
    let value = |key: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("{key}\n{text}"));
        let v = line[key.len()..].trim().trim_end_matches("FLOPS").trim_end_matches("FLOPs").trim_end_matches("ms");
        count(v)
    };
    let (fwd, iter, flops) = (value("fwd flops per rank:"), value("iter latency:"), value("FLOPS per rank:"));
    let expect = 4.0 * fwd / (iter / 1e3);
    assert!((flops - expect).abs() / expect < 0.02, "{flops} vs 4 x {fwd} / {iter} ms\n{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}
