//! CUDA on demand: a process that has not asked for CUDA has no libtorch_cuda mapped and libtorch reports no CUDA
//! backend; `cuda::load` maps the libtorch_cuda beside the libtorch in use and the backend registers, GPU or not.
//! One test in its own binary: loading is for the life of the process.
use zerorun_runtime::cuda;

fn mapped(name: &str) -> bool {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().any(|l| l.ends_with(name))
}

#[test]
fn libtorch_cuda_loads_on_demand_only() {
    assert!(!mapped("/libtorch_cuda.so"), "libtorch_cuda is mapped before anyone asked for CUDA: is it linked again?");
    assert!(!cuda::hooks_registered(), "libtorch reports a CUDA backend before the load");
    let dir = cuda::libtorch_dir().expect("the libtorch in use");
    assert!(dir.join("libtorch_cpu.so").is_file(), "{}", dir.display());
    if dir.join("libtorch_cuda.so").is_file() {
        cuda::load().unwrap();
        assert!(mapped("/libtorch_cuda.so"));
        assert!(cuda::hooks_registered(), "the CUDA backend did not register after the load");
        cuda::load().unwrap();
        // A GPU is another matter: without one libtorch sees no device, and says so instead of failing.
        assert_eq!(cuda::available(), cuda::device_count() > 0);
    } else {
        let e = cuda::load().unwrap_err().to_string();
        assert!(e.starts_with(&format!("CUDA: {}: not found", dir.join("libtorch_cuda.so").display())), "{e}");
    }
}
