//! Shared build script: embeds an rpath to libtorch's `lib` folder into every binary of the package
//! (CLI, examples, tests), so they run without LD_LIBRARY_PATH. torch-sys (links = "tch") exports the
//! folder it linked against as `DEP_TCH_LIBTORCH_LIB` to its direct dependents.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| lib.into());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        // libtorch_cuda.so (in the +cu wheels) needs the link to keep it even when nothing names it directly.
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    }
}
