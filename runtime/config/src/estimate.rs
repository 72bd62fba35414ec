//! Memory of model states before a run: for every ZeRO stage and offload option, the bytes per device and per host,
//! as DeepSpeed's estimators compute them (../shared/reference/zero-facts.md), plus the exact model-state bytes a
//! rank holds (parameters, gradients, optimizer states: what the engine's accounting measures).
use serde::Serialize;

use crate::{Config, OffloadDevice, Precision};

/// DeepSpeed's additional buffer factor for host memory.
pub const ADDITIONAL_BUFFER_FACTOR: f64 = 1.5;

/// What the estimate is about.
#[derive(Debug, Clone, PartialEq)]
pub struct EstimateInput {
    /// Trainable parameters.
    pub params: u64,
    /// Parameters of the largest layer (gathered whole at stage 3); None leaves that term out.
    pub largest_layer_params: Option<u64>,
    /// Hosts.
    pub nodes: u64,
    /// Ranks per host.
    pub gpus_per_node: u64,
    /// The parameters' precision.
    pub precision: Precision,
    /// fp32 values the optimizer keeps per parameter (Adam: 2).
    pub optimizer_states: u64,
    /// Frozen parameters (requires_grad off: a frozen backbone, a LoRA base), not counted in `params`: they
    /// cost their values only, no gradient and no optimizer state; partitioned at stage 3.
    pub frozen_params: u64,
    /// Bytes of one frozen value; None: the trainable parameters' (2 for 16-bit models, 4 for fp32).
    pub frozen_bytes_per_param: Option<u64>,
    /// `optimizer_in_backward`: stage 3 steps each unit's part as its gradients are reduced and holds no gradient
    /// shard.
    pub optimizer_in_backward: bool,
    /// `zero_hpz_partition_size` (1: off): stage 3 keeps a secondary copy of the parameters split over this many
    /// ranks (a host's) between a step's first gathers and the next step.
    pub hpz_partition_size: u64,
    /// `mics_shard_size`: the model states are partitioned over groups of this many ranks, not over every rank.
    pub shard_group_size: Option<u64>,
    /// Trainable parameters of a mixture of experts' experts (part of `params`), split over `expert_parallel`
    /// positions: at stage 2 with units (the Llama example's, or `engine.unit` scopes) a rank holds the values
    /// of its position's experts only. 0: none, or not split.
    pub expert_params: u64,
    /// `expert_parallel.autoep_size` (1: every rank computes every expert).
    pub expert_parallel: u64,
}

impl EstimateInput {
    /// An estimate for `params` trainable fp32 parameters with Adam on one rank of one host.
    pub fn new(params: u64) -> Self {
        EstimateInput {
            params,
            largest_layer_params: None,
            nodes: 1,
            gpus_per_node: 1,
            precision: Precision::Bf16,
            optimizer_states: 2,
            frozen_params: 0,
            frozen_bytes_per_param: None,
            optimizer_in_backward: false,
            hpz_partition_size: 1,
            shard_group_size: None,
            expert_params: 0,
            expert_parallel: 1,
        }
    }

    /// Precision and optimizer from a config.
    pub fn with_config(mut self, config: &Config) -> Self {
        self.precision = config.precision();
        self.optimizer_states = config.optimizer.as_ref().map_or(2, |o| o.states_per_param() as u64);
        self.optimizer_in_backward = config.optimizer_in_backward;
        self.hpz_partition_size = config.zero_optimization.zero_hpz_partition_size;
        self.shard_group_size = config.zero_optimization.mics_shard_size;
        self.expert_parallel = config.expert_parallel.size();
        self
    }

    /// `params` of which are experts split over the expert-parallel positions (see [`EstimateInput::expert_params`]).
    pub fn with_experts(mut self, params: u64) -> Self {
        self.expert_params = params;
        self
    }

    /// Parameter values (and, at stage 1, gradients) one rank holds at stages 0-2: all of them, but at stages 1-2
    /// only its expert-parallel position's share of the experts.
    pub fn resident_params(&self, stage: u8) -> f64 {
        let e = self.expert_parallel.max(1) as f64;
        let elsewhere = if matches!(stage, 1 | 2) { self.expert_params as f64 * (1.0 - 1.0 / e) } else { 0.0 };
        self.params as f64 - elsewhere
    }

