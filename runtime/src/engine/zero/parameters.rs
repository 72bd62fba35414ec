//! Where the model's parameter values live between steps, and the unit state machine's calls (FSDP2's
//! `FSDPParamGroup`, one per unit): a flat buffer of every parameter (stages 0-2, whose stage-2 units are regions
//! of it, always gathered), or this rank's shard of every unit with the units gathered only while they run
//! (stage 3), on NVMe with `offload_param`. The engine walks the units (`unit_walk.rs`) and asks this store to
//! gather, prefetch, release and refresh them; the optimizer reaches this rank's values through `read_shard` /
//! `write_shard` or in place.
use tch::Tensor;

use crate::comm::Communicator;
use crate::config::ZeroConfig;
use crate::engine::counters::{CommVolume, GatheredBytes};
use crate::engine::engine_comm::EngineComm;
use crate::engine::zero::frozen::FrozenUnits;
use crate::engine::zero::layout::FlatLayout;
use crate::engine::zero::plan::{self, Optimized, StagePlan};
use crate::engine::zero::sharded_unit::{ShardedUnit, UnitState};
use crate::engine::zero::swapped_params::{Chunk, SwappedParams};
use crate::error::Result;

pub(crate) struct Parameters {
    /// All parameters in the model's dtype (stages 0-2; at stages 1-2 with units split over expert-parallel groups,
    /// those of the units this rank holds, [`FlatLayout::resident_starts`]); this rank's shard of every unit
    /// (stage 3; empty when the shard is on NVMe).
    pub flat: Tensor,
    /// Stage 3 with `offload_param.device = nvme`: where the shard lives instead of `flat`.
    pub swapped: Option<SwappedParams>,
    /// One per unit, in execution order (stages 2-3, and stage 1 with units split over groups; empty otherwise).
    /// Stages 1-2's are regions of `flat`.
    pub units: Vec<ShardedUnit>,
    /// Stage 3: the frozen parameters, partitioned unit by unit beside `units`.
    pub frozen_units: Option<FrozenUnits>,
    /// Bytes of gathered full parameters (stage 3's own unit buffers).
    pub gathered: GatheredBytes,
}

impl Parameters {
    pub fn new(
        flat: Tensor,
        swapped: Option<SwappedParams>,
        units: Vec<ShardedUnit>,
        frozen_units: Option<FrozenUnits>,
    ) -> Parameters {
        // Gathered bytes count units' own buffers (stage 3); stage 2's units are regions of `flat`.
        let persistent =
            units.iter().filter(|u| u.persistent && u.owns_buffer()).map(ShardedUnit::full_bytes).sum::<usize>()
                + frozen_units
                    .as_ref()
                    .map_or(0, |f| f.units.iter().filter(|u| u.persistent).map(ShardedUnit::full_bytes).sum());
        let gathered = GatheredBytes { current: persistent, peak: persistent, step_peak: persistent };
        Parameters { flat, swapped, units, frozen_units, gathered }
    }

    /// Unit `i` gathered, its trainable and frozen parts (finishing a prefetch if one runs), over the group it is
    /// split over.
    pub fn gather(&mut self, i: usize, comm: &EngineComm, volume: &mut CommVolume) -> Result<()> {
        let comm = comm.of_unit(&self.units[i].span);
        match self.units[i].state() {
            UnitState::Gathered => {}
            UnitState::Gathering => {
                let kept = self.units[i].host_copy_bytes();
                self.units[i].finish_gather()?;
                self.gathered.add(self.units[i].host_copy_bytes() - kept);
            }
            UnitState::Sharded => {
                let kept = self.units[i].host_copy_bytes();
                let chunk = self.unit_chunk(i, comm.world_size())?;
                let gathered = self.units[i].gather(comm, &chunk);
                self.recycle(i, chunk);
                volume.all_gather_elements += gathered? as u64;
                self.gathered.add(self.units[i].full_bytes() + self.units[i].host_copy_bytes() - kept);
            }
        }
        if let Some(frozen) = self.frozen_units.as_mut() {
            let sharded = frozen.units[i].state() == UnitState::Sharded;
            let n = frozen.gather(i, comm)?;
            if sharded {
                volume.all_gather_elements += n as u64;
                self.gathered.add(frozen.full_bytes(i));
            }
        }
        Ok(())
    }

