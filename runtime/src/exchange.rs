//! A group of ranks that trade rows of a tensor by an all-to-all inside the model's forward, as an autograd
//! function of the C++ shim (`native/expert_dispatch.cpp`) whose collective is this group's communicator, reached
//! through a callback here: a mixture of experts sends tokens to their experts' ranks (`moe::ExpertParallel`), and
//! sequence parallelism trades a sequence's slices for heads (`sequence::SequenceParallel`).
use std::cell::Cell;
use std::ffi::{c_char, c_void, CString};

use tch::Tensor;

use crate::comm::Communicator;
use crate::engine::device::views;
use crate::error::{Error, Result};

type AllToAll = extern "C" fn(*mut c_void, *mut c_void, *const i64, *mut c_void, *const i64, i64) -> *mut c_char;

extern "C" {
    fn zerorun_moe_all_to_all(
        x: *mut c_void,
        send: *const i64,
        recv: *const i64,
        n: i64,
        fn_: AllToAll,
        group: *mut c_void,
        out: *mut *mut c_void,
    ) -> *mut c_char;
}

/// The all-to-alls this group ran, forward and backward together (each rank counts its own).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllToAllCounts {
    /// All-to-alls of rows.
    pub all_to_all: u64,
    /// Elements this rank sent to other ranks.
    pub elements_sent: u64,
}

/// What the shim's callback reaches. Boxed, so its address stays put while graphs that hold it exist.
struct Inner {
    comm: Box<dyn Communicator>,
    counts: Cell<AllToAllCounts>,
}

/// Ranks that trade rows inside the model's forward.
pub struct AllToAllGroup {
    inner: Box<Inner>,
}

impl AllToAllGroup {
    /// The group of `comm`'s ranks.
    pub fn new(comm: Box<dyn Communicator>) -> AllToAllGroup {
        AllToAllGroup { inner: Box::new(Inner { comm, counts: Cell::new(AllToAllCounts::default()) }) }
    }

    /// The group of `size` adjacent ranks of `comm` this rank is in (ranks `r / size * size ..` of it): an
    /// expert-parallel group (`expert_parallel.autoep_size`) or a sequence-parallel one (`sequence_parallel_size`),
    /// so its all-to-alls stay within a host where the ranks of a host are adjacent. Collective over `comm`.
    pub fn adjacent(comm: &dyn Communicator, size: usize) -> Result<AllToAllGroup> {
        let world = comm.world_size();
        if size == 0 || world % size != 0 {
            return Err(Error::Usage(format!(
                "a group of {size} adjacent ranks (expert_parallel.autoep_size, sequence_parallel_size) does not divide the {world} ranks"
            )));
        }
        use crate::comm::Collectives;
        let rank = comm.rank();
        let split = comm.split(Some((rank / size) as u32), rank as i64)?;
        Ok(AllToAllGroup::new(split.expect("every rank has a color")))
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.comm.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.comm.world_size()
    }

    /// The all-to-alls run so far.
    pub fn counts(&self) -> AllToAllCounts {
        self.inner.counts.get()
    }

    /// The group's communicator (for collectives outside the graph: a loss's token counts).
    pub fn comm(&self) -> &dyn Communicator {
        self.inner.comm.as_ref()
    }

    /// Every rank's `mine[q]` counts for rank q: an all-to-all of `per_rank` counts per rank (no graph). Rank q
    /// ends with rank p's block for it as block p.
    pub fn exchange_counts(&self, mine: &[i64], per_rank: usize) -> Result<Vec<i64>> {
        let n = self.size();
        let mut theirs = vec![0i64; mine.len()];
        let counts = vec![per_rank; n];
        use crate::comm::Collectives;
        self.inner.comm.all_to_all_v(mine, &counts, &mut theirs, &counts).map_err(Error::from)?;
        Ok(theirs)
    }

