//! The asynchronous swapper: byte buffers by key to and from swap files (one per key) on I/O threads, so reading
//! sub-group k+1 and writing k-1 run while the optimizer steps k (DeepSpeed's pipelined swapper). Reads and
//! writes have a thread each; a read of a key first waits for that key's write, so order is safe by construction.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::buffer::{HostBuffer, PAGE};
use crate::error::{OffloadError, Result};
use crate::io::{self, IoConfig};
use crate::swap_file::SwapFile;

type Job = Box<dyn FnOnce() + Send>;

struct Worker {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    fn spawn(name: String) -> Worker {
        let (tx, rx) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .expect("spawning an offload I/O thread");
        Worker { tx: Some(tx), thread: Some(thread) }
    }

    fn submit(&self, job: Job) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A swap in or out in flight.
pub struct SwapHandle<T> {
    rx: Receiver<Result<T>>,
    op: &'static str,
    key: String,
}

impl<T> SwapHandle<T> {
    /// Blocks until the I/O finished; its error names the file and offset.
    pub fn wait(self) -> Result<T> {
        self.rx.recv().unwrap_or(Err(OffloadError::WorkerGone { op: self.op, key: self.key }))
    }

    fn ready(op: &'static str, key: &str, r: Result<T>) -> Self {
        let (tx, rx) = channel();
        let _ = tx.send(r);
        SwapHandle { rx, op, key: key.to_string() }
    }
}

struct Entry {
    file: Arc<SwapFile>,
    bytes: usize,
    /// Signalled when the last write of this key has ended.
    write_done: Option<Receiver<()>>,
}

/// Moves host buffers to and from swap files on a pool of I/O threads (`aio.intra_op_parallelism`), `aio.queue_depth` requests in flight.
pub struct Swapper {
    dir: PathBuf,
    prefix: String,
    io: IoConfig,
    entries: Mutex<HashMap<String, Entry>>,
    // Drop (below) joins the workers before the entries go, so no I/O outlives its file.
    reader: Worker,
    writer: Worker,
}

impl Swapper {
    /// Swap files go to `dir` named `{prefix}-{key}.swp`; they are removed when the swapper is dropped.
    pub fn new(dir: &Path, prefix: &str, io: IoConfig) -> Swapper {
        Swapper {
            dir: dir.to_path_buf(),
            prefix: prefix.to_string(),
            io,
            entries: Mutex::new(HashMap::new()),
            reader: Worker::spawn(format!("zerorun-swap-in-{prefix}")),
            writer: Worker::spawn(format!("zerorun-swap-out-{prefix}")),
        }
    }

    fn path_of(&self, key: &str) -> PathBuf {
        let clean: String =
            key.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
        self.dir.join(format!("{}-{clean}.swp", self.prefix))
    }

