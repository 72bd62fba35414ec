//! Local SGD and DiLoCo (`async_training`): every rank steps its own optimizer on its own gradients, and every
//! `sync_every` optimizer steps the ranks meet. Local SGD averages the parameters; DiLoCo averages them too, takes
//! the change from the parameters of the last meeting (the anchor) as the outer gradient and applies it to the
//! anchor with SGD with (Nesterov) momentum, as `torch.optim.SGD` does; every rank then continues from the anchor.
//! Between meetings no collective runs: not the gradients' reduction, not the loss's mean, not the buffers' sync.
use tch::Tensor;

use crate::comm::{Communicator, ReduceOp};
use crate::config::{AsyncTraining, OuterOptimizer};
use crate::engine::device::{views, Residence};
use crate::engine::zero::layout::ParamSlot;
use crate::error::Result;

pub(crate) struct Meetings {
    every: u64,
    diloco: Option<Diloco>,
}

struct Diloco {
    outer: OuterOptimizer,
    /// The parameters after the last meeting (fp32, the flat buffer's length).
    anchor: Tensor,
    /// The outer optimizer's momentum buffer.
    momentum: Tensor,
}

impl Meetings {
    /// None when training is synchronous. `flat`: the values the ranks meet by (the parameters' flat buffer, or a
    /// 16-bit model's fp32 master), stage 0's whole padded length.
    pub fn new(mode: &AsyncTraining, flat: &Tensor) -> Option<Meetings> {
        match *mode {
            AsyncTraining::Off | AsyncTraining::BoundedStaleness { .. } => None,
            AsyncTraining::LocalSgd { sync_every } => Some(Meetings { every: sync_every, diloco: None }),
            AsyncTraining::Diloco { sync_every, outer_optimizer } => Some(Meetings {
                every: sync_every,
                diloco: Some(Diloco {
                    outer: outer_optimizer,
                    anchor: tch::no_grad(|| flat.to_kind(tch::Kind::Float).copy()),
                    momentum: flat.zeros_like().to_kind(tch::Kind::Float),
                }),
            }),
        }
    }

    /// Whether the optimizer step numbered `step` (from 1) ends with a meeting.
    pub fn meets_after(&self, step: u64) -> bool {
        step % self.every == 0
    }

    /// Why a checkpoint cannot be taken after `steps` optimizer steps, if it cannot: between meetings the ranks'
    /// parameters differ (a checkpoint holds one copy of them).
    pub fn refuses_checkpoint(&self, steps: u64) -> Option<String> {
        (!self.meets_after(steps)).then(|| {
            format!(
                "async_training: after {steps} steps the ranks are between meetings (every {} steps) and their parameters differ; save right after a meeting",
                self.every
            )
        })
    }

    /// DiLoCo's anchor and momentum by parameter name (`anchor/<name>`, `momentum/<name>`), for a checkpoint; empty
    /// for local SGD.
    pub fn outer_state(&self, slots: &[ParamSlot]) -> Vec<(String, Tensor)> {
        let Some(d) = &self.diloco else { return Vec::new() };
        let mut out = Vec::with_capacity(2 * slots.len());
        for (what, t) in [("anchor", &d.anchor), ("momentum", &d.momentum)] {
            for s in slots {
                let piece = t.narrow(0, s.range.start as i64, s.range.len() as i64).view(s.shape.as_slice());
                out.push((format!("{what}/{}", s.name), piece));
            }
        }
        out
    }

    /// Restores DiLoCo's anchor and momentum from a checkpoint's outer state (`read(name)`), parameter by parameter.
    pub fn load_outer_state(
        &mut self,
        slots: &[ParamSlot],
        read: &mut dyn FnMut(&str) -> Result<Tensor>,
    ) -> Result<()> {
        let Some(d) = &mut self.diloco else { return Ok(()) };
        tch::no_grad(|| -> Result<()> {
            for (what, t) in [("anchor", &d.anchor), ("momentum", &d.momentum)] {
                for s in slots {
                    let saved = read(&format!("{what}/{}", s.name))?;
                    t.narrow(0, s.range.start as i64, s.range.len() as i64)
                        .f_copy_(&saved.to_kind(tch::Kind::Float).reshape([-1]))?;
                }
            }
            Ok(())
        })
    }

    /// Whether this is DiLoCo (whose checkpoints carry the outer state).
    pub fn has_outer_state(&self) -> bool {
        self.diloco.is_some()
    }

    /// The meeting: every rank ends with the same values in `flat` (see [`Meetings::new`]). Collective.
    pub fn meet(&mut self, residence: Residence, comm: &dyn Communicator, flat: &Tensor) -> Result<()> {
        views::all_reduce(residence, comm, flat, ReduceOp::Avg)?;
        let Some(d) = &mut self.diloco else { return Ok(()) };
        tch::no_grad(|| -> Result<()> {
            // The outer gradient: how far the average moved from the anchor, against the descent direction.
            let delta = d.anchor.f_sub(&flat.to_kind(tch::Kind::Float))?;
            let mu = d.outer.momentum;
            let _ = d.momentum.f_mul_scalar_(mu)?.f_add_(&delta)?;
            let update = if d.outer.nesterov { delta.f_add(&(&d.momentum * mu))? } else { d.momentum.shallow_clone() };
            let _ = d.anchor.f_sub_(&(update * d.outer.lr))?;
            flat.shallow_clone().f_copy_(&d.anchor)?;
            Ok(())
        })
    }
}
