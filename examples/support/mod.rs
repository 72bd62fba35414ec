//! What both examples share: flags, starting ranks, seeded batches, loading and saving weights.
#![allow(dead_code)]
pub mod gpt_model;
pub mod llama_model;
pub mod nanogpt_model;
pub mod scoped_models;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tch::{nn, Tensor};
use zerorun::communicator_from_env;
use zerorun::runtime::comm::env::RankInfo;
use zerorun::runtime::comm::{threads, Communicator};
use zerorun::{Config, Engine, StepOutcome};

/// Flags every example takes.
#[derive(clap::Args, Clone, Debug)]
pub struct CommonArgs {
    /// A DeepSpeed-style ds_config.json.
    #[arg(long)]
    pub config: PathBuf,
    /// Optimizer steps to run.
    #[arg(long, default_value_t = 20)]
    pub steps: u64,
    /// Seed of the data, the initial weights and the batch order (never of the world size).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Initial weights by parameter name (e.g. pretrained), safetensors.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Rank 0 writes every parameter, full fp32, here at the end (safetensors).
    #[arg(long)]
    pub save_final: Option<PathBuf>,
    /// Where checkpoints go.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every K optimizer steps.
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Continue from CHECKPOINT_DIR/latest.
    #[arg(long)]
    pub resume: bool,
    /// Run this many ranks as threads of this process (the threads backend). Under `zerorun launch`, each
    /// process is one rank instead.
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Stage 3: keep only each unit's input in forward and recompute the unit in backward.
    #[arg(long)]
    pub activation_checkpointing: bool,
    /// Where the model trains: the CPU, or this rank's GPU (`cuda`: LOCAL_RANK modulo the GPUs seen).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
}

/// `--device`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

impl CommonArgs {
    /// The device `--device` names: the CPU, or this rank's GPU (an error when none is usable here).
    // ANCHOR: device
    pub fn device(&self) -> Result<tch::Device, String> {
        match self.device {
            DeviceArg::Cpu => Ok(tch::Device::Cpu),
            DeviceArg::Cuda => {
                if let Err(e) = zerorun::cuda::load() {
                    return Err(format!("--device cuda: {e}"));
                }
                if !zerorun::cuda::available() {
                    return Err("--device cuda: libtorch sees no CUDA device on this machine".into());
                }
                Ok(zerorun::local_device())
            }
        }
    }
    // ANCHOR_END: device

    /// Refuses flags whose feature is not in this build, rather than ignoring them.
    pub fn check(&self) -> Result<(), String> {
        if (self.save_every.is_some() || self.resume) && self.checkpoint_dir.is_none() {
            return Err("--save-every and --resume need --checkpoint-dir".into());
        }
        if self.save_every == Some(0) {
            return Err("--save-every must be >= 1".into());
        }
        if self.ranks == 0 {
            return Err("--ranks must be >= 1".into());
        }
        if self.ranks > 1 && std::env::var("WORLD_SIZE").is_ok_and(|w| w != "1") {
            return Err("--ranks starts thread ranks inside one process; under `zerorun launch` leave it out".into());
        }
        Ok(())
    }
}

/// splitmix64: a small, seedable generator so batches depend only on (seed, step).
pub struct Rng(u64);

