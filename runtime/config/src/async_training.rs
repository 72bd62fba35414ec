//! `async_training` (zerorun's own section): how far the data-parallel ranks may run apart. `off` is synchronous
//! training; `local_sgd` and `diloco` let every rank take `sync_every` optimizer steps on its own gradients before
//! the ranks meet (the parameters averaged, or their averaged change applied by an outer optimizer: DiLoCo);
//! `bounded_staleness` lets every rank run up to `staleness` optimizer steps ahead of the slowest, on parameters
//! that may lack that many steps' updates (stale synchronous parallel over stage 1's partition).
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::Section;

/// DiLoCo's outer optimizer: SGD with Nesterov momentum on the averaged parameter change. Written back as the
/// section spells it (`{"type": "nesterov", "lr": 0.7, "momentum": 0.9}`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterOptimizer {
    /// The outer learning rate.
    pub lr: f64,
    /// The outer momentum.
    pub momentum: f64,
    /// Nesterov momentum (`type: nesterov`).
    pub nesterov: bool,
}

impl Serialize for OuterOptimizer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let kind = if self.nesterov { "nesterov" } else { "sgd" };
        serde_json::json!({"type": kind, "lr": self.lr, "momentum": self.momentum}).serialize(s)
    }
}

impl Default for OuterOptimizer {
    /// DiLoCo's (Douillard et al. 2023): lr 0.7, momentum 0.9, Nesterov.
    fn default() -> Self {
        OuterOptimizer { lr: 0.7, momentum: 0.9, nesterov: true }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
/// The `async_training` section: how far data-parallel ranks may run apart.
pub enum AsyncTraining {
    /// Synchronous: gradients averaged every step.
    #[default]
    Off,
    /// Every rank steps alone; every `sync_every` steps the parameters are averaged.
    LocalSgd {
        /// Local steps between averages.
        sync_every: u64,
    },
    /// Every rank steps alone (the inner optimizer is the config's); every `sync_every` steps the averaged change
    /// since the last meeting is applied by `outer_optimizer`.
    Diloco {
        /// Local steps between meetings.
        sync_every: u64,
        /// What applies the averaged change.
        outer_optimizer: OuterOptimizer,
    },
    /// Stale synchronous parallel: each rank owns a partition of the parameters and its optimizer state (as at
    /// stage 1); workers push gradients to the owners and pull the owners' latest values, and start a step only
    /// once every owner has applied the steps older than `staleness` (0: synchronous). With
    /// `lr_staleness_scaling` each gradient is divided by its staleness (steps of updates its parameters lacked).
    BoundedStaleness {
        /// Steps a rank may run ahead of the slowest owner.
        staleness: u64,
        /// Divide each gradient by its staleness + 1.
        lr_staleness_scaling: bool,
    },
}

impl AsyncTraining {
    /// Steps between meetings (1 when synchronous).
    pub fn sync_every(&self) -> u64 {
        match self {
            AsyncTraining::Off | AsyncTraining::BoundedStaleness { .. } => 1,
            AsyncTraining::LocalSgd { sync_every } | AsyncTraining::Diloco { sync_every, .. } => *sync_every,
        }
    }

    /// Whether ranks step on their own gradients between meetings (local SGD, DiLoCo).
    pub fn is_local(&self) -> bool {
        matches!(self, AsyncTraining::LocalSgd { .. } | AsyncTraining::Diloco { .. })
    }

    /// Whether training is anything but synchronous.
    pub fn is_async(&self) -> bool {
        !matches!(self, AsyncTraining::Off)
    }

    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let mode = s.choice("mode", &["off", "local_sgd", "diloco", "bounded_staleness"], "off")?;
        let invalid = |s: &Section, key: &str, value: String, allowed: &str| ConfigError::Invalid {
            path: s.path_of(key),
            value,
            allowed: allowed.into(),
        };
        let out = match mode {
            "bounded_staleness" => AsyncTraining::BoundedStaleness {
                staleness: s.uint("staleness", 0)?,
                lr_staleness_scaling: s.bool("lr_staleness_scaling", false)?,
            },
            "off" => AsyncTraining::Off,
            _ => {
                let sync_every = s.uint("sync_every", 0)?;
                if sync_every == 0 {
                    return Err(invalid(&s, "sync_every", "0 or absent".into(), "at least 1 optimizer step"));
                }
                if mode == "local_sgd" {
                    AsyncTraining::LocalSgd { sync_every }
                } else {
                    let mut outer = s.section("outer_optimizer")?;
                    let kind = outer.choice("type", &["nesterov", "sgd"], "nesterov")?;
                    let d = OuterOptimizer::default();
                    let o = OuterOptimizer {
                        lr: outer.float("lr", d.lr)?,
                        momentum: outer.float("momentum", d.momentum)?,
                        nesterov: kind == "nesterov",
                    };
                    if o.lr <= 0.0 {
                        return Err(invalid(&outer, "lr", o.lr.to_string(), "> 0"));
                    }
                    if !(0.0..1.0).contains(&o.momentum) {
                        return Err(invalid(&outer, "momentum", o.momentum.to_string(), "in [0, 1)"));
                    }
                    outer.finish()?;
                    AsyncTraining::Diloco { sync_every, outer_optimizer: o }
                }
            }
        };
        s.finish()?;
        Ok(out)
    }
}
