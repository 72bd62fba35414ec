//! The conjugate operators of tensor parallelism (Megatron-LM's `mappings.py`), each the other's backward:
//! `copy_to_region` (identity forward, all-reduce backward) before a column-parallel layer, `reduce_from_region`
//! (all-reduce forward, identity backward) after a row-parallel one, `scatter_to_region` / `gather_from_region`
//! along the last dimension, and the sequence-parallel pair along the first (`gather_sequence`: all-gather forward,
//! reduce-scatter backward; `scatter_sequence`: the reverse). tch has no custom autograd functions, so the
//! operators are the C++ shim's (`native/tensor_parallel.cpp`), which calls back here for each collective.
use std::cell::Cell;
use std::ffi::{c_char, c_void, CString};

use tch::Tensor;

use super::Placements;
use crate::comm::{Communicator, ReduceOp};
use crate::engine::device::{views, Residence};
use crate::error::{Error, Result};

extern "C" {
    fn zerorun_tp_region(
        x: *mut c_void,
        region: i64,
        collective: extern "C" fn(*mut c_void, i32, *mut c_void, *mut c_void) -> *mut c_char,
        group: *mut c_void,
        rank: i64,
        size: i64,
        out: *mut *mut c_void,
    ) -> *mut c_char;
}

/// The shim's operators (`Region` there).
#[derive(Clone, Copy)]
enum Region {
    Copy = 0,
    Reduce = 1,
    ScatterLast = 2,
    GatherLast = 3,
    GatherFirst = 4,
    ReduceScatterFirst = 5,
}

/// Collectives this group ran, forward and backward together (each rank counts its own).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TensorParallelCounts {
    /// All-reduces.
    pub all_reduce: u64,
    /// All-gathers.
    pub all_gather: u64,
    /// Reduce-scatters.
    pub reduce_scatter: u64,
    /// Elements moved, as the engine's `CommVolume` counts them.
    pub elements: u64,
}

/// What the shim's callback reaches: the communicator and the counts. Boxed, so its address stays put while
/// graphs that hold it exist.
struct Inner {
    comm: Box<dyn Communicator>,
    counts: Cell<TensorParallelCounts>,
    /// Where host tensors live for this group's collectives (emulated device memory or not), decided when the
    /// group is made.
    host: Residence,
}

/// A tensor-parallel group: the ranks that split each layer's weight between them.
pub struct TensorParallel {
    inner: Box<Inner>,
    /// Where the layers made on this group split their parameters.
    placements: Placements,
}

impl TensorParallel {
    /// The group of `comm`'s ranks (a tensor-parallel group of the topology, or the whole world).
    pub fn new(comm: Box<dyn Communicator>) -> TensorParallel {
        TensorParallel::with_placements(comm, Placements::default())
    }

    /// The group of `comm`'s ranks, recording its layers' placements in `placements` (the mesh's: see
    /// [`crate::mesh::Mesh::tensor_parallel`]).
    pub fn with_placements(comm: Box<dyn Communicator>, placements: Placements) -> TensorParallel {
        let host = Residence::of(tch::Device::Cpu);
        let inner = Box::new(Inner { comm, counts: Cell::new(TensorParallelCounts::default()), host });
        TensorParallel { inner, placements }
    }

    /// Records that the variable `name` (`path.path("weight")`) is split along `dim` across the group: what a
    /// layer of its own calls for each variable it splits (the layers here do).
    pub fn place(&self, name: impl Into<String>, dim: usize) {
        self.placements.split(name, dim);
    }

    /// Records that the variable `name` is split along `dim` after the layer padded it to split evenly: its true
    /// extent there is `whole` (a vocabulary's size), so checkpoints and whole copies hold the unpadded tensor.
    pub fn place_padded(&self, name: impl Into<String>, dim: usize, whole: i64) {
        self.placements.split_padded(name, dim, whole);
    }

    /// The dimension parameter `name` is split along (None: every member holds it whole).
    pub fn split_dim(&self, name: &str) -> Option<usize> {
        self.placements.split_dim(name)
    }

    /// Where the layers made on this group split their parameters.
    pub fn placements(&self) -> &Placements {
        &self.placements
    }

    /// The whole parameter `name` from this rank's `part`: the members' parts gathered along its split dimension,
    /// padding left out (`part` itself when it is held whole). Collective over the group; no graph.
    pub fn gather_whole(&self, name: &str, part: &Tensor) -> Result<Tensor> {
        let Some(split) = self.placements.get(name) else { return Ok(part.shallow_clone()) };
        let whole = tch::no_grad(|| -> Result<Tensor> {
            let moved = part.transpose(0, split.dim as i64).contiguous();
            Ok(self.gather_sequence(&moved)?.transpose(0, split.dim as i64).contiguous())
        })?;
        Ok(match split.whole {
            Some(n) => whole.narrow(split.dim as i64, 0, n).contiguous(),
            None => whole,
        })
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.comm.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.comm.world_size()
    }

