//! One rank's ProcessGroupGloo as a zerorun [`Communicator`]: the handshakes, the mean, the bandwidth-optimal
//! reduce-scatter and all-gather over gloo's point-to-point, and groups on the job's store.
use std::ffi::{c_char, c_int, c_void};
use std::time::Duration;

use super::ffi::*;
use crate::comm::agreement::{self, Call};
use crate::comm::groups::{self, Split, Transfer};
use crate::comm::rank_info::RankInfo;
use crate::comm::{BufMut, BufRef, CommError, CommResult, Communicator, Dtype, Element, ReduceOp};

/// Tags of a transfer's two messages (gloo matches by peer and tag, in order).
const TAG_HEADER: c_int = 1;
const TAG_PAYLOAD: c_int = 2;
/// The collectives' own messages (reduce-scatter and all-gather parts): apart from the point-to-point ones.
const TAG_PARTS: c_int = 3;

/// One rank's gloo group.
pub struct GlooComm {
    group: *mut c_void,
    rank: usize,
    world_size: usize,
    /// The job's store address, for errors.
    place: String,
    /// Where a reduce-scatter receives the peers' parts, kept between calls (a bucket's worth, reused: no page
    /// faults on every call).
    scratch: std::cell::RefCell<Vec<u8>>,
}

// SAFETY: the group is used by one thread at a time (the trait is Send, not Sync); libtorch's ProcessGroupGloo
// runs its own worker threads and is safe to call from any one thread.
unsafe impl Send for GlooComm {}

impl Drop for GlooComm {
    fn drop(&mut self) {
        // SAFETY: made by zr_gloo_new or zr_gloo_subgroup, freed once.
        unsafe { zr_gloo_free(self.group) };
    }
}

/// The address this rank's gloo device binds: `ZERORUN_HOST_ADDR`, else loopback when the master is local, else
/// this host's name (which must resolve to an address the other hosts reach).
pub(super) fn host_address(master_addr: &str) -> String {
    if let Ok(a) = std::env::var("ZERORUN_HOST_ADDR") {
        return a;
    }
    if master_addr == "localhost" || master_addr.starts_with("127.") || master_addr == "::1" {
        return "127.0.0.1".into();
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "127.0.0.1".into())
}

impl GlooComm {
    /// Joins the job's group: rank 0 serves the TCPStore at MASTER_ADDR:MASTER_PORT (under torchrun, its agent
    /// does), every rank connects, and the ranks meet under the run's id. Waits at most `timeout` for the others.
    pub fn from_env(info: &RankInfo, timeout: Duration) -> CommResult<GlooComm> {
        let place = format!("the TCPStore at {}:{}", info.master_addr, info.master_port);
        // torchrun's agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT and tells its ranks to use it.
        let agent_store = std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
        let host = host_address(&info.master_addr);
        let (addr, host_c, prefix) =
            (c_string(&info.master_addr), c_string(&host), c_string(&format!("zerorun/{}/", info.run_id)));
        let mut err = ErrBuf::new();
        // SAFETY: valid C strings and an error buffer of the length given; the result is checked for null.
        let group = unsafe {
            zr_gloo_new(
                addr.as_ptr(),
                c_int::from(info.master_port),
                c_int::from(agent_store),
                host_c.as_ptr(),
                info.rank as c_int,
                info.world_size as c_int,
                timeout.as_millis() as i64,
                prefix.as_ptr(),
                err.ptr(),
                err.0.len(),
            )
        };
        if group.is_null() {
            return Err(CommError::Rendezvous {
                rank: info.rank,
                world_size: info.world_size,
                place,
                what: format!("gloo (binding {host}): {}", err.message()),
            });
        }
        tracing::debug!(rank = info.rank, world_size = info.world_size, %host, "gloo backend ready");
        Ok(GlooComm { group, rank: info.rank, world_size: info.world_size, place, scratch: Default::default() })
    }

