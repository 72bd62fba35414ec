//! Units entered from the program's own forward: `engine.unit(name, |engine| ...)` gathers the unit, runs the
//! closure, hooks its outputs for backward and releases it; `engine.backward` runs autograd over the program's own
//! graph while the hooks gather, reduce and release unit by unit (`zero/scopes.rs`). At stages 0-1, and stage 2
//! without units, a scope is just the call, so one program runs at every stage (at stage 1 with units split over
//! expert-parallel groups, a unit this rank does not hold is refused, as at stages 2-3).
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use tch::Tensor;

use crate::engine::device::native;
use crate::engine::zero::plan::GradientPath;
use crate::engine::zero::scopes::{HookTarget, Scopes, UnitOutput};
use crate::engine::zero::sharded_unit::UnitState;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::report::allocations::{owned_by, Owner};
use crate::report::Phase;

impl Engine {
    /// Runs `forward` as the unit `name` (any of its prefixes in [`EngineOptions::units`](crate::EngineOptions)):
    /// at stage 3 the unit's parameters are gathered for the call and released after it, and gathered again in
    /// backward before autograd needs them. `forward` gets the engine back, to enter units nested in this one. Any
    /// dataflow works: several inputs and outputs, outputs read by several later units, a unit entered more than
    /// once (a tied embedding and head), units skipped. What the scope returns must hold every tensor it computed
    /// that the rest of the forward reads ([`UnitOutput`]: a tensor, tuples, vectors, tch's LSTM and GRU states).
    /// At stages 0-2 without units it only calls `forward`.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tch::nn::{self, Module};
    /// use tch::{Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let enc = nn::linear(vs.root() / "enc", 4, 8, Default::default());
    /// let dec = nn::linear(vs.root() / "dec", 8, 4, Default::default());
    /// let options = zerorun_runtime::EngineOptions { units: Some(vec![vec!["enc".into()], vec!["dec".into()]]), ..Default::default() };
    /// let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, options)?;
    /// let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// let h = engine.unit("enc", |_| enc.forward(&x).relu())?;
    /// // The decoder reads the encoder's output and the input: no chain needed.
    /// let y = engine.unit("dec", |_| dec.forward(&h) + &x)?;
    /// engine.backward(&y.square().mean(Kind::Float))?;
    /// engine.step()?;
    /// # Ok(()) }
    /// ```
    pub fn unit<T: UnitOutput>(&mut self, name: &str, forward: impl FnOnce(&mut Engine) -> T) -> Result<T> {
        if self.plan.gradients != GradientPath::UnitWalk {
            // Stage 1 keeps no storage for another position's experts: refused as at stages 2-3.
            if self.walk.not_held.contains(name) {
                return Err(another_positions_unit(name, self.rank()));
            }
            return Ok(forward(self));
        }
        let u = self.scopes()?.unit_named(name)?;
        if self.walk.activation_checkpointing {
            return Err(Error::Usage(format!(
                "engine.unit(\"{name}\", ..) with EngineOptions::activation_checkpointing, which recomputes the units \
                 of `engine.forward`'s walk: checkpoint a scope with `engine.unit_checkpointed(name, inputs, forward)` \
                 and build the engine without that option"
            )));
        }
        self.enter_unit(u, forward)
    }

