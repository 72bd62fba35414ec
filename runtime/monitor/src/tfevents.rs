//! TensorBoard event files, written as TensorBoard's own writer does (tensorboard/summary/writer/): a file
//! `events.out.tfevents.<secs>.<host>.<pid>.<n>` of TFRecords, each `u64 length | masked CRC32C of the length |
//! data | masked CRC32C of the data` (little-endian), the data an `Event` protobuf. The first event carries
//! `file_version = "brain.Event:2"`; each scalar is `Event { wall_time, step, summary: Summary { value: [Value { tag,
//! simple_value }] } }`, the form TensorBoard's readers all take.
//!
//! The five protobuf fields are encoded here by hand (field numbers from tensorboard/compat/proto/event.proto and
//! summary.proto): a protobuf crate would bring code generation for two messages.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{MonitorError, Result};

/// LevelDB's mask on a CRC stored beside the data it covers (TFRecord's framing).
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xA282_EAD8)
}

/// One TFRecord around `data`.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(number: u32, data: &[u8], out: &mut Vec<u8>) {
    varint(((number << 3) | 2) as u64, out);
    varint(data.len() as u64, out);
    out.extend_from_slice(data);
}

/// `Event.wall_time` (1, double) and `Event.step` (2, int64; proto3 leaves 0 out).
fn event_head(wall_time: f64, step: i64, out: &mut Vec<u8>) {
    out.push(0x09);
    out.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        out.push(0x10);
        varint(step as u64, out);
    }
}

/// The first event of a file: `file_version = "brain.Event:2"` (field 3).
pub fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut out = Vec::new();
    event_head(wall_time, 0, &mut out);
    bytes_field(3, b"brain.Event:2", &mut out);
    out
}

/// A scalar event: `Event { wall_time, step, summary (5): Summary { value (1): Value { tag (1), simple_value (2, float) } } }`.
pub fn scalar_event(wall_time: f64, step: i64, tag: &str, value: f32) -> Vec<u8> {
    let mut v = Vec::new();
    bytes_field(1, tag.as_bytes(), &mut v);
    v.push(0x15);
    v.extend_from_slice(&value.to_le_bytes());
    let mut summary = Vec::new();
    bytes_field(1, &v, &mut summary);
    let mut out = Vec::new();
    event_head(wall_time, step, &mut out);
    bytes_field(5, &summary, &mut out);
    out
}

fn now_secs() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// An event file being written.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir` and a new event file in it named as TensorBoard's writer names them, and writes the
    /// file-version event.
    pub fn create_in(dir: &Path) -> Result<EventWriter> {
        static FILES: AtomicU64 = AtomicU64::new(0);
        std::fs::create_dir_all(dir).map_err(|e| MonitorError::io(dir, e))?;
        let now = now_secs();
        let name = format!(
            "events.out.tfevents.{:010}.{}.{}.{}",
            now as u64,
            hostname(),
            std::process::id(),
            FILES.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = File::create(&path).map_err(|e| MonitorError::io(&path, e))?;
        let mut w = EventWriter { path, out: BufWriter::new(file) };
        w.write_record(&file_version_event(now))?;
        w.flush()?;
        Ok(w)
    }

    fn write_record(&mut self, data: &[u8]) -> Result<()> {
        self.out.write_all(&record(data)).map_err(|e| MonitorError::io(&self.path, e))
    }

    /// Appends a scalar (TensorBoard keeps scalars as f32).
    pub fn write_scalar(&mut self, tag: &str, value: f32, step: i64) -> Result<()> {
        self.write_record(&scalar_event(now_secs(), step, tag, value))
    }

    /// Hands what was written to the file system.
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|e| MonitorError::io(&self.path, e))
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn crcs_match_the_published_vectors() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8A91_36AA);
        // From a real TensorFlow file (rustboard's masked_crc test).
        assert_eq!(masked_crc32c(b"\x1a\x11CRC test, one two"), 0x5794_D08A);
    }

    #[test]
    fn events_encode_to_the_reference_bytes() {
        let scalar = scalar_event(1_700_000_000.0, 128, "Train/Samples/train_loss", 2.5);
        let mut want = hex("09 00000040fc54d941 10 8001 2a 21 0a 1f 0a 18");
        want.extend_from_slice(b"Train/Samples/train_loss");
        want.extend_from_slice(&hex("15 00002040"));
        assert_eq!(scalar, want);
        assert_eq!(scalar.len(), 47);
        let rec = record(&scalar);
        assert_eq!(&rec[8..12], &0x501D_5D6Du32.to_le_bytes());
        assert_eq!(&rec[rec.len() - 4..], &0x806D_244Du32.to_le_bytes());
        let version = file_version_event(1_700_000_000.0);
        let mut want = hex("09 00000040fc54d941 1a 0d");
        want.extend_from_slice(b"brain.Event:2");
        assert_eq!(version, want);
        let rec = record(&version);
        assert_eq!(&rec[8..12], &0x224B_7FA3u32.to_le_bytes());
        assert_eq!(&rec[rec.len() - 4..], &0x9D8F_EDECu32.to_le_bytes());
    }

    #[test]
    fn a_file_holds_whole_records_after_every_flush() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create_in(&dir.path().join("job")).unwrap();
        w.write_scalar("a", 1.0, 8).unwrap();
        w.flush().unwrap();
        let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let bytes = std::fs::read(w.path()).unwrap();
        // Walk the records: every length and CRC checks.
        let (mut at, mut n) = (0, 0);
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            assert_eq!(masked_crc32c(&bytes[at..at + 8]).to_le_bytes(), bytes[at + 8..at + 12]);
            let data = &bytes[at + 12..at + 12 + len];
            assert_eq!(masked_crc32c(data).to_le_bytes(), bytes[at + 12 + len..at + 16 + len]);
            at += 16 + len;
            n += 1;
        }
        assert_eq!(n, 2);
    }
}
