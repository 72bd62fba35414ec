//! Point-to-point over the segment. The sender posts its transfer in its block (destination, number, length, type,
//! address) and waits; the receiver checks length and type (a mismatch is answered, so both ends fail) and then
//! either reads the sender's buffer directly (its mapped region or process_vm_readv: one copy) or, when the group
//! stages, takes it chunk by chunk through the sender's staging slot. The sender returns once the receiver has it.
//!
//! A rank runs one call at a time, so its block and its slot are free for a transfer whenever it is not in a
//! collective; peers only read a rank's slot inside a collective that rank is in.
use std::sync::atomic::Ordering;

use super::super::groups;
use super::super::{BufMut, BufRef, CommError, CommResult, Dtype};
use super::segment::{
    R_P2P_ACKED, R_P2P_ADDR, R_P2P_ANSWER, R_P2P_CHUNKS, R_P2P_DTYPE, R_P2P_LEN, R_P2P_SEQ, R_P2P_THEIR_DTYPE,
    R_P2P_THEIR_LEN, R_P2P_TO, SLOT_BYTES,
};
use super::ShmComm;

/// The receiver's answers (low byte of `R_P2P_ANSWER`, above it the transfer's number).
const DONE: u64 = 1;
const REFUSED: u64 = 2;
const GO_STAGED: u64 = 3;

fn answer(seq: u64, code: u64) -> u64 {
    (seq << 8) | code
}

impl ShmComm {
    pub(super) fn send_impl(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        let seq = self.post(&buf, dst)?;
        self.finish_send(seq, &buf, dst)
    }

    /// A send and a receive in flight at once (a ring shift): this rank posts its transfer, takes the one `src`
    /// posted to it (the peers read each other's buffers at the same time, where the default sends and then
    /// receives, one copy after the other), then waits for `dst` to have its own. Staged groups, and transfers to or
    /// from this rank itself, take the default order.
    pub(super) fn send_recv_impl(&self, send: BufRef<'_>, dst: usize, recv: BufMut<'_>, src: usize) -> CommResult<()> {
        let me = self.seg.rank;
        if !self.peers.direct() || dst == me || src == me {
            return if me % 2 == 0 {
                self.send_impl(send, dst).and_then(|()| self.recv_impl(recv, src))
            } else {
                self.recv_impl(recv, src).and_then(|()| self.send_impl(send, dst))
            };
        }
        let seq = self.post(&send, dst)?;
        let received = self.recv_impl(recv, src);
        let sent = self.finish_send(seq, &send, dst);
        received.and(sent)
    }

    /// Posts `buf` for `dst` in this rank's block; returns the transfer's number.
    fn post(&self, buf: &BufRef<'_>, dst: usize) -> CommResult<u64> {
        const OP: &str = "send";
        let seg = &self.seg;
        let me = seg.rank;
        groups::check_peer(OP, me, seg.world_size, dst)?;
        let word = |w: usize| seg.rank_word(me, w);
        let seq = word(R_P2P_SEQ).load(Ordering::Relaxed) + 1;
        word(R_P2P_LEN).store(buf.len() as u64, Ordering::Relaxed);
        word(R_P2P_DTYPE).store(buf.dtype.code(), Ordering::Relaxed);
        word(R_P2P_ADDR).store(buf.bytes.as_ptr() as u64, Ordering::Relaxed);
        word(R_P2P_CHUNKS).store(0, Ordering::Relaxed);
        word(R_P2P_ACKED).store(0, Ordering::Relaxed);
        word(R_P2P_SEQ).store(seq, Ordering::Release);
        word(R_P2P_TO).store(dst as u64 + 1, Ordering::Release);
        Ok(seq)
    }

