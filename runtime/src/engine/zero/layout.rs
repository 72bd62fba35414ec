//! Where every parameter lives in the flat buffer, and which part of it each rank owns. Pure arithmetic, no tensors.
use std::ops::Range;

/// One parameter's place in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSlot {
    /// The variable's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Element range in the flat buffer.
    pub range: Range<usize>,
    /// Whether the weight decay of the optimizer applies to this parameter.
    pub decay: bool,
}

/// The ranks a unit is split over.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum UnitRanks {
    /// Every rank of the layout.
    #[default]
    All,
    /// These ranks of the layout, ascending (a chunk each, in this order): a mixture-of-experts layer's experts of
    /// one expert-parallel position, split over the ranks that compute them (the expert-data-parallel group,
    /// DeepSpeed's). The other ranks hold none of the unit and never gather it.
    Group(Vec<usize>),
}

/// A unit of the layout: a run of slots padded to a multiple of the ranks it is split over, split evenly among
/// them.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitSpan {
    /// Padded flat range.
    pub range: Range<usize>,
    /// Indices of its slots.
    pub slots: Range<usize>,
    /// The ranks it is split over.
    pub ranks: UnitRanks,
}

impl UnitSpan {
    /// Ranks the unit is split over: the world size, or its group's.
    pub fn split(&self, world_size: usize) -> usize {
        match &self.ranks {
            UnitRanks::All => world_size,
            UnitRanks::Group(members) => members.len(),
        }
    }

    /// Elements of the unit each of its ranks owns.
    pub fn chunk_len(&self, world_size: usize) -> usize {
        self.range.len() / self.split(world_size)
    }

    /// Where rank `rank` of the layout is among the unit's ranks (None: it holds none of the unit).
    pub fn place_of(&self, rank: usize) -> Option<usize> {
        match &self.ranks {
            UnitRanks::All => Some(rank),
            UnitRanks::Group(members) => members.iter().position(|&m| m == rank),
        }
    }

    /// Whether rank `rank` of the layout holds a chunk of the unit.
    pub fn holds(&self, rank: usize) -> bool {
        self.place_of(rank).is_some()
    }

    /// Elements of the unit rank `rank` owns: its chunk's, or none.
    pub fn held_len(&self, rank: usize, world_size: usize) -> usize {
        if self.holds(rank) {
            self.chunk_len(world_size)
        } else {
            0
        }
    }

    /// The flat range of the unit rank `rank` of the layout owns (empty where it holds none).
    pub fn chunk(&self, rank: usize, world_size: usize) -> Range<usize> {
        let c = self.chunk_len(world_size);
        match self.place_of(rank) {
            Some(p) => self.range.start + p * c..self.range.start + (p + 1) * c,
            None => self.range.start..self.range.start,
        }
    }
}

/// Parameters concatenated in order in units, each unit right-padded to a multiple of the ranks it is split over
/// (the world size, or its group's) and split evenly. Stages 0-2 use one unit (the whole model); stage 3 one per
/// model unit, gathered one at a time. Every rank has the same layout; a unit split over a group is empty on the
/// other ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatLayout {
    /// Every parameter, in flat order.
    pub slots: Vec<ParamSlot>,
    /// The units.
    pub units: Vec<UnitSpan>,
    /// Elements of real parameters.
    pub numel: usize,
    /// Flat length: real elements plus every unit's padding.
    pub padded: usize,
    /// Ranks the units are split over.
    pub world_size: usize,
}

impl FlatLayout {
    /// One unit. `params`: (name, shape, decay) in the order they are laid out.
    pub fn new(params: &[(String, Vec<i64>, bool)], world_size: usize) -> Self {
        Self::with_units(&[params.to_vec()], world_size)
    }

    /// Units in order, each a list of (name, shape, decay), every one split over all ranks.
    pub fn with_units(units: &[Vec<(String, Vec<i64>, bool)>], world_size: usize) -> Self {
        Self::with_unit_ranks(units, &vec![UnitRanks::All; units.len()], world_size)
    }

    /// Units in order, each a list of (name, shape, decay), split over the ranks `ranks` gives (one per unit).
    pub fn with_unit_ranks(units: &[Vec<(String, Vec<i64>, bool)>], ranks: &[UnitRanks], world_size: usize) -> Self {
        assert_eq!(units.len(), ranks.len(), "the ranks of every unit");
        let ws = world_size.max(1);
        let (mut offset, mut numel) = (0, 0);
        let mut slots = Vec::new();
        let mut spans = Vec::new();
        for (unit, unit_ranks) in units.iter().zip(ranks) {
            let (start, first_slot) = (offset, slots.len());
            for (name, shape, decay) in unit {
                let n: usize = shape.iter().map(|&d| d as usize).product();
                slots.push(ParamSlot {
                    name: name.clone(),
                    shape: shape.clone(),
                    range: offset..offset + n,
                    decay: *decay,
                });
                offset += n;
                numel += n;
            }
            let split = match unit_ranks {
                UnitRanks::All => ws,
                UnitRanks::Group(members) => {
                    assert!(
                        !members.is_empty()
                            && members.windows(2).all(|w| w[0] < w[1])
                            && members[members.len() - 1] < ws,
                        "a unit's group: ascending ranks of the layout"
                    );
                    members.len()
                }
            };
            offset = start + (offset - start).div_ceil(split) * split;
            spans.push(UnitSpan { range: start..offset, slots: first_slot..slots.len(), ranks: unit_ranks.clone() });
        }
        FlatLayout { slots, units: spans, numel, padded: offset, world_size: ws }
    }

