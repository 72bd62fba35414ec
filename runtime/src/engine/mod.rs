//! The ZeRO engine for stages 0-2: wraps a tch `VarStore` so a training loop shards its optimizer states
//! (stage 1) and gradients (stage 2) across the data-parallel ranks of a [`Communicator`].
//!
//! Parameters are packed into one contiguous fp32 buffer and the model's tensors become views into it
//! (`set_data`), so the optimizer steps the model's own storage. Each step, gradients are gathered into a flat
//! gradient buffer, reduced (all-reduce at stage 0, reduce-scatter at stages 1-2), clipped by the global norm,
//! stepped on the owned partition, and the updated partitions all-gathered.
pub mod layout;
mod optimizer;

use std::time::Instant;

use tch::{nn, Kind, Tensor};
use zerorun_optim::norm;
use zerorun_optim::schedule::LrScheduler;
use zerorun_optim::{Grads, Group, Optimizer};

use crate::comm::{Collectives, Communicator, ReduceOp};
use crate::config::{BatchSizes, Config, OffloadDevice, OptimizerConfig, Precision};
use crate::error::{Error, Result};
pub use layout::{FlatLayout, ParamSlot};

/// What `step` did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutcome {
    /// Not at a gradient-accumulation boundary: gradients were kept, nothing else happened.
    Accumulating,
    /// An optimizer step was taken; `loss` is the mean over micro-batches and ranks.
    Stepped { step: u64, loss: f64, grad_norm: f64, lr: f64 },
}

/// Options a program sets in code rather than in ds_config.json.
#[derive(Clone, Default)]
pub struct EngineOptions {
    /// Parameters (by name) that get no weight decay, e.g. biases and norm weights.
    pub no_weight_decay: Option<fn(&str, &[i64]) -> bool>,
}

/// Biases and norm weights (1-D parameters) get no weight decay: the usual transformer recipe.
pub fn no_decay_for_1d(_name: &str, shape: &[i64]) -> bool {
    shape.len() <= 1
}

pub struct Engine {
    comm: Box<dyn Communicator>,
    config: Config,
    batch: BatchSizes,
    layout: FlatLayout,
    /// The model's parameters, in layout order; views into `flat_params`.
    params: Vec<Tensor>,
    flat_params: Tensor,
    flat_grads: Tensor,
    /// This rank's reduced gradient partition (stages 1-2).
    grad_shard: Vec<f32>,
    optimizer: Box<dyn Optimizer>,
    /// Groups relative to the optimized range (the partition at stages 1-2, everything at stage 0).
    groups: Vec<Group>,
    optimized: std::ops::Range<usize>,
    base_lr: f64,
    scheduler: Option<LrScheduler>,
    micro_steps: u64,
    global_steps: u64,
    global_samples: u64,
    loss_sum: f64,
    loss_count: u64,
    step_started: Option<Instant>,
}

/// A contiguous fp32 CPU tensor's elements.
fn f32_slice(t: &Tensor) -> &mut [f32] {
    debug_assert!(t.kind() == Kind::Float && t.is_contiguous());
    let n = t.numel();
    if n == 0 {
        return &mut [];
    }
    // SAFETY: the tensor is contiguous fp32 on the CPU and outlives the returned slice at every call site.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n) }
}

