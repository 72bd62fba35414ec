//! `zerorun plan`: every way to train a model on a cluster, with its predicted peak memory and step time, the ones
//! that fit fastest first (the arithmetic is the `zerorun-plan` crate's); `plan measure` writes this machine as a
//! cluster; `plan validate` (plan_validate.rs) runs configurations here and sets the prediction beside the run.
//!
//!     zerorun plan --model MODEL.json --cluster CLUSTER.json --global-batch B [--top K] [--json] [--write-config DIR]
//!     zerorun plan measure [--ranks-per-host K] [--nvme-dir DIR] > cluster.json
//!     zerorun plan validate [--json]
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::{Args, Subcommand, ValueEnum};
use zerorun_config::Precision;
use zerorun_plan::{Cluster, Cost, Link, Links, Model, Options, Row};

use super::{emit, CliError};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PlanArgs {
    #[command(subcommand)]
    command: Option<PlanCommand>,
    #[command(flatten)]
    plan: PlanOptions,
}

#[derive(Subcommand)]
enum PlanCommand {
    /// Write this machine as a cluster JSON (one host, or --hosts of them): matmul FLOP/s per rank, the shared-memory collectives'
    /// latency and bus bandwidth, AdamW's params/s, memory, the process floor (and NVMe with --nvme-dir).
    Measure(MeasureArgs),
    /// Run small configurations here (stages 0-3, NVMe offload, a pipeline, tensor parallelism, 1-4 ranks) and
    /// print predicted against measured peak memory and step time, with the errors.
    Validate(super::plan_validate::ValidateArgs),
}

#[derive(Args)]
pub struct MeasureArgs {
    #[arg(long, default_value_t = 2)]
    pub ranks_per_host: u64,
    /// Hosts of the cluster written: more than 1 adds `links.inter`, measured as gloo's collectives here (the TCP
    /// backend ranks on different hosts use) on loopback; replace it with the real network's figures.
    #[arg(long, default_value_t = 1)]
    pub hosts: u64,
    /// A folder on the NVMe drive offload would use: its write/read bandwidth is measured (bench swap).
    #[arg(long)]
    pub nvme_dir: Option<PathBuf>,
    /// Shape of the matmul measured: rows (tokens of a micro-batch), inner and outer width.
    #[arg(long, value_delimiter = ',', default_values_t = [512i64, 1024, 1024])]
    pub matmul: Vec<i64>,
}

#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    Fp32,
    Bf16,
    Fp16,
}

#[derive(Args)]
struct PlanOptions {
    /// A transformer {"layers", "hidden", "heads", "vocab", "seq_len"} (optionally "kv_heads", "ffn", "tied",
    /// "gated" for Llama's SwiGLU), or a measured model {"params", "largest_layer_params",
    /// "activation_bytes_per_sample"}.
    #[arg(long)]
    model: Option<PathBuf>,
    /// {"hosts", "ranks_per_host", "memory_per_rank_bytes", "host_memory_bytes", "flops_per_rank", "links":
    /// {"intra": {"latency_s", "bandwidth_bytes_per_s"}, "inter": {...}}}; `zerorun plan measure` writes this
    /// machine's. Without "flops_per_rank", this machine's matmul throughput is measured.
    #[arg(long)]
    cluster: Option<PathBuf>,
    /// Samples per optimizer step over all ranks.
    #[arg(long)]
    global_batch: Option<u64>,
    /// Rows shown (and written with --write-config).
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Largest micro-batch tried.
    #[arg(long, default_value_t = 64)]
    max_micro_batch: u64,
    /// Training precision; default bf16 on accelerators, fp32 on a CPU cluster.
    #[arg(long, value_enum)]
    precision: Option<PrecisionArg>,
    /// Write DIR/plan-01.json ... : a ds_config for each row shown.
    #[arg(long)]
    write_config: Option<PathBuf>,
    /// nvme_path written into configs that offload to NVMe.
    #[arg(long, default_value = "/local_nvme")]
    nvme_path: String,
    /// Print `{"rows": [...]}`: the rows shown, each with its strategy, memory and time breakdown.
    #[arg(long)]
    json: bool,
}

