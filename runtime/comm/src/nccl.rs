//! NCCL through cudarc (feature `nccl`, dynamic loading: it builds without CUDA and loads libcuda and libnccl at
//! run time). This backend takes host buffers, like the others, staging them through device memory: it is the
//! conformance and bootstrap path; the engine's device-resident buffers come with the GPU work (issue 11).
//!
//! cudarc panics at first use when a library is missing, so [`preflight`] checks first and names what is
//! missing. cudarc looks for `libnccl.so`; the pip wheel ships only `libnccl.so.2`: scripts/gpu-check.sh links one
//! to the other, and the error says so. The link must point at the NCCL libtorch_cuda itself loads: two NCCL
//! copies in one process interpose each other's symbols and NCCL reports a "corrupted comm object" (seen on the
//! H200 image, whose /usr/lib has another NCCL).
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};
use half::{bf16, f16};

use super::groups::{self, Split};
use super::{BufMut, BufRef, Collectives, CommError, CommResult, Communicator, DeviceBuf, Dtype, ReduceOp};

fn dl_ok(name: &str) -> bool {
    let c = std::ffi::CString::new(name).expect("no NUL in library names");
    // SAFETY: dlopen/dlclose with a valid C string; the handle is closed at once.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if h.is_null() {
            return false;
        }
        libc::dlclose(h);
    }
    true
}

/// Checks that the CUDA driver and NCCL can be loaded, before cudarc is touched.
pub fn preflight(rank: usize, world_size: usize) -> CommResult<()> {
    let fail = |what: String| CommError::Rendezvous { rank, world_size, place: "NCCL".into(), what };
    if !dl_ok("libcuda.so") && !dl_ok("libcuda.so.1") {
        return Err(fail("no CUDA driver (libcuda.so) on this machine: NCCL needs a GPU".into()));
    }
    if !dl_ok("libnccl.so") {
        let hint = if dl_ok("libnccl.so.2") {
            "only libnccl.so.2 is on the library path, and cudarc loads libnccl.so: link one to the other in a folder on LD_LIBRARY_PATH (scripts/gpu-check.sh does)"
        } else {
            "libnccl.so is not on the library path (pip: nvidia-nccl-cu13 puts it under site-packages/nvidia/*/lib)"
        };
        return Err(fail(hint.into()));
    }
    Ok(())
}

/// One rank's NCCL communicator on device `device`.
pub struct NcclComm {
    comm: Comm,
    stream: Arc<CudaStream>,
    device: usize,
    rank: usize,
    world_size: usize,
}

// SAFETY: the communicator and its stream are used from one thread at a time (the trait is Send, not Sync).
unsafe impl Send for NcclComm {}

fn nccl_err(op: &'static str, rank: usize, e: impl std::fmt::Debug) -> CommError {
    CommError::BadArgument { op, rank, what: format!("NCCL/CUDA: {e:?}") }
}

/// A fresh NCCL unique id as bytes, for rank 0 to share through a rendezvous.
pub fn unique_id() -> CommResult<[u8; 128]> {
    preflight(0, 0)?;
    let id = Id::new().map_err(|e| nccl_err("rendezvous", 0, e.0))?;
    Ok(id.internal().map(|c| c as u8))
}

impl NcclComm {
    /// The NCCL communicator of a job the environment describes, on one host: rank 0 makes the NCCL id and the
    /// others get it through a shared-memory rendezvous (NCCL's own bootstrap needs the id first); `LOCAL_RANK`
    /// picks the GPU. Across hosts zerorun-runtime bootstraps through gloo's TCPStore instead
    /// ([`NcclComm::with_bootstrap`]).
    pub fn from_env(info: &super::rank_info::RankInfo, timeout: std::time::Duration) -> CommResult<NcclComm> {
        preflight(info.rank, info.world_size)?;
        if info.world_size == 1 {
            return NcclComm::with_bootstrap(info, None);
        }
        let boot_info = super::rank_info::RankInfo { run_id: format!("{}-nccl", info.run_id), ..info.clone() };
        let boot = super::shm::ShmComm::join(&boot_info, timeout)?;
        NcclComm::with_bootstrap(info, Some(&boot))
    }

