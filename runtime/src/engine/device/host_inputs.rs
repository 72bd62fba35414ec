//! `activation_checkpointing.cpu_checkpointing`: on the device path, the unit inputs activation checkpointing keeps
//! for backward wait in host memory instead of device memory. Each goes out as its unit's forward ends, by a
//! non-blocking copy into pinned host memory (libtorch pins the destination of a non-blocking device-to-host copy),
//! and comes back by a non-blocking copy one unit ahead of its recomputation. Both copies are queued on the
//! stream that computes, so they are ordered with it: the device tensor can be dropped as soon as its copy is queued
//! (the caching allocator reuses its block only for work queued after the copy), and the recomputation reads the
//! returned input only after it arrived. Under device emulation the "device" is host memory and the copies are
//! plain copies, so `make test` runs this path; on a host run the inputs are in host memory already.
use tch::{Device, Tensor};

use super::Residence;

/// A unit input sent to host memory, and how to bring it back.
pub(crate) struct HostInput {
    host: Tensor,
    requires_grad: bool,
}

impl HostInput {
    /// Queues the copy of `x` (a unit's input, a leaf) to host memory.
    pub fn send(residence: Residence, x: &Tensor) -> HostInput {
        let detached = x.detach();
        let host = match residence {
            Residence::Device(_) => detached.to_device_(Device::Cpu, x.kind(), true, false),
            Residence::Emulated | Residence::Host => detached.copy(),
        };
        HostInput { host, requires_grad: x.requires_grad() }
    }

    /// Bytes in host memory.
    pub fn bytes(&self) -> usize {
        self.host.numel() * self.host.kind().elt_size_in_bytes()
    }

    /// Queues the copy back to the model's device: a leaf that requires grad as the input did.
    pub fn bring_back(&self, residence: Residence) -> Tensor {
        let back = match residence {
            Residence::Device(d) => self.host.to_device_(d, self.host.kind(), true, false),
            Residence::Emulated | Residence::Host => self.host.copy(),
        };
        if self.requires_grad {
            back.set_requires_grad(true)
        } else {
            back
        }
    }
}
