//! File mechanics: atomic replacement, checksums, a streaming safetensors writer and a memory-mapped reader.
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;

use memmap2::Mmap;

use super::{io_err, CheckpointError, Result};

/// Writes `bytes` to `path` atomically: a temporary file, fsync, rename, fsync of the folder.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
    f.write_all(bytes).map_err(|e| io_err(&tmp, e))?;
    f.sync_all().map_err(|e| io_err(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// fsyncs a folder, so the names created in it survive a crash.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io_err(dir, e))
}

/// CRC-32 of a whole file.
pub fn crc_of(path: &Path) -> Result<u32> {
    let mut f =
        File::open(path).map_err(|e| CheckpointError::Missing { path: path.to_path_buf(), what: e.to_string() })?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize())
}

/// Writes tensors of one dtype (`"F32"` with 4-byte or `"BF16"` with 2-byte elements) as safetensors, one at a
/// time, so memory stays bounded by the largest tensor the caller holds. `tensors` gives (name, shape);
/// `fill(i, out)` appends tensor i's little-endian bytes. The file is written under a temporary name, fsynced and
/// renamed; returns its CRC-32.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>)],
    dtype: &str,
    fill: impl FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
) -> Result<u32> {
    let typed: Vec<(String, Vec<usize>, String)> =
        tensors.iter().map(|(n, s)| (n.clone(), s.clone(), dtype.to_string())).collect();
    write_safetensors_typed(path, &typed, fill)
}

/// Bytes of one element of a safetensors dtype.
pub fn dtype_size(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "I8" | "U8" | "BOOL" => 1,
        _ => return None,
    })
}

/// [`write_safetensors`] with a dtype per tensor: (name, shape, dtype).
pub fn write_safetensors_typed(
    path: &Path,
    tensors: &[(String, Vec<usize>, String)],
    mut fill: impl FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
) -> Result<u32> {
    let mut w = SafetensorsWriter::create(path, tensors)?;
    for i in 0..tensors.len() {
        w.tensor(|out| fill(i, out))?;
    }
    w.finish()
}

/// A safetensors file written tensor by tensor in the order its header lists them (the header is written first:
/// every name, shape and dtype is known up front), under a temporary name until [`SafetensorsWriter::finish`]
/// fsyncs and renames it. Memory stays bounded by what the caller holds of one tensor.
pub struct SafetensorsWriter {
    path: std::path::PathBuf,
    tmp: std::path::PathBuf,
    names: Vec<String>,
    /// Where each tensor's bytes end, from the start of the data.
    ends: Vec<usize>,
    next: usize,
    data_start: usize,
    w: CrcWriter<BufWriter<File>>,
}

impl SafetensorsWriter {
    /// Starts `path` with the header of `tensors`: (name, shape, safetensors dtype).
    pub fn create(path: &Path, tensors: &[(String, Vec<usize>, String)]) -> Result<SafetensorsWriter> {
        let mut header = BTreeMap::new();
        let mut offset = 0usize;
        let mut ends = Vec::with_capacity(tensors.len());
        for (name, shape, dtype) in tensors {
            let elem = dtype_size(dtype)
                .ok_or_else(|| io_err(path, format!("tensor `{name}`: no safetensors dtype {dtype:?}")))?;
            let bytes = shape.iter().product::<usize>() * elem;
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
            );
            offset += bytes;
            ends.push(offset);
        }
        let mut text = serde_json::to_string(&header).expect("header serializes");
        while text.len() % 8 != 0 {
            text.push(' ');
        }
        let tmp = path.with_extension("tmp");
        let file = File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
        let w = CrcWriter { inner: BufWriter::with_capacity(1 << 20, file), crc: crc32fast::Hasher::new(), written: 0 };
        let names = tensors.iter().map(|t| t.0.clone()).collect();
        let mut writer = SafetensorsWriter { path: path.to_path_buf(), tmp, names, ends, next: 0, data_start: 0, w };
        writer.write(&(text.len() as u64).to_le_bytes())?;
        writer.write(text.as_bytes())?;
        writer.data_start = writer.w.written;
        Ok(writer)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let at = self.w.written;
        self.w.write_all(bytes).map_err(|e| io_err(&self.tmp, format!("{e} (at byte offset {at})")))
    }

    /// The next tensor's bytes: `fill` writes them (little-endian), exactly as many as its shape and dtype hold.
    pub fn tensor(&mut self, fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
        let name =
            self.names.get(self.next).cloned().ok_or_else(|| io_err(&self.tmp, "more tensors than the header"))?;
        let at = self.w.written;
        fill(&mut self.w).map_err(|e| io_err(&self.tmp, format!("tensor `{name}`: {e} (at byte offset {at})")))?;
        let expected = self.data_start + self.ends[self.next];
        if self.w.written != expected {
            return Err(io_err(
                &self.tmp,
                format!("tensor `{name}` wrote {} bytes too few or many", self.w.written as i64 - expected as i64),
            ));
        }
        self.next += 1;
        Ok(())
    }

    /// Fsyncs the file and renames it into place; returns its CRC-32. Every tensor must have been written.
    pub fn finish(self) -> Result<u32> {
        if self.next != self.names.len() {
            return Err(io_err(&self.tmp, format!("{} of {} tensors written", self.next, self.names.len())));
        }
        let crc = self.w.crc.clone().finalize();
        let file = self.w.inner.into_inner().map_err(|e| io_err(&self.tmp, e.error()))?;
        file.sync_all().map_err(|e| io_err(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.path).map_err(|e| io_err(&self.path, e))?;
        Ok(crc)
    }
}