    /// Where `key` is stored (for error messages and tests).
    pub fn file_of(&self, key: &str) -> Option<PathBuf> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).get(key).map(|e| e.file.path().to_path_buf())
    }

    /// Bytes swapped out under `key`.
    pub fn len_of(&self, key: &str) -> Option<usize> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).get(key).map(|e| e.bytes)
    }

    /// Writes the first `bytes` of `buf` under `key`; the handle gives the buffer back when it is on disk.
    pub fn swap_out(&self, key: &str, buf: HostBuffer, bytes: usize) -> SwapHandle<HostBuffer> {
        assert!(bytes <= buf.capacity(), "swap_out of {bytes} bytes from a buffer of {}", buf.capacity());
        let file = {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            let file = match entries.get(key) {
                Some(e) => e.file.clone(),
                None => match SwapFile::create(&self.path_of(key)) {
                    Ok(f) => Arc::new(f),
                    Err(e) => return SwapHandle::ready("swap_out", key, Err(e)),
                },
            };
            let (done_tx, done_rx) = channel();
            entries.insert(key.to_string(), Entry { file: file.clone(), bytes, write_done: Some(done_rx) });
            (file, done_tx)
        };
        let (file, done_tx) = file;
        let (tx, rx) = channel();
        let cfg = self.io;
        let job: Job = Box::new(move || {
            let len = bytes.div_ceil(PAGE) * PAGE;
            let r = io::write(&cfg, &file, 0, &buf.as_slice()[..len]).map(|_| buf);
            let _ = done_tx.send(());
            let _ = tx.send(r);
        });
        if !self.writer.submit(job) {
            return SwapHandle::ready(
                "swap_out",
                key,
                Err(OffloadError::WorkerGone { op: "swap_out", key: key.into() }),
            );
        }
        SwapHandle { rx, op: "swap_out", key: key.to_string() }
    }

    /// Reads `key` into `buf` (at least as large as what was written); waits for the key's write first.
    pub fn swap_in(&self, key: &str, mut buf: HostBuffer) -> SwapHandle<HostBuffer> {
        let (file, bytes, pending) = {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            let Some(e) = entries.get_mut(key) else {
                return SwapHandle::ready(
                    "swap_in",
                    key,
                    Err(OffloadError::Key { key: key.into(), what: "was never swapped out".into() }),
                );
            };
            (e.file.clone(), e.bytes, e.write_done.take())
        };
        if buf.capacity() < bytes {
            return SwapHandle::ready(
                "swap_in",
                key,
                Err(OffloadError::Key {
                    key: key.into(),
                    what: format!("needs a buffer of {bytes} bytes, got {}", buf.capacity()),
                }),
            );
        }
        if let Some(p) = pending {
            let _ = p.recv();
        }
        let (tx, rx) = channel();
        let cfg = self.io;
        let job: Job = Box::new(move || {
            let len = bytes.div_ceil(PAGE) * PAGE;
            let r = io::read(&cfg, &file, 0, &mut buf.as_mut_slice()[..len]).map(|_| buf);
            let _ = tx.send(r);
        });
        if !self.reader.submit(job) {
            return SwapHandle::ready("swap_in", key, Err(OffloadError::WorkerGone { op: "swap_in", key: key.into() }));
        }
        SwapHandle { rx, op: "swap_in", key: key.to_string() }
    }

    /// Swap files currently on disk.
    pub fn files(&self) -> Vec<PathBuf> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).values().map(|e| e.file.path().to_path_buf()).collect()
    }
}

impl Drop for Swapper {
    fn drop(&mut self) {
        // Finish the I/O in flight before the files go (entries drop after this, removing them).
        let (r, w) = (
            std::mem::replace(&mut self.reader, Worker { tx: None, thread: None }),
            std::mem::replace(&mut self.writer, Worker { tx: None, thread: None }),
        );
        drop(r);
        drop(w);
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("zerorun-swapper-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn filled(bytes: usize, seed: u8) -> HostBuffer {
        let mut b = HostBuffer::new(bytes);
        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        b
    }

    #[test]
    fn round_trips_many_blocks_and_removes_its_files() {
        let d = dir("roundtrip");
        let cfg = IoConfig { block_size: 8192, queue_depth: 4, intra_op_parallelism: 2 };
        let files;
        {
            let s = Swapper::new(&d, "rank0", cfg);
            let bytes = 5 * 8192 + 4096;
            let a = s.swap_out("group0", filled(bytes, 1), bytes);
            let b = s.swap_out("group1", filled(bytes, 2), bytes);
            a.wait().unwrap();
            b.wait().unwrap();
            // A read right after a write of the same key sees the write.
            let again = s.swap_out("group0", filled(bytes, 9), bytes);
            let back = s.swap_in("group0", HostBuffer::new(bytes)).wait().unwrap();
            again.wait().unwrap();
            assert_eq!(&back.as_slice()[..bytes], &filled(bytes, 9).as_slice()[..bytes]);
            let back1 = s.swap_in("group1", HostBuffer::new(bytes)).wait().unwrap();
            assert_eq!(&back1.as_slice()[..bytes], &filled(bytes, 2).as_slice()[..bytes]);
            files = s.files();
            assert_eq!(files.len(), 2);
            assert!(files.iter().all(|f| f.exists()));
        }
        assert!(files.iter().all(|f| !f.exists()), "swap files are removed with the swapper");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_removed_file_and_an_unknown_key_are_errors_naming_them() {
        let d = dir("removed");
        let s = Swapper::new(&d, "rank1", IoConfig::default());
        s.swap_out("m", filled(4096, 0), 4096).wait().unwrap();
        let path = s.file_of("m").unwrap();
        std::fs::remove_file(&path).unwrap();
        let e = s.swap_in("m", HostBuffer::new(4096)).wait().unwrap_err().to_string();
        assert_eq!(e, format!("{} at offset 0: the swap file is gone (removed while the run used it)", path.display()));
        let e = s.swap_in("nope", HostBuffer::new(4096)).wait().unwrap_err().to_string();
        assert_eq!(e, "swap key `nope`: was never swapped out");
        drop(s);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "no stray files");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
