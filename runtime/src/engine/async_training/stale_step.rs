//! A rank's bounded staleness over the engine's parts (`staleness.rs` is the protocol): setting up the window from
//! the engine's values, the step at each accumulation boundary (push this rank's gradients, serve its partition as
//! owner, pull the next values), and quiescing before checkpoints and at the end of the run. The engine lends its
//! parts for each call ([`StaleParts`]).
use std::time::Duration;

use tch::Tensor;

use crate::comm::Communicator;
use crate::config::Config;
use crate::engine::async_training::staleness::{BoundedStaleness, OwnerStep};
use crate::engine::device::{views, Residence};
use crate::engine::zero::grads::Gradients;
use crate::engine::zero::layout::FlatLayout;
use crate::engine::zero::optim::OptimizerShard;
use crate::error::{Error, Result};

/// Bounded staleness on a 16-bit model or one on a device: the fp32 host values workers and owners exchange (a
/// 16-bit model's own partition is the master), and the host buffer its gradients are widened or copied into each
/// step. The windows are host memory; an fp32 host model exchanges its parameters in place instead.
pub(crate) struct StalenessValues {
    values: Vec<f32>,
    grads: Vec<f32>,
}

/// A rank's bounded staleness: its window, inbox and accumulators, the values it exchanges, and the schedule of
/// the steps it applies as an owner.
pub(crate) struct Stale {
    window: BoundedStaleness,
    values: Option<StalenessValues>,
    owner_schedule: Option<zerorun_optim::schedule::LrScheduler>,
    /// `engine.finish()` ran: every step is applied and the ranks hold one model.
    finished: bool,
}

impl Stale {
    /// Whether the run was ended with `engine.finish()`.
    pub fn finished(&self) -> bool {
        self.finished
    }
}

/// What bounded staleness borrows of the engine for one call.
pub(crate) struct StaleParts<'a> {
    pub comm: &'a dyn Communicator,
    /// The flat parameters (every rank holds them whole: bounded staleness runs at stages 0-1).
    pub flat: &'a Tensor,
    pub shard: &'a mut OptimizerShard,
    pub layout: &'a FlatLayout,
    pub residence: Residence,
}

impl Stale {
    /// `async_training.mode = "bounded_staleness"`: the window, with this rank's partition as its owner's values
    /// (a 16-bit model's: its fp32 master). None in the other modes. Collective.
    pub fn start(config: &Config, gradients: &Gradients, parts: StaleParts<'_>) -> Result<Option<Stale>> {
        let crate::config::AsyncTraining::BoundedStaleness { staleness, lr_staleness_scaling } = config.async_training
        else {
            return Ok(None);
        };
        if gradients.view_buffer().is_none() {
            return Err(Error::Unsupported {
                key: "communication_data_type",
                value: format!("{:?}", config.communication_data_type),
                why: "bounded staleness pushes the gradients as autograd wrote them: they must travel in the model's dtype (leave communication_data_type out)",
            });
        }
        let mut wide = Vec::<f32>::try_from(&parts.flat.to_kind(tch::Kind::Float))?;
        if let Some(master) = &parts.shard.master {
            wide[parts.layout.partition(parts.comm.rank())].copy_from_slice(&Vec::<f32>::try_from(master)?);
        }
        let timeout = Duration::from_secs_f64(config.comms_timeout);
        let window = BoundedStaleness::new(parts.comm, &wide, staleness, lr_staleness_scaling, timeout)?;
        // An fp32 host model exchanges its parameters themselves; a 16-bit or device one an fp32 host copy of them.
        let copied = parts.shard.master.is_some() || parts.residence.device_path();
        let values = copied.then(|| StalenessValues { grads: vec![0.0; wide.len()], values: wide });
        let owner_schedule = parts.shard.scheduler.clone();
        Ok(Some(Stale { window, values, owner_schedule, finished: false }))
    }

