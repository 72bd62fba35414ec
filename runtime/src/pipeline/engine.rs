//! [`PipelineEngine`]: runs this rank's actions of a schedule ([`super::schedule`]) over its stage's layers, with a
//! ZeRO [`Engine`] (stages 0-2) over the stage's data-parallel group doing the gradients and the optimizer.
//!
//! What the pipeline adds to the engine, and where:
//! - the engine reduces once per step: fp32 gradients accumulate in autograd over the micro-batches and stage 2
//!   reduce-scatters them during the last backward (`Engine::set_requires_gradient_sync`), never once per
//!   micro-batch as DeepSpeed would (which is why it refuses stage 2 with pipelines);
//! - the gradient norm, clipping and the fp16 overflow verdict are agreed over the whole pipeline
//!   (the mesh's `pipe x tensor` group), so every stage clips by the same factor and skips the same steps;
//! - a stage's backward starts from the gradient the next stage sent (`Engine::backward_output`); only the last
//!   stage has a loss, which it scales as a plain loop's would, and which every stage gets back at the step.
use std::time::{Duration, Instant};

use tch::{nn, Tensor};

use super::link::{recv_bytes, recv_tensor, send_bytes, send_tensor, StageLink};
use super::model::StageModel;
use super::placement::StagePlacement;
use super::schedule::{self, Action, Kind};
use super::PipelineError;
use crate::comm::{Collectives, Communicator};
use crate::config::{Config, ScheduleName};
use crate::engine::{Engine, EngineOptions, StepOutcome};
use crate::error::{Error, Result};
use crate::mesh::{Dim, Mesh};

/// One micro-batch as a stage sees it: the first stage needs the inputs, the last the labels; the others get None.
#[derive(Debug, Default)]
pub struct MicroBatch {
    /// The first stage's inputs.
    pub inputs: Option<Tensor>,
    /// The last stage's labels.
    pub labels: Option<Tensor>,
}

/// Where a stage's time went in its last step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimes {
    /// The whole `train_batch` call.
    pub step: Duration,
    /// Forwards and backwards (with the loss).
    pub compute: Duration,
    /// Blocked on the neighbours: receives, and the sends still in flight at the end of the step.
    pub wait: Duration,
    /// The optimizer's update (the engine's step phase: not the waits for the other stages inside the step).
    pub optimizer: Duration,
}

impl StageTimes {
    fn fraction(&self, part: Duration) -> f64 {
        let step = self.step.as_secs_f64();
        if step == 0.0 {
            return 0.0;
        }
        (part.as_secs_f64() / step).clamp(0.0, 1.0)
    }

    /// The idle fraction: the part of the step this stage was neither computing nor stepping the optimizer (the
    /// schedule's bubble, and waits beyond it).
    pub fn idle_fraction(&self) -> f64 {
        self.fraction(self.step.saturating_sub(self.compute + self.optimizer))
    }

    /// The part of the step spent blocked on the neighbours.
    pub fn wait_fraction(&self) -> f64 {
        self.fraction(self.wait)
    }

    /// The part of the step spent in the optimizer step.
    pub fn optimizer_fraction(&self) -> f64 {
        self.fraction(self.optimizer)
    }
}

/// A pipeline stage's engine: runs the schedule's actions for this stage, exchanges activations and gradients with its neighbours, and steps a ZeRO engine (stages 0-2) over the stage's data-parallel group.
pub struct PipelineEngine<'a> {
    pub(super) engine: Engine,
    pub(super) model: StageModel<'a>,
    pub(super) placement: StagePlacement,
    pub(super) link: StageLink,
    /// Collectives over this rank's pipeline (one rank per stage): the loss, the full model.
    pub(super) pipe: Box<dyn Communicator>,
    /// Tied weights' gradients and values between their owner and replica stages (on the schedule's thread).
    pub(super) tied_group: Box<dyn Communicator>,
    /// This stage's actions for one optimizer step.
    pub(super) actions: Vec<Action>,
    /// Every stage's simulated activations peak and the schedule's bubble, as [`schedule::validate`] found them.
    pub(super) simulation: schedule::Simulation,
    pub(super) last_times: StageTimes,
    /// Sums over the steps so far, and their number.
    pub(super) total_times: StageTimes,
    pub(super) timed_steps: u32,
    /// Every rank, laid out (splits of it are the engine's and the link's groups).
    pub(super) mesh: Mesh,
}

