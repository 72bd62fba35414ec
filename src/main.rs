//! The `zerorun` command line: config, estimate, plan, launch, bench, consolidate, report, pipeline. It links no libtorch (only the
//! tensor-free crates), so a command that touches no tensor costs a few MiB; `bench adam` runs in the
//! `zerorun-torch` helper beside it.
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;
// The library's logging set-up, shared as a file (the CLI links no libtorch, so not the library itself).
#[allow(dead_code)]
mod logging;

#[derive(Parser)]
#[command(name = "zerorun", version, about = "ZeRO-style memory-sharding training runtime for tch training loops")]
struct Cli {
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
    /// Start N ranks of a program on this host (torchrun-compatible variables).
    Launch(cli::launch::LaunchArgs),
    /// Memory reports of several runs, side by side.
    #[command(subcommand)]
    Report(cli::report::ReportCommand),
    /// Pipeline schedules, simulated: the table by stage and time step, the bubble, the activations held.
    #[command(subcommand)]
    Pipeline(cli::pipeline::PipelineCommand),
    /// Benchmarks that report ratios against a reference measured in the same run.
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
    };
    cli::exit_code(result)
}
