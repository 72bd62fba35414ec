//! An MLP (`layers.0` ... `layers.{L-1}`, exact-erf GELU between layers, none after the last) regressing
//! synthetic data from a seed, or `--data FILE.safetensors` (tensors `x` and `y`), with mean-squared error.
//!
//!     cargo run --release --example mlp -- --config configs/zero1.json --ranks 3 --steps 20
use std::time::Duration;

use clap::Parser;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use zerorun::{Engine, EngineOptions, StepOutcome, UnitModel};

#[path = "support/mod.rs"]
mod support;
use support::*;

#[derive(Parser, Debug)]
#[command(about = "Train an MLP on regression data with zerorun")]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[arg(long = "in", default_value_t = 16)]
    input: i64,
    #[arg(long, default_value_t = 32)]
    hidden: i64,
    #[arg(long, default_value_t = 3)]
    layers: i64,
    #[arg(long, default_value_t = 4)]
    out: i64,
    /// Training data: a safetensors file with `x` [N, in] and `y` [N, out] (default: synthetic from --seed).
    #[arg(long)]
    data: Option<std::path::PathBuf>,
    /// Train as a plain loop: no units given to the engine, the model called directly, `engine.backward(&loss)`
    /// (stage 2 then reduces from gradient hooks). Stages 0-2 only: stage 3 gathers parameters inside
    /// `engine.forward`, so it refuses a model called directly unless it is small enough to stay gathered.
    #[arg(long)]
    plain_loop: bool,
    /// Freeze the first K layers (requires_grad off, as a frozen backbone): no gradient and no optimizer state;
    /// partitioned at stage 3.
    #[arg(long, default_value_t = 0)]
    freeze_first: usize,
    /// Build the model from one builder per layer (`zerorun::UnitBuilders`): at stage 3 no rank ever holds the
    /// whole model; the initial weights are those of the ordinary construction. Ranks as processes only.
    #[arg(long)]
    builders: bool,
    /// Slow rank R down (with --slow-ms): it sleeps that long per micro-batch, as a straggler would compute
    /// (what `zerorun bench async` measures synchronous and asynchronous training against).
    #[arg(long, requires = "slow_ms", conflicts_with = "slow_rotate")]
    slow_rank: Option<usize>,
    /// The straggler moves: at step s, rank s % world size is the slow one (with --slow-ms).
    #[arg(long, requires = "slow_ms")]
    slow_rotate: bool,
    /// Milliseconds the slow rank sleeps per micro-batch (with --slow-rank or --slow-rotate).
    #[arg(long)]
    slow_ms: Option<u64>,
    /// Enter the model's units from this loop with `engine.unit` (units as scopes of the program's forward)
    /// instead of `engine.forward`'s walk: the same result; `zerorun bench scopes` times both.
    #[arg(long, conflicts_with_all = ["plain_loop", "activation_checkpointing"])]
    scoped: bool,
    /// Fault injection: the process of rank R (`RANK`, with --crash-rank) aborts once step K is committed, as a
    /// crashed host would; a replica group restarted by `zerorun launch --fault-tolerant` does not crash again.
    #[arg(long, value_name = "K", requires = "crash_rank")]
    crash_after_step: Option<u64>,
    /// The rank --crash-after-step kills.
    #[arg(long, value_name = "R")]
    crash_rank: Option<usize>,
    /// The data cursor's log: after each step it committed, every rank prints `samples step N: P,P,..`, the
    /// places in the step's global batch it trained on (what shows that no sample is lost or repeated when
    /// fault-tolerant replica groups come and go).
    #[arg(long)]
    log_samples: bool,
}

pub struct Mlp {
    layers: Vec<nn::Linear>,
}

/// The widths of the layers' inputs and outputs: `input`, `hidden` between, `out` at the end.
fn layer_dims(input: i64, hidden: i64, layers: i64, out: i64) -> Vec<i64> {
    (0..=layers)
        .map(|i| {
            if i == 0 {
                input
            } else if i == layers {
                out
            } else {
                hidden
            }
        })
        .collect()
}

impl Mlp {
    pub fn new(p: nn::Path, input: i64, hidden: i64, layers: i64, out: i64) -> Self {
        let dims = layer_dims(input, hidden, layers, out);
        Mlp {
            layers: (0..layers as usize)
                .map(|i| nn::linear(&p / "layers" / i, dims[i], dims[i + 1], Default::default()))
                .collect(),
        }
    }
}

/// The same model as one builder per layer, in the order `Mlp::new` creates them.
// ANCHOR: builders
fn mlp_builders(input: i64, hidden: i64, layers: i64, out: i64) -> zerorun::UnitBuilders<'static> {
    let dims = layer_dims(input, hidden, layers, out);
    (0..layers as usize).fold(zerorun::UnitBuilders::new(), |b, i| {
        let (din, dout, last) = (dims[i], dims[i + 1], i + 1 == layers as usize);
        b.unit([format!("layers.{i}")], move |p: &nn::Path| {
            let layer = nn::linear(p / "layers" / i, din, dout, Default::default());
            Box::new(move |x: &Tensor| if last { layer.forward(x) } else { layer.forward(x).gelu("none") })
        })
    })
}
// ANCHOR_END: builders