impl Rng {
    /// The generator of `stream` (a step, a rank) under `seed`. Both are hashed into the state: SplitMix64 walks one
    /// sequence by a fixed increment, so a state of `seed ^ stream x increment` made stream s + 1 the same draws as
    /// stream s one place on (consecutive steps' batches shared all but one sample).
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut s = Rng(seed);
        let mut t = Rng(stream ^ 0xD1B5_4A32_D192_ED03);
        Rng(s.next_u64() ^ t.next_u64().rotate_left(29))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Which samples of a global batch of `train` samples this rank's micro-batch `micro_index` holds.
pub fn micro_batch_range(rank: usize, world: usize, micro_index: u64, micro: u64) -> std::ops::Range<usize> {
    let first = (micro_index as usize * world + rank) * micro as usize;
    first..first + micro as usize
}

/// Model construction draws from libtorch's global generator: one rank at a time, from the seed, so the
/// initial weights never depend on how many ranks run.
static INIT: Mutex<()> = Mutex::new(());

pub fn build_model<M>(
    seed: u64,
    init: Option<&PathBuf>,
    f: impl FnOnce(&nn::VarStore) -> M,
) -> Result<(nn::VarStore, M), String> {
    let _guard = INIT.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(seed as i64);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = f(&vs);
    if let Some(path) = init {
        // Tensor by tensor from the mapped file: the file is never read whole into memory.
        zerorun::runtime::engine::load_mapped(&vs, path).map_err(|e| format!("--init {}: {e}", path.display()))?;
    }
    Ok((vs, model))
}

/// Converts the model to the config's precision (bf16 / fp16 configs train 16-bit parameters with an fp32
/// master); returns the kind inputs should have.
pub fn to_config_precision(config: &Config, vs: &mut nn::VarStore) -> tch::Kind {
    let kind = config_kind(config);
    match kind {
        tch::Kind::BFloat16 => vs.bfloat16(),
        tch::Kind::Half => vs.half(),
        _ => {}
    }
    kind
}

/// The kind the config trains in (what inputs should have).
pub fn config_kind(config: &Config) -> tch::Kind {
    if config.bf16.enabled {
        tch::Kind::BFloat16
    } else if config.fp16.enabled {
        tch::Kind::Half
    } else {
        tch::Kind::Float
    }
}

/// Runs `train(comm)` as this process's rank when started by `zerorun launch` (or torchrun), else on `ranks`
/// threads. Returns rank 0's result (None in the processes of other ranks); the first failing rank's error wins.
pub fn run_ranks<T: Send>(
    ranks: usize,
    timeout: Duration,
    train: impl Fn(Box<dyn Communicator>) -> Result<T, String> + Sync,
) -> Result<Option<T>, String> {
    let info = RankInfo::from_env().map_err(|e| e.to_string())?;
    if info.is_distributed() {
        let comm = communicator_from_env(timeout).map_err(|e| e.to_string())?;
        let result = train(comm).map_err(|e| format!("rank {}: {e}", info.rank))?;
        return Ok((info.rank == 0).then_some(result));
    }
    let comms = threads::group(ranks, timeout);
    let results: Vec<Result<T, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let train = &train;
                s.spawn(move || {
                    let rank = c.rank();
                    train(Box::new(c)).map_err(|e| format!("rank {rank}: {e}"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into()))).collect()
    });
    let mut first = None;
    let mut out = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) if rank == 0 => out = Some(v),
            Ok(_) => {}
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    match (first, out) {
        (Some(e), _) => Err(e),
        (None, Some(v)) => Ok(Some(v)),
        (None, None) => Err("rank 0 returned nothing".into()),
    }
}

/// Per-step timing and what rank 0 prints: one `step N loss X` line per optimizer step, or, when stdout is a
/// terminal, one progress line rewritten in place with the loss and samples/s.
pub struct Progress {
    times: Vec<f64>,
    started: Instant,
    pub last_loss: f64,
    pub first_loss: Option<f64>,
    total_steps: u64,
    terminal: bool,
    /// Tokens per sample (a sequence model's block), to print tokens/s; 0 prints samples/s.
    tokens_per_sample: u64,
    /// The step's model FLOPs utilisation, when the engine knows what a sample costs (`engine.set_throughput`).
    mfu: Option<f64>,
}

impl Progress {
    pub fn new(total_steps: u64) -> Self {
        use std::io::IsTerminal;
        Progress {
            times: Vec::new(),
            started: Instant::now(),
            last_loss: f64::NAN,
            first_loss: None,
            total_steps,
            terminal: std::io::stdout().is_terminal(),
            tokens_per_sample: 0,
            mfu: None,
        }
    }

    /// Rates in tokens per second, `block` tokens a sample.
    pub fn in_tokens(mut self, block: i64) -> Self {
        self.tokens_per_sample = block.max(1) as u64;
        self
    }

    /// "1234 tokens/s" or "56 samples/s" for `train_batch_size` samples in `secs`.
    fn rate(&self, train_batch_size: u64, secs: f64) -> String {
        let samples_per_s = train_batch_size as f64 / secs.max(1e-9);
        let rate = match self.tokens_per_sample {
            0 => format!("{samples_per_s:.1} samples/s"),
            t => format!("{:.0} tokens/s", samples_per_s * t as f64),
        };
        match self.mfu {
            Some(mfu) => format!("{rate} mfu {:.1}%", mfu * 100.0),
            None => rate,
        }
    }