impl Engine {
    /// Wraps the trainable variables of `vs` for data-parallel training with `comm`.
    pub fn new(vs: &nn::VarStore, config: Config, comm: Box<dyn Communicator>, options: EngineOptions) -> Result<Engine> {
        let world_size = comm.world_size();
        let rank = comm.rank();
        let batch = config.batch_sizes(world_size)?;
        let z = &config.zero_optimization;
        if z.stage == 3 {
            return Err(Error::Unsupported { key: "zero_optimization.stage", value: "3".into(), why: "stage 3 is not in this build yet; use stage 0, 1 or 2" });
        }
        if z.offload_optimizer.device != OffloadDevice::None {
            return Err(Error::Unsupported {
                key: "zero_optimization.offload_optimizer.device",
                value: format!("{:?}", z.offload_optimizer.device).to_lowercase(),
                why: "optimizer offload is not in this build yet; remove the offload_optimizer section",
            });
        }
        if config.precision() != Precision::Fp32 {
            let key = if config.fp16.enabled { "fp16.enabled" } else { "bf16.enabled" };
            return Err(Error::Unsupported { key, value: "true".into(), why: "16-bit model weights are not in this build yet; train in fp32" });
        }
        if let Some(OptimizerConfig::Lamb(_)) = &config.optimizer {
            return Err(Error::Unsupported { key: "optimizer.type", value: "\"Lamb\"".into(), why: "Lamb needs per-tensor trust ratios across ranks, not in this build yet" });
        }

        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        if named.is_empty() {
            return Err(Error::Usage("the VarStore has no trainable parameters".into()));
        }
        for (name, t) in &named {
            if t.device() != tch::Device::Cpu {
                return Err(Error::Parameter { name: name.clone(), why: format!("is on {:?}; this build trains on the CPU", t.device()) });
            }
            if t.kind() != Kind::Float {
                return Err(Error::Parameter { name: name.clone(), why: format!("has dtype {:?}; fp32 parameters are expected", t.kind()) });
            }
        }
        let specs: Vec<(String, Vec<i64>, bool)> = named
            .iter()
            .map(|(n, t)| {
                let shape = t.size();
                let decay = !options.no_weight_decay.is_some_and(|f| f(n, &shape));
                (n.clone(), shape, decay)
            })
            .collect();
        let layout = FlatLayout::new(&specs, world_size);

        // Pack the parameters into the flat buffer and make the model's tensors views into it.
        let flat_params = Tensor::zeros([layout.padded as i64], (Kind::Float, tch::Device::Cpu));
        let mut params = Vec::with_capacity(named.len());
        tch::no_grad(|| {
            for ((_, mut t), slot) in named.into_iter().zip(&layout.slots) {
                let mut view = flat_params.narrow(0, slot.range.start as i64, slot.range.len() as i64);
                view.copy_(&t.reshape([-1]));
                t.set_data(&view.view(slot.shape.as_slice()));
                params.push(t);
            }
        });
        // Every rank starts from rank 0's weights.
        comm.broadcast(f32_slice(&flat_params), 0)?;

        let optimized = if z.stage == 0 { 0..layout.padded } else { layout.partition(rank) };
        let (optimizer, base_lr, weight_decay) = optimizer::build(&config, optimized.len());
        let groups = layout
            .decay_runs(optimized.clone())
            .into_iter()
            .map(|(range, decay)| Group { range, lr: base_lr, weight_decay: if decay { weight_decay } else { 0.0 } })
            .collect();
        let scheduler = optimizer::scheduler(&config, base_lr);
        let grad_shard = if z.stage == 0 { Vec::new() } else { vec![0f32; layout.partition_len()] };
        let flat_grads = Tensor::zeros([layout.padded as i64], (Kind::Float, tch::Device::Cpu));
        tracing::info!(rank, world_size, stage = z.stage, params = layout.numel, partition = layout.partition_len(), "zerorun engine ready");
        Ok(Engine {
            comm,
            config,
            batch,
            layout,
            params,
            flat_params,
            flat_grads,
            grad_shard,
            optimizer,
            groups,
            optimized,
            base_lr,
            scheduler,
            micro_steps: 0,
            global_steps: 0,
            global_samples: 0,
            loss_sum: 0.0,
            loss_count: 0,
            step_started: None,
        })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn batch_sizes(&self) -> BatchSizes {
        self.batch
    }

    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    pub fn global_steps(&self) -> u64 {
        self.global_steps
    }

    pub fn global_samples(&self) -> u64 {
        self.global_samples
    }

    /// The learning rate the next optimizer step uses.
    pub fn lr(&self) -> f64 {
        self.scheduler.as_ref().map_or(self.base_lr, LrScheduler::lr)
    }

    /// Whether the next `step` is an optimizer step (the last micro-batch of an accumulation).
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0
    }

