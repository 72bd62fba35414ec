//! `zerorun bench comm`: bus bandwidth of the collectives, measured by ranks the command starts itself (processes
//! through `zerorun launch` for shm, threads for the threads backend), beside a single-core memcpy.
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use zerorun_comm::env::communicator_from_env;
use zerorun_comm::region::SharedBuffer;
use zerorun_comm::{threads, BufMut, BufRef, Collectives, Communicator, Dtype, ReduceOp};

use super::{emit, CliError};

/// `all_reduce_1bit` (f32 only): the 1-bit optimizers' sign all-reduce with error feedback (`signs::all_reduce`),
/// its bandwidth counted as an fp32 all-reduce's of the same array, so it reads against `all_reduce` directly.
/// `all_to_all` runs the all-to-all of parts of any length (`all_to_all_v_buf`, what a mixture-of-experts layer
/// dispatches with) on equal parts; its bus bandwidth is nccl-tests' alltoall's, (n-1)/n of S / t.
const OPS: [&str; 7] =
    ["all_reduce", "all_reduce_1bit", "reduce_scatter", "all_gather", "all_to_all", "send_recv", "send_recv_ring"];

fn sizes(max_bytes: usize) -> Vec<usize> {
    std::iter::successors(Some(4096usize), |b| Some(b * 4)).take_while(|b| *b <= max_bytes.max(4096)).collect()
}

/// nccl-tests: algbw = S / t with S the full array; busbw = algbw * 2(n-1)/n for all-reduce, * (n-1)/n for
/// reduce-scatter and all-gather; a send/recv (one direction, rank 0 to rank 1) is S / t, and so is a ring shift
/// (`send_recv_ring`, nccl-tests' sendrecv: every rank sends S to the next and receives S from the previous at once,
/// so the link, or loopback's copies, carry both directions, as a reduce-scatter's or all-gather's exchange does).
fn busbw(op: &str, bytes: usize, ranks: usize, secs: f64) -> f64 {
    let algbw = bytes as f64 / secs / 1e9;
    let n = ranks as f64;
    match op {
        "all_reduce" | "all_reduce_1bit" => algbw * 2.0 * (n - 1.0) / n,
        "send_recv" | "send_recv_ring" => algbw,
        _ => algbw * (n - 1.0) / n,
    }
}

enum Buffer {
    Shared(SharedBuffer),
    /// u64 words keep any element type aligned.
    Heap(Vec<u64>),
}

impl Buffer {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Buffer::Shared(b) => b.as_slice_mut(),
            Buffer::Heap(v) => bytemuck::cast_slice_mut(v),
        }
    }
}

/// Sets every element of `bytes` (of `dtype`) to one.
fn fill_ones(bytes: &mut [u8], dtype: Dtype) {
    match dtype {
        Dtype::F32 => bytemuck::cast_slice_mut::<u8, f32>(bytes).fill(1.0),
        Dtype::Bf16 => bytemuck::cast_slice_mut::<u8, half::bf16>(bytes).fill(half::bf16::ONE),
        Dtype::F16 => bytemuck::cast_slice_mut::<u8, half::f16>(bytes).fill(half::f16::ONE),
        Dtype::I64 => bytemuck::cast_slice_mut::<u8, i64>(bytes).fill(1),
    }
}