    pub fn record(&mut self, engine: &Engine, outcome: StepOutcome) {
        self.mfu = engine.step_rates().mfu;
        self.record_for(engine.rank() == 0, engine.batch_sizes().train_batch_size, outcome);
    }

    /// `record` where the printing rank and the global batch are given (a pipeline stage's engine has neither).
    pub fn record_for(&mut self, print: bool, train_batch_size: u64, outcome: StepOutcome) {
        if let StepOutcome::Skipped { loss, .. } = outcome {
            // fp16 overflow (the engine logs it): the step's loss is real, the update was not made.
            self.started = Instant::now();
            self.last_loss = loss;
            self.first_loss.get_or_insert(loss);
        }
        if let StepOutcome::Stepped { step, loss, .. } = outcome {
            let secs = self.started.elapsed().as_secs_f64();
            self.times.push(secs);
            self.started = Instant::now();
            self.last_loss = loss;
            self.first_loss.get_or_insert(loss);
            if print {
                if self.terminal {
                    use std::io::Write;
                    let done = (step * 30 / self.total_steps.max(1)).min(30) as usize;
                    print!(
                        "\r[{}{}] step {step}/{} loss {loss:.4} {:.0} ms {} ",
                        "#".repeat(done),
                        " ".repeat(30 - done),
                        self.total_steps,
                        secs * 1e3,
                        self.rate(train_batch_size, secs)
                    );
                    let _ = std::io::stdout().flush();
                    if step >= self.total_steps {
                        println!();
                    }
                } else {
                    // `step N loss X` first: tools and tests read these lines.
                    println!(
                        "step {step} loss {loss:.6} time {:.0} ms {}",
                        secs * 1e3,
                        self.rate(train_batch_size, secs)
                    );
                }
            }
        }
    }

    /// Median optimizer-step time after the first two steps (warm-up).
    pub fn median_step_s(&self) -> f64 {
        let mut t: Vec<f64> = self.times.iter().skip(2).copied().collect();
        if t.is_empty() {
            t = self.times.clone();
        }
        t.sort_by(f64::total_cmp);
        t.get(t.len() / 2).copied().unwrap_or(0.0)
    }
}

/// `--resume`: continues from CHECKPOINT_DIR's newest intact checkpoint (`latest`, else an older one when its
/// files are damaged; any world size and stage); returns the first step to run. A folder with no checkpoint yet
/// starts from the beginning (so one command line serves the first start and every restart under `zerorun launch
/// --max-restarts`). Rank 0 says which (`resumed from step K at world size W`).
pub fn resume(args: &CommonArgs, engine: &mut Engine) -> Result<u64, String> {
    let (rank, world) = (engine.rank(), engine.world_size());
    // A fault-tolerant job's restarted replica group: `initialize` healed it from a live group, at that group's step.
    if engine.global_steps() > 0 {
        println!("rank {rank} healed from a live replica group: continuing at step {}", engine.global_steps());
        return Ok(engine.global_steps());
    }
    resume_with(args, rank == 0, world, |dir| {
        engine.load_latest_intact_checkpoint(dir).map_err(|e| e.to_string())?;
        Ok(engine.global_steps())
    })
}

/// [`resume`] for any engine: `load(dir)` loads the latest checkpoint and returns its step; `print`: this rank
/// says what happened; `world`: the job's ranks, for the message.
pub fn resume_with(
    args: &CommonArgs,
    print: bool,
    world: usize,
    load: impl FnOnce(&std::path::Path) -> Result<u64, String>,
) -> Result<u64, String> {
    let (Some(dir), true) = (&args.checkpoint_dir, args.resume) else { return Ok(0) };
    if !dir.join("latest").exists() {
        if print {
            println!("no checkpoint in {} yet: starting from step 0", dir.display());
        }
        return Ok(0);
    }
    let step = load(dir)?;
    if print {
        println!("resumed from step {step} at world size {world}");
    }
    Ok(step)
}

