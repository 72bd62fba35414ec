//! Groups inside a group: MPI_Comm_split's agreement, written once for every backend, and the name every error of
//! a group made so carries. A backend only builds the communicator of an agreed [`Split`]
//! ([`Communicator::split_group`]); what the ranks agree on, how the new ranks are ordered and what the group is
//! called is here.
use std::sync::atomic::{AtomicU64, Ordering};

use super::{BufMut, BufRef, Collectives, CommError, CommResult, Communicator, DeviceBuf, ReduceOp};

/// A split every rank of the parent group agreed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// Every parent rank's color (None: in no group), by parent rank.
    pub colors: Vec<Option<u32>>,
    /// Members of this rank's new group: their ranks in the parent, in new-rank order (empty without a color).
    pub members: Vec<usize>,
    /// This rank's rank in its new group (0 without a color).
    pub rank: usize,
    /// The new group's name: the parent's name and the color, or the ranks given to `new_group`.
    pub name: String,
    /// Unique to this split within the job (picked by the parent's rank 0): names what the group's ranks share.
    pub id: u64,
}

impl Split {
    /// This rank's color.
    pub fn color(&self, parent_rank: usize) -> Option<u32> {
        self.colors[parent_rank]
    }

    /// The key MPI-like backends pass on: the rank in the new group, so their order is this one.
    pub fn key(&self) -> i64 {
        self.rank as i64
    }
}

/// A number no other split of this process has, with the pid in the high bits.
fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    (u64::from(std::process::id()) << 24) | (NEXT.fetch_add(1, Ordering::Relaxed) & 0xff_ffff)
}

/// Agrees on a split (one all-gather of every rank's color, key, the list `new_group` was given and an id), then
/// lets the backend build this rank's group, which is named in its errors.
pub(crate) fn split<C: Communicator + ?Sized>(
    comm: &C,
    color: Option<u32>,
    key: i64,
    listed: Option<&[usize]>,
    named: Option<String>,
) -> CommResult<Option<Box<dyn Communicator>>> {
    const OP: &str = "split";
    let (rank, ws) = (comm.rank(), comm.world_size());
    const WORDS: usize = 4;
    let list_hash = listed.map_or(0, |l| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        l.hash(&mut h);
        h.finish() as i64
    });
    let mut all = vec![0i64; WORDS * ws];
    all[WORDS * rank..WORDS * (rank + 1)].copy_from_slice(&[
        color.map_or(-1, i64::from),
        key,
        list_hash,
        next_id() as i64,
    ]);
    comm.all_gather_in_place(&mut all)?;
    let word = |r: usize, w: usize| all[WORDS * r + w];
    if let Some(other) = (0..ws).find(|&r| word(r, 2) != list_hash) {
        return Err(CommError::BadArgument {
            op: "new_group",
            rank,
            what: format!("rank {other} passed another list of ranks than this rank's {listed:?}"),
        });
    }
    let colors: Vec<Option<u32>> = (0..ws).map(|r| u32::try_from(word(r, 0)).ok()).collect();
    let mut members: Vec<usize> = match color {
        Some(c) => (0..ws).filter(|&r| colors[r] == Some(c)).collect(),
        None => Vec::new(),
    };
    members.sort_by_key(|&r| (word(r, 1), r));
    let new_rank = members.iter().position(|&r| r == rank).unwrap_or(0);
    let parent = comm.group_name();
    let name = match (listed, color) {
        _ if named.is_some() => format!("{parent}/{}", named.unwrap_or_default()),
        (Some(l), _) => format!("{parent}{l:?}").replace(' ', ""),
        (None, Some(c)) => format!("{parent}/color{c}"),
        (None, None) => format!("{parent}/none"),
    };
    let split = Split { colors, members, rank: new_rank, name: name.clone(), id: word(0, 3) as u64 };
    let made = comm.split_group(&split).map_err(|e| match e {
        e @ CommError::InGroup { .. } => e,
        e => CommError::InGroup { group: format!("{name} (being made by {OP})"), error: Box::new(e) },
    })?;
    Ok(made.map(|inner| Box::new(Named { inner, name }) as Box<dyn Communicator>))
}

/// The group of `ranks`, in that order; None on the ranks not listed.
pub(crate) fn new_group<C: Communicator + ?Sized>(
    comm: &C,
    ranks: &[usize],
) -> CommResult<Option<Box<dyn Communicator>>> {
    let (rank, ws) = (comm.rank(), comm.world_size());
    let bad = |what: String| CommError::BadArgument { op: "new_group", rank, what };
    if ranks.is_empty() {
        return Err(bad("the list of ranks is empty".into()));
    }
    if let Some(r) = ranks.iter().find(|&&r| r >= ws) {
        return Err(bad(format!("rank {r} is not a rank of {ws}")));
    }
    let mut seen = vec![false; ws];
    for &r in ranks {
        if std::mem::replace(&mut seen[r], true) {
            return Err(bad(format!("rank {r} is listed twice in {ranks:?}")));
        }
    }
    let position = ranks.iter().position(|&r| r == rank);
    split(comm, position.map(|_| 0), position.unwrap_or(0) as i64, Some(ranks), None)
}

/// A group made by a split: the backend's communicator, with the group's name on every error.
struct Named {
    inner: Box<dyn Communicator>,
    name: String,
}

impl Named {
    fn named<T>(&self, r: CommResult<T>) -> CommResult<T> {
        r.map_err(|error| match error {
            e @ CommError::InGroup { .. } => e,
            error => CommError::InGroup { group: self.name.clone(), error: Box::new(error) },
        })
    }
}

