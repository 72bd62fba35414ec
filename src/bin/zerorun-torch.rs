//! `zerorun-torch`: the `zerorun` commands that need libtorch (`bench adam`), in a binary of their own so that
//! `zerorun` loads no libtorch. `zerorun bench adam ...` replaces itself with this binary (it must sit beside
//! `zerorun`, as `cargo build --bins` and `make` put it); it takes the same arguments.
use std::process::ExitCode;

use clap::{Parser, Subcommand};
// The library carries the C++ shim of libtorch's fused AdamW (`zerorun_fused_adamw`, built by the build script).
extern crate zerorun as _;

#[path = "../cli/bench_adam.rs"]
mod bench_adam;
#[allow(dead_code)]
#[path = "../cli/mod.rs"]
mod cli;
#[path = "../logging.rs"]
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
    logging::init_logging();
    let result = match bench {
        cli::bench::BenchCommand::Adam { params, repeats, json } => bench_adam::run(params, repeats, json),
        _ => Err(CliError::Usage("zerorun-torch runs `bench adam` only; call `zerorun` for the other commands".into())),
    };
    cli::exit_code(result)
}