    /// The NCCL communicator of the job, rank 0's NCCL id broadcast over `boot` (a group of the same ranks: the
    /// shm segment on one host, gloo across hosts), then a barrier so the bootstrap group may go.
    pub fn with_bootstrap(info: &super::rank_info::RankInfo, boot: Option<&dyn Communicator>) -> CommResult<NcclComm> {
        preflight(info.rank, info.world_size)?;
        let mut id = [0i64; 16];
        if info.rank == 0 {
            let bytes = unique_id()?;
            for (w, c) in id.iter_mut().zip(bytes.chunks(8)) {
                *w = i64::from_ne_bytes(c.try_into().expect("8 bytes"));
            }
        }
        if let Some(boot) = boot {
            boot.broadcast(&mut id, 0)?;
            boot.barrier()?;
        }
        let mut bytes = [0u8; 128];
        for (c, w) in bytes.chunks_mut(8).zip(id) {
            c.copy_from_slice(&w.to_ne_bytes());
        }
        NcclComm::new(info.local_rank, info.rank, info.world_size, bytes)
    }

    /// Joins the NCCL communicator `id` names as rank `rank` of `world_size`, on CUDA device `device` (every rank calls it with the id its first member made).
    pub fn new(device: usize, rank: usize, world_size: usize, id: [u8; 128]) -> CommResult<NcclComm> {
        preflight(rank, world_size)?;
        let ctx = CudaContext::new(device).map_err(|e| nccl_err("rendezvous", rank, e))?;
        let stream = ctx.default_stream();
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let comm =
            Comm::from_rank(stream.clone(), rank, world_size, id).map_err(|e| nccl_err("rendezvous", rank, e.0))?;
        Ok(NcclComm { comm, stream, device, rank, world_size })
    }

    /// Sends (`Some`) or receives (`None`, into `into`) bytes from `peer`, through device memory.
    fn p2p_bytes(&self, op: &'static str, peer: usize, send: Option<&[u8]>, into: &mut [u8]) -> CommResult<()> {
        let e = |x: cudarc::driver::DriverError| nccl_err(op, self.rank, x);
        match send {
            Some(bytes) => {
                let dev = self.stream.clone_htod(bytes).map_err(e)?;
                self.comm.send(&dev, peer as i32).map_err(|x| nccl_err(op, self.rank, x.0))?;
            }
            None => {
                let mut dev = self.stream.alloc_zeros::<u8>(into.len()).map_err(e)?;
                self.comm.recv(&mut dev, peer as i32).map_err(|x| nccl_err(op, self.rank, x.0))?;
                self.stream.memcpy_dtoh(&dev, into).map_err(e)?;
            }
        }
        self.stream.synchronize().map_err(e)
    }

    /// A transfer: the header handshake (length and type, both ends fail on a mismatch), then the payload.
    fn p2p(&self, op: &'static str, peer: usize, sending: bool, bytes: &mut [u8], dtype: Dtype) -> CommResult<()> {
        groups::check_peer(op, self.rank, self.world_size, peer)?;
        let len = bytes.len() / dtype.size();
        let transfer = groups::Transfer { op, rank: self.rank, peer, sending, len, dtype };
        groups::header_handshake(
            &transfer,
            |w| self.p2p_bytes(op, peer, Some(bytemuck::cast_slice(w)), &mut []),
            |w| self.p2p_bytes(op, peer, None, bytemuck::cast_slice_mut(w)),
        )?;
        if bytes.is_empty() {
            return Ok(());
        }
        if sending {
            self.p2p_bytes(op, peer, Some(bytes), &mut [])
        } else {
            self.p2p_bytes(op, peer, None, bytes)
        }
    }

    fn op(op: ReduceOp) -> NcclOp {
        match op {
            ReduceOp::Sum => NcclOp::Sum,
            ReduceOp::Avg => NcclOp::Avg,
            ReduceOp::Max => NcclOp::Max,
        }
    }

    /// Copies `input` to the device, runs `f(comm, device input, device output)`, copies the output into `out`.
    fn staged<T>(
        &self,
        op: &'static str,
        input: &[T],
        out: &mut [T],
        f: impl FnOnce(
            &Comm,
            &cudarc::driver::CudaSlice<T>,
            &mut cudarc::driver::CudaSlice<T>,
        ) -> Result<(), cudarc::nccl::result::NcclError>,
    ) -> CommResult<()>
    where
        T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy,
    {
        let e = |x: cudarc::driver::DriverError| nccl_err(op, self.rank, x);
        let src = self.stream.clone_htod(input).map_err(e)?;
        let mut dst = self.stream.alloc_zeros::<T>(out.len().max(1)).map_err(e)?;
        f(&self.comm, &src, &mut dst).map_err(|x| nccl_err(op, self.rank, x.0))?;
        self.stream.memcpy_dtoh(&dst.slice(..out.len()), out).map_err(e)?;
        self.stream.synchronize().map_err(e)?;
        Ok(())
    }
}