fn read(path: &Path) -> Result<String, CliError> {
    std::fs::read_to_string(path)
        .map_err(|e| CliError::Io { context: format!("reading {}", path.display()), source: e })
}

fn plan_error(e: zerorun_plan::PlanError) -> CliError {
    CliError::Usage(e.to_string())
}

pub fn run(a: PlanArgs) -> Result<(), CliError> {
    match a.command {
        Some(PlanCommand::Measure(m)) => {
            let cluster = measure_machine(&m)?;
            emit(&serde_json::to_string_pretty(&cluster).expect("a cluster serializes"))
        }
        Some(PlanCommand::Validate(v)) => super::plan_validate::run(v),
        None => plan(a.plan),
    }
}

fn plan(o: PlanOptions) -> Result<(), CliError> {
    let (Some(model_path), Some(cluster_path), Some(global_batch)) = (&o.model, &o.cluster, o.global_batch) else {
        return Err(CliError::Usage(
            "plan needs --model MODEL.json, --cluster CLUSTER.json and --global-batch B (or a subcommand: measure, validate)"
                .into(),
        ));
    };
    let model = Model::from_json(&read(model_path)?, &model_path.display().to_string()).map_err(plan_error)?;
    let mut cluster =
        Cluster::from_json(&read(cluster_path)?, &cluster_path.display().to_string()).map_err(plan_error)?;
    if cluster.flops_per_rank.is_none() {
        let shape = model_matmul(&model);
        let threads = (cores() / cluster.ranks_per_host as usize).max(1);
        let (flops, _) = measure_matmul(shape, threads)?;
        tracing::info!(
            "{}: no flops_per_rank; measured {:.2} GFLOP/s per rank here",
            cluster_path.display(),
            flops / 1e9
        );
        cluster.flops_per_rank = Some(flops);
    }
    let precision = match o.precision {
        Some(PrecisionArg::Fp32) => Precision::Fp32,
        Some(PrecisionArg::Fp16) => Precision::Fp16,
        Some(PrecisionArg::Bf16) => Precision::Bf16,
        None if cluster.accelerator => Precision::Bf16,
        None => Precision::Fp32,
    };
    let options = Options { global_batch, precision, max_micro_batch: o.max_micro_batch.max(1) };
    let started = std::time::Instant::now();
    let rows = zerorun_plan::plan(&model, &cluster, &options).map_err(plan_error)?;
    let took = started.elapsed().as_secs_f64();
    let fitting = rows.iter().filter(|r| r.fits).count();
    // The fastest that fit; when none does, the smallest peaks, to show how far off they are.
    let shown: Vec<&Row> = if fitting > 0 {
        rows.iter().take(o.top.min(fitting)).collect()
    } else {
        let mut by_peak: Vec<&Row> = rows.iter().collect();
        by_peak.sort_by(|a, b| a.peak_bytes_per_rank.total_cmp(&b.peak_bytes_per_rank));
        by_peak.into_iter().take(o.top).collect()
    };
    if let Some(dir) = &o.write_config {
        write_configs(dir, &shown, precision, &o.nvme_path)?;
    }
    if o.json {
        return emit(
            &serde_json::json!({
                "params": model.params(), "world": cluster.world(), "precision": format!("{precision:?}").to_lowercase(),
                "strategies": rows.len(), "fitting": fitting, "seconds": took, "rows": shown,
            })
            .to_string(),
        );
    }
    emit(&format!(
        "{} parameters, {:?}, global batch {global_batch}, on {} host(s) x {} rank(s): {} strategies, {fitting} fit ({:.3} s)",
        model.params(),
        precision,
        cluster.hosts,
        cluster.ranks_per_host,
        rows.len(),
        took
    ))?;
    if fitting == 0 {
        emit("nothing fits; the smallest peaks:")?;
    }
    // A model known by measured totals without a sequence length counts samples, not tokens.
    let per_sample = matches!(&model, zerorun_plan::Model::Measured(m) if m.seq_len <= 1);
    emit(&table(&shown, if per_sample { "samples/s" } else { "tokens/s" }))?;
    if let Some(line) = least_sure(&shown) {
        emit(&line)?;
    }
    if let Some(best) = shown.first() {
        emit(&describe(best))?;
    }
    Ok(())
}