    /// Sends `send[q]` rows of `x` (in rank order) to rank q and returns the `recv[p]` rows from each rank p, in
    /// rank order; backward sends each row's gradient back where the row came from.
    pub fn all_to_all_rows(&self, x: &Tensor, send: &[i64], recv: &[i64]) -> Result<Tensor> {
        let n = self.size();
        if send.len() != n || recv.len() != n {
            return Err(Error::Usage(format!(
                "all-to-all of rows: {} send and {} receive counts for a group of {n} ranks",
                send.len(),
                recv.len()
            )));
        }
        let mut out: *mut c_void = std::ptr::null_mut();
        let group = &*self.inner as *const Inner as *mut c_void;
        // SAFETY: `x` is a live tensor and the counts hold n entries each; `group` stays valid while this value
        // lives (the caller keeps it alive as long as graphs through this operator may run backward).
        let message = unsafe {
            zerorun_moe_all_to_all(
                x.as_ptr() as *mut c_void,
                send.as_ptr(),
                recv.as_ptr(),
                n as i64,
                all_to_all,
                group,
                &mut out,
            )
        };
        if !message.is_null() {
            // SAFETY: a NUL-terminated string from malloc, ours to free.
            let text = unsafe { std::ffi::CStr::from_ptr(message) }.to_string_lossy().into_owned();
            unsafe { libc::free(message as *mut c_void) };
            return Err(Error::Torch(tch::TchError::Torch(format!("all-to-all of rows: {text}"))));
        }
        // SAFETY: the shim allocated the result with `new at::Tensor`, which tch's Tensor owns from here.
        Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
    }
}

/// The shim's callback: the all-to-all of `input` into `output` over the group's communicator (host memory; a
/// device tensor travels through a host copy). Returns null or a malloc'ed message.
extern "C" fn all_to_all(
    group: *mut c_void,
    input: *mut c_void,
    send: *const i64,
    output: *mut c_void,
    recv: *const i64,
    n: i64,
) -> *mut c_char {
    // A panic must not cross into C++: it becomes the message.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `group` is the `Inner` of a live `AllToAllGroup`; the tensors are the shim's, borrowed for this
        // call (ManuallyDrop: tch must not delete them); the counts hold n entries each.
        let inner = unsafe { &*(group as *const Inner) };
        let (input, output) = unsafe {
            (
                std::mem::ManuallyDrop::new(Tensor::from_ptr(input as *mut torch_sys::C_tensor)),
                std::mem::ManuallyDrop::new(Tensor::from_ptr(output as *mut torch_sys::C_tensor)),
            )
        };
        let counts = |p: *const i64| -> Vec<usize> {
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts(p, n as usize) }.iter().map(|c| *c as usize).collect()
        };
        let (send, recv) = (counts(send), counts(recv));
        let mut c = inner.counts.get();
        c.all_to_all += 1;
        let me = inner.comm.rank();
        c.elements_sent += send.iter().enumerate().filter(|(q, _)| *q != me).map(|(_, s)| *s as u64).sum::<u64>();
        inner.counts.set(c);
        let comm = inner.comm.as_ref();
        crate::comm::coding::EXCHANGE.timed(|| {
            if input.device() == tch::Device::Cpu {
                return views::all_to_all_v(comm, &input, &send, &output, &recv).map_err(|e| e.to_string());
            }
            let (host_in, host_out) = (input.to_device(tch::Device::Cpu), output.to_device(tch::Device::Cpu));
            views::all_to_all_v(comm, &host_in, &send, &host_out, &recv).map_err(|e| e.to_string())?;
            tch::no_grad(|| output.shallow_clone().f_copy_(&host_out)).map(|_| ()).map_err(|e| e.to_string())
        })
    }));
    let text = match result {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(e)) => e,
        Err(_) => "the all-to-all panicked".to_string(),
    };
    let c = CString::new(text.replace('\0', " ")).unwrap_or_default();
    // SAFETY: strdup copies into malloc'ed memory, which the shim frees.
    unsafe { libc::strdup(c.as_ptr()) }
}
