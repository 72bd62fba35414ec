//! Frozen parameters at stage 3: partitioned unit by unit like the trainable ones, because a frozen base model
//! is most of a fine-tuned model's bytes (LoRA, a frozen backbone). Each unit's frozen parameters get a
//! [`ShardedUnit`] of their own, gathered and released together with the unit's trainable one, with no gradient,
//! no reduction and no optimizer state. This rank keeps its chunk of every frozen unit in `shard`.
use tch::{Kind, Tensor};

use crate::comm::async_comm::CommThread;
use crate::comm::Communicator;
use crate::engine::zero::layout::FlatLayout;
use crate::engine::zero::sharded_unit::{ShardedUnit, UnitState};
use crate::engine::zero::swapped_params::Chunk;
use crate::error::{Error, Result};

pub(crate) struct FrozenUnits {
    /// The frozen parameters by unit, in the engine's unit order (a unit without any has an empty span).
    pub layout: FlatLayout,
    /// This rank's chunk of every unit, concatenated (the frozen unit's `shard_offset` is its place here).
    shard: Tensor,
    pub units: Vec<ShardedUnit>,
}

impl FrozenUnits {
    /// Packs `by_unit[i]` (unit i's frozen parameters, by name) into unit buffers, takes rank 0's values, keeps
    /// this rank's chunks and releases the units that are not `persistent[i]`. Every frozen parameter must have
    /// one floating dtype (the units' buffers have one).
    pub fn new(
        by_unit: Vec<Vec<(String, Tensor)>>,
        persistent: &[bool],
        comm: &dyn Communicator,
        residence: crate::engine::device::Residence,
        mut materialize: Option<&mut crate::engine::zero::units::Materialize>,
    ) -> Result<FrozenUnits> {
        let kind = frozen_kind(&by_unit)?;
        let specs: Vec<Vec<(String, Vec<i64>, bool)>> =
            by_unit.iter().map(|u| u.iter().map(|(n, t)| (n.clone(), t.size(), false)).collect()).collect();
        let ws = comm.world_size();
        let layout = FlatLayout::with_units(&specs, ws);
        let shard = Tensor::f_zeros([layout.partition_len() as i64], (kind, residence.device()))?;
        let mut units = Vec::with_capacity(by_unit.len());
        let mut offset = 0;
        for (i, ((span, params), &keep)) in layout.units.iter().zip(by_unit).zip(persistent).enumerate() {
            if let (Some(m), false) = (materialize.as_deref_mut(), params.is_empty()) {
                let vars: Vec<(&str, &Tensor)> = params.iter().map(|(n, t)| (n.as_str(), t)).collect();
                m(i, &vars)?;
            }
            let own: Vec<Tensor> = params.into_iter().map(|(_, t)| t).collect();
            let place = shard.narrow(0, offset as i64, span.chunk_len(ws) as i64);
            let store = |chunk: &Tensor| -> Result<()> {
                tch::no_grad(|| place.shallow_clone().f_copy_(chunk))?;
                Ok(())
            };
            units.push(ShardedUnit::shard_from_rank0(
                span.clone(),
                &layout.slots[span.slots.clone()],
                own,
                kind,
                offset,
                keep,
                comm,
                store,
                residence,
            )?);
            offset += span.chunk_len(ws);
        }
        Ok(FrozenUnits { layout, shard, units })
    }

    fn chunk(&self, i: usize, ws: usize) -> Tensor {
        let r = self.units[i].shard_range(ws);
        self.shard.narrow(0, r.start as i64, r.len() as i64)
    }

    /// Unit `i` gathered (finishing its prefetch if one runs). Returns the elements it all-gathered now.
    pub fn gather(&mut self, i: usize, comm: &dyn Communicator) -> Result<usize> {
        match self.units[i].state() {
            UnitState::Gathered => Ok(0),
            UnitState::Gathering => self.units[i].finish_gather().map(|_| 0),
            UnitState::Sharded => {
                let chunk = self.chunk(i, comm.world_size());
                self.units[i].gather(comm, &Chunk::InMemory(chunk))
            }
        }
    }

    /// Starts unit `i`'s all-gather on the communication thread (a prefetch), if it is sharded.
    pub fn begin_gather(&mut self, i: usize, thread: &CommThread) -> Result<usize> {
        if self.units[i].state() != UnitState::Sharded {
            return Ok(0);
        }
        let chunk = self.chunk(i, thread.world_size());
        self.units[i].begin_gather(thread, &Chunk::InMemory(chunk))
    }

