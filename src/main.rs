//! The `zerorun` command line: config, estimate, plan, launch, bench, consolidate, report, pipeline. It links no libtorch (only the
//! tensor-free crates), so a command that touches no tensor costs a few MiB; `bench adam` runs in the
//! `zerorun-torch` helper beside it.
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

mod cli;
// The library's logging set-up, shared as a file (the CLI links no libtorch, so not the library itself).
#[allow(dead_code)]
mod logging;

#[derive(Parser)]
#[command(name = "zerorun", version, about = "ZeRO-style memory-sharding training runtime for tch training loops")]
struct Cli {
    /// No progress bars or progress lines (the commands' output and errors are unchanged).
    #[arg(long, short, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Inspect ds_config.json files.
    #[command(subcommand)]
    Config(cli::config::ConfigCommand),
    /// Model-state memory per device and per host for every stage and offload option.
    Estimate(cli::estimate::EstimateArgs),
    /// The whole model by variable name from a sharded checkpoint (safetensors).
    Consolidate(cli::consolidate::ConsolidateArgs),
    /// Every way to train a model on a cluster, its predicted peak memory and step time, those that fit fastest
    /// first; `plan measure` writes this machine as a cluster, `plan validate` checks predictions against runs.
    Plan(cli::plan::PlanArgs),
    /// Start a program's ranks: N on this host, on every host of a hostfile over ssh, or on each node of a Slurm
    /// allocation (torchrun-compatible variables).
    Launch(cli::launch::LaunchArgs),
    /// A run's memory report: as an HTML page (DIR --html OUT), again (show), or several runs side by side
    /// (compare).
    Report(cli::report::ReportArgs),
    /// Pipeline schedules, simulated: the table by stage and time step, the bubble, the activations held.
    #[command(subcommand)]
    Pipeline(cli::pipeline::PipelineCommand),
    /// Benchmarks that report ratios against a reference measured in the same run.
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
    /// Print a shell completion script: `zerorun completions bash > /etc/bash_completion.d/zerorun`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write the man pages (zerorun.1 and one per subcommand) into a folder (`make docs` does).
    #[command(hide = true)]
    Man {
        /// The folder to write into (created).
        out: std::path::PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli::progress::set_quiet(cli.quiet);
    // Logs (warnings about ignored keys, progress) go to stderr; stdout carries the command's output. Warnings only:
    // the pipelines `bench pipeline` runs in this process are not the user's, and their partitions would be noise.
    logging::init_logging_with_default("warn");
    let result = match cli.command {
        Command::Config(c) => cli::config::run(c),
        Command::Bench(c) => cli::bench::run(c),
        Command::Launch(a) => cli::launch::run(a),
        Command::Estimate(a) => cli::estimate::run(a),
        Command::Consolidate(a) => cli::consolidate::run(a),
        Command::Report(c) => cli::report::run(c),
        Command::Pipeline(c) => cli::pipeline::run(c),
        Command::Plan(a) => cli::plan::run(a),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "zerorun", &mut std::io::stdout());
            Ok(())
        }
        Command::Man { out } => write_man_pages(&out),
    };
    cli::exit_code(result)
}

/// zerorun.1, and zerorun-SUB.1 (and zerorun-SUB-SUBSUB.1) for every subcommand, from the clap definitions.
fn write_man_pages(out: &std::path::Path) -> Result<(), cli::CliError> {
    let io = |what: String| move |e: std::io::Error| cli::CliError::Io { context: what, source: e };
    std::fs::create_dir_all(out).map_err(io(format!("creating {}", out.display())))?;
    fn walk(cmd: clap::Command, name: String, pages: &mut Vec<(String, clap::Command)>) {
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
            walk(sub.clone(), format!("{name}-{}", sub.get_name()), pages);
        }
        pages.push((name, cmd));
    }
    let mut pages = Vec::new();
    let mut root = Cli::command();
    root.build();
    walk(root, "zerorun".into(), &mut pages);
    for (name, cmd) in pages {
        let path = out.join(format!("{name}.1"));
        let mut page = Vec::new();
        clap_mangen::Man::new(cmd.name(name.clone())).render(&mut page).map_err(io(format!("rendering {name}")))?;
        std::fs::write(&path, page).map_err(io(format!("writing {}", path.display())))?;
    }
    Ok(())
}