/// One unit per layer (stage 3 gathers one layer at a time).
// ANCHOR: unit_model
impl UnitModel for Mlp {
    fn unit_prefixes(&self) -> Vec<Vec<String>> {
        (0..self.layers.len()).map(|i| vec![format!("layers.{i}")]).collect()
    }

    fn forward_unit(&self, unit: usize, x: &Tensor) -> Tensor {
        let h = self.layers[unit].forward(x);
        if unit + 1 < self.layers.len() {
            h.gelu("none")
        } else {
            h
        }
    }
}
// ANCHOR_END: unit_model

/// Synthetic regression data: x ~ N(0, 1), y = a fixed random linear map of sin(x), from the seed.
fn synthetic(seed: u64, n: i64, input: i64, out: i64) -> (Tensor, Tensor) {
    let _g = tch::no_grad_guard();
    tch::manual_seed(seed as i64 ^ 0x5EED);
    let x = Tensor::randn([n, input], (Kind::Float, tch::Device::Cpu));
    let w = Tensor::randn([input, out], (Kind::Float, tch::Device::Cpu)) / (input as f64).sqrt();
    let y = x.sin().matmul(&w);
    (x, y)
}

fn load_data(path: &std::path::Path) -> Result<(Tensor, Tensor), String> {
    let tensors = Tensor::read_safetensors(path).map_err(|e| format!("--data {}: {e}", path.display()))?;
    let get = |name: &str| {
        tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.to_kind(Kind::Float))
            .ok_or_else(|| format!("--data {}: no tensor `{name}`", path.display()))
    };
    Ok((get("x")?, get("y")?))
}

fn main() {
    run_main(&Args::parse(), run);
}