    /// A group made on a store by `zr_gloo_on_store` (null checked by the caller).
    pub(super) fn from_group(group: *mut c_void, rank: usize, world_size: usize, place: String) -> GlooComm {
        GlooComm { group, rank, world_size, place, scratch: Default::default() }
    }

    /// Runs one C call; its failure becomes an error of `op` naming this rank and what libtorch said.
    fn call(&self, op: &'static str, f: impl FnOnce(*mut c_char, usize) -> c_int) -> CommResult<()> {
        let mut err = ErrBuf::new();
        let len = err.0.len();
        if f(err.ptr(), len) == 0 {
            return Ok(());
        }
        let what = err.message();
        if what.contains("Timed out") || what.contains("timed out") || what.contains("Timeout") {
            return Err(CommError::Timeout { op, rank: self.rank, missing: Vec::new(), waited: Duration::ZERO });
        }
        Err(CommError::BadArgument { op, rank: self.rank, what: format!("gloo: {what}") })
    }

    /// Every rank shares (op, length, type); any difference is an error on every rank.
    fn handshake(&self, op: &'static str, len: usize, dtype: Dtype) -> CommResult<()> {
        let mine = Call::new(op, len, dtype).words();
        let mut all = vec![0u64; 3 * self.world_size];
        all[3 * self.rank..3 * self.rank + 3].copy_from_slice(&mine);
        // SAFETY: `all` holds world_size parts of 3 u64 words (gathered as i64), alive for the call.
        self.call(op, |e, l| unsafe {
            zr_gloo_all_gather(self.group, all.as_mut_ptr() as *mut c_void, 3, Dtype::I64 as c_int, e, l)
        })?;
        let calls: Vec<Call> = all.chunks(3).map(Call::from_words).collect();
        agreement::check(op, self.rank, &calls)
    }

    /// gloo's op for ours: the mean is a sum, divided afterwards by [`divide`].
    fn op_code(op: ReduceOp) -> c_int {
        match op {
            ReduceOp::Max => 2,
            ReduceOp::Sum | ReduceOp::Avg => 0,
        }
    }

    /// One transfer's message (header or payload) to or from `peer`.
    /// One message of a transfer (its header or its payload) to or from the transfer's peer: `n` elements of
    /// `dtype` at `bytes`, which the caller keeps alive (and, receiving, writable) for the call.
    fn p2p_message(
        &self,
        t: &Transfer,
        sending: bool,
        bytes: *mut u8,
        n: usize,
        dtype: Dtype,
        tag: c_int,
    ) -> CommResult<()> {
        let (data, peer) = (bytes as *mut c_void, t.peer as c_int);
        // SAFETY: as this function's contract says.
        self.call(t.op, |e, l| unsafe {
            if sending {
                zr_gloo_send(self.group, data, n as i64, dtype as c_int, peer, tag, e, l)
            } else {
                zr_gloo_recv(self.group, data, n as i64, dtype as c_int, peer, tag, e, l)
            }
        })
    }

    fn p2p(
        &self,
        op: &'static str,
        peer: usize,
        sending: bool,
        bytes: *mut u8,
        len: usize,
        dtype: Dtype,
    ) -> CommResult<()> {
        groups::check_peer(op, self.rank, self.world_size, peer)?;
        let transfer = Transfer { op, rank: self.rank, peer, sending, len, dtype };
        groups::header_handshake(
            &transfer,
            |w| self.p2p_message(&transfer, true, w.as_ptr() as *mut u8, w.len(), Dtype::I64, TAG_HEADER),
            |w| self.p2p_message(&transfer, false, w.as_mut_ptr() as *mut u8, w.len(), Dtype::I64, TAG_HEADER),
        )?;
        if len == 0 {
            return Ok(());
        }
        self.p2p_message(&transfer, sending, bytes, len, dtype, TAG_PAYLOAD)
    }
}

