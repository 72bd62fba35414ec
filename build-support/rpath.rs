//! Shared build script: embeds an rpath to libtorch's `lib` folder into every binary of the package
//! (CLI, examples, tests), so they run without LD_LIBRARY_PATH. torch-sys (links = "tch") exports the
//! folder it linked against as `DEP_TCH_LIBTORCH_LIB` to its direct dependents.
//!
//! libtorch_cuda is not linked: a CPU run never loads the CUDA stack (about 230 MiB resident); code that uses CUDA
//! loads it first (`zerorun::cuda::load`, a dlopen of the libtorch_cuda beside the libtorch in use).
//!
//! It also compiles the package's C++ shims over libtorch calls tch does not bind: `native/fused_adam.cpp`
//! (zerorun-runtime: libtorch's fused Adam/AdamW kernels, the optimizer step on device memory and `zerorun bench
//! adam`'s reference) and `native/unit_storage.cpp`
//! (zerorun-runtime: storage resizing and backward into chosen inputs, for stage 3) with `native/region_allocator.cpp`
//! (zerorun-runtime: tensors in the shm backend's shared buffer region) and `native/gloo_backend.cpp` (zerorun-runtime:
//! libtorch's TCPStore and ProcessGroupGloo, the backend across hosts) and `native/tensor_parallel.cpp`
//! (zerorun-runtime: tensor parallelism's conjugate operators as autograd functions) and `native/counting_allocator.cpp`
//! (zerorun-runtime: libtorch's CPU allocator with live-byte counters by owner, for the memory report) and
//! `native/flops_counter.cpp` (zerorun-runtime: the flops profiler's counter, libtorch's profiler with FLOPs) and
//! `native/unit_scopes.cpp` (zerorun-runtime: stage 3's scopes: released parameters every operator refuses, the
//! pre-backward hook on a unit's outputs, activation checkpointing as a custom autograd function).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| lib.into());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        if std::env::var("CARGO_PKG_NAME").as_deref() == Ok("zerorun") {
            // `links = "zerorun"`: dependents' build scripts read it as DEP_ZERORUN_LIBTORCH_LIB.
            println!("cargo:libtorch_lib={}", lib.display());
        }
        let shims: &[&str] = match std::env::var("CARGO_PKG_NAME").as_deref() {
            Ok("zerorun") => &[],
            Ok("zerorun-runtime") => &[
                "native/unit_storage.cpp",
                "native/region_allocator.cpp",
                "native/counting_allocator.cpp",
                "native/grad_hooks.cpp",
                "native/unit_scopes.cpp",
                "native/cuda_loader.cpp",
                "native/gloo_backend.cpp",
                "native/tensor_parallel.cpp",
                "native/expert_dispatch.cpp",
                "native/ring_attention.cpp",
                "native/fused_adam.cpp",
                "native/flops_counter.cpp",
            ],
            _ => &[],
        };
        let files: Vec<&str> = shims.iter().copied().filter(|f| std::path::Path::new(f).exists()).collect();
        if !files.is_empty() {
            let include = lib.parent().expect("libtorch lib folder has a parent").join("include");
            let mut build = cc::Build::new();
            build
                .cpp(true)
                .pic(true)
                .warnings(false)
                .include(&include)
                .include(include.join("torch/csrc/api/include"))
                .flag("-std=c++17")
                .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
                // ProcessGroupGloo.hpp declares the class only with this defined and gloo's headers (Debian's
                // libgloo-dev, which `make setup` installs) on the include path; libtorch brings the gloo code.
                .define("USE_C10D_GLOO", None);
            for file in &files {
                println!("cargo:rerun-if-changed={file}");
                build.file(file);
            }
            build.compile(&format!("{}_native", std::env::var("CARGO_PKG_NAME").unwrap_or_default().replace('-', "_")));
        }
    }
}