    /// Unit `i` back to its shard (a no-op for persistent units, which stay gathered).
    pub fn release(&mut self, i: usize) -> Result<()> {
        if self.units[i].persistent {
            return Ok(());
        }
        self.units[i].release()
    }

    /// Bytes of unit `i`'s full frozen parameters.
    pub fn full_bytes(&self, i: usize) -> usize {
        self.units[i].full_bytes()
    }

    /// Bytes of this rank's shard (gathered units, persistent ones included, count as gathered parameters).
    pub fn shard_bytes(&self) -> usize {
        self.shard.numel() * self.shard.kind().elt_size_in_bytes()
    }

    /// Unit `i`'s frozen parameters by name (views of its gathered buffer: the unit must be gathered).
    pub fn named(&self, i: usize) -> impl Iterator<Item = (&str, &Tensor)> {
        let span = &self.units[i].span;
        self.layout.slots[span.slots.clone()].iter().map(|s| s.name.as_str()).zip(self.units[i].params())
    }

    /// Overwrites this rank's chunks from full values by name (`value(name)`; None keeps the current value), and
    /// the gathered units' buffers with them.
    pub fn load(
        &mut self,
        comm: &dyn Communicator,
        value: &mut dyn FnMut(&str) -> Result<Option<Tensor>>,
    ) -> Result<()> {
        let (rank, ws) = (comm.rank(), comm.world_size());
        for i in 0..self.units.len() {
            let span = self.units[i].span.clone();
            let chunk = span.chunk(rank, ws);
            let dst = self.chunk(i, ws);
            let full = self.units[i].state() == UnitState::Gathered;
            for slot in &self.layout.slots[span.slots.clone()] {
                let (a, b) = (slot.range.start.max(chunk.start), slot.range.end.min(chunk.end));
                let Some(v) = value(&slot.name)? else { continue };
                let v = v.reshape([-1]);
                tch::no_grad(|| -> Result<()> {
                    if a < b {
                        let piece = v.narrow(0, (a - slot.range.start) as i64, (b - a) as i64);
                        dst.narrow(0, (a - chunk.start) as i64, (b - a) as i64).f_copy_(&piece)?;
                    }
                    if full {
                        self.units[i]
                            .full()
                            .narrow(0, (slot.range.start - span.range.start) as i64, slot.range.len() as i64)
                            .f_copy_(&v)?;
                    }
                    Ok(())
                })?;
            }
        }
        Ok(())
    }
}

/// The one floating dtype of the frozen parameters.
fn frozen_kind(by_unit: &[Vec<(String, Tensor)>]) -> Result<Kind> {
    let mut kind: Option<(Kind, &str)> = None;
    for (name, t) in by_unit.iter().flatten() {
        match kind {
            None if t.is_floating_point() => kind = Some((t.kind(), name)),
            None => return Err(Error::Parameter { name: name.clone(), why: format!("is frozen with dtype {:?}; stage 3 partitions frozen parameters, which must be floating", t.kind()) }),
            Some((k, first)) if k != t.kind() => {
                return Err(Error::Parameter {
                    name: name.clone(),
                    why: format!("is frozen with dtype {:?} but `{first}` with {k:?}; stage 3 partitions frozen parameters in one dtype: convert them to one", t.kind()),
                })
            }
            Some(_) => {}
        }
    }
    Ok(kind.map_or(Kind::Float, |(k, _)| k))
}

impl FrozenUnits {
    /// Every frozen parameter by name as full copies, gathering one unit at a time (collective).
    pub fn full_copies(&mut self, comm: &dyn Communicator) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for i in 0..self.units.len() {
            let was = self.units[i].state();
            self.gather(i, comm)?;
            out.extend(self.named(i).map(|(n, t)| (n.to_string(), t.detach().copy())));
            if was == UnitState::Sharded {
                self.units[i].release()?;
            }
        }
        Ok(out)
    }

    /// (name, shape, kind) of every frozen parameter.
    pub fn specs(&self) -> Vec<(String, Vec<i64>, Kind)> {
        let kind = self.shard.kind();
        self.layout.slots.iter().map(|s| (s.name.clone(), s.shape.clone(), kind)).collect()
    }
}
