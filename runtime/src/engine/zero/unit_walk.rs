//! The walk over the model's units (stage 3, and stage 2 with units, whose units stay gathered): forward gathers
//! each unit, runs it on its input detached as a new leaf and releases it; backward walks the units in reverse, gathers each again, backpropagates from its saved output
//! with the gradient of the next unit's input, reduce-scatters the unit's gradients into this rank's shard and
//! releases parameters and full gradients. With activation checkpointing only unit inputs are kept and each
//! unit is recomputed in backward.
use tch::Tensor;

use crate::engine::counters::{CommVolume, GatheredBytes};
use crate::engine::device::native;
use crate::engine::zero::plan::{self, GradientPath};
use crate::engine::zero::sharded_unit::UnitState;
use crate::engine::zero::units::UnitModel;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::report::memory::MemoryCategory;

/// What forward keeps of one unit for backward.
pub(crate) struct UnitRecord {
    /// The unit's input as run: a leaf that requires grad (units after the first, floating inputs).
    input: Tensor,
    /// The unit's output with its graph (None under activation checkpointing: recomputed in backward).
    output: Option<Tensor>,
}

/// Stage 3's walk over the model's units.
pub(crate) struct Walk {
    /// The units' parameter-name prefixes, in execution order.
    pub unit_prefixes: Vec<Vec<String>>,
    /// What the current micro-batch's forward kept for backward.
    pub records: Vec<UnitRecord>,
    /// Keep only each unit's input in forward and recompute the unit in backward.
    pub activation_checkpointing: bool,
}

impl Engine {
    /// Runs `model` on `input`, unit by unit. At stages 0-2 this is just the units in order; at stage 3 it
    /// gathers each unit's parameters only while it runs. Under `tch::no_grad` nothing is kept for backward.
    pub fn forward(&mut self, model: &dyn UnitModel, input: &Tensor) -> Result<Tensor> {
        let _span = crate::report::Phase::Forward.span().entered();
        let (started, comm_before) = (std::time::Instant::now(), self.report.times.comm());
        let out = self.forward_impl(model, input);
        self.report.times.add(
            crate::report::Phase::Forward,
            started.elapsed().saturating_sub(self.report.times.comm() - comm_before),
        );
        out
    }

