//! Collectives of ranks that span hosts, in two levels: among a host's ranks through a fast local group (shared
//! memory) and across hosts through a group of the ranks with the same place on their host (gloo). Each of a
//! host's K ranks carries 1/K of the host's cross-host traffic, so the K ranks use the link in parallel and every
//! byte crosses it once: a reduce-scatter over H hosts sends (H-1)/H of the buffer per host across, where a flat
//! one over H x K ranks sends (HK-1)/(HK) per rank, K times the link's share.
//!
//! Rank r = h K + k is rank k of its host's group and rank h of its cross-host group (ranks on a host are
//! consecutive, as `zerorun launch` and torchrun number them). The reduction order differs from the flat one
//! (each host's sum first): results agree with it to rounding, and every rank still ends with the same values.
//! Everything that is not a reduce-scatter, all-gather, large all-reduce or large broadcast goes through the flat group.
mod all_to_all;
mod pipelined;
mod split;

use std::cell::RefCell;
use std::ops::Range;

use super::agreement;
use super::buffer::divide;
use super::groups::Split;
use super::region::SharedBuffer;
use super::{BufMut, BufRef, Collectives, CommError, CommResult, Communicator, ReduceOp};

/// Below this many elements an all-reduce or a broadcast goes through the flat group: two or three collectives
/// cost more than one.
const SMALL: usize = 4096;

/// The two-level communicator: the flat group of every rank, this host's group and this rank's cross-host group.
pub struct Hierarchical {
    world: Box<dyn Communicator>,
    local: Box<dyn Communicator>,
    cross: Box<dyn Communicator>,
    /// Permuted copies of the buffers.
    scratch: RefCell<Scratch>,
    /// The cross-host group's part of a reduce-scatter, reused.
    staged: RefCell<Scratch>,
    /// Bytes of each part's slice in one chunk of a large collective (see `pipelined`).
    chunk_bytes: usize,
    /// All-to-alls in two levels ([`Hierarchical::two_level_all_to_all_v`]) or through the flat group.
    two_level_all_to_all: bool,
}

/// How a job's ranks lie on hosts, as every rank agreed: `hosts` of `per_host` consecutive ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostLayout {
    /// Hosts.
    pub hosts: usize,
    /// Ranks on each host.
    pub per_host: usize,
}

/// Agrees over `world` (collective) whether its collectives can run in two levels: every rank says where it is on
/// its host (`local_rank` of `local_world_size`) and whether it wants the two levels. Some layout when every rank
/// wants them, every host has the same number of ranks, more than one, on more than one host, and ranks on a host
/// are consecutive; None otherwise, on every rank alike.
pub fn agree_layout(
    world: &dyn Communicator,
    local_rank: usize,
    local_world_size: usize,
    wanted: bool,
) -> CommResult<Option<HostLayout>> {
    let (rank, n) = (world.rank(), world.world_size());
    let mut all = vec![0i64; 3 * n];
    all[3 * rank..3 * rank + 3].copy_from_slice(&[local_rank as i64, local_world_size as i64, i64::from(wanted)]);
    world.all_gather_in_place(&mut all)?;
    let k = all[1] as usize;
    let fits = k > 1
        && n > k
        && n % k == 0
        && (0..n).all(|r| all[3 * r] as usize == r % k && all[3 * r + 1] as usize == k && all[3 * r + 2] == 1);
    Ok(fits.then_some(HostLayout { hosts: n / k, per_host: k }))
}

