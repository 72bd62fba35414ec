//! Large two-level collectives in chunks: the cross-host step of each chunk runs on a helper thread while this
//! thread runs the host step of the next one (gathering, of the one before), so the link does not wait for shared
//! memory, nor shared memory for the link. One after the other, a 67 MB bucket's reduce-scatter on 2 hosts x 2
//! ranks at 1 Gbit/s took 330-370 ms against the link's 280.
//!
//! Chunk c is slice c of every part, and a reduce-scatter or all-gather of it is one of the whole buffer's
//! elements: each element is summed by the same ranks in the same order as unchunked, so the results are bitwise
//! the unchunked ones. (The all-reduce's cross-host step is the backend's, whose order may depend on where an
//! element sits; the two-level all-reduce agrees with the flat one to rounding either way.) Quantized steps stay
//! unchunked: the quantizer's buffers live with the thread that runs it.
use std::ops::Range;
use std::sync::mpsc::{self, Receiver, Sender};

use super::{bytes_of, permute, Hierarchical};
use crate::{BufMut, BufRef, CommResult, Communicator, Dtype, ReduceOp};

/// Bytes of each part's slice in one chunk: large enough that a chunk's handshake and thread hop are noise beside
/// its transfer (8 ms at 1 Gbit/s), small enough that the first chunk's host step is short. On 2 hosts x 2 ranks
/// at 1 Gbit/s (the 54.6M MLP) stage 2's step read 2.24-2.31 s with 1 MiB, 2.32-2.40 with 4 MiB, 2.49-2.52 with
/// 16 MiB and 2.46-2.51 unchunked.
pub(super) const CHUNK_BYTES: usize = 1 << 20;

/// The chunks of `part` elements: consecutive slices of at most `chunk`.
fn chunks(part: usize, chunk: usize) -> Vec<Range<usize>> {
    (0..part).step_by(chunk).map(|s| s..(s + chunk).min(part)).collect()
}

/// The cross-host group, lent to the helper thread for one collective.
struct Lent<'a>(&'a dyn Communicator);

// SAFETY: a Communicator is Send. While it is lent, only the helper calls it (the owner joins the helper before it
// touches the group again), which is moving it to the helper and back.
unsafe impl Send for Lent<'_> {}

/// Splits `rest` at `at`, leaving the tail in `rest`.
fn take<'a>(rest: &mut &'a mut [u8], at: usize) -> &'a mut [u8] {
    let (head, tail) = std::mem::take(rest).split_at_mut(at);
    *rest = tail;
    head
}

/// Runs `host_steps` on this thread beside a helper that applies `cross_step` on `cross` to every chunk handed to
/// it (the sender), in order, handing each back when done (the receiver). A failed step on either side stops both
/// and is returned: the host side closing the sender ends the helper once it has crossed what it was given, and
/// the helper's end closes the receiver.
fn pipeline<'a, T: Send + 'a>(
    cross: &'a dyn Communicator,
    cross_step: impl Fn(&dyn Communicator, &mut T) -> CommResult<()> + Send + 'a,
    host_steps: impl FnOnce(&Sender<T>, &Receiver<T>) -> CommResult<()>,
) -> CommResult<()> {
    let cross = Lent(cross);
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<T>();
        let (done_tx, done_rx) = mpsc::channel::<T>();
        let helper = s.spawn(move || -> CommResult<()> {
            let cross = cross;
            for mut chunk in rx {
                cross_step(cross.0, &mut chunk)?;
                // Handed back to a host side that may not read it (a reduce-scatter's): every chunk sent is
                // crossed, as the peers' helpers cross theirs, until the sender closes.
                let _ = done_tx.send(chunk);
            }
            Ok(())
        });
        let hosted = host_steps(&tx, &done_rx);
        drop(tx);
        let crossed = helper.join().expect("the cross-host helper panicked");
        hosted.and(crossed)
    })
}

impl Hierarchical {
    /// Elements of each part's slice in one chunk.
    pub(super) fn chunk_elements(&self, dtype: Dtype) -> usize {
        (self.chunk_bytes / dtype.size()).max(1)
    }

    /// The reduce-scatter in chunks of `chunk` elements of every part of `part` (`op` a sum or a maximum: a mean
    /// is divided by the caller).
    pub(super) fn reduce_scatter_in_chunks(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        part: usize,
        chunk: usize,
    ) -> CommResult<()> {
        let (h, k, dtype) = (self.hosts(), self.per_host(), input.dtype);
        let size = dtype.size();
        let mut scratch = self.scratch.borrow_mut();
        let mut staged = self.staged.borrow_mut();
        let grouped = bytes_of(&mut scratch, h * k * chunk * size);
        let mut across_rest = bytes_of(&mut staged, h * part * size);
        let mut out_rest = output.bytes;
        let cross_step = move |c: &dyn Communicator, (across, out): &mut (&[u8], &mut [u8])| {
            c.reduce_scatter_buf(BufRef { bytes: across, dtype }, BufMut { bytes: out, dtype }, op)
        };
        pipeline(self.cross.as_ref(), cross_step, |to_cross, _| {
            for r in chunks(part, chunk) {
                let bytes = r.len() * size;
                let g = &mut grouped[..h * k * bytes];
                permute(input.bytes, g, part * size, r.start * size..r.end * size, h, k, false);
                let across = take(&mut across_rest, h * bytes);
                self.local.reduce_scatter_buf(BufRef { bytes: g, dtype }, BufMut { bytes: &mut *across, dtype }, op)?;
                if to_cross.send((&*across, take(&mut out_rest, bytes))).is_err() {
                    break; // the helper stopped on an error, which it returns
                }
            }
            Ok(())
        })
    }