    /// Unit `i` gathered with the values the shards hold, also where its gathers are quantized (a gathered unit then
    /// holds dequantized values, so it is gathered again, exactly): what saving the model reads.
    pub fn gather_exact(&mut self, i: usize, engine_comm: &EngineComm, volume: &mut CommVolume) -> Result<()> {
        let Some(block) = self.units[i].take_quantized() else { return self.gather(i, engine_comm, volume) };
        let comm = engine_comm.of_unit(&self.units[i].span);
        // An hpZ host copy of a quantized gather holds dequantized values.
        self.gathered.current -= self.units[i].drop_host_copy();
        let exact = (|| {
            let was_sharded = self.units[i].state() == UnitState::Sharded;
            self.gather(i, engine_comm, volume)?;
            if !was_sharded {
                let chunk = self.unit_chunk(i, comm.world_size())?;
                let n = self.units[i].refresh(comm, Some(&chunk));
                self.recycle(i, chunk);
                volume.all_gather_elements += n? as u64;
            }
            Ok(())
        })();
        self.units[i].restore_quantized(Some(block));
        exact
    }

    /// Elements of unit `i` gathered together: its trainable and its frozen parameters.
    pub(crate) fn unit_elements(&self, i: usize) -> u64 {
        let frozen = self.frozen_units.as_ref().map_or(0, |f| f.units[i].span.range.len());
        (self.units[i].span.range.len() + frozen) as u64
    }

    /// This rank's chunk of unit `i`: a view of the shard, or read from NVMe (`offload_param`).
    fn unit_chunk(&mut self, i: usize, world_size: usize) -> Result<Chunk> {
        match self.swapped.as_mut() {
            Some(swapped) => swapped.chunk(i),
            None => {
                let r = self.units[i].shard_range(world_size);
                Ok(Chunk::InMemory(self.flat.narrow(0, r.start as i64, r.len() as i64)))
            }
        }
    }

    fn recycle(&mut self, unit: usize, chunk: Chunk) {
        if let Some(swapped) = self.swapped.as_mut() {
            swapped.recycle(unit, chunk);
        }
    }

    /// With parameters on NVMe: keep the chunks gathers read for their units' steps while the optimizer in backward
    /// steps (`on`), or give them back (the step ended). See [`SwappedParams::keep_for_step`].
    pub fn keep_chunks_for_step(&mut self, on: bool) {
        if let Some(swapped) = self.swapped.as_mut() {
            swapped.keep_for_step(on);
        }
    }

    /// With parameters on NVMe, starts reading the chunks of the units that come next in `order` and are not
    /// gathered yet, so the reads overlap this unit's compute.
    pub fn read_ahead(&mut self, order: impl Iterator<Item = usize>) {
        if let Some(swapped) = self.swapped.as_mut() {
            let units = &self.units;
            swapped.read_ahead(order, |u| units[u].state() == UnitState::Sharded);
        }
    }

    /// Which units forward leaves gathered because backward reuses them soon ([`plan::kept_after_forward`]).
    pub fn kept_after_forward(&self, z: &ZeroConfig) -> Vec<bool> {
        self.kept_after_forward_in(&(0..self.units.len()).collect::<Vec<_>>(), z)
    }

