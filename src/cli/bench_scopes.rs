//! `zerorun bench scopes`: stage 3's two ways of running a model's units, in one sitting. The GPT and MLP examples
//! run under `zerorun launch` (rank processes over shared memory) at stage 3, alternately through the walk over the
//! detached chain of units (`engine.forward` with `ZERORUN_STAGE3_WALK=chain`, the path before scopes) and with
//! `--scoped` (the same units entered with `engine.unit` from the loop, gathered and reduced by autograd's hooks,
//! prefetched along the traced order). Reported per model: the median of
//! the runs' median step times and the largest peak RSS of any rank, each path's, and scoped over chain.
use std::path::Path;
use std::process::Command;

use super::{emit, CliError};

pub struct ScopesBenchArgs {
    pub config: std::path::PathBuf,
    pub ranks: usize,
    pub steps: usize,
    pub rounds: usize,
    pub json: bool,
}

/// The example and its flags for each model measured.
const MODELS: [(&str, &str, &[&str]); 2] = [
    ("gpt", "gpt", &["--layers", "8", "--embd", "512", "--heads", "8", "--block", "64"]),
    ("mlp", "mlp", &["--in", "1024", "--hidden", "4096", "--layers", "5", "--out", "8"]),
];

/// One run: rank 0's median step and the largest peak RSS over ranks.
struct Run {
    step_s: f64,
    peak_rss: u64,
}

pub fn run(args: ScopesBenchArgs) -> Result<(), CliError> {
    let zerorun = std::env::current_exe().map_err(|e| CliError::Io { context: "finding zerorun".into(), source: e })?;
    let examples = zerorun.parent().map(|d| d.join("examples")).unwrap_or_default();
    let config = &args.config;
    if !config.is_file() {
        return Err(CliError::Usage(format!("bench scopes: --config {} is not a file", config.display())));
    }
    let mut table = format!(
        "stage 3 on {} rank processes, {} steps per run, {} rounds (chain and scoped alternating): median of the runs' median step, largest peak RSS of any rank\n{:<6} {:>13} {:>13} {:>7} {:>14} {:>14} {:>7}\n",
        args.ranks, args.steps, args.rounds, "model", "chain step s", "scoped step s", "ratio", "chain peak MiB", "scoped peak MiB", "ratio"
    );
    for (model, example, flags) in MODELS {
        let binary = examples.join(example);
        if !binary.is_file() {
            return Err(CliError::Usage(format!(
                "bench scopes runs the {example} example, which is not built beside this zerorun ({}): cargo build --release --examples",
                binary.display()
            )));
        }
        let (mut chain, mut scoped) = (Vec::new(), Vec::new());
        for _ in 0..args.rounds {
            chain.push(measure(&zerorun, &binary, config, flags, &args, false)?);
            scoped.push(measure(&zerorun, &binary, config, flags, &args, true)?);
        }
        let median = |runs: &[Run]| {
            let mut v: Vec<f64> = runs.iter().map(|r| r.step_s).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let peak = |runs: &[Run]| runs.iter().map(|r| r.peak_rss).max().unwrap_or(0);
        let (cs, ss, cp, sp) = (median(&chain), median(&scoped), peak(&chain), peak(&scoped));
        if args.json {
            emit(
                &serde_json::json!({
                    "model": model, "ranks": args.ranks, "steps": args.steps, "rounds": args.rounds,
                    "chain_step_s": cs, "scoped_step_s": ss, "step_ratio": ss / cs,
                    "chain_peak_rss_bytes": cp, "scoped_peak_rss_bytes": sp, "peak_ratio": sp as f64 / cp as f64,
                })
                .to_string(),
            )?;
        } else {
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            table.push_str(&format!(
                "{model:<6} {cs:>13.4} {ss:>13.4} {:>7.3} {:>14.1} {:>14.1} {:>7.3}\n",
                ss / cs,
                mib(cp),
                mib(sp),
                sp as f64 / cp as f64
            ));
        }
    }
    if !args.json {
        emit(table.trim_end())?;
    }
    Ok(())
}

fn measure(
    zerorun: &Path,
    example: &Path,
    config: &Path,
    flags: &[&str],
    args: &ScopesBenchArgs,
    scoped: bool,
) -> Result<Run, CliError> {
    let mut cmd = Command::new(zerorun);
    cmd.args(["launch", "--nproc-per-node", &args.ranks.to_string(), "--"])
        .arg(example)
        .args(["--config", &config.display().to_string(), "--steps", &args.steps.to_string()])
        .args(flags);
    if scoped {
        cmd.arg("--scoped");
    } else {
        cmd.env(zerorun::runtime::engine::CHAIN_WALK_ENV, "chain");
    }
    let what = format!("{} {}", example.display(), if scoped { "--scoped" } else { "(chain)" });
    let text = super::bench::example_output("scopes", &what, &mut cmd)?;
    let step_s = super::bench::rank0_value("scopes", &what, &text, "median_step_s")?;
    let peak_rss = text
        .lines()
        .filter_map(|l| l.split_once("] peak_rss_bytes ").and_then(|(_, v)| v.trim().parse::<u64>().ok()))
        .max()
        .ok_or_else(|| CliError::Usage(format!("bench scopes: {what} printed no peak_rss_bytes:\n{text}")))?;
    Ok(Run { step_s, peak_rss })
}