fn gib(b: f64) -> f64 {
    b / (1u64 << 30) as f64
}

/// The rows as a table, one line each; `rate`: the throughput column's unit (tokens/s, or samples/s for a model
/// without a sequence).
pub fn table(rows: &[&Row], rate: &str) -> String {
    let mut out = format!(
        "{:>3} {:>5} {:<21} {:>3} {:>3} {:>3} {:>3} {:>5} {:>5} {:>4} {:>3} {:>10} {:>10} {:>10} {:>5} {:>12} {:>5}",
        "#",
        "stage",
        "offload",
        "pp",
        "tp",
        "sp",
        "ep",
        "dp",
        "micro",
        "gas",
        "ac",
        "peak GiB",
        "act GiB",
        "step s",
        "+-%",
        rate,
        "fits"
    );
    for (i, r) in rows.iter().enumerate() {
        let s = &r.strategy;
        out.push_str(&format!(
            "\n{:>3} {:>5} {:<21} {:>3} {:>3} {:>3} {:>3} {:>5} {:>5} {:>4} {:>3} {:>10.2} {:>10.2} {:>10.4} {:>5.0} {:>12.0} {:>5}",
            i + 1,
            s.stage,
            s.offload.name(),
            s.pipeline,
            s.tensor,
            s.sequence,
            s.experts,
            s.data,
            s.micro_batch,
            s.gradient_accumulation,
            if s.activation_checkpointing { "yes" } else { "no" },
            gib(r.peak_bytes_per_rank),
            gib(r.activation_bytes_per_rank),
            r.step_seconds,
            100.0 * r.confidence.relative,
            r.tokens_per_s,
            if r.fits { "yes" } else { "no" }
        ));
    }
    out
}

/// The shown rows the planner is least sure of (up to three, by relative uncertainty) and why, or that every row
/// is as sure; None when every row is within 20%.
pub fn least_sure(rows: &[&Row]) -> Option<String> {
    let mut order: Vec<(usize, &Row)> =
        rows.iter().enumerate().map(|(i, r)| (i + 1, *r)).filter(|(_, r)| r.confidence.relative > 0.2).collect();
    order.sort_by(|a, b| b.1.confidence.relative.total_cmp(&a.1.confidence.relative).then(a.0.cmp(&b.0)));
    let why = |r: &Row| {
        let c = &r.confidence;
        let part = c.least_sure_part.replace('_', " ");
        let cores = if c.shared_cores { ", ranks sharing cores" } else { "" };
        format!("+-{:.0}% ({part}{cores})", 100.0 * c.relative)
    };
    let stated = rows.iter().any(|r| r.confidence.relative >= 0.5 - 1e-9);
    let hint = if stated {
        "; figures stated rather than measured are priced at +-50%: `zerorun plan measure` measures a machine"
    } else {
        ""
    };
    let (first, last) = (order.first()?, order.last()?);
    if order.len() == rows.len() && first.1.confidence.relative - last.1.confidence.relative < 0.01 {
        return Some(format!("least sure: every row alike, {}{hint}", why(first.1)));
    }
    let named: Vec<String> = order.iter().take(3).map(|(i, r)| format!("#{i} {}", why(r))).collect();
    Some(format!("least sure: {}{hint}", named.join(", ")))
}