impl Hierarchical {
    /// The two levels over `world`: `local` is this rank's host group (its rank the place on the host), `cross`
    /// the group of the ranks with this rank's place on every host (its rank the host's index).
    pub fn new(
        world: Box<dyn Communicator>,
        local: Box<dyn Communicator>,
        cross: Box<dyn Communicator>,
    ) -> CommResult<Hierarchical> {
        let (k, h) = (local.world_size(), cross.world_size());
        if k * h != world.world_size() || world.rank() != cross.rank() * k + local.rank() {
            return Err(CommError::BadArgument {
                op: "hierarchical",
                rank: world.rank(),
                what: format!(
                    "rank {} of {} is not rank {} of a host's {k} ranks on host {} of {h}",
                    world.rank(),
                    world.world_size(),
                    local.rank(),
                    cross.rank()
                ),
            });
        }
        let shared = local.prefers_shared_buffers();
        Ok(Hierarchical {
            world,
            local,
            cross,
            scratch: RefCell::new(Scratch::new(shared)),
            staged: RefCell::new(Scratch::new(shared)),
            chunk_bytes: pipelined::CHUNK_BYTES,
            two_level_all_to_all: true,
        })
    }

    /// All-to-alls through the flat group (`false`) instead of in two levels, in this group and the groups split
    /// from it: for comparing them (`ZERORUN_ALL_TO_ALL=flat`).
    pub fn with_two_level_all_to_all(mut self, two_level: bool) -> Hierarchical {
        self.two_level_all_to_all = two_level;
        self
    }

    /// Builds the cross-host group from `world` (collective) and joins the two levels.
    pub fn over(world: Box<dyn Communicator>, local: Box<dyn Communicator>) -> CommResult<Hierarchical> {
        let cross = world.split(Some(local.rank() as u32), world.rank() as i64)?.expect("every rank has a color");
        Hierarchical::new(world, local, cross)
    }

    /// The reduce-scatter of both kinds: the cross-host step quantized in blocks of `quantized` values, if given.
    fn two_level_reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        quantized: Option<usize>,
    ) -> CommResult<()> {
        const OP: &str = "reduce_scatter";
        let part = agreement::scatter_output(OP, self.rank(), self.world_size(), &input, &output)?;
        let (h, k, dtype) = (self.hosts(), self.per_host(), input.dtype);
        let (op, mean) = summed(op);
        let chunk = self.chunk_elements(dtype);
        if quantized.is_none() && part > chunk {
            let out = output.bytes;
            self.reduce_scatter_in_chunks(input, BufMut { bytes: &mut *out, dtype }, op, part, chunk)?;
            if mean {
                divide(dtype, out, self.world_size());
            }
            return Ok(());
        }
        let part_bytes = part * dtype.size();
        let mut scratch = self.scratch.borrow_mut();
        let mut staged = self.staged.borrow_mut();
        let grouped = bytes_of(&mut scratch, input.bytes.len());
        permute(input.bytes, grouped, part_bytes, 0..part_bytes, h, k, false);
        let across = bytes_of(&mut staged, h * part_bytes);
        self.local.reduce_scatter_buf(BufRef { bytes: grouped, dtype }, BufMut { bytes: across, dtype }, op)?;
        let out = output.bytes;
        let (input, output) = (BufRef { bytes: across, dtype }, BufMut { bytes: &mut *out, dtype });
        match quantized {
            Some(block) => self.cross.reduce_scatter_quantized_buf(input, output, op, block)?,
            None => self.cross.reduce_scatter_buf(input, output, op)?,
        }
        if mean {
            divide(dtype, out, self.world_size());
        }
        Ok(())
    }

    fn per_host(&self) -> usize {
        self.local.world_size()
    }

    fn hosts(&self) -> usize {
        self.cross.world_size()
    }
}

/// Scratch bytes, grown on demand: in the shared region when the host's group reads its peers' buffers there
/// (a peer copies from its mapping; process_vm_readv, which it uses for other memory, pins and copies page by
/// page at about half the speed), else on the heap.
struct Scratch {
    shared: bool,
    buf: Option<SharedBuffer>,
}

impl Scratch {
    fn new(shared: bool) -> Scratch {
        Scratch { shared, buf: None }
    }
}

/// `scratch` as at least `bytes` bytes (grown when short; the contents are undefined).
fn bytes_of(scratch: &mut Scratch, bytes: usize) -> &mut [u8] {
    if !scratch.buf.as_ref().is_some_and(|b| b.len() >= bytes) {
        scratch.buf = None;
        scratch.buf = Some(if scratch.shared { SharedBuffer::zeroed(bytes) } else { SharedBuffer::on_heap(bytes) });
    }
    &mut scratch.buf.as_mut().expect("allocated above").as_slice_mut::<u8>()[..bytes]
}

