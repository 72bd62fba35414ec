//! `zerorun bench swap [--dir D] [--size BYTES] [--json]`: write and read GiB/s of the NVMe swapper on folder D
//! beside `dd` with oflag=direct / iflag=direct on the same folder and size, measured in the same run.
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