    /// Waits for `dst`'s answer to transfer `seq` (staging the data when asked), then clears the post.
    fn finish_send(&self, seq: u64, buf: &BufRef<'_>, dst: usize) -> CommResult<()> {
        const OP: &str = "send";
        let seg = &self.seg;
        let me = seg.rank;
        let word = |w: usize| seg.rank_word(me, w);
        let answered = |code: u64| word(R_P2P_ANSWER).load(Ordering::Acquire) == answer(seq, code);
        let result = (|| {
            seg.wait_for_peer(OP, dst, || answered(DONE) || answered(REFUSED) || answered(GO_STAGED))?;
            if answered(REFUSED) {
                let len = word(R_P2P_THEIR_LEN).load(Ordering::Relaxed) as usize;
                let dtype = Dtype::from_index(word(R_P2P_THEIR_DTYPE).load(Ordering::Relaxed) as i64 - 1);
                return Err(CommError::P2pMismatch {
                    op: OP,
                    src: me,
                    dst,
                    sent: (buf.len(), buf.dtype),
                    expected: (len, dtype),
                });
            }
            if answered(GO_STAGED) {
                for (k, chunk) in buf.bytes.chunks(SLOT_BYTES).enumerate() {
                    seg.slot(me)[..chunk.len()].copy_from_slice(chunk);
                    word(R_P2P_CHUNKS).store(k as u64 + 1, Ordering::Release);
                    seg.wait_for_peer(OP, dst, || word(R_P2P_ACKED).load(Ordering::Acquire) > k as u64)?;
                }
            }
            Ok(())
        })();
        word(R_P2P_TO).store(0, Ordering::Release);
        result
    }

    pub(super) fn recv_impl(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        const OP: &str = "recv";
        let seg = &self.seg;
        let me = seg.rank;
        groups::check_peer(OP, me, seg.world_size, src)?;
        let theirs = |w: usize| seg.rank_word(src, w);
        let last = self.received[src].get();
        let posted = std::cell::Cell::new(last);
        // The sender writes the transfer's words, then its number, then the destination, and clears the destination
        // before its next number. The number is read on both sides of the destination: a sender that finished a
        // transfer to another rank and posted the next one to this rank between the two reads shows a destination
        // that is not the first number's (its number has moved on), and the receiver looks again. Read once, this
        // rank took the new transfer's words under the old number and answered a number the sender no longer waited
        // for: the sender hung (seen with the 1-bit exchange's sends to one rank after another, 4 shm ranks).
        seg.wait_for_peer(OP, src, || {
            let seq = theirs(R_P2P_SEQ).load(Ordering::Acquire);
            posted.set(seq);
            seq != last
                && theirs(R_P2P_TO).load(Ordering::Acquire) == me as u64 + 1
                && theirs(R_P2P_SEQ).load(Ordering::Acquire) == seq
        })?;
        let seq = posted.get();
        self.received[src].set(seq);
        let (len, code) = (theirs(R_P2P_LEN).load(Ordering::Relaxed), theirs(R_P2P_DTYPE).load(Ordering::Relaxed));
        if len != buf.len() as u64 || code != buf.dtype.code() {
            theirs(R_P2P_THEIR_LEN).store(buf.len() as u64, Ordering::Relaxed);
            theirs(R_P2P_THEIR_DTYPE).store(buf.dtype.code(), Ordering::Relaxed);
            theirs(R_P2P_ANSWER).store(answer(seq, REFUSED), Ordering::Release);
            return Err(CommError::P2pMismatch {
                op: OP,
                src,
                dst: me,
                sent: (len as usize, Dtype::from_index(code as i64 - 1)),
                expected: (buf.len(), buf.dtype),
            });
        }
        if self.peers.direct() {
            let addr = theirs(R_P2P_ADDR).load(Ordering::Relaxed) as usize;
            self.peers.read_at(seg, OP, src, addr, buf.bytes)?;
            theirs(R_P2P_ANSWER).store(answer(seq, DONE), Ordering::Release);
            return Ok(());
        }
        theirs(R_P2P_ANSWER).store(answer(seq, GO_STAGED), Ordering::Release);
        for (k, chunk) in buf.bytes.chunks_mut(SLOT_BYTES).enumerate() {
            seg.wait_for_peer(OP, src, || theirs(R_P2P_CHUNKS).load(Ordering::Acquire) > k as u64)?;
            chunk.copy_from_slice(&seg.slot(src)[..chunk.len()]);
            theirs(R_P2P_ACKED).store(k as u64 + 1, Ordering::Release);
        }
        Ok(())
    }
}
