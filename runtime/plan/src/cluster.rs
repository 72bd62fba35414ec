//! Where it runs: hosts, ranks, memory, compute, and what each link class costs.
use serde::{Deserialize, Serialize};

use crate::PlanError;

/// One link class's alpha-beta figures: a message of n bytes costs `latency_s + n / bandwidth_bytes_per_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cost {
    /// Per message, seconds.
    pub latency_s: f64,
    /// Bus bandwidth (nccl-tests' busbw): what the ring's (p-1)/p terms divide by.
    pub bandwidth_bytes_per_s: f64,
}

/// A link class (inside a host, across hosts), optionally with measured figures per collective.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Per message, seconds.
    pub latency_s: f64,
    /// Bus bandwidth (nccl-tests' busbw), bytes per second.
    pub bandwidth_bytes_per_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Measured all-reduce figures, when they differ from the link's.
    pub all_reduce: Option<Cost>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Measured reduce-scatter figures.
    pub reduce_scatter: Option<Cost>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Measured all-gather figures.
    pub all_gather: Option<Cost>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
/// The cluster's link classes.
pub struct Links {
    /// Inside a host.
    pub intra: Link,
    /// Across hosts; the intra link's figures on a cluster of one host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter: Option<Link>,
}

/// A cluster. The required keys are what a person can write from a data sheet; the optional ones are refinements
/// `zerorun plan measure` writes from this machine's benchmarks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// Hosts.
    pub hosts: u64,
    /// Ranks per host.
    pub ranks_per_host: u64,
    /// Memory one rank may fill: an accelerator's, or on a CPU cluster the host's memory / ranks per host.
    pub memory_per_rank_bytes: f64,
    /// Memory of one host.
    pub host_memory_bytes: f64,
    /// Achieved matmul FLOP/s of one rank; absent: `zerorun plan` measures this machine's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flops_per_rank: Option<f64>,
    /// The link classes.
    pub links: Links,
    /// Ranks compute on accelerators (CPU offload frees their memory); false on a CPU cluster, where the
    /// process's memory is the rank's memory and only NVMe offload frees it. Default true.
    #[serde(default = "yes")]
    pub accelerator: bool,
    /// Resident memory of a rank before the model: the runtime, libraries, a CUDA context. Default 1 GiB with an
    /// accelerator (a CUDA context), [`CPU_PROCESS_FLOOR_BYTES`] without (`zerorun plan measure` measures it).
    #[serde(default = "gib")]
    pub process_floor_bytes: f64,
    /// Parameters per second one rank's optimizer steps (AdamW) where the states live; default: 2e10 on an
    /// accelerator, 2e8 on a CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_params_per_s: Option<f64>,
    /// Parameters per second of AdamW on the host for offloaded states (one rank's share of the host); default 5e8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_optimizer_params_per_s: Option<f64>,
    /// Bytes per second between a rank's accelerator and host memory; default 2.5e10 (PCIe 4 x16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_link_bytes_per_s: Option<f64>,
    /// NVMe read/write bytes per second available to one rank; absent: NVMe offload is not planned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvme_bytes_per_s: Option<f64>,
    /// Memory bandwidth one rank gets while every rank streams (bytes/s): what elementwise work and the copies
    /// around collectives run at. Default: 2e12 on an accelerator (HBM), 5e9 on a CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes_per_s: Option<f64>,
    /// Fixed cost of one operator (eager dispatch, a kernel launch), seconds; default 1e-5 (PyTorch eager on a
    /// CPU; about the same to launch a CUDA kernel from eager mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op_overhead_s: Option<f64>,
    /// CPU cores of a host. Where its ranks are more, they take turns on the cores and every part of the step is
    /// less sure ([`crate::confidence`]); absent: not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores_per_host: Option<u64>,
    /// Seconds one NVMe request costs beyond its bytes (`nvme_bytes_per_s`): training reads a unit's parameter
    /// shard and a sub-group's states at a time, requests of a few MiB, not one long stream. Default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvme_request_latency_s: Option<f64>,
    /// The figures are this machine's benchmarks (`zerorun plan measure` writes true): a stated compute rate or
    /// optimizer throughput makes predictions less sure ([`crate::confidence`]). Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub measured: bool,
    /// Fraction of ZeRO's collective time hidden behind compute (prefetch, bucketed reduce-scatter): 0 on a CPU
    /// cluster whose ranks share the cores that compute; default 0.5 on accelerators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_overlap: Option<f64>,
}

