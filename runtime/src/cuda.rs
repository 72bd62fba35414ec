//! CUDA on demand. libtorch_cuda is not linked into zerorun's binaries, so a CPU run never loads the CUDA stack
//! (libtorch_cuda pulls in cudart, cusparse, cufft, cufile, cusparseLt and nvshmem: about 230 MiB resident and
//! 120 MiB private per process). Whatever uses CUDA calls [`load`] first: it dlopens the libtorch_cuda next to the
//! libtorch in use (RTLD_GLOBAL, so its kernels and hooks register), once per process.
//!
//! Load before anything asks libtorch about CUDA (`tch::Cuda::is_available()`, `Device::cuda_if_available()`):
//! libtorch caches its first answer for the life of the process. [`available`] loads, then asks.
use std::ffi::{c_char, c_int, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::{Error, Result};

extern "C" {
    fn zerorun_cuda_hooks_registered() -> c_int;
    fn zerorun_libtorch_dir(out: *mut c_char, cap: c_int) -> c_int;
}

/// Whether libtorch's CUDA backend is registered in this process (libtorch_cuda loaded), GPU or not.
pub fn hooks_registered() -> bool {
    unsafe { zerorun_cuda_hooks_registered() != 0 }
}

/// The folder of the libtorch this process uses.
pub fn libtorch_dir() -> Option<PathBuf> {
    let mut buf = vec![0 as c_char; 4096];
    let n = unsafe { zerorun_libtorch_dir(buf.as_mut_ptr(), buf.len() as c_int) };
    // SAFETY: on success the shim wrote a NUL-terminated string into `buf`.
    (n >= 0).then(|| PathBuf::from(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()))
}

/// Loads libtorch's CUDA backend (idempotent). Errors name the library and why it did not load: absent (a CPU
/// build of libtorch) or a dependency missing.
pub fn load() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), (PathBuf, String)>> = OnceLock::new();
    LOADED.get_or_init(load_once).clone().map_err(|(library, why)| Error::Cuda { library, why })
}

fn load_once() -> std::result::Result<(), (PathBuf, String)> {
    if hooks_registered() {
        return Ok(());
    }
    let dir = libtorch_dir().ok_or_else(|| {
        (PathBuf::from("libtorch_cuda.so"), "cannot tell which libtorch this process uses".to_string())
    })?;
    let library = dir.join("libtorch_cuda.so");
    if !library.is_file() {
        return Err((library, "not found: this libtorch is a CPU-only build".into()));
    }
    let path =
        std::ffi::CString::new(library.as_os_str().as_encoded_bytes()).map_err(|e| (library.clone(), e.to_string()))?;
    // SAFETY: a plain dlopen; the handle is kept for the life of the process (never closed).
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a NUL-terminated message after a failed dlopen on this thread.
        let why = unsafe { CStr::from_ptr(libc::dlerror()) }.to_string_lossy().into_owned();
        return Err((library, why));
    }
    if !hooks_registered() {
        return Err((library, "loaded, but libtorch's CUDA hooks did not register".into()));
    }
    tracing::info!(library = %library.display(), "CUDA backend loaded");
    Ok(())
}

/// Whether a GPU can be used: loads the CUDA backend, then asks libtorch. False on CPU-only machines and builds.
pub fn available() -> bool {
    load().is_ok() && tch::Cuda::is_available()
}

/// Number of GPUs libtorch sees (0 when the backend cannot load).
pub fn device_count() -> i64 {
    if load().is_ok() {
        tch::Cuda::device_count()
    } else {
        0
    }
}

/// The device this process trains on: `cuda:{LOCAL_RANK mod the GPUs seen}` when a GPU is usable (`zerorun
/// launch`, torchrun and mpirun set LOCAL_RANK; a lone process is local rank 0), else the CPU. Build the model's
/// `VarStore` on it; the engine puts its buffers where the model is.
pub fn local_device() -> tch::Device {
    let count = device_count();
    if count <= 0 || !tch::Cuda::is_available() {
        return tch::Device::Cpu;
    }
    let local_rank = ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"]
        .iter()
        .find_map(|name| std::env::var(name).ok())
        .and_then(|v| v.trim().parse::<i64>().ok())
        .unwrap_or(0);
    tch::Device::Cuda((local_rank.rem_euclid(count)) as usize)
}

pub use zerorun_report::memory::DeviceMemory;

extern "C" {
    fn zerorun_device_memory(device_index: c_int, out: *mut i64) -> c_int;
    fn zerorun_reset_device_peak(device_index: c_int) -> c_int;
}

/// The CUDA allocator's statistics for `device` (a CUDA device); None for the CPU, or when libtorch's CUDA backend
/// is not loaded (then no CUDA tensor exists either). Read through libc10's allocator registry, so zerorun still
/// does not link libtorch_cuda.
pub fn device_memory(device: tch::Device) -> Option<DeviceMemory> {
    let tch::Device::Cuda(index) = device else { return None };
    if !hooks_registered() {
        return None;
    }
    let mut out = [0i64; 4];
    // SAFETY: `out` holds the four values the shim writes.
    let rc = unsafe { zerorun_device_memory(index as c_int, out.as_mut_ptr()) };
    (rc == 0).then(|| DeviceMemory {
        allocated: out[0].max(0) as u64,
        allocated_peak: out[1].max(0) as u64,
        reserved: out[2].max(0) as u64,
        reserved_peak: out[3].max(0) as u64,
    })
}

/// Starts `device`'s allocator peaks over from the memory in use now (`torch.cuda.reset_peak_memory_stats`), so
/// that [`device_memory`] gives the peak of what runs next; false for the CPU or without the CUDA backend.
pub fn reset_peak(device: tch::Device) -> bool {
    let tch::Device::Cuda(index) = device else { return false };
    // SAFETY: a plain call into the shim, which checks that the allocator exists.
    hooks_registered() && unsafe { zerorun_reset_device_peak(index as c_int) } == 0
}