/// Divides every element of `bytes` (of `dtype`) by `n`: the mean from a sum, as the other backends compute it.
fn divide(bytes: &mut [u8], dtype: Dtype, n: usize) {
    fn each<T: Element>(bytes: &mut [u8], n: usize) {
        for x in bytemuck::cast_slice_mut::<u8, T>(bytes) {
            *x = T::div(*x, n);
        }
    }
    match dtype {
        Dtype::F32 => each::<f32>(bytes, n),
        Dtype::Bf16 => each::<half::bf16>(bytes, n),
        Dtype::F16 => each::<half::f16>(bytes, n),
        Dtype::I64 => each::<i64>(bytes, n),
    }
}

impl Communicator for GlooComm {
    fn rank(&self) -> usize {
        self.rank
    }

    /// Every group is a ProcessGroupGloo of its own, with its own connections.
    fn independent_groups(&self) -> bool {
        true
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        const OP: &str = "all_reduce";
        let (len, dtype) = (buf.len(), buf.dtype);
        self.handshake(OP, len, dtype)?;
        if len == 0 {
            return Ok(());
        }
        let data = buf.bytes.as_mut_ptr() as *mut c_void;
        // SAFETY: `buf` is this call's, `len` elements of `dtype`.
        self.call(OP, |e, l| unsafe {
            zr_gloo_all_reduce(self.group, data, len as i64, dtype as c_int, Self::op_code(op), e, l)
        })?;
        if op == ReduceOp::Avg {
            divide(buf.bytes, dtype, self.world_size);
        }
        Ok(())
    }