impl<'a> PipelineEngine<'a> {
    /// The pipeline of `mesh` (its `pipe` dimension; each stage's ranks data parallel and, when the mesh has a
    /// tensor dimension, split across tensor-parallel groups whose layers recorded their placements on the mesh),
    /// with `model` built for this rank's stage on `vs` (see [`super::PipelineModel::build_stage`] and
    /// [`StagePlacement::of`]). Collective.
    pub fn new(
        vs: &nn::VarStore,
        config: Config,
        mesh: Mesh,
        options: EngineOptions,
        model: StageModel<'a>,
    ) -> Result<PipelineEngine<'a>> {
        if config.zero_optimization.stage > 2 {
            return Err(Error::Unsupported {
                key: "zero_optimization.stage",
                value: config.zero_optimization.stage.to_string(),
                why: "a pipeline stage runs ZeRO 0, 1 or 2 over its data-parallel group: stage 3 would gather every layer of the stage at every micro-batch's forward and backward; use stage 2 (a stage already holds only its own layers)",
            });
        }
        if let Some(size) = config.zero_optimization.mics_shard_size.filter(|&s| s as usize != mesh.shape().data()) {
            return Err(Error::Unsupported {
                key: "zero_optimization.mics_shard_size",
                value: size.to_string(),
                why: "shard groups run on a data-parallel mesh; with pipeline stages they are not built yet",
            });
        }
        crate::mesh::refuse_adjacent_groups(&config, "with pipeline stages not yet")?;
        if options.units.is_some() {
            return Err(Error::Usage(
                "a pipeline stage runs its layers itself: leave EngineOptions::units unset".into(),
            ));
        }
        let placement = StagePlacement::of(&mesh, &config.pipeline);
        // Checked before any group is made, and the same on every rank, so every rank fails alike.
        if model.ties_cross_stages() && placement.chunks > 1 {
            return Err(PipelineError::Model(
                "tied weights across stages run with the gpipe and 1f1b schedules; the interleaved schedule does not exchange them yet".into(),
            )
            .into());
        }
        let data = mesh.group(&[Dim::Replicate, Dim::Shard])?;
        let link = StageLink::new(mesh.group(&[Dim::Pipeline])?)?;
        let pipe = mesh.group(&[Dim::Pipeline])?;
        let tied_group = mesh.group(&[Dim::Pipeline])?;
        let pipeline = config.pipeline.clone();
        // Replicas live outside the VarStore: they take the precision the program gave the model's variables.
        let kind = match config.precision() {
            crate::config::Precision::Bf16 => tch::Kind::BFloat16,
            crate::config::Precision::Fp16 => tch::Kind::Half,
            crate::config::Precision::Fp32 => tch::Kind::Float,
        };
        for t in model.tied().iter().filter(|t| t.owner != placement.stage) {
            let mut replica = t.tensor.shallow_clone();
            tch::no_grad(|| replica.set_data(&t.tensor.to_kind(kind)));
        }
        let mut engine = Engine::new(vs, config, data, options)?;
        // The norm and the fp16 overflow verdict span the whole model: every stage and tensor-parallel rank.
        engine.join_mesh(&mesh)?;
        let m = engine.batch_sizes().gradient_accumulation_steps as usize;
        let kind = match pipeline.schedule {
            ScheduleName::OneFOneB => Kind::OneFOneB,
            ScheduleName::GPipe => Kind::GPipe,
            ScheduleName::Interleaved => Kind::Interleaved(placement.chunks),
        };
        let plan = schedule::build(kind, placement.stages, m, pipeline.allow_fewer_micro_batches)
            .map_err(PipelineError::from)?;
        let simulation = schedule::validate(&plan).map_err(PipelineError::from)?;
        let actions = plan[placement.stage].clone();
        if placement.rank == 0 {
            tracing::info!(
                stages = placement.stages,
                data_parallel = placement.data_parallel,
                tensor_parallel = placement.tensor_parallel,
                micro_batches = m,
                schedule = ?kind,
                bubble = simulation.bubble,
                peak_activations = ?simulation.peak_activations,
                "pipeline ready"
            );
        }
        Ok(PipelineEngine {
            engine,
            model,
            placement,
            link,
            pipe,
            tied_group,
            actions,
            simulation,
            last_times: StageTimes::default(),
            total_times: StageTimes::default(),
            timed_steps: 0,
            mesh,
        })
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches pulled from `micro_batches` in order.
    /// Every rank calls it; the outcome's loss is the mean over the micro-batches and the data-parallel ranks, on
    /// every stage.
    pub fn train_batch(&mut self, micro_batches: &mut dyn Iterator<Item = MicroBatch>) -> Result<StepOutcome> {
        let started = Instant::now();
        let (mut compute, mut optimizer) = (Duration::ZERO, Duration::ZERO);
        self.link.take_wait();
        let m = self.micro_batches();
        let v = self.placement.chunks;
        let mut batches = self.take_micro_batches(micro_batches)?;
        // Per (micro-batch, chunk): the received input (a leaf), the output (the loss on the last part), the
        // gradient received for the output or computed for the input.
        let slot = |mb: usize, chunk: usize| mb * v + chunk;
        let empty = || -> Vec<Option<Tensor>> { (0..m * v).map(|_| None).collect() };
        let (mut inputs, mut outputs, mut grads) = (empty(), empty(), empty());
        let mut backwards = 0;
        let last_backward = self.actions.iter().rposition(|a| matches!(a, Action::Backward { .. }));
        let mut outcome = None;
        for (index, action) in self.actions.clone().into_iter().enumerate() {
            match action {
                Action::RecvActivation { mb, chunk } => {
                    let received = self.link.recv_activation()?.to_device(self.engine.device());
                    inputs[slot(mb, chunk)] = Some(received.set_requires_grad(true));
                }
                Action::Forward { mb, chunk } => {
                    let t = Instant::now();
                    let input = if self.placement.is_first(chunk) {
                        batches[mb].inputs.take().ok_or_else(|| self.missing("inputs", mb))?
                    } else {
                        inputs[slot(mb, chunk)].as_ref().expect("received before its forward").shallow_clone()
                    };
                    let out = self.model.forward(chunk, &input);
                    outputs[slot(mb, chunk)] = Some(if self.placement.is_last(chunk) {
                        let labels = batches[mb].labels.take().ok_or_else(|| self.missing("labels", mb))?;
                        self.model.loss(&out, &labels).expect("the last stage has the loss")
                    } else {
                        out
                    });
                    compute += t.elapsed();
                }
                Action::SendActivation { mb, chunk } => {
                    self.link
                        .send_activation(outputs[slot(mb, chunk)].as_ref().expect("computed before it is sent"))?;
                }
                Action::RecvGradient { mb, chunk } => {
                    grads[slot(mb, chunk)] = Some(self.link.recv_gradient()?.to_device(self.engine.device()))
                }
                Action::Backward { mb, chunk } => {
                    if last_backward == Some(index) {
                        // Every replica's gradient is complete (their stages' backwards come first).
                        self.receive_tied_gradients()?;
                    }
                    let t = Instant::now();
                    let at = slot(mb, chunk);
                    let out = outputs[at].take().expect("forward before backward");
                    // Gradients accumulate over the step's micro-batches and are reduced once, during the last.
                    let last_micro_batch = self.engine.is_gradient_accumulation_boundary();
                    self.engine.set_requires_gradient_sync(last_micro_batch);
                    if self.placement.is_last(chunk) {
                        self.engine.backward(&out)?;
                    } else {
                        self.engine.backward_output(&out, &grads[at].take().expect("received before backward"))?;
                    }
                    if !self.placement.is_first(chunk) {
                        grads[at] = Some(inputs[at].take().expect("received before backward").grad());
                    }
                    // The engine counts backwards at `step`: one step per micro-batch (its chunks' backwards all
                    // accumulate), and the last one is the optimizer step.
                    backwards += 1;
                    if backwards % v == 0 && backwards < m * v {
                        self.engine.step()?;
                    }
                    compute += t.elapsed();
                }
                Action::SendGradient { mb, chunk } => {
                    let at = slot(mb, chunk);
                    self.link.send_gradient(grads[at].as_ref().expect("computed before it is sent"))?;
                    grads[at] = None;
                }
                // The engine reduces at its step (stage 2: during the last backward already).
                Action::ReduceGradients => {}
                Action::OptimizerStep => {
                    // The update's own time: waits for the other stages inside the step (the norm's all-reduce,
                    // the tied weights) are the schedule's bubble, not the optimizer's.
                    let before = self.engine.optimizer_time();
                    self.send_tied_gradients()?;
                    outcome = Some(self.engine.step()?);
                    self.exchange_tied_values()?;
                    optimizer += self.engine.optimizer_time().saturating_sub(before);
                }
            }
        }
        self.link.finish_sends()?;
        let outcome = outcome.expect("every schedule ends with the optimizer step");
        let outcome = self.with_pipeline_loss(outcome)?;
        self.last_times = StageTimes { step: started.elapsed(), compute, wait: self.link.take_wait(), optimizer };
        self.total_times.step += self.last_times.step;
        self.total_times.compute += self.last_times.compute;
        self.total_times.wait += self.last_times.wait;
        self.total_times.optimizer += self.last_times.optimizer;
        self.timed_steps += 1;
        Ok(outcome)
    }

