//! `zerorun plan`: for a model and a cluster, every way to train it (ZeRO stage x offload x pipeline degree x
//! tensor degree x sequence-parallel degree x micro-batch x activation checkpointing), each with its peak memory per rank and its step time,
//! predicted from formulas and the cluster's measured (or stated) bandwidths; the ones that fit, fastest first.
//!
//! Memory: model states exactly as `zerorun estimate` counts them, activations by the transformer's count
//! ([`activations`]), stage 3's gathered units, the process floor. Time: compute from FLOPs and the rank's matmul
//! throughput, every collective by the ring's alpha-beta cost on the link class it crosses ([`cluster`]), the
//! pipeline's bubble from the schedule, the optimizer and the offload traffic from their throughputs. No libtorch.
#![warn(missing_docs)]
pub mod activations;
pub mod cluster;
pub mod confidence;
mod ds_config;
pub mod model;
mod predict;

pub use cluster::{Cluster, Collective, Cost, Link, Links};
pub use confidence::Confidence;
pub use ds_config::ds_config;
pub use model::{Measured, Model, Transformer};
pub use predict::{predict, Breakdown, MemoryParts};

use serde::Serialize;
use zerorun_config::Precision;

#[derive(Debug, thiserror::Error)]
/// A plan that cannot be made, with the reason.
pub enum PlanError {
    #[error("{0}")]
    /// An input (a model or cluster file, an option) is wrong; the message names it.
    Input(String),
}

/// Where optimizer states and parameters live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Offload {
    /// Everything in the rank's memory.
    None,
    /// Optimizer states in host memory.
    CpuOptimizer,
    /// Optimizer states and parameters in host memory.
    CpuOptimizerParams,
    /// Optimizer states on NVMe.
    NvmeOptimizer,
    /// Optimizer states and parameters on NVMe.
    NvmeOptimizerParams,
}

impl Offload {
    /// Every placement, none first.
    pub const ALL: [Offload; 5] = [
        Offload::None,
        Offload::CpuOptimizer,
        Offload::CpuOptimizerParams,
        Offload::NvmeOptimizer,
        Offload::NvmeOptimizerParams,
    ];

    /// The name the plan's tables and JSON use.
    pub fn name(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::CpuOptimizer => "cpu_optimizer",
            Offload::CpuOptimizerParams => "cpu_optimizer_params",
            Offload::NvmeOptimizer => "nvme_optimizer",
            Offload::NvmeOptimizerParams => "nvme_optimizer_params",
        }
    }

    /// Whether parameters are offloaded.
    pub fn params(self) -> bool {
        matches!(self, Offload::CpuOptimizerParams | Offload::NvmeOptimizerParams)
    }

    /// Whether optimizer states are offloaded.
    pub fn optimizer(self) -> bool {
        self != Offload::None
    }

    /// Whether what is offloaded goes to NVMe.
    pub fn nvme(self) -> bool {
        matches!(self, Offload::NvmeOptimizer | Offload::NvmeOptimizerParams)
    }
}

/// One way to train: the choices a ds_config and the program's flags make.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Strategy {
    /// The ZeRO stage.
    pub stage: u8,
    /// Where states live.
    pub offload: Offload,
    /// Pipeline stages.
    pub pipeline: u64,
    /// Tensor-parallel degree.
    pub tensor: u64,
    /// Sequence-parallel degree (`sequence_parallel_size`: DeepSpeed-Ulysses over adjacent ranks; ZeRO shards over
    /// data x sequence ranks).
    pub sequence: u64,
    /// Expert-parallel degree (`expert_parallel.autoep_size`): E adjacent ranks compute different experts of every
    /// layer, the tokens travelling to them by all-to-alls; at stages 2 and 3 each position's experts are a unit
    /// split over the data-parallel ranks at that position, which alone keep their values (1: none).
    pub experts: u64,
    /// Data-parallel degree: the ranks a batch's rows are split over.
    pub data: u64,
    /// Samples per micro-batch per rank.
    pub micro_batch: u64,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation: u64,
    /// Every layer recomputed in backward.
    pub activation_checkpointing: bool,
}

