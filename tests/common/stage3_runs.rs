//! Stage 3's test runs: the MLP of `mlp.rs` with one unit per layer or as one unit, on thread ranks or given
//! communicators, every rank's final full parameters, peak gathered bytes, memory and comm volume. Used by
//! `stage3.rs` and `zeropp.rs`, which include `mlp.rs` as `mlp` beside it.
#![allow(dead_code)]
use std::time::Duration;

use serde_json::{json, Value};
use tch::Tensor;
use zerorun::runtime::comm::{threads, Communicator};
use zerorun::{Config, Engine, EngineOptions, Whole};

use crate::compare::full_parameters;
use crate::mlp::*;

#[derive(Clone, Copy, Debug)]
pub enum Units {
    PerLayer,
    Whole,
}

pub fn config(gas: u64, zero: Value) -> Config {
    let mut z = json!({"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0});
    for (k, v) in zero.as_object().unwrap() {
        z[k] = v.clone();
    }
    Config::from_value(json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": z
    }))
    .unwrap()
}

/// What one rank saw: final full parameters (sorted by name), peak gathered bytes, comm volume of one step.
pub struct RankRun {
    pub params: Vec<(String, Vec<f32>)>,
    pub peak_gathered: usize,
    pub memory: Vec<(zerorun::runtime::report::MemoryCategory, usize)>,
    pub volume_per_step: u64,
}

pub fn run(world: usize, config: Config, units: Units, checkpointing: bool, dims: &[i64]) -> Vec<RankRun> {
    let options = EngineOptions { activation_checkpointing: checkpointing, ..Default::default() };
    run_with(world, config, units, options, dims)
}

pub fn run_with(world: usize, config: Config, units: Units, options: EngineOptions, dims: &[i64]) -> Vec<RankRun> {
    let comms =
        threads::group(world, Duration::from_secs(60)).into_iter().map(|c| Box::new(c) as Box<dyn Communicator>);
    run_on(comms.collect(), config, units, options, dims)
}

pub fn run_on(
    comms: Vec<Box<dyn Communicator>>,
    config: Config,
    units: Units,
    options: EngineOptions,
    dims: &[i64],
) -> Vec<RankRun> {
    let world = comms.len();
    let (xv, yv) = data();
    let dims = dims.to_vec();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (config, xv, yv, dims, options) = (config.clone(), &xv, &yv, dims.clone(), options.clone());
                s.spawn(move || {
                    let (x, y) =
                        (Tensor::from_slice(xv).view([SAMPLES, IN]), Tensor::from_slice(yv).view([SAMPLES, OUT]));
                    let (vs, layers) = init_layers(&dims);
                    let whole = Whole(|x: &Tensor| layers.forward_all(x));
                    let model: &dyn zerorun::UnitModel = match units {
                        Units::PerLayer => &layers,
                        Units::Whole => &whole,
                    };
                    let options = options.units_of(model);
                    let mut engine = Engine::new(&vs, config, comm, options).unwrap();
                    let b = engine.batch_sizes();
                    let (rank, micro) = (engine.rank() as i64, b.train_micro_batch_size_per_gpu as i64);
                    let mut volume_per_step = 0;
                    for step in 0..STEPS {
                        let before = engine.comm_volume();
                        let order = batch_indices(step);
                        for m in 0..b.gradient_accumulation_steps as i64 {
                            let first = ((m * world as i64 + rank) * micro) as usize;
                            let idx = Tensor::from_slice(&order[first..first + micro as usize]);
                            let pred = engine.forward(model, &x.index_select(0, &idx)).unwrap();
                            let loss = pred.mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
                            engine.backward_units(model, &loss).unwrap();
                            engine.step().unwrap();
                        }
                        let after = engine.comm_volume();
                        volume_per_step = (after.all_gather_elements - before.all_gather_elements)
                            + (after.reduce_scatter_elements - before.reduce_scatter_elements);
                    }
                    let peak_gathered = engine.gathered_bytes().peak;
                    let memory = engine.memory_bytes();
                    let params = full_parameters(&mut engine);
                    RankRun { params, peak_gathered, memory, volume_per_step }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

pub const DIMS: [i64; 4] = [IN, HIDDEN, HIDDEN, OUT];