    /// Bandwidth-optimal and in rank order: every rank sends each peer its part and sums the parts it received
    /// in rank order, as every backend does (gloo's own reduce-scatter all-reduces the whole buffer).
    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        const OP: &str = "reduce_scatter";
        let part = agreement::scatter_output(OP, self.rank, self.world_size, &input, &output)?;
        self.handshake(OP, input.len(), input.dtype)?;
        if part == 0 {
            return Ok(());
        }
        let dtype = input.dtype;
        let part_bytes = part * dtype.size();
        // The peers' parts arrive in the scratch, one slot per peer in rank order (this rank's own is read from the
        // input where it is).
        let mut scratch = self.scratch.borrow_mut();
        let need = (self.world_size - 1) * part_bytes;
        if scratch.len() < need {
            *scratch = vec![0u8; need];
        }
        if self.world_size > 1 {
            let (i, o) = (input.bytes.as_ptr() as *mut c_void, scratch.as_mut_ptr() as *mut c_void);
            // SAFETY: the input is only read (sent); the scratch holds world_size - 1 parts of `part` elements.
            self.call(OP, |e, l| unsafe {
                zr_gloo_exchange_parts(self.group, i, o, part as i64, dtype as c_int, TAG_PARTS, e, l)
            })?;
        }
        let own = &input.bytes[self.rank * part_bytes..(self.rank + 1) * part_bytes];
        let mut peers = scratch[..need].chunks(part_bytes);
        let parts: Vec<&[u8]> = (0..self.world_size)
            .map(|r| if r == self.rank { own } else { peers.next().expect("a slot per peer") })
            .collect();
        crate::comm::reduce_into(dtype, output.bytes, &parts, op);
        Ok(())
    }

    /// The reduce-scatter's exchange, every transfer in flight at once; this rank's own part is copied.
    fn all_to_all_buf(&self, input: BufRef<'_>, output: BufMut<'_>) -> CommResult<()> {
        const OP: &str = "all_to_all";
        let part = agreement::exchange_output(OP, self.rank, self.world_size, &input, &output)?;
        self.handshake(OP, input.len(), input.dtype)?;
        if part == 0 {
            return Ok(());
        }
        let (dtype, part_bytes, rank) = (input.dtype, part * input.dtype.size(), self.rank);
        if self.world_size > 1 {
            let (i, o) = (input.bytes.as_ptr() as *mut c_void, output.bytes.as_mut_ptr() as *mut c_void);
            // SAFETY: the input is only read; the output holds world_size parts, the first world_size - 1 of
            // which take the peers' parts in rank order.
            self.call(OP, |e, l| unsafe {
                zr_gloo_exchange_parts(self.group, i, o, part as i64, dtype as c_int, TAG_PARTS, e, l)
            })?;
        }
        // The peers after this rank move up one place, and this rank's own part takes its place.
        output.bytes.copy_within(rank * part_bytes..(self.world_size - 1) * part_bytes, (rank + 1) * part_bytes);
        output.bytes[rank * part_bytes..(rank + 1) * part_bytes]
            .copy_from_slice(&input.bytes[rank * part_bytes..(rank + 1) * part_bytes]);
        Ok(())
    }

    /// The counts exchanged and checked first (gloo cannot tell a part of the wrong size), then every part in flight
    /// at once, straight into its place; this rank's own part is copied.
    fn all_to_all_v_buf(
        &self,
        input: BufRef<'_>,
        send: &[usize],
        output: BufMut<'_>,
        recv: &[usize],
    ) -> CommResult<()> {
        const OP: &str = "all_to_all";
        let (n, rank, es, dtype) = (self.world_size, self.rank, input.dtype.size(), input.dtype);
        let (sends, recvs) = crate::comm::all_to_all::offsets(OP, rank, n, &input, send, &output, recv)?;
        crate::comm::all_to_all::agree(self, OP, send, recv, dtype)?;
        let bytes = |v: &[usize]| v.iter().map(|x| (x * es) as i64).collect::<Vec<i64>>();
        let counts = |v: &[usize]| v.iter().map(|x| *x as i64).collect::<Vec<i64>>();
        let (so, sc, ro, rc) = (bytes(&sends), counts(send), bytes(&recvs), counts(recv));
        let (i, o) = (input.bytes.as_ptr() as *mut c_void, output.bytes.as_mut_ptr() as *mut c_void);
        // SAFETY: every part lies within its buffer (offsets checked against the lengths above); the input is only
        // read.
        self.call(OP, |e, l| unsafe {
            zr_gloo_exchange_v(
                self.group,
                i,
                so.as_ptr(),
                sc.as_ptr(),
                o,
                ro.as_ptr(),
                rc.as_ptr(),
                dtype as c_int,
                TAG_PARTS,
                e,
                l,
            )
        })?;
        output.bytes[recvs[rank] * es..recvs[rank + 1] * es]
            .copy_from_slice(&input.bytes[sends[rank] * es..sends[rank + 1] * es]);
        Ok(())
    }

    /// Bandwidth-optimal: this rank's part goes to every peer, each peer's arrives in its place.
    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        const OP: &str = "all_gather";
        let part = agreement::equal_parts(OP, self.rank, self.world_size, buf.len())?;
        self.handshake(OP, buf.len(), buf.dtype)?;
        if part == 0 || self.world_size == 1 {
            return Ok(());
        }
        let (data, dtype) = (buf.bytes.as_mut_ptr() as *mut c_void, buf.dtype);
        // SAFETY: `buf` holds world_size parts of `part` elements, this call's.
        self.call(OP, |e, l| unsafe {
            zr_gloo_share_parts(self.group, data, part as i64, dtype as c_int, TAG_PARTS, e, l)
        })
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        const OP: &str = "broadcast";
        agreement::root(OP, self.rank, self.world_size, root)?;
        self.handshake(OP, buf.len(), buf.dtype)?;
        if buf.is_empty() {
            return Ok(());
        }
        let (data, len, dtype) = (buf.bytes.as_mut_ptr() as *mut c_void, buf.len(), buf.dtype);
        // SAFETY: as for the all-reduce.
        self.call(OP, |e, l| unsafe {
            zr_gloo_broadcast(self.group, data, len as i64, dtype as c_int, root as c_int, e, l)
        })
    }

    fn barrier(&self) -> CommResult<()> {
        // SAFETY: a call on this group with an error buffer of the length given.
        self.call("barrier", |e, l| unsafe { zr_gloo_barrier(self.group, e, l) })
    }

    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        // Read only: gloo's send does not write its tensor.
        self.p2p("send", dst, true, buf.bytes.as_ptr() as *mut u8, buf.len(), buf.dtype)
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        let (len, dtype) = (buf.len(), buf.dtype);
        self.p2p("recv", src, false, buf.bytes.as_mut_ptr(), len, dtype)
    }

    /// Both headers are checked first (even ranks the send's, odd ranks the receive's, as the default does), then
    /// both payloads move at once: a ring shift uses the link both ways.
    fn send_recv_buf(&self, send: BufRef<'_>, dst: usize, recv: BufMut<'_>, src: usize) -> CommResult<()> {
        const OP: &str = "send_recv";
        groups::check_peer(OP, self.rank, self.world_size, dst)?;
        groups::check_peer(OP, self.rank, self.world_size, src)?;
        let out = Transfer { op: OP, rank: self.rank, peer: dst, sending: true, len: send.len(), dtype: send.dtype };
        let inn = Transfer { op: OP, rank: self.rank, peer: src, sending: false, len: recv.len(), dtype: recv.dtype };
        let headers = |t: &Transfer| {
            groups::header_handshake(
                t,
                |w| self.p2p_message(t, true, w.as_ptr() as *mut u8, w.len(), Dtype::I64, TAG_HEADER),
                |w| self.p2p_message(t, false, w.as_mut_ptr() as *mut u8, w.len(), Dtype::I64, TAG_HEADER),
            )
        };
        if self.rank % 2 == 0 {
            headers(&out)?;
            headers(&inn)?;
        } else {
            headers(&inn)?;
            headers(&out)?;
        }
        let (n_send, n_recv) = (send.len(), recv.len());
        let (s, r) = (send.bytes.as_ptr() as *mut u8, recv.bytes.as_mut_ptr());
        // An empty payload is not sent (as `send_buf` does not): the other one moves alone.
        match (n_send, n_recv) {
            (0, 0) => return Ok(()),
            (_, 0) => return self.p2p_message(&out, true, s, n_send, send.dtype, TAG_PAYLOAD),
            (0, _) => return self.p2p_message(&inn, false, r, n_recv, recv.dtype, TAG_PAYLOAD),
            _ => {}
        }
        let (s, r) = (s as *mut c_void, r as *mut c_void);
        // SAFETY: `send` is only read, `recv` is this call's to write; both hold the lengths given, of the dtypes
        // both ends agreed on above.
        self.call(OP, |e, l| unsafe {
            zr_gloo_send_recv(
                self.group,
                s,
                n_send as i64,
                dst as c_int,
                r,
                n_recv as i64,
                src as c_int,
                send.dtype as c_int,
                TAG_PAYLOAD,
                e,
                l,
            )
        })
    }

    /// The members make a ProcessGroupGloo of their own on the job's store, under the group's name and the
    /// split's id (so every group, and every split, meets apart).
    fn split_group(&self, split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        if split.color(self.rank).is_none() {
            return Ok(None);
        }
        let name = c_string(&format!("{}#{:x}/", split.name, split.id));
        let mut err = ErrBuf::new();
        // SAFETY: a live parent group, a C string and an error buffer of the length given.
        let group = unsafe {
            zr_gloo_subgroup(
                self.group,
                name.as_ptr(),
                split.rank as c_int,
                split.members.len() as c_int,
                err.ptr(),
                err.0.len(),
            )
        };
        if group.is_null() {
            return Err(CommError::Rendezvous {
                rank: split.rank,
                world_size: split.members.len(),
                place: self.place.clone(),
                what: format!("gloo group {}: {}", split.name, err.message()),
            });
        }
        Ok(Some(Box::new(GlooComm {
            group,
            rank: split.rank,
            world_size: split.members.len(),
            place: self.place.clone(),
            scratch: Default::default(),
        })))
    }
}
