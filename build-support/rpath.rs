//! Shared build script: embeds an rpath to libtorch's `lib` folder into every binary of the package
//! (CLI, examples, tests), so they run without LD_LIBRARY_PATH. torch-sys (links = "tch") exports the
//! folder it linked against as `DEP_TCH_LIBTORCH_LIB` to its direct dependents.
//!
//! It also compiles the package's C++ shims over libtorch calls tch does not bind: `src/cli/native/fused_adamw.cpp`
//! (zerorun: libtorch's fused AdamW kernel, for `zerorun bench adam`) and `native/unit_storage.cpp`
//! (zerorun-runtime: storage resizing and backward into chosen inputs, for stage 3).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| lib.into());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        let shim = match std::env::var("CARGO_PKG_NAME").as_deref() {
            Ok("zerorun") => Some(("src/cli/native/fused_adamw.cpp", "zerorun_fused_adamw")),
            Ok("zerorun-runtime") => Some(("native/unit_storage.cpp", "zerorun_unit_storage")),
            _ => None,
        };
        if let Some((file, name)) = shim.filter(|(f, _)| std::path::Path::new(f).exists()) {
            println!("cargo:rerun-if-changed={file}");
            let include = lib.parent().expect("libtorch lib folder has a parent").join("include");
            cc::Build::new()
                .cpp(true)
                .pic(true)
                .warnings(false)
                .include(&include)
                .include(include.join("torch/csrc/api/include"))
                .flag("-std=c++17")
                .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
                .file(file)
                .compile(name);
        }
        // libtorch_cuda.so registers the CUDA backend when loaded, but nothing calls into it by name, so
        // `--as-needed` would drop it and tch would see no GPU. Keep it, whatever the link order.
        if lib.join("libtorch_cuda.so").exists() {
            println!("cargo:rustc-link-arg=-Wl,--push-state,--no-as-needed,-ltorch_cuda,--pop-state");
        }
    }
}
