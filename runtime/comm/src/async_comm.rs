//! Collectives that run on a communication thread, in submission order, while the caller computes.
//!
//! A group's communicator moves onto its own thread; `submit` queues a job and returns a [`Handle`] to wait on.
//! Jobs own their buffers (moved in, handed back with the result), so no borrow outlives the call that made it.
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::groups::Split;
use super::{BufMut, BufRef, Collectives, CommError, CommResult, Communicator, DeviceBuf, Dtype, Element, ReduceOp};

type Job = Box<dyn FnOnce(&dyn Communicator) + Send>;

/// A communicator driven by its own thread.
pub struct CommThread {
    rank: usize,
    world_size: usize,
    shared_buffers: bool,
    independent_groups: bool,
    host_layout: Option<(usize, usize)>,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<Box<dyn Communicator>>>,
}

/// The pending result of a submitted collective.
pub struct Handle<R> {
    rx: Receiver<CommResult<R>>,
    ready: Option<CommResult<R>>,
    op: &'static str,
    rank: usize,
}

fn thread_gone(op: &'static str, rank: usize) -> CommError {
    CommError::BadArgument { op, rank, what: "the communication thread ended before the collective finished".into() }
}

impl<R> Handle<R> {
    /// Blocks until the collective finished (the communicator's own timeout bounds the wait).
    pub fn wait(mut self) -> CommResult<R> {
        if let Some(r) = self.ready.take() {
            return r;
        }
        self.rx.recv().unwrap_or_else(|_| Err(thread_gone(self.op, self.rank)))
    }

    /// Waits at most `timeout`; gives the handle back if the collective is still running.
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<CommResult<R>, Handle<R>> {
        if let Some(r) = self.ready.take() {
            return Ok(r);
        }
        match self.rx.recv_timeout(timeout) {
            Ok(r) => Ok(r),
            Err(RecvTimeoutError::Timeout) => Err(self),
            Err(RecvTimeoutError::Disconnected) => Ok(Err(thread_gone(self.op, self.rank))),
        }
    }

    /// Whether the collective has finished (successfully or not); does not block.
    pub fn is_done(&mut self) -> bool {
        if self.ready.is_some() {
            return true;
        }
        match self.rx.try_recv() {
            Ok(r) => {
                self.ready = Some(r);
                true
            }
            Err(TryRecvError::Empty) => false,
            Err(TryRecvError::Disconnected) => {
                self.ready = Some(Err(thread_gone(self.op, self.rank)));
                true
            }
        }
    }
}

impl CommThread {
    /// Moves `comm` onto a new communication thread.
    pub fn spawn(comm: Box<dyn Communicator>) -> CommThread {
        let (rank, world_size, shared_buffers) = (comm.rank(), comm.world_size(), comm.prefers_shared_buffers());
        let independent_groups = comm.independent_groups();
        let host_layout = comm.host_layout();
        let (tx, rx) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("zerorun-comm-{rank}"))
            .spawn(move || {
                for job in rx {
                    job(comm.as_ref());
                }
                comm
            })
            .expect("spawning the communication thread");
        CommThread {
            rank,
            world_size,
            shared_buffers,
            independent_groups,
            host_layout,
            jobs: Some(tx),
            thread: Some(thread),
        }
    }

    /// Queues `f` to run on the communication thread after everything submitted before it.
    pub fn submit<R: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&dyn Communicator) -> CommResult<R> + Send + 'static,
    ) -> Handle<R> {
        let (tx, rx) = channel();
        let queued = std::time::Instant::now();
        let job: Job = Box::new(move |c| {
            let started = std::time::Instant::now();
            let result = f(c);
            // Where a step's communication time goes: how long each job waited behind others, and ran.
            tracing::trace!(
                op,
                waited_us = (started - queued).as_micros() as u64,
                ran_us = started.elapsed().as_micros() as u64,
                "communication thread job"
            );
            let _ = tx.send(result);
        });
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
        Handle { rx, ready: None, op, rank: self.rank }
    }

    /// All-reduce of an owned buffer, handed back when done.
    pub fn all_reduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Handle<Vec<T>> {
        self.submit("all_reduce", move |c| c.all_reduce(&mut buf, op).map(|_| buf))
    }

    /// Reduce-scatter of an owned input; the result is (input, this rank's reduced part).
    pub fn reduce_scatter<T: Element + Default>(&self, input: Vec<T>, op: ReduceOp) -> Handle<(Vec<T>, Vec<T>)> {
        let part = input.len() / self.world_size.max(1);
        self.submit("reduce_scatter", move |c| {
            let mut out = vec![T::default(); part];
            c.reduce_scatter(&input, &mut out, op).map(|_| (input, out))
        })
    }

    /// In-place all-gather of an owned buffer (this rank's part filled in), handed back when done.
    pub fn all_gather<T: Element>(&self, mut buf: Vec<T>) -> Handle<Vec<T>> {
        self.submit("all_gather", move |c| c.all_gather_in_place(&mut buf).map(|_| buf))
    }

    /// Sends an owned buffer to rank `dst`; the handle gives it back once `dst` has it. Jobs run in submission
    /// order, and a send waits for its receive: two ranks that send to each other order their calls (one sends
    /// first), as with the blocking calls.
    pub fn isend<T: Element>(&self, buf: Vec<T>, dst: usize) -> Handle<Vec<T>> {
        self.submit("send", move |c| c.send(&buf, dst).map(|_| buf))
    }

    /// Receives into an owned buffer from rank `src` (its length and type must match the send); the handle gives
    /// it back filled.
    pub fn irecv<T: Element>(&self, mut buf: Vec<T>, src: usize) -> Handle<Vec<T>> {
        self.submit("recv", move |c| c.recv(&mut buf, src).map(|_| buf))
    }

    /// Finishes the queued jobs and returns the communicator.
    pub fn into_inner(mut self) -> Box<dyn Communicator> {
        self.jobs.take();
        self.thread.take().expect("joined once").join().expect("the communication thread panicked")
    }
}