    /// Bytes per parameter of stage 1's fp32 gradient shard: 4 where it splits experts over their positions
    /// (reduced unit by unit into a shard, as stage 2), 0 for the flat buffer (reduced in place in the gradients).
    pub fn split_gradient_shard(&self) -> u64 {
        if self.expert_params > 0 && self.expert_parallel > 1 {
            4
        } else {
            0
        }
    }

    fn ranks(&self) -> u64 {
        (self.nodes * self.gpus_per_node).max(1)
    }

    /// Ranks the model states are partitioned over: a shard group's, else every rank.
    fn partitions(&self) -> u64 {
        self.shard_group_size.map_or(self.ranks(), |s| s.clamp(1, self.ranks()))
    }

    /// Bytes of the frozen parameters one rank holds at `stage` (all of them, or its share at stage 3).
    pub fn frozen_bytes(&self, stage: u8) -> f64 {
        let bytes = (self.frozen_params * self.frozen_bytes_per_param.unwrap_or(self.bytes_per_param().0)) as f64;
        if stage == 3 {
            bytes / self.partitions() as f64
        } else {
            bytes
        }
    }

    /// Bytes per parameter of (parameters, gradients, optimizer states incl. an fp32 master copy when the
    /// parameters are 16-bit).
    pub fn bytes_per_param(&self) -> (u64, u64, u64) {
        match self.precision {
            Precision::Fp32 => (4, 4, 4 * self.optimizer_states),
            Precision::Fp16 | Precision::Bf16 => (2, 2, 4 + 4 * self.optimizer_states),
        }
    }
}

/// One row of the estimate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EstimateRow {
    /// The ZeRO stage.
    pub stage: u8,
    /// Where optimizer states are.
    pub offload_optimizer: OffloadDevice,
    /// Where parameters are.
    pub offload_param: OffloadDevice,
    /// Accelerator (or, on CPU runs, process) memory per rank, DeepSpeed's estimator.
    pub per_device_bytes: u64,
    /// Host memory per node, DeepSpeed's estimator (with the additional buffer factor).
    pub per_host_bytes: u64,
    /// Exact parameter + gradient + optimizer-state bytes one rank holds wherever they live (no buffers).
    pub model_states_bytes: u64,
}

/// Model-state bytes one rank holds at `stage` (the ZeRO paper's formulas, generalised to any precision and
/// optimizer): stage 0 keeps everything, 1 shards optimizer states, 2 also gradients, 3 also parameters.
pub fn model_states_bytes(input: &EstimateInput, stage: u8) -> u64 {
    let (p, g, o) = input.bytes_per_param();
    let (psi, n) = (input.params as f64, input.partitions() as f64);
    let bytes = match stage {
        0 => psi * (p + g + o) as f64,
        // Values and gradients of the dense parameters and this position's experts; states over every rank. Split
        // so, stage 1 reduces each unit into an fp32 gradient shard as stage 2 does (the flat buffer reduces in place).
        1 => input.resident_params(1) * (p + g) as f64 + psi * (o + input.split_gradient_shard()) as f64 / n,
        // Each position's experts' gradients and states are split over its W / E ranks: experts / W a rank.
        2 => input.resident_params(2) * p as f64 + psi * (g + o) as f64 / n,
        _ if input.optimizer_in_backward => psi * (p + o) as f64 / n,
        _ => psi * (p + g + o) as f64 / n,
    };
    (bytes + input.frozen_bytes(stage)).round() as u64
}

