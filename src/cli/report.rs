//! `zerorun report DIR --html OUT`: the run's memory report as one self-contained HTML page (the peak step's
//! events stacked by category, every step, the peak's window, what would help; no network needed to open it).
//! `zerorun report show DIR`: a run's memory report again (the table, what would help, the peak's largest
//! allocations when recorded) and its pictures redrawn (DIR/memory.svg and .png: every step, the peak step's
//! timeline). `zerorun report compare DIR... [--label L]... --out STEM`: runs' memory reports side by side (every
//! rank at its peak, by category, and its resident memory) as STEM.svg and STEM.png, with the table of each run.
use std::path::PathBuf;

use clap::{Args, Subcommand};
use zerorun_report::memory::MemoryReport;

use super::{emit, CliError};

#[derive(Subcommand)]
pub enum ReportCommand {
    /// Print a run's memory report (table, what would help, largest allocations) and redraw its pictures.
    Show(ShowArgs),
    /// Draw several runs' memory reports side by side (e.g. stage 0, stage 3, stage 3 with NVMe offload).
    Compare(CompareArgs),
}

/// `zerorun report`: a subcommand, or a run's folder with `--html OUT`.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct ReportArgs {
    #[command(subcommand)]
    command: Option<ReportCommand>,
    /// The run's `--memory-report` folder (memory_rank{r}.json), for --html.
    #[arg(required = true)]
    dir: Option<PathBuf>,
    /// Write the report as one self-contained HTML page here (inline styles, script and pictures).
    #[arg(long, value_name = "OUT", required = true)]
    html: Option<PathBuf>,
}

#[derive(Args)]
pub struct ShowArgs {
    /// The run's `--memory-report` folder (memory_rank{r}.json).
    dir: PathBuf,
}

#[derive(Args)]
pub struct CompareArgs {
    /// Folders holding `memory_rank{r}.json` (a run's `--memory-report` folder), one per run.
    #[arg(required = true)]
    dirs: Vec<PathBuf>,
    /// A label per run, in order (default: each folder's name).
    #[arg(long = "label")]
    labels: Vec<String>,
    /// Where the picture goes: STEM.svg and STEM.png.
    #[arg(long)]
    out: PathBuf,
}

/// Every rank's report in `dir` (memory_rank0.json, memory_rank1.json, ... up to the world size rank 0 names).
fn read_run(dir: &std::path::Path) -> Result<Vec<MemoryReport>, CliError> {
    let first = MemoryReport::read(dir, 0).map_err(|e| CliError::Usage(e.to_string()))?;
    let mut reports = vec![first];
    for r in 1..reports[0].world_size {
        reports.push(MemoryReport::read(dir, r).map_err(|e| CliError::Usage(e.to_string()))?);
    }
    Ok(reports)
}

pub fn run(args: ReportArgs) -> Result<(), CliError> {
    let c = match (args.command, args.dir, args.html) {
        (Some(c), _, _) => c,
        (None, Some(dir), Some(out)) => return write_html(&dir, &out),
        _ => return Err(CliError::Usage("zerorun report DIR --html OUT, or `report show` / `report compare`".into())),
    };
    let a = match c {
        ReportCommand::Show(s) => return show(&s.dir),
        ReportCommand::Compare(a) => a,
    };
    if !a.labels.is_empty() && a.labels.len() != a.dirs.len() {
        return Err(CliError::Usage(format!(
            "{} --label for {} folders: give one per folder, or none",
            a.labels.len(),
            a.dirs.len()
        )));
    }
    let mut runs = Vec::with_capacity(a.dirs.len());
    for (i, dir) in a.dirs.iter().enumerate() {
        let label = a.labels.get(i).cloned().unwrap_or_else(|| {
            dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned())
        });
        runs.push((label, read_run(dir)?));
    }
    for (label, reports) in &runs {
        emit(&format!("{label}:\n{}", zerorun_report::table::table(reports)))?;
    }
    if let Some(parent) = a.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| CliError::Io { context: format!("creating {}", parent.display()), source: e })?;
    }
    let (svg, png) =
        zerorun_report::plot::draw_comparison(&a.out, &runs).map_err(|e| CliError::Usage(e.to_string()))?;
    emit(&format!("wrote {} and {}", svg.display(), png.display()))
}

fn show(dir: &std::path::Path) -> Result<(), CliError> {
    let reports = read_run(dir)?;
    emit(&zerorun_report::table::table(&reports))?;
    let (svg, png) = zerorun_report::plot::draw_memory(dir, &reports).map_err(|e| CliError::Usage(e.to_string()))?;
    emit(&format!("wrote {} and {}", svg.display(), png.display()))
}

fn write_html(dir: &std::path::Path, out: &std::path::Path) -> Result<(), CliError> {
    let reports = read_run(dir)?;
    let page = zerorun_report::html::html(&reports);
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| CliError::Io { context: format!("creating {}", parent.display()), source: e })?;
    }
    std::fs::write(out, page).map_err(|e| CliError::Io { context: format!("writing {}", out.display()), source: e })?;
    emit(&format!("wrote {}", out.display()))
}