    /// [`Engine::unit`] with activation checkpointing: `forward` runs on `inputs` without autograd keeping anything
    /// but them, and runs again in backward, right after the unit is gathered for it, to backpropagate through (the
    /// CPU generator replayed, so dropout draws the same masks). The parameters it reads must be the unit's (at
    /// stages 0-2: those under the unit's prefixes, or under `name`), whose gradients it passes on. `forward` reads
    /// its tensors from `inputs` (what it captures is constant to autograd) and must own what it captures
    /// (`'static`: modules behind an `Rc`, say), since backward calls it after this returns. At every stage; at
    /// stages 0-2 only the activations are saved. Several outputs, or units entered inside:
    /// [`Engine::unit_checkpointed_with`].
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::rc::Rc;
    /// use tch::nn::{self, Module};
    /// use tch::{Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let block = Rc::new(nn::linear(vs.root() / "block", 4, 4, Default::default()));
    /// let options = zerorun_runtime::EngineOptions { units: Some(vec![vec!["block".into()]]), ..Default::default() };
    /// let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, options)?;
    /// let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// let b = Rc::clone(&block);
    /// let y = engine.unit_checkpointed("block", &[&x], move |xs| b.forward(&xs[0]).gelu("none"))?;
    /// engine.backward(&y.square().mean(Kind::Float))?;
    /// engine.step()?;
    /// # Ok(()) }
    /// ```
    pub fn unit_checkpointed(
        &mut self,
        name: &str,
        inputs: &[&Tensor],
        forward: impl Fn(&[Tensor]) -> Tensor + 'static,
    ) -> Result<Tensor> {
        let mut outputs = self.unit_checkpointed_with(name, inputs, move |xs, _| Ok(vec![forward(xs)]))?;
        Ok(outputs.remove(0))
    }

    /// [`Engine::unit_checkpointed`] with several outputs (each may carry a gradient: a layer's output and its
    /// router's logits for a load-balancing loss), and with units entered inside it through [`NestedUnits`] (a
    /// layer's experts, split over their own ranks): in backward's run they are gathered again, and their
    /// gradients reach `.grad` and their reduction as the unit's own do.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::rc::Rc;
    /// use tch::nn::{self, Module};
    /// use tch::{Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let outer = Rc::new(nn::linear(vs.root() / "layer" / "mix", 4, 4, Default::default()));
    /// let inner = Rc::new(nn::linear(vs.root() / "layer" / "expert", 4, 4, Default::default()));
    /// let units = vec![vec!["layer.mix".into()], vec!["layer.expert".into()]];
    /// let options = zerorun_runtime::EngineOptions { units: Some(units), ..Default::default() };
    /// let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, options)?;
    /// let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// let (a, b) = (Rc::clone(&outer), Rc::clone(&inner));
    /// let out = engine.unit_checkpointed_with("layer.mix", &[&x], move |xs, nested| {
    ///     let h = a.forward(&xs[0]).relu();
    ///     let e = nested.unit("layer.expert", || b.forward(&h))?;
    ///     Ok(vec![&h + e, h.sum(Kind::Float)])
    /// })?;
    /// engine.backward(&(out[0].square().mean(Kind::Float) + 0.01 * &out[1]))?;
    /// engine.step()?;
    /// # Ok(()) }
    /// ```
    pub fn unit_checkpointed_with(
        &mut self,
        name: &str,
        inputs: &[&Tensor],
        forward: impl Fn(&[Tensor], &mut NestedUnits) -> Result<Vec<Tensor>> + 'static,
    ) -> Result<Vec<Tensor>> {
        let state = native::rng_state()?;
        let ran = std::cell::Cell::new(false);
        // The unit (where units are gathered: stage 3, stage 2 with units), its parameters, and where a nested
        // unit's come from: the engine, lent, or names.
        let (unit, params, reach) = if self.plan.gradients == GradientPath::UnitWalk {
            let u = self.scopes()?.unit_named(name)?;
            let params = self.states.parameters.units[u].params().iter().map(Tensor::shallow_clone).collect();
            let target = self.scopes()?.target();
            (Some((u, Arc::clone(&target))), params, Reach::Lent(target))
        } else {
            let by_name = Rc::new(ParamsByName::of(self));
            (None, by_name.params(name)?, Reach::ByName(by_name))
        };
        let replaying: native::Recompute = Box::new(move |xs: &[Tensor]| {
            let mut nested = NestedUnits { reach: reach.clone(), params: Vec::new() };
            // Backward's run draws what the forward drew. The state is restored after (errors here would be
            // libtorch refusing its own state: nothing to recover).
            let now = match ran.replace(true) {
                true => {
                    let now = native::rng_state().ok();
                    let _ = native::set_rng_state(&state);
                    now
                }
                false => None,
            };
            let outputs = forward(xs, &mut nested);
            if let Some(now) = now {
                let _ = native::set_rng_state(&now);
            }
            Ok(native::Recomputed { outputs: outputs.map_err(|e| e.to_string())?, nested_params: nested.params })
        });
        let Some((u, target)) = unit else { return native::checkpoint(inputs, &params, replaying) };
        self.enter_unit(u, |engine| {
            // The first run enters the nested units through the engine lent here, as backward's run does.
            let before = target.swap(engine);
            let outputs = native::checkpoint(inputs, &params, replaying);
            target.restore(before);
            outputs
        })?
    }

