//! The inputs of a step: gradients in any of the three float dtypes, parameter groups, the 16-bit output copy.
use std::ops::Range;

use half::{bf16, f16};

use crate::{OptimError, Result};

/// Gradients of a shard, in the dtype the engine reduced them in.
#[derive(Clone, Copy)]
pub enum Grads<'a> {
    /// fp32 gradients.
    F32(&'a [f32]),
    /// bf16 gradients.
    Bf16(&'a [bf16]),
    /// fp16 gradients.
    F16(&'a [f16]),
    /// fp32 gradients multiplied by a factor as they are read (clipping's coefficient): each element is `g * factor`
    /// rounded once, bitwise what scaling them in place first gives, without a pass over them before the step.
    Scaled(&'a [f32], f32),
}

/// Where updated parameters are copied in 16 bits (the model's weights under mixed precision).
pub enum ParamsOut<'a> {
    /// bf16 weights.
    Bf16(&'a mut [bf16]),
    /// fp16 weights.
    F16(&'a mut [f16]),
}

/// A parameter group: an element range of the shard and its hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// The group's elements in the shard.
    pub range: Range<usize>,
    /// Hyper-parameters are f64, as torch's Python floats: derived constants are computed in f64 and rounded once.
    pub lr: f64,
    /// Weight decay (decoupled for AdamW).
    pub weight_decay: f64,
}

impl Group {
    /// One group over a whole shard.
    pub fn whole(len: usize, lr: f64, weight_decay: f64) -> Vec<Group> {
        vec![Group { range: 0..len, lr, weight_decay }]
    }
}

impl Grads<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Grads::F32(g) | Grads::Scaled(g, _) => g.len(),
            Grads::Bf16(g) => g.len(),
            Grads::F16(g) => g.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per element, for bandwidth accounting.
    pub fn elem_bytes(&self) -> usize {
        match self {
            Grads::F32(_) | Grads::Scaled(..) => 4,
            _ => 2,
        }
    }

    /// Writes elements `range` as f32 into `dst` (len = range.len()).
    #[inline]
    pub fn load(&self, range: Range<usize>, dst: &mut [f32]) {
        match self {
            Grads::F32(g) => dst.copy_from_slice(&g[range]),
            Grads::Bf16(g) => {
                for (d, s) in dst.iter_mut().zip(&g[range]) {
                    *d = f32::from_bits((s.to_bits() as u32) << 16);
                }
            }
            Grads::F16(g) => half::slice::HalfFloatSliceExt::convert_to_f32_slice(&g[range], dst),
            Grads::Scaled(g, factor) => {
                for (d, s) in dst.iter_mut().zip(&g[range]) {
                    *d = s * factor;
                }
            }
        }
    }
}

impl ParamsOut<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            ParamsOut::Bf16(o) => o.len(),
            ParamsOut::F16(o) => o.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rounds `src` (this output's length) into it: the 16-bit copy of fp32 values.
    pub fn store(&mut self, src: &[f32]) {
        match self {
            ParamsOut::Bf16(o) => half::slice::HalfFloatSliceExt::convert_from_f32_slice(&mut **o, src),
            ParamsOut::F16(o) => half::slice::HalfFloatSliceExt::convert_from_f32_slice(&mut **o, src),
        }
    }
}

/// `groups` (relative to the whole shard) cut to elements `range` and made relative to it; groups outside it are
/// left out. What a step over part of the shard (`Optimizer::update_range`) runs its kernel with.
pub(crate) fn groups_within(groups: &[Group], range: &Range<usize>) -> Vec<Group> {
    groups
        .iter()
        .filter_map(|g| {
            let (start, end) = (g.range.start.max(range.start), g.range.end.min(range.end));
            (start < end).then(|| Group { range: start - range.start..end - range.start, ..g.clone() })
        })
        .collect()
}

/// Checks a step over elements `range` of a shard of `shard_len` elements (None: a state without buffers, which
/// does not know it): the inputs are the range's, the groups the whole shard's. Returns the groups cut to the range
/// ([`groups_within`]).
pub(crate) fn check_range(
    shard_len: Option<usize>,
    range: &Range<usize>,
    params: usize,
    grads: &Grads<'_>,
    groups: &[Group],
    out: Option<&ParamsOut<'_>>,
) -> Result<Vec<Group>> {
    let len = shard_len.unwrap_or(usize::MAX);
    if range.start > range.end || range.end > len {
        return Err(OptimError::GroupRange { index: 0, start: range.start, end: range.end, len });
    }
    if params != range.len() {
        return Err(OptimError::Length { what: "parameters of the range", got: params, expected: range.len() });
    }
    for (index, g) in groups.iter().enumerate() {
        if g.range.start > g.range.end || g.range.end > len {
            return Err(OptimError::GroupRange { index, start: g.range.start, end: g.range.end, len });
        }
    }
    let cut = groups_within(groups, range);
    check(params, grads, &cut, out)?;
    Ok(cut)
}

/// Checks the lengths of a step's inputs against the shard.
pub(crate) fn check(params: usize, grads: &Grads<'_>, groups: &[Group], out: Option<&ParamsOut<'_>>) -> Result<()> {
    if grads.len() != params {
        return Err(OptimError::Length { what: "gradient shard", got: grads.len(), expected: params });
    }
    if let Some(out) = out {
        if out.len() != params {
            return Err(OptimError::Length { what: "16-bit parameter copy", got: out.len(), expected: params });
        }
    }
    for (index, g) in groups.iter().enumerate() {
        if g.range.start > g.range.end || g.range.end > params {
            return Err(OptimError::GroupRange { index, start: g.range.start, end: g.range.end, len: params });
        }
    }
    // Tiles of different groups run in parallel on the same buffers: groups must not overlap.
    let mut order: Vec<&Group> = groups.iter().collect();
    order.sort_by_key(|g| g.range.start);
    for pair in order.windows(2) {
        if pair[1].range.start < pair[0].range.end {
            return Err(OptimError::GroupOverlap { first: pair[0].range.clone(), second: pair[1].range.clone() });
        }
    }
    Ok(())
}