/// A buffer lent to the communication thread by a caller that keeps it alive until the job ends.
struct RawBuf {
    ptr: *mut u8,
    len: usize,
    dtype: Dtype,
}

// SAFETY: the memory is only touched by the job while the lender waits for it.
unsafe impl Send for RawBuf {}

impl RawBuf {
    fn new(ptr: *mut u8, len: usize, dtype: Dtype) -> Self {
        RawBuf { ptr, len, dtype }
    }

    /// # Safety
    /// The lender's buffer is alive and lent to this job alone.
    unsafe fn buf_mut(&self) -> BufMut<'static> {
        let bytes: &'static mut [u8] =
            if self.len == 0 { &mut [] } else { unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) } };
        BufMut { bytes, dtype: self.dtype }
    }

    unsafe fn buf_ref(&self) -> BufRef<'static> {
        let bytes: &'static [u8] =
            if self.len == 0 { &[] } else { unsafe { std::slice::from_raw_parts(self.ptr, self.len) } };
        BufRef { bytes, dtype: self.dtype }
    }
}

/// Blocking collectives through the thread, so they stay in order with the jobs submitted before them: the
/// caller's buffers are lent to the job and the call returns when it is done.
impl Communicator for CommThread {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn prefers_shared_buffers(&self) -> bool {
        self.shared_buffers
    }

    fn independent_groups(&self) -> bool {
        self.independent_groups
    }

    fn host_layout(&self) -> Option<(usize, usize)> {
        self.host_layout
    }

