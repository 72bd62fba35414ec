//! Fault tolerance across replica groups (`fault_tolerance`): the shard groups' replicas (`mics_shard_size`) are
//! the failure domain, as in torchft. Every rank heartbeats on the job's TCPStore (`heartbeat.rs`); each step the
//! groups still alive form a quorum there (`quorum.rs`, the rule; `manager.rs`, the rounds), reduce across its
//! members only and vote to commit or discard the step. A lost group's peers discard the step it failed in, and
//! redo it without it (the engine splits the global batch over the groups left), with no restart. A group its
//! launcher restarts (`rejoin.rs`) waits until a step's last voter takes it in, joins that round's quorum and heals
//! from a group that stayed (`engine/fault_tolerant.rs`).
mod heartbeat;
mod manager;
mod quorum;
mod rejoin;

pub use manager::{Formed, ManagedReplicas, Manager, Place, Verdict};
pub use quorum::Quorum;
pub use rejoin::{incarnation, RejoiningWorld, REJOIN_ENV};