/// Every stage and CPU-offload option, in DeepSpeed's estimator terms.
pub fn estimate(input: &EstimateInput) -> Vec<EstimateRow> {
    let psi = input.params as f64;
    let n = input.partitions() as f64;
    let gpn = input.gpus_per_node as f64;
    let abf = ADDITIONAL_BUFFER_FACTOR;
    // DeepSpeed: the largest layer is gathered in 16 bits with its gradient (4 bytes per parameter).
    let largest = 4.0 * input.largest_layer_params.unwrap_or(0) as f64;
    // With zero.Init, stage-3 host memory is divided among the nodes.
    let g = 1.0 / input.nodes.max(1) as f64;
    let (pb, gb, ob) = input.bytes_per_param();
    let full = (pb + gb + ob) as f64; // 16 for mixed-precision Adam
    let states = (gb + ob) as f64; // gradients + optimizer states (14)
    use OffloadDevice::{Cpu, None as Off};
    let row = |stage: u8, oo: OffloadDevice, op: OffloadDevice, device: f64, host: f64| EstimateRow {
        stage,
        offload_optimizer: oo,
        offload_param: op,
        // Frozen values live where the parameters do: on the device, or on the host with offload_param.
        per_device_bytes: (device + if op == Off { input.frozen_bytes(stage) } else { 0.0 }).round() as u64,
        per_host_bytes: (host + if op == Off { 0.0 } else { input.frozen_bytes(stage) * gpn }).round() as u64,
        model_states_bytes: model_states_bytes(input, stage),
    };
    let load = psi * 4.0 * gpn * abf; // fp32 weights loaded on the host, once per local rank

    // hpZ's secondary partition: the parameters once more, over a host's k ranks (2 Psi / k in 16 bits).
    let hpz = if input.hpz_partition_size > 1 { psi * pb as f64 / input.hpz_partition_size as f64 } else { 0.0 };
    let largest = largest + hpz;
    vec![
        row(0, Off, Off, psi * full, load),
        row(1, Off, Off, psi * (pb + gb) as f64 + psi * ob as f64 / n, load),
        row(1, Cpu, Off, psi * pb as f64, psi * (4.0 * n).max(full) * abf),
        row(2, Off, Off, psi * pb as f64 + psi * (states + 4.0) / n, load),
        row(2, Cpu, Off, psi * pb as f64, psi * (4.0 * n).max(full) * abf),
        row(3, Off, Off, largest + psi * (full + 2.0) / n, psi * 4.0 * g * abf),
        row(3, Cpu, Off, largest + psi * pb as f64 / n, psi * full * g * abf),
        row(3, Cpu, Cpu, largest, psi * (full + 2.0) * g * abf),
    ]
}