/// The first row's breakdown and how to run it.
fn describe(r: &Row) -> String {
    let (m, t) = (&r.memory, &r.time);
    let s = &r.strategy;
    let mut flags = String::new();
    if !(s.tensor > 1 || s.pipeline > 1 || s.sequence > 1 || s.experts > 1 || s.activation_checkpointing) {
        flags.push_str(" none");
    }
    if s.experts > 1 {
        // The config says it too (expert_parallel.autoep_size); the Llama example's flag.
        flags.push_str(&format!(" --expert-parallel {}", s.experts));
    }
    if s.tensor > 1 {
        flags.push_str(&format!(" --tensor-parallel {}", s.tensor));
    }
    if s.sequence > 1 {
        // The config says it too (sequence_parallel_size); the Llama example's attention runs it.
        flags.push_str(&format!(
            " (sequence_parallel_size {}: the model's attention through runtime::sequence)",
            s.sequence
        ));
    }
    if s.pipeline > 1 {
        flags.push_str(&format!(" --pipeline-stages {}", s.pipeline));
    }
    if s.activation_checkpointing {
        flags.push_str(" --activation-checkpointing");
    }
    format!(
        "#1: peak {:.2} GiB = floor {:.2} + model states {:.2} + gathered {:.2} + reduction buffers {:.2} + activations {:.2} + temporaries {:.2} (offloaded: host {:.2}, NVMe {:.2})\n    step {:.4} s = compute {:.4} + data-parallel comm {:.4} + tensor-parallel comm {:.4} + sequence-parallel comm {:.4} + expert-parallel comm {:.4} + pipeline comm {:.4} + optimizer {:.4} + offload {:.4}\n    run: the ds_config --write-config writes (plan-01.json), program flags:{flags}",
        gib(r.peak_bytes_per_rank),
        gib(m.floor),
        gib(m.model_states),
        gib(m.gathered),
        gib(m.reduction_buffers),
        gib(m.activations),
        gib(m.temporaries),
        gib(m.host),
        gib(m.nvme),
        r.step_seconds,
        t.compute,
        t.data_parallel_comm,
        t.tensor_parallel_comm,
        t.sequence_parallel_comm,
        t.expert_parallel_comm,
        t.pipeline_comm,
        t.optimizer,
        t.offload
    )
}

fn write_configs(dir: &Path, rows: &[&Row], precision: Precision, nvme_path: &str) -> Result<(), CliError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| CliError::Io { context: format!("creating {}", dir.display()), source: e })?;
    for (i, r) in rows.iter().enumerate() {
        let path = dir.join(format!("plan-{:02}.json", i + 1));
        let config = zerorun_plan::ds_config(&r.strategy, precision, nvme_path);
        let text = serde_json::to_string_pretty(&config).expect("a config serializes");
        std::fs::write(&path, text + "\n")
            .map_err(|e| CliError::Io { context: format!("writing {}", path.display()), source: e })?;
    }
    Ok(())
}

/// The matmul shape that stands for the model's: the tokens of a micro-batch of a few samples (256 to 4096) by the
/// MLP's first matrix.
fn model_matmul(model: &Model) -> [i64; 3] {
    match model {
        Model::Transformer(t) => [(8 * t.seq_len as i64).clamp(256, 4096), t.hidden as i64, t.ffn as i64],
        Model::Measured(_) => [512, 1024, 1024],
    }
}

pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// (FLOP/s, resident bytes of a process with libtorch loaded): the median of three `zerorun bench matmul` runs
/// of the helper. One run on a shared machine can land in a slow moment and price every row's compute that much
/// higher (`plan validate` saw a run whose 2-rank rows all read 21-37% over); three separate processes outvote it.
pub fn measure_matmul(shape: [i64; 3], threads: usize) -> Result<(f64, f64), CliError> {
    let mut runs = (0..3).map(|_| measure_matmul_once(shape, threads)).collect::<Result<Vec<_>, _>>()?;
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(runs[1])
}

fn measure_matmul_once(shape: [i64; 3], threads: usize) -> Result<(f64, f64), CliError> {
    let exe = std::env::current_exe().map_err(|e| CliError::Io { context: "finding zerorun".into(), source: e })?;
    let helper = exe.with_file_name(super::torch_helper::HELPER);
    let out = Command::new(&helper)
        .args(["bench", "matmul", "--json", "--threads", &threads.to_string()])
        .args(["--m", &shape[0].to_string(), "--k", &shape[1].to_string(), "--n", &shape[2].to_string()])
        .output()
        .map_err(|e| CliError::Io {
            context: format!("running {} (build it: cargo build --bins)", helper.display()),
            source: e,
        })?;
    let v = json_line(&out.stdout, &out.stderr, "bench matmul")?;
    Ok((v["flops_per_s"].as_f64().unwrap_or(0.0), v["rss_bytes"].as_f64().unwrap_or(0.0)))
}

