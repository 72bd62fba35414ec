//! The engine's communicator, called directly or driven by its own thread (`overlap_comm`), so stage 3's next
//! units' all-gathers and stages 1-2's reductions run while this rank computes. Which units to start ahead is the
//! plan's ([`crate::engine::zero::plan::units_to_prefetch`]).
use std::ops::Deref;

use crate::comm::async_comm::CommThread;
use crate::comm::Communicator;

/// The engine's process group.
pub(crate) enum EngineComm {
    Direct(Box<dyn Communicator>),
    /// On a communication thread: blocking calls queue behind the prefetches started before them.
    Threaded(CommThread),
}

impl EngineComm {
    pub fn new(comm: Box<dyn Communicator>, threaded: bool) -> Self {
        if threaded {
            EngineComm::Threaded(CommThread::spawn(comm))
        } else {
            EngineComm::Direct(comm)
        }
    }

    pub fn as_ref(&self) -> &(dyn Communicator + 'static) {
        match self {
            EngineComm::Direct(c) => c.as_ref(),
            EngineComm::Threaded(t) => t,
        }
    }

    /// The thread, when collectives can be started ahead.
    pub fn thread(&self) -> Option<&CommThread> {
        match self {
            EngineComm::Threaded(t) => Some(t),
            EngineComm::Direct(_) => None,
        }
    }
}

impl Deref for EngineComm {
    type Target = dyn Communicator;

    fn deref(&self) -> &Self::Target {
        self.as_ref()
    }
}
