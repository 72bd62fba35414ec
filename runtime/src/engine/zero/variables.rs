//! Every variable of the VarStore belongs to the engine, each by its role:
//! - trainable parameters (`requires_grad`): packed, sharded and stepped by the optimizer;
//! - frozen parameters: tch's trainable variables with `requires_grad` off (`vs.freeze()`, or
//!   `set_requires_grad(false)` on one of them): no gradient and no optimizer state, rank 0's values everywhere,
//!   partitioned unit by unit at stage 3 (`frozen.rs`);
//! - buffers: variables created outside tch's trainable list (`zeros_no_train`: BatchNorm's `running_mean`,
//!   `running_var`, `num_batches_tracked`) that the model updates itself; kept consistent by [`BufferSync`].
//!
//! All of them start from rank 0's values (DDP's broadcast at construction), are saved in checkpoints and are in
//! `engine.state_dict()`. A variable belongs to one live engine at a time (`Claim`).
use std::collections::HashSet;
use std::sync::{LazyLock, Mutex};

use tch::{nn, Kind, Tensor};

use crate::comm::{Collectives, Communicator, ReduceOp};
use crate::engine::device::native;
use crate::error::{Error, Result};

/// How buffers (variables the model updates itself, such as BatchNorm's running statistics) stay consistent
/// across ranks. Every choice starts every rank from rank 0's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BufferSync {
    /// DDP's default (`broadcast_buffers=True`): rank 0's buffers are copied to every rank at the end of every
    /// `engine.step()` call, that is before the next micro-batch's forward, so every forward runs with rank 0's
    /// buffers as under DDP's broadcast before each forward. Cost: one broadcast of the buffers' bytes per
    /// micro-batch (a ResNet-18's are 38 KiB); none for models without buffers.
    #[default]
    Broadcast,
    /// Floating buffers are averaged over the ranks (all-reduce mean) at the end of every `engine.step()` call;
    /// integer ones (`num_batches_tracked`) take rank 0's. The running statistics then cover every rank's data,
    /// what SyncBatchNorm-style users want (the batch statistics inside forward stay per rank). Cost: one
    /// all-reduce of the floating buffers in f32 per micro-batch.
    Average,
    /// Each rank keeps its own (DDP's `broadcast_buffers=False`): no communication after the start. Checkpoints
    /// and `state_dict` hold rank 0's.
    Local,
}

/// The VarStore's variables by role, each list sorted by name.
pub(crate) struct Variables {
    pub trainable: Vec<(String, Tensor)>,
    pub frozen: Vec<(String, Tensor)>,
    pub buffers: Vec<(String, Tensor)>,
}

/// Sorts the variables of `vs` into trainable parameters, frozen parameters and buffers.
pub(crate) fn classify(vs: &nn::VarStore) -> Variables {
    let listed: HashSet<usize> = vs.trainable_variables().iter().map(native::tensor_identity).collect();
    let mut all: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    let mut v = Variables { trainable: Vec::new(), frozen: Vec::new(), buffers: Vec::new() };
    for (name, t) in all {
        if t.requires_grad() {
            v.trainable.push((name, t));
        } else if listed.contains(&native::tensor_identity(&t)) {
            v.frozen.push((name, t));
        } else {
            v.buffers.push((name, t));
        }
    }
    v
}

/// Variables of engines alive in this process, by identity.
static CLAIMED: LazyLock<Mutex<HashSet<usize>>> = LazyLock::new(|| Mutex::new(HashSet::new()));

/// The variables one engine holds, registered for as long as it lives: a second engine over the same variables
/// would repack tensors the first one steps, so the first engine's updates would stop reaching the model.
pub(crate) struct Claim {
    ids: Vec<usize>,
}

