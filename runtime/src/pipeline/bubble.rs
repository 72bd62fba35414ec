//! The measured bubble of [`PipelineEngine`] on stages of equal, known cost (what `zerorun bench pipeline` runs):
//! every layer's forward sleeps a fixed time and so does its backward (a hook on its one parameter, called when
//! autograd accumulated its gradient). Sleeping rather than computing keeps the costs exact when more stages than
//! cores run at once. Each stage's idle fraction is 1 - (its forward and backward time) / (the step), averaged over
//! the stages; the result is the median over the timed steps.
use std::ffi::c_void;
use std::time::Duration;

use tch::{nn, Tensor};

use super::{MicroBatch, PipelineEngine, PipelineModel, StagePlacement};
use crate::comm::threads;
use crate::config::Config;
use crate::engine::device::native;
use crate::engine::EngineOptions;
use crate::error::{Error, Result};
use crate::mesh::{Mesh, MeshOptions};

/// One case: which schedule, on how many stages (thread ranks), with how many micro-batches.
#[derive(Debug, Clone, Copy)]
pub struct BubbleCase {
    /// "gpipe", "1f1b" or "interleaved".
    pub schedule: &'static str,
    /// Pipeline stages.
    pub stages: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Chunks per stage (interleaved; else 1).
    pub virtual_stages: usize,
    /// A stage's forward time (and its backward's): split evenly over its chunks.
    pub stage_time: Duration,
    /// Timed steps (one more runs first).
    pub steps: usize,
}

impl BubbleCase {
    /// (p - 1) / (v m + p - 1).
    pub fn theory(&self) -> f64 {
        (self.stages - 1) as f64 / (self.virtual_stages * self.micro_batches + self.stages - 1) as f64
    }
}

extern "C" fn sleep_micros(_ctx: *mut c_void, micros: i64) {
    std::thread::sleep(Duration::from_micros(micros as u64));
}

/// Runs `case` on thread ranks and returns the measured idle fraction.
pub fn measure(case: &BubbleCase) -> Result<f64> {
    let (p, m, v) = (case.stages, case.micro_batches, case.virtual_stages);
    let mut pipeline = serde_json::json!({"schedule": case.schedule, "allow_fewer_micro_batches": true});
    if v > 1 {
        pipeline["virtual_stages"] = v.into();
    }
    let config = Config::from_value(serde_json::json!({
        "train_batch_size": m, "gradient_accumulation_steps": m, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": 0}, "pipeline": pipeline, "comms_timeout": 300,
    }))?;
    let per_layer = case.stage_time / v as u32;
    let comms = threads::group(p, Duration::from_secs(300));
    let results: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let config = &config;
                s.spawn(move || -> Result<Vec<f64>> {
                    let options = MeshOptions { pipeline_stages: Some(p), ..Default::default() };
                    let mesh = Mesh::from_config(Box::new(comm), config, options)?;
                    let placement = StagePlacement::of(&mesh, &config.pipeline);
                    let mut model = PipelineModel::new(|out: &Tensor, _labels: &Tensor| out.mean(None));
                    for i in 0..p * v {
                        model = model.layer(format!("layer{i}"), move |path: &nn::Path| {
                            let w = path.var(&format!("w{i}"), &[1], nn::Init::Const(1.0));
                            Box::new(move |x: &Tensor| {
                                std::thread::sleep(per_layer);
                                x * &w
                            })
                        });
                    }
                    let vs = nn::VarStore::new(tch::Device::Cpu);
                    let stage = model.build_stage(&vs, &placement, &config.pipeline.partition)?;
                    let mut engine = PipelineEngine::new(&vs, config.clone(), mesh, EngineOptions::default(), stage)?;
                    for w in vs.trainable_variables() {
                        native::on_grad_ready(&w, sleep_micros, std::ptr::null_mut(), per_layer.as_micros() as usize)?;
                    }
                    let mut idle = Vec::new();
                    for step in 0..=case.steps {
                        let mut batches = (0..m).map(|_| MicroBatch {
                            inputs: Some(Tensor::ones([1, 16], tch::kind::FLOAT_CPU)),
                            labels: Some(Tensor::zeros([1], tch::kind::FLOAT_CPU)),
                        });
                        engine.train_batch(&mut batches)?;
                        if step > 0 {
                            idle.push(engine.last_times().idle_fraction());
                        }
                    }
                    for w in vs.trainable_variables() {
                        native::remove_grad_ready(&w);
                    }
                    Ok(idle)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::Usage("a rank panicked".into())))).collect()
    });
    let per_stage: Vec<Vec<f64>> = results.into_iter().collect::<Result<_>>()?;
    let mut per_step: Vec<f64> =
        (0..case.steps).map(|i| per_stage.iter().map(|s| s[i]).sum::<f64>() / p as f64).collect();
    per_step.sort_by(f64::total_cmp);
    Ok(per_step[per_step.len() / 2])
}