/// A CUDA tensor's storage as cudarc's NCCL calls take device memory: its address and length. The collectives run
/// on the communicator's stream, the legacy default stream, which is also libtorch's unless a program sets another:
/// work queued by libtorch before the call is ordered before the collective, and the call synchronizes the stream
/// before it returns (the engine's collectives block).
struct TorchMemory<'s, T> {
    ptr: u64,
    len: usize,
    stream: &'s Arc<CudaStream>,
    elements: std::marker::PhantomData<T>,
}

impl<T> cudarc::driver::DeviceSlice<T> for TorchMemory<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> cudarc::driver::DevicePtr<T> for TorchMemory<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
        // Ordering is the one stream's: nothing to record.
        (self.ptr, cudarc::driver::SyncOnDrop::Sync(None))
    }
}

impl<T> cudarc::driver::DevicePtrMut<T> for TorchMemory<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
        (self.ptr, cudarc::driver::SyncOnDrop::Sync(None))
    }
}

impl NcclComm {
    /// Every one of `bufs` is device memory of this communicator's device, or an error names the mismatch.
    fn check_device(&self, op: &'static str, bufs: &[DeviceBuf]) -> CommResult<()> {
        match bufs.iter().find(|b| b.device != self.device) {
            None => Ok(()),
            Some(b) => Err(CommError::BadArgument {
                op,
                rank: self.rank,
                what: format!("a buffer on cuda:{} given to the NCCL communicator of cuda:{}", b.device, self.device),
            }),
        }
    }

    fn memory<T>(&self, ptr: u64, len: usize) -> TorchMemory<'_, T> {
        TorchMemory { ptr, len, stream: &self.stream, elements: std::marker::PhantomData }
    }

    /// Runs a device collective on this thread with the communicator's context bound, then waits for the stream.
    fn on_device(
        &self,
        op: &'static str,
        f: impl FnOnce() -> Result<cudarc::nccl::result::NcclStatus, cudarc::nccl::result::NcclError>,
    ) -> CommResult<bool> {
        let e = |x: cudarc::driver::DriverError| nccl_err(op, self.rank, x);
        self.stream.context().bind_to_thread().map_err(e)?;
        f().map_err(|x| nccl_err(op, self.rank, x.0))?;
        self.stream.synchronize().map_err(e)?;
        Ok(true)
    }
}

