//! `zerorun bench swap [--dir D] [--size BYTES] [--json]`: write and read GiB/s of the NVMe swapper on folder D
//! beside `dd` with oflag=direct / iflag=direct on the same folder and size, measured in the same run.
//!
//! `--pattern training [--chunk BYTES] [--ranks R]`: the access pattern of a training step with states on NVMe
//! instead of one stream: R ranks at once (threads, each with its own swapper and files, as rank processes have),
//! each walking its `size` bytes in chunks (a unit's parameter shard, a sub-group's states) in order, reading the
//! next chunk ahead while the current one is written back: reads and writes mixed on the disk. It gives the
//! disk's rate per rank under that pattern and each read's time from its request to its data.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use zerorun_offload::{preflight, HostBuffer, IoConfig, Swapper};

use super::{emit, CliError};

pub struct SwapBenchArgs {
    pub dir: PathBuf,
    pub size: usize,
    pub io: IoConfig,
    pub repeats: usize,
    pub json: bool,
    /// None: one stream (and dd beside it); Some: the training pattern.
    pub training: Option<TrainingPattern>,
}

/// [`run`]'s training pattern: `ranks` ranks at once, each over its bytes in `chunk`-byte requests.
#[derive(Clone, Copy)]
pub struct TrainingPattern {
    pub chunk: usize,
    pub ranks: usize,
}

/// One rank's walk: its chunks written, then read in order with the next read ahead and each written back
/// behind; (seconds of the walk, each read's seconds from request to data).
fn walk(swapper: &Swapper, size: usize, chunk: usize) -> Result<(f64, Vec<f64>), CliError> {
    let err = |e: zerorun_offload::OffloadError| CliError::Usage(e.to_string());
    let chunks = size.div_ceil(chunk);
    let key = |i: usize| format!("chunk{i}");
    // Laid out once (the run before the step), not timed.
    for i in 0..chunks {
        let mut buf = HostBuffer::new(chunk);
        buf.as_mut_slice().fill(i as u8);
        swapper.swap_out(&key(i), buf, chunk).wait().map_err(err)?;
    }
    let started = Instant::now();
    let mut reads = Vec::with_capacity(chunks);
    let mut ahead = Some((Instant::now(), swapper.swap_in(&key(0), HostBuffer::new(chunk))));
    let mut behind: Option<zerorun_offload::SwapHandle<HostBuffer>> = None;
    for i in 0..chunks {
        let (asked, handle) = ahead.take().expect("read ahead");
        let buf = handle.wait().map_err(err)?;
        reads.push(asked.elapsed().as_secs_f64());
        if buf.as_slice()[chunk - 1] != i as u8 {
            return Err(CliError::Usage(format!("bench swap: chunk {i} read back other bytes than were written")));
        }
        if i + 1 < chunks {
            ahead = Some((Instant::now(), swapper.swap_in(&key(i + 1), HostBuffer::new(chunk))));
        }
        // The previous chunk's write ends before this one's starts: one write in flight, as the step's write-behind.
        if let Some(h) = behind.take() {
            h.wait().map_err(err)?;
        }
        behind = Some(swapper.swap_out(&key(i), buf, chunk));
    }
    if let Some(h) = behind {
        h.wait().map_err(err)?;
    }
    Ok((started.elapsed().as_secs_f64(), reads))
}

