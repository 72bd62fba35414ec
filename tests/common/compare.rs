//! Comparing trained parameters: shared by the equivalence tests.

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