macro_rules! by_dtype {
    ($dtype:expr, $f:ident ! ($($arg:tt)*)) => {
        match $dtype {
            Dtype::F32 => $f!(f32, $($arg)*),
            Dtype::Bf16 => $f!(bf16, $($arg)*),
            Dtype::F16 => $f!(f16, $($arg)*),
            Dtype::I64 => $f!(i64, $($arg)*),
        }
    };
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        if buf.is_empty() {
            return Ok(());
        }
        macro_rules! run {
            ($t:ty, $buf:expr, $op:expr) => {{
                let v: &mut [$t] = bytemuck::cast_slice_mut($buf.bytes);
                let input = v.to_vec();
                let o = Self::op($op);
                self.staged("all_reduce", &input, v, |c, s, d| c.all_reduce(s, d, &o).map(|_| ()))
            }};
        }
        by_dtype!(buf.dtype, run!(buf, op))
    }

    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        if input.is_empty() {
            return Ok(());
        }
        macro_rules! run {
            ($t:ty, $input:expr, $output:expr, $op:expr) => {{
                let i: &[$t] = bytemuck::cast_slice($input.bytes);
                let out: &mut [$t] = bytemuck::cast_slice_mut($output.bytes);
                let o = Self::op($op);
                self.staged("reduce_scatter", i, out, |c, s, d| c.reduce_scatter(s, d, &o).map(|_| ()))
            }};
        }
        by_dtype!(input.dtype, run!(input, output, op))
    }

    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let (rank, n) = (self.rank, self.world_size);
        macro_rules! run {
            ($t:ty, $buf:expr) => {{
                let v: &mut [$t] = bytemuck::cast_slice_mut($buf.bytes);
                let part = v.len() / n;
                let mine = v[rank * part..(rank + 1) * part].to_vec();
                self.staged("all_gather", &mine, v, |c, s, d| c.all_gather(s, d).map(|_| ()))
            }};
        }
        by_dtype!(buf.dtype, run!(buf))
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        if buf.is_empty() {
            return Ok(());
        }
        macro_rules! run {
            ($t:ty, $buf:expr, $root:expr) => {{
                let v: &mut [$t] = bytemuck::cast_slice_mut($buf.bytes);
                let input = v.to_vec();
                self.staged("broadcast", &input, v, |c, s, d| c.broadcast(Some(s), d, $root as i32).map(|_| ()))
            }};
        }
        by_dtype!(buf.dtype, run!(buf, root))
    }

    unsafe fn all_reduce_device(&self, buf: DeviceBuf, op: ReduceOp) -> CommResult<bool> {
        self.check_device("all_reduce", &[buf])?;
        if buf.count == 0 {
            return Ok(true);
        }
        let o = Self::op(op);
        macro_rules! run {
            ($t:ty, $buf:expr) => {{
                let mut m = self.memory::<$t>($buf.ptr, $buf.count);
                self.on_device("all_reduce", || self.comm.all_reduce_in_place(&mut m, &o))
            }};
        }
        by_dtype!(buf.dtype, run!(buf))
    }

    unsafe fn reduce_scatter_device(&self, input: DeviceBuf, output: DeviceBuf, op: ReduceOp) -> CommResult<bool> {
        self.check_device("reduce_scatter", &[input, output])?;
        if input.count == 0 {
            return Ok(true);
        }
        let o = Self::op(op);
        macro_rules! run {
            ($t:ty, $input:expr, $output:expr) => {{
                let i = self.memory::<$t>($input.ptr, $input.count);
                let mut out = self.memory::<$t>($output.ptr, $output.count);
                self.on_device("reduce_scatter", || self.comm.reduce_scatter(&i, &mut out, &o))
            }};
        }
        by_dtype!(input.dtype, run!(input, output))
    }

    unsafe fn all_gather_device(&self, buf: DeviceBuf) -> CommResult<bool> {
        self.check_device("all_gather", &[buf])?;
        if buf.count == 0 {
            return Ok(true);
        }
        // In place, as NCCL allows: this rank's part is the send buffer, inside the receive buffer.
        let part = buf.count / self.world_size;
        let mine = buf.ptr + (self.rank * part * buf.dtype.size()) as u64;
        macro_rules! run {
            ($t:ty, $buf:expr) => {{
                let send = self.memory::<$t>(mine, part);
                let mut all = self.memory::<$t>($buf.ptr, $buf.count);
                self.on_device("all_gather", || self.comm.all_gather(&send, &mut all))
            }};
        }
        by_dtype!(buf.dtype, run!(buf))
    }

    unsafe fn broadcast_device(&self, buf: DeviceBuf, root: usize) -> CommResult<bool> {
        self.check_device("broadcast", &[buf])?;
        if buf.count == 0 {
            return Ok(true);
        }
        macro_rules! run {
            ($t:ty, $buf:expr) => {{
                let mut m = self.memory::<$t>($buf.ptr, $buf.count);
                self.on_device("broadcast", || self.comm.broadcast_in_place(&mut m, root as i32))
            }};
        }
        by_dtype!(buf.dtype, run!(buf))
    }

    fn barrier(&self) -> CommResult<()> {
        let mut one = [0f32];
        self.all_reduce_buf(BufMut::new(&mut one), ReduceOp::Sum)
    }

    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        let mut bytes = buf.bytes.to_vec();
        self.p2p("send", dst, true, &mut bytes, buf.dtype)
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        let dtype = buf.dtype;
        self.p2p("recv", src, false, buf.bytes, dtype)
    }

    /// Each new group's first member makes an NCCL id; the parent all-gathers every rank's proposal (one
    /// collective: 128 bytes a rank) and each member initialises its group's communicator from its first member's
    /// id, on this communicator's device (ncclCommInitRank per group, as torch's new_group does).
    fn split_group(&self, split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        const WORDS: usize = 16;
        let first = split.color(self.rank).is_some() && split.rank == 0;
        let mine = if first { unique_id()? } else { [0u8; 128] };
        let mut all = vec![0i64; WORDS * self.world_size];
        for (k, word) in mine.chunks(8).enumerate() {
            all[WORDS * self.rank + k] = i64::from_ne_bytes(word.try_into().expect("8 bytes"));
        }
        self.all_gather_in_place(&mut all)?;
        let Some(_) = split.color(self.rank) else { return Ok(None) };
        let leader = split.members[0];
        let mut id = [0u8; 128];
        for (k, word) in all[WORDS * leader..WORDS * (leader + 1)].iter().enumerate() {
            id[8 * k..8 * (k + 1)].copy_from_slice(&word.to_ne_bytes());
        }
        Ok(Some(Box::new(NcclComm::new(self.device, split.rank, split.members.len(), id)?)))
    }
}
