//! The arithmetic the engine runs on its flat buffers between backward and the optimizer step (the squared
//! gradient norm, clipping's scaling, accumulating reduced gradients in fp32), written once for both residences:
//! host buffers go through zerorun-optim's slice kernels (bitwise what the host engine always computed), buffers
//! on the device paths ([`Residence::on_device`]: device memory, or any tensor under emulation) through tensor ops
//! on their own device, so no gradient crosses to the host for it.
use tch::{Kind, Tensor};
use zerorun_optim::norm;

use crate::engine::device::staging::{self, Staged};
use crate::engine::device::{views, Residence};
use crate::error::Result;

/// The sum of the squares of `t`'s elements (any float kind), accumulated in f64.
pub fn sum_of_squares(residence: Residence, t: &Tensor) -> Result<f64> {
    sum_of_squares_on(t, residence.on_device(t))
}

fn sum_of_squares_on(t: &Tensor, device_path: bool) -> Result<f64> {
    if t.numel() == 0 {
        return Ok(0.0);
    }
    if device_path {
        // The norm accumulated in f64 by the kernel, without an f64 or squared copy of the gradients.
        let norm = tch::no_grad(|| t.f_linalg_norm(2.0, None::<&[i64]>, false, Kind::Double))?;
        let norm = f64::try_from(&norm)?;
        return Ok(norm * norm);
    }
    // SAFETY: read-only for this call, between the reduction and the step (nothing writes gradients then).
    Ok(norm::sum_of_squares(unsafe { views::grads_of(t) }))
}

/// `t *= coef` in place (fp32).
pub fn scale(residence: Residence, t: &Tensor, coef: f32) -> Result<()> {
    scale_on(t, coef, residence.on_device(t))
}

fn scale_on(t: &Tensor, coef: f32, device_path: bool) -> Result<()> {
    if device_path {
        let _ = tch::no_grad(|| t.shallow_clone().f_mul_scalar_(coef as f64))?;
        return Ok(());
    }
    // SAFETY: the only view of `t` for this call.
    norm::scale_in_place(unsafe { views::slice::<f32>(t) }, coef);
    Ok(())
}

/// `acc[i] += part[i]` in f32, whatever `part`'s kind; `part` may live elsewhere than `acc` (a device part into a
/// host accumulator under CPU offload), and is then copied to `acc`'s device first.
pub fn accumulate(residence: Residence, acc: &Tensor, part: &Tensor) -> Result<()> {
    accumulate_on(acc, part, residence.on_device(acc) || residence.on_device(part))
}

fn accumulate_on(acc: &Tensor, part: &Tensor, device_path: bool) -> Result<()> {
    debug_assert_eq!(acc.numel(), part.numel(), "an accumulation adds equal lengths");
    if device_path {
        tch::no_grad(|| -> Result<()> {
            // In-place add promotes a 16-bit part to f32 in the kernel: no widened copy (only a device hop when
            // the accumulator is in host memory).
            let _ = acc.shallow_clone().f_add_(&part.f_to_device(acc.device())?)?;
            Ok(())
        })?;
        return Ok(());
    }
    // SAFETY: `acc` is the engine's fp32 accumulator and `part` a reduced gradient buffer, two storages; both are
    // viewed for this call only.
    views::accumulate(unsafe { views::slice::<f32>(acc) }, part);
    Ok(())
}

/// `t` in host memory: `t` itself when it is a host tensor off the device paths, else a host copy in a staging
/// buffer (what the host optimizer reads when the engine's buffers are on a device and its states are not).
pub fn on_host(residence: Residence, t: &Tensor) -> Result<Staged> {
    if residence.on_device(t) {
        return staging::host_copy(t);
    }
    Ok(Staged::borrowed(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device path (tensor ops) gives the host path's values: bitwise for accumulation and scaling, to f64
    /// rounding for the norm (another summation order).
    #[test]
    fn host_and_device_paths_agree() {
        let values: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 17.0 - 3.0).collect();
        let t = Tensor::from_slice(&values);
        let reference: f64 = values.iter().map(|&v| (v as f64) * (v as f64)).sum();
        for device_path in [false, true] {
            let sq = sum_of_squares_on(&t, device_path).unwrap();
            assert!((sq - reference).abs() < 1e-12 * reference, "device path {device_path}: {sq} vs {reference}");
        }
        let part = t.to_kind(Kind::BFloat16);
        let results: Vec<Tensor> = [false, true]
            .into_iter()
            .map(|device_path| {
                let acc = Tensor::zeros([1000], (Kind::Float, tch::Device::Cpu));
                accumulate_on(&acc, &part, device_path).unwrap();
                accumulate_on(&acc, &t, device_path).unwrap();
                scale_on(&acc, 0.5, device_path).unwrap();
                acc
            })
            .collect();
        assert!(results[0].equal(&results[1]), "the two paths differ");
        let expected = (part.to_kind(Kind::Float) + &t) * 0.5;
        assert!(results[0].equal(&expected), "accumulate-then-scale is not (bf16 part + fp32 part) / 2");
    }
}