/// Moves bytes `slice` of part `h K + k` of the flat layout (parts of `part` bytes) to place `k H + h` of the
/// grouped one (places of `slice.len()` bytes), or back (`inverse`: `from` grouped, `to` flat): the parts a host's
/// rank k reduces or gathers across hosts become one contiguous run. Unchunked the slice is the whole part; in
/// chunks, one chunk's slice of every part.
fn permute(from: &[u8], to: &mut [u8], part: usize, slice: Range<usize>, hosts: usize, per_host: usize, inverse: bool) {
    let len = slice.len();
    for h in 0..hosts {
        for k in 0..per_host {
            let (flat, grouped) = ((h * per_host + k) * part + slice.start, (k * hosts + h) * len);
            let (src, dst) = if inverse { (grouped, flat) } else { (flat, grouped) };
            to[dst..dst + len].copy_from_slice(&from[src..src + len]);
        }
    }
}

/// A mean is a sum at both levels, divided once at the end as the flat group divides it.
fn summed(op: ReduceOp) -> (ReduceOp, bool) {
    match op {
        ReduceOp::Avg => (ReduceOp::Sum, true),
        op => (op, false),
    }
}

impl Communicator for Hierarchical {
    fn rank(&self) -> usize {
        self.world.rank()
    }

    fn world_size(&self) -> usize {
        self.world.world_size()
    }

