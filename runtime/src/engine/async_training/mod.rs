//! Asynchronous training's engine side: local SGD and DiLoCo's meetings (`meetings.rs`), and bounded staleness
//! (`staleness.rs`: the protocol over shared windows; `relay.rs`: its relay across processes; `stale_step.rs`: the
//! step as a worker and as an owner).
pub(crate) mod meetings;
pub(crate) mod relay;
pub(crate) mod stale_step;
pub(crate) mod staleness;

/// How the ranks synchronise at a step boundary, chosen once from `async_training.mode`.
pub(crate) enum Synchronization {
    /// Every step reduces over all ranks.
    Synchronous,
    /// Local SGD or DiLoCo: the ranks step alone and meet every few steps.
    Meetings(meetings::Meetings),
    /// Bounded staleness: gradients go to their partitions' owners, values come back at most `staleness` late.
    Stale(Box<stale_step::Stale>),
}

impl Synchronization {
    pub fn meetings(&self) -> Option<&meetings::Meetings> {
        match self {
            Synchronization::Meetings(m) => Some(m),
            _ => None,
        }
    }

    pub fn meetings_mut(&mut self) -> Option<&mut meetings::Meetings> {
        match self {
            Synchronization::Meetings(m) => Some(m),
            _ => None,
        }
    }

    pub fn stale(&self) -> Option<&stale_step::Stale> {
        match self {
            Synchronization::Stale(s) => Some(s),
            _ => None,
        }
    }

    pub fn stale_mut(&mut self) -> Option<&mut stale_step::Stale> {
        match self {
            Synchronization::Stale(s) => Some(s),
            _ => None,
        }
    }

    pub fn is_stale(&self) -> bool {
        matches!(self, Synchronization::Stale(_))
    }
}
