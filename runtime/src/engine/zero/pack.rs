//! Stages 0-2: the model's parameters packed into one flat buffer of the units a rank holds, the model's tensors
//! made views into it, every rank starting from rank 0's values, and stage 2's in-place units over its regions.
use tch::{Kind, Tensor};

use crate::comm::Communicator;
use crate::engine::device::{native, views, Residence};
use crate::engine::zero::layout::{FlatLayout, ParamSlot};
use crate::engine::zero::plan::StagePlan;
use crate::engine::zero::sharded_unit::ShardedUnit;
use crate::error::Result;

/// Stages 0-2: packs the parameters into one flat buffer (in the shared region when `shared`), makes the model's
/// tensors views into it, and starts every rank from rank 0's weights. Stage 2 also gets one in-place unit per
/// unit span (its chunk stays where it is; nothing is released). With units split over expert-parallel groups
/// (stage 2), the buffer keeps only the units this rank holds ([`FlatLayout::resident_starts`]): another
/// position's experts are never computed, reduced or stepped here, so their tensors keep no storage, as at stage 3.
pub(crate) fn pack(
    layout: &FlatLayout,
    named: Vec<(String, Tensor)>,
    kind: Kind,
    comm: &dyn Communicator,
    plan: &StagePlan,
    shared: bool,
    residence: Residence,
) -> Result<(Tensor, Vec<Tensor>, Vec<ShardedUnit>)> {
    let mut params: Vec<Tensor> = named.into_iter().map(|(_, t)| t).collect();
    let rank = comm.rank();
    let starts = layout.resident_starts(rank);
    let flat = views::comm_zeros(layout.resident_len(rank), kind, shared, residence.device())?;
    if plan.shard_in_pieces() && layout.has_groups() {
        // Unit by unit, so that no rank ever holds the model twice: each unit's values go from rank 0 into the
        // units' regions of the ranks that hold them (through a scratch buffer where a rank does not).
        for (i, span) in layout.units.iter().enumerate() {
            let held = layout.resident_range(&starts, i, &span.range);
            let buffer = match &held {
                Some(r) => flat.narrow(0, r.start as i64, r.len() as i64),
                None => Tensor::f_zeros([span.range.len() as i64], (kind, residence.device()))?,
            };
            let own = &mut params[span.slots.clone()];
            let slots = &layout.slots[span.slots.clone()];
            let view = |slot: &ParamSlot| {
                let at = (slot.range.start - span.range.start) as i64;
                buffer.narrow(0, at, slot.range.len() as i64)
            };
            if rank == 0 || held.is_some() {
                for (t, slot) in own.iter().zip(slots) {
                    tch::no_grad(|| view(slot).f_copy_(&t.reshape([-1])))?;
                }
            }
            views::broadcast(residence, comm, &buffer, 0)?;
            for (t, slot) in own.iter_mut().zip(slots) {
                let data = match held {
                    Some(_) => view(slot).view(slot.shape.as_slice()),
                    None => {
                        let hollow = Tensor::f_empty(t.size(), (kind, residence.device()))?;
                        native::resize_storage(&hollow, 0)?;
                        hollow
                    }
                };
                tch::no_grad(|| t.set_data(&data));
            }
        }
    } else {
        tch::no_grad(|| {
            for (t, slot) in params.iter_mut().zip(&layout.slots) {
                let mut view = flat.narrow(0, slot.range.start as i64, slot.range.len() as i64);
                view.copy_(&t.reshape([-1]));
                t.set_data(&view.view(slot.shape.as_slice()));
            }
        });
        views::broadcast(residence, comm, &flat, 0)?;
        if !plan.shard_in_pieces() {
            return Ok((flat, params, Vec::new()));
        }
    }
    let world_size = comm.world_size();
    let mut units = Vec::new();
    let mut offset = 0;
    for (i, span) in layout.units.iter().enumerate() {
        let own: Vec<Tensor> = params[span.slots.clone()].iter().map(Tensor::shallow_clone).collect();
        units.push(match layout.resident_range(&starts, i, &span.range) {
            Some(r) => ShardedUnit::in_place(
                span.clone(),
                &layout.slots[span.slots.clone()],
                own,
                flat.narrow(0, r.start as i64, r.len() as i64),
                offset,
                residence,
            ),
            None => ShardedUnit::held_elsewhere(span.clone(), own, kind, offset, residence)?,
        });
        offset += span.held_len(rank, world_size);
    }
    Ok((flat, params, units))
}
