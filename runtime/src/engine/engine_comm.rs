//! The engine's communicators: the shard group ZeRO partitions over, called directly or driven by its own thread
//! (`overlap_comm`), so stage 3's next units' all-gathers and stages 1-3's reductions run while this rank computes
//! (which units to start ahead is the plan's, [`crate::engine::zero::plan::units_to_prefetch`]); and with shard
//! groups (MiCS, `mics_shard_size`) the replicas of this rank's shard across the other groups; with expert
//! parallelism, the ranks that hold the same experts as this one (the expert-data-parallel group), over which the
//! units of those experts are split.
use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tch::Tensor;

use crate::comm::async_comm::CommThread;
use crate::comm::{CommResult, Communicator, ReduceOp};
use crate::engine::device::{views, Residence};
use crate::engine::fault_tolerant::FaultTolerance;
use crate::engine::zero::layout::{UnitRanks, UnitSpan};

/// The engine's process groups.
pub(crate) struct EngineComm {
    shard: ShardGroup,
    replicas: Option<Replicas>,
    /// The expert-data-parallel group: the ranks at this rank's expert-parallel position, which hold its experts
    /// (units split over a group, [`UnitRanks::Group`]).
    experts: Option<ShardGroup>,
    /// `fault_tolerance`: the manager of the replicas' membership (which groups take each step).
    fault_tolerance: Option<FaultTolerance>,
}

enum ShardGroup {
    Direct(Box<dyn Communicator>),
    /// On a communication thread: blocking calls queue behind the prefetches started before them.
    Threaded(CommThread),
}

/// The ranks holding the same shard as this one in the other shard groups (MiCS): a bucket's reduced part is
/// all-reduced across them, and what spans every data-parallel rank (the loss, barriers) ends here. Shared with the
/// communication thread, which runs a bucket's reduce-scatter and then its all-reduce across replicas in one job;
/// the lock orders nothing (the thread's jobs finish before the engine's own calls at a step boundary), it only
/// makes the group `Sync`.
/// With fault tolerance the place and the count are the live groups' ([`Replicas::set_live`]).
#[derive(Clone)]
pub(crate) struct Replicas {
    group: Arc<Mutex<Box<dyn Communicator>>>,
    index: Arc<AtomicUsize>,
    count: Arc<AtomicUsize>,
}

impl Replicas {
    fn new(group: Box<dyn Communicator>) -> Replicas {
        let (index, count) = (group.rank(), group.world_size());
        Replicas {
            group: Arc::new(Mutex::new(group)),
            index: Arc::new(AtomicUsize::new(index)),
            count: Arc::new(AtomicUsize::new(count)),
        }
    }

    /// This rank's shard group among the replicas.
    pub fn index(&self) -> usize {
        self.index.load(Ordering::Relaxed)
    }

    /// Shard groups in the job (the live ones, with fault tolerance).
    pub fn count(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Fault tolerance: this rank's group is `index` of the `count` groups of the step's quorum.
    pub fn set_live(&self, index: usize, count: usize) {
        self.index.store(index, Ordering::Relaxed);
        self.count.store(count, Ordering::Relaxed);
    }

    /// Runs `f` on the replicas' group.
    pub fn with<R>(&self, f: impl FnOnce(&dyn Communicator) -> R) -> R {
        let group = self.group.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        f(group.as_ref())
    }

    /// All-reduces `t` (a reduced gradient part) across the replicas, its traffic int8 blocks of `quantized`
    /// values if given (`zero_quantized_gradients`).
    pub fn all_reduce(
        &self,
        residence: Residence,
        t: &Tensor,
        op: ReduceOp,
        quantized: Option<usize>,
    ) -> CommResult<()> {
        self.with(|g| match quantized {
            Some(block) => views::all_reduce_quantized(residence, g, t, op, block),
            None => views::all_reduce(residence, g, t, op),
        })
    }
}

impl EngineComm {
    pub fn new(comm: Box<dyn Communicator>, replicas: Option<Box<dyn Communicator>>, threaded: bool) -> Self {
        let shard = if threaded { ShardGroup::Threaded(CommThread::spawn(comm)) } else { ShardGroup::Direct(comm) };
        EngineComm {
            shard,
            replicas: replicas.filter(|r| r.world_size() > 1).map(Replicas::new),
            experts: None,
            fault_tolerance: None,
        }
    }