/// The row matching a config's stage and offload settings.
pub fn row_for<'a>(rows: &'a [EstimateRow], config: &Config) -> Option<&'a EstimateRow> {
    let z = &config.zero_optimization;
    let cpu_like = |d: OffloadDevice| if d == OffloadDevice::None { OffloadDevice::None } else { OffloadDevice::Cpu };
    rows.iter().find(|r| {
        r.stage == z.stage
            && r.offload_optimizer == cpu_like(z.offload_optimizer.device)
            && r.offload_param == cpu_like(z.offload_param.device)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_groups_partition_over_the_group_not_every_rank() {
        let eight = EstimateInput { nodes: 2, gpus_per_node: 4, ..EstimateInput::new(1_000_000) };
        let grouped = EstimateInput { shard_group_size: Some(2), ..eight.clone() };
        let two = EstimateInput { nodes: 1, gpus_per_node: 2, ..eight.clone() };
        for stage in 0..=3 {
            assert_eq!(model_states_bytes(&grouped, stage), model_states_bytes(&two, stage), "stage {stage}");
        }
        assert!(model_states_bytes(&grouped, 3) > model_states_bytes(&eight, 3));
        let device = |i: &EstimateInput| estimate(i).iter().map(|r| r.per_device_bytes).collect::<Vec<_>>();
        assert_eq!(device(&grouped), device(&two));
    }

    #[test]
    fn at_stages_1_2_a_rank_holds_its_expert_parallel_positions_experts_only() {
        // 1M parameters of which 800k experts over E = 4 positions on 8 ranks, mixed-precision Adam.
        let dense = EstimateInput { nodes: 1, gpus_per_node: 8, ..EstimateInput::new(1_000_000) };
        let moe = EstimateInput { expert_parallel: 4, ..dense.clone() }.with_experts(800_000);
        // Values: 200k dense + 200k of its position's experts, 2 bytes each; gradients and states over 8 ranks.
        assert_eq!(model_states_bytes(&moe, 2), 2 * 400_000 + 14 * 1_000_000 / 8);
        // Stage 1: the gradients of those 400k too; the states (12 bytes) and the fp32 gradient shard over 8 ranks.
        assert_eq!(model_states_bytes(&moe, 1), (2 + 2) * 400_000 + (12 + 4) * 1_000_000 / 8);
        for stage in [0, 3] {
            assert_eq!(model_states_bytes(&moe, stage), model_states_bytes(&dense, stage), "stage {stage}");
        }
        let one = EstimateInput { expert_parallel: 1, ..moe.clone() };
        assert_eq!(model_states_bytes(&one, 2), model_states_bytes(&dense, 2));
        assert_eq!(model_states_bytes(&one, 1), model_states_bytes(&dense, 1));
    }

    #[test]
    fn zero_paper_worked_example() {
        // Psi = 7.5e9, N = 64, mixed-precision Adam: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
        let input = EstimateInput { nodes: 8, gpus_per_node: 8, ..EstimateInput::new(7_500_000_000) };
        let gb = |s| model_states_bytes(&input, s) as f64 / 1e9;
        assert!((gb(0) - 120.0).abs() < 0.05);
        assert!((gb(1) - 31.4).abs() < 0.05);
        assert!((gb(2) - 16.6).abs() < 0.05);
        assert!((gb(3) - 1.875).abs() < 0.01);
    }

    #[test]
    fn hpz_adds_the_parameters_over_its_partition_at_stage_3_only() {
        let base = EstimateInput { nodes: 2, gpus_per_node: 4, ..EstimateInput::new(1_000_000) };
        let hpz = EstimateInput { hpz_partition_size: 4, ..base.clone() };
        for (a, b) in estimate(&base).iter().zip(estimate(&hpz)) {
            let extra = b.per_device_bytes as i64 - a.per_device_bytes as i64;
            assert_eq!(extra, if a.stage == 3 { 2 * 1_000_000 / 4 } else { 0 }, "{a:?}");
        }
        let fp32 = EstimateInput { precision: Precision::Fp32, ..hpz };
        let row = estimate(&fp32).into_iter().find(|r| r.stage == 3).unwrap();
        let plain = estimate(&EstimateInput { hpz_partition_size: 1, ..fp32 }).into_iter().find(|r| r.stage == 3);
        assert_eq!(row.per_device_bytes - plain.unwrap().per_device_bytes, 4 * 1_000_000 / 4);
    }

    #[test]
    fn deepspeed_estimator_rows() {
        let input = EstimateInput {
            nodes: 1,
            gpus_per_node: 4,
            largest_layer_params: Some(1000),
            ..EstimateInput::new(1_000_000)
        };
        let rows = estimate(&input);
        let find = |s, oo, op| {
            rows.iter().find(|r| r.stage == s && r.offload_optimizer == oo && r.offload_param == op).unwrap()
        };
        use OffloadDevice::{Cpu, None as Off};
        // ZeRO-2: GPU 2P + 18P/N without offload; 2P with it, host P * max(4N, 16) * 1.5.
        assert_eq!(find(2, Off, Off).per_device_bytes, 2_000_000 + 18_000_000 / 4);
        assert_eq!(find(2, Cpu, Off).per_device_bytes, 2_000_000);
        assert_eq!(find(2, Cpu, Off).per_host_bytes, 24_000_000);
        // ZeRO-3: L + 18P/N; L + 2P/N with optimizer offload (host 16 P g abf); L with both (host 18 P g abf).
        assert_eq!(find(3, Off, Off).per_device_bytes, 4_000 + 18_000_000 / 4);
        assert_eq!(find(3, Cpu, Off).per_device_bytes, 4_000 + 500_000);
        assert_eq!(find(3, Cpu, Off).per_host_bytes, 24_000_000);
        assert_eq!(find(3, Cpu, Cpu).per_device_bytes, 4_000);
        assert_eq!(find(3, Cpu, Cpu).per_host_bytes, 27_000_000);
        // fp32 training: 4 + 4 + 8 bytes per parameter.
        let fp32 = EstimateInput { precision: Precision::Fp32, ..input };
        assert_eq!(model_states_bytes(&fp32, 0), 16_000_000);
        assert_eq!(model_states_bytes(&fp32, 2), 4_000_000 + 12_000_000 / 4);
    }
}
