//! Optimizer states on NVMe (ZeRO-Infinity's optimizer offload): the optimized range is cut into sub-groups of
//! `sub_group_size` elements, each with its own optimizer whose state buffers live in a swap file between steps.
//! A step reads sub-group k+1 (`pipeline_read`) and writes k-1 (`pipeline_write`) while k steps, with at most
//! `buffer_count` host buffers in use, so resident state is a few sub-groups whatever the model size.
use std::collections::VecDeque;
use std::ops::Range;
use std::path::Path;

use zerorun_optim::{AlignedVec, Grads, Group, Optimizer, ParamsOut};

use crate::optimizer_tier::{FillState, OptimizerTier, TierError};
use crate::{BufferPool, HostBuffer, IoConfig, OffloadError, SwapHandle, Swapper};

type Result<T> = std::result::Result<T, TierError>;

struct SubGroup {
    range: Range<usize>,
    optimizer: Box<dyn Optimizer>,
    /// The engine's groups restricted to this sub-group, relative to its start.
    groups: Vec<Group>,
}

/// An optimizer whose states live in swap files on NVMe, stepped sub-group by sub-group with reads ahead and writes behind (`offload_optimizer.device: nvme`).
pub struct SwappedOptimizer {
    name: &'static str,
    state_names: Vec<String>,
    subgroups: Vec<SubGroup>,
    swapper: Swapper,
    pool: BufferPool,
    step: u64,
    pipeline_read: bool,
    pipeline_write: bool,
    buffer_count: usize,
    /// State buffers lent to whichever sub-group steps, by sub-group length (at most two lengths: the full
    /// size and the last sub-group's), so a step allocates nothing.
    scratch: Vec<(usize, Vec<AlignedVec>)>,
    /// A step taken in pieces: the sub-groups' writes still in flight (with their bytes), which the next read of a
    /// sub-group waits for (the swapper orders a key's read after its write); `finish_step` waits for all.
    piece_writes: VecDeque<(SwapHandle<HostBuffer>, usize)>,
    /// A step in pieces going forward (a step unit by unit): the sub-group the last piece ended inside, still lent
    /// to its optimizer, so the next piece, which starts there, steps on without reading and writing it again.
    /// Packed and written when a piece starts elsewhere or the step ends.
    open: Option<usize>,
    /// The read started for the sub-group after `open`, where the next piece goes on.
    ahead: Option<(usize, SwapHandle<HostBuffer>)>,
    /// Where the last piece started: pieces in increasing order carry their last sub-group over (the optimizer
    /// in backward's go the other way).
    last_piece_start: Option<usize>,
    /// Sub-group reads started, for the tests.
    reads: std::cell::Cell<u64>,
}

fn key(k: usize) -> String {
    format!("optim{k}")
}

fn offload_err(e: OffloadError) -> TierError {
    TierError::Offload(e)
}