    fn forward_impl(&mut self, model: &dyn UnitModel, input: &Tensor) -> Result<Tensor> {
        let prefixes = model.unit_prefixes();
        if self.plan.gradients != GradientPath::UnitWalk {
            let mut h = input.shallow_clone();
            for i in 0..prefixes.len() {
                h = model.forward_unit(i, &h);
            }
            return Ok(h);
        }
        if prefixes != self.walk.unit_prefixes {
            return Err(Error::Usage(format!(
                "the model's units {prefixes:?} are not the ones the engine was built with {:?} (EngineOptions::units)",
                self.walk.unit_prefixes
            )));
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
                h = model.forward_unit(i, &h);
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
            let y = if recompute { tch::no_grad(|| model.forward_unit(i, &x)) } else { model.forward_unit(i, &x) };
            self.walk.records.push(UnitRecord { input: x, output: (!recompute).then(|| y.shallow_clone()) });
            if !last && !self.states.parameters.units[i].persistent && !kept {
                self.release_unit(i)?;
            }
            h = y;
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
        let records = std::mem::take(&mut self.walk.records);
        if records.len() != self.states.parameters.units.len() {
            let stage = self.plan.stage();
            let plain = if self.plan.shard_in_pieces() {
                "; for a plain loop at stage 2 build the engine without EngineOptions::units"
            } else {
                ""
            };
            return Err(Error::Usage(format!(
                "the engine runs the model's units at stage {stage}: the loss must come from `engine.forward(&model, input)` (run with gradients), once per backward{plain}"
            )));
        }
        if self.plan.steps_in_backward {
            self.shard.begin_step_in_backward()?;
        }
        let root = if factor != 1.0 { loss * factor } else { loss.shallow_clone() };
        let mut upstream: Option<Tensor> = None;
        for i in (0..records.len()).rev() {
            let last = i + 1 == records.len();
            let rec = &records[i];
            self.gather_unit(i)?;
            self.prefetch((0..i).rev())?;
            self.states.parameters.read_ahead((0..i).rev());
            self.memory_event(|| format!("backward: unit {i} gathered"), &[]);
            let output = match &rec.output {
                Some(y) => y.shallow_clone(),
                None => {
                    let model = model.ok_or_else(|| {
                        Error::Usage("activation checkpointing recomputes units in backward: call `engine.backward_units(&model, &loss)`".into())
                    })?;
                    model.forward_unit(i, &rec.input)
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
                    Some(r) if output.requires_grad() || last => native::grad(&[r], &inputs)?,
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
        self.states.parameters.gather(i, self.comm.as_ref(), &mut self.report.comm_volume)?;
        self.report.times.add(crate::report::Phase::AllGather, t.elapsed());
        Ok(())
    }

    fn prefetch(&mut self, order: impl Iterator<Item = usize>) -> Result<()> {
        self.states.parameters.prefetch(order, &self.comm, &self.config.zero_optimization, &mut self.report.comm_volume)
    }

    pub(crate) fn release_unit(&mut self, i: usize) -> Result<()> {
        self.states.parameters.release(i)
    }

    /// After an optimizer step: units that stay gathered take the new values of every rank's shard.
    pub(crate) fn refresh_gathered_units(&mut self) -> Result<()> {
        self.states.parameters.refresh_gathered(self.comm.as_ref(), &mut self.report.comm_volume)
    }

    /// Bytes of gathered full parameters (stage 3): now, the run's peak, the current step's peak.
    pub fn gathered_bytes(&self) -> GatheredBytes {
        self.states.parameters.gathered
    }

    /// Elements this rank's collectives moved since the engine started.
    pub fn comm_volume(&self) -> CommVolume {
        self.report.comm_volume
    }

    /// Every trainable parameter by name as full copies of `kind`, and with `frozen` every frozen one in its own
    /// dtype (stage 3 gathers unit by unit: collective there).
    pub(crate) fn gather_full_parameters(&mut self, kind: tch::Kind, frozen: bool) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(self.states.layout.slots.len());
        for i in 0..self.states.parameters.units.len() {
            let was = self.states.parameters.units[i].state();
            self.gather_unit(i)?;
            let span = self.states.parameters.units[i].span.clone();
            for (slot, t) in self.states.layout.slots[span.slots].iter().zip(self.states.parameters.units[i].params()) {
                // A copy: the unit's storage may be freed below.
                out.push((slot.name.clone(), t.detach().to_kind(kind).copy()));
            }
            if let Some(units) = self.states.parameters.frozen_units.as_ref().filter(|_| frozen) {
                out.extend(units.named(i).map(|(n, t)| (n.to_string(), t.detach().copy())));
            }
            if was == UnitState::Sharded {
                self.release_unit(i)?;
            }
        }
        Ok(out)
    }
}

/// Start-up at stage 3: packs each unit's parameters into its buffer, takes rank 0's values, keeps this
/// rank's chunk of every unit in the shard and releases all but the persistent units. Returns (shard, the
/// model's tensors in layout order, units).
pub(crate) fn shard_units(
    layout: &crate::engine::FlatLayout,
    named: Vec<(String, Tensor)>,
    frozen_numel: &[u64],
    (kind, residence): (tch::Kind, crate::engine::device::Residence),
    comm: &dyn crate::comm::Communicator,
    config: &crate::config::Config,
    mut materialize: Option<&mut crate::engine::zero::units::Materialize>,
) -> Result<(Tensor, Vec<Tensor>, Vec<crate::engine::zero::sharded_unit::ShardedUnit>)> {
    let z = &config.zero_optimization;
    let ws = comm.world_size();
    let shard = Tensor::f_zeros([layout.partition_len() as i64], (kind, residence.device()))?;
    let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
    let mut units = Vec::with_capacity(layout.units.len());
    // A unit persists by its whole size, frozen parameters included: both parts are gathered together.
    let numels: Vec<u64> = layout
        .units
        .iter()
        .zip(frozen_numel)
        .map(|(span, frozen)| {
            layout.slots[span.slots.clone()].iter().map(|s| s.range.len() as u64).sum::<u64>() + frozen
        })
        .collect();
    let persistence =
        plan::persistent_units(&numels, z.stage3_param_persistence_threshold, z.stage3_model_persistence_threshold);
    let mut offset = 0;
    for (span, persistent) in layout.units.iter().zip(persistence) {
        if let (Some(m), false) = (materialize.as_deref_mut(), span.slots.is_empty()) {
            let vars: Vec<(&str, &Tensor)> =
                names[span.slots.clone()].iter().map(String::as_str).zip(&params[span.slots.clone()]).collect();
            m(units.len(), &vars)?;
        }
        let own: Vec<Tensor> = params[span.slots.clone()].iter().map(Tensor::shallow_clone).collect();
        units.push(crate::engine::zero::sharded_unit::ShardedUnit::shard_from_rank0(
            span.clone(),
            &layout.slots[span.slots.clone()],
            own,
            kind,
            offset,
            persistent,
            comm,
            &shard,
            residence,
        )?);
        offset += span.chunk_len(ws);
    }
    Ok((shard, params, units))
}