    /// [`Engine::unit`] for unit `u` (its index), at stage 3 or stage 2 with units.
    pub(crate) fn enter_unit<T: UnitOutput>(&mut self, u: usize, forward: impl FnOnce(&mut Engine) -> T) -> Result<T> {
        let rank = self.rank();
        let held = self.states.layout.units[u].holds(rank);
        let scopes = self.scopes()?;
        let (name, outermost) = (scopes.label(u), scopes.depth == 0);
        if !held {
            return Err(another_positions_unit(&name, rank));
        }
        // No unit open around this one (engine.forward's walk counts as depth, not as a unit): the flops
        // profiler's rows are these.
        let top_unit = scopes.open.iter().all(|&n| n == 0);
        let train = native::grad_enabled();
        // Inside a checkpointed unit's run in backward: gathered for the backward about to follow, not a forward.
        let recomputing = train && scopes.in_backward;
        if recomputing {
            self.gather_unit(u)?;
            self.memory_event(|| format!("backward: unit {name} gathered to recompute"), &[]);
            self.walk.scopes.as_mut().expect("installed above").open_scope(u);
            let out = forward(self);
            let scopes = self.walk.scopes.as_mut().expect("installed above");
            scopes.close_scope(u);
            // Its gradient hooks release it once its gradients are reduced; backward's end releases what got none.
            scopes.hook_outputs(&out, u)?;
            return Ok(out);
        }
        let (started, comm_before) = (Instant::now(), self.report.times.comm());
        let times_before = (!train && outermost).then(|| self.report.times.clone());
        self.gather_unit(u)?;
        if train {
            // The next units of the traced order start gathering while this one runs.
            if let Some(next) = self.walk.scopes.as_mut().expect("installed above").entered(u) {
                self.prefetch(next.iter().copied())?;
                self.states.parameters.read_ahead(next.into_iter());
            }
            self.memory_event(|| format!("forward: unit {name} gathered"), &[]);
        }
        self.enter_phase(|| format!("forward: unit {name}"));
        // What the unit leaves alive for backward, for the memory report (the outermost scopes: nested ones count
        // in theirs).
        let activations_before = (train && outermost).then(|| self.forward_live_bytes());
        self.walk.scopes.as_mut().expect("installed above").open_scope(u);
        let out = {
            let _owner = owned_by(Owner::Forward);
            if train && top_unit {
                self.profile_unit(u, &name, forward)?
            } else {
                forward(self)
            }
        };
        let scopes = self.walk.scopes.as_mut().expect("installed above");
        let (open, kept) = (scopes.close_scope(u), scopes.kept[u]);
        if let Some(before) = activations_before {
            self.record_unit_activation_bytes(u, before, 0);
        }
        if train {
            let scopes = self.walk.scopes.as_mut().expect("installed above");
            scopes.hook_outputs(&out, u)?;
            scopes.forward_ran = true;
            self.memory_event(|| format!("forward: unit {name} computed"), &[]);
        } else {
            self.memory_event(|| format!("forward (no grad): unit {name} computed"), &[]);
        }
        if open == 0 && !self.states.parameters.units[u].persistent && !(train && kept) {
            self.release_unit(u)?;
        }
        match times_before {
            Some(before) => self.report.times = before,
            None if outermost => self
                .report
                .times
                .add(Phase::Forward, started.elapsed().saturating_sub(self.report.times.comm() - comm_before)),
            None => {}
        }
        Ok(out)
    }