impl SwappedOptimizer {
    /// `build(len)` makes an optimizer for `len` elements (the config's). Writes every sub-group's initial state
    /// to `dir`, so each step is the same read-step-write pipeline.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        build: impl Fn(usize) -> Box<dyn Optimizer>,
        len: usize,
        sub_group_size: usize,
        dir: &Path,
        prefix: &str,
        io: IoConfig,
        buffer_count: usize,
        pipeline: (bool, bool),
    ) -> Result<SwappedOptimizer> {
        let size = sub_group_size.max(1);
        let probe = build(0);
        let name = probe.name();
        let state_names: Vec<String> = probe.state().buffers.iter().map(|(n, _)| n.clone()).collect();
        let bytes_per_element = 4 * state_names.len();
        let needed = len as u64 * bytes_per_element as u64;
        crate::preflight::check(dir, needed).map_err(offload_err)?;
        let swapper = Swapper::new(dir, prefix, io);
        let buffer_count = buffer_count.max(2);
        let largest = size.min(len.max(1)) * bytes_per_element;
        let mut s = SwappedOptimizer {
            name,
            state_names,
            subgroups: Vec::new(),
            swapper,
            pool: BufferPool::new(buffer_count * largest.div_ceil(crate::PAGE) * crate::PAGE),
            step: 0,
            pipeline_read: pipeline.0,
            pipeline_write: pipeline.1,
            buffer_count,
            scratch: Vec::new(),
            piece_writes: VecDeque::new(),
            open: None,
            ahead: None,
            last_piece_start: None,
            reads: std::cell::Cell::new(0),
        };
        // Every sub-group starts from the initial state of its length (at most two lengths): packed once per
        // length and written to each sub-group's file, so start-up holds one sub-group's state, not one per
        // sub-group freed into malloc's heap. The sub-groups' own optimizers hold empty states, lent scratch to step.
        let mut initial: Vec<(usize, HostBuffer)> = Vec::new();
        for start in (0..len.max(1)).step_by(size) {
            let range = start..(start + size).min(len);
            let n = range.len();
            let buf = match initial.iter().position(|(l, _)| *l == n) {
                Some(i) => initial.swap_remove(i).1,
                None => s.pack(build(n).as_mut(), n),
            };
            let buf =
                s.swapper.swap_out(&key(s.subgroups.len()), buf, n * bytes_per_element).wait().map_err(offload_err)?;
            initial.push((n, buf));
            s.subgroups.push(SubGroup { range, optimizer: build(0), groups: Vec::new() });
        }
        for (_, buf) in initial {
            s.pool.give_back(buf);
        }
        for g in &s.subgroups {
            if !s.scratch.iter().any(|(l, _)| *l == g.range.len()) {
                s.scratch.push((
                    g.range.len(),
                    s.state_names.iter().map(|_| AlignedVec::filled(g.range.len(), 0.0)).collect(),
                ));
            }
        }
        Ok(s)
    }

    fn pack(&self, optimizer: &mut dyn Optimizer, len: usize) -> HostBuffer {
        pack(&self.pool, optimizer, len)
    }

    fn read(&self, k: usize) -> SwapHandle<HostBuffer> {
        self.reads.set(self.reads.get() + 1);
        let bytes = self.subgroups[k].range.len() * 4 * self.state_names.len();
        self.swapper.swap_in(&key(k), self.pool.take(bytes))
    }

    /// Sub-group `k`'s state: the read started ahead for it, or a read started now (a read ahead for another one
    /// is let go).
    fn take_read(&mut self, k: usize) -> Result<SwapHandle<HostBuffer>> {
        match self.ahead.take() {
            Some((a, h)) if a == k => return Ok(h),
            Some((_, h)) => self.pool.give_back(h.wait().map_err(offload_err)?),
            None => {}
        }
        Ok(self.read(k))
    }

    /// Packs sub-group `k`'s state, lent to its optimizer, into a host buffer and takes the scratch back.
    fn unlend(&mut self, k: usize) -> HostBuffer {
        let sg = &mut self.subgroups[k];
        let len = sg.range.len();
        let scratch =
            &mut self.scratch.iter_mut().find(|(l, _)| *l == len).expect("a scratch set per sub-group length").1;
        let packed = pack(&self.pool, sg.optimizer.as_mut(), len);
        take_back(sg.optimizer.as_mut(), scratch);
        packed
    }

    /// Starts writing sub-group `k`'s packed state behind (bounded as the pieces' writes are).
    fn write_behind(&mut self, k: usize, packed: HostBuffer) -> Result<()> {
        let bytes = self.subgroups[k].range.len() * 4 * self.state_names.len();
        self.piece_writes.push_back((self.swapper.swap_out(&key(k), packed, bytes), bytes));
        self.finish_piece_writes(self.max_piece_writes())
    }

    /// Packs the sub-group still lent from the last piece and starts its write.
    fn close_open(&mut self) -> Result<()> {
        let Some(k) = self.open.take() else { return Ok(()) };
        let packed = self.unlend(k);
        self.write_behind(k, packed)
    }

    /// Ends a step in pieces: the sub-group left open written, the read ahead let go, every write waited for.
    fn settle(&mut self) -> Result<()> {
        self.close_open()?;
        if let Some((_, h)) = self.ahead.take() {
            self.pool.give_back(h.wait().map_err(offload_err)?);
        }
        self.last_piece_start = None;
        self.finish_piece_writes(0)
    }

    /// Writes a step keeps in flight: one buffer is being stepped and one read ahead, the rest may be writing.
    fn max_piece_writes(&self) -> usize {
        if self.pipeline_write {
            self.buffer_count.saturating_sub(2).max(1)
        } else {
            0
        }
    }

    /// Waits for the pieces' writes until at most `keep` are in flight.
    fn finish_piece_writes(&mut self, keep: usize) -> Result<()> {
        while self.piece_writes.len() > keep {
            let (w, _) = self.piece_writes.pop_front().expect("non-empty");
            self.pool.give_back(w.wait().map_err(offload_err)?);
        }
        Ok(())
    }
}

