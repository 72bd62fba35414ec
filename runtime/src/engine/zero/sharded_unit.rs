//! One unit's parameters at stage 3 (FSDP's FlatParameter): a flat buffer of the unit's padded length whose
//! storage exists only while the unit is gathered. Sharded -> Gathered -> Sharded, one explicit state.
//!
//! The model's tensors are views into the buffer while gathered and point at a released tensor while sharded
//! ([`native::released_like`]: every libtorch operator refuses it with an error naming the parameter and its
//! unit), so a stray use outside the engine is an error, never a read of freed memory. Releasing resizes the buffer's
//! storage to zero bytes, which also frees what autograd's saved views of the parameters hold; gathering grows it
//! back before backward needs them.
use tch::{Kind, Tensor};

use crate::comm::async_comm::{CommThread, Handle};
use crate::comm::Communicator;
use crate::engine::device::native;
use crate::engine::device::{views, Residence};
use crate::engine::zero::layout::{ParamSlot, UnitSpan};
use crate::engine::zero::swapped_params::Chunk;
use crate::error::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitState {
    /// Only this rank's chunk exists (in the engine's shard buffer).
    Sharded,
    /// The buffer exists and its all-gather runs on the communication thread (a prefetch).
    Gathering,
    /// The full parameters are in the unit's buffer and the model's tensors view them.
    Gathered,
}

pub struct ShardedUnit {
    pub span: UnitSpan,
    /// Where this rank's chunk of the unit sits in the shard buffer.
    pub shard_offset: usize,
    /// Small units stay gathered for the whole run (`stage3_param_persistence_threshold`).
    pub persistent: bool,
    full: Tensor,
    /// Views of `full` with the parameters' shapes.
    views: Vec<Tensor>,
    /// The model's tensors (same TensorImpl as the VarStore's).
    params: Vec<Tensor>,
    /// What each of `params` points at while the unit is sharded ([`native::released_like`]).
    released: Vec<Tensor>,
    state: UnitState,
    /// The prefetch in flight (state Gathering).
    pending: Option<Handle<()>>,
    /// Stage 2 with units: the buffer is a region of the engine's full parameter buffer and holds this rank's
    /// chunk itself (always gathered; never resized).
    in_place: bool,
    /// Where the buffer lives (the engine's residence), for its collectives.
    residence: Residence,
    /// `zero_quantized_weights`: gathers carry int8 blocks of this many values, one scale each.
    quantized_block: Option<usize>,
    /// `zero_hpz_partition_size` (hpZ): this rank's place on its host and the host's ranks; the first gather
    /// after a step keeps this rank's piece of the unit (`host_copy`), from which the host's ranks gather it again.
    host_piece: Option<(usize, usize)>,
    host_copy: Option<Tensor>,
}

impl ShardedUnit {
    /// Packs `params` (the unit's tensors, in slot order) into a new buffer and makes them views of it; the unit
    /// starts gathered with the model's own values.
    /// `shared`: the buffer goes in the shm backend's shared region (see `views::comm_zeros`); it lives on
    /// `device`.
    #[allow(clippy::too_many_arguments)] // one call site (`shard_from_rank0`), each argument a distinct input
    fn new(
        span: UnitSpan,
        slots: &[ParamSlot],
        params: Vec<Tensor>,
        kind: Kind,
        shard_offset: usize,
        persistent: bool,
        shared: bool,
        residence: Residence,
    ) -> Result<ShardedUnit> {
        let full = views::comm_zeros(span.range.len(), kind, shared, residence.device())?;
        let mut views = Vec::with_capacity(params.len());
        let mut params = params;
        tch::no_grad(|| {
            for (slot, t) in slots.iter().zip(params.iter_mut()) {
                let view = full
                    .narrow(0, (slot.range.start - span.range.start) as i64, slot.range.len() as i64)
                    .view(slot.shape.as_slice());
                view.shallow_clone().copy_(t);
                t.set_data(&view);
                views.push(view);
            }
        });
        let released = released_params(slots, &views, "")?;
        Ok(ShardedUnit {
            span,
            shard_offset,
            persistent,
            full,
            views,
            params,
            released,
            state: UnitState::Gathered,
            pending: None,
            in_place: false,
            residence,
            quantized_block: None,
            host_piece: None,
            host_copy: None,
        })
    }