    /// Backward of one micro-batch's loss, scaled by 1/gradient_accumulation_steps as DeepSpeed does.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        if self.step_started.is_none() {
            self.step_started = Some(Instant::now());
        }
        self.loss_sum += loss.f_double_value(&[])?;
        self.loss_count += 1;
        let gas = self.batch.gradient_accumulation_steps;
        if gas > 1 {
            (loss / gas as f64).f_backward()?;
        } else {
            loss.f_backward()?;
        }
        Ok(())
    }

    /// Ends a micro-batch; at the accumulation boundary reduces gradients and steps the optimizer.
    pub fn step(&mut self) -> Result<StepOutcome> {
        self.micro_steps += 1;
        if self.micro_steps % self.batch.gradient_accumulation_steps != 0 {
            return Ok(StepOutcome::Accumulating);
        }
        self.collect_grads()?;
        let lr = self.lr();
        let stage = self.config.zero_optimization.stage;
        let grads: &mut [f32] = if stage == 0 {
            let g = f32_slice(&self.flat_grads);
            self.comm.all_reduce(g, ReduceOp::Avg)?;
            g
        } else {
            let full = f32_slice(&self.flat_grads);
            if self.config.zero_optimization.reduce_scatter {
                self.comm.reduce_scatter(full, &mut self.grad_shard, ReduceOp::Avg)?;
            } else {
                self.comm.all_reduce(full, ReduceOp::Avg)?;
                self.grad_shard.copy_from_slice(&full[self.optimized.clone()]);
            }
            &mut self.grad_shard
        };

        // Global gradient norm: the ranks' partitions are disjoint, so one all-reduce of a scalar suffices.
        let mut sq = [norm::sum_of_squares(Grads::F32(grads)) as f32];
        if stage > 0 {
            self.comm.all_reduce(&mut sq, ReduceOp::Sum)?;
        }
        let grad_norm = (sq[0] as f64).sqrt();
        let coef = norm::clip_coefficient(grad_norm, self.config.gradient_clipping);
        if coef < 1.0 {
            norm::scale_in_place(grads, coef as f32);
        }

        for g in &mut self.groups {
            g.lr = lr;
        }
        let params = &mut f32_slice(&self.flat_params)[self.optimized.clone()];
        self.optimizer.step(params, Grads::F32(grads), &self.groups, None)?;
        if stage > 0 {
            self.comm.all_gather_in_place(f32_slice(&self.flat_params))?;
        }
        if let Some(s) = self.scheduler.as_mut() {
            s.step();
        }
        self.global_steps += 1;
        self.global_samples += self.batch.train_batch_size;

        let mut loss = [(self.loss_sum / self.loss_count.max(1) as f64) as f32];
        self.comm.all_reduce(&mut loss, ReduceOp::Avg)?;
        self.loss_sum = 0.0;
        self.loss_count = 0;
        let loss = loss[0] as f64;
        if let Some(every) = self.config.steps_per_print {
            if self.global_steps % every == 0 && self.rank() == 0 {
                let secs = self.step_started.map_or(0.0, |t| t.elapsed().as_secs_f64());
                let samples_per_s = if secs > 0.0 { self.batch.train_batch_size as f64 / secs } else { 0.0 };
                tracing::info!(step = self.global_steps, loss, lr, grad_norm, samples_per_s, "train");
            }
        }
        self.step_started = None;
        Ok(StepOutcome::Stepped { step: self.global_steps, loss, grad_norm, lr })
    }

    /// Copies every parameter's gradient into the flat buffer and clears it for the next accumulation.
    fn collect_grads(&mut self) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for (t, slot) in self.params.iter_mut().zip(&self.layout.slots) {
                let mut dst = self.flat_grads.narrow(0, slot.range.start as i64, slot.range.len() as i64);
                let g = t.grad();
                if g.defined() {
                    dst.f_copy_(&g.reshape([-1]))?;
                    t.zero_grad();
                } else {
                    // A parameter this step did not use: zero gradient, as DDP's ignore_unused_parameters.
                    let _ = dst.f_zero_()?;
                }
            }
            Ok(())
        })
    }

    /// Every parameter by name, full fp32 (the model's own values; identical on every rank).
    pub fn full_parameters(&self) -> Vec<(String, Tensor)> {
        self.layout.slots.iter().zip(&self.params).map(|(s, t)| (s.name.clone(), t.detach().copy())).collect()
    }

    /// Model-state bytes this rank holds, by category (fp32 training: parameters, gradients, optimizer states).
    pub fn memory_bytes(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("parameters", self.layout.padded * 4),
            ("gradients_full", self.layout.padded * 4),
            ("gradients_shard", self.grad_shard.len() * 4),
            ("optimizer_states", self.optimizer.state().bytes()),
        ]
    }
}