    fn host_all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        let raw = RawBuf::new(buf.bytes.as_mut_ptr(), buf.bytes.len(), buf.dtype);
        self.submit("all_gather", move |c| c.host_all_gather_buf(unsafe { raw.buf_mut() })).wait()
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        let raw = RawBuf::new(buf.bytes.as_mut_ptr(), buf.bytes.len(), buf.dtype);
        self.submit("all_reduce", move |c| c.all_reduce_buf(unsafe { raw.buf_mut() }, op)).wait()
    }

    fn reduce_scatter_buf(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> CommResult<()> {
        let i = RawBuf::new(input.bytes.as_ptr() as *mut u8, input.bytes.len(), input.dtype);
        let o = RawBuf::new(output.bytes.as_mut_ptr(), output.bytes.len(), output.dtype);
        self.submit("reduce_scatter", move |c| c.reduce_scatter_buf(unsafe { i.buf_ref() }, unsafe { o.buf_mut() }, op))
            .wait()
    }

    fn all_gather_buf(&self, buf: BufMut<'_>) -> CommResult<()> {
        let raw = RawBuf::new(buf.bytes.as_mut_ptr(), buf.bytes.len(), buf.dtype);
        self.submit("all_gather", move |c| c.all_gather_buf(unsafe { raw.buf_mut() })).wait()
    }

    fn all_to_all_buf(&self, input: BufRef<'_>, output: BufMut<'_>) -> CommResult<()> {
        let i = RawBuf::new(input.bytes.as_ptr() as *mut u8, input.bytes.len(), input.dtype);
        let o = RawBuf::new(output.bytes.as_mut_ptr(), output.bytes.len(), output.dtype);
        self.submit("all_to_all", move |c| c.all_to_all_buf(unsafe { i.buf_ref() }, unsafe { o.buf_mut() })).wait()
    }

    fn all_to_all_v_buf(
        &self,
        input: BufRef<'_>,
        send: &[usize],
        output: BufMut<'_>,
        recv: &[usize],
    ) -> CommResult<()> {
        let i = RawBuf::new(input.bytes.as_ptr() as *mut u8, input.bytes.len(), input.dtype);
        let o = RawBuf::new(output.bytes.as_mut_ptr(), output.bytes.len(), output.dtype);
        let (send, recv) = (send.to_vec(), recv.to_vec());
        self.submit("all_to_all", move |c| {
            c.all_to_all_v_buf(unsafe { i.buf_ref() }, &send, unsafe { o.buf_mut() }, &recv)
        })
        .wait()
    }

    fn reduce_scatter_quantized_buf(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        block: usize,
    ) -> CommResult<()> {
        let i = RawBuf::new(input.bytes.as_ptr() as *mut u8, input.bytes.len(), input.dtype);
        let o = RawBuf::new(output.bytes.as_mut_ptr(), output.bytes.len(), output.dtype);
        self.submit("reduce_scatter", move |c| {
            c.reduce_scatter_quantized_buf(unsafe { i.buf_ref() }, unsafe { o.buf_mut() }, op, block)
        })
        .wait()
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> CommResult<()> {
        let raw = RawBuf::new(buf.bytes.as_mut_ptr(), buf.bytes.len(), buf.dtype);
        self.submit("broadcast", move |c| c.broadcast_buf(unsafe { raw.buf_mut() }, root)).wait()
    }

    // Device buffers are addresses (Copy, Send): the job carries them; the caller keeps the memory alive until the
    // wait returns, as for the host buffers above.
    unsafe fn all_reduce_device(&self, buf: DeviceBuf, op: ReduceOp) -> CommResult<bool> {
        // SAFETY: the caller's, passed on; the call waits for the job.
        self.submit("all_reduce", move |c| unsafe { c.all_reduce_device(buf, op) }).wait()
    }

    unsafe fn reduce_scatter_device(&self, input: DeviceBuf, output: DeviceBuf, op: ReduceOp) -> CommResult<bool> {
        // SAFETY: as above.
        self.submit("reduce_scatter", move |c| unsafe { c.reduce_scatter_device(input, output, op) }).wait()
    }

    unsafe fn all_gather_device(&self, buf: DeviceBuf) -> CommResult<bool> {
        // SAFETY: as above.
        self.submit("all_gather", move |c| unsafe { c.all_gather_device(buf) }).wait()
    }

    unsafe fn broadcast_device(&self, buf: DeviceBuf, root: usize) -> CommResult<bool> {
        // SAFETY: as above.
        self.submit("broadcast", move |c| unsafe { c.broadcast_device(buf, root) }).wait()
    }

    fn window(&self, local: &mut [u8]) -> CommResult<Option<Vec<usize>>> {
        let raw = RawBuf::new(local.as_mut_ptr(), local.len(), Dtype::I64);
        self.submit("window", move |c| c.window(unsafe { raw.buf_mut() }.bytes)).wait()
    }

    fn forget_gathered_pages(&self) {
        // Only backends that map the peers' buffers read their pages (no round trip to the thread otherwise).
        if !self.shared_buffers {
            return;
        }
        // On the thread that ran the all-gather, after it (jobs run in order).
        let _ = self
            .submit("forget_gathered_pages", |c| {
                c.forget_gathered_pages();
                Ok(())
            })
            .wait();
    }

    fn barrier(&self) -> CommResult<()> {
        self.submit("barrier", |c| c.barrier()).wait()
    }

    fn send_buf(&self, buf: BufRef<'_>, dst: usize) -> CommResult<()> {
        let raw = RawBuf::new(buf.bytes.as_ptr() as *mut u8, buf.bytes.len(), buf.dtype);
        self.submit("send", move |c| c.send_buf(unsafe { raw.buf_ref() }, dst)).wait()
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize) -> CommResult<()> {
        let raw = RawBuf::new(buf.bytes.as_mut_ptr(), buf.bytes.len(), buf.dtype);
        self.submit("recv", move |c| c.recv_buf(unsafe { raw.buf_mut() }, src)).wait()
    }

    fn split_group(&self, split: &Split) -> CommResult<Option<Box<dyn Communicator>>> {
        let split = split.clone();
        self.submit("split", move |c| c.split_group(&split)).wait()
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend without device collectives answers "not here" through the communication thread too, so the
    /// engine stages a device tensor through host memory instead of waiting on a collective no backend runs.
    #[test]
    fn device_collectives_fall_back_through_the_thread() {
        let comm = crate::threads::group(1, Duration::from_secs(5)).pop().unwrap();
        let thread = CommThread::spawn(Box::new(comm));
        let buf = DeviceBuf { ptr: 0x1000, count: 4, dtype: Dtype::F32, device: 0 };
        // SAFETY: the default methods never touch the memory.
        unsafe {
            assert!(!thread.all_reduce_device(buf, ReduceOp::Sum).unwrap());
            assert!(!thread.reduce_scatter_device(buf, buf, ReduceOp::Sum).unwrap());
            assert!(!thread.all_gather_device(buf).unwrap());
            assert!(!thread.broadcast_device(buf, 0).unwrap());
        }
    }
}
