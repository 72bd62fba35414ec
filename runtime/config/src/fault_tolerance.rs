//! `fault_tolerance`: the replica groups of a job with shard groups (`zero_optimization.mics_shard_size`) survive
//! the loss of one another. Each step the live groups agree on who takes part (a quorum: at least `min_replicas`
//! groups and a majority of the groups still heartbeating, so two halves never both go on), reduce gradients among
//! themselves only (a mean over the live groups' ranks) and commit or discard the step together. A group that loses
//! a rank leaves; the others redo the step with the whole global batch split over them and go on, no restart.
//! torchft's lighthouse quorum (see `../shared/reference/moe-sequence-faults.md`), over the job's own TCPStore.
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::Section;

/// The `fault_tolerance` section, every default filled in.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultToleranceConfig {
    /// Make the replica dimension fault-tolerant.
    pub enabled: bool,
    /// Fewest replica groups a step may be taken with (the run stops, naming why, below it).
    pub min_replicas: u64,
    /// Seconds a quorum or a step's vote may wait for the groups that still heartbeat.
    pub quorum_timeout: f64,
    /// Milliseconds between a rank's heartbeats; a rank silent for 5 of them (`MISSED_BEATS`) is lost.
    pub heartbeat_ms: u64,
}

/// Heartbeats a rank may miss before its group is counted lost.
pub const MISSED_BEATS: u64 = 5;

impl Default for FaultToleranceConfig {
    fn default() -> Self {
        FaultToleranceConfig { enabled: false, min_replicas: 1, quorum_timeout: 60.0, heartbeat_ms: 100 }
    }
}

impl FaultToleranceConfig {
    /// How long a rank may be silent before its group is counted lost.
    pub fn heartbeat_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.heartbeat_ms * MISSED_BEATS)
    }

    /// When enabled: what it needs of the rest of `config` (shard groups, and a step taken whole before the groups
    /// vote on it).
    pub(crate) fn check(&self, config: &super::Config) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let conflict = |message: &str| {
            Err(ConfigError::Conflict { path: "fault_tolerance.enabled".into(), message: message.into() })
        };
        if config.zero_optimization.mics_shard_size.is_none() {
            return conflict(
                "fault tolerance keeps the replica groups of shard groups going when one is lost: set `zero_optimization.mics_shard_size` (ranks per group, fewer than the data-parallel ranks)",
            );
        }
        if config.optimizer_in_backward {
            return conflict("`optimizer_in_backward` steps the optimizer during backward, before the replica groups vote on the step");
        }
        if config.async_training.is_async() {
            return conflict("asynchronous training has no per-step reduction across the replica groups to vote on");
        }
        if config.elasticity.enabled {
            return conflict("`elasticity` sizes the batch at each restart; fault tolerance keeps `train_batch_size` and splits it over the live groups (set one of them)");
        }
        if config.gradient_compression != super::GradientCompression::None {
            return conflict("compressed gradients keep error-feedback state across the replica groups, which a lost group would leave inconsistent");
        }
        Ok(())
    }

    pub(crate) fn read(mut s: Section) -> Result<Self> {
        let d = FaultToleranceConfig::default();
        let enabled = s.bool("enabled", d.enabled)?;
        let min_replicas = s.uint("min_replicas", d.min_replicas)?;
        if min_replicas == 0 {
            return Err(ConfigError::Invalid {
                path: s.path_of("min_replicas"),
                value: "0".into(),
                allowed: "at least 1 (replica groups a step needs)".into(),
            });
        }
        let quorum_timeout = s.float("quorum_timeout", d.quorum_timeout)?;
        if !(quorum_timeout > 0.0 && quorum_timeout.is_finite()) {
            return Err(ConfigError::Invalid {
                path: s.path_of("quorum_timeout"),
                value: quorum_timeout.to_string(),
                allowed: "a positive number of seconds".into(),
            });
        }
        let heartbeat_ms = s.uint("heartbeat_ms", d.heartbeat_ms)?;
        if heartbeat_ms == 0 || heartbeat_ms * MISSED_BEATS > (quorum_timeout * 1000.0) as u64 {
            return Err(ConfigError::Invalid {
                path: s.path_of("heartbeat_ms"),
                value: heartbeat_ms.to_string(),
                allowed: format!(
                    "at least 1, and {MISSED_BEATS} of them within `quorum_timeout` ({quorum_timeout} s): a lost group must be found before the quorum gives up"
                ),
            });
        }
        let c = FaultToleranceConfig { enabled, min_replicas, quorum_timeout, heartbeat_ms };
        s.finish()?;
        Ok(c)
    }
}