    /// Elements each rank owns where every unit is split over all ranks (stages 0-1 without groups): the flat length
    /// over the world size. With units split over groups, ranks own different lengths: [`shard_len`](Self::shard_len).
    pub fn partition_len(&self) -> usize {
        self.padded / self.world_size
    }

    /// Elements rank `rank` owns: its chunk of every unit it holds (the length of its shard space).
    pub fn shard_len(&self, rank: usize) -> usize {
        self.units.iter().map(|u| u.held_len(rank, self.world_size)).sum()
    }

    /// Stages 0-2: where each unit starts in rank `rank`'s buffer of full parameters, which lays the units it
    /// holds out one after another (None for a unit it does not hold). Every rank holds every unit but another
    /// expert-parallel position's experts (stages 1-2 with units split over groups), so without groups this is each
    /// unit's own flat start.
    pub fn resident_starts(&self, rank: usize) -> Vec<Option<usize>> {
        let mut at = 0;
        self.units
            .iter()
            .map(|u| {
                u.holds(rank).then(|| {
                    at += u.range.len();
                    at - u.range.len()
                })
            })
            .collect()
    }

    /// Elements of rank `rank`'s buffer of full parameters (stages 0-2): every unit it holds, padding included.
    pub fn resident_len(&self, rank: usize) -> usize {
        self.units.iter().filter(|u| u.holds(rank)).map(|u| u.range.len()).sum()
    }

    /// Where flat range `range`, inside unit `unit`, lies in rank `rank`'s buffer of full parameters, given
    /// [`resident_starts`](Self::resident_starts); None where the rank does not hold the unit.
    pub fn resident_range(&self, starts: &[Option<usize>], unit: usize, range: &Range<usize>) -> Option<Range<usize>> {
        let span = &self.units[unit];
        debug_assert!(span.range.start <= range.start && range.end <= span.range.end.max(range.start));
        starts[unit].map(|s| s + range.start - span.range.start..s + range.end - span.range.start)
    }

    /// Rank `rank`'s chunk of every unit (its [`shard_pieces`](Self::shard_pieces)) as ranges of its buffer of
    /// full parameters (stage 2's pieces, stepped in place); empty for the units it does not hold.
    pub fn resident_pieces(&self, rank: usize) -> Vec<Range<usize>> {
        let starts = self.resident_starts(rank);
        self.shard_pieces(rank)
            .iter()
            .enumerate()
            .map(|(i, piece)| self.resident_range(&starts, i, piece).unwrap_or(0..0))
            .collect()
    }

    /// Whether some unit is split over a group of ranks rather than all of them.
    pub fn has_groups(&self) -> bool {
        self.units.iter().any(|u| u.ranks != UnitRanks::All)
    }

    /// The flat range rank `r` owns, for a one-unit layout (stages 0-2).
    pub fn partition(&self, rank: usize) -> Range<usize> {
        debug_assert_eq!(self.units.len(), 1, "a layout of several units has no contiguous partition");
        let p = self.partition_len();
        rank * p..(rank + 1) * p
    }

    /// The flat ranges rank `r` owns, one per unit; concatenated they make its shard.
    pub fn shard_pieces(&self, rank: usize) -> Vec<Range<usize>> {
        self.units.iter().map(|u| u.chunk(rank, self.world_size)).collect()
    }

    /// Weight-decay groups of rank `r`'s shard, relative to the shard's start.
    pub fn shard_decay_runs(&self, rank: usize) -> Vec<(Range<usize>, bool)> {
        let mut offset = 0;
        let mut runs = Vec::new();
        for piece in self.shard_pieces(rank) {
            runs.extend(self.decay_runs(piece.clone()).into_iter().map(|(r, d)| (r.start + offset..r.end + offset, d)));
            offset += piece.len();
        }
        runs
    }

    /// The ranges of rank `r`'s shard (relative to its start) that hold slots `pick` chooses.
    pub fn shard_runs_where(&self, rank: usize, pick: &dyn Fn(&ParamSlot) -> bool) -> Vec<Range<usize>> {
        let mut offset = 0;
        let mut runs = Vec::new();
        for piece in self.shard_pieces(rank) {
            runs.extend(self.runs_where(piece.clone(), pick).into_iter().map(|r| r.start + offset..r.end + offset));
            offset += piece.len();
        }
        runs
    }

