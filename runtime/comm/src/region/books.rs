//! The region's bookkeeping, pure and without memory: which offsets are free ([`FreeList`]) and which freed
//! blocks are kept for reuse ([`Kept`], within a [`KeepBound`]). The region maps the memory and takes one lock
//! around both.
use std::collections::{BTreeMap, HashMap};

/// How many freed large blocks are kept for reuse, beside the large blocks live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeepBound {
    /// Live and kept together never exceed the most that were live at once: keeping never raises that peak.
    Peak,
    /// They may exceed that peak by the largest block: a step whose mix of live sizes changes (a unit's gradient
    /// beside the next unit in backward, activations in forward) evicts at its peak, within the peak alone, the
    /// blocks it needs next and maps them afresh every step; one block of headroom keeps them.
    #[default]
    PeakAndLargest,
}

/// Page-granular best-fit allocator over `0..capacity`: pure bookkeeping, no memory.
#[derive(Debug, Default)]
pub(crate) struct FreeList {
    /// Free blocks below `top`, by start offset.
    free: BTreeMap<usize, usize>,
    /// Everything from `top` up is free.
    top: usize,
    capacity: usize,
}

impl FreeList {
    pub fn new(capacity: usize) -> FreeList {
        FreeList { free: BTreeMap::new(), top: 0, capacity }
    }

    /// The offset of a free block of `len` bytes (a multiple of the page): the smallest free block that fits,
    /// else the top.
    pub fn alloc(&mut self, len: usize) -> Option<usize> {
        let best = self.free.iter().filter(|(_, &l)| l >= len).min_by_key(|(_, &l)| l).map(|(&s, &l)| (s, l));
        if let Some((start, l)) = best {
            self.free.remove(&start);
            if l > len {
                self.free.insert(start + len, l - len);
            }
            return Some(start);
        }
        (self.top + len <= self.capacity).then(|| {
            self.top += len;
            self.top - len
        })
    }

    /// Returns a block, merging it with free neighbours (and the top).
    pub fn release(&mut self, mut start: usize, mut len: usize) {
        if let Some((&s, &l)) = self.free.range(..start).next_back() {
            if s + l == start {
                self.free.remove(&s);
                start = s;
                len += l;
            }
        }
        if let Some(&l) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += l;
        }
        if start + len == self.top {
            self.top = start;
        } else {
            self.free.insert(start, len);
        }
    }

    /// Bytes in use.
    pub fn used(&self) -> usize {
        self.top - self.free.values().sum::<usize>()
    }
}

/// Freed blocks kept for reuse by size: pure bookkeeping, like [`FreeList`]. A block is kept only if it was
/// handed out while keeping was on ([`Kept::born`]), so the large blocks live and kept are both known; an
/// allocation that finds no kept block of its size gives back the oldest until the live and kept ones, with it,
/// are no more than the most that were live at once ([`KeepBound::Peak`]), or that plus the largest block.
#[derive(Debug, Default)]
pub(crate) struct Kept {
    /// Blocks from this many bytes up are kept (0: none).
    from: usize,
    bound: KeepBound,
    /// The largest block handed out since the kept blocks were last released.
    largest: usize,
    /// Kept blocks (offset, length), oldest first.
    blocks: Vec<(usize, usize)>,
    bytes: usize,
    /// Live blocks handed out while keeping was on, by offset.
    live: HashMap<usize, usize>,
    live_bytes: usize,
    peak: usize,
}

/// What [`Kept::take`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Taken {
    /// A kept block of the size, at this offset.
    Reused(usize),
    /// None of the size: allocate afresh, after releasing these kept blocks (offset, length).
    Fresh(Vec<(usize, usize)>),
}

impl Kept {
    /// Bytes kept.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether blocks of `len` bytes are kept.
    pub fn keeps(&self, len: usize) -> bool {
        self.from != 0 && len >= self.from
    }

    /// A kept block of `len` bytes (the most recently kept), or the kept blocks to release before allocating one.
    pub fn take(&mut self, len: usize) -> Taken {
        if let Some(i) = self.blocks.iter().rposition(|&(_, l)| l == len) {
            self.bytes -= len;
            return Taken::Reused(self.blocks.remove(i).0);
        }
        let after = self.live_bytes + len;
        let headroom = match self.bound {
            KeepBound::Peak => 0,
            KeepBound::PeakAndLargest => self.largest.max(len),
        };
        let bound = self.peak.max(after) + headroom;
        let mut n = 0;
        while n < self.blocks.len() && after + self.bytes > bound {
            self.bytes -= self.blocks[n].1;
            n += 1;
        }
        Taken::Fresh(self.blocks.drain(..n).collect())
    }

    /// A block of `len` bytes at `at` handed out.
    pub fn born(&mut self, at: usize, len: usize) {
        self.live.insert(at, len);
        self.live_bytes += len;
        self.peak = self.peak.max(self.live_bytes);
        self.largest = self.largest.max(len);
    }

    /// The block at `at` freed: true when it is kept (else the caller releases it).
    pub fn freed(&mut self, at: usize) -> bool {
        let Some(len) = self.live.remove(&at) else { return false };
        self.live_bytes -= len;
        if self.from == 0 {
            return false;
        }
        self.blocks.push((at, len));
        self.bytes += len;
        true
    }