    /// The collectives run so far.
    pub fn counts(&self) -> TensorParallelCounts {
        self.inner.counts.get()
    }

    /// Identity forward, all-reduce (sum) of the gradient backward: the input of a column-parallel layer, which
    /// every rank uses whole.
    pub fn copy_to_region(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, Region::Copy)
    }

    /// All-reduce (sum) forward, identity backward: the output of a row-parallel layer (each rank holds a part of
    /// the sum).
    pub fn reduce_from_region(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, Region::Reduce)
    }

    /// This rank's chunk of the last dimension forward, all-gather of the gradient along it backward.
    pub fn scatter_to_region(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, Region::ScatterLast)
    }

    /// All-gather along the last dimension forward, this rank's chunk of the gradient backward.
    pub fn gather_from_region(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, Region::GatherLast)
    }

    /// Sequence parallelism: all-gather along the first (sequence) dimension forward, reduce-scatter of the
    /// gradient along it backward (before a column-parallel layer).
    pub fn gather_sequence(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, Region::GatherFirst)
    }

    /// Sequence parallelism: reduce-scatter along the first dimension forward, all-gather of the gradient backward
    /// (after a row-parallel layer, instead of the all-reduce).
    pub fn scatter_sequence(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, Region::ReduceScatterFirst)
    }

    fn apply(&self, x: &Tensor, region: Region) -> Result<Tensor> {
        let mut out: *mut c_void = std::ptr::null_mut();
        let group = &*self.inner as *const Inner as *mut c_void;
        // SAFETY: `x` is a live tensor; `group` stays valid while this value lives (the caller keeps it alive as
        // long as graphs through these operators may run backward).
        let message = unsafe {
            zerorun_tp_region(
                x.as_ptr() as *mut c_void,
                region as i64,
                collective,
                group,
                self.rank() as i64,
                self.size() as i64,
                &mut out,
            )
        };
        if !message.is_null() {
            // SAFETY: a NUL-terminated string from malloc, ours to free.
            let text = unsafe { std::ffi::CStr::from_ptr(message) }.to_string_lossy().into_owned();
            unsafe { libc::free(message as *mut c_void) };
            return Err(Error::Torch(tch::TchError::Torch(format!("tensor parallel: {text}"))));
        }
        // SAFETY: the shim allocated the result with `new at::Tensor`, which tch's Tensor owns from here.
        Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
    }
}

/// The shim's callback: collective `kind` (0 all-reduce in place, 1 all-gather of `input` into `output`, 2
/// reduce-scatter of `input` into `output`) over the group's communicator. Returns null or a malloc'ed message.
extern "C" fn collective(group: *mut c_void, kind: i32, input: *mut c_void, output: *mut c_void) -> *mut c_char {
    // A panic must not cross into C++: it becomes the message.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_collective(group, kind, input, output)))
        .unwrap_or_else(|_| Err("the collective panicked".to_string()));
    match result {
        Ok(()) => std::ptr::null_mut(),
        Err(e) => {
            let text = CString::new(e).unwrap_or_default();
            // SAFETY: a malloc'ed copy the shim frees.
            unsafe { libc::strdup(text.as_ptr()) }
        }
    }
}

fn run_collective(
    group: *mut c_void,
    kind: i32,
    input: *mut c_void,
    output: *mut c_void,
) -> std::result::Result<(), String> {
    // SAFETY: `group` is the `Inner` of a live `TensorParallel` (see `apply`); the tensors are the shim's, borrowed
    // for this call (ManuallyDrop: tch must not delete them).
    let inner = unsafe { &*(group as *const Inner) };
    let (input, output) = unsafe {
        (
            std::mem::ManuallyDrop::new(Tensor::from_ptr(input as *mut torch_sys::C_tensor)),
            std::mem::ManuallyDrop::new(Tensor::from_ptr(output as *mut torch_sys::C_tensor)),
        )
    };
    let comm = inner.comm.as_ref();
    let residence = match input.device() {
        tch::Device::Cpu => inner.host,
        device => Residence::Device(device),
    };
    let mut counts = inner.counts.get();
    let result = match kind {
        0 => {
            counts.all_reduce += 1;
            counts.elements += input.numel() as u64;
            views::all_reduce(residence, comm, &input, ReduceOp::Sum)
        }
        1 => {
            counts.all_gather += 1;
            counts.elements += output.numel() as u64;
            let n = input.numel() as i64;
            tch::no_grad(|| output.narrow(0, comm.rank() as i64 * n, n).f_copy_(&input.reshape([-1])))
                .map_err(|e| e.to_string())?;
            views::all_gather(residence, comm, &output)
        }
        _ => {
            counts.reduce_scatter += 1;
            counts.elements += input.numel() as u64;
            views::reduce_scatter(residence, comm, &input, &output, ReduceOp::Sum)
        }
    };
    inner.counts.set(counts);
    result.map_err(|e| e.to_string())
}