/// A strategy with its prediction.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    #[serde(flatten)]
    /// The strategy.
    pub strategy: Strategy,
    /// Predicted peak resident bytes of one rank.
    pub peak_bytes_per_rank: f64,
    /// Of which activations.
    pub activation_bytes_per_rank: f64,
    /// Parameters, gradients and optimizer states one rank holds wherever they live (`zerorun estimate`'s count).
    pub model_state_bytes_per_rank: f64,
    /// Host memory per host of what is offloaded to CPU (plus, on a CPU cluster, every rank's peak).
    pub host_bytes_per_host: f64,
    /// Predicted seconds per optimizer step.
    pub step_seconds: f64,
    /// Predicted tokens per second over the job.
    pub tokens_per_s: f64,
    /// Whether the peak fits the rank's memory (and the host's).
    pub fits: bool,
    /// The peak's parts.
    pub memory: MemoryParts,
    /// The step's parts.
    pub time: Breakdown,
    /// How far the predicted step may be off, and which part is least sure.
    pub confidence: Confidence,
}

/// What is planned for besides the model and the cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// Samples per optimizer step, over all ranks.
    pub global_batch: u64,
    /// The parameters' precision.
    pub precision: Precision,
    /// Largest micro-batch tried (powers of two up to it, and the whole per-rank batch).
    pub max_micro_batch: u64,
}

