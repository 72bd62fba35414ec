//! Stage 3 prefetch: the engine's communicator either called directly or driven by its own thread
//! (`overlap_comm`), so the next units' all-gathers run while the current unit computes; and which units to
//! start ahead, under `stage3_prefetch_bucket_size` and `stage3_max_live_parameters`.
use std::ops::Deref;

use crate::comm::async_comm::CommThread;
use crate::comm::Communicator;

/// The engine's process group.
pub(super) enum EngineComm {
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

/// All-gathers in flight at most, as FSDP's rate limiter: more only holds memory without hiding more latency.
pub(super) const MAX_GATHERS_IN_FLIGHT: usize = 2;

/// The units to start gathering next, walking `order` (unit indices in execution order after the current one):
/// sharded ones, in order, while their elements fit `bucket` (the first always does), the gathered elements stay
/// within `max_live`, and at most [`MAX_GATHERS_IN_FLIGHT`] counting the `in_flight` ones. `sizes[u]`: unit u's
/// elements; `sharded[u]`: whether it still needs gathering; `live`: elements gathered or in flight now.
pub(super) fn units_to_prefetch(order: impl Iterator<Item = usize>, sizes: &[u64], sharded: &[bool], live: u64, in_flight: usize, bucket: u64, max_live: u64) -> Vec<usize> {
    let mut picked = Vec::new();
    let (mut taken, mut live) = (0u64, live);
    for u in order {
        if in_flight + picked.len() >= MAX_GATHERS_IN_FLIGHT {
            break;
        }
        if !sharded[u] {
            continue;
        }
        let n = sizes[u];
        if (!picked.is_empty() && taken + n > bucket) || live + n > max_live {
            break;
        }
        picked.push(u);
        taken += n;
        live += n;
    }
    picked
}

#[cfg(test)]
mod tests {
    use super::units_to_prefetch;

    #[test]
    fn prefetch_takes_the_next_sharded_units_within_the_bucket_and_the_live_limit() {
        let sizes = [10, 20, 30, 40];
        let sharded = [true, false, true, true];
        // Unit 1 is gathered already (persistent): skipped. The first unit always fits the bucket.
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 0, 0, 5, 1000), vec![0]);
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 0, 0, 40, 1000), vec![0, 2]);
        // At most two in flight, however large the bucket.
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 0, 0, 1000, 1000), vec![0, 2]);
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 0, 1, 1000, 1000), vec![0]);
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 0, 2, 1000, 1000), Vec::<usize>::new());
        // Never beyond the live limit, not even the first.
        assert_eq!(units_to_prefetch(0..4, &sizes, &sharded, 95, 0, 1000, 100), Vec::<usize>::new());
        // Backward walks down.
        assert_eq!(units_to_prefetch((0..3).rev(), &sizes, &sharded, 0, 0, 30, 1000), vec![2]);
    }
}