    /// Start-up at stage 3: packs `params` into a new unit, takes rank 0's values, hands this rank's chunk to
    /// `store` (the shard in memory, or NVMe) and releases the unit unless it is `persistent`; then hands the pages of the
    /// parameters' original tensors, freed by the packing, back to the OS. So start-up holds the model, the shard
    /// and one unit rather than the model twice.
    #[allow(clippy::too_many_arguments)] // one call site (stage 3's start-up), each argument a distinct input
    pub fn shard_from_rank0(
        span: UnitSpan,
        slots: &[ParamSlot],
        params: Vec<Tensor>,
        kind: Kind,
        shard_offset: usize,
        persistent: bool,
        comm: &dyn Communicator,
        store: impl FnOnce(&Tensor) -> Result<()>,
        residence: Residence,
    ) -> Result<ShardedUnit> {
        let shared = comm.prefers_shared_buffers();
        let mut unit = ShardedUnit::new(span, slots, params, kind, shard_offset, persistent, shared, residence)?;
        views::broadcast(residence, comm, unit.full(), 0)?;
        // A unit split over a group: its ranks keep their chunk, the others none.
        if let Some(place) = unit.span.place_of(comm.rank()) {
            store(&unit.chunk_of_full(place, comm.world_size()))?;
        }
        if !persistent {
            unit.release()?;
        }
        crate::engine::device::allocator::return_freed_memory();
        Ok(unit)
    }

    /// Stage 2 with units: a unit over `region` of the engine's full parameter buffer, which the model's tensors
    /// (`params`, in slot order) already view. Always gathered; refreshing all-gathers the region in place.
    pub fn in_place(
        span: UnitSpan,
        slots: &[ParamSlot],
        params: Vec<Tensor>,
        region: Tensor,
        shard_offset: usize,
        residence: Residence,
    ) -> ShardedUnit {
        let views = slots
            .iter()
            .map(|slot| {
                region
                    .narrow(0, (slot.range.start - span.range.start) as i64, slot.range.len() as i64)
                    .view(slot.shape.as_slice())
            })
            .collect();
        ShardedUnit {
            span,
            shard_offset,
            persistent: true,
            full: region,
            views,
            params,
            released: Vec::new(),
            state: UnitState::Gathered,
            pending: None,
            in_place: true,
            residence,
            quantized_block: None,
            host_piece: None,
            host_copy: None,
        }
    }

    /// Stage 2: a unit of another expert-parallel position's experts, which this rank never computes, reduces or
    /// steps. Its tensors (`params`) have no storage; its buffer is empty, and exports take its values from the
    /// first rank of its group.
    pub fn held_elsewhere(
        span: UnitSpan,
        params: Vec<Tensor>,
        kind: tch::Kind,
        shard_offset: usize,
        residence: Residence,
    ) -> Result<ShardedUnit> {
        let empty = Tensor::f_empty([0], (kind, residence.device()))?;
        Ok(ShardedUnit::in_place(span, &[], params, empty, shard_offset, residence))
    }

    /// Quantizes this unit's gathers from now on (`zero_quantized_weights`): int8 in blocks of `block` values.
    pub fn quantize_gathers(&mut self, block: usize) {
        self.quantized_block = Some(block);
    }

    /// hpZ: from now on the unit's first gather after each step keeps this rank's piece of the host's `per_host`
    /// (`local` is this rank's place on its host), and later gathers until the step stay inside the host.
    pub fn keep_host_copies(&mut self, local: usize, per_host: usize) {
        self.host_piece = Some((local, per_host));
    }

    /// Bytes of this unit's host copy (hpZ), 0 without one.
    pub fn host_copy_bytes(&self) -> usize {
        self.host_copy.as_ref().map_or(0, |t| t.numel() * t.kind().elt_size_in_bytes())
    }

    /// After an optimizer step the host copy holds old values: dropped. Returns the bytes freed.
    pub fn drop_host_copy(&mut self) -> usize {
        let bytes = self.host_copy_bytes();
        self.host_copy = None;
        bytes
    }

    /// This rank's piece of the unit for its host's gathers: the range of the full buffer.
    fn host_range(&self) -> Option<std::ops::Range<i64>> {
        let (local, per_host) = self.host_piece?;
        let piece = (self.span.range.len() / per_host) as i64;
        Some(local as i64 * piece..(local as i64 + 1) * piece)
    }

    /// Keeps this rank's piece of a freshly gathered unit (hpZ) unless it has one. Returns the bytes kept.
    fn keep_host_copy(&mut self) -> Result<usize> {
        let Some(r) = self.host_range().filter(|_| self.host_copy.is_none() && !self.persistent) else { return Ok(0) };
        let piece = self.full.narrow(0, r.start, r.end - r.start);
        let copy = piece.f_empty_like()?;
        tch::no_grad(|| copy.shallow_clone().f_copy_(&piece))?;
        self.host_copy = Some(copy);
        Ok(self.host_copy_bytes())
    }

    /// Puts the host copy (hpZ) in its place in the full buffer; whether there was one.
    fn put_host_copy(&self) -> Result<bool> {
        let (Some(r), Some(copy)) = (self.host_range(), self.host_copy.as_ref()) else { return Ok(false) };
        tch::no_grad(|| self.full.narrow(0, r.start, r.end - r.start).f_copy_(copy))?;
        Ok(true)
    }