/// `groups` (relative to the whole range) cut to a sub-group's `range` and made relative to its start.
fn within(groups: &[Group], range: &Range<usize>) -> Vec<Group> {
    groups
        .iter()
        .filter_map(|x| {
            let (a, b) = (x.range.start.max(range.start), x.range.end.min(range.end));
            (a < b).then(|| Group { range: a - range.start..b - range.start, lr: x.lr, weight_decay: x.weight_decay })
        })
        .collect()
}

impl OptimizerTier for SwappedOptimizer {
    fn name(&self) -> &'static str {
        self.name
    }

    fn state_names(&self) -> Vec<String> {
        self.state_names.clone()
    }

    fn begin_step(&mut self) -> std::result::Result<(), TierError> {
        self.settle()?;
        self.step += 1;
        Ok(())
    }

    /// A piece of a step begun with `begin_step` (stage 3's optimizer in backward, or a step unit by unit with the
    /// parameters on NVMe): every sub-group `range` touches is read (the next one while this one steps), its part
    /// updated, and written back behind. Pieces in increasing order (a step unit by unit) leave the sub-group the
    /// piece ends inside lent to its optimizer, with the next one read ahead: the next piece starts there and
    /// steps on, so a sub-group that two pieces share is read and written once. In other orders (the optimizer in
    /// backward's) a shared sub-group is read twice, its state whole each time.
    fn update_range(
        &mut self,
        range: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        groups: &[Group],
        mut out: Option<ParamsOut<'_>>,
    ) -> std::result::Result<(), TierError> {
        if params.len() != range.len() || grads.len() != range.len() {
            let got = if params.len() != range.len() { params.len() } else { grads.len() };
            return Err(zerorun_optim::OptimError::Length {
                what: "a piece's values or gradients",
                got,
                expected: range.len(),
            }
            .into());
        }
        let first = self.subgroups.partition_point(|g| g.range.end <= range.start);
        let touched: Vec<usize> =
            (first..self.subgroups.len()).take_while(|&k| self.subgroups[k].range.start < range.end).collect();
        let forward = self.last_piece_start.map_or(true, |s| range.start >= s);
        self.last_piece_start = Some(range.start);
        if self.open.is_some() && (touched.first() != self.open.as_ref() || !forward) {
            self.close_open()?;
        }
        let mut next_read = match touched.first() {
            Some(&k) if self.open != Some(k) => Some(self.take_read(k)?),
            _ => None,
        };
        for (i, &k) in touched.iter().enumerate() {
            // The first sub-group may still be lent from the last piece; the others are read.
            let buf = match self.open.take() {
                Some(o) if o == k => None,
                _ => Some(next_read.take().expect("sub-group k was read").wait().map_err(offload_err)?),
            };
            if let Some(&after) = touched.get(i + 1) {
                next_read = Some(self.take_read(after)?);
            }
            let sg = &mut self.subgroups[k];
            let len = sg.range.len();
            let (a, b) = (sg.range.start.max(range.start), sg.range.end.min(range.end));
            let local = a - sg.range.start..b - sg.range.start;
            let piece = a - range.start..b - range.start;
            let sg_groups = within(groups, &sg.range);
            let scratch =
                &mut self.scratch.iter_mut().find(|(l, _)| *l == len).expect("a scratch set per sub-group length").1;
            if let Some(buf) = buf {
                lend(sg.optimizer.as_mut(), scratch, len, &buf, self.step);
                self.pool.give_back(buf);
            }
            let sub_out = out.as_mut().map(|o| match o {
                ParamsOut::Bf16(s) => ParamsOut::Bf16(&mut s[piece.clone()]),
                ParamsOut::F16(s) => ParamsOut::F16(&mut s[piece.clone()]),
            });
            let r = sg.optimizer.update_range(
                local,
                &mut params[piece.clone()],
                Grads::F32(&grads[piece]),
                &sg_groups,
                sub_out,
            );
            if r.is_ok() && forward && i + 1 == touched.len() && b < sg.range.end {
                // The piece ends inside this sub-group: kept lent for the next piece, the one after read ahead.
                self.open = Some(k);
                if k + 1 < self.subgroups.len() && self.ahead.is_none() {
                    let h = self.read(k + 1);
                    self.ahead = Some((k + 1, h));
                }
                return Ok(());
            }
            let packed = self.unlend(k);
            if let Err(e) = r {
                self.pool.give_back(packed);
                return Err(e.into());
            }
            self.write_behind(k, packed)?;
        }
        Ok(())
    }

    fn finish_step(&mut self) -> std::result::Result<(), TierError> {
        self.settle()
    }

    fn set_momentum(&mut self, momentum: f64) {
        for g in &mut self.subgroups {
            g.optimizer.set_momentum(momentum);
        }
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    /// Bytes of state on NVMe.
    fn swapped_bytes(&self) -> usize {
        self.subgroups.iter().map(|g| g.range.len() * 4 * self.state_names.len()).sum()
    }

    /// Every state lives on NVMe: what is in memory is staging.
    fn resident_bytes(&self) -> usize {
        0
    }

    /// The scratch a sub-group is stepped in and the idle swap buffers.
    fn buffer_bytes(&self) -> usize {
        let writing: usize = self.piece_writes.iter().map(|(_, b)| b.div_ceil(crate::PAGE) * crate::PAGE).sum();
        writing
            + self.pool.idle_bytes()
            + self.scratch.iter().flat_map(|(_, v)| v.iter()).map(|b| b.len() * 4).sum::<usize>()
    }

    /// One optimizer step over the whole range, sub-group by sub-group. `groups` are the engine's (relative to
    /// the range start).
    fn step(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        groups: &[Group],
        mut out: Option<ParamsOut<'_>>,
    ) -> std::result::Result<(), TierError> {
        self.settle()?;
        for g in &mut self.subgroups {
            g.groups = within(groups, &g.range);
        }
        let n = self.subgroups.len();
        let mut next_read = Some(self.read(0));
        let mut writes: VecDeque<SwapHandle<HostBuffer>> = VecDeque::new();
        let step = self.step;
        for k in 0..n {
            let buf = next_read.take().expect("sub-group k was read").wait().map_err(offload_err)?;
            if self.pipeline_read && k + 1 < n {
                next_read = Some(self.read(k + 1));
            }
            let sg = &mut self.subgroups[k];
            let range = sg.range.clone();
            let scratch = &mut self
                .scratch
                .iter_mut()
                .find(|(l, _)| *l == range.len())
                .expect("a scratch set per sub-group length")
                .1;
            lend(sg.optimizer.as_mut(), scratch, range.len(), &buf, step);
            self.pool.give_back(buf);
            let sub_out = out.as_mut().map(|o| match o {
                ParamsOut::Bf16(s) => ParamsOut::Bf16(&mut s[range.clone()]),
                ParamsOut::F16(s) => ParamsOut::F16(&mut s[range.clone()]),
            });
            let r =
                sg.optimizer.step(&mut params[range.clone()], Grads::F32(&grads[range.clone()]), &sg.groups, sub_out);
            let packed = pack(&self.pool, sg.optimizer.as_mut(), range.len());
            take_back(sg.optimizer.as_mut(), scratch);
            r?;
            writes.push_back(self.swapper.swap_out(&key(k), packed, range.len() * 4 * self.state_names.len()));
            while writes.len() > self.max_piece_writes() {
                let b = writes.pop_front().expect("non-empty").wait().map_err(offload_err)?;
                self.pool.give_back(b);
            }
            if !self.pipeline_read && k + 1 < n {
                next_read = Some(self.read(k + 1));
            }
        }
        for w in writes {
            let b = w.wait().map_err(offload_err)?;
            self.pool.give_back(b);
        }
        self.step += 1;
        Ok(())
    }

    /// Writes state buffer `index` of the whole range, reading one sub-group at a time.
    fn write_state(&mut self, index: usize, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        self.settle().map_err(|e| std::io::Error::other(e.to_string()))?;
        let names = self.state_names.len();
        for k in 0..self.subgroups.len() {
            let buf = self.read(k).wait().map_err(|e| std::io::Error::other(e.to_string()))?;
            let len = self.subgroups[k].range.len();
            let src: &[f32] = bytemuck::cast_slice(&buf.as_slice()[..len * 4 * names]);
            let r = w.write_all(bytemuck::cast_slice(&src[index * len..(index + 1) * len]));
            self.pool.give_back(buf);
            r?;
        }
        Ok(())
    }

    /// Replaces the state (checkpoint load): `fill` writes each sub-group's part into a host buffer, which goes to
    /// the sub-group's swap file before the next is filled.
    fn import_from(&mut self, step: u64, fill: &mut FillState<'_>) -> std::result::Result<(), TierError> {
        self.settle()?;
        let names = self.state_names.len();
        for k in 0..self.subgroups.len() {
            let r = self.subgroups[k].range.clone();
            let bytes = r.len() * 4 * names;
            let mut buf = self.pool.take(bytes);
            let filled = {
                let all: &mut [f32] = bytemuck::cast_slice_mut(&mut buf.as_mut_slice()[..bytes]);
                // Padding, which no checkpoint file holds, starts at zero like a fresh state.
                all.fill(0.0);
                let mut out: Vec<&mut [f32]> = all.chunks_mut(r.len().max(1)).collect();
                fill(r.clone(), &mut out)
            };
            if let Err(e) = filled {
                self.pool.give_back(buf);
                return Err(e);
            }
            let b = self.swapper.swap_out(&key(k), buf, bytes).wait().map_err(offload_err)?;
            self.pool.give_back(b);
        }
        self.step = step;
        Ok(())
    }
}

