//! One swap file: positioned reads and writes with O_DIRECT (bypassing the page cache, as DeepNVMe does), or
//! buffered I/O where the filesystem refuses O_DIRECT, with one warning. The file is opened for every operation,
//! so a file removed under a run is an error naming it, not a silent read of an unlinked inode.
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{OffloadError, Result};

static WARNED_BUFFERED: AtomicBool = AtomicBool::new(false);

#[derive(Debug)]
/// One file of swapped data, opened with O_DIRECT where the file system allows it (reads and writes of whole aligned blocks).
pub struct SwapFile {
    path: PathBuf,
    direct: AtomicBool,
}

fn io_err(path: &Path, offset: u64, e: impl std::fmt::Display) -> OffloadError {
    OffloadError::Io { path: path.to_path_buf(), offset, what: e.to_string() }
}

impl SwapFile {
    /// Creates (or truncates) the file. I/O buffers, offsets and lengths must be multiples of 4 KiB for O_DIRECT.
    pub fn create(path: &Path) -> Result<SwapFile> {
        let f = SwapFile { path: path.to_path_buf(), direct: AtomicBool::new(true) };
        let file = f.open(true, true)?;
        drop(file);
        Ok(f)
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether I/O bypasses the page cache (false after the filesystem refused O_DIRECT).
    pub fn is_direct(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    fn open(&self, write: bool, create: bool) -> Result<File> {
        let mut o = OpenOptions::new();
        o.read(true).write(write).create(create).truncate(create);
        if self.is_direct() {
            match o.clone().custom_flags(libc::O_DIRECT).open(&self.path) {
                Ok(f) => return Ok(f),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    self.direct.store(false, Ordering::Relaxed);
                    if !WARNED_BUFFERED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(path = %self.path.display(), "the filesystem refuses O_DIRECT; swap files use buffered I/O (page cache)");
                    }
                }
                Err(e) => return Err(io_err(&self.path, 0, format!("cannot open: {e}"))),
            }
        }
        o.open(&self.path).map_err(|e| io_err(&self.path, 0, format!("cannot open: {e}")))
    }

    /// Opens the file for a batch of operations (see [`SwapFile::write_at`]).
    pub fn open_for(&self, write: bool) -> Result<File> {
        if !write && !self.path.exists() {
            return Err(io_err(&self.path, 0, "the swap file is gone (removed while the run used it)"));
        }
        self.open(write, false)
    }

    /// Writes all of `buf` at `offset` of an opened `file`; short writes continue, errors name the offset.
    pub fn write_at(&self, file: &File, offset: u64, buf: &[u8]) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match file.write_at(&buf[done..], offset + done as u64) {
                Ok(0) => return Err(io_err(&self.path, offset + done as u64, "write returned 0 bytes")),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(io_err(
                        &self.path,
                        offset + done as u64,
                        format!("write of {} bytes failed: {e}", buf.len() - done),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Fills `buf` from `offset` of an opened `file`; reaching the end first is a short read, named.
    pub fn read_at(&self, file: &File, offset: u64, buf: &mut [u8]) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    return Err(io_err(
                        &self.path,
                        offset + done as u64,
                        format!("short read: {} of {} bytes", done, buf.len()),
                    ))
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(&self.path, offset + done as u64, format!("read failed: {e}"))),
            }
        }
        Ok(())
    }

    /// Makes written data durable (buffered mode; O_DIRECT writes are already past the cache).
    pub fn sync(&self, file: &File) -> Result<()> {
        file.sync_data().map_err(|e| io_err(&self.path, 0, format!("fsync: {e}")))
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
