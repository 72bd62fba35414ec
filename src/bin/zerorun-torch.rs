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
    /// As `zerorun --quiet`: no progress.
    #[arg(long, short, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
}

fn main() -> ExitCode {
    let parsed = Cli::parse();
    cli::progress::set_quiet(parsed.quiet);
    let Command::Bench(bench) = parsed.command;
    // Warnings only, as `zerorun`: the benches' in-process pipelines are not the user's (no partition summaries).
    logging::init_logging_with_default("warn");
    let result = match bench {
        cli::bench::BenchCommand::Adam { params, repeats, json } => bench_adam::run(params, repeats, json),
        cli::bench::BenchCommand::Pipeline { stage_ms, steps, json } => bench_pipeline::run(stage_ms, steps.max(1), json),
        cli::bench::BenchCommand::Matmul { m, k, n, threads, repeats, json } => {
            bench_matmul(m, k, n, threads.max(1), repeats.max(1), json)
        }
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

/// FLOP/s of the three products of a linear layer's training step (`[m,k] x [k,n]` forward, its two gradients), the
/// median of `repeats` after one warm-up; then this process's resident memory with the operands freed.
fn bench_matmul(m: i64, k: i64, n: i64, threads: usize, repeats: usize, json: bool) -> Result<(), CliError> {
    if m < 1 || k < 1 || n < 1 {
        return Err(CliError::Usage("bench matmul: --m, --k and --n must be at least 1".into()));
    }
    tch::set_num_threads(threads as i32);
    let flops = {
        let opts = (tch::Kind::Float, tch::Device::Cpu);
        let (x, w, dy) =
            (tch::Tensor::randn([m, k], opts), tch::Tensor::randn([k, n], opts), tch::Tensor::randn([m, n], opts));
        let mut times = Vec::with_capacity(repeats);
        for i in 0..=repeats {
            let started = std::time::Instant::now();
            let y = x.matmul(&w);
            let dx = dy.matmul(&w.tr());
            let dw = x.tr().matmul(&dy);
            let _ = std::hint::black_box((y, dx, dw));
            if i > 0 {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        3.0 * 2.0 * (m * k * n) as f64 / times[times.len() / 2]
    };
    let rss = zerorun::runtime::report::memory::rss().0;
    if json {
        emit(
            &serde_json::json!({"m": m, "k": k, "n": n, "threads": threads, "flops_per_s": flops, "rss_bytes": rss})
                .to_string(),
        )
    } else {
        emit(&format!(
            "[{m}, {k}] x [{k}, {n}] on {threads} thread(s): {:.2} GFLOP/s; resident memory {:.0} MiB",
            flops / 1e9,
            rss as f64 / (1u64 << 20) as f64
        ))
    }
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