    /// With fault tolerance's manager of the replicas (`fault_tolerance`).
    pub(super) fn with_fault_tolerance(mut self, ft: Option<FaultTolerance>) -> Self {
        self.fault_tolerance = ft;
        self
    }

    /// Fault tolerance's manager of the replicas, when on.
    pub(super) fn fault_tolerance(&self) -> Option<&FaultTolerance> {
        self.fault_tolerance.as_ref()
    }

    /// With the expert-data-parallel group `group` (on a thread of its own when `threaded`): the units split over
    /// a group of ranks gather and reduce over it.
    pub fn with_experts(mut self, group: Box<dyn Communicator>, threaded: bool) -> Self {
        self.experts =
            Some(if threaded { ShardGroup::Threaded(CommThread::spawn(group)) } else { ShardGroup::Direct(group) });
        self
    }

    /// The group a collective runs over: the expert-data-parallel group (`over_experts`, only where the engine has
    /// units split over it), else the shard group.
    fn group(&self, over_experts: bool) -> &ShardGroup {
        match over_experts {
            true => self.experts.as_ref().expect("units split over a group come with the engine's group"),
            false => &self.shard,
        }
    }

    /// [`group`](Self::group)'s communicator.
    pub fn over(&self, over_experts: bool) -> &(dyn Communicator + 'static) {
        self.group(over_experts).as_ref()
    }

    /// [`group`](Self::group)'s thread, when collectives can be started ahead.
    pub fn thread_over(&self, over_experts: bool) -> Option<&CommThread> {
        self.group(over_experts).thread()
    }

    /// The group a unit is split over: the shard group, or the expert-data-parallel group.
    pub fn of_unit(&self, span: &UnitSpan) -> &(dyn Communicator + 'static) {
        self.over(span.ranks != UnitRanks::All)
    }

    /// The thread of the group a unit is split over, when collectives can be started ahead.
    pub fn thread_of_unit(&self, span: &UnitSpan) -> Option<&CommThread> {
        self.thread_over(span.ranks != UnitRanks::All)
    }

    /// The shard group.
    pub fn as_ref(&self) -> &(dyn Communicator + 'static) {
        self.shard.as_ref()
    }

    /// The thread, when collectives can be started ahead.
    pub fn thread(&self) -> Option<&CommThread> {
        self.shard.thread()
    }

    /// The replicas of this rank's shard (MiCS), if there are any.
    pub fn replicas(&self) -> Option<&Replicas> {
        self.replicas.as_ref()
    }

    /// This rank among all data-parallel ranks: shard groups are consecutive ranks, replicas the slower index.
    pub fn data_rank(&self) -> usize {
        self.replicas.as_ref().map_or(0, |r| r.index() * self.world_size()) + self.rank()
    }

    /// Data-parallel ranks: shard groups times their ranks.
    pub fn data_world_size(&self) -> usize {
        self.replicas.as_ref().map_or(1, |r| r.count()) * self.world_size()
    }

    /// All-reduces `buf` over every data-parallel rank: inside the shard group, then across the replicas (a mean
    /// of means of equal groups is the mean).
    pub fn all_reduce_data(&self, buf: &mut [f32], op: ReduceOp) -> CommResult<()> {
        crate::comm::Collectives::all_reduce(self.as_ref(), buf, op)?;
        match &self.replicas {
            Some(r) => r.with(|g| crate::comm::Collectives::all_reduce(g, buf, op)),
            None => Ok(()),
        }
    }

    /// Waits for every data-parallel rank.
    pub fn barrier_data(&self) -> CommResult<()> {
        self.barrier()?;
        match &self.replicas {
            Some(r) => r.with(|g| g.barrier()),
            None => Ok(()),
        }
    }
}

impl ShardGroup {
    fn as_ref(&self) -> &(dyn Communicator + 'static) {
        match self {
            ShardGroup::Direct(c) => c.as_ref(),
            ShardGroup::Threaded(t) => t,
        }
    }

    fn thread(&self) -> Option<&CommThread> {
        match self {
            ShardGroup::Threaded(t) => Some(t),
            ShardGroup::Direct(_) => None,
        }
    }
}

impl Deref for EngineComm {
    type Target = dyn Communicator;

    fn deref(&self) -> &Self::Target {
        self.as_ref()
    }
}