    /// The scopes' state, installed (with its gradient hooks) on first use.
    pub(crate) fn scopes(&mut self) -> Result<&mut Scopes> {
        if self.walk.scopes.is_none() {
            let unit_slots: Vec<std::ops::Range<usize>> =
                self.states.layout.units.iter().map(|span| span.slots.clone()).collect();
            let n = self.states.parameters.units.len();
            let has_frozen: Vec<bool> = (0..n)
                .map(|u| {
                    self.states.parameters.frozen_units.as_ref().is_some_and(|f| !f.units[u].span.range.is_empty())
                })
                .collect();
            let kept = self.states.parameters.kept_after_forward(&self.config.zero_optimization);
            let scopes = Scopes::install(&self.walk.unit_prefixes, &self.states.params, &unit_slots, has_frozen, kept)?;
            self.walk.scopes = Some(scopes);
        }
        Ok(self.walk.scopes.as_mut().expect("installed"))
    }

    /// Whether the next backward runs over units entered by scopes.
    pub(crate) fn backward_is_scoped(&self) -> bool {
        self.walk.records.is_empty() && self.walk.scopes.as_ref().is_some_and(|s| s.forward_ran)
    }

    /// Stage 3's backward of a forward run through scopes: autograd over the program's graph with the hooks lent
    /// the engine, then the units whose gradients did not all come are reduced and every unit is released.
    pub(crate) fn backward_scopes(&mut self, loss: &Tensor, factor: f64) -> Result<()> {
        self.begin_step_in_backward()?;
        self.scopes()?.begin_backward();
        let root = if factor != 1.0 { loss * factor } else { loss.shallow_clone() };
        let engine: *mut Engine = self;
        let scopes = self.walk.scopes.as_mut().expect("installed");
        scopes.lend(engine);
        scopes.in_backward = true;
        let ran = {
            let _owner = owned_by(Owner::Backward);
            root.f_backward()
        };
        let scopes = self.walk.scopes.as_mut().expect("installed");
        scopes.unlend();
        scopes.in_backward = false;
        scopes.forward_ran = false;
        let hook_error = scopes.error.take();
        let finished = match (hook_error, ran) {
            (Some(e), _) => Err(e),
            (None, Err(e)) => Err(e.into()),
            (None, Ok(())) => self.reduce_remaining_units(),
        };
        // Whatever happened, no unit stays gathered past its backward (the persistent ones always are).
        let released = self.release_scoped_units();
        self.retrace();
        finished?;
        released?;
        self.gradient_sync().drain()
    }

    /// This micro-batch's order becomes the trace the next ones prefetch along (and decide, from its last units,
    /// which stay gathered after forward); a changed order is logged, once as a warning.
    fn retrace(&mut self) {
        let rank = self.rank();
        let scopes = self.walk.scopes.as_mut().expect("installed");
        if let Some(note) = scopes.retrace() {
            if scopes.noticed_before() {
                tracing::debug!(rank, "the units ran in another order ({note}): prefetch follows it from now on");
            } else {
                tracing::warn!(
                    rank,
                    "the units ran in another order than the micro-batch before ({note}): prefetch follows the new order from the next micro-batch (later changes are logged at debug level)"
                );
            }
        }
        // The units in the order of their last entry: the last ones stay gathered for backward.
        let mut order: Vec<usize> = Vec::new();
        for &u in scopes.trace().forward.iter().rev() {
            if !order.contains(&u) {
                order.push(u);
            }
        }
        order.reverse();
        if !order.is_empty() {
            let kept = self.states.parameters.kept_after_forward_in(&order, &self.config.zero_optimization);
            self.walk.scopes.as_mut().expect("installed").kept = kept;
        }
    }

