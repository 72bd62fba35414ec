//! Where the engine's buffers live and how they are reached: host views of tensors and the collectives on them
//! (`views.rs`), host staging of device memory (`staging.rs`), the flat arithmetic on either side
//! (`flat_math.rs`), checkpointed unit inputs waiting in host memory (`host_inputs.rs`), storage operations of the
//! C++ shim (`native.rs`), glibc's allocator settings
//! (`allocator.rs`), and the device path's optimizer ([`optimizer`]), whose states stay on the model's device.
pub(crate) mod allocator;
pub(crate) mod flat_math;
pub(crate) mod host_inputs;
pub(crate) mod native;
pub mod optimizer;
pub(crate) mod staging;
pub(crate) mod views;

use tch::Device;

/// Where the engine's buffers live, decided once when the engine is built and held as a value: host memory
/// (host views and kernels), or the device path: a CUDA device, or host memory taken as a device under
/// `ZERORUN_DEVICE_EMULATION=1`, so that `make test` runs the device path's code on CPU tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residence {
    /// On the host: views and the host kernels.
    Host,
    /// On this CUDA device.
    Device(Device),
    /// Host memory taken as a device (`ZERORUN_DEVICE_EMULATION=1`).
    Emulated,
}

impl Residence {
    /// The residence of a model on `device`; the CPU is the device path's when emulation is asked for.
    pub fn of(device: Device) -> Residence {
        match device {
            Device::Cpu if emulation_requested() => Residence::Emulated,
            Device::Cpu => Residence::Host,
            d => Residence::Device(d),
        }
    }

    /// The device the model's tensors are on.
    pub fn device(self) -> Device {
        match self {
            Residence::Device(d) => d,
            Residence::Host | Residence::Emulated => Device::Cpu,
        }
    }

    /// Whether `t` takes the device paths: a tensor in device memory, and every tensor of an emulated residence,
    /// so that `make test` runs them. Host slices (`views.rs`) are for the others.
    pub fn on_device(self, t: &tch::Tensor) -> bool {
        t.device() != Device::Cpu || self == Residence::Emulated
    }

    /// Whether the engine takes the device path (tensor ops, host staging for host-only collectives).
    pub fn device_path(self) -> bool {
        self != Residence::Host
    }
}

/// `ZERORUN_DEVICE_EMULATION=1`, read when an engine is built.
pub fn emulation_requested() -> bool {
    std::env::var_os("ZERORUN_DEVICE_EMULATION").is_some_and(|v| v == "1")
}