    /// The mean loss over `gradient_accumulation_steps` micro-batches and the data-parallel ranks, forward only
    /// (no gradients, nothing stepped), on every stage.
    pub fn eval_batch(&mut self, micro_batches: &mut dyn Iterator<Item = MicroBatch>) -> Result<f64> {
        let m = self.micro_batches();
        let mut batches = self.take_micro_batches(micro_batches)?;
        let mut sum = 0.0;
        // Every micro-batch through every chunk in turn: forwards only, no schedule to keep activations for.
        for (mb, batch) in batches.iter_mut().enumerate() {
            for chunk in 0..self.placement.chunks {
                let input = if self.placement.is_first(chunk) {
                    batch.inputs.take().ok_or_else(|| self.missing("inputs", mb))?
                } else {
                    self.link.recv_activation()?.to_device(self.engine.device())
                };
                let out = tch::no_grad(|| self.model.forward(chunk, &input));
                if self.placement.is_last(chunk) {
                    let labels = batch.labels.take().ok_or_else(|| self.missing("labels", mb))?;
                    let loss = tch::no_grad(|| self.model.loss(&out, &labels).expect("the last stage has the loss"));
                    sum += loss.f_double_value(&[])?;
                } else {
                    self.link.send_activation(&out)?;
                }
            }
        }
        self.link.finish_sends()?;
        let mut loss = [(sum / m as f64) as f32];
        if self.placement.is_last(self.placement.chunks - 1) {
            self.engine.data_parallel_mean(&mut loss)?;
        }
        self.pipe.broadcast(&mut loss, self.placement.stages - 1)?;
        Ok(loss[0] as f64)
    }

