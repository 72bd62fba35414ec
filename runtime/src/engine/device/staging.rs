//! Host buffers that device values pass through (a collective on a backend without device support, the host
//! optimizer's copies under CPU offload), kept for reuse rather than allocated per call: page-locked ("pinned")
//! when the values come from a CUDA device, so the copies are DMA transfers at full bandwidth (pinning is a slow
//! allocation, which is why the buffers are kept). One pool per thread (the engine's thread and its communication
//! thread stage at once); a buffer goes back to its thread's pool when its [`Staged`] handle drops.
use std::cell::RefCell;

use tch::{Device, Kind, Tensor};

/// Free buffers kept per thread, at most: the largest stay (a step stages the same sizes again).
const KEPT: usize = 4;

thread_local! {
    static FREE: RefCell<Vec<Tensor>> = const { RefCell::new(Vec::new()) };
}

/// A host buffer of the pool, lent for one use: [`Staged::values`] is its first `len` elements.
pub struct Staged {
    whole: Option<Tensor>,
    values: Tensor,
}

impl Staged {
    /// `t` itself, lent from nowhere (a host tensor that needs no staging): nothing returns to the pool.
    pub fn borrowed(t: &Tensor) -> Staged {
        Staged { whole: None, values: t.shallow_clone() }
    }

    /// The lent elements (a view of the buffer, contiguous).
    pub fn values(&self) -> &Tensor {
        &self.values
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let Some(whole) = self.whole.take() else { return };
        FREE.with(|free| {
            let mut free = free.borrow_mut();
            free.push(whole);
            if free.len() > KEPT {
                // Let the smallest go.
                let smallest = (0..free.len()).min_by_key(|&i| free[i].numel()).expect("not empty");
                let _ = free.swap_remove(smallest);
            }
        });
    }
}

/// A host buffer of `len` elements of `kind` for values of `source` (a device: pinned when it is CUDA), from this
/// thread's pool when one fits, else new.
pub fn host_buffer(len: usize, kind: Kind, source: Device) -> crate::error::Result<Staged> {
    let pinned = matches!(source, Device::Cuda(_));
    let reused = FREE.with(|free| {
        let mut free = free.borrow_mut();
        let fits = (0..free.len())
            .filter(|&i| free[i].kind() == kind && free[i].numel() >= len && is_pinned(&free[i], source) == pinned)
            .min_by_key(|&i| free[i].numel());
        fits.map(|i| free.swap_remove(i))
    });
    let whole = match reused {
        Some(t) => t,
        None => {
            let t = Tensor::f_empty([len as i64], (kind, Device::Cpu))?;
            if pinned {
                super::native::pin_memory(&t)?
            } else {
                t
            }
        }
    };
    let values = whole.narrow(0, 0, len as i64);
    Ok(Staged { whole: Some(whole), values })
}

/// A host copy of device values `t` in a buffer of the pool (see [`host_buffer`]).
pub fn host_copy(t: &Tensor) -> crate::error::Result<Staged> {
    let staged = host_buffer(t.numel(), t.kind(), t.device())?;
    tch::no_grad(|| staged.values().shallow_clone().f_copy_(&t.reshape([-1])))?;
    Ok(staged)
}

/// `t` (a host tensor that stays, such as the fp32 master of an offloaded optimizer) page-locked when the values
/// it exchanges come from a CUDA device, as is.
pub fn pinned_for(t: Tensor, source: Device) -> crate::error::Result<Tensor> {
    if matches!(source, Device::Cuda(_)) && t.device() == Device::Cpu {
        return super::native::pin_memory(&t);
    }
    Ok(t)
}

fn is_pinned(t: &Tensor, source: Device) -> bool {
    matches!(source, Device::Cuda(_)) && super::native::is_pinned(t)
}

/// Buffers this thread's pool holds now.
#[cfg(test)]
fn kept_on_this_thread() -> usize {
    FREE.with(|free| free.borrow().len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer comes back on drop and is lent again for a size it fits; two at once are two buffers; the
    /// smallest go beyond the kept count.
    #[test]
    fn buffers_are_reused_by_size_and_kind() {
        let first = host_buffer(100, Kind::Float, Device::Cpu).unwrap();
        let address = first.values().data_ptr() as usize;
        drop(first);
        assert_eq!(kept_on_this_thread(), 1);
        let again = host_buffer(60, Kind::Float, Device::Cpu).unwrap();
        assert_eq!(again.values().data_ptr() as usize, address, "the kept buffer is lent again");
        assert_eq!(again.values().numel(), 60);
        let other = host_buffer(60, Kind::Float, Device::Cpu).unwrap();
        assert_ne!(other.values().data_ptr() as usize, address, "two at once are two buffers");
        let half = host_buffer(10, Kind::BFloat16, Device::Cpu).unwrap();
        assert_eq!(half.values().kind(), Kind::BFloat16, "a buffer of another kind is not lent");
        drop((again, other, half));
        assert_eq!(kept_on_this_thread(), 3);
        let many: Vec<Staged> = (0..6).map(|i| host_buffer(1000 + i, Kind::Float, Device::Cpu).unwrap()).collect();
        drop(many);
        assert_eq!(kept_on_this_thread(), KEPT);
        let largest = host_buffer(1005, Kind::Float, Device::Cpu).unwrap();
        assert_eq!(largest.values().numel(), 1005, "the largest were kept");
    }
}