struct CrcWriter<W: Write> {
    inner: W,
    crc: crc32fast::Hasher,
    written: usize,
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        self.written += n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Appends f32 values as little-endian bytes.
pub fn write_f32(w: &mut dyn Write, v: &[f32]) -> std::io::Result<()> {
    w.write_all(bytemuck::cast_slice(v))
}

/// A memory-mapped safetensors file: only the pages of the ranges read are loaded.
pub struct MappedTensors {
    map: Mmap,
    path: std::path::PathBuf,
}

impl MappedTensors {
    /// Maps the safetensors file at `path` (read-only) and reads its header.
    pub fn open(path: &Path) -> Result<MappedTensors> {
        let f =
            File::open(path).map_err(|e| CheckpointError::Missing { path: path.to_path_buf(), what: e.to_string() })?;
        // SAFETY: checkpoint files are not modified while mapped (new checkpoints go to new files).
        let map = unsafe { Mmap::map(&f) }.map_err(|e| io_err(path, e))?;
        safetensors::SafeTensors::deserialize(&map)
            .map_err(|e| io_err(path, format!("not a valid safetensors file: {e}")))?;
        Ok(MappedTensors { map, path: path.to_path_buf() })
    }

    /// Whether the file holds tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        safetensors::SafeTensors::deserialize(&self.map).is_ok_and(|st| st.tensor(name).is_ok())
    }

    /// Tensor `name` whole: its safetensors dtype, shape and little-endian bytes (borrowed from the mapping).
    pub fn raw(&self, name: &str) -> Result<(String, Vec<usize>, &[u8])> {
        let st = safetensors::SafeTensors::deserialize(&self.map).map_err(|e| io_err(&self.path, e))?;
        let t = st.tensor(name).map_err(|e| io_err(&self.path, format!("tensor `{name}`: {e}")))?;
        let (dtype, shape) = (format!("{:?}", t.dtype()), t.shape().to_vec());
        let data: *const [u8] = t.data();
        // SAFETY: `data` points into `self.map`, which lives as long as the borrow of `self`.
        Ok((dtype, shape, unsafe { &*data }))
    }

    /// Elements `range` of f32 tensor `name` into `out`.
    pub fn read_f32(&self, name: &str, range: std::ops::Range<usize>, out: &mut [f32]) -> Result<()> {
        let st = safetensors::SafeTensors::deserialize(&self.map).map_err(|e| io_err(&self.path, e))?;
        let t = st.tensor(name).map_err(|e| io_err(&self.path, format!("tensor `{name}`: {e}")))?;
        let data = t.data();
        let bytes = data.get(range.start * 4..range.end * 4).ok_or_else(|| {
            io_err(&self.path, format!("tensor `{name}` has {} elements, wanted {range:?}", data.len() / 4))
        })?;
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes(c.try_into().expect("4 bytes"));
        }
        Ok(())
    }
}
