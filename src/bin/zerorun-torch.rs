//! `zerorun-torch`: the `zerorun` commands that need libtorch (`bench adam`), in a binary of their own so that
//! `zerorun` loads no libtorch. `zerorun bench adam ...` replaces itself with this binary (it must sit beside
//! `zerorun`, as `cargo build --bins` and `make` put it); it takes the same arguments.
use std::process::ExitCode;

use clap::{Parser, Subcommand};
// The library carries the C++ shim of libtorch's fused AdamW (`zerorun_fused_adamw`, built by the build script).
extern crate zerorun as _;

#[path = "../cli/bench_adam.rs"]
mod bench_adam;
#[path = "../cli/bench_pipeline.rs"]
mod bench_pipeline;
#[allow(dead_code)]
#[path = "../cli/mod.rs"]
mod cli;
#[path = "../logging.rs"]
#[allow(dead_code)]
mod logging;

use cli::{emit, CliError};

#[derive(Parser)]
#[command(name = "zerorun", version, about = "zerorun's commands that need libtorch (run through `zerorun`)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
}

fn main() -> ExitCode {
    let Command::Bench(bench) = Cli::parse().command;
    // Warnings only, as `zerorun`: the benches' in-process pipelines are not the user's (no partition summaries).
    logging::init_logging_with_default("warn");
    let result = match bench {
        cli::bench::BenchCommand::Adam { params, repeats, json } => bench_adam::run(params, repeats, json),
        cli::bench::BenchCommand::Pipeline { stage_ms, steps, json } => bench_pipeline::run(stage_ms, steps.max(1), json),
        // A rank of `zerorun bench comm --backend gloo` (the backend is libtorch's).
        cli::bench::BenchCommand::Comm { backend, max_bytes, dtype, repeats, json, worker: true, .. }
            if backend == "gloo" =>
        {
            gloo_bench_rank(max_bytes, &dtype, repeats.max(1), json)
        }
        _ => Err(CliError::Usage(
            "zerorun-torch runs `bench adam`, `bench pipeline` and gloo's `bench comm` ranks only; call `zerorun` for the other commands"
                .into(),
        )),
    };
    cli::exit_code(result)
}

fn gloo_bench_rank(max_bytes: usize, dtype: &str, repeats: usize, json: bool) -> Result<(), CliError> {
    let elem = match dtype {
        "bf16" => zerorun::runtime::comm::Dtype::Bf16,
        "f16" => zerorun::runtime::comm::Dtype::F16,
        _ => zerorun::runtime::comm::Dtype::F32,
    };
    let c = zerorun::communicator_from_env(std::time::Duration::from_secs(600))
        .map_err(|e| CliError::Usage(e.to_string()))?;
    cli::bench_comm::rank_main(c.as_ref(), max_bytes, elem, repeats, json)
}