    /// Every trainable parameter by name, full fp32, on the first stage's ranks (the whole model, stage by stage);
    /// the other stages get their own. Collective over every rank.
    pub fn full_parameters(&mut self) -> Result<Vec<(String, Tensor)>> {
        let mut own = self.engine.full_parameters()?;
        let stage = self.placement.stage;
        if stage > 0 {
            let c = self.pipe.as_ref();
            c.send(&[own.len() as i64], 0)?;
            for (name, t) in &own {
                send_bytes(c, name.as_bytes(), 0)?;
                send_tensor(c, t, 0)?;
            }
            return Ok(own);
        }
        for from in 1..self.placement.stages {
            let c = self.pipe.as_ref();
            let mut count = [0i64];
            c.recv(&mut count, from)?;
            for _ in 0..count[0] {
                let name = String::from_utf8_lossy(&recv_bytes(c, from)?).into_owned();
                own.push((name, recv_tensor(c, from)?));
            }
        }
        Ok(own)
    }

    /// Ends asynchronous training (`async_training`): with bounded staleness every stage's owners apply every
    /// step and its ranks pull the final values ([`Engine::finish`]). Collective; a no-op otherwise.
    pub fn finish(&mut self) -> Result<()> {
        self.engine.finish()?;
        self.mesh.world().barrier()?;
        Ok(())
    }

    /// The ZeRO engine of this stage (over its data-parallel group).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The stage's ZeRO engine, mutable.
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Where this rank sits in the pipeline.
    pub fn placement(&self) -> &StagePlacement {
        &self.placement
    }

