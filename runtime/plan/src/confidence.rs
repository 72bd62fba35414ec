//! How sure a predicted step is. Each part of the step ([`Breakdown`]) is priced from one figure of the cluster,
//! and the figures are not equally well known: a matmul rate measured at the model's shape predicts compute within
//! a few percent, a data sheet's bandwidth does not, and a disk shared with the page cache varies from run to run.
//! A row's uncertainty is its parts' shares of the step, each times how far its figure may be off, summed (the
//! parts' errors are not independent on one machine: shared cores slow compute and communication together, so
//! they are added, not added in quadrature). `zerorun plan` shows it beside each step and names the rows it is
//! least sure of; `zerorun plan validate` sets each measured error beside it.
use serde::Serialize;

use crate::{Breakdown, Cluster, Link, Strategy};

/// Compute priced by a matmul rate measured at the model's shape: `plan validate`'s compute-bound rows land within
/// 1-16% of it.
const COMPUTE_MEASURED: f64 = 0.15;
/// Compute priced by a stated rate (a data sheet's is a peak, not what the model's shapes achieve).
const COMPUTE_STATED: f64 = 0.5;
/// Collectives priced by their measured alpha-beta figures (`plan measure`): within 10% of runs here, 25% allowed
/// for message sizes away from the measured ones.
const COMM_MEASURED: f64 = 0.25;
/// Collectives priced by a link's stated latency and bandwidth: real collectives reach a fraction of the bus
/// bandwidth that depends on the implementation and the message size.
const COMM_STATED: f64 = 0.5;
/// The optimizer step priced by a measured AdamW rate.
const OPTIMIZER_MEASURED: f64 = 0.2;
/// The optimizer step priced by the default rate.
const OPTIMIZER_STATED: f64 = 0.5;
/// NVMe traffic: many requests of a unit's or a sub-group's size sharing the disk (and on a VM the host's page
/// cache) with the other ranks; the same NVMe config ran 0.49-0.72 s a step within one hour here.
const NVME: f64 = 0.4;
/// Host-link traffic priced by the default PCIe figure.
const HOST_LINK: f64 = 0.3;
/// Added to every part where a host's ranks outnumber its cores: ranks take turns on a core, and how the
/// scheduler interleaves them (a collective's waiters, one rank's compute beside another's copy) is not priced:
/// 4 ranks on 2 cores compute 1.91x, not 2x, what 2 ranks do, and their measured figures vary more.
const SHARED_CORES: f64 = 0.25;

/// How far a row's predicted step may be off, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Confidence {
    /// Relative uncertainty of the step: the measured step is expected within step x (1 +- relative).
    pub relative: f64,
    /// The part of the step that contributes most to the uncertainty (a [`Breakdown`] field's name).
    pub least_sure_part: &'static str,
    /// The host's ranks outnumber its cores (`cores_per_host`): every part is less sure.
    pub shared_cores: bool,
}

fn measured(link: &Link) -> bool {
    link.all_reduce.is_some() || link.reduce_scatter.is_some() || link.all_gather.is_some()
}

