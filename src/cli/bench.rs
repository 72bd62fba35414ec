//! `zerorun bench adam|comm|swap|pipeline|matmul`: the subcommands and where each runs. `adam` and `matmul` run
//! libtorch and `pipeline` runs the pipeline engine, so they run in the `zerorun-torch` helper binary (`bench_adam.rs`,
//! `bench_pipeline.rs`); `comm`, `swap` and `async` (which runs the MLP example's processes) run here, with no
//! libtorch loaded.
use clap::Subcommand;

use super::CliError;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Stage 3's two ways of running a model's units, alternately in one sitting: the GPT and MLP examples through
    /// `engine.forward`'s walk over the chain of units, and with the same units entered by `engine.unit` from the
    /// loop (`--scoped`): median step and peak RSS of each, and their ratios.
    Scopes {
        /// A stage-3 ds_config.json.
        #[arg(long, default_value = "configs/zero3.json")]
        config: std::path::PathBuf,
        /// Rank processes per run.
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// Optimizer steps per run (the examples report their median step).
        #[arg(long, default_value_t = 12)]
        steps: usize,
        /// Runs of each path per model, alternating.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// One JSON object per model.
        #[arg(long)]
        json: bool,
    },
    /// A cluster of --hosts hosts simulated here (network namespaces joined by veth links limited to --link each
    /// way), one `zerorun launch --nnodes H` in each: the median step, the bytes each rank sent across and inside
    /// hosts, and the link floor. Needs root.
    Cluster(super::bench_cluster::ClusterArgs),
    /// AdamW step throughput: zerorun-optim vs libtorch (fused kernel and C++ optimizer) vs the bandwidth limit.
    Adam {
        /// One size (parameters); default: every power of two from 2^20 to 2^27.
        #[arg(long)]
        params: Option<usize>,
        /// Timed repetitions per size (the median is reported).
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Bus bandwidth of all_reduce, reduce_scatter and all_gather (nccl-tests formulas) beside a single-core memcpy.
    Comm {
        /// shm (rank processes over shared memory), threads (rank threads in this process), mpi (under mpirun) or
        /// gloo (libtorch's TCP backend, ranks in the zerorun-torch helper).
        #[arg(long, default_value = "shm")]
        backend: String,
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// Largest message, bytes (from 4 KiB up by factors of 4).
        #[arg(long, default_value_t = 256 << 20)]
        max_bytes: usize,
        /// Element type: f32, bf16 or f16 (16-bit values are summed in f32 and rounded once, as NCCL does).
        #[arg(long, default_value = "f32")]
        dtype: String,
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// Internal: run as one rank of the benchmark (set by the benchmark itself).
        #[arg(long, hide = true)]
        worker: bool,
    },
    /// The pipeline engine's measured bubble (idle fraction) beside (p - 1) / (v m + p - 1), for GPipe, 1F1B and
    /// interleaved 1F1B on 2 and 4 stages of equal cost and 1-16 micro-batches.
    Pipeline {
        /// Forward time of one stage per micro-batch, milliseconds; its backward takes as long (its layers sleep).
        #[arg(long, default_value_t = 20.0)]
        stage_ms: f64,
        /// Timed steps per case (the median is reported; one more runs first).
        #[arg(long, default_value_t = 3)]
        steps: usize,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Synchronous against asynchronous training (bounded staleness, local SGD, DiLoCo) with one rank slowed: the
    /// MLP example on 2 and 4 rank processes per mode, the job's samples/s and the trained model's loss.
    Async {
        /// Rank counts to run, comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [2usize, 4])]
        ranks: Vec<usize>,
        /// Optimizer steps per run (every mode sees the same samples).
        #[arg(long, default_value_t = 60)]
        steps: usize,
        /// The slow rank's step over the synchronous step with no slow rank (1: no slow rank), comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [1.0f64, 2.0])]
        slow_factor: Vec<f64>,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// Also draw PLOT.svg and PLOT.png: training loss against samples for every mode (the largest rank count,
        /// the rotating straggler) beside the synchronous run with no slow rank.
        #[arg(long)]
        plot: Option<std::path::PathBuf>,
        /// How the ranks communicate: shm (shared memory, one-sided) or gloo (messages only, as across hosts).
        #[arg(long, default_value = "shm", value_parser = ["shm", "gloo"])]
        backend: String,
    },
    /// Achieved FLOP/s of fp32 matmuls of the given shape ([m, k] x [k, n], forward and both backward products) on
    /// --threads threads, and the resident memory of a process with libtorch loaded: what `zerorun plan measure`
    /// writes as a rank's `flops_per_rank` and `process_floor_bytes`.
    Matmul {
        #[arg(long, default_value_t = 512)]
        m: i64,
        #[arg(long, default_value_t = 1024)]
        k: i64,
        #[arg(long, default_value_t = 1024)]
        n: i64,
        /// Threads of libtorch's intra-op pool (a rank's share of the cores).
        #[arg(long, default_value_t = 1)]
        threads: usize,
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Write and read GiB/s of the NVMe swapper on a folder, beside dd with O_DIRECT on the same folder and size.
    Swap {
        /// The folder to test (where nvme_path would point).
        #[arg(long, default_value = ".")]
        dir: std::path::PathBuf,
        /// Bytes per write and read (rounded up to MiB).
        #[arg(long, default_value_t = 1 << 30)]
        size: usize,
        /// aio.block_size: bytes per request.
        #[arg(long, default_value_t = 1 << 20)]
        block_size: usize,
        /// aio.queue_depth: requests in flight.
        #[arg(long, default_value_t = 8)]
        queue_depth: usize,
        /// aio.intra_op_parallelism: I/O threads.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// One JSON object.
        #[arg(long)]
        json: bool,
        /// `stream` (one write and one read of --size) or `training`: --ranks ranks at once, each over --size
        /// bytes in --chunk-byte requests, the next read ahead while the last is written back.
        #[arg(long, default_value = "stream", value_parser = ["stream", "training"])]
        pattern: String,
        /// With --pattern training: bytes per request (a unit's parameter shard, a sub-group's states).
        #[arg(long, default_value_t = 4 << 20)]
        chunk: usize,
        /// With --pattern training: ranks sharing the folder.
        #[arg(long, default_value_t = 2)]
        ranks: usize,
    },
}

pub fn run(command: BenchCommand) -> Result<(), CliError> {
    match command {
        BenchCommand::Adam { .. } | BenchCommand::Pipeline { .. } | BenchCommand::Matmul { .. } => {
            super::torch_helper::run_here()
        }
        BenchCommand::Comm { backend, ranks, max_bytes, dtype, repeats, json, worker } => {
            super::bench_comm::run(&backend, ranks, max_bytes, &dtype, repeats.max(1), json, worker)
        }
        BenchCommand::Scopes { config, ranks, steps, rounds, json } => {
            if ranks == 0 || steps == 0 || rounds == 0 {
                return Err(CliError::Usage("bench scopes: --ranks, --steps and --rounds at least 1".into()));
            }
            super::bench_scopes::run(super::bench_scopes::ScopesBenchArgs { config, ranks, steps, rounds, json })
        }
        BenchCommand::Async { ranks, steps, slow_factor, json, plot, backend } => {
            if ranks.iter().any(|&r| r < 2) || slow_factor.iter().any(|&f| f.is_nan() || f < 1.0) || steps == 0 {
                return Err(CliError::Usage(
                    "bench async: --ranks at least 2, --slow-factor at least 1, --steps at least 1".into(),
                ));
            }
            super::bench_async::run(super::bench_async::AsyncBenchArgs {
                ranks,
                steps,
                slow_factors: slow_factor,
                json,
                plot,
                backend,
            })
        }
        BenchCommand::Cluster(a) => super::bench_cluster::run(a),
        BenchCommand::Swap { dir, size, block_size, queue_depth, threads, repeats, json, pattern, chunk, ranks } => {
            super::bench_swap::run(super::bench_swap::SwapBenchArgs {
                dir,
                size,
                io: zerorun_offload::IoConfig { block_size, queue_depth, intra_op_parallelism: threads },
                repeats: repeats.max(1),
                json,
                training: (pattern == "training")
                    .then_some(super::bench_swap::TrainingPattern { chunk, ranks: ranks.max(1) }),
            })
        }
    }
}

/// What an example run by a benchmark (`bench`) under `zerorun launch` printed on stdout; a failed run is an error
/// naming it (`what`) with its output.
pub(super) fn example_output(bench: &str, what: &str, cmd: &mut std::process::Command) -> Result<String, CliError> {
    let out = cmd.output().map_err(|e| CliError::Io { context: format!("running {what}"), source: e })?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(CliError::Usage(format!(
            "bench {bench}: {what} failed:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(text)
}

/// Rank 0's `key value` line in a launched example's `text` (`[rank 0] key value`), or an error naming the run.
pub(super) fn rank0_value(bench: &str, what: &str, text: &str, key: &str) -> Result<f64, CliError> {
    text.lines()
        .find_map(|l| l.strip_prefix("[rank 0] ").and_then(|l| l.strip_prefix(key)))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| CliError::Usage(format!("bench {bench}: {what} printed no `{key}`:\n{text}")))
}