fn training(a: &SwapBenchArgs, p: TrainingPattern) -> Result<(), CliError> {
    let chunk = p.chunk.div_ceil(zerorun_offload::PAGE).max(1) * zerorun_offload::PAGE;
    let size = a.size.div_ceil(chunk).max(1) * chunk;
    preflight::check(&a.dir, (p.ranks * size) as u64).map_err(|e| CliError::Usage(e.to_string()))?;
    let mut progress = super::progress::Progress::new("bench swap", a.repeats as u64);
    let (mut rates, mut reads) = (Vec::new(), Vec::new());
    for repeat in 0..a.repeats {
        progress.item(&format!("{} ranks' training pattern, repeat {}", p.ranks, repeat + 1));
        let walks: Vec<Result<(f64, Vec<f64>), CliError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..p.ranks)
                .map(|r| {
                    let dir = a.dir.clone();
                    let io = a.io;
                    scope.spawn(move || {
                        let swapper = Swapper::new(&dir, &format!("zerorun-bench-{}-rank{r}", std::process::id()), io);
                        walk(&swapper, size, chunk)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a bench rank panicked")).collect()
        });
        for w in walks {
            let (seconds, r) = w?;
            // Each rank read and wrote its bytes.
            rates.push(2.0 * size as f64 / seconds);
            reads.extend(r);
        }
        progress.done();
    }
    drop(progress);
    let rate = median(rates);
    reads.sort_by(f64::total_cmp);
    let (p50, p90) = (reads[reads.len() / 2], reads[(reads.len() * 9 / 10).min(reads.len() - 1)]);
    if a.json {
        let row = serde_json::json!({
            "dir": a.dir.display().to_string(), "pattern": "training", "ranks": p.ranks, "chunk_bytes": chunk,
            "size_bytes_per_rank": size, "block_size": a.io.block_size, "queue_depth": a.io.queue_depth,
            "read_write_gibps_per_rank": rate / GIB, "read_seconds_median": p50, "read_seconds_p90": p90,
        });
        return emit(&row.to_string());
    }
    emit(&format!(
        "swap bench on {}, the training pattern: {} ranks at once, each {} MiB in {} KiB chunks read ahead and written behind (block {} KiB, queue depth {}, median of {}):\n  read + write  {:.2} GiB/s per rank ({:.2} GiB/s for the {} ranks)\n  a chunk's read from request to data: median {:.2} ms, p90 {:.2} ms",
        a.dir.display(),
        p.ranks,
        size >> 20,
        chunk >> 10,
        a.io.block_size >> 10,
        a.io.queue_depth,
        a.repeats,
        rate / GIB,
        rate * p.ranks as f64 / GIB,
        p.ranks,
        1e3 * p50,
        1e3 * p90
    ))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

const GIB: f64 = (1u64 << 30) as f64;

/// Seconds `dd` takes with these arguments; None when it fails (e.g. O_DIRECT refused).
fn dd(args: &[String]) -> Option<f64> {
    let t = Instant::now();
    let out = Command::new("dd").args(args).output().ok()?;
    out.status.success().then(|| t.elapsed().as_secs_f64())
}

/// dd write and read of `size` bytes in 1 MiB blocks: (write s, read s, whether O_DIRECT was used).
fn dd_times(dir: &Path, size: usize) -> Result<(f64, f64, bool), CliError> {
    let file = dir.join(format!("zerorun-bench-dd-{}.bin", std::process::id()));
    let of = format!("of={}", file.display());
    let iff = format!("if={}", file.display());
    let count = format!("count={}", size.div_ceil(1 << 20));
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let direct = dd(&s(&["if=/dev/zero", &of, "bs=1M", &count, "oflag=direct", "status=none"]));
    let result = match direct {
        Some(w) => dd(&s(&[&iff, "of=/dev/null", "bs=1M", "iflag=direct", "status=none"])).map(|r| (w, r, true)),
        None => {
            // O_DIRECT refused: buffered dd with the data flushed, reading back after dropping nothing (cached).
            let w = dd(&s(&["if=/dev/zero", &of, "bs=1M", &count, "conv=fdatasync", "status=none"]));
            w.and_then(|w| dd(&s(&[&iff, "of=/dev/null", "bs=1M", "status=none"])).map(|r| (w, r, false)))
        }
    };
    let _ = std::fs::remove_file(&file);
    result.ok_or_else(|| {
        CliError::Usage(format!("dd failed on {} (is dd installed and the folder writable?)", dir.display()))
    })
}

pub fn run(a: SwapBenchArgs) -> Result<(), CliError> {
    if let Some(p) = a.training {
        return training(&a, p);
    }
    let size = a.size.div_ceil(1 << 20).max(1) << 20;
    preflight::check(&a.dir, 2 * size as u64).map_err(|e| CliError::Usage(e.to_string()))?;
    let swapper = Swapper::new(&a.dir, &format!("zerorun-bench-{}", std::process::id()), a.io);
    let mut buf = HostBuffer::new(size);
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(151);
    }
    let first = buf.as_slice()[size - 1];
    let (mut writes, mut reads) = (Vec::new(), Vec::new());
    let err = |e: zerorun_offload::OffloadError| CliError::Usage(e.to_string());
    let mut progress = super::progress::Progress::new("bench swap", 2 * a.repeats as u64);
    for i in 0..a.repeats {
        progress.item(&format!("zerorun's swapper, repeat {}", i + 1));
        let t = Instant::now();
        buf = swapper.swap_out("bench", buf, size).wait().map_err(err)?;
        writes.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        buf = swapper.swap_in("bench", buf).wait().map_err(err)?;
        reads.push(t.elapsed().as_secs_f64());
        progress.done();
    }
    if buf.as_slice()[size - 1] != first {
        return Err(CliError::Usage("the swapper read back other bytes than it wrote".into()));
    }
    let direct = zerorun_offload::SwapFile::create(&a.dir.join(format!("zerorun-bench-probe-{}", std::process::id())))
        .map(|f| f.is_direct())
        .unwrap_or(false);
    drop(swapper);
    let (mut dd_w, mut dd_r) = (Vec::new(), Vec::new());
    let mut dd_direct = true;
    for i in 0..a.repeats {
        progress.item(&format!("dd with O_DIRECT, repeat {}", i + 1));
        let (w, r, d) = dd_times(&a.dir, size)?;
        dd_w.push(w);
        dd_r.push(r);
        dd_direct &= d;
        progress.done();
    }
    drop(progress);
    let gibps = |s: f64| size as f64 / GIB / s;
    let (w, r, dw, dr) = (gibps(median(writes)), gibps(median(reads)), gibps(median(dd_w)), gibps(median(dd_r)));
    if a.json {
        let row = serde_json::json!({
            "dir": a.dir.display().to_string(), "size_bytes": size, "o_direct": direct, "dd_direct": dd_direct,
            "block_size": a.io.block_size, "queue_depth": a.io.queue_depth, "intra_op_parallelism": a.io.intra_op_parallelism,
            "write_gibps": w, "read_gibps": r, "dd_write_gibps": dw, "dd_read_gibps": dr,
            "write_vs_dd": w / dw, "read_vs_dd": r / dr
        });
        return emit(&row.to_string());
    }
    emit(&format!(
        "swap bench on {} ({} MiB, O_DIRECT {direct}, dd direct {dd_direct}, block {} KiB, queue depth {}, {} threads, median of {}):\n  write  swapper {w:.2} GiB/s   dd {dw:.2} GiB/s   ratio {:.2}\n  read   swapper {r:.2} GiB/s   dd {dr:.2} GiB/s   ratio {:.2}",
        a.dir.display(),
        size >> 20,
        a.io.block_size >> 10,
        a.io.queue_depth,
        a.io.intra_op_parallelism,
        a.repeats,
        w / dw,
        r / dr
    ))
}