/// `--save-every K`: a checkpoint after every K-th optimizer step. Rank 0 prints how long the save held training
/// up (`checkpoint_stall_s`: the whole save, or with `checkpoint.async_save` the snapshot).
pub fn maybe_save(args: &CommonArgs, engine: &mut Engine, outcome: StepOutcome) -> Result<(), String> {
    if let (Some(dir), Some(every)) = (&args.checkpoint_dir, args.save_every) {
        if outcome != StepOutcome::Accumulating && engine.global_steps() % every == 0 {
            let started = Instant::now();
            engine.save_checkpoint(dir, None).map_err(|e| e.to_string())?;
            if engine.rank() == 0 {
                println!("checkpoint_stall_s {:.4} step {}", started.elapsed().as_secs_f64(), engine.global_steps());
            }
        }
    }
    Ok(())
}

/// Rank 0 writes every parameter, full fp32, by name. Every rank calls it (stage 3 gathers the units).
pub fn save_final(engine: &mut Engine, path: &PathBuf) -> Result<(), String> {
    let params = engine.full_parameters().map_err(|e| e.to_string())?;
    if engine.rank() != 0 {
        return Ok(());
    }
    Tensor::write_safetensors(&params, path).map_err(|e| format!("--save-final {}: {e}", path.display()))
}

/// Reads and validates the config; errors name the file.
pub fn load_config(path: &PathBuf) -> Result<Config, String> {
    Config::from_file(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// libtorch's intra-op threads: the cores shared among the thread ranks.
pub fn share_cores(ranks: usize) {
    if std::env::var("OMP_NUM_THREADS").is_err() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        tch::set_num_threads((cores / ranks).max(1) as i32);
    }
}

/// An example's `main`: the runtime's warnings on stderr, then `run(args)`; an error is printed as text (zerorun's
/// messages say what is wrong and where) and exits with status 1.
pub fn run_main<A>(args: &A, run: impl FnOnce(&A) -> Result<(), String>) {
    zerorun::init_logging();
    if let Err(e) = run(args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// The end of an example's rank: the final weights when asked (`--save-final`), the reports, and what the summary
/// line needs: the median step, the last loss and the world size.
pub fn finish_rank(args: &CommonArgs, engine: &mut Engine, progress: &Progress) -> Result<(f64, f64, usize), String> {
    if let Some(path) = &args.save_final {
        save_final(engine, path)?;
    }
    finish_reports(engine)?;
    Ok((progress.median_step_s(), progress.last_loss, engine.world_size()))
}

/// Rank 0's closing lines: the median step and the summary (nothing in the other ranks' processes).
pub fn print_summary(result: Option<(f64, f64, usize)>, config: &Config, steps: u64) {
    let Some((median, last, world)) = result else { return };
    println!("median_step_s {median:.6}");
    println!("summary: {world} ranks, ZeRO stage {}, {steps} optimizer steps, final loss {last:.6}", config.stage());
}

/// The model's units entered one after another with `engine.unit` from the program's loop (`--scoped`), instead of
/// `engine.forward`'s walk: the same result, with backward through `engine.backward`.
pub fn forward_scoped(engine: &mut Engine, model: &dyn zerorun::UnitModel, x: &Tensor) -> Result<Tensor, String> {
    let mut h = x.shallow_clone();
    for (i, prefixes) in model.unit_prefixes().iter().enumerate() {
        let name = prefixes.first().map_or("", String::as_str);
        h = engine.unit(name, |_| model.forward_unit(i, &h)).map_err(|e| e.to_string())?;
    }
    Ok(h)
}

/// At the end of a run: the memory report when asked for (`memory_breakdown` or `zerorun launch --memory-report`),
/// and the wall-clock breakdown when the config sets `wall_clock_breakdown` (rank 0 prints them); every rank
/// prints `peak_rss_bytes`.
pub fn finish_reports(engine: &mut Engine) -> Result<(), String> {
    if let Some(files) = engine.finish_memory_report().map_err(|e| e.to_string())? {
        if let (Some(table), Some(svg)) = (files.table, files.svg) {
            println!("{table}");
            println!("memory report: {} (and memory_rank*.json, memory.png)", svg.display());
        }
    }
    if engine.config().wall_clock_breakdown && engine.rank() == 0 {
        println!("{}", engine.wall_clock_summary());
    }
    // `comms_logger`: DeepSpeed's summary table, with the bytes each rank sent per optimizer step.
    if let (Some(summary), 0) = (engine.comms_summary(), engine.rank()) {
        println!("{summary}");
    }
    // Every rank: this process's peak resident memory (what sharding and offloading lower).
    println!("peak_rss_bytes {}", zerorun::runtime::report::memory::rss().1);
    Ok(())
}