    /// Reduces, last unit first (one order on every rank), every unit with trainable parameters that this backward
    /// did not reduce yet: some of its parameters took no part, or it was not entered (zeros).
    /// Units of other ranks' experts (split over a group this rank is not in) are theirs to reduce.
    fn reduce_remaining_units(&mut self) -> Result<()> {
        let (n, rank) = (self.states.parameters.units.len(), self.rank());
        for u in (0..n).rev() {
            let scopes = self.walk.scopes.as_ref().expect("installed");
            if scopes.trains(u) && !scopes.reduced[u] && self.states.layout.units[u].holds(rank) {
                self.reduce_scoped_unit(u)?;
            }
        }
        Ok(())
    }

    fn release_scoped_units(&mut self) -> Result<()> {
        for u in 0..self.states.parameters.units.len() {
            let unit = &self.states.parameters.units[u];
            if !unit.persistent && unit.owns_buffer() && unit.state() != UnitState::Sharded {
                self.release_unit(u)?;
            }
        }
        Ok(())
    }

    /// Reduces unit `u`'s gradients (from its parameters' `.grad`; a missing one counts as zeros) into this rank's
    /// shard and frees them.
    fn reduce_scoped_unit(&mut self, u: usize) -> Result<()> {
        let grads: Vec<Option<Tensor>> = self.states.parameters.units[u]
            .params()
            .iter()
            .map(|p| {
                let g = p.grad();
                g.defined().then_some(g)
            })
            .collect();
        let name = self.walk.scopes.as_ref().expect("installed").label(u);
        // The unit's gradients are its parameters' `.grad`: the report counts them as gradients_full already.
        self.memory_event(|| format!("backward: unit {name} gradients"), &[]);
        self.walk.scopes.as_mut().expect("installed").reduced[u] = true;
        self.gradient_sync().reduce_unit(u, &grads)?;
        drop(grads);
        for p in self.states.parameters.units[u].params() {
            native::reset_grad(p);
        }
        self.memory_event(|| format!("backward: unit {name} reduced"), &[]);
        Ok(())
    }

    /// A unit's output hook: the unit gathered before autograd computes anything inside it.
    pub(crate) fn scope_output_ready(&mut self, u: usize) -> Result<()> {
        if self.walk.scopes.as_ref().is_some_and(|s| s.error.is_some()) {
            // The first error is the one returned; this stops autograd before it reads a released unit.
            return Err(Error::Usage("an earlier gradient hook failed".into()));
        }
        let (first, next) = self.walk.scopes.as_mut().expect("installed").reached(u);
        let name = self.walk.scopes.as_ref().expect("installed").label(u);
        if self.states.parameters.units[u].state() != UnitState::Gathered {
            self.gather_unit(u)?;
            self.memory_event(|| format!("backward: unit {name} gathered"), &[]);
        }
        if first {
            self.enter_phase(|| format!("backward: unit {name}"));
        }
        if let Some(next) = next {
            self.prefetch(next.iter().copied())?;
            self.states.parameters.read_ahead(next.into_iter());
        }
        Ok(())
    }

    /// A parameter's gradient hook: when its unit has all of its gradients, the unit is reduced and released.
    pub(crate) fn scope_grad_ready(&mut self, slot: usize) -> Result<()> {
        let scopes = self.walk.scopes.as_mut().expect("hooks come with scopes");
        if scopes.error.is_some() {
            return Ok(());
        }
        let Some(u) = scopes.count_down(slot) else { return Ok(()) };
        let frozen_part = scopes.has_frozen[u];
        self.reduce_scoped_unit(u)?;
        // Frozen parameters have no gradient to say when backward is done with them: their unit waits for the end.
        if !self.states.parameters.units[u].persistent && !frozen_part {
            self.release_unit(u)?;
        }
        Ok(())
    }

    /// Keeps the first error a hook met, for `backward` to return.
    pub(crate) fn scope_error(&mut self, e: Error) {
        if let Some(scopes) = self.walk.scopes.as_mut() {
            scopes.error.get_or_insert(e);
        }
    }
}

