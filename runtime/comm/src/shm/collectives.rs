//! The collectives over the segment: direct (each rank reads its peers' buffers, through their mapped regions or
//! `process_vm_readv`) or staged (through the segment's slots, in chunks, when some rank cannot read another).
use super::super::agreement;
use super::super::buffer::{combine_pair, combine_pair_in_place, divide, fold_into};
use super::super::{reduce_into, BufMut, BufRef, CommResult, Dtype, ReduceOp};
use super::segment::SLOT_BYTES;
use super::ShmComm;

/// Bytes reduced at a time in the direct path (256 KiB: the chunk and its scratch stay in L2).
const REDUCE_CHUNK: usize = 256 * 1024;

/// Copies a finished chunk (at byte `offset` of the reduced range) to the same place in each of `push`.
fn push_chunk(push: &[*mut u8], offset: usize, chunk: &[u8]) {
    for &p in push {
        // SAFETY: each destination holds the whole range (reduce_direct's contract).
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), p.add(offset), chunk.len()) };
    }
}

impl ShmComm {
    /// Combines, in rank order, bytes `range` (whole `dtype` elements) of every rank's buffer (`local` is this
    /// rank's) into `dst` (`range.len()` bytes; it may be `local`'s own `range`: each chunk of `local` is read
    /// before that chunk of `dst` is written).
    /// Each finished chunk is also copied to every pointer of `push` (each `range.len()` bytes, not overlapping).
    #[allow(clippy::too_many_arguments)]
    fn reduce_direct(
        &self,
        op: &'static str,
        range: std::ops::Range<usize>,
        local: *const u8,
        dst: *mut u8,
        push: &[*mut u8],
        dtype: Dtype,
        how: ReduceOp,
    ) -> CommResult<()> {
        let mut scratch = self.scratch.borrow_mut();
        if scratch.len() < 2 * REDUCE_CHUNK / 8 {
            scratch.resize(2 * REDUCE_CHUNK / 8, 0);
        }
        let (acc, tmp) = bytemuck::cast_slice_mut::<u64, u8>(&mut scratch).split_at_mut(REDUCE_CHUNK);
        let n = self.seg.world_size;
        for a in (range.start..range.end).step_by(REDUCE_CHUNK) {
            let b = (a + REDUCE_CHUNK).min(range.end);
            // SAFETY: `local` holds at least range.end bytes and `dst` range.len(); the chunk of `local` is read
            // before the same chunk of `dst` is written.
            let (mine, out) = unsafe { (local.add(a), dst.add(a - range.start)) };
            if n == 2 {
                // Two ranks: the peer's chunk from its mapped region (else landed in `tmp`) and one fused pass, in
                // rank order.
                let peer = 1 - self.seg.rank;
                let theirs = match self.peers.bytes(&self.seg, peer, a, b - a) {
                    Some(mapped) => mapped.as_ptr(),
                    None => {
                        self.peers.read(&self.seg, op, peer, a, &mut tmp[..b - a])?;
                        tmp.as_ptr()
                    }
                };
                // SAFETY: chunks of `local`, `dst` and the peer's bytes (mapped or landed in `tmp`), `b - a` long;
                // `dst` either is `local`'s chunk (all-reduce) or overlaps neither.
                let theirs = unsafe { std::slice::from_raw_parts(theirs, b - a) };
                let out_chunk = unsafe { std::slice::from_raw_parts_mut(out, b - a) };
                if std::ptr::eq(out as *const u8, mine) {
                    combine_pair_in_place(dtype, out_chunk, theirs, self.seg.rank == 1, how, n);
                } else {
                    let mine = unsafe { std::slice::from_raw_parts(mine, b - a) };
                    let (first, second) = if self.seg.rank == 0 { (mine, theirs) } else { (theirs, mine) };
                    combine_pair(dtype, out_chunk, first, second, how, n);
                }
                push_chunk(push, a - range.start, out_chunk);
                continue;
            }
            // Only one peer's chunk fits the landing buffer at a time: fold as we go, in rank order.
            for k in 0..n {
                let part: &[u8] = if k == self.seg.rank {
                    unsafe { std::slice::from_raw_parts(mine, b - a) }
                } else if let Some(mapped) = self.peers.bytes(&self.seg, k, a, b - a) {
                    mapped
                } else {
                    self.peers.read(&self.seg, op, k, a, &mut tmp[..b - a])?;
                    &tmp[..b - a]
                };
                if k == 0 {
                    acc[..b - a].copy_from_slice(part);
                } else {
                    fold_into(dtype, &mut acc[..b - a], part, how);
                }
            }
            if how == ReduceOp::Avg {
                divide(dtype, &mut acc[..b - a], n);
            }
            unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), out, b - a) };
            push_chunk(push, a - range.start, &acc[..b - a]);
        }
        Ok(())
    }

    pub(super) fn all_reduce_buf_impl(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        const OP: &str = "all_reduce";
        let (dtype, es, len) = (buf.dtype, buf.dtype.size(), buf.len());
        let bytes = buf.bytes;
        self.seg.handshake(OP, len, dtype, bytes.as_ptr())?;
        let n = self.seg.world_size;
        let segment_of = |k: usize| (len * k / n * es)..(len * (k + 1) / n * es);
        if self.peers.direct() {
            // Reduce-scatter: rank r combines segment r of every buffer into its own (peers read only other
            // segments of ours meanwhile); then all-gather: read every other segment from its owner.
            let mine = segment_of(self.seg.rank);
            let base = bytes.as_mut_ptr();
            // When every rank's buffer is in its shared region, each rank also writes its reduced segment into
            // every peer's buffer (no rank then reads what a peer has just written, which costs a cross-core
            // transfer of dirty lines) and one barrier ends the collective.
            let push: Option<Vec<*mut u8>> = self.peers.all_buffers_shared(&self.seg, bytes.len()).then(|| {
                (0..n)
                    .filter(|&k| k != self.seg.rank)
                    .map(|k| {
                        self.peers
                            .ptr(&self.seg, k, mine.start, mine.len())
                            .expect("checked: the peer's buffer is mapped")
                    })
                    .collect()
            });
            // SAFETY: our own segment of our own buffer; the pushed-to ranges are this segment of the peers'
            // buffers, which their owners neither read nor write during the collective.
            self.reduce_direct(
                OP,
                mine.clone(),
                base,
                unsafe { base.add(mine.start) },
                push.as_deref().unwrap_or(&[]),
                dtype,
                op,
            )?;
            if push.is_some() {
                return self.seg.barrier(OP);
            }
            self.seg.barrier(OP)?;
            for k in (0..n).filter(|&k| k != self.seg.rank) {
                let s = segment_of(k);
                self.peers.read(&self.seg, OP, k, s.start, &mut bytes[s])?;
            }
            return self.seg.barrier(OP);
        }
        let chunk_elems = SLOT_BYTES / es;
        for start in (0..len).step_by(chunk_elems.max(1)) {
            let l = chunk_elems.min(len - start);
            let chunk = &mut bytes[start * es..(start + l) * es];
            self.seg.slot(self.seg.rank)[..chunk.len()].copy_from_slice(chunk);
            self.seg.barrier(OP)?;
            // Rank r reduces segment r of every slot into the result slot.
            let s = (l * self.seg.rank / n * es)..(l * (self.seg.rank + 1) / n * es);
            let parts: Vec<&[u8]> = (0..n).map(|k| &self.seg.slot(k)[s.clone()]).collect();
            reduce_into(dtype, &mut self.seg.slot(n)[s.clone()], &parts, op);
            self.seg.barrier(OP)?;
            chunk.copy_from_slice(&self.seg.slot(n)[..chunk.len()]);
            self.seg.barrier(OP)?;
        }
        Ok(())
    }

    pub(super) fn reduce_scatter_buf_impl(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
    ) -> CommResult<()> {
        const OP: &str = "reduce_scatter";
        let part = agreement::scatter_output(OP, self.seg.rank, self.seg.world_size, &input, &output)?;
        let (dtype, es) = (input.dtype, input.dtype.size());
        self.seg.handshake(OP, input.len(), dtype, input.bytes.as_ptr())?;
        let n = self.seg.world_size;
        let r = self.seg.rank;
        let pb = part * es;
        if self.peers.direct() {
            self.reduce_direct(
                OP,
                r * pb..(r + 1) * pb,
                input.bytes.as_ptr(),
                output.bytes.as_mut_ptr(),
                &[],
                dtype,
                op,
            )?;
            return self.seg.barrier(OP);
        }
        let q = (SLOT_BYTES / n / es).max(1) * es; // bytes of each part per round
        for a in (0..pb).step_by(q) {
            let b = (a + q).min(pb);
            let slot = self.seg.slot(r);
            for k in 0..n {
                slot[k * q..k * q + (b - a)].copy_from_slice(&input.bytes[k * pb + a..k * pb + b]);
            }
            self.seg.barrier(OP)?;
            let parts: Vec<&[u8]> = (0..n).map(|k| &self.seg.slot(k)[r * q..r * q + (b - a)]).collect();
            reduce_into(dtype, &mut output.bytes[a..b], &parts, op);
            self.seg.barrier(OP)?;
        }
        Ok(())
    }

    pub(super) fn all_gather_buf_impl(&self, buf: BufMut<'_>) -> CommResult<()> {
        const OP: &str = "all_gather";
        let pb = agreement::equal_parts(OP, self.seg.rank, self.seg.world_size, buf.len())? * buf.dtype.size();
        let bytes = buf.bytes;
        self.seg.handshake(OP, bytes.len() / buf.dtype.size(), buf.dtype, bytes.as_ptr())?;
        let r = self.seg.rank;
        if self.peers.direct() {
            self.peers.begin_gather();
            for k in (0..self.seg.world_size).filter(|&k| k != r) {
                self.peers.read(&self.seg, OP, k, k * pb, &mut bytes[k * pb..(k + 1) * pb])?;
            }
            self.peers.end_gather();
            return self.seg.barrier(OP);
        }
        for a in (0..pb).step_by(SLOT_BYTES) {
            let b = (a + SLOT_BYTES).min(pb);
            self.seg.slot(r)[..b - a].copy_from_slice(&bytes[r * pb + a..r * pb + b]);
            self.seg.barrier(OP)?;
            for k in (0..self.seg.world_size).filter(|&k| k != r) {
                bytes[k * pb + a..k * pb + b].copy_from_slice(&self.seg.slot(k)[..b - a]);
            }
            self.seg.barrier(OP)?;
        }
        Ok(())
    }

    pub(super) fn broadcast_buf_impl(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        const OP: &str = "broadcast";
        agreement::root(OP, self.seg.rank, self.seg.world_size, root)?;
        let bytes = buf.bytes;
        self.seg.handshake(OP, bytes.len() / buf.dtype.size(), buf.dtype, bytes.as_ptr())?;
        if self.peers.direct() {
            if self.seg.rank != root {
                self.peers.read(&self.seg, OP, root, 0, bytes)?;
            }
            return self.seg.barrier(OP);
        }
        for chunk in bytes.chunks_mut(SLOT_BYTES) {
            if self.seg.rank == root {
                self.seg.slot(root)[..chunk.len()].copy_from_slice(chunk);
            }
            self.seg.barrier(OP)?;
            if self.seg.rank != root {
                chunk.copy_from_slice(&self.seg.slot(root)[..chunk.len()]);
            }
            self.seg.barrier(OP)?;
        }
        Ok(())
    }
}