/// The uncertainty of `step` = the sum of `time`'s parts, for strategy `s` on `cluster`.
pub fn confidence(cluster: &Cluster, s: &Strategy, time: &Breakdown, step: f64) -> Confidence {
    let shared_cores = cluster.cores_per_host.is_some_and(|c| cluster.ranks_per_host > c);
    let comm = |span: u64| {
        let link = if span <= cluster.ranks_per_host { cluster.links.intra } else { cluster.inter() };
        if measured(&link) {
            COMM_MEASURED
        } else {
            COMM_STATED
        }
    };
    let data_span = s.tensor * s.data * s.sequence.max(1);
    let offload = if s.offload.nvme() {
        NVME
    } else if cluster.host_link_bytes_per_s.is_some() {
        HOST_LINK
    } else {
        COMM_STATED
    };
    let parts: [(&'static str, f64, f64); 8] = [
        (
            "compute",
            time.compute,
            if cluster.measured && cluster.flops_per_rank.is_some() { COMPUTE_MEASURED } else { COMPUTE_STATED },
        ),
        ("data_parallel_comm", time.data_parallel_comm, comm(data_span)),
        ("tensor_parallel_comm", time.tensor_parallel_comm, comm(s.tensor)),
        ("sequence_parallel_comm", time.sequence_parallel_comm, comm(s.sequence.max(1))),
        ("expert_parallel_comm", time.expert_parallel_comm, comm(s.experts.max(1))),
        ("pipeline_comm", time.pipeline_comm, comm(data_span * s.pipeline)),
        (
            "optimizer",
            time.optimizer,
            if cluster.measured && cluster.optimizer_params_per_s.is_some() {
                OPTIMIZER_MEASURED
            } else {
                OPTIMIZER_STATED
            },
        ),
        ("offload", time.offload, offload),
    ];
    let extra = if shared_cores { SHARED_CORES } else { 0.0 };
    let step = step.max(f64::MIN_POSITIVE);
    let (mut relative, mut least, mut most) = (0.0, "compute", -1.0);
    for (name, seconds, u) in parts {
        let part = seconds / step * (u + extra);
        relative += part;
        if part > most {
            (least, most) = (name, part);
        }
    }
    Confidence { relative, least_sure_part: least, shared_cores }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Cost, Links, Offload};

    fn cluster(measured: bool, cores: Option<u64>) -> Cluster {
        let cost = Cost { latency_s: 1e-5, bandwidth_bytes_per_s: 1e9 };
        let link = Link {
            latency_s: 1e-5,
            bandwidth_bytes_per_s: 1e9,
            all_reduce: measured.then_some(cost),
            reduce_scatter: measured.then_some(cost),
            all_gather: measured.then_some(cost),
        };
        Cluster {
            hosts: 1,
            ranks_per_host: 4,
            memory_per_rank_bytes: 1e10,
            host_memory_bytes: 4e10,
            flops_per_rank: Some(1e10),
            links: Links { intra: link, inter: None },
            accelerator: false,
            process_floor_bytes: 1e8,
            optimizer_params_per_s: Some(1e8),
            host_optimizer_params_per_s: None,
            host_link_bytes_per_s: None,
            nvme_bytes_per_s: Some(1e9),
            memory_bytes_per_s: None,
            op_overhead_s: None,
            comm_overlap: None,
            cores_per_host: cores,
            nvme_request_latency_s: None,
            measured,
        }
    }

    fn strategy(offload: Offload) -> Strategy {
        Strategy {
            stage: 3,
            offload,
            pipeline: 1,
            tensor: 1,
            sequence: 1,
            experts: 1,
            data: 4,
            micro_batch: 1,
            gradient_accumulation: 1,
            activation_checkpointing: false,
        }
    }

    fn time(compute: f64, comm: f64, optimizer: f64, offload: f64) -> Breakdown {
        Breakdown {
            compute,
            data_parallel_comm: comm,
            tensor_parallel_comm: 0.0,
            sequence_parallel_comm: 0.0,
            expert_parallel_comm: 0.0,
            pipeline_comm: 0.0,
            optimizer,
            offload,
        }
    }

    #[test]
    fn each_part_weighs_by_its_share_and_how_its_figure_is_known() {
        let t = time(0.6, 0.2, 0.2, 0.0);
        // Measured: 0.6 x 0.15 + 0.2 x 0.25 + 0.2 x 0.2.
        let c = confidence(&cluster(true, Some(4)), &strategy(Offload::None), &t, 1.0);
        assert!((c.relative - (0.09 + 0.05 + 0.04)).abs() < 1e-12, "{c:?}");
        assert_eq!((c.least_sure_part, c.shared_cores), ("compute", false));
        // Stated: every part at 0.5.
        let c = confidence(&cluster(false, None), &strategy(Offload::None), &t, 1.0);
        assert!((c.relative - 0.5).abs() < 1e-12, "{c:?}");
        // 4 ranks on 2 cores: 0.25 more on every part.
        let c = confidence(&cluster(true, Some(2)), &strategy(Offload::None), &t, 1.0);
        assert!((c.relative - (0.18 + 0.25)).abs() < 1e-12 && c.shared_cores, "{c:?}");
        // NVMe traffic a third of the step outweighs compute's half.
        let t = time(0.5, 0.0, 0.1, 0.4);
        let c = confidence(&cluster(true, Some(4)), &strategy(Offload::NvmeOptimizerParams), &t, 1.0);
        assert!((c.relative - (0.075 + 0.02 + 0.16)).abs() < 1e-12, "{c:?}");
        assert_eq!(c.least_sure_part, "offload");
    }
}