impl Claim {
    pub fn new<'a>(vars: impl IntoIterator<Item = &'a (String, Tensor)>) -> Result<Claim> {
        let vars: Vec<&(String, Tensor)> = vars.into_iter().collect();
        let mut claimed = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((name, _)) = vars.iter().find(|(_, t)| claimed.contains(&native::tensor_identity(t))) {
            return Err(Error::Usage(format!(
                "variable `{name}` already belongs to a live zerorun engine: one VarStore, one engine (drop the first engine before wrapping its VarStore again; two models, as in a GAN, need two VarStores)"
            )));
        }
        let ids: Vec<usize> = vars.iter().map(|(_, t)| native::tensor_identity(t)).collect();
        claimed.extend(ids.iter().copied());
        Ok(Claim { ids })
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut claimed = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
        for id in &self.ids {
            claimed.remove(id);
        }
    }
}

fn nbytes(t: &Tensor) -> usize {
    t.numel() * t.kind().elt_size_in_bytes()
}

/// Broadcasts pack at most this many bytes at a time, so a large frozen model is never copied whole.
const PACK_BYTES: usize = 64 << 20;

/// Rank 0's values of `tensors` on every rank: their bytes packed into one buffer per batch, one broadcast each.
pub(crate) fn broadcast_values(comm: &dyn Communicator, tensors: &[&Tensor]) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut start = 0;
    while start < tensors.len() {
        let (mut end, mut total) = (start, 0);
        while end < tensors.len() && (end == start || total + nbytes(tensors[end]).next_multiple_of(8) <= PACK_BYTES) {
            total += nbytes(tensors[end]).next_multiple_of(8);
            end += 1;
        }
        let batch = &tensors[start..end];
        let mut packed = vec![0i64; total / 8];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut packed);
        let mut at = 0;
        for t in batch {
            let n = nbytes(t);
            if n > 0 {
                let c = t.detach().contiguous();
                c.f_copy_data_u8(&mut bytes[at..at + n], c.numel())?;
            }
            at += n.next_multiple_of(8);
        }
        comm.broadcast(&mut packed, 0)?;
        if comm.rank() != 0 {
            let bytes: &[u8] = bytemuck::cast_slice(&packed);
            let mut at = 0;
            for t in batch {
                let n = nbytes(t);
                if n > 0 {
                    let src = Tensor::f_from_data_size(&bytes[at..at + n], &t.size(), t.kind())?;
                    tch::no_grad(|| t.shallow_clone().f_copy_(&src))?;
                }
                at += n.next_multiple_of(8);
            }
        }
        start = end;
    }
    Ok(())
}

/// Floating `tensors` averaged over the ranks (in f32), the others set to rank 0's.
pub(crate) fn average_values(comm: &dyn Communicator, tensors: &[&Tensor]) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let (floats, others): (Vec<&Tensor>, Vec<&Tensor>) = tensors.iter().partition(|t| t.is_floating_point());
    if !floats.is_empty() {
        let flat: Vec<Tensor> = floats.iter().map(|t| t.detach().to_kind(Kind::Float).reshape([-1])).collect();
        let mut packed = Vec::<f32>::try_from(&Tensor::f_cat(&flat, 0)?)?;
        comm.all_reduce(&mut packed, ReduceOp::Avg)?;
        let mut at = 0;
        for t in floats {
            let n = t.numel();
            let src = Tensor::from_slice(&packed[at..at + n]).view(t.size().as_slice());
            tch::no_grad(|| t.shallow_clone().f_copy_(&src))?;
            at += n;
        }
    }
    broadcast_values(comm, &others)
}

/// Applies `sync` to `buffers` (the end of an `engine.step()` call).
pub(crate) fn sync_buffers(comm: &dyn Communicator, sync: BufferSync, buffers: &[(String, Tensor)]) -> Result<()> {
    if buffers.is_empty() {
        return Ok(());
    }
    let tensors: Vec<&Tensor> = buffers.iter().map(|(_, t)| t).collect();
    match sync {
        BufferSync::Broadcast => broadcast_values(comm, &tensors),
        BufferSync::Average => average_values(comm, &tensors),
        BufferSync::Local => Ok(()),
    }
}

/// Bytes of the tensors.
pub(crate) fn bytes_of(vars: &[(String, Tensor)]) -> usize {
    vars.iter().map(|(_, t)| nbytes(t)).sum()
}