    /// Runs `f` on the fp32 values workers and owners exchange: an fp32 model's flat parameters, or a 16-bit
    /// model's fp32 copy of them (its own partition being the owner's master), which then goes back into the
    /// parameters and the master.
    fn with_exchanged_values(
        &mut self,
        parts: &mut StaleParts<'_>,
        f: impl FnOnce(&mut BoundedStaleness, &dyn Communicator, &mut [f32], &mut OwnerStep<'_>) -> Result<()>,
    ) -> Result<()> {
        let Stale { window, values, owner_schedule, .. } = self;
        let shard = &mut *parts.shard;
        let mut step = owner_step(&mut shard.tier, &shard.groups, shard.base_lr, owner_schedule);
        let Some(wide) = values.as_mut() else {
            // SAFETY: inside `engine.step()` or between steps: nothing else touches the flat parameters.
            let flat = unsafe { views::slice::<f32>(parts.flat) };
            return f(window, parts.comm, flat, &mut step);
        };
        let done = f(window, parts.comm, &mut wide.values, &mut step);
        let flat = parts.flat;
        if parts.residence.device_path() {
            // The parameters take the exchanged values where they live (rounded to a 16-bit kind as the host does).
            let values = Tensor::from_slice(&wide.values);
            tch::no_grad(|| flat.shallow_clone().f_copy_(&values))?;
        } else {
            // SAFETY: as above; the 16-bit parameters take the exchanged values rounded, in one pass.
            let mut params = unsafe {
                match flat.kind() {
                    tch::Kind::Half => zerorun_optim::ParamsOut::F16(views::slice(flat)),
                    _ => zerorun_optim::ParamsOut::Bf16(views::slice(flat)),
                }
            };
            params.store(&wide.values);
        }
        if let Some(master) = shard.master.as_mut() {
            let own = Tensor::from_slice(&wide.values[parts.layout.partition(parts.comm.rank())]);
            tch::no_grad(|| master.f_copy_(&own))?;
        }
        done
    }

    /// Bounded staleness's optimizer step: push this step's gradients (autograd's, in `gradients`' view buffer),
    /// serve this rank's partition, pull the next step's values.
    /// A step that fails ends the run for this rank, which keeps serving its partition meanwhile (bounded by
    /// `comms_timeout`), so the other ranks see the failure that stopped it and name its cause, not this rank.
    pub fn step(&mut self, gradients: &mut Gradients, mut parts: StaleParts<'_>) -> Result<()> {
        // A handle of the gradient buffer (its storage is the engine's, untouched while this step runs).
        let view = gradients.view_buffer().expect("bounded staleness keeps gradient views").shallow_clone();
        // A 16-bit model's gradients widened into the buffer kept for them (taken out for the exchange).
        let mut widened = self.values.as_mut().map(|w| std::mem::take(&mut w.grads));
        // SAFETY: inside `engine.step()`: no forward, backward or collective touches the gradients.
        let grads: &[f32] = match widened.as_mut() {
            Some(g) if parts.residence.device_path() => {
                let n = g.len();
                view.f_to_device(tch::Device::Cpu)?.f_to_kind(tch::Kind::Float)?.f_copy_data(g, n)?;
                g
            }
            Some(g) => {
                unsafe { views::grads_of(&view) }.load(0..g.len(), g);
                g
            }
            None => unsafe { views::slice::<f32>(&view) },
        };
        let stepped = self.with_exchanged_values(&mut parts, |ps, _, values, step| ps.step(grads, values, step));
        if let (Some(w), Some(g)) = (self.values.as_mut(), widened) {
            w.grads = g;
        }
        if let Err(failed) = stepped {
            let rank = parts.comm.rank();
            if let Err(e) = self.finish(parts) {
                tracing::debug!(rank, "bounded_staleness after a failed step: {e}");
            }
            return Err(failed);
        }
        gradients.consume()
    }

    /// Gradients applied by this rank as an owner, by staleness.
    pub fn counts(&self) -> &[u64] {
        self.window.staleness_counts()
    }

    /// Before a checkpoint: every owner applies every step pushed so far and every rank pulls the values, so the
    /// ranks hold one model and no gradient is in flight; the checkpoint is then stage 1's. Collective.
    pub fn quiesce(&mut self, mut parts: StaleParts<'_>) -> Result<()> {
        self.with_exchanged_values(&mut parts, |ps, comm, values, step| ps.quiesce(comm, values, step))
    }

    /// Ends the run: every owner applies every step and every rank pulls the final values (collective; see
    /// [`BoundedStaleness::finish`]), after which the ranks' parameters are equal and no step may follow.
    pub fn finish(&mut self, mut parts: StaleParts<'_>) -> Result<()> {
        self.with_exchanged_values(&mut parts, |ps, comm, values, step| ps.finish(comm, values, step))?;
        self.finished = true;
        Ok(())
    }
}

/// An owner's optimizer step on its partition: the owner's schedule gives each applied step its learning rate (and
/// cycled momentum), in the order the steps are applied.
fn owner_step<'a>(
    tier: &'a mut crate::engine::zero::optim::build::OptimizerTier,
    groups: &'a [zerorun_optim::Group],
    base_lr: f64,
    schedule: &'a mut Option<zerorun_optim::schedule::LrScheduler>,
) -> impl FnMut(&mut [f32], &[f32]) -> Result<()> + 'a {
    let mut groups = groups.to_vec();
    move |values, mean| {
        let lr = schedule.as_ref().map_or(base_lr, zerorun_optim::schedule::LrScheduler::lr);
        for g in &mut groups {
            g.lr = lr;
        }
        if let Some(momentum) = schedule.as_ref().and_then(zerorun_optim::schedule::LrScheduler::momentum) {
            tier.set_momentum(momentum);
        }
        tier.step(values, mean, &groups, None)?;
        if let Some(s) = schedule.as_mut() {
            s.step();
        }
        Ok(())
    }
}