fn yes() -> bool {
    true
}

/// A CPU rank's resident memory before the model: a zerorun process with libtorch loaded measured about 120 MiB
/// (`zerorun bench matmul` here, 2026-12-04).
pub const CPU_PROCESS_FLOOR_BYTES: f64 = 128.0 * 1024.0 * 1024.0;

fn gib() -> f64 {
    (1u64 << 30) as f64
}

impl Cluster {
    /// A cluster from its JSON (`what` names the file in errors), every value checked.
    pub fn from_json(text: &str, what: &str) -> Result<Cluster, PlanError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| PlanError::Input(format!("{what}: {e}")))?;
        let mut c: Cluster =
            serde_json::from_value(value.clone()).map_err(|e| PlanError::Input(format!("{what}: {e}")))?;
        if !c.accelerator && value.get("process_floor_bytes").is_none() {
            c.process_floor_bytes = CPU_PROCESS_FLOOR_BYTES;
        }
        c.check(what)?;
        Ok(c)
    }

    fn check(&self, what: &str) -> Result<(), PlanError> {
        let bad = |key: &str, why: &str| Err(PlanError::Input(format!("{what}: \"{key}\" {why}")));
        if self.hosts == 0 {
            return bad("hosts", "must be at least 1");
        }
        if self.ranks_per_host == 0 {
            return bad("ranks_per_host", "must be at least 1");
        }
        let positive = [
            ("memory_per_rank_bytes", Some(self.memory_per_rank_bytes)),
            ("host_memory_bytes", Some(self.host_memory_bytes)),
            ("flops_per_rank", self.flops_per_rank),
            ("links.intra.bandwidth_bytes_per_s", Some(self.links.intra.bandwidth_bytes_per_s)),
            ("links.inter.bandwidth_bytes_per_s", self.links.inter.map(|l| l.bandwidth_bytes_per_s)),
            ("optimizer_params_per_s", self.optimizer_params_per_s),
            ("host_optimizer_params_per_s", self.host_optimizer_params_per_s),
            ("host_link_bytes_per_s", self.host_link_bytes_per_s),
            ("nvme_bytes_per_s", self.nvme_bytes_per_s),
            ("memory_bytes_per_s", self.memory_bytes_per_s),
            ("op_overhead_s", self.op_overhead_s),
        ];
        if let Some(l) = self.nvme_request_latency_s {
            if !(l.is_finite() && l >= 0.0) {
                return bad("nvme_request_latency_s", &format!("must be a number of seconds, 0 or more, not {l}"));
            }
        }
        if self.cores_per_host == Some(0) {
            return bad("cores_per_host", "must be at least 1");
        }
        for (key, v) in positive {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    return bad(key, &format!("must be a positive number, not {v}"));
                }
            }
        }
        if self.hosts > 1 && self.links.inter.is_none() {
            return bad("links.inter", "is needed when \"hosts\" is more than 1");
        }
        if let Some(o) = self.comm_overlap {
            if !(0.0..=1.0).contains(&o) {
                return bad("comm_overlap", &format!("must be within 0..1, not {o}"));
            }
        }
        Ok(())
    }

    /// Ranks in all.
    pub fn world(&self) -> u64 {
        self.hosts * self.ranks_per_host
    }

    /// The link across hosts (the one inside on a one-host cluster).
    pub fn inter(&self) -> Link {
        self.links.inter.unwrap_or(self.links.intra)
    }

    /// Parameters per second one rank's optimizer steps where its states live.
    pub fn optimizer_params_per_s(&self) -> f64 {
        self.optimizer_params_per_s.unwrap_or(if self.accelerator { 2e10 } else { 2e8 })
    }

    /// Parameters per second the host's optimizer steps (offloaded states).
    pub fn host_optimizer_params_per_s(&self) -> f64 {
        self.host_optimizer_params_per_s.unwrap_or(5e8)
    }

    /// Bytes per second between a rank and its host's memory.
    pub fn host_link_bytes_per_s(&self) -> f64 {
        self.host_link_bytes_per_s.unwrap_or(2.5e10)
    }

    /// Bytes per second of a rank's memory (the optimizer's and the activations' traffic).
    pub fn memory_bytes_per_s(&self) -> f64 {
        self.memory_bytes_per_s.unwrap_or(if self.accelerator { 2e12 } else { 5e9 })
    }

    /// Seconds of fixed cost per collective or kernel launch.
    pub fn op_overhead_s(&self) -> f64 {
        self.op_overhead_s.unwrap_or(1e-5)
    }

    /// The fraction of the data-parallel traffic hidden behind compute.
    pub fn comm_overlap(&self) -> f64 {
        self.comm_overlap.unwrap_or(if self.accelerator { 0.5 } else { 0.0 })
    }
}