/// Copies an optimizer's state buffers into a host buffer from `pool`, for writing.
fn pack(pool: &BufferPool, optimizer: &mut dyn Optimizer, len: usize) -> HostBuffer {
    let names = optimizer.state().buffers.len();
    let mut buf = pool.take(len * 4 * names);
    let out: &mut [f32] = bytemuck::cast_slice_mut(&mut buf.as_mut_slice()[..len * 4 * names]);
    for (i, (_, b)) in optimizer.state().buffers.iter().enumerate() {
        out[i * len..(i + 1) * len].copy_from_slice(&b[..len]);
    }
    buf
}

/// Lends the scratch buffers (as long as the sub-group) to an optimizer, filled with the state read from disk,
/// with the step count of the run.
fn lend(optimizer: &mut dyn Optimizer, scratch: &mut [AlignedVec], len: usize, buf: &HostBuffer, step: u64) {
    let st = optimizer.state_mut();
    let names = st.buffers.len();
    let src: &[f32] = bytemuck::cast_slice(&buf.as_slice()[..len * 4 * names]);
    st.step = step;
    for (i, ((_, b), s)) in st.buffers.iter_mut().zip(scratch.iter_mut()).enumerate() {
        std::mem::swap(b, s);
        b.copy_from_slice(&src[i * len..(i + 1) * len]);
    }
}