    /// This stage's layers.
    pub fn model(&self) -> &StageModel<'a> {
        &self.model
    }

    /// The schedule's simulation: every stage's peak of activations held and the bubble (idle fraction) when a
    /// forward and a backward take one time step each.
    pub fn simulation(&self) -> &schedule::Simulation {
        &self.simulation
    }

    /// Where this stage's time went in the last `train_batch`.
    pub fn last_times(&self) -> StageTimes {
        self.last_times
    }

    /// The mean over the steps so far of where this stage's time went.
    pub fn mean_times(&self) -> StageTimes {
        let n = self.timed_steps.max(1);
        StageTimes {
            step: self.total_times.step / n,
            compute: self.total_times.compute / n,
            wait: self.total_times.wait / n,
            optimizer: self.total_times.optimizer / n,
        }
    }

    /// This stage's layers, e.g. `embed..blocks.1` (chunks separated by commas).
    pub fn layer_names(&self) -> String {
        let infos = self.model.layer_infos();
        self.model
            .layers()
            .iter()
            .map(|r| format!("{}..{}", infos[r.start].name, infos[r.end - 1].name))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `wall_clock_breakdown` for this stage: the mean step, its compute, the optimizer step, the time blocked on
    /// the neighbours, and the idle fraction (neither computing nor stepping) beside the schedule's bubble.
    pub fn wall_clock_summary(&self) -> String {
        let t = self.mean_times();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        format!(
            "stage {} of {} ({}): step {:.2} ms, compute {:.2} ms, optimizer step {:.2} ms, waiting on neighbours {:.2} ms ({:.1}%), idle {:.1}% (the schedule's bubble {:.1}%)",
            self.placement.stage,
            self.placement.stages,
            self.layer_names(),
            ms(t.step),
            ms(t.compute),
            ms(t.optimizer),
            ms(t.wait),
            100.0 * t.wait_fraction(),
            100.0 * t.idle_fraction(),
            100.0 * self.simulation.bubble
        )
    }

    /// At the end of a run, when a report is asked for (`memory_breakdown`, `zerorun launch --memory-report`):
    /// every rank writes `memory_rank{r}.json` with its stage, layers and times; rank 0 then draws the pictures
    /// and returns the table of every rank. Collective over every rank. None: no report.
    pub fn finish_memory_report(&mut self) -> Result<Option<crate::engine::MemoryReportFiles>> {
        match self.engine.memory_report_dir() {
            Some(dir) => self.write_memory_report(&dir).map(Some),
            None => Ok(None),
        }
    }

    /// Writes the memory report into `dir` now (see [`PipelineEngine::finish_memory_report`]). Collective.
    pub fn write_memory_report(&mut self, dir: &std::path::Path) -> Result<crate::engine::MemoryReportFiles> {
        let dir = dir.to_path_buf();
        let mut report = self.engine.memory_report();
        let t = self.mean_times();
        report.rank = self.placement.rank;
        report.world_size = self.placement.world_size;
        report.pipeline = Some(crate::report::memory::PipelineStage {
            stage: self.placement.stage,
            stages: self.placement.stages,
            layers: self.layer_names(),
            parameters: self.engine.layout().numel,
            step_us: t.step.as_micros() as u64,
            compute_us: t.compute.as_micros() as u64,
            wait_us: t.wait.as_micros() as u64,
            optimizer_us: t.optimizer.as_micros() as u64,
        });
        let json = report.write(&dir)?;
        self.mesh.world().barrier()?;
        let mut files = crate::engine::MemoryReportFiles { json, table: None, svg: None, png: None };
        if self.placement.rank == 0 {
            let reports = (0..self.placement.world_size)
                .map(|r| crate::report::memory::MemoryReport::read(&dir, r))
                .collect::<zerorun_report::Result<Vec<_>>>()?;
            let (svg, png) = crate::report::plot::draw_memory(&dir, &reports)?;
            files.table = Some(crate::report::table::table(&reports));
            files.svg = Some(svg);
            files.png = Some(png);
        }
        self.mesh.world().barrier()?;
        Ok(files)
    }

    /// Global rank.
    pub fn rank(&self) -> usize {
        self.placement.rank
    }

    /// Micro-batches per step (`gradient_accumulation_steps`).
    pub fn micro_batches(&self) -> usize {
        self.engine.batch_sizes().gradient_accumulation_steps as usize
    }

    /// A step's micro-batches, in order (an interleaved schedule does not take them in order).
    fn take_micro_batches(&self, it: &mut dyn Iterator<Item = MicroBatch>) -> Result<Vec<MicroBatch>> {
        let m = self.micro_batches();
        let batches: Vec<MicroBatch> = it.take(m).collect();
        if batches.len() < m {
            return Err(Error::Usage(format!(
                "stage {}: the micro-batch iterator gave {} micro-batches; a step takes gradient_accumulation_steps = {m}",
                self.placement.stage,
                batches.len()
            )));
        }
        Ok(batches)
    }

    fn missing(&self, what: &str, mb: usize) -> Error {
        Error::Usage(format!(
            "stage {} of {}: micro-batch {mb} has no {what} (the first stage needs inputs, the last labels)",
            self.placement.stage, self.placement.stages
        ))
    }

    /// The owner of a tied weight adds each replica's gradient (sum over this step's micro-batches, scaled as the
    /// loss was) to its own, before its last backward.
    fn receive_tied_gradients(&mut self) -> Result<()> {
        let stage = self.placement.stage;
        for t in self.model.tied().iter().filter(|t| t.owner == stage) {
            for &from in &t.replicas {
                let g = recv_tensor(self.tied_group.as_ref(), from)?;
                let grad = t.tensor.grad();
                if grad.defined() {
                    tch::no_grad(|| grad.shallow_clone().f_add_(&g.to_kind(grad.kind())).map(drop))?;
                } else {
                    crate::engine::device::native::set_grad(&t.tensor, &g.to_kind(t.tensor.kind()))?;
                }
            }
        }
        Ok(())
    }

    /// A replica's stage sends its gradient to the owner (after its own last backward) and clears it.
    fn send_tied_gradients(&mut self) -> Result<()> {
        let stage = self.placement.stage;
        for t in self.model.tied().iter().filter(|t| t.owner != stage) {
            let grad = t.tensor.grad();
            let g = if grad.defined() { grad.shallow_clone() } else { t.tensor.zeros_like() };
            send_tensor(self.tied_group.as_ref(), &g, t.owner)?;
            crate::engine::device::native::reset_grad(&t.tensor);
        }
        Ok(())
    }

    /// After the step: the owner sends each tied weight's new value to its replicas.
    pub(super) fn exchange_tied_values(&mut self) -> Result<()> {
        let stage = self.placement.stage;
        for t in self.model.tied() {
            if t.owner == stage {
                for &to in &t.replicas {
                    send_tensor(self.tied_group.as_ref(), &t.tensor.detach(), to)?;
                }
            } else {
                let value = recv_tensor(self.tied_group.as_ref(), t.owner)?;
                tch::no_grad(|| t.tensor.shallow_clone().f_copy_(&value))?;
            }
        }
        Ok(())
    }

    /// The last stage's loss for every stage (the others computed none).
    fn with_pipeline_loss(&mut self, outcome: StepOutcome) -> Result<StepOutcome> {
        let loss_of = |o: &StepOutcome| match o {
            StepOutcome::Stepped { loss, .. }
            | StepOutcome::Skipped { loss, .. }
            | StepOutcome::Discarded { loss, .. } => *loss,
            StepOutcome::Accumulating => f64::NAN,
        };
        let mut loss = [loss_of(&outcome) as f32];
        self.pipe.broadcast(&mut loss, self.placement.stages - 1)?;
        let loss = loss[0] as f64;
        Ok(match outcome {
            StepOutcome::Stepped { step, grad_norm, lr, .. } => StepOutcome::Stepped { step, loss, grad_norm, lr },
            StepOutcome::Skipped { step, scale, .. } => StepOutcome::Skipped { step, loss, scale },
            StepOutcome::Discarded { step, .. } => StepOutcome::Discarded { step, loss },
            StepOutcome::Accumulating => StepOutcome::Accumulating,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The optimizer step is neither idle nor waiting: a stage that computes 60 ms and steps 20 ms of a 100 ms step
    /// idles 20%, of which the waits are what the link measured.
    #[test]
    fn the_optimizer_step_is_apart_from_idle_and_waiting() {
        let ms = Duration::from_millis;
        let t = StageTimes { step: ms(100), compute: ms(60), wait: ms(12), optimizer: ms(20) };
        assert!((t.idle_fraction() - 0.2).abs() < 1e-12, "{}", t.idle_fraction());
        assert!((t.wait_fraction() - 0.12).abs() < 1e-12);
        assert!((t.optimizer_fraction() - 0.2).abs() < 1e-12);
        assert_eq!(StageTimes::default().idle_fraction(), 0.0);
    }
}
