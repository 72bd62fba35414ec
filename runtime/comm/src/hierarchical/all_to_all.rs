//! The all-to-all of parts in two levels: inside each host by place, then one message per host across.
use std::ops::Range;

use super::{bytes_of, Hierarchical};
use crate::{all_to_all, BufMut, BufRef, CommResult, Communicator};

impl Hierarchical {
    /// The all-to-all of parts in two levels. Inside each host, rank k gives its host's rank k' every part bound for
    /// a rank with place k' (on any host); across hosts, rank k then sends host h' the parts its host's ranks have
    /// for rank (h', k), which land in `output` in source order. Every byte crosses the link once as in the flat
    /// exchange, but each rank sends H - 1 messages across instead of (H - 1) K and its host's parts go through
    /// shared memory instead of loopback TCP.
    pub(super) fn two_level_all_to_all_v(
        &self,
        input: BufRef<'_>,
        send: &[usize],
        output: BufMut<'_>,
        recv: &[usize],
    ) -> CommResult<()> {
        const OP: &str = "all_to_all";
        let (h, k, n) = (self.hosts(), self.per_host(), self.world_size());
        let (send_at, _) = all_to_all::offsets(OP, self.rank(), n, &input, send, &output, recv)?;
        let (place, host, dtype, size) = (self.local.rank(), self.cross.rank(), input.dtype, input.dtype.size());
        // Counts that disagree are the same error on every rank before anything moves, as in the flat exchange;
        // what the host's ranks send every rank gives the inside step's receive counts and the cross step's sends.
        let sends = all_to_all::agree(self, OP, send, recv, dtype)?;
        // What this rank receives inside its host from place j for host g, in arrival order ([j][g]).
        let arrives = |j: usize, g: usize| sends[(host * k + j) * n + g * k + place];
        let inside_send: Vec<usize> = (0..k).map(|kk| (0..h).map(|g| send[g * k + kk]).sum()).collect();
        let inside_recv: Vec<usize> = (0..k).map(|j| (0..h).map(|g| arrives(j, g)).sum()).collect();
        let across_send: Vec<usize> = (0..h).map(|g| (0..k).map(|j| arrives(j, g)).sum()).collect();
        let across_recv: Vec<usize> = (0..h).map(|g| recv[g * k..(g + 1) * k].iter().sum()).collect();
        let received_inside: usize = inside_recv.iter().sum();
        let mut scratch = self.scratch.borrow_mut();
        let mut staged = self.staged.borrow_mut();
        let grouped = bytes_of(&mut scratch, input.bytes.len().max(received_inside * size));
        // Inside: the parts grouped by destination place, then host ([k'][h']).
        let by_place = (0..k).flat_map(|kk| (0..h).map(move |g| g * k + kk));
        concat(input.bytes, by_place.map(|d| send_at[d] * size..send_at[d + 1] * size), grouped);
        let inside = bytes_of(&mut staged, received_inside * size);
        self.local.all_to_all_v_buf(
            BufRef { bytes: &grouped[..input.bytes.len()], dtype },
            &inside_send,
            BufMut { bytes: &mut *inside, dtype },
            &inside_recv,
        )?;
        // Across: what arrived ([j][g]) regrouped by host, then place ([g][j]).
        let mut at = vec![0usize; k * h + 1];
        for (i, (j, g)) in (0..k).flat_map(|j| (0..h).map(move |g| (j, g))).enumerate() {
            at[i + 1] = at[i] + arrives(j, g) * size;
        }
        let by_host = (0..h).flat_map(|g| (0..k).map(move |j| j * h + g));
        concat(inside, by_host.map(|i| at[i]..at[i + 1]), grouped);
        self.cross.all_to_all_v_buf(
            BufRef { bytes: &grouped[..received_inside * size], dtype },
            &across_send,
            output,
            &across_recv,
        )
    }
}

/// Copies the byte ranges `runs` of `from`, in their order, to the start of `to`.
fn concat(from: &[u8], runs: impl Iterator<Item = Range<usize>>, to: &mut [u8]) {
    let mut at = 0;
    for run in runs {
        to[at..at + run.len()].copy_from_slice(&from[run.clone()]);
        at += run.len();
    }
}