/// A ring collective among `ranks` ranks over `n` bytes (Thakur, Rabenseifner, Gropp 2005).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// Every rank ends with the reduction of every rank's buffer.
    AllReduce,
    /// Every rank ends with its part of the reduction.
    ReduceScatter,
    /// Every rank ends with every rank's part.
    AllGather,
}

impl Link {
    fn cost(&self, c: Collective) -> Cost {
        let measured = match c {
            Collective::AllReduce => self.all_reduce,
            Collective::ReduceScatter => self.reduce_scatter,
            Collective::AllGather => self.all_gather,
        };
        measured.unwrap_or(Cost { latency_s: self.latency_s, bandwidth_bytes_per_s: self.bandwidth_bytes_per_s })
    }

    /// Seconds of collective `c` of `n` bytes (the whole buffer) among `ranks`: (p-1) alpha + (p-1)/p n / busbw
    /// for reduce-scatter and all-gather, twice both for all-reduce.
    pub fn seconds(&self, c: Collective, ranks: u64, n: f64) -> f64 {
        if ranks <= 1 || n <= 0.0 {
            return 0.0;
        }
        let p = ranks as f64;
        let cost = self.cost(c);
        let steps = if c == Collective::AllReduce { 2.0 } else { 1.0 };
        steps * ((p - 1.0) * cost.latency_s + (p - 1.0) / p * n / cost.bandwidth_bytes_per_s)
    }

    /// One message of n bytes between two ranks.
    pub fn send_seconds(&self, n: f64) -> f64 {
        self.latency_s + n / self.bandwidth_bytes_per_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_costs_by_hand() {
        let link = Link {
            latency_s: 1e-5,
            bandwidth_bytes_per_s: 1e9,
            all_reduce: None,
            reduce_scatter: None,
            all_gather: None,
        };
        // 4 ranks, 1 GB: reduce-scatter 3 alpha + 0.75 s; all-reduce twice that.
        assert!((link.seconds(Collective::ReduceScatter, 4, 1e9) - (3e-5 + 0.75)).abs() < 1e-12);
        assert!((link.seconds(Collective::AllReduce, 4, 1e9) - 2.0 * (3e-5 + 0.75)).abs() < 1e-12);
        assert_eq!(link.seconds(Collective::AllGather, 1, 1e9), 0.0);
        let measured = Link { all_gather: Some(Cost { latency_s: 0.0, bandwidth_bytes_per_s: 5e8 }), ..link };
        assert!((measured.seconds(Collective::AllGather, 2, 1e9) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn bad_clusters_name_the_key() {
        let base = r#""hosts": 2, "ranks_per_host": 8, "memory_per_rank_bytes": 8e10, "host_memory_bytes": 1e12, "flops_per_rank": 3e14"#;
        let intra = r#""intra": {"latency_s": 5e-6, "bandwidth_bytes_per_s": 2e11}"#;
        let err = |t: String| Cluster::from_json(&t, "c.json").unwrap_err().to_string();
        assert!(err(format!("{{{base}, \"links\": {{{intra}}}}}")).contains("c.json: \"links.inter\" is needed"));
        let links =
            format!("\"links\": {{{intra}, \"inter\": {{\"latency_s\": 2e-5, \"bandwidth_bytes_per_s\": 2.5e10}}}}");
        assert!(err(format!("{{{base}, {links}, \"comm_overlap\": 2}}"))
            .contains("c.json: \"comm_overlap\" must be within 0..1"));
        assert!(err(format!("{{{base}, {links}, \"nvme_bytes_per_s\": 0}}"))
            .contains("\"nvme_bytes_per_s\" must be a positive number"));
        let ok = format!("{{{base}, {links}}}");
        let c = Cluster::from_json(&ok, "c.json").unwrap();
        assert_eq!(c.world(), 16);
        assert!(c.accelerator);
    }
}
