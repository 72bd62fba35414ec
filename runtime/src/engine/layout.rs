//! Where every parameter lives in the flat buffer, and which part of it each rank owns. Pure arithmetic, no tensors.
use std::ops::Range;

/// One parameter's place in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSlot {
    pub name: String,
    pub shape: Vec<i64>,
    /// Element range in the flat buffer.
    pub range: Range<usize>,
    /// Whether the weight decay of the optimizer applies to this parameter.
    pub decay: bool,
}

/// Parameters concatenated in name order, right-padded to a multiple of the world size, split evenly.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatLayout {
    pub slots: Vec<ParamSlot>,
    /// Elements of real parameters.
    pub numel: usize,
    /// `numel` rounded up to a multiple of `world_size`.
    pub padded: usize,
    pub world_size: usize,
}

impl FlatLayout {
    /// `params`: (name, shape, decay) in the order they are laid out.
    pub fn new(params: &[(String, Vec<i64>, bool)], world_size: usize) -> Self {
        let mut offset = 0;
        let slots = params
            .iter()
            .map(|(name, shape, decay)| {
                let n: usize = shape.iter().map(|&d| d as usize).product();
                let slot = ParamSlot { name: name.clone(), shape: shape.clone(), range: offset..offset + n, decay: *decay };
                offset += n;
                slot
            })
            .collect();
        let padded = offset.div_ceil(world_size.max(1)) * world_size.max(1);
        FlatLayout { slots, numel: offset, padded, world_size }
    }

    /// Elements each rank owns.
    pub fn partition_len(&self) -> usize {
        self.padded / self.world_size
    }

    /// The flat range rank `r` owns.
    pub fn partition(&self, rank: usize) -> Range<usize> {
        let p = self.partition_len();
        rank * p..(rank + 1) * p
    }

    /// Weight-decay groups within `range`, as ranges relative to its start: runs of slots with the same `decay`
    /// (padding joins the run before it; it has zero gradients and stays zero).
    pub fn decay_runs(&self, range: Range<usize>) -> Vec<(Range<usize>, bool)> {
        let mut runs: Vec<(Range<usize>, bool)> = Vec::new();
        for slot in &self.slots {
            let (s, e) = (slot.range.start.max(range.start), slot.range.end.min(range.end));
            if s >= e {
                continue;
            }
            let r = (s - range.start)..(e - range.start);
            match runs.last_mut() {
                Some((last, d)) if *d == slot.decay && last.end == r.start => last.end = r.end,
                _ => runs.push((r, slot.decay)),
            }
        }
        let covered = runs.last().map_or(0, |(r, _)| r.end);
        let len = range.len();
        if covered < len {
            match runs.last_mut() {
                Some((last, _)) => last.end = len,
                None => runs.push((0..len, false)),
            }
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(ws: usize) -> FlatLayout {
        FlatLayout::new(&[("a.weight".into(), vec![2, 3], true), ("a.bias".into(), vec![3], false), ("b.weight".into(), vec![2, 2], true)], ws)
    }

    #[test]
    fn pads_to_a_multiple_of_the_world_size() {
        let l = layout(3);
        assert_eq!((l.numel, l.padded, l.partition_len()), (13, 15, 5));
        assert_eq!(l.partition(2), 10..15);
        assert_eq!(l.slots[1].range, 6..9);
        assert_eq!(layout(1).padded, 13);
    }

    #[test]
    fn decay_runs_cover_a_partition_exactly() {
        let l = layout(3);
        // Partition 1 is flat 5..10: a.weight[5], a.bias (no decay), b.weight[0].
        assert_eq!(l.decay_runs(l.partition(1)), vec![(0..1, true), (1..4, false), (4..5, true)]);
        // Partition 2 is flat 10..15: b.weight[1..4] and two padding elements.
        assert_eq!(l.decay_runs(l.partition(2)), vec![(0..5, true)]);
        for r in 0..3 {
            let runs = l.decay_runs(l.partition(r));
            assert_eq!(runs.first().unwrap().0.start, 0);
            assert_eq!(runs.last().unwrap().0.end, 5);
            assert!(runs.windows(2).all(|w| w[0].0.end == w[1].0.start));
        }
    }
}