/// Where a checkpointed unit's closure enters the units nested in it from.
#[derive(Clone)]
enum Reach {
    /// Units are gathered (stage 3, stage 2 with units): through the engine lent to the hooks, in forward by the
    /// checkpointed unit's scope and in backward by `engine.backward`.
    Lent(Arc<HookTarget>),
    /// Every rank holds every parameter: a nested unit is its parameters, found by name.
    ByName(Rc<ParamsByName>),
}

/// Every trainable parameter by name, and the units' prefixes (stages 0-2, where a unit is the parameters under
/// its prefixes).
struct ParamsByName {
    slots: Vec<(String, Tensor)>,
    units: Vec<Vec<String>>,
}

impl ParamsByName {
    fn of(engine: &Engine) -> ParamsByName {
        let slots = engine
            .states
            .layout
            .slots
            .iter()
            .zip(&engine.states.params)
            .map(|(slot, p)| (slot.name.clone(), p.shallow_clone()))
            .collect();
        ParamsByName { slots, units: engine.walk.unit_prefixes.clone() }
    }

    /// The parameters of the unit `name` names (all of its prefixes), or those under `name` where no unit has it;
    /// a name that is neither is an error (at stage 3 it would name no unit either).
    fn params(&self, name: &str) -> Result<Vec<Tensor>> {
        let own = [name.to_string()];
        let prefixes = self.units.iter().find(|u| u.iter().any(|p| p == name)).map_or(&own[..], Vec::as_slice);
        let params: Vec<Tensor> = self
            .slots
            .iter()
            .filter(|(n, _)| prefixes.iter().any(|p| crate::engine::zero::units::owns(p, n)))
            .map(|(_, p)| p.shallow_clone())
            .collect();
        if params.is_empty() && prefixes == own {
            return Err(Error::Usage(format!(
                "a checkpointed unit \"{name}\": no unit and no trainable parameter has that name (EngineOptions::units names units by their prefixes)"
            )));
        }
        Ok(params)
    }
}

/// The units a checkpointed unit's closure enters inside it ([`Engine::unit_checkpointed_with`]): each is
/// gathered for the call (in forward's run and again in backward's), and the parameters it holds get their
/// gradients from the checkpoint's backward beside the unit's own.
pub struct NestedUnits {
    reach: Reach,
    params: Vec<Tensor>,
}

impl NestedUnits {
    /// Runs `forward` as the unit `name` (any of its prefixes), nested in the checkpointed unit; its parameters
    /// must be those `forward` reads, as for [`Engine::unit`].
    pub fn unit<T: UnitOutput>(&mut self, name: &str, forward: impl FnOnce() -> T) -> Result<T> {
        match &self.reach {
            Reach::ByName(by_name) => {
                self.params.extend(by_name.params(name)?);
                Ok(forward())
            }
            Reach::Lent(target) => {
                let engine = target.lent();
                if engine.is_null() {
                    return Err(Error::Usage(format!(
                        "unit \"{name}\" nested in a checkpointed unit ran outside its forward and `engine.backward`"
                    )));
                }
                // SAFETY: the engine's lender (the checkpointed unit's scope, or `engine.backward`) waits in
                // libtorch while this closure runs, and nothing else holds the engine.
                let engine = unsafe { &mut *engine };
                let u = engine.scopes()?.unit_named(name)?;
                self.params.extend(engine.states.parameters.units[u].params().iter().map(Tensor::shallow_clone));
                engine.enter_unit(u, |_| forward())
            }
        }
    }
}

/// `engine.unit(name, ..)` on a rank that does not hold the unit: another expert-parallel position's experts.
fn another_positions_unit(name: &str, rank: usize) -> Error {
    Error::Usage(format!(
        "engine.unit(\"{name}\", ..) on rank {rank}: the unit holds experts of another expert-parallel position, split over other ranks; enter only the units of this rank's experts (`ExpertParallel::rank`)"
    ))
}
