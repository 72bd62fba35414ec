//! The memory traffic of an Adam step with trivial math, through the same tiles, threads and vector code as the
//! optimizers: what a benchmark divides by to say how close a step runs to the machine's bandwidth.
use crate::dispatch::{for_each_chunk, Kernel};
use crate::shard::{check, Grads, Group};
use crate::Result;

struct Traffic;

impl Kernel<2> for Traffic {
    #[inline(always)]
    fn run(&self, _group: usize, p: &mut [f32], g: &[f32], [m, v]: [&mut [f32]; 2]) {
        let n = p.len();
        let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            m[i] += g[i];
            v[i] += g[i];
            p[i] -= g[i];
        }
    }
}

/// Reads params, grads and two moment buffers and writes params and moments once each (28 B per element with f32
/// gradients), adding the gradient to each. Only for measuring bandwidth: the values become meaningless.
pub fn adam_traffic(params: &mut [f32], grads: Grads<'_>, m: &mut [f32], v: &mut [f32]) -> Result<()> {
    let n = params.len();
    let groups = Group::whole(n, 0.0, 0.0);
    check(n, &grads, &groups, None)?;
    for (what, len) in [("first moment buffer", m.len()), ("second moment buffer", v.len())] {
        if len != n {
            return Err(crate::OptimError::Length { what, got: len, expected: n });
        }
    }
    for_each_chunk(params, grads, &groups, [m, v], None, &Traffic);
    Ok(())
}