fn run(args: &Args) -> Result<(), String> {
    let a = &args.common;
    a.check()?;
    let device = a.device()?;
    let config = load_config(&a.config)?;
    let (x, y) = match &args.data {
        Some(p) => load_data(p)?,
        None => synthetic(a.seed, 1024, args.input, args.out),
    };
    if args.builders && (a.ranks > 1 || args.freeze_first > 0) {
        return Err("--builders draws from libtorch's process-wide generator while the engine packs: run ranks as processes (zerorun launch), without --freeze-first".into());
    }
    if args.freeze_first >= args.layers as usize {
        return Err(format!(
            "--freeze-first {} must leave a layer to train (--layers {})",
            args.freeze_first, args.layers
        ));
    }
    if x.size() != [x.size()[0], args.input] || y.size() != [x.size()[0], args.out] {
        return Err(format!(
            "data shapes x {:?} and y {:?} do not fit --in {} --out {}",
            x.size(),
            y.size(),
            args.input,
            args.out
        ));
    }
    let samples = x.size()[0] as u64;
    // Tensors are not Sync: each rank thread rebuilds them from the plain values.
    let (xv, yv) = (
        Vec::<f32>::try_from(x.reshape([-1])).map_err(|e| e.to_string())?,
        Vec::<f32>::try_from(y.reshape([-1])).map_err(|e| e.to_string())?,
    );
    share_cores(a.ranks);
    let timeout = Duration::from_secs_f64(config.comms_timeout);
    let result = run_ranks(a.ranks, timeout, |comm| {
        let options = EngineOptions { activation_checkpointing: a.activation_checkpointing, ..Default::default() };
        let (_vs, model, kind, mut engine): (nn::VarStore, Box<dyn UnitModel>, Kind, Engine) = if args.builders {
            tch::manual_seed(a.seed as i64);
            let vs = nn::VarStore::new(device);
            let builders = mlp_builders(args.input, args.hidden, args.layers, args.out);
            let builders = match &a.init {
                Some(path) => builders.init_from(path),
                None => builders,
            };
            let (engine, model) =
                Engine::from_builders(&vs, config.clone(), comm, options, builders).map_err(|e| e.to_string())?;
            (vs, Box::new(model), config_kind(&config), engine)
        } else {
            let (mut vs, model) = build_model(a.seed, a.init.as_ref(), |vs| {
                Mlp::new(vs.root(), args.input, args.hidden, args.layers, args.out)
            })?;
            vs.set_device(device);
            let kind = to_config_precision(&config, &mut vs);
            for (name, t) in vs.variables() {
                let layer = name
                    .strip_prefix("layers.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|i| i.parse::<usize>().ok());
                if layer.is_some_and(|i| i < args.freeze_first) {
                    let _ = t.set_requires_grad(false);
                }
            }
            // ANCHOR: engine
            // `options`: `EngineOptions { activation_checkpointing, ..Default::default() }` from the flags. `comm`:
            // this rank's communicator from `run_ranks` (examples/support): under `zerorun launch` it is
            // `zerorun::communicator_from_env(timeout)?`, `timeout` a `std::time::Duration` (the config's
            // `comms_timeout`); with `--ranks N`, one of N thread ranks. `zerorun::initialize(&vs, config)` does
            // the same from the environment when a program needs no options.
            let options = if args.plain_loop { options } else { options.units_of(&model) };
            // The job's communicator as a data-parallel mesh (shard groups from `mics_shard_size`, if set).
            let engine = zerorun::initialize_with(&vs, config.clone(), comm, options).map_err(|e| e.to_string())?;
            // ANCHOR_END: engine
            (vs, Box::new(model), kind, engine)
        };
        let model: &dyn UnitModel = model.as_ref();
        let x = Tensor::from_slice(&xv).view([samples as i64, args.input]).to_device(device).to_kind(kind);
        let y = Tensor::from_slice(&yv).view([samples as i64, args.out]).to_device(device);
        let mut progress = Progress::new(a.steps);
        let first = resume(a, &mut engine)?;
        let training = std::time::Instant::now();
        // ANCHOR: loop
        let mut step = first;
        while step < a.steps {
            // The batch sizes and this rank's place among the data-parallel ranks: fixed, except under
            // `fault_tolerance`, where the replica groups left split the same global batch.
            let b = engine.batch_sizes();
            let (rank, world) = (engine.rank(), engine.world_size());
            let mut rng = Rng::new(a.seed, step);
            let mut redo = false;
            let mut places = Vec::new();
            let order: Vec<i64> = (0..b.train_batch_size).map(|_| rng.below(samples) as i64).collect();
            for m in 0..b.gradient_accumulation_steps {
                let slow = if args.slow_rotate { Some(step as usize % world) } else { args.slow_rank };
                if let (Some(slow), Some(ms)) = (slow, args.slow_ms) {
                    if slow == rank {
                        std::thread::sleep(Duration::from_millis(ms));
                    }
                }
                let range = micro_batch_range(rank, world, m, b.train_micro_batch_size_per_gpu);
                places.extend(range.clone());
                let idx = Tensor::from_slice(&order[range]).to_device(device);
                let input = x.index_select(0, &idx);
                let pred = if args.plain_loop {
                    (0..model.unit_prefixes().len()).fold(input, |h, i| model.forward_unit(i, &h))
                } else if args.scoped {
                    forward_scoped(&mut engine, model, &input)?
                } else {
                    engine.forward(model, &input).map_err(|e| e.to_string())?
                };
                let loss = pred.to_kind(Kind::Float).mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
                if args.plain_loop || args.scoped {
                    engine.backward(&loss).map_err(|e| e.to_string())?;
                } else {
                    engine.backward_units(model, &loss).map_err(|e| e.to_string())?;
                }
                let outcome = engine.step().map_err(|e| e.to_string())?;
                progress.record(&engine, outcome);
                maybe_save(a, &mut engine, outcome)?;
                // A step the replica groups discarded (one was lost during it) is redone by those left.
                redo |= matches!(outcome, StepOutcome::Discarded { .. });
                if let (true, StepOutcome::Stepped { step, .. }) = (args.log_samples, outcome) {
                    let list: Vec<String> = places.iter().map(usize::to_string).collect();
                    println!("samples step {step}: {}", list.join(","));
                }
                if let (Some(k), Some(r), StepOutcome::Stepped { step, .. }) =
                    (args.crash_after_step, args.crash_rank, outcome)
                {
                    let first_start = std::env::var_os(zerorun::runtime::fault_tolerance::REJOIN_ENV).is_none();
                    let this = std::env::var("RANK").ok().and_then(|v| v.parse::<usize>().ok());
                    if step == k && first_start && this == Some(r) {
                        std::process::abort();
                    }
                }
            }
            if !redo {
                step += 1;
            }
        }
        // ANCHOR_END: loop
        // Asynchronous training ends with every rank holding the final values (a no-op when synchronous).
        engine.finish().map_err(|e| e.to_string())?;
        let train_s = training.elapsed().as_secs_f64();
        // The trained model's loss on the whole data set (every rank holds the same model now; local SGD's ranks
        // after a meeting), comparable across modes that saw the same samples.
        let eval_loss = tch::no_grad(|| -> Result<f64, String> {
            let pred = engine.forward(model, &x).map_err(|e| e.to_string())?;
            Ok(pred.to_kind(Kind::Float).mse_loss(&y, tch::Reduction::Mean).double_value(&[]))
        })?;
        if engine.rank() == 0 {
            let samples = (a.steps - first) * engine.batch_sizes().train_batch_size;
            println!("train_samples_per_s {:.3}", samples as f64 / train_s.max(1e-9));
            println!("eval_loss {eval_loss:.6}");
        }
        let counts = engine.staleness_counts();
        if !counts.is_empty() {
            // Bounded staleness: the gradients this rank applied as an owner, by how stale they were.
            println!("staleness_counts {counts:?}");
        }
        finish_rank(a, &mut engine, &progress)
    })?;
    print_summary(result, &config, a.steps);
    Ok(())
}