impl Communicator for Named {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.named(self.inner.all_reduce_buf(buf, op))
    }

    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.named(self.inner.reduce_scatter_buf(input, output, op))
    }

    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        self.named(self.inner.all_gather_buf(buf))
    }

    fn all_to_all_buf(&self, input: BufRef<'_>, output: BufMut<'_>) -> CommResult<()> {
        self.named(self.inner.all_to_all_buf(input, output))
    }

    fn all_to_all_v_buf(
        &self,
        input: BufRef<'_>,
        send: &[usize],
        output: BufMut<'_>,
        recv: &[usize],
    ) -> CommResult<()> {
        self.named(self.inner.all_to_all_v_buf(input, send, output, recv))
    }

    fn host_layout(&self) -> Option<(usize, usize)> {
        self.inner.host_layout()
    }

    fn host_all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        self.named(self.inner.host_all_gather_buf(buf))
    }

    fn reduce_scatter_quantized_buf(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        block: usize,
    ) -> CommResult<()> {
        self.named(self.inner.reduce_scatter_quantized_buf(input, output, op, block))
    }

    fn forget_gathered_pages(&self) {
        self.inner.forget_gathered_pages()
    }

    fn window(&self, local: &mut [u8]) -> CommResult<Option<Vec<usize>>> {
        self.named(self.inner.window(local))
    }

    fn independent_groups(&self) -> bool {
        self.inner.independent_groups()
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        self.named(self.inner.broadcast_buf(buf, root))
    }

    unsafe fn all_reduce_device(&self, buf: DeviceBuf, op: ReduceOp) -> CommResult<bool> {
        // SAFETY: the caller's, passed on.
        self.named(unsafe { self.inner.all_reduce_device(buf, op) })
    }

    unsafe fn reduce_scatter_device(&self, input: DeviceBuf, output: DeviceBuf, op: ReduceOp) -> CommResult<bool> {
        // SAFETY: the caller's, passed on.
        self.named(unsafe { self.inner.reduce_scatter_device(input, output, op) })
    }

    unsafe fn all_gather_device(&self, buf: DeviceBuf) -> CommResult<bool> {
        // SAFETY: the caller's, passed on.
        self.named(unsafe { self.inner.all_gather_device(buf) })
    }

    unsafe fn broadcast_device(&self, buf: DeviceBuf, root: usize) -> CommResult<bool> {
        // SAFETY: the caller's, passed on.
        self.named(unsafe { self.inner.broadcast_device(buf, root) })
    }

    fn barrier(&self) -> CommResult<()> {
        self.named(self.inner.barrier())
    }

    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        self.named(self.inner.send_buf(buf, dst))
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        self.named(self.inner.recv_buf(buf, src))
    }

    fn split_group(&self, split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        self.named(self.inner.split_group(split))
    }

    fn group_name(&self) -> String {
        self.name.clone()
    }

    fn prefers_shared_buffers(&self) -> bool {
        self.inner.prefers_shared_buffers()
    }
}

/// The checks both ends of a point-to-point transfer make: a peer that is a rank of the group and not this one.
pub fn check_peer(op: &'static str, rank: usize, world_size: usize, peer: usize) -> CommResult<()> {
    if peer >= world_size || peer == rank {
        let what = if peer == rank {
            format!("rank {rank} cannot {op} to or from itself")
        } else {
            format!("peer {peer} is not a rank of {world_size}")
        };
        return Err(CommError::BadArgument { op, rank, what });
    }
    Ok(())
}

/// One end of a point-to-point transfer, as the header handshake sees it.
pub struct Transfer {
    /// The transfer (`send`, `recv`).
    pub op: &'static str,
    /// This rank.
    pub rank: usize,
    /// The other end.
    pub peer: usize,
    /// Whether this end sends.
    pub sending: bool,
    /// Elements.
    pub len: usize,
    /// Their type.
    pub dtype: super::Dtype,
}

/// Point-to-point over backends that move messages (MPI, NCCL): the sender sends a header (length, element type),
/// the receiver answers whether it matches, and only then the payload moves, so a mismatch is an error on both
/// ends and no payload is ever misread. `send_words` / `recv_words` move one small i64 message to / from the peer.
pub fn header_handshake(
    t: &Transfer,
    mut send_words: impl FnMut(&[i64]) -> CommResult<()>,
    mut recv_words: impl FnMut(&mut [i64]) -> CommResult<()>,
) -> CommResult<()> {
    let mine = [t.len as i64, t.dtype as i64];
    let (src, dst) = if t.sending { (t.rank, t.peer) } else { (t.peer, t.rank) };
    let mismatch = |theirs: [i64; 2]| {
        let theirs = (theirs[0] as usize, super::Dtype::from_index(theirs[1]));
        let mine = (t.len, t.dtype);
        let (sent, expected) = if t.sending { (mine, theirs) } else { (theirs, mine) };
        CommError::P2pMismatch { op: t.op, src, dst, sent, expected }
    };
    if t.sending {
        send_words(&mine)?;
        let mut answer = [0i64; 3];
        recv_words(&mut answer)?;
        if answer[0] == 0 {
            return Err(mismatch([answer[1], answer[2]]));
        }
        Ok(())
    } else {
        let mut theirs = [0i64; 2];
        recv_words(&mut theirs)?;
        let ok = theirs == mine;
        send_words(&[i64::from(ok), mine[0], mine[1]])?;
        if !ok {
            return Err(mismatch(theirs));
        }
        Ok(())
    }
}