    /// The ranges within `range` (relative to its start) that hold slots `pick` chooses.
    pub fn runs_where(&self, range: Range<usize>, pick: &dyn Fn(&ParamSlot) -> bool) -> Vec<Range<usize>> {
        self.slots
            .iter()
            .filter(|slot| pick(slot))
            .filter_map(|slot| {
                let (s, e) = (slot.range.start.max(range.start), slot.range.end.min(range.end));
                (s < e).then(|| s - range.start..e - range.start)
            })
            .collect()
    }

    /// One group per slot within `range` (relative to its start), with its `decay`; padding joins the slot before
    /// it. What LAMB-type optimizers step with: their trust ratio is per tensor.
    pub fn slot_runs(&self, range: Range<usize>) -> Vec<(Range<usize>, bool)> {
        let mut runs: Vec<(Range<usize>, bool)> = Vec::new();
        for slot in &self.slots {
            let (s, e) = (slot.range.start.max(range.start), slot.range.end.min(range.end));
            if s >= e {
                continue;
            }
            if let Some((last, _)) = runs.last_mut() {
                last.end = s - range.start;
            }
            runs.push(((s - range.start)..(e - range.start), slot.decay));
        }
        match runs.last_mut() {
            Some((last, _)) => last.end = range.len(),
            None if !range.is_empty() => runs.push((0..range.len(), false)),
            None => {}
        }
        runs
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
        FlatLayout::new(
            &[
                ("a.weight".into(), vec![2, 3], true),
                ("a.bias".into(), vec![3], false),
                ("b.weight".into(), vec![2, 2], true),
            ],
            ws,
        )
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
    fn units_are_padded_one_by_one_and_shards_take_a_chunk_of_each() {
        let a = vec![("a.weight".to_string(), vec![2, 3], true), ("a.bias".to_string(), vec![3], false)];
        let b = vec![("b.weight".to_string(), vec![2, 2], true)];
        let l = FlatLayout::with_units(&[a, b], 2);
        // Unit a: 9 elements padded to 10; unit b: 4 elements at 10..14.
        assert_eq!(l.units.iter().map(|u| u.range.clone()).collect::<Vec<_>>(), vec![0..10, 10..14]);
        assert_eq!((l.numel, l.padded, l.partition_len()), (13, 14, 7));
        assert_eq!(l.slots[2].range, 10..14);
        assert_eq!(l.shard_pieces(1), vec![5..10, 12..14]);
        // Rank 1's shard: a.weight[5], a.bias + padding (no decay), then b.weight[2..4].
        assert_eq!(l.shard_decay_runs(1), vec![(0..1, true), (1..5, false), (5..7, true)]);
    }

    #[test]
    fn a_unit_split_over_a_group_is_empty_on_the_other_ranks() {
        let dense = vec![("embed".to_string(), vec![5], true)];
        let experts = vec![("experts.0.w".to_string(), vec![3], true)];
        let l = FlatLayout::with_unit_ranks(
            &[dense, experts.clone(), experts],
            &[UnitRanks::All, UnitRanks::Group(vec![0, 2]), UnitRanks::Group(vec![1, 3])],
            4,
        );
        // embed: 5 padded to 8 over 4 ranks; each experts unit: 3 padded to 4 over its 2 ranks.
        assert_eq!(l.units.iter().map(|u| u.range.clone()).collect::<Vec<_>>(), vec![0..8, 8..12, 12..16]);
        assert_eq!((l.units[1].chunk_len(4), l.units[1].split(4)), (2, 2));
        assert_eq!(l.shard_pieces(2), vec![4..6, 10..12, 12..12]);
        assert_eq!(l.shard_pieces(3), vec![6..8, 8..8, 14..16]);
        assert_eq!((l.shard_len(0), l.shard_len(3)), (4, 4));
        assert_eq!((l.units[2].holds(0), l.units[2].place_of(3)), (false, Some(1)));
        assert!(l.has_groups() && !layout(2).has_groups());
        // Rank 1's shard: embed[2..4], then the first chunk of the experts unit split over ranks 1 and 3.
        assert_eq!(l.shard_decay_runs(1), vec![(0..2, true), (2..4, true)]);
        // Rank 2's buffer of full parameters: embed, then the first experts unit only (8 + 4 elements).
        assert_eq!(l.resident_starts(2), vec![Some(0), Some(8), None]);
        assert_eq!(l.resident_starts(3), vec![Some(0), None, Some(8)]);
        assert_eq!((l.resident_len(2), l.resident_len(3)), (12, 12));
        assert_eq!(l.resident_pieces(2), vec![4..6, 10..12, 0..0]);
        assert_eq!(l.resident_pieces(3), vec![6..8, 0..0, 10..12]);
        // Without groups a rank's buffer is the flat layout itself.
        let whole = layout(3);
        assert_eq!((whole.resident_len(1), whole.resident_pieces(1)), (whole.padded, whole.shard_pieces(1)));
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