/// Every strategy the engine can run for this model on this cluster. Skipped, as the engine refuses them or as
/// they cannot help: degrees that do not divide the world, tensor groups wider than a host or not dividing the
/// heads, tensor, sequence or pipeline parallelism with experts, expert parallelism at stage 0 (it would only add
/// all-to-alls there) or not dividing the experts, sequence groups wider than a host, not dividing the heads or the sequence, or beside tensor or pipeline
/// parallelism (the engine refuses those), pipelines deeper than the layers or with fewer micro-batches than stages, stage 3 under a pipeline, offload
/// at stage 0, parameter offload below stage 3, CPU offload on a CPU cluster (the host's memory is the rank's) and
/// NVMe offload where the cluster names no NVMe.
pub fn strategies(model: &Model, cluster: &Cluster, options: &Options) -> Vec<Strategy> {
    let world = cluster.world();
    let mut out = Vec::new();
    // A mixture of experts runs without tensor, sequence or pipeline parallelism (the Llama example refuses them).
    let heads_ok = |t: u64| match model {
        Model::Transformer(m) => m.heads % t == 0 && m.kv_heads % t == 0 && (t == 1 || m.experts == 0),
        Model::Measured(_) => t == 1,
    };
    let sequence_ok = |sp: u64| match model {
        Model::Transformer(m) => m.heads % sp == 0 && m.seq_len % sp == 0 && (sp == 1 || m.experts == 0),
        Model::Measured(_) => sp == 1,
    };
    for t in divisors(cluster.ranks_per_host).into_iter().filter(|&t| world % t == 0 && heads_ok(t)) {
        for p in divisors(world / t).into_iter().filter(|&p| p <= model.layers() && (p == 1 || model.experts() == 0)) {
            for sp in divisors(world / (t * p)) {
                let usable = sp == 1 || (t == 1 && p == 1 && sp <= cluster.ranks_per_host && sequence_ok(sp));
                let d = world / (t * p * sp);
                if !usable || options.global_batch % d != 0 {
                    continue;
                }
                let per_rank = options.global_batch / d;
                for b in micro_batches(per_rank, options.max_micro_batch) {
                    let m = per_rank / b;
                    if m < p {
                        continue;
                    }
                    for stage in 0..=3u8 {
                        if stage == 3 && p > 1 {
                            continue;
                        }
                        for offload in Offload::ALL {
                            let usable = match offload {
                                Offload::None => true,
                                _ if stage == 0 => false,
                                o if o.params() && stage != 3 => false,
                                o if o.nvme() => cluster.nvme_bytes_per_s.is_some(),
                                _ => cluster.accelerator,
                            };
                            if !usable {
                                continue;
                            }
                            // Expert parallelism at stages 1-3, where it splits each position's experts over
                            // their own ranks (at stage 0 every rank holds every expert: it would only add
                            // all-to-alls), without tensor, pipeline or sequence parallelism (the engine refuses
                            // those); with activation checkpointing a layer recomputes with its experts' unit nested.
                            let experts_ok = stage >= 1 && t == 1 && p == 1 && sp == 1;
                            for e in expert_degrees(model, d).into_iter().filter(|&e| e == 1 || experts_ok) {
                                for ac in [false, true] {
                                    out.push(Strategy {
                                        stage,
                                        offload,
                                        pipeline: p,
                                        tensor: t,
                                        sequence: sp,
                                        experts: e,
                                        data: d,
                                        micro_batch: b,
                                        gradient_accumulation: m,
                                        activation_checkpointing: ac,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Expert-parallel degrees for `data` ranks: those dividing both the ranks and every layer's experts (1 for a
/// dense model).
fn expert_degrees(model: &Model, data: u64) -> Vec<u64> {
    match model.experts() {
        0 => vec![1],
        n => divisors(data).into_iter().filter(|e| n % e == 0).collect(),
    }
}

/// Every strategy predicted, those that fit first, each part fastest first (then by peak).
pub fn plan(model: &Model, cluster: &Cluster, options: &Options) -> Result<Vec<Row>, PlanError> {
    if options.global_batch == 0 {
        return Err(PlanError::Input("the global batch must be at least 1".into()));
    }
    let mut rows: Vec<Row> =
        strategies(model, cluster, options).iter().map(|s| predict(model, cluster, options, s)).collect();
    rows.sort_by(|a, b| {
        b.fits
            .cmp(&a.fits)
            .then(a.step_seconds.total_cmp(&b.step_seconds))
            .then(a.peak_bytes_per_rank.total_cmp(&b.peak_bytes_per_rank))
    });
    Ok(rows)
}

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|d| n % d == 0).collect()
}

/// Powers of two dividing `per_rank` up to `max`, and `per_rank` itself when it is within `max`.
fn micro_batches(per_rank: u64, max: u64) -> Vec<u64> {
    let mut out: Vec<u64> =
        (0..63).map(|i| 1u64 << i).take_while(|&b| b <= per_rank.min(max)).filter(|b| per_rank % b == 0).collect();
    if per_rank <= max && !out.contains(&per_rank) {
        out.push(per_rank);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(hosts: u64, rph: u64, accelerator: bool, nvme: bool) -> Cluster {
        let link = |bw| Link {
            latency_s: 1e-5,
            bandwidth_bytes_per_s: bw,
            all_reduce: None,
            reduce_scatter: None,
            all_gather: None,
        };
        Cluster {
            hosts,
            ranks_per_host: rph,
            memory_per_rank_bytes: 80e9,
            host_memory_bytes: 1e12,
            flops_per_rank: Some(3e14),
            links: Links { intra: link(2e11), inter: Some(link(2.5e10)) },
            accelerator,
            process_floor_bytes: 1e9,
            optimizer_params_per_s: None,
            host_optimizer_params_per_s: None,
            host_link_bytes_per_s: None,
            nvme_bytes_per_s: nvme.then_some(2e9),
            memory_bytes_per_s: None,
            op_overhead_s: None,
            comm_overlap: None,
            cores_per_host: None,
            nvme_request_latency_s: None,
            measured: false,
        }
    }

    fn gpt() -> Model {
        Model::from_json(r#"{"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "seq_len": 1024}"#, "m").unwrap()
    }

    #[test]
    fn the_enumeration_keeps_to_what_the_engine_runs() {
        let options = Options { global_batch: 48, precision: Precision::Bf16, max_micro_batch: 64 };
        let all = strategies(&gpt(), &cluster(2, 8, true, false), &options);
        assert!(!all.is_empty());
        for s in &all {
            assert_eq!(s.pipeline * s.tensor * s.sequence * s.data, 16, "{s:?}");
            assert!(s.sequence == 1 || (s.tensor == 1 && s.pipeline == 1 && s.sequence <= 8), "{s:?}");
            assert!(8 % s.tensor == 0 && 12 % s.tensor == 0, "{s:?}");
            assert_eq!(s.micro_batch * s.gradient_accumulation * s.data, 48, "{s:?}");
            assert!(!(s.stage == 3 && s.pipeline > 1), "stage 3 under a pipeline: {s:?}");
            assert!(s.gradient_accumulation >= s.pipeline, "{s:?}");
            assert!(!s.offload.nvme(), "no NVMe in the cluster: {s:?}");
            assert!(!(s.offload.params() && s.stage != 3));
            assert!(!(s.stage == 0 && s.offload != Offload::None));
        }
        // 48 samples over 16 data ranks leave 3 per rank: micro-batches 1 and 3.
        let flat: Vec<_> = all.iter().filter(|s| s.data == 16).map(|s| s.micro_batch).collect();
        assert!(flat.contains(&1) && flat.contains(&3) && !flat.contains(&2));
        // A batch no data degree divides but 1: 7 samples.
        let odd = strategies(&gpt(), &cluster(2, 8, true, false), &Options { global_batch: 7, ..options });
        assert!(odd.iter().all(|s| s.data == 1 && s.pipeline * s.tensor * s.sequence == 16));
        // Sequence groups: 12 heads and 1024 tokens split over 2 and 4 (within a host of 8), not 8 or 16.
        let split: std::collections::BTreeSet<u64> = all.iter().map(|s| s.sequence).collect();
        assert_eq!(split.into_iter().collect::<Vec<_>>(), vec![1, 2, 4]);
        // On a CPU cluster: no CPU offload; NVMe where the cluster has it.
        let cpu = strategies(&gpt(), &cluster(1, 2, false, true), &options);
        assert!(cpu.iter().all(|s| !matches!(s.offload, Offload::CpuOptimizer | Offload::CpuOptimizerParams)));
        assert!(cpu.iter().any(|s| s.offload == Offload::NvmeOptimizerParams));
    }

    #[test]
    fn a_70b_model_on_1024_ranks_plans_in_under_a_second() {
        let llama70 = Model::from_json(
            r#"{"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "vocab": 32000, "seq_len": 4096, "gated": true}"#,
            "m",
        )
        .unwrap();
        let options = Options { global_batch: 1024, precision: Precision::Bf16, max_micro_batch: 16 };
        let started = std::time::Instant::now();
        let rows = plan(&llama70, &cluster(128, 8, true, true), &options).unwrap();
        let took = started.elapsed();
        assert!(rows.len() > 1000, "{}", rows.len());
        assert!(rows[0].fits, "something fits on 1024 x 80 GB");
        assert!(took.as_secs_f64() < if cfg!(debug_assertions) { 10.0 } else { 1.0 }, "{took:?}");
        // Fitting rows come first, ranked by step time.
        let fit: Vec<_> = rows.iter().take_while(|r| r.fits).collect();
        assert!(fit.windows(2).all(|w| w[0].step_seconds <= w[1].step_seconds));
        assert!(rows[fit.len()..].iter().all(|r| !r.fits));
        // Plain data parallelism of 70B cannot fit 80 GB (16 bytes per parameter).
        assert!(rows
            .iter()
            .filter(|r| r.strategy.stage == 0 && r.strategy.pipeline * r.strategy.tensor == 1)
            .all(|r| !r.fits));
    }
}