/// Median seconds of one collective on this rank (rank 0's view is reported).
fn measure(c: &dyn Communicator, op: &str, bytes: usize, dtype: Dtype, repeats: usize) -> Result<f64, CliError> {
    let n = c.world_size();
    let es = dtype.size();
    let elems = (bytes / es / n).max(1) * n;
    // Allocated as the engine allocates the buffers it hands to collectives: in the shared region where the
    // backend's peers map it (shm), on the heap otherwise.
    let alloc = |len: usize| {
        if c.prefers_shared_buffers() {
            Buffer::Shared(SharedBuffer::zeroed(len * es))
        } else {
            Buffer::Heap(vec![0u64; (len * es).div_ceil(8)])
        }
    };
    let (mut buf_mem, mut out_mem) = (alloc(elems), alloc(elems / n));
    // The ring shift and the all-to-all receive a whole buffer beside the one they send.
    let mut ring_mem = (op == "send_recv_ring" || op == "all_to_all").then(|| alloc(elems));
    let mut ring = ring_mem.as_mut().map(|m| &mut m.bytes()[..elems * es]);
    let (buf, out) = (&mut buf_mem.bytes()[..elems * es], &mut out_mem.bytes()[..elems / n * es]);
    fill_ones(buf, dtype);
    let fail = |e: zerorun_comm::CommError| CliError::Usage(e.to_string());
    let mut errors = (op == "all_reduce_1bit").then(|| zerorun_comm::signs::SignErrors::new(elems, n));
    let mut times = Vec::with_capacity(repeats);
    for rep in 0..=repeats {
        c.barrier().map_err(fail)?;
        let t = Instant::now();
        match op {
            "all_reduce" => c.all_reduce_buf(BufMut { bytes: &mut *buf, dtype }, ReduceOp::Sum).map_err(fail)?,
            "all_reduce_1bit" => {
                let e = errors.as_mut().expect("made for this op");
                zerorun_comm::signs::all_reduce(c, bytemuck::cast_slice_mut(&mut *buf), &mut e.worker, &mut e.server)
                    .map_err(fail)?
            }
            "reduce_scatter" => c
                .reduce_scatter_buf(BufRef { bytes: &*buf, dtype }, BufMut { bytes: &mut *out, dtype }, ReduceOp::Sum)
                .map_err(fail)?,
            // One direction between the first two ranks; the sender's time is the transfer's (it returns once the
            // receiver has the data), and the others wait at the next barrier.
            "send_recv" => match c.rank() {
                0 => c.send_buf(BufRef { bytes: &*buf, dtype }, 1).map_err(fail)?,
                1 => c.recv_buf(BufMut { bytes: &mut *buf, dtype }, 0).map_err(fail)?,
                _ => {}
            },
            "send_recv_ring" => {
                let (next, previous) = ((c.rank() + 1) % n, (c.rank() + n - 1) % n);
                c.send_recv_buf(
                    BufRef { bytes: &*buf, dtype },
                    next,
                    BufMut { bytes: ring.as_deref_mut().expect("allocated for the ring"), dtype },
                    previous,
                )
                .map_err(fail)?
            }
            "all_to_all" => {
                let counts = vec![elems / n; n];
                let into = BufMut { bytes: ring.as_deref_mut().expect("allocated for the all-to-all"), dtype };
                c.all_to_all_v_buf(BufRef { bytes: &*buf, dtype }, &counts, into, &counts).map_err(fail)?
            }
            _ => c.all_gather_buf(BufMut { bytes: &mut *buf, dtype }).map_err(fail)?,
        }
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
        if op == "all_reduce" || op == "all_reduce_1bit" {
            fill_ones(buf, dtype); // keep values finite across repeats
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Single-core memcpy bandwidth (bytes copied per second) over 256 MiB: the best of `repeats`, or their median
/// (when every rank copies at once, so that the repeats counted overlap the other ranks' ones).
fn memcpy_gbps(repeats: usize, median: bool) -> f64 {
    let n = 64 << 20;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let mut times: Vec<f64> = (0..=repeats)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let secs = if median { times[times.len() / 2] } else { times[0] };
    (n * 4) as f64 / secs / 1e9
}

/// Every measurement of one rank; rank 0 prints them.
pub fn rank_main(
    c: &dyn Communicator,
    max_bytes: usize,
    dtype: Dtype,
    repeats: usize,
    json: bool,
) -> Result<(), CliError> {
    let rows: Vec<(&str, usize, f64)> = {
        let mut rows = Vec::new();
        // Rank 0 shows the progress: every rank runs the same measurements in step.
        let total = ((OPS.len() - usize::from(dtype != Dtype::F32)) * sizes(max_bytes).len()) as u64;
        let mut progress = (c.rank() == 0).then(|| super::progress::Progress::new("bench comm", total));
        for op in OPS.into_iter().filter(|op| *op != "all_reduce_1bit" || dtype == Dtype::F32) {
            for bytes in sizes(max_bytes) {
                if let Some(p) = &mut progress {
                    p.item(&format!("{op} {bytes} B"));
                }
                let secs = measure(c, op, bytes, dtype, repeats)?;
                rows.push((op, bytes, busbw(op, bytes, c.world_size(), secs)));
                if let Some(p) = &mut progress {
                    p.done();
                }
            }
        }
        rows
    };
    // What the memory system gives each rank when all of them stream at once, as they do in a collective: the
    // ceiling the collectives share (the single-core memcpy is measured alone).
    c.barrier().map_err(|e| CliError::Usage(e.to_string()))?;
    let mut concurrent = [memcpy_gbps(repeats, true) as f32];
    c.all_reduce(&mut concurrent, ReduceOp::Avg).map_err(|e| CliError::Usage(e.to_string()))?;
    if c.rank() != 0 {
        return Ok(());
    }
    for (op, bytes, bw) in rows {
        if json {
            emit(&serde_json::json!({"op": op, "bytes": bytes, "ranks": c.world_size(), "dtype": dtype_name(dtype), "busbw_gbps": bw}).to_string())?;
        } else {
            emit(&format!("{op:>15} {bytes:>12} B {:>4}  busbw {bw:>7.2} GB/s", dtype_name(dtype)))?;
        }
    }
    if json {
        emit(&serde_json::json!({"memcpy_all_ranks_gbps": concurrent[0], "ranks": c.world_size()}).to_string())?;
    } else {
        emit(&format!(
            "# memcpy per rank with all {} ranks copying at once: {:.2} GB/s",
            c.world_size(),
            concurrent[0]
        ))?;
    }
    Ok(())
}

/// The element types the benchmark runs, by their `--dtype` name.
const DTYPES: [(&str, Dtype); 3] = [("f32", Dtype::F32), ("bf16", Dtype::Bf16), ("f16", Dtype::F16)];

fn dtype_name(dtype: Dtype) -> &'static str {
    DTYPES.iter().find(|(_, d)| *d == dtype).map_or("?", |(name, _)| name)
}

pub fn run(
    backend: &str,
    ranks: usize,
    max_bytes: usize,
    dtype: &str,
    repeats: usize,
    json: bool,
    worker: bool,
) -> Result<(), CliError> {
    if ranks < 2 {
        return Err(CliError::Usage("--ranks must be >= 2".into()));
    }
    let elem = DTYPES
        .iter()
        .find(|(name, _)| *name == dtype)
        .map(|(_, d)| *d)
        .ok_or_else(|| CliError::Usage(format!("--dtype {dtype:?}: choose f32, bf16 or f16")))?;
    if worker {
        let c = communicator_from_env(Duration::from_secs(600)).map_err(|e| CliError::Usage(e.to_string()))?;
        return rank_main(c.as_ref(), max_bytes, elem, repeats, json);
    }
    let memcpy = memcpy_gbps(repeats, false);
    if !json {
        emit(&format!("# {backend}, {ranks} ranks; single-core memcpy {memcpy:.2} GB/s"))?;
    }
    match backend {
        "threads" => {
            let comms = threads::group(ranks, Duration::from_secs(600));
            let results: Vec<Result<(), CliError>> = std::thread::scope(|s| {
                let hs: Vec<_> =
                    comms.into_iter().map(|c| s.spawn(move || rank_main(&c, max_bytes, elem, repeats, json))).collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(CliError::Usage("a rank panicked".into()))))
                    .collect()
            });
            results.into_iter().collect::<Result<Vec<()>, CliError>>()?;
        }
        "shm" | "mpi" | "gloo" => {
            let me =
                std::env::current_exe().map_err(|e| CliError::Io { context: "finding zerorun".into(), source: e })?;
            let mut cmd;
            if backend == "shm" || backend == "gloo" {
                cmd = Command::new(&me);
                cmd.args(["launch", "--nproc-per-node", &ranks.to_string(), "--backend", backend, "--"]);
                // gloo is libtorch's: its ranks run in the helper beside zerorun, which takes the same arguments.
                if backend == "gloo" {
                    let helper = me.with_file_name(super::torch_helper::HELPER);
                    if !helper.is_file() {
                        return Err(CliError::Usage(format!(
                            "{}: not found; --backend gloo runs its ranks in the helper beside zerorun (cargo build --bins)",
                            helper.display()
                        )));
                    }
                    cmd.arg(helper);
                } else {
                    cmd.arg(&me);
                }
            } else {
                if !cfg!(feature = "mpi") {
                    return Err(CliError::Usage(
                        "--backend mpi: this zerorun was built without `--features mpi`".into(),
                    ));
                }
                cmd = Command::new("mpirun");
                // SAFETY: geteuid has no preconditions.
                if unsafe { libc::geteuid() } == 0 {
                    cmd.arg("--allow-run-as-root");
                }
                cmd.args(["--oversubscribe", "-np", &ranks.to_string()]).arg(&me);
            }
            cmd.args(["bench", "comm", "--worker", "--backend", backend, "--ranks", &ranks.to_string()]);
            cmd.args(["--max-bytes", &max_bytes.to_string(), "--dtype", dtype, "--repeats", &repeats.to_string()]);
            if json {
                cmd.arg("--json");
            }
            let out = cmd
                .stderr(Stdio::inherit())
                .output()
                .map_err(|e| CliError::Io { context: "starting the ranks".into(), source: e })?;
            let text = String::from_utf8_lossy(&out.stdout);
            for line in text.lines() {
                if backend != "mpi" {
                    emit(line.strip_prefix("[rank 0] ").unwrap_or(line))?;
                } else if line.starts_with('{') || line.contains("busbw") {
                    emit(line)?;
                }
            }
            if !out.status.success() {
                return Err(CliError::Usage("the benchmark's ranks failed (see above)".into()));
            }
        }
        other => return Err(CliError::Usage(format!("--backend {other:?}: choose shm, threads, mpi or gloo"))),
    }
    if json {
        emit(&serde_json::json!({"memcpy_gbps": memcpy}).to_string())?;
    }
    Ok(())
}