fn json_line(stdout: &[u8], stderr: &[u8], what: &str) -> Result<serde_json::Value, CliError> {
    String::from_utf8_lossy(stdout)
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l.trim_start_matches("[rank 0] ")).ok())
        .ok_or_else(|| CliError::Usage(format!("{what} printed no JSON:\n{}", String::from_utf8_lossy(stderr))))
}

/// Latency and bus bandwidth of each collective among `ranks` ranks of `backend` (shm, gloo): bandwidth at the
/// largest size, latency from the smallest's time less what that bandwidth explains.
/// Also the memory bandwidth each rank got while all of them copied at once (bytes/s).
pub fn measure_link(backend: &str, ranks: u64) -> Result<(Link, Option<f64>), CliError> {
    let exe = std::env::current_exe().map_err(|e| CliError::Io { context: "finding zerorun".into(), source: e })?;
    let out = Command::new(&exe)
        .args([
            "bench",
            "comm",
            "--backend",
            backend,
            "--json",
            "--repeats",
            "3",
            "--max-bytes",
            &(64u64 << 20).to_string(),
        ])
        .args(["--ranks", &ranks.max(2).to_string()])
        .output()
        .map_err(|e| CliError::Io { context: "running zerorun bench comm".into(), source: e })?;
    let all: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .collect();
    let memory = all.iter().find_map(|v| v["memcpy_all_ranks_gbps"].as_f64()).map(|g| g * 1e9);
    let rows: Vec<&serde_json::Value> = all.iter().filter(|v| v.get("op").is_some()).collect();
    if !out.status.success() || rows.is_empty() {
        return Err(CliError::Usage(format!("bench comm failed:\n{}", String::from_utf8_lossy(&out.stderr))));
    }
    let p = ranks.max(2) as f64;
    let cost = |op: &str| -> Option<Cost> {
        let mine: Vec<(f64, f64)> = rows
            .iter()
            .filter(|v| v["op"] == op)
            .filter_map(|v| Some((v["bytes"].as_f64()?, v["busbw_gbps"].as_f64()? * 1e9)))
            .collect();
        let (&(big, bw), &(small, small_bw)) =
            (mine.iter().max_by(|a, b| a.0.total_cmp(&b.0))?, mine.iter().min_by(|a, b| a.0.total_cmp(&b.0))?);
        let _ = big;
        let factor = if op == "all_reduce" { 2.0 } else { 1.0 };
        let small_s = factor * (p - 1.0) / p * small / small_bw;
        let latency = ((small_s - factor * (p - 1.0) / p * small / bw) / (factor * (p - 1.0))).max(0.0);
        Some(Cost { latency_s: latency, bandwidth_bytes_per_s: bw })
    };
    let base = cost("reduce_scatter").ok_or_else(|| CliError::Usage("bench comm printed no reduce_scatter".into()))?;
    let link = Link {
        latency_s: base.latency_s,
        bandwidth_bytes_per_s: base.bandwidth_bytes_per_s,
        all_reduce: cost("all_reduce"),
        reduce_scatter: Some(base),
        all_gather: cost("all_gather"),
    };
    Ok((link, memory))
}

/// zerorun's AdamW params/s on one thread (the rank's share of the cores on a CPU cluster).
fn measure_adam() -> Result<f64, CliError> {
    let exe = std::env::current_exe().map_err(|e| CliError::Io { context: "finding zerorun".into(), source: e })?;
    let helper = exe.with_file_name(super::torch_helper::HELPER);
    let out = Command::new(&helper)
        .args(["bench", "adam", "--json", "--repeats", "3", "--params", &(1usize << 22).to_string()])
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .map_err(|e| CliError::Io { context: format!("running {}", helper.display()), source: e })?;
    let v = json_line(&out.stdout, &out.stderr, "bench adam")?;
    v["zerorun_params_per_s"]
        .as_f64()
        .ok_or_else(|| CliError::Usage("bench adam printed no zerorun_params_per_s".into()))
}