    /// [`Parameters::kept_after_forward`] for units run in `order` (each once, the last run last); units not in it
    /// are not kept.
    pub fn kept_after_forward_in(&self, order: &[usize], z: &ZeroConfig) -> Vec<bool> {
        let sizes: Vec<u64> = order.iter().map(|&i| self.unit_elements(i)).collect();
        let persistent: Vec<bool> = order.iter().map(|&i| self.units[i].persistent).collect();
        let keep =
            plan::kept_after_forward(&sizes, &persistent, z.stage3_max_reuse_distance, z.stage3_max_live_parameters);
        let mut kept = vec![false; self.units.len()];
        for (&u, k) in order.iter().zip(keep) {
            kept[u] = k;
        }
        kept
    }

    /// With a communication thread (`overlap_comm`), starts the all-gathers of the units that come next in `order`
    /// (see [`plan::units_to_prefetch`]); they finish there while this rank computes.
    pub fn prefetch(
        &mut self,
        order: impl Iterator<Item = usize>,
        comm: &EngineComm,
        z: &ZeroConfig,
        volume: &mut CommVolume,
    ) -> Result<()> {
        if comm.thread().is_none() {
            return Ok(());
        }
        let sizes: Vec<u64> = (0..self.units.len()).map(|u| self.unit_elements(u)).collect();
        // Units split over a group this rank is not in are never gathered here: neither sharded nor live.
        let held: Vec<bool> = self.units.iter().map(|u| u.span.holds(comm.rank())).collect();
        let sharded: Vec<bool> =
            self.units.iter().zip(&held).map(|(u, &h)| h && u.state() == UnitState::Sharded).collect();
        let live: u64 = (0..self.units.len())
            .filter(|&u| held[u] && !self.units[u].persistent && !sharded[u])
            .map(|u| sizes[u])
            .sum();
        let in_flight = self.units.iter().filter(|u| u.state() == UnitState::Gathering).count();
        let picked = plan::units_to_prefetch(
            order,
            &sizes,
            &sharded,
            live,
            in_flight,
            z.stage3_prefetch_bucket_size,
            z.stage3_max_live_parameters,
        );
        for u in picked {
            let thread = comm.thread_of_unit(&self.units[u].span).expect("both groups are threaded or neither");
            let chunk = self.unit_chunk(u, thread.world_size())?;
            let n = self.units[u].begin_gather(thread, &chunk);
            self.recycle(u, chunk);
            volume.all_gather_elements += n? as u64;
            self.gathered.add(self.units[u].full_bytes());
            if let Some(frozen) = self.frozen_units.as_mut() {
                volume.all_gather_elements += frozen.begin_gather(u, thread)? as u64;
                self.gathered.add(frozen.full_bytes(u));
            }
        }
        Ok(())
    }

    /// Unit `i` back to its shard (its frozen part too, unless persistent).
    pub fn release(&mut self, i: usize) -> Result<()> {
        if self.units[i].state() != UnitState::Sharded {
            self.units[i].release()?;
            self.gathered.current -= self.units[i].full_bytes();
        }
        if let Some(frozen) = self.frozen_units.as_mut() {
            if frozen.units[i].state() != UnitState::Sharded && !frozen.units[i].persistent {
                frozen.release(i)?;
                self.gathered.current -= frozen.full_bytes(i);
            }
        }
        Ok(())
    }

    /// After an optimizer step: units that stay gathered take the new values of every rank's shard.
    pub fn refresh_gathered(&mut self, engine_comm: &EngineComm, volume: &mut CommVolume) -> Result<()> {
        // hpZ's host copies hold the old values.
        for unit in &mut self.units {
            self.gathered.current -= unit.drop_host_copy();
        }
        for i in 0..self.units.len() {
            // A stage-2 unit of another expert-parallel position's experts stays as it is: its ranks gather it.
            if self.units[i].state() != UnitState::Gathered || !self.units[i].span.holds(engine_comm.rank()) {
                continue;
            }
            let comm = engine_comm.of_unit(&self.units[i].span);
            let n = if self.units[i].owns_buffer() {
                let chunk = self.unit_chunk(i, comm.world_size())?;
                let n = self.units[i].refresh(comm, Some(&chunk));
                self.recycle(i, chunk);
                n?
            } else {
                self.units[i].refresh(comm, None)?
            };
            volume.all_gather_elements += n as u64;
        }
        // The next forward starts at the first unit: its chunk's read can start now.
        self.read_ahead(0..self.units.len());
        Ok(())
    }