    /// The all-reduce in chunks of `chunk` elements of each of the K pieces of `piece` elements `buf` splits into
    /// (the last padded with zeros): per chunk a reduce-scatter inside the host, an all-reduce across hosts on the
    /// helper, an all-gather inside the host, one chunk behind.
    pub(super) fn all_reduce_in_chunks(
        &self,
        buf: BufMut<'_>,
        op: ReduceOp,
        piece: usize,
        chunk: usize,
    ) -> CommResult<()> {
        let (k, dtype, place) = (self.per_host(), buf.dtype, self.local.rank());
        let size = dtype.size();
        let end = buf.bytes.len();
        let values = buf.bytes;
        let mut scratch = self.scratch.borrow_mut();
        let mut staged = self.staged.borrow_mut();
        let mut work_rest = bytes_of(&mut scratch, k * piece * size);
        let mut mine_rest = bytes_of(&mut staged, piece * size);
        let ranges = chunks(piece, chunk);
        // Slice r of piece p in `values`, cut at its end (the padding is not there).
        let span = |p: usize, r: &Range<usize>| {
            let (s, e) = ((p * piece + r.start) * size, (p * piece + r.end) * size);
            s.min(end)..e.min(end)
        };
        let cross_step =
            move |c: &dyn Communicator, mine: &mut &mut [u8]| c.all_reduce_buf(BufMut { bytes: mine, dtype }, op);
        pipeline(self.cross.as_ref(), cross_step, |to_cross, crossed| {
            let mut works = Vec::with_capacity(ranges.len());
            // Chunk c's host all-gather, once its cross-host all-reduce is back; false when the helper stopped.
            let finish = |c: usize, work: &mut [u8], values: &mut [u8]| -> CommResult<bool> {
                let Ok(mine) = crossed.recv() else { return Ok(false) };
                let bytes = ranges[c].len() * size;
                work[place * bytes..(place + 1) * bytes].copy_from_slice(mine);
                self.local.all_gather_buf(BufMut { bytes: &mut *work, dtype })?;
                for p in 0..k {
                    let at = span(p, &ranges[c]);
                    let n = at.len();
                    values[at].copy_from_slice(&work[p * bytes..p * bytes + n]);
                }
                Ok(true)
            };
            for (c, r) in ranges.iter().enumerate() {
                let bytes = r.len() * size;
                let work = take(&mut work_rest, k * bytes);
                for p in 0..k {
                    let at = span(p, r);
                    let n = at.len();
                    work[p * bytes..p * bytes + n].copy_from_slice(&values[at]);
                    work[p * bytes + n..(p + 1) * bytes].fill(0);
                }
                let mine = take(&mut mine_rest, bytes);
                self.local.reduce_scatter_buf(
                    BufRef { bytes: work, dtype },
                    BufMut { bytes: &mut *mine, dtype },
                    op,
                )?;
                if to_cross.send(mine).is_err() {
                    return Ok(());
                }
                works.push(work);
                // One chunk in flight beyond this one: finish the one before.
                if c >= 1 && !finish(c - 1, std::mem::take(&mut works[c - 1]), values)? {
                    return Ok(());
                }
            }
            if let Some(c) = ranges.len().checked_sub(1) {
                finish(c, std::mem::take(&mut works[c]), values)?;
            }
            Ok(())
        })
    }

    /// The all-gather in chunks of `chunk` elements of every part of `part`: every chunk's cross-host gather is
    /// handed to the helper at once, and each chunk's host gather follows its own.
    pub(super) fn all_gather_in_chunks(&self, buf: BufMut<'_>, part: usize, chunk: usize) -> CommResult<()> {
        let (h, k, dtype) = (self.hosts(), self.per_host(), buf.dtype);
        let (size, place, host, rank) = (dtype.size(), self.local.rank(), self.cross.rank(), self.rank());
        let values = buf.bytes;
        let mut scratch = self.scratch.borrow_mut();
        let mut staged = self.staged.borrow_mut();
        let grouped = bytes_of(&mut scratch, h * k * chunk * size);
        let mut across_rest = bytes_of(&mut staged, h * part * size);
        let ranges = chunks(part, chunk);
        let cross_step =
            move |c: &dyn Communicator, across: &mut &mut [u8]| c.all_gather_buf(BufMut { bytes: across, dtype });
        pipeline(self.cross.as_ref(), cross_step, |to_cross, crossed| {
            // This rank's slice of each chunk in its host's place, every chunk handed over.
            for r in &ranges {
                let bytes = r.len() * size;
                let across = take(&mut across_rest, h * bytes);
                let own = (rank * part + r.start) * size;
                across[host * bytes..(host + 1) * bytes].copy_from_slice(&values[own..own + bytes]);
                if to_cross.send(across).is_err() {
                    break;
                }
            }
            for r in &ranges {
                let Ok(across) = crossed.recv() else { return Ok(()) };
                let bytes = r.len() * size;
                let g = &mut grouped[..h * k * bytes];
                g[place * h * bytes..(place + 1) * h * bytes].copy_from_slice(across);
                self.local.all_gather_buf(BufMut { bytes: &mut *g, dtype })?;
                permute(g, values, part * size, r.start * size..r.end * size, h, k, true);
            }
            Ok(())
        })
    }
}