/// Takes the scratch buffers back after a step (the optimizer is left with empty ones).
fn take_back(optimizer: &mut dyn Optimizer, scratch: &mut [AlignedVec]) {
    for ((_, b), s) in optimizer.state_mut().buffers.iter_mut().zip(scratch.iter_mut()) {
        std::mem::swap(b, s);
    }
}

#[cfg(test)]
mod tests {
    use crate::IoConfig;
    use zerorun_optim::{Adam, AdamConfig, Grads, Group, Optimizer, ParamsOut};

    use super::SwappedOptimizer;
    use crate::OptimizerTier;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0).collect()
    }

    /// The reference both tests compare with: one Adam in memory over `n` elements after three steps of
    /// `values(n, 10 + s)`, its values and 16-bit output.
    fn three_steps_in_memory(n: usize, groups: &[Group]) -> (Adam, Vec<f32>, Vec<half::bf16>) {
        let mut reference = Adam::new(AdamConfig::default(), n);
        let mut expected = values(n, 1);
        let mut expected_out = vec![half::bf16::ZERO; n];
        for s in 0..3 {
            let out = ParamsOut::Bf16(&mut expected_out);
            reference.step(&mut expected, Grads::F32(&values(n, 10 + s)), groups, Some(out)).unwrap();
        }
        (reference, expected, expected_out)
    }

    /// Sub-groups on disk step exactly as one optimizer in memory: every sub-group size (one sub-group, several,
    /// a ragged last one), with and without pipelining, groups that straddle sub-groups, a 16-bit output, and
    /// the state read back for a checkpoint.
    #[test]
    fn swapped_sub_groups_step_bitwise_like_one_optimizer_in_memory() {
        let n = 1000;
        let groups = [
            Group { range: 0..300, lr: 1e-2, weight_decay: 0.1 },
            Group { range: 300..n, lr: 3e-3, weight_decay: 0.0 },
        ];
        let dir = std::env::temp_dir().join(format!("zerorun-swapped-optimizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let io = IoConfig { block_size: 1 << 20, queue_depth: 8, intra_op_parallelism: 1 };
        let build = |len: usize| -> Box<dyn Optimizer> { Box::new(Adam::new(AdamConfig::default(), len)) };
        let (reference, expected, expected_out) = three_steps_in_memory(n, &groups);
        for (k, (sub_group, pipeline)) in
            [(n, (false, false)), (256, (false, false)), (256, (true, true)), (333, (true, false))]
                .into_iter()
                .enumerate()
        {
            let prefix = format!("case{k}");
            let mut swapped = SwappedOptimizer::new(build, n, sub_group, &dir, &prefix, io, 4, pipeline).unwrap();
            let mut params = values(n, 1);
            let mut out = vec![half::bf16::ZERO; n];
            for s in 0..3 {
                swapped.step(&mut params, &values(n, 10 + s), &groups, Some(ParamsOut::Bf16(&mut out))).unwrap();
            }
            assert_eq!(params, expected, "sub-groups of {sub_group}, pipeline {pipeline:?}");
            assert_eq!(out, expected_out);
            assert_eq!(swapped.step_count(), 3);
            assert_eq!(swapped.swapped_bytes(), n * 4 * 2);
            for (i, (name, state)) in reference.state().buffers.iter().enumerate() {
                let mut bytes = Vec::new();
                swapped.write_state(i, &mut bytes).unwrap();
                assert_eq!(bytes, bytemuck::cast_slice::<f32, u8>(state), "state {name}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A step taken in pieces (begin_step, update_range per piece, finish_step) gives bitwise the whole step's
    /// values, states and 16-bit output: pieces inside one sub-group, straddling several, in backward's order (last
    /// piece first) and in increasing order (a step unit by unit), where each sub-group is read once a step (the
    /// one a piece ends inside carried over to the next piece).
    #[test]
    fn a_step_in_pieces_over_swapped_sub_groups_equals_the_whole_step() {
        let n = 1000;
        let groups = [
            Group { range: 0..450, lr: 1e-2, weight_decay: 0.1 },
            Group { range: 450..n, lr: 3e-3, weight_decay: 0.0 },
        ];
        let dir = std::env::temp_dir().join(format!("zerorun-swapped-pieces-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let io = IoConfig { block_size: 1 << 20, queue_depth: 8, intra_op_parallelism: 1 };
        let build = |len: usize| -> Box<dyn Optimizer> { Box::new(Adam::new(AdamConfig::default(), len)) };
        let (reference, expected, expected_out) = three_steps_in_memory(n, &groups);
        let pieces = [0..90, 90..100, 100..610, 610..611, 611..n];
        for (case, (sub_group, pipeline)) in
            [(256, (true, true)), (128, (false, false)), (n, (true, true))].into_iter().enumerate()
        {
            let prefix = format!("pieces{case}");
            let mut swapped = SwappedOptimizer::new(build, n, sub_group, &dir, &prefix, io, 4, pipeline).unwrap();
            let mut params = values(n, 1);
            let mut out = vec![half::bf16::ZERO; n];
            for s in 0..3 {
                let grads = values(n, 10 + s);
                swapped.begin_step().unwrap();
                let reads = swapped.reads.get();
                // Steps 1 and 3 in increasing order, step 2 in backward's.
                let order: Vec<&std::ops::Range<usize>> =
                    if s == 1 { pieces.iter().rev().collect() } else { pieces.iter().collect() };
                for r in order {
                    let o = ParamsOut::Bf16(&mut out[r.clone()]);
                    swapped
                        .update_range(r.clone(), &mut params[r.clone()], &grads[r.clone()], &groups, Some(o))
                        .unwrap();
                }
                swapped.finish_step().unwrap();
                if s != 1 {
                    assert_eq!(swapped.reads.get() - reads, n.div_ceil(sub_group) as u64, "sub-groups of {sub_group}");
                }
            }
            assert_eq!(params, expected, "sub-groups of {sub_group}");
            assert_eq!(out, expected_out);
            assert_eq!(swapped.step_count(), 3);
            for (i, (name, state)) in reference.state().buffers.iter().enumerate() {
                let mut bytes = Vec::new();
                swapped.write_state(i, &mut bytes).unwrap();
                assert_eq!(bytes, bytemuck::cast_slice::<f32, u8>(state), "state {name}, sub-groups of {sub_group}");
            }
            let e = swapped.update_range(0..10, &mut params[..9], &values(10, 0), &groups, None).unwrap_err();
            assert_eq!(e.to_string(), "a piece's values or gradients has 9 elements, expected 10");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
