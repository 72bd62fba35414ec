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
