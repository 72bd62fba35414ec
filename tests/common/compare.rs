//! Comparing trained parameters: shared by the equivalence tests.
#![allow(dead_code)]
use tch::Tensor;

/// Named tensors as fp32 values, sorted by name: the form the tests compare parameters in.
pub fn sorted_values(mut named: Vec<(String, Tensor)>) -> Vec<(String, Vec<f32>)> {
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(t.to_kind(tch::Kind::Float).reshape([-1])).unwrap()))
        .collect()
}

/// The engine's full parameters ([`sorted_values`]); collective at stage 3, so every rank calls it.
pub fn full_parameters(engine: &mut zerorun::Engine) -> Vec<(String, Vec<f32>)> {
    sorted_values(engine.full_parameters().unwrap())
}

/// The largest over parameters of max |a - b| / max |b| (names must match, in order).
pub fn max_relative_difference(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f64 {
    assert_eq!(a.iter().map(|p| &p.0).collect::<Vec<_>>(), b.iter().map(|p| &p.0).collect::<Vec<_>>());
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| {
            let diff = x.iter().zip(y).map(|(p, q)| (p - q).abs() as f64).fold(0.0, f64::max);
            let scale = y.iter().map(|q| q.abs() as f64).fold(1e-6, f64::max);
            diff / scale
        })
        .fold(0.0, f64::max)
}