    /// Inside each host a reduce-scatter into K pieces, across hosts an all-reduce of this rank's piece, inside
    /// again an all-gather. Small buffers take the flat group.
    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        let (len, dtype) = (buf.len(), buf.dtype);
        if len < SMALL {
            return self.world.all_reduce_buf(buf, op);
        }
        let (op, mean) = summed(op);
        let (k, size) = (self.per_host(), dtype.size());
        let piece = len.div_ceil(k);
        let chunk = self.chunk_elements(dtype);
        if piece > chunk {
            let bytes = buf.bytes;
            self.all_reduce_in_chunks(BufMut { bytes: &mut *bytes, dtype }, op, piece, chunk)?;
            if mean {
                divide(dtype, bytes, self.world_size());
            }
            return Ok(());
        }
        let mut scratch = self.scratch.borrow_mut();
        let mut staged = self.staged.borrow_mut();
        // The buffer padded to K pieces (zeros beyond its end, which no rank reads back).
        let padded = bytes_of(&mut scratch, piece * k * size);
        padded[..len * size].copy_from_slice(buf.bytes);
        padded[len * size..].fill(0);
        let mine = bytes_of(&mut staged, piece * size);
        self.local.reduce_scatter_buf(BufRef { bytes: padded, dtype }, BufMut { bytes: mine, dtype }, op)?;
        self.cross.all_reduce_buf(BufMut { bytes: mine, dtype }, op)?;
        let at = self.local.rank() * piece * size;
        padded[at..at + piece * size].copy_from_slice(mine);
        self.local.all_gather_buf(BufMut { bytes: padded, dtype })?;
        buf.bytes.copy_from_slice(&padded[..len * size]);
        if mean {
            divide(dtype, buf.bytes, self.world_size());
        }
        Ok(())
    }

    /// Inside each host, rank k sums the parts of rank k on every host; across hosts, those sums reduce-scatter.
    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.two_level_reduce_scatter(input, output, op, None)
    }

    /// Across hosts, rank k gathers the parts of rank k on every host; inside each host, those runs gather.
    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        const OP: &str = "all_gather";
        let part = agreement::equal_parts(OP, self.rank(), self.world_size(), buf.len())?;
        let (h, k, dtype) = (self.hosts(), self.per_host(), buf.dtype);
        let chunk = self.chunk_elements(dtype);
        if part > chunk {
            return self.all_gather_in_chunks(buf, part, chunk);
        }
        let (part_bytes, local) = (part * dtype.size(), self.local.rank());
        let mut scratch = self.scratch.borrow_mut();
        let grouped = bytes_of(&mut scratch, buf.bytes.len());
        let run = local * h * part_bytes..(local + 1) * h * part_bytes;
        let own = self.rank() * part_bytes;
        let at = run.start + self.cross.rank() * part_bytes;
        grouped[at..at + part_bytes].copy_from_slice(&buf.bytes[own..own + part_bytes]);
        self.cross.all_gather_buf(BufMut { bytes: &mut grouped[run.clone()], dtype })?;
        self.local.all_gather_buf(BufMut { bytes: grouped, dtype })?;
        permute(grouped, buf.bytes, part_bytes, 0..part_bytes, h, k, true);
        Ok(())
    }

    /// Inside each host in full precision, across hosts quantized: only the link carries int8.
    fn reduce_scatter_quantized_buf(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        block: usize,
    ) -> CommResult<()> {
        self.two_level_reduce_scatter(input, output, op, Some(block))
    }

    fn all_to_all_buf(&self, input: BufRef<'_>, output: BufMut<'_>) -> CommResult<()> {
        let part = agreement::exchange_output("all_to_all", self.rank(), self.world_size(), &input, &output)?;
        let counts = vec![part; self.world_size()];
        self.all_to_all_v_buf(input, &counts, output, &counts)
    }

    fn all_to_all_v_buf(
        &self,
        input: BufRef<'_>,
        send: &[usize],
        output: BufMut<'_>,
        recv: &[usize],
    ) -> CommResult<()> {
        match self.two_level_all_to_all {
            true => self.two_level_all_to_all_v(input, send, output, recv),
            false => self.world.all_to_all_v_buf(input, send, output, recv),
        }
    }

    fn host_layout(&self) -> Option<(usize, usize)> {
        Some((self.local.rank(), self.per_host()))
    }

    fn host_all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        self.local.all_gather_buf(buf)
    }

    /// In two levels when large: the root's cross-host group (the ranks with its place on every host) first, then
    /// every host's group from that place, so the value crosses each host's link once (flat, it goes to every rank
    /// of the other hosts: at start-up a model broadcast from rank 0 crossed the link K times). Small ones, and a
    /// root out of range (the flat group names the error), go through the flat group.
    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        if buf.len() < SMALL || root >= self.world_size() {
            return self.world.broadcast_buf(buf, root);
        }
        let k = self.per_host();
        let BufMut { bytes, dtype } = buf;
        if self.local.rank() == root % k {
            self.cross.broadcast_buf(BufMut { bytes: &mut *bytes, dtype }, root / k)?;
        }
        self.local.broadcast_buf(BufMut { bytes, dtype }, root % k)
    }

    fn barrier(&self) -> CommResult<()> {
        self.world.barrier()
    }

    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        self.world.send_buf(buf, dst)
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        self.world.recv_buf(buf, src)
    }

    /// By the level its groups lie in (`split.rs`).
    fn split_group(&self, split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        self.split_by_level(split)
    }

    fn group_name(&self) -> String {
        self.world.group_name()
    }

    fn independent_groups(&self) -> bool {
        self.world.independent_groups()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::threads;

    /// Runs `f` on every rank of `hosts` x `per_host` ranks as threads, each with a two-level communicator and a
    /// flat one, and returns the ranks' results in rank order.
    pub(super) fn on_ranks<R: Send + 'static>(
        hosts: usize,
        per_host: usize,
        f: impl Fn(&Hierarchical, &dyn Communicator) -> R + Send + Sync + Copy + 'static,
    ) -> Vec<R> {
        on_ranks_in_chunks(hosts, per_host, pipelined::CHUNK_BYTES, f)
    }

    /// [`on_ranks`] with chunks of `chunk_bytes` per part.
    fn on_ranks_in_chunks<R: Send + 'static>(
        hosts: usize,
        per_host: usize,
        chunk_bytes: usize,
        f: impl Fn(&Hierarchical, &dyn Communicator) -> R + Send + Sync + Copy + 'static,
    ) -> Vec<R> {
        let t = Duration::from_secs(20);
        let n = hosts * per_host;
        let mut worlds: Vec<Option<_>> = threads::group(n, t).into_iter().map(Some).collect();
        let mut flats: Vec<Option<_>> = threads::group(n, t).into_iter().map(Some).collect();
        let mut locals: Vec<Option<_>> = (0..hosts).flat_map(|_| threads::group(per_host, t)).map(Some).collect();
        let mut crosses: Vec<Vec<Option<_>>> =
            (0..per_host).map(|_| threads::group(hosts, t).into_iter().map(Some).collect()).collect();
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let world = worlds[r].take().unwrap();
                let flat = flats[r].take().unwrap();
                let local = locals[r].take().unwrap();
                let cross = crosses[r % per_host][r / per_host].take().unwrap();
                std::thread::spawn(move || {
                    let mut two = Hierarchical::new(Box::new(world), Box::new(local), Box::new(cross)).unwrap();
                    two.chunk_bytes = chunk_bytes;
                    f(&two, &flat)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Integers in f32, so that any order of summing is exact: the two levels must equal the flat group bitwise.
    fn values(rank: usize, len: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * 7 + rank * 13) % 97) as f32 - 40.0).collect()
    }

    /// Whole and in chunks (of 64 bytes per part, so 1000-element parts and 5000-element all-reduces run chunk by
    /// chunk, the last chunk short and the all-reduce's last piece padded).
    #[test]
    fn reduce_scatter_all_gather_all_reduce_and_broadcast_equal_the_flat_group() {
        let layouts = [(2, 2), (3, 2), (2, 3)];
        for ((hosts, per_host), chunk_bytes) in layouts.into_iter().flat_map(|l| [(l, pipelined::CHUNK_BYTES), (l, 64)])
        {
            let n = hosts * per_host;
            let results = on_ranks_in_chunks(hosts, per_host, chunk_bytes, move |two, flat| {
                let r = two.rank();
                for part in [1, 5, 1000] {
                    let input = values(r, n * part);
                    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                        let (mut a, mut b) = (vec![0f32; part], vec![0f32; part]);
                        two.reduce_scatter(&input, &mut a, op).unwrap();
                        flat.reduce_scatter(&input, &mut b, op).unwrap();
                        assert_eq!(
                            a, b,
                            "reduce-scatter {op:?}, {hosts}x{per_host}, part {part}, chunks of {chunk_bytes} B"
                        );
                    }
                    let mut gathered = vec![0f32; n * part];
                    gathered[r * part..(r + 1) * part].copy_from_slice(&values(r, part));
                    let mut reference = gathered.clone();
                    two.all_gather_in_place(&mut gathered).unwrap();
                    flat.all_gather_in_place(&mut reference).unwrap();
                    assert_eq!(
                        gathered, reference,
                        "all-gather, {hosts}x{per_host}, part {part}, chunks of {chunk_bytes} B"
                    );
                }
                for len in [3, 5000, 10_001] {
                    let (mut a, mut b) = (values(r, len), values(r, len));
                    two.all_reduce(&mut a, ReduceOp::Sum).unwrap();
                    flat.all_reduce(&mut b, ReduceOp::Sum).unwrap();
                    assert_eq!(a, b, "all-reduce of {len}, {hosts}x{per_host}, chunks of {chunk_bytes} B");
                }
                for (len, root) in [(3, 1), (5000, 0), (10_001, n - 1), (4096, n / 2)] {
                    let (mut a, mut b) = (values(r, len), values(r, len));
                    two.broadcast(&mut a, root).unwrap();
                    flat.broadcast(&mut b, root).unwrap();
                    assert_eq!(a, values(root, len), "broadcast of {len} from {root}, {hosts}x{per_host}");
                    assert_eq!(a, b);
                }
                let mut a = values(r, 8);
                two.all_reduce(&mut a, ReduceOp::Sum).unwrap();
                a
            });
            assert!(results.windows(2).all(|w| w[0] == w[1]), "every rank ends with the same values");
        }
    }

    /// The all-to-all in two levels gives every rank what the flat one gives: parts of any length (zeros among
    /// them, as an expert no token was routed to) and equal ones.
    #[test]
    fn the_all_to_all_in_two_levels_equals_the_flat_group() {
        for (hosts, per_host) in [(2, 2), (3, 2), (2, 3)] {
            let n = hosts * per_host;
            on_ranks(hosts, per_host, move |two, flat| {
                let r = two.rank();
                // Rank s sends rank d (s * 5 + d * 3) % 7 elements, numbered by both: 0 for some pairs.
                let count = |s: usize, d: usize| (s * 5 + d * 3) % 7;
                let send: Vec<usize> = (0..n).map(|d| count(r, d)).collect();
                let recv: Vec<usize> = (0..n).map(|s| count(s, r)).collect();
                let input: Vec<f32> =
                    (0..n).flat_map(|d| (0..count(r, d)).map(move |i| (r * 1000 + d * 10 + i) as f32)).collect();
                let expected: Vec<f32> =
                    (0..n).flat_map(|s| (0..count(s, r)).map(move |i| (s * 1000 + r * 10 + i) as f32)).collect();
                let (mut a, mut b) = (vec![0f32; expected.len()], vec![0f32; expected.len()]);
                two.all_to_all_v(&input, &send, &mut a, &recv).unwrap();
                flat.all_to_all_v(&input, &send, &mut b, &recv).unwrap();
                assert_eq!(a, expected, "rank {r} of {hosts}x{per_host}: parts in source order");
                assert_eq!(a, b);
                let equal: Vec<f32> = (0..n * 4).map(|i| (r * 100 + i) as f32).collect();
                let mut out = vec![0f32; n * 4];
                two.all_to_all_buf(BufRef::new(&equal), BufMut::new(&mut out)).unwrap();
                let want: Vec<f32> = (0..n).flat_map(|s| (0..4).map(move |i| (s * 100 + r * 4 + i) as f32)).collect();
                assert_eq!(out, want, "equal parts, rank {r} of {hosts}x{per_host}");
                // Rank 0 expects one element more from rank 1 than it sends: every rank errs, nothing moves.
                let mut recv = vec![1usize; n];
                if r == 0 {
                    recv[1] = 2;
                }
                let mut out = vec![0f32; recv.iter().sum()];
                let e = two.all_to_all_v(&vec![0f32; n], &vec![1; n], &mut out, &recv).unwrap_err().to_string();
                assert!(e.contains("rank 1 sends rank 0 1 elements, which expects 2"), "{e}");
                two.barrier().unwrap();
            });
        }
    }

    /// The 1-bit exchange runs on the two levels through the trait's sends and all-gather: the same bits as on the
    /// flat group, which are the one-process simulation's.
    #[test]
    fn the_one_bit_all_reduce_equals_the_flat_group_bitwise() {
        use crate::signs;
        for (hosts, per_host) in [(2, 2), (2, 3)] {
            let n = hosts * per_host;
            let len = 1000;
            let input = move |r: usize| -> Vec<f32> {
                (0..len).map(|i| ((i * 31 + r * 17) % 101) as f32 / 7.0 - 6.0).collect()
            };
            let results = on_ranks_in_chunks(hosts, per_host, pipelined::CHUNK_BYTES, move |two, flat| {
                let r = two.rank();
                let (mut a, mut b) = (input(r), input(r));
                let (mut ea, mut eb) = (signs::SignErrors::new(len, n), signs::SignErrors::new(len, n));
                for _ in 0..2 {
                    signs::all_reduce(two, &mut a, &mut ea.worker, &mut ea.server).unwrap();
                    signs::all_reduce(flat, &mut b, &mut eb.worker, &mut eb.server).unwrap();
                }
                assert_eq!(a, b, "{hosts}x{per_host}, rank {r}");
                a
            });
            let mut values: Vec<Vec<f32>> = (0..n).map(input).collect();
            let mut errors: Vec<signs::SignErrors> = (0..n).map(|_| signs::SignErrors::new(len, n)).collect();
            signs::simulate(&mut values, &mut errors);
            signs::simulate(&mut values, &mut errors);
            for (r, got) in results.iter().enumerate() {
                assert_eq!(got, &values[r], "{hosts}x{per_host}, rank {r} against the simulation");
            }
        }
    }

    #[test]
    fn bf16_differs_from_the_flat_order_by_at_most_two_units_in_the_last_place() {
        let results = on_ranks(2, 2, |two, flat| {
            let r = two.rank();
            let input: Vec<half::bf16> =
                (0..4 * 600).map(|i| half::bf16::from_f32(((i * 31 + r * 17) % 1000) as f32 / 997.0)).collect();
            let (mut a, mut b) = (vec![half::bf16::ZERO; 600], vec![half::bf16::ZERO; 600]);
            two.reduce_scatter(&input, &mut a, ReduceOp::Avg).unwrap();
            flat.reduce_scatter(&input, &mut b, ReduceOp::Avg).unwrap();
            a.iter()
                .zip(&b)
                .map(|(x, y)| (x.to_f32() - y.to_f32()).abs() / y.to_f32().abs().max(1e-3))
                .fold(0f32, f32::max)
        });
        for worst in results {
            assert!(worst <= 2.0 * 2f32.powi(-7), "relative difference {worst}");
        }
    }

    /// Quantized, the two levels reduce each host's sum exactly and carry only the cross-host step as int8: the
    /// result is within half a quantization step of the exact sum per host beyond the first.
    #[test]
    fn quantized_reduce_scatter_quantizes_only_across_hosts() {
        let results = on_ranks(2, 2, |two, _| {
            let r = two.rank();
            let input: Vec<f32> = (0..4 * 3000).map(|i| (((i * 31 + r * 17) % 1000) as f32 / 500.0) - 1.0).collect();
            let mut out = vec![0f32; 3000];
            two.reduce_scatter_quantized_buf(BufRef::new(&input), BufMut::new(&mut out), ReduceOp::Sum, 4096).unwrap();
            (r, out)
        });
        for (r, out) in results {
            for (i, o) in out.iter().enumerate() {
                let at = r * 3000 + i;
                let exact: f32 = (0..4).map(|q| (((at * 31 + q * 17) % 1000) as f32 / 500.0) - 1.0).sum();
                // The other host's sum of two values (at most 2 in size) arrives within half of 2 / 127.
                assert!((o - exact).abs() <= 1.0 / 127.0 + 1e-5, "rank {r}, element {i}: {o} against {exact}");
            }
        }
    }

    #[test]
    fn layouts_that_do_not_split_into_equal_consecutive_hosts_stay_flat() {
        let t = Duration::from_secs(20);
        // Each rank's (local rank, ranks on its host, wants two levels), and what they agree.
        type Case = (Vec<(usize, usize, bool)>, Option<HostLayout>);
        let cases: Vec<Case> = vec![
            (vec![(0, 2, true), (1, 2, true), (0, 2, true), (1, 2, true)], Some(HostLayout { hosts: 2, per_host: 2 })),
            (vec![(0, 2, true), (1, 2, true), (0, 2, false), (1, 2, true)], None),
            (vec![(0, 2, true), (0, 2, true), (1, 2, true), (1, 2, true)], None),
            (vec![(0, 1, true), (0, 1, true)], None),
            (vec![(0, 2, true), (1, 2, true)], None),
            (vec![(0, 3, true), (1, 3, true), (2, 3, true), (0, 1, true)], None),
        ];
        for (ranks, expected) in cases {
            let handles: Vec<_> = threads::group(ranks.len(), t)
                .into_iter()
                .zip(ranks.clone())
                .map(|(c, (lr, lws, want))| std::thread::spawn(move || agree_layout(&c, lr, lws, want).unwrap()))
                .collect();
            for h in handles {
                assert_eq!(h.join().unwrap(), expected, "{ranks:?}");
            }
        }
    }
}