    /// Takes the quantization off this unit's gathers (for an exact gather), returning what it was.
    pub fn take_quantized(&mut self) -> Option<usize> {
        self.quantized_block.take()
    }

    /// Puts back what [`ShardedUnit::take_quantized`] took.
    pub fn restore_quantized(&mut self, block: Option<usize>) {
        self.quantized_block = block;
    }

    /// Whether the unit's buffer is its own (stage 3) rather than a region of the engine's parameters (stage 2).
    pub fn owns_buffer(&self) -> bool {
        !self.in_place
    }

    pub fn state(&self) -> UnitState {
        self.state
    }

    /// The model's tensors of this unit, in slot order.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// Bytes of the unit's full parameters.
    pub fn full_bytes(&self) -> usize {
        self.span.range.len() * self.full.kind().elt_size_in_bytes()
    }

    /// The gathered flat buffer (the unit's padded length).
    pub fn full(&self) -> &Tensor {
        &self.full
    }

    fn chunk_of_full(&self, rank: usize, ws: usize) -> Tensor {
        let c = self.span.chunk_len(ws);
        self.full.narrow(0, (rank * c) as i64, c as i64)
    }

    /// Copies this rank's chunk into its place in the full buffer (not gathering: no collective writes it).
    fn put_chunk(&self, rank: usize, ws: usize, chunk: &Chunk) -> Result<()> {
        chunk.copy_into(&self.chunk_of_full(rank, ws), self.residence)
    }

    /// Sharded -> Gathered: regrows the buffer and all-gathers every rank's chunk, this rank's being `chunk`.
    /// Returns the elements gathered.
    pub fn gather(&mut self, comm: &dyn Communicator, chunk: &Chunk) -> Result<usize> {
        debug_assert_eq!(self.state, UnitState::Sharded);
        native::resize_storage(&self.full, self.full_bytes())?;
        if self.span.range.is_empty() {
            // A unit without parameters of this kind (all frozen, or none frozen): nothing to gather.
            self.point_params_at_views()?;
            return Ok(0);
        }
        if self.put_host_copy()? {
            views::all_gather_in_host(self.residence, comm, &self.full)?;
        } else {
            self.fill_from(comm, Some(chunk))?;
            self.keep_host_copy()?;
        }
        // The peers free their copies of this unit soon: their pages need not stay in this resident set.
        comm.forget_gathered_pages();
        self.point_params_at_views()?;
        Ok(self.span.range.len())
    }

    /// Gathering -> Gathered: waits for the prefetch.
    pub fn finish_gather(&mut self) -> Result<()> {
        debug_assert_eq!(self.state, UnitState::Gathering);
        self.pending.take().expect("a gathering unit has a handle").wait()?;
        self.keep_host_copy()?;
        self.point_params_at_views()
    }

    fn point_params_at_views(&mut self) -> Result<()> {
        for (t, v) in self.params.iter().zip(&self.views) {
            native::point_at(t, v)?;
        }
        self.state = UnitState::Gathered;
        Ok(())
    }

    /// Names the unit in the error a released parameter gives (`unit`: its name, as `engine.unit` takes it).
    pub fn describe(&mut self, slots: &[ParamSlot], unit: &str) -> Result<()> {
        if self.in_place {
            return Ok(());
        }
        let released = released_params(slots, &self.views, unit)?;
        if self.state == UnitState::Sharded {
            for (t, r) in self.params.iter().zip(&released) {
                native::point_at(t, r)?;
            }
        }
        self.released = released;
        Ok(())
    }

    /// Sharded -> Gathering: regrows the buffer, puts this rank's `chunk` in and starts the all-gather on the
    /// communication thread. Returns the elements it will gather.
    pub fn begin_gather(&mut self, thread: &CommThread, chunk: &Chunk) -> Result<usize> {
        debug_assert_eq!(self.state, UnitState::Sharded);
        native::resize_storage(&self.full, self.full_bytes())?;
        if self.span.range.is_empty() {
            self.point_params_at_views()?;
            return Ok(0);
        }
        let in_host = self.put_host_copy()?;
        if !in_host {
            self.put_chunk(thread.rank(), thread.world_size(), chunk)?;
        }
        // The job holds its own handle to the buffer, so the storage outlives it; nothing here reads, writes or
        // resizes the buffer until `finish_gather` waits (release finishes a Gathering unit first).
        let (full, residence, quantized) = (self.full.shallow_clone(), self.residence, self.quantized_block);
        let handle = thread.submit("all_gather", move |c| {
            if in_host {
                views::all_gather_in_host(residence, c, &full)?;
            } else {
                gather_into(residence, c, &full, quantized)?;
            }
            // The peers free their copies of this unit soon: their pages need not stay in this resident set.
            c.forget_gathered_pages();
            Ok(())
        });
        self.pending = Some(handle);
        self.state = UnitState::Gathering;
        Ok(self.span.range.len())
    }