    /// Stage 2: starts unit `i`'s refresh on the communication thread once its chunk is stepped
    /// ([`ShardedUnit::begin_refresh`]); `refresh_gathered` waits for it.
    pub fn begin_refresh(&mut self, i: usize, thread: &crate::comm::async_comm::CommThread, volume: &mut CommVolume) {
        volume.all_gather_elements += self.units[i].begin_refresh(thread) as u64;
    }

    /// Whether the optimizer steps a contiguous copy of this rank's values rather than the values in place: they
    /// are pieces of every unit (stage 2) or on NVMe (stage 3).
    pub fn steps_a_copy(&self, plan: &StagePlan) -> bool {
        plan.shard_in_pieces() || self.swapped.is_some()
    }

    /// This rank's optimized values in the model's dtype, in the optimizer's order: a view of `flat` where they are
    /// contiguous (stages 0-1, 3's shard), the concatenation of its chunk of every unit at stage 2, read from NVMe
    /// where the shard is there.
    pub fn read_shard(
        &mut self,
        layout: &FlatLayout,
        rank: usize,
        plan: &StagePlan,
        optimized: &Optimized,
    ) -> Result<Tensor> {
        if let Some(swapped) = self.swapped.as_mut() {
            return swapped.read_all(optimized.len());
        }
        Ok(shard_values(&self.flat, layout, rank, plan, optimized))
    }

    /// Writes values in the optimizer's order (any float kind) into this rank's part of the parameters.
    pub fn write_shard(
        &mut self,
        values: &Tensor,
        layout: &FlatLayout,
        rank: usize,
        plan: &StagePlan,
        optimized: &Optimized,
    ) -> Result<()> {
        if let Some(swapped) = self.swapped.as_mut() {
            return swapped.write_all(values);
        }
        let values = values.to_kind(self.flat.kind());
        tch::no_grad(|| -> Result<()> {
            if plan.shard_in_pieces() {
                let mut at = 0i64;
                for piece in layout.resident_pieces(rank) {
                    let n = piece.len() as i64;
                    self.flat.narrow(0, piece.start as i64, n).f_copy_(&values.narrow(0, at, n))?;
                    at += n;
                }
            } else {
                self.flat.narrow(0, optimized.range().start as i64, optimized.len() as i64).f_copy_(&values)?;
            }
            Ok(())
        })
    }

    /// Bytes of parameter values kept between steps in memory, and on NVMe.
    pub fn kept_bytes(&self) -> (usize, usize, usize) {
        let flat = self.flat.numel() * self.flat.kind().elt_size_in_bytes();
        let (kept, nvme, buffers) =
            self.swapped.as_ref().map_or((0, 0, 0), |s| (s.kept_bytes(), s.swapped_bytes(), s.buffer_bytes()));
        (flat + kept, nvme, buffers)
    }
}

/// This rank's optimized values in the model's dtype: a view of `flat` where they are contiguous (stages 0-1, 3's
/// shard), the concatenation of its chunk of every unit at stage 2 (where `flat` holds the units this rank holds,
/// [`FlatLayout::resident_pieces`]).
pub(crate) fn shard_values(
    flat: &Tensor,
    layout: &FlatLayout,
    rank: usize,
    plan: &StagePlan,
    optimized: &Optimized,
) -> Tensor {
    if plan.shard_in_pieces() {
        let pieces: Vec<Tensor> =
            layout.resident_pieces(rank).into_iter().map(|p| flat.narrow(0, p.start as i64, p.len() as i64)).collect();
        Tensor::cat(&pieces, 0)
    } else {
        let r = optimized.range();
        flat.narrow(0, r.start as i64, r.len() as i64)
    }
}