fn mem_total() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb * 1024.0)
}

/// This machine as a one-host CPU cluster of `ranks_per_host` ranks.
pub fn measure_machine(m: &MeasureArgs) -> Result<Cluster, CliError> {
    if m.ranks_per_host == 0 || m.hosts == 0 || m.matmul.len() != 3 {
        return Err(CliError::Usage("plan measure: --ranks-per-host and --hosts at least 1, --matmul M,K,N".into()));
    }
    let k = m.ranks_per_host;
    let threads = (cores() / k as usize).max(1);
    // More ranks than cores share them: each gets its fraction.
    let share = (cores() as f64 / k as f64).min(1.0);
    let (flops, floor) = measure_matmul([m.matmul[0], m.matmul[1], m.matmul[2]], threads)?;
    let (link, memory) = measure_link("shm", k)?;
    let inter = if m.hosts > 1 { Some(measure_link("gloo", 2)?.0) } else { None };
    let adam = measure_adam()? * share;
    let (nvme, nvme_latency) = match &m.nvme_dir {
        Some(dir) => {
            let (bandwidth, latency) = measure_nvme(dir)?;
            (Some(bandwidth), Some(latency))
        }
        None => (None, None),
    };
    let host = mem_total();
    Ok(Cluster {
        hosts: m.hosts.max(1),
        ranks_per_host: k,
        memory_per_rank_bytes: host / k as f64,
        host_memory_bytes: host,
        flops_per_rank: Some(flops * share),
        links: Links { intra: link, inter },
        accelerator: false,
        process_floor_bytes: floor,
        optimizer_params_per_s: Some(adam),
        host_optimizer_params_per_s: None,
        host_link_bytes_per_s: None,
        nvme_bytes_per_s: nvme,
        nvme_request_latency_s: nvme_latency,
        cores_per_host: Some(cores() as u64),
        measured: true,
        // Measured with every rank copying at once (`bench comm`'s memcpy_all_ranks_gbps): with more ranks than
        // cores that already is each rank's share of the time, unlike the matmul and AdamW measured alone.
        memory_bytes_per_s: memory,
        op_overhead_s: None,
        comm_overlap: Some(0.0),
    })
}

/// The NVMe swapper on `dir` as training uses it: (bytes/s, seconds per request). The bandwidth is the slower of
/// its write and read of 256 MiB (bench swap); the request's fixed cost is what a 1 MiB write and read (the mean of
/// the two, median of five) take beyond their bytes at that bandwidth.
fn measure_nvme(dir: &Path) -> Result<(f64, f64), CliError> {
    let swap = |size: u64, repeats: &str| -> Result<(f64, f64), CliError> {
        let exe = std::env::current_exe().map_err(|e| CliError::Io { context: "finding zerorun".into(), source: e })?;
        let out = Command::new(&exe)
            .args(["bench", "swap", "--json", "--repeats", repeats, "--size", &size.to_string(), "--dir"])
            .arg(dir)
            .output()
            .map_err(|e| CliError::Io { context: "running zerorun bench swap".into(), source: e })?;
        let v = json_line(&out.stdout, &out.stderr, "bench swap")?;
        let gib = (1u64 << 30) as f64;
        match (v["write_gibps"].as_f64(), v["read_gibps"].as_f64()) {
            (Some(w), Some(r)) => Ok((w * gib, r * gib)),
            _ => Err(CliError::Usage(format!("bench swap printed no write/read GiB/s: {v}"))),
        }
    };
    let (w, r) = swap(256 << 20, "1")?;
    let bandwidth = w.min(r);
    let small = (1u64 << 20) as f64;
    let (sw, sr) = swap(1 << 20, "5")?;
    let seconds = (small / sw + small / sr) / 2.0;
    Ok((bandwidth, (seconds - small / bandwidth).max(0.0)))
}
