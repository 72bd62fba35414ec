//! One micro-batch's forward and backward. A plain loop's backward is autograd's, with the gradients reduced
//! after it or by hooks during it (`zero/grads/`); with the model's units (stage 3, and stage 2 with units) the
//! engine walks them: forward gathers each unit, runs it on its input detached as a new leaf and releases it;
//! backward walks the units in reverse, gathers each again, backpropagates from its saved output with the
//! gradient of the next unit's input, reduce-scatters the unit's gradients into this rank's shard and releases
//! parameters and full gradients. With activation checkpointing only unit inputs are kept and each unit is
//! recomputed in backward. What forward keeps is
//! [`Walk`](crate::engine::zero::unit_walk::Walk)'s.
use std::time::Instant;

use tch::Tensor;

use crate::config::Precision;
use crate::engine::device::host_inputs::HostInput;
use crate::engine::device::native;
use crate::engine::zero::plan::GradientPath;
use crate::engine::zero::unit_walk::UnitRecord;
use crate::engine::zero::{self, units::UnitModel};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::report::allocations::{owned_by, Owner};
use crate::report::memory::MemoryCategory;
use crate::report::Phase;

/// Where a backward starts.
#[derive(Clone, Copy)]
enum Root<'a> {
    /// A micro-batch's loss, scaled by the loss scale over the accumulation steps.
    Loss(&'a Tensor),
    /// A part's output and the gradient of the loss with respect to it.
    Output { output: &'a Tensor, grad: &'a Tensor },
}