    /// Gathered: refreshes the full parameters after an optimizer step, from this rank's new `chunk` (None: an
    /// in-place unit, whose region already holds it). Returns the elements. A refresh begun on the communication
    /// thread ([`ShardedUnit::begin_refresh`]) is waited for instead.
    pub fn refresh(&mut self, comm: &dyn Communicator, chunk: Option<&Chunk>) -> Result<usize> {
        debug_assert_eq!(self.state, UnitState::Gathered);
        if self.pending.is_some() {
            self.gather_pending_only()?;
            return Ok(0);
        }
        self.fill_from(comm, chunk)?;
        Ok(self.span.range.len())
    }

    /// Gathered, in place (stage 2): starts the refresh after this rank's chunk was stepped, on the communication
    /// thread, while the optimizer steps the next unit's chunk; the next [`ShardedUnit::refresh`] waits for it.
    /// Returns the elements it will gather.
    pub fn begin_refresh(&mut self, thread: &CommThread) -> usize {
        debug_assert!(self.in_place && self.state == UnitState::Gathered && self.pending.is_none());
        if self.span.range.is_empty() {
            return 0;
        }
        // The job holds its own handle to the region; the step writes only other units' chunks until `refresh`
        // waits, and this unit's other chunks are the peers', written by the gather alone.
        let (full, residence, quantized) = (self.full.shallow_clone(), self.residence, self.quantized_block);
        self.pending = Some(thread.submit("all_gather", move |c| gather_into(residence, c, &full, quantized)));
        self.span.range.len()
    }

    fn fill_from(&self, comm: &dyn Communicator, chunk: Option<&Chunk>) -> Result<()> {
        if self.span.range.is_empty() {
            return Ok(());
        }
        if let Some(chunk) = chunk {
            self.put_chunk(comm.rank(), comm.world_size(), chunk)?;
        }
        gather_into(self.residence, comm, &self.full, self.quantized_block)?;
        Ok(())
    }

    /// Gathered -> Sharded: the model's tensors point at an empty tensor and the buffer's storage is freed.
    pub fn release(&mut self) -> Result<()> {
        assert!(!self.in_place, "an in-place unit (stage 2) is never released");
        match self.state {
            UnitState::Sharded => return Ok(()),
            UnitState::Gathering => {
                // Finish the collective before the memory goes.
                self.gather_pending_only()?;
            }
            UnitState::Gathered => {}
        }
        for (t, r) in self.params.iter().zip(&self.released) {
            native::point_at(t, r)?;
        }
        native::resize_storage(&self.full, 0)?;
        debug_assert_eq!(native::storage_nbytes(&self.full), 0);
        self.state = UnitState::Sharded;
        Ok(())
    }

    fn gather_pending_only(&mut self) -> Result<()> {
        if let Some(h) = self.pending.take() {
            h.wait()?;
        }
        Ok(())
    }

    /// Gathered: copies this rank's chunk of the full parameters into `shard` (at start-up).
    /// This rank's chunk's range in shard space.
    pub fn shard_range(&self, ws: usize) -> std::ops::Range<usize> {
        self.shard_offset..self.shard_offset + self.span.chunk_len(ws)
    }
}

/// What the parameters of a unit point at while it is sharded: tensors of their shapes that every operator refuses
/// with an error naming the parameter and `unit` (none given: the parameter alone).
fn released_params(slots: &[ParamSlot], views: &[Tensor], unit: &str) -> Result<Vec<Tensor>> {
    slots
        .iter()
        .zip(views)
        .map(|(slot, view)| {
            let what = if unit.is_empty() {
                format!(
                    "parameter `{}` is released (ZeRO stage 3 keeps only this rank's shard of it outside its unit): \
                     run the code that reads it inside its unit's scope, `engine.unit(..)`, or through `engine.forward`",
                    slot.name
                )
            } else {
                format!(
                    "parameter `{}` of unit `{unit}` is released (ZeRO stage 3 keeps only this rank's shard of it \
                     outside the unit): run the code that reads it inside `engine.unit(\"{unit}\", ..)`, or through \
                     `engine.forward`",
                    slot.name
                )
            };
            native::released_like(view, &what)
        })
        .collect()
}

/// The all-gather of a unit's buffer, quantized when the unit's gathers are.
fn gather_into(
    residence: Residence,
    comm: &dyn Communicator,
    full: &Tensor,
    quantized: Option<usize>,
) -> crate::comm::CommResult<()> {
    match quantized {
        Some(block) => views::all_gather_quantized(residence, comm, full, block),
        None => views::all_gather(residence, comm, full),
    }
}
