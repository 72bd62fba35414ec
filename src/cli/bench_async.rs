//! `zerorun bench async`: synchronous against asynchronous training with a slow rank. The MLP example runs under
//! `zerorun launch` (rank processes over shared memory) once per mode, rank count and slowdown: synchronous (stage
//! 1), bounded staleness (stage 1's partition served by its owners), local SGD and DiLoCo (stage 0). A slow rank
//! sleeps per micro-batch so that its step takes `slow_factor` times the synchronous step with no slow rank: always
//! the last rank (`fixed`: a slower machine), or rank s % n at step s (`rotating`: a straggler that moves, as
//! interference does). Reported per case: the whole job's samples per second (every rank's samples over rank 0's
//! wall time, up to the end of `engine.finish()`) and the trained model's loss on the whole data set, after the same
//! number of samples.
use std::path::{Path, PathBuf};
use std::process::Command;

use super::{emit, CliError};

/// The modes measured and their config fragments (AdamW, no clipping: bounded staleness refuses it).
const MODES: [(&str, u8, &str); 4] = [
    ("off", 1, r#"{"mode": "off"}"#),
    ("bounded_staleness", 1, r#"{"mode": "bounded_staleness", "staleness": 2}"#),
    ("local_sgd", 0, r#"{"mode": "local_sgd", "sync_every": 4}"#),
    ("diloco", 0, r#"{"mode": "diloco", "sync_every": 4}"#),
];

/// Samples per rank and micro-batch.
const MICRO_BATCH: usize = 12;

pub struct AsyncBenchArgs {
    pub ranks: Vec<usize>,
    pub steps: usize,
    pub slow_factors: Vec<f64>,
    pub json: bool,
    /// Draw `{plot}.svg` and `.png`: training loss against samples for every mode, at the largest rank count with
    /// the rotating straggler (or none).
    pub plot: Option<PathBuf>,
    /// `zerorun launch --backend`: shm or gloo.
    pub backend: String,
}

#[derive(Clone)]
struct Measured {
    samples_per_s: f64,
    loss: f64,
    /// The training loss rank 0 reported at each step (synchronous: the ranks' mean; otherwise its own).
    losses: Vec<f64>,
}

pub fn run(args: AsyncBenchArgs) -> Result<(), CliError> {
    let zerorun = std::env::current_exe().map_err(|e| CliError::Io { context: "finding zerorun".into(), source: e })?;
    let mlp = zerorun.parent().map(|d| d.join("examples").join("mlp")).unwrap_or_default();
    if !mlp.is_file() {
        return Err(CliError::Usage(format!(
            "bench async runs the MLP example, which is not built beside this zerorun ({}): cargo build --release --examples",
            mlp.display()
        )));
    }
    let dir = std::env::temp_dir().join(format!("zerorun-bench-async-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError::Io { context: format!("creating {}", dir.display()), source: e })?;
    let result = run_cases(&args, &zerorun, &mlp, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_cases(args: &AsyncBenchArgs, zerorun: &Path, mlp: &Path, dir: &Path) -> Result<(), CliError> {
    let mut curves: Vec<zerorun_report::curves::Curve> = Vec::new();
    let mut table = format!(
        "synchronous vs asynchronous training over {}, MLP 64-1024x3-8, AdamW, {} steps of {MICRO_BATCH} samples per rank; a slow rank sleeps per micro-batch so its step takes slow_factor x the synchronous step\n{:<18} {:>5} {:>9} {:>11} {:>8} {:>10} {:>9} {:>7} {:>8}\n",
        args.backend, args.steps, "mode", "ranks", "slow", "slow_factor", "slow_ms", "samples/s", "/ no slow", "/ sync", "loss"
    );
    // One run per mode without a slow rank, and per mode for each slow pattern (fixed and rotating) of a factor > 1.
    let slowed = args.slow_factors.iter().filter(|&&f| f > 1.0).count();
    let runs = args.ranks.len() * MODES.len() * (1 + 2 * slowed);
    let mut progress = super::progress::Progress::new("bench async", runs as u64);
    for &ranks in &args.ranks {
        let configs: Vec<PathBuf> = MODES
            .iter()
            .map(|(name, stage, mode)| write_config(dir, name, *stage, mode, ranks))
            .collect::<Result<_, _>>()?;
        // With no slow rank: each mode's own throughput, and the synchronous step that sets the slowdowns.
        let no_slow: Vec<Measured> = configs
            .iter()
            .zip(MODES)
            .map(|(c, (name, _, _))| {
                progress.item(&format!("{name}, {ranks} ranks, no slow rank"));
                let m = measure(zerorun, mlp, c, args, ranks, None);
                progress.done();
                m
            })
            .collect::<Result<_, _>>()?;
        let step_ms = 1000.0 * (MICRO_BATCH * ranks) as f64 / no_slow[0].samples_per_s;
        let mut cases: Vec<(Option<Slow>, f64)> = Vec::new();
        for &factor in &args.slow_factors {
            if factor > 1.0 {
                cases.push((Some(Slow::Fixed(ranks - 1)), factor));
                cases.push((Some(Slow::Rotating), factor));
            } else {
                cases.push((None, factor));
            }
        }
        for (slow, factor) in cases {
            let slow_ms = ((factor - 1.0) * step_ms).round().max(1.0) as u64;
            let mut sync = None;
            for (i, (name, _, _)) in MODES.iter().enumerate() {
                let m = match slow {
                    None => no_slow[i].clone(),
                    Some(s) => {
                        progress.item(&format!("{name}, {ranks} ranks, {} slow rank x{factor}", s.name()));
                        let m = measure(zerorun, mlp, &configs[i], args, ranks, Some((s, slow_ms)))?;
                        progress.done();
                        m
                    }
                };
                let sync_sps = *sync.get_or_insert(m.samples_per_s);
                let (vs_no_slow, vs_sync) = (m.samples_per_s / no_slow[i].samples_per_s, m.samples_per_s / sync_sps);
                let (pattern, ms) = slow.map_or(("none", 0), |s| (s.name(), slow_ms));
                // Synchronous losses do not depend on a straggler: its curve once, with no slow rank.
                let plotted = ranks == *args.ranks.iter().max().unwrap_or(&ranks)
                    && (if i == 0 { slow.is_none() } else { matches!(slow, Some(Slow::Rotating)) });
                if plotted {
                    let label = format!("{name}, {pattern} slow rank, {:.0} samples/s", m.samples_per_s);
                    curves.push(curve(label, &m.losses, MICRO_BATCH * ranks));
                }
                if args.json {
                    emit(
                        &serde_json::json!({
                            "mode": name, "ranks": ranks, "slow": pattern, "slow_factor": factor, "slow_ms": ms,
                            "samples_per_s": m.samples_per_s, "loss": m.loss, "vs_no_slow": vs_no_slow,
                            "vs_sync": vs_sync, "steps": args.steps, "backend": args.backend,
                        })
                        .to_string(),
                    )?;
                } else {
                    table.push_str(&format!(
                        "{name:<18} {ranks:>5} {pattern:>9} {factor:>11} {ms:>8} {:>10.0} {vs_no_slow:>9.2} {vs_sync:>7.2} {:>8.4}\n",
                        m.samples_per_s, m.loss
                    ));
                }
            }
        }
    }
    if !args.json {
        emit(table.trim_end())?;
    }
    if let Some(stem) = &args.plot {
        let ranks = args.ranks.iter().max().unwrap_or(&0);
        let title = format!("training loss against samples, {ranks} ranks (moving mean of 5 steps, log scale)");
        let y = "loss (synchronous: the ranks' mean; asynchronous: rank 0's own)";
        let (svg, _) = zerorun_report::curves::draw_curves(stem, &title, ("samples", y), &curves)
            .map_err(|e| CliError::Usage(format!("bench async: {e}")))?;
        eprintln!("loss curves: {} (and .png)", svg.display());
    }
    Ok(())
}

/// A run's losses as (samples seen, the mean of the last 5 steps' losses).
fn curve(label: String, losses: &[f64], batch: usize) -> zerorun_report::curves::Curve {
    let points = (0..losses.len())
        .map(|i| {
            let window = &losses[i.saturating_sub(4)..=i];
            (((i + 1) * batch) as f64, window.iter().sum::<f64>() / window.len() as f64)
        })
        .collect();
    zerorun_report::curves::Curve { label, points }
}

fn write_config(dir: &Path, name: &str, stage: u8, mode: &str, ranks: usize) -> Result<PathBuf, CliError> {
    let text = format!(
        r#"{{"train_batch_size": {}, "gradient_clipping": 0, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}}, "zero_optimization": {{"stage": {stage}}}, "async_training": {mode}}}"#,
        MICRO_BATCH * ranks
    );
    let path = dir.join(format!("{name}_{ranks}.json"));
    std::fs::write(&path, text)
        .map_err(|e| CliError::Io { context: format!("writing {}", path.display()), source: e })?;
    Ok(path)
}

/// Which rank is slow.
#[derive(Clone, Copy)]
enum Slow {
    /// This rank, at every step.
    Fixed(usize),
    /// Rank s % n at step s.
    Rotating,
}

impl Slow {
    fn name(self) -> &'static str {
        match self {
            Slow::Fixed(_) => "fixed",
            Slow::Rotating => "rotating",
        }
    }
}

/// One run of the MLP example; `slow`: which rank sleeps, and how many milliseconds per micro-batch.
fn measure(
    zerorun: &Path,
    mlp: &Path,
    config: &Path,
    args: &AsyncBenchArgs,
    ranks: usize,
    slow: Option<(Slow, u64)>,
) -> Result<Measured, CliError> {
    let steps = args.steps;
    let mut cmd = Command::new(zerorun);
    cmd.args(["launch", "--nproc-per-node", &ranks.to_string(), "--backend", &args.backend, "--"]).arg(mlp).args([
        "--config",
        &config.display().to_string(),
        "--steps",
        &steps.to_string(),
        "--in",
        "64",
        "--hidden",
        "1024",
        "--layers",
        "4",
        "--out",
        "8",
    ]);
    match slow {
        Some((Slow::Fixed(rank), ms)) => cmd.args(["--slow-rank", &rank.to_string(), "--slow-ms", &ms.to_string()]),
        Some((Slow::Rotating, ms)) => cmd.args(["--slow-rotate", "--slow-ms", &ms.to_string()]),
        None => &mut cmd,
    };
    let what = format!(
        "{} on {ranks} ranks{}",
        config.display(),
        slow.map_or(String::new(), |(s, ms)| format!(", a {} slow rank sleeping {ms} ms", s.name()))
    );
    let text = super::bench::example_output("async", &what, &mut cmd)?;
    let value = |key: &str| super::bench::rank0_value("async", &what, &text, key);
    let losses = text
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0] step "))
        .filter_map(|l| l.split_once(" loss ").and_then(|(_, v)| v.split_whitespace().next()?.parse().ok()))
        .collect();
    Ok(Measured { samples_per_s: value("train_samples_per_s")?, loss: value("eval_loss")?, losses })
}
