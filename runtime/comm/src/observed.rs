//! A communicator that runs every call of another through an [`Observer`]: the one wrapper behind the heartbeat
//! ([`crate::heartbeat::Heartbeat`]: a collective in progress counts as waiting) and the communication logger
//! ([`crate::logged::CommLog`]: each collective timed and recorded). Groups split from it are observed by the same
//! observer, so one wrapping of the job's communicator covers every group made from it.
use crate::buffer::{BufMut, BufRef, DeviceBuf};
use crate::{groups, CommResult, Communicator, ReduceOp};

/// One call as an observer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    /// DeepSpeed's name for it (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `broadcast`, `send`,
    /// `recv`, `barrier`), or `split_group` / `window` for the calls that make groups and windows.
    pub op: &'static str,
    /// Bytes of the whole buffer (the gathered one, the reduce-scatter's input; nccl-tests' S).
    pub bytes: usize,
    /// Ranks taking part.
    pub group_size: usize,
}

/// What runs around every call of an [`Observed`] communicator.
pub trait Observer: Clone + Send + 'static {
    /// Runs `call`'s work `f`.
    fn around<R>(&self, call: Call, f: impl FnOnce() -> CommResult<R>) -> CommResult<R>;
}

/// A communicator whose calls run through `observer`.
pub struct Observed<O: Observer> {
    inner: Box<dyn Communicator>,
    observer: O,
}

impl<O: Observer> Observed<O> {
    /// Wraps `inner`.
    pub fn new(inner: Box<dyn Communicator>, observer: O) -> Observed<O> {
        Observed { inner, observer }
    }

    fn around<R>(&self, op: &'static str, bytes: usize, f: impl FnOnce() -> CommResult<R>) -> CommResult<R> {
        self.observer.around(Call { op, bytes, group_size: self.inner.world_size() }, f)
    }
}

impl<O: Observer> Communicator for Observed<O> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.around("all_reduce", buf.bytes.len(), || self.inner.all_reduce_buf(buf, op))
    }
    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        self.around("reduce_scatter", input.bytes.len(), || self.inner.reduce_scatter_buf(input, output, op))
    }
    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        self.around("all_gather", buf.bytes.len(), || self.inner.all_gather_buf(buf))
    }
    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        self.around("broadcast", buf.bytes.len(), || self.inner.broadcast_buf(buf, root))
    }
    fn all_to_all_buf(&self, input: BufRef<'_>, output: BufMut<'_>) -> CommResult<()> {
        self.around("all_to_all", input.bytes.len(), || self.inner.all_to_all_buf(input, output))
    }

    fn all_to_all_v_buf(
        &self,
        input: BufRef<'_>,
        send: &[usize],
        output: BufMut<'_>,
        recv: &[usize],
    ) -> CommResult<()> {
        self.around("all_to_all", input.bytes.len(), || self.inner.all_to_all_v_buf(input, send, output, recv))
    }
    fn reduce_scatter_quantized_buf(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        block: usize,
    ) -> CommResult<()> {
        // Counted at the bytes it would move unquantized: the logger's rows stay comparable across runs.
        self.around("reduce_scatter", input.bytes.len(), || {
            self.inner.reduce_scatter_quantized_buf(input, output, op, block)
        })
    }
    fn barrier(&self) -> CommResult<()> {
        self.around("barrier", 0, || self.inner.barrier())
    }
    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        self.around("send", buf.bytes.len(), || self.inner.send_buf(buf, dst))
    }
    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        self.around("recv", buf.bytes.len(), || self.inner.recv_buf(buf, src))
    }
    fn send_recv_buf(&self, send: BufRef<'_>, dst: usize, recv: BufMut<'_>, src: usize) -> CommResult<()> {
        self.around("send", send.bytes.len(), || self.inner.send_recv_buf(send, dst, recv, src))
    }
    fn split_group(&self, split: &groups::Split) -> CommResult<Option<Box<dyn Communicator>>> {
        let group = self.around("split_group", 0, || self.inner.split_group(split))?;
        Ok(group.map(|g| Box::new(Observed::new(g, self.observer.clone())) as Box<dyn Communicator>))
    }
    fn group_name(&self) -> String {
        self.inner.group_name()
    }
    fn prefers_shared_buffers(&self) -> bool {
        self.inner.prefers_shared_buffers()
    }
    fn forget_gathered_pages(&self) {
        self.inner.forget_gathered_pages()
    }
    fn window(&self, local: &mut [u8]) -> CommResult<Option<Vec<usize>>> {
        self.around("window", 0, || self.inner.window(local))
    }
    fn host_layout(&self) -> Option<(usize, usize)> {
        self.inner.host_layout()
    }
    fn host_all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        let call = Call {
            op: "all_gather",
            bytes: buf.bytes.len(),
            group_size: self.inner.host_layout().map_or(1, |(_, per_host)| per_host),
        };
        self.observer.around(call, || self.inner.host_all_gather_buf(buf))
    }
    fn independent_groups(&self) -> bool {
        self.inner.independent_groups()
    }
    unsafe fn all_reduce_device(&self, buf: DeviceBuf, op: ReduceOp) -> CommResult<bool> {
        // SAFETY: the caller's guarantees, passed on.
        self.around("all_reduce", device_bytes(&buf), || unsafe { self.inner.all_reduce_device(buf, op) })
    }
    unsafe fn reduce_scatter_device(&self, input: DeviceBuf, output: DeviceBuf, op: ReduceOp) -> CommResult<bool> {
        // SAFETY: the caller's guarantees, passed on.
        self.around("reduce_scatter", device_bytes(&input), || unsafe {
            self.inner.reduce_scatter_device(input, output, op)
        })
    }
    unsafe fn all_gather_device(&self, buf: DeviceBuf) -> CommResult<bool> {
        // SAFETY: the caller's guarantees, passed on.
        self.around("all_gather", device_bytes(&buf), || unsafe { self.inner.all_gather_device(buf) })
    }
    unsafe fn broadcast_device(&self, buf: DeviceBuf, root: usize) -> CommResult<bool> {
        // SAFETY: the caller's guarantees, passed on.
        self.around("broadcast", device_bytes(&buf), || unsafe { self.inner.broadcast_device(buf, root) })
    }
}

fn device_bytes(b: &DeviceBuf) -> usize {
    b.count * b.dtype.size()
}