    /// Keeps blocks from `from` bytes up (0: none) within `bound`; returns the kept blocks to release when keeping
    /// stops.
    pub fn set(&mut self, from: usize, bound: KeepBound) -> Vec<(usize, usize)> {
        self.from = from;
        self.bound = bound;
        if from == 0 {
            self.drain()
        } else {
            Vec::new()
        }
    }

    /// Every kept block, to release. The peak and the largest block count again from the blocks live now
    /// (start-up's one-off blocks no longer widen the bound).
    pub fn drain(&mut self) -> Vec<(usize, usize)> {
        self.bytes = 0;
        self.peak = self.live_bytes;
        self.largest = 0;
        std::mem::take(&mut self.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::super::PAGE;
    use super::*;

    #[test]
    fn blocks_are_reused_and_merged() {
        let mut f = FreeList::new(10 * PAGE);
        let a = f.alloc(2 * PAGE).unwrap();
        let b = f.alloc(3 * PAGE).unwrap();
        let c = f.alloc(PAGE).unwrap();
        assert_eq!((a, b, c), (0, 2 * PAGE, 5 * PAGE));
        assert_eq!(f.alloc(5 * PAGE), None, "only 4 pages left");
        f.release(a, 2 * PAGE);
        // The smallest block that fits: the freed 2 pages for 1 page, the rest stays free.
        assert_eq!(f.alloc(PAGE), Some(0));
        f.release(0, PAGE);
        f.release(b, 3 * PAGE);
        // 0..5 pages merged into one block.
        assert_eq!(f.alloc(5 * PAGE), Some(0));
        f.release(0, 5 * PAGE);
        f.release(c, PAGE);
        // Everything merged back into the top.
        assert_eq!((f.used(), f.top), (0, 0));
    }

    #[test]
    fn kept_blocks_stay_within_the_live_peak() {
        let mut k = Kept::default();
        k.set(4 * PAGE, KeepBound::Peak);
        assert!(!k.keeps(2 * PAGE) && k.keeps(4 * PAGE));
        // Two 8-page blocks live at once, both freed and kept.
        assert_eq!(k.take(8 * PAGE), Taken::Fresh(vec![]));
        k.born(0, 8 * PAGE);
        assert_eq!(k.take(8 * PAGE), Taken::Fresh(vec![]));
        k.born(8 * PAGE, 8 * PAGE);
        assert!(k.freed(0) && k.freed(8 * PAGE));
        assert!(!k.freed(99 * PAGE), "a block handed out before keeping is not kept");
        // The most recently kept block of the size comes back.
        assert_eq!(k.take(8 * PAGE), Taken::Reused(8 * PAGE));
        k.born(8 * PAGE, 8 * PAGE);
        // 12 pages: none of the size; 8 live + 12 + 8 kept would exceed the 16 live at once, so the kept block goes.
        assert_eq!(k.take(12 * PAGE), Taken::Fresh(vec![(0, 8 * PAGE)]));
        k.born(16 * PAGE, 12 * PAGE);
        assert!(k.freed(8 * PAGE) && k.freed(16 * PAGE));
        assert_eq!(k.bytes, 20 * PAGE);
        // 4 pages beside 20 kept is over the peak of 20 live: the oldest kept block (8 pages) goes, 12 stay.
        assert_eq!(k.take(4 * PAGE), Taken::Fresh(vec![(8 * PAGE, 8 * PAGE)]));
        assert_eq!(k.bytes, 12 * PAGE);
        assert_eq!(k.set(0, KeepBound::Peak), vec![(16 * PAGE, 12 * PAGE)], "keeping off releases what is kept");
    }

    /// A cycle whose live mix changes: two 8-page blocks live at once, then a 4-page one. Within the peak alone the
    /// 4-page block evicts an 8-page one, which the next cycle maps afresh (two blocks a cycle); with the largest
    /// block's headroom every later cycle reuses, and live and kept stay within the peak plus that block.
    #[test]
    fn headroom_of_the_largest_block_keeps_a_changing_mix() {
        for (bound, fresh_after_the_first) in [(KeepBound::Peak, 4), (KeepBound::PeakAndLargest, 0)] {
            let mut k = Kept::default();
            k.set(4 * PAGE, bound);
            let (mut fresh, mut next_at) = (0, 0);
            for cycle in 0..3 {
                let mut take = |k: &mut Kept, len: usize| {
                    let at = match k.take(len) {
                        Taken::Reused(at) => at,
                        Taken::Fresh(_) => {
                            fresh += usize::from(cycle > 0);
                            next_at += len;
                            next_at - len
                        }
                    };
                    k.born(at, len);
                    at
                };
                let (a, b) = (take(&mut k, 8 * PAGE), take(&mut k, 8 * PAGE));
                assert!(k.freed(a) && k.freed(b));
                let c = take(&mut k, 4 * PAGE);
                assert!(k.live_bytes + k.bytes <= 16 * PAGE + if bound == KeepBound::Peak { 0 } else { 8 * PAGE });
                assert!(k.freed(c));
            }
            assert_eq!(fresh, fresh_after_the_first, "{bound:?}: blocks mapped afresh after the first cycle");
        }
        // Releasing the kept blocks starts the peak and the largest block over from what is live.
        let mut k = Kept::default();
        k.set(4 * PAGE, KeepBound::PeakAndLargest);
        let _ = k.take(8 * PAGE);
        k.born(0, 8 * PAGE);
        assert!(k.freed(0));
        assert_eq!(k.drain(), vec![(0, 8 * PAGE)]);
        assert_eq!((k.peak, k.largest), (0, 0));
    }
}