impl Engine {
    /// Backward of one micro-batch's loss, scaled by 1/gradient_accumulation_steps as DeepSpeed does (and by the
    /// loss scale under fp16).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use tch::nn::{self, Module};
    /// # use tch::{Device, Kind, Tensor};
    /// # let vs = nn::VarStore::new(Device::Cpu);
    /// # let (l0, l1) = (nn::linear(vs.root() / "l0", 4, 8, Default::default()), nn::linear(vs.root() / "l1", 8, 1, Default::default()));
    /// # let model = zerorun_runtime::engine::Sequence::new().unit(["l0"], move |x| l0.forward(x).relu()).unit(["l1"], move |x| l1.forward(x));
    /// # let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// # let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// # let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, zerorun_runtime::EngineOptions::default().units_of(&model))?;
    /// # let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// let loss = engine.forward(&model, &x)?.square().mean(Kind::Float);
    /// engine.backward(&loss)?; // a plain loop's call; with units at hand, `backward_units`
    /// engine.step()?;
    /// # Ok(()) }
    /// ```
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        self.backward_impl(None, loss)
    }

    /// [`Engine::backward`] with the model at hand, which stage 3 needs to recompute units under activation
    /// checkpointing. Works at every stage.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use tch::nn::{self, Module};
    /// # use tch::{Device, Kind, Tensor};
    /// # let vs = nn::VarStore::new(Device::Cpu);
    /// # let (l0, l1) = (nn::linear(vs.root() / "l0", 4, 8, Default::default()), nn::linear(vs.root() / "l1", 8, 1, Default::default()));
    /// # let model = zerorun_runtime::engine::Sequence::new().unit(["l0"], move |x| l0.forward(x).relu()).unit(["l1"], move |x| l1.forward(x));
    /// # let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// # let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// # let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, zerorun_runtime::EngineOptions::default().units_of(&model))?;
    /// # let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// let loss = engine.forward(&model, &x)?.square().mean(Kind::Float);
    /// engine.backward_units(&model, &loss)?;
    /// engine.step()?;
    /// # Ok(()) }
    /// ```
    pub fn backward_units(&mut self, model: &dyn UnitModel, loss: &Tensor) -> Result<()> {
        self.backward_impl(Some(model), loss)
    }

    /// Whether the next backwards reduce their gradients (true, the default), or leave them accumulating in
    /// `.grad` for a later backward to reduce (FSDP2's `set_requires_gradient_sync`): a pipeline stage, whose
    /// micro-batches' backwards spread over the whole step, reduces once, during the last. Stage 2 of an fp32
    /// plain loop then holds full gradients until that backward (as stage 1 does) and runs no collective before it;
    /// 16-bit models reduce every micro-batch into their fp32 accumulator whatever this says, and the other paths
    /// reduce at the step anyway.
    pub fn set_requires_gradient_sync(&mut self, sync: bool) {
        self.gradients.defers_reduction = !sync && self.precision() == Precision::Fp32;
    }

    /// Backward of a part of the model from the gradient of its `output` (what the next pipeline stage sent back,
    /// already scaled as that stage's loss was): accumulates the parameters' gradients as [`Engine::backward`]
    /// does, records no loss. Stages 0-2 without units.
    pub(crate) fn backward_output(&mut self, output: &Tensor, grad: &Tensor) -> Result<()> {
        let _owner = owned_by(Owner::Engine);
        if self.plan.gradients == GradientPath::UnitWalk {
            return Err(Error::Usage(
                "engine.backward_output runs a plain backward: it needs ZeRO stage 0-2 without units".into(),
            ));
        }
        self.backward_root(Root::Output { output, grad })
    }

    fn backward_impl(&mut self, model: Option<&dyn UnitModel>, loss: &Tensor) -> Result<()> {
        let _owner = owned_by(Owner::Engine);
        // A forward the program ran through scopes of its own has no end the engine saw: it ends here.
        let marked = std::mem::take(&mut self.walk.forward_marked);
        if !marked && self.backward_is_scoped() {
            self.memory_event(|| "forward".into(), &[]);
        }
        self.memory_event(|| "backward start".into(), &[]);
        self.enter_phase(|| "backward".into());
        if self.plan.gradients == GradientPath::UnitWalk {
            self.begin_backward(Some(loss))?;
            let factor = self.loss_scale() / self.batch.gradient_accumulation_steps as f64;
            let (started, comm_before) = (Instant::now(), self.report.times.comm());
            let _span = Phase::Backward.span().entered();
            // The walk (or the scopes' hooks) records its own events, unit by unit.
            let ran = if self.backward_is_scoped() {
                self.backward_scopes(loss, factor)
            } else {
                self.backward_units_impl(model, loss, factor)
            };
            return ran.map(|()| self.end_backward(started, comm_before));
        }
        self.backward_root(Root::Loss(loss))
    }

    /// Counts the backward (and its loss).
    fn begin_backward(&mut self, loss: Option<&Tensor>) -> Result<()> {
        if self.progress.step_started.is_none() {
            self.progress.step_started = Some(Instant::now());
        }
        if let Some(loss) = loss {
            self.progress.loss_sum += loss.f_double_value(&[])?;
            self.progress.loss_count += 1;
        }
        self.progress.backwards += 1;
        Ok(())
    }

    fn backward_root(&mut self, root: Root<'_>) -> Result<()> {
        self.begin_backward(match root {
            Root::Loss(loss) => Some(loss),
            Root::Output { .. } => None,
        })?;
        let factor = self.loss_scale() / self.batch.gradient_accumulation_steps as f64;
        let _span = Phase::Backward.span().entered();
        let (started, comm_before) = (Instant::now(), self.report.times.comm());
        let autograd = || -> Result<()> {
            let _owner = owned_by(Owner::Backward);
            match root {
                Root::Loss(loss) if factor != 1.0 => (loss * factor).f_backward()?,
                Root::Loss(loss) => loss.f_backward()?,
                // d/d(output) of sum(output * grad) is grad, exactly.
                Root::Output { output, grad } => (output * grad.detach()).sum(None).f_backward()?,
            }
            Ok(())
        };
        // Deferring: this micro-batch's gradients stay in `.grad` (the hooks only act while lent).
        let defer = self.gradients.defers_reduction;
        // Stage 0's hooks all-reduce in the backward of a micro-step that reduces: each one of a 16-bit model
        // (reduced into the fp32 accumulator at its step), the boundary's of an fp32 model.
        let all_reduces = self.gradients.all_reduce_in_backward.is_some()
            && !defer
            && (self.precision() != Precision::Fp32 || self.is_gradient_accumulation_boundary());
        match self.plan.gradients {
            GradientPath::AfterBackward if all_reduces => {
                let staging = self.gradients.view_buffer().expect("stage 0's gradients are views").shallow_clone();
                // First: a second backward before the step is refused before anything is set aside.
                self.begin_step_in_backward()?;
                self.gradients.all_reduce_in_backward.as_mut().expect("checked").before_backward(&staging)?;
                self.lend_hooks(autograd)?;
                let mark = self.gradient_fingerprint();
                self.gradients.all_reduce_in_backward.as_mut().expect("checked").mark_reduced(mark);
            }
            GradientPath::AfterBackward | GradientPath::UnitsAfterBackward => autograd()?,
            GradientPath::Hooks if defer => autograd()?,
            GradientPath::Hooks => self.lend_hooks(autograd)?,
            GradientPath::UnitWalk => unreachable!("unit walks run in backward_impl"),
        }
        self.memory_event(|| "backward".into(), &[]);
        self.end_backward(started, comm_before);
        Ok(())
    }

    /// Runs autograd with the gradient hooks reducing bucket by bucket.
    fn lend_hooks(&mut self, autograd: impl FnOnce() -> Result<()>) -> Result<()> {
        let hooks = self.gradients.hooks.take().expect("hooked mode has hooks");
        let ran = hooks.lend(&mut self.gradient_sync(), autograd);
        self.gradients.hooks = Some(hooks);
        ran
    }

    /// With `optimizer_in_backward`, begins the step the backward about to run takes: the optimizer's (its
    /// learning rate and count) and, with parameters on NVMe, keeping the chunks gathers read for their units'
    /// steps (`step` ends both).
    pub(super) fn begin_step_in_backward(&mut self) -> Result<()> {
        if self.plan.steps_in_backward {
            self.shard.begin_step_in_backward()?;
            self.states.parameters.keep_chunks_for_step(true);
        }
        Ok(())
    }

    fn end_backward(&mut self, started: Instant, comm_before: std::time::Duration) {
        self.report
            .times
            .add(Phase::Backward, started.elapsed().saturating_sub(self.report.times.comm() - comm_before));
    }

    /// What reducing gradients needs, borrowed from the engine's fields.
    pub(super) fn gradient_sync(&mut self) -> zero::grads::GradientSync<'_> {
        // Only while the optimizer in backward has begun a step.
        let stepper = self.shard.in_backward.as_mut().map(|progress| zero::optim::in_backward::ShardStepper {
            tier: &mut self.shard.tier,
            groups: &self.shard.groups,
            values: match self.states.parameters.swapped.as_mut() {
                Some(swapped) => zero::optim::in_backward::ShardValues::Swapped(swapped),
                None => zero::optim::in_backward::ShardValues::InMemory(&self.states.parameters.flat),
            },
            progress,
            residence: self.residence,
            replicated: self.placement.replicated.as_ref(),
        });
        zero::grads::GradientSync {
            gradients: &mut self.gradients,
            comm: &self.comm,
            layout: &self.states.layout,
            params: &self.states.params,
            volume: &mut self.report.comm_volume,
            times: &mut self.report.times,
            stepper,
        }
    }

    /// Runs `model` on `input`, unit by unit. At stages 0-2 this is just the units in order; at stage 3 it
    /// gathers each unit's parameters only while it runs. Under `tch::no_grad` nothing is kept for backward.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use tch::nn::{self, Module};
    /// # use tch::{Device, Kind, Tensor};
    /// # let vs = nn::VarStore::new(Device::Cpu);
    /// # let (l0, l1) = (nn::linear(vs.root() / "l0", 4, 8, Default::default()), nn::linear(vs.root() / "l1", 8, 1, Default::default()));
    /// # let model = zerorun_runtime::engine::Sequence::new().unit(["l0"], move |x| l0.forward(x).relu()).unit(["l1"], move |x| l1.forward(x));
    /// # let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// # let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// # let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, zerorun_runtime::EngineOptions::default().units_of(&model))?;
    /// # let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// let y = engine.forward(&model, &x)?; // at stage 3 no unit stays gathered afterwards
    /// assert_eq!(y.size(), [2, 1]);
    /// let eval = tch::no_grad(|| engine.forward(&model, &x))?; // keeps nothing for backward
    /// # Ok(()) }
    /// ```
    pub fn forward(&mut self, model: &dyn UnitModel, input: &Tensor) -> Result<Tensor> {
        if self.states.layout.has_groups() {
            // The walk runs every unit on every rank; a rank holds only its own experts' units.
            return Err(Error::Usage(
                "engine.forward walks every unit on every rank, but with expert_parallel the units of each expert-parallel position's experts are split over that position's ranks only: enter the units from your forward with engine.unit(name, ..), each rank only its own experts'".into(),
            ));
        }
        let _span = crate::report::Phase::Forward.span().entered();
        let _owner = owned_by(Owner::Engine);
        self.enter_phase(|| "forward".into());
        let (started, comm_before) = (std::time::Instant::now(), self.report.times.comm());
        // A forward under no_grad (an evaluation) is no training step's: its time, gathers included, is left out
        // of the wall-clock breakdown, which divides by the steps.
        let training = native::grad_enabled();
        let times_before = (!training).then(|| self.report.times.clone());
        let out = self.forward_impl(model, input);
        match times_before {
            Some(before) => self.report.times = before,
            None => self.report.times.add(
                crate::report::Phase::Forward,
                started.elapsed().saturating_sub(self.report.times.comm() - comm_before),
            ),
        }
        // The end of forward, where the activations autograd keeps peak: a sample at every stage.
        if out.is_ok() && training {
            self.memory_event(|| "forward".to_string(), &[]);
            self.walk.forward_marked = true;
        }
        out
    }

    fn forward_impl(&mut self, model: &dyn UnitModel, input: &Tensor) -> Result<Tensor> {
        let prefixes = model.unit_prefixes();
        if self.plan.gradients != GradientPath::UnitWalk {
            let mut h = input.shallow_clone();
            let train = native::grad_enabled();
            for i in 0..prefixes.len() {
                h = owned_forward(|| model.forward_unit(i, &h));
                // Activations growing unit by unit; a no-grad forward peaks at a unit's input and output.
                if train {
                    self.memory_event(|| format!("forward: unit {i} computed"), &[]);
                } else {
                    self.memory_event(|| format!("forward (no grad): unit {i} computed"), &[]);
                }
            }
            return Ok(h);
        }
        if prefixes != self.walk.unit_prefixes {
            return Err(Error::Usage(format!(
                "the model's units {prefixes:?} are not the ones the engine was built with {:?} (EngineOptions::units)",
                self.walk.unit_prefixes
            )));
        }
        if !self.walk.chain {
            return self.forward_scoped(model, input);
        }
        let train = native::grad_enabled();
        self.walk.records.clear();
        let n = self.states.parameters.units.len();
        let keep = self.states.parameters.kept_after_forward(&self.config.zero_optimization);
        let first_trainable = self.states.parameters.units.iter().position(|u| !u.span.range.is_empty()).unwrap_or(n);
        let mut h = input.shallow_clone();
        for (i, kept) in keep.into_iter().enumerate() {
            self.gather_unit(i)?;
            self.prefetch(i + 1..n)?;
            self.states.parameters.read_ahead(i + 1..n);
            let last = i + 1 == n;
            if !train {
                h = owned_forward(|| model.forward_unit(i, &h));
                // The unit's input and output beside its parameters: where a no-grad forward (an evaluation on
                // more samples than a micro-batch, say) peaks.
                self.memory_event(|| format!("forward (no grad): unit {i} computed"), &[]);
                if !self.states.parameters.units[i].persistent {
                    self.release_unit(i)?;
                }
                continue;
            }
            // A unit's input needs a gradient only when a unit before it has trainable parameters (a frozen
            // backbone first: no backward through it).
            let x = if i > first_trainable && h.is_floating_point() {
                h.detach().set_requires_grad(true)
            } else {
                h.shallow_clone()
            };
            self.memory_event(|| format!("forward: unit {i} gathered"), &[]);
            let recompute = self.walk.activation_checkpointing && !last;
            self.enter_phase(|| format!("forward: unit {i}"));
            let before = self.forward_live_bytes();
            let y = owned_forward(|| {
                if recompute {
                    tch::no_grad(|| model.forward_unit(i, &x))
                } else {
                    model.forward_unit(i, &x)
                }
            });
            self.record_unit_activations(i, before, &x);
            // The unit's output and what autograd saved, beside its parameters and the next unit's prefetch.
            self.memory_event(|| format!("forward: unit {i} computed"), &[]);
            // With cpu_checkpointing the input waits in host memory; the device copy goes once its copy is queued.
            let on_host = (recompute && self.walk.inputs_to_host).then(|| HostInput::send(self.residence, &x));
            let input = match &on_host {
                Some(h) => {
                    self.walk.inputs_sent_bytes += h.bytes() as u64;
                    Tensor::new()
                }
                None => x,
            };
            self.walk.records.push(UnitRecord { input, output: (!recompute).then(|| y.shallow_clone()), on_host });
            if !last && !self.states.parameters.units[i].persistent && !kept {
                self.release_unit(i)?;
            }
            h = y;
        }
        Ok(h)
    }

    /// The units of `model` in order, each entered as a scope (`engine.unit`): the program's graph runs through
    /// them as written, and backward's hooks gather, reduce and release each. Records each unit's activations for
    /// the memory report.
    fn forward_scoped(&mut self, model: &dyn UnitModel, input: &Tensor) -> Result<Tensor> {
        // `engine.forward` times the whole forward itself: its scopes are not the outermost ones.
        self.scopes()?.depth += 1;
        let out = self.forward_units_scoped(model, input);
        self.walk.scopes.as_mut().expect("installed").depth -= 1;
        out
    }

    fn forward_units_scoped(&mut self, model: &dyn UnitModel, input: &Tensor) -> Result<Tensor> {
        let train = native::grad_enabled();
        let mut h = input.shallow_clone();
        for i in 0..self.states.parameters.units.len() {
            let before = self.forward_live_bytes();
            let x = h;
            h = self.enter_unit(i, |_| model.forward_unit(i, &x))?;
            if train {
                self.record_unit_activations(i, before, &x);
            }
        }
        Ok(h)
    }

    /// Stage 3 backward from a loss computed from `forward`'s output. `model` recomputes units when activation
    /// checkpointing is on.
    pub(crate) fn backward_units_impl(
        &mut self,
        model: Option<&dyn UnitModel>,
        loss: &Tensor,
        factor: f64,
    ) -> Result<()> {
        let mut records = std::mem::take(&mut self.walk.records);
        if records.len() != self.states.parameters.units.len() {
            let stage = self.plan.stage();
            let plain = if self.plan.shard_in_pieces() {
                "; for a plain loop at stage 2 build the engine without EngineOptions::units"
            } else {
                ""
            };
            return Err(Error::Usage(format!(
                "the engine runs the model's units at stage {stage}: the loss must come from `engine.forward(&model, input)` or from units entered with `engine.unit(name, ..)` (run with gradients), once per backward{plain}"
            )));
        }
        self.begin_step_in_backward()?;
        let root = if factor != 1.0 { loss * factor } else { loss.shallow_clone() };
        let mut upstream: Option<Tensor> = None;
        let units = records.len();
        for i in (0..units).rev() {
            let last = i + 1 == units;
            // Taken, so the unit's activations are freed once its backward is done (as autograd frees saved ones).
            let mut rec = records.pop().expect("a record per unit");
            // Inputs waiting in host memory come back one unit ahead of their recomputation.
            for r in std::iter::once(&mut rec).chain(records.last_mut()) {
                if let Some(h) = r.on_host.take() {
                    r.input = h.bring_back(self.residence);
                }
            }
            self.gather_unit(i)?;
            self.prefetch((0..i).rev())?;
            self.states.parameters.read_ahead((0..i).rev());
            self.memory_event(|| format!("backward: unit {i} gathered"), &[]);
            self.enter_phase(|| format!("backward: unit {i}"));
            let output = match &rec.output {
                Some(y) => y.shallow_clone(),
                None => {
                    let model = model.ok_or_else(|| {
                        Error::Usage("activation checkpointing recomputes units in backward: call `engine.backward_units(&model, &loss)`".into())
                    })?;
                    owned_forward(|| model.forward_unit(i, &rec.input))
                }
            };
            let takes_input = i > 0 && rec.input.requires_grad();
            let grads = {
                let params = self.states.parameters.units[i].params();
                let mut inputs: Vec<&Tensor> = params.iter().collect();
                if takes_input {
                    inputs.push(&rec.input);
                }
                let start: Option<(&Tensor, Option<&Tensor>)> =
                    if last { Some((&root, None)) } else { upstream.as_ref().map(|g| (&output, Some(g))) };
                match start {
                    _ if inputs.is_empty() => Vec::new(),
                    Some(r) if output.requires_grad() || last => {
                        let _owner = owned_by(Owner::Backward);
                        native::grad(&[r], &inputs)?
                    }
                    _ => (0..inputs.len()).map(|_| None).collect(),
                }
            };
            let mut grads = grads;
            let unit_grad_bytes: usize = grads.iter().flatten().map(|g| g.numel() * g.kind().elt_size_in_bytes()).sum();
            self.memory_event(
                || format!("backward: unit {i} gradients"),
                &[(MemoryCategory::GradientsUnit, unit_grad_bytes)],
            );
            upstream = if takes_input { grads.pop().flatten() } else { None };
            self.gradient_sync().reduce_unit(i, &grads)?;
            self.memory_event(
                || format!("backward: unit {i} reduced"),
                &[(MemoryCategory::GradientsUnit, unit_grad_bytes)],
            );
            drop(grads);
            if !self.states.parameters.units[i].persistent {
                self.release_unit(i)?;
            }
        }
        self.gradient_sync().drain()
    }

    pub(crate) fn gather_unit(&mut self, i: usize) -> Result<()> {
        let t = std::time::Instant::now();
        self.states.parameters.gather(i, &self.comm, &mut self.report.comm_volume)?;
        self.report.times.add(crate::report::Phase::AllGather, t.elapsed());
        Ok(())
    }

    /// [`Engine::gather_unit`] with the shards' exact values where gathers are quantized (for saving the model).
    pub(crate) fn gather_unit_exact(&mut self, i: usize) -> Result<()> {
        let t = std::time::Instant::now();
        self.states.parameters.gather_exact(i, &self.comm, &mut self.report.comm_volume)?;
        self.report.times.add(crate::report::Phase::AllGather, t.elapsed());
        Ok(())
    }

    pub(crate) fn prefetch(&mut self, order: impl Iterator<Item = usize>) -> Result<()> {
        self.states.parameters.prefetch(order, &self.comm, &self.config.zero_optimization, &mut self.report.comm_volume)
    }

    pub(crate) fn release_unit(&mut self, i: usize) -> Result<()> {
        self.states.parameters.release(i)
    }

    /// After an optimizer step: units that stay gathered take the new values of every rank's shard.
    pub(crate) fn refresh_gathered_units(&mut self) -> Result<()> {
        self.states.parameters.refresh_gathered(&self.comm, &mut self.report.comm_volume)
    }
}

/// Runs model code whose allocations are the forward's (activations, the output).
fn owned_forward<T>(f: impl FnOnce() -> T) -> T {
    let _owner = owned_by(Owner::Forward);
    f()
}
