//! One strategy's peak memory and step time.
use serde::Serialize;
use zerorun_config::estimate::{model_states_bytes, EstimateInput};
use zerorun_config::Precision;

use crate::cluster::Collective::{AllGather, AllReduce, ReduceScatter};
use crate::confidence::confidence;
use crate::{activations, Cluster, Link, Model, Options, Row, Strategy};

/// The peak's parts, bytes per rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryParts {
    /// The process's memory before the model.
    pub floor: f64,
    /// Model states resident in the rank's memory (not offloaded; on a CPU cluster with the NVMe swap buffers).
    pub model_states: f64,
    /// Stage 3's gathered units (up to `stage3_max_live_parameters`).
    pub gathered: f64,
    /// The reduction's buffers: the full gradients staged at stage 1, a unit's gradients and its reduced part at
    /// stages 2 and 3.
    pub reduction_buffers: f64,
    /// Autograd's saved tensors at the peak.
    pub activations: f64,
    /// The logits' gradient, and on an accelerator one layer's gradients and largest intermediate, alive during
    /// backward.
    pub temporaries: f64,
    /// Offloaded to the host (per rank) and to NVMe (per rank), outside the peak.
    pub host: f64,
    /// On NVMe.
    pub nvme: f64,
}

/// The step's parts, seconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Breakdown {
    /// Forward and backward (and recomputation), with the pipeline's bubble.
    pub compute: f64,
    /// ZeRO's collectives over the data-parallel group, the part not hidden behind compute.
    pub data_parallel_comm: f64,
    /// Tensor-parallel collectives.
    pub tensor_parallel_comm: f64,
    /// Sequence parallelism's all-to-alls (Ulysses: four a layer forward, four backward).
    pub sequence_parallel_comm: f64,
    /// Expert parallelism's all-to-alls of rows (two a mixture-of-experts layer forward, two backward).
    pub expert_parallel_comm: f64,
    /// Pipeline sends and receives between stages.
    pub pipeline_comm: f64,
    /// The optimizer step.
    pub optimizer: f64,
    /// Offload traffic: host link, NVMe reads and writes.
    pub offload: f64,
}

/// `sub_group_size` the planner writes for NVMe offload (DeepSpeed's default 1e9 would stage 16 GB of states).
pub const NVME_SUB_GROUP_SIZE: f64 = 1e8;

fn value_bytes(p: Precision) -> f64 {
    match p {
        Precision::Fp32 => 4.0,
        _ => 2.0,
    }
}

/// The experts of one expert-parallel position of `ep`: every layer's experts / E.
fn position_experts(model: &Model, ep: u64) -> f64 {
    model.expert_params() as f64 / ep as f64
}

/// Predicts one strategy (see the crate's documentation for the model).
pub fn predict(model: &Model, cluster: &Cluster, options: &Options, s: &Strategy) -> Row {
    let (p, t, b, m) = (s.pipeline, s.tensor, s.micro_batch as f64, s.gradient_accumulation as f64);
    // ZeRO shards over the data x sequence ranks; each rank of a sequence group holds 1/sp of every row's tokens.
    let (sp, d) = (s.sequence.max(1), s.data * s.sequence.max(1));
    let split = sp as f64;
    let e = value_bytes(options.precision);
    // One rank's slice of the model: its pipeline stage, its tensor-parallel share.
    let local_params = model.params() as f64 / (p * t) as f64;
    let local_layers = model.layers().div_ceil(p);
    // With expert parallelism a layer's experts are split over E positions: at stage 3 a layer's unit holds
    // experts / E of its experts, and at stages 1-2 a rank keeps the values of its position's experts only.
    let ep = s.experts.max(1);
    let input = EstimateInput {
        gpus_per_node: d,
        precision: options.precision,
        expert_parallel: ep,
        ..EstimateInput::new(local_params.round() as u64).with_experts(model.expert_params())
    };
    let (pb, gb, ob) = input.bytes_per_param();
    let shard = |sharded: bool| if sharded { local_params / d as f64 } else { local_params };
    // Values a rank keeps: its shard at stage 3, the dense ones and its position's experts at stages 1-2 (where
    // stage 1 keeps their gradients too, beside the fp32 gradient shard it reduces them into), everything at stage 0:
    // the estimate's own counts.
    let params = match s.stage {
        3 => local_params / d as f64,
        stage => input.resident_params(stage),
    } * pb as f64;
    let grads = match s.stage {
        2.. => local_params / d as f64 * gb as f64,
        1 => input.resident_params(1) * gb as f64 + local_params / d as f64 * input.split_gradient_shard() as f64,
        _ => local_params * gb as f64,
    };
    let optim = shard(s.stage >= 1) * ob as f64;
    let stepped = shard(s.stage >= 1);
    let moved = if s.offload.params() { params } else { 0.0 } + if s.offload.optimizer() { optim } else { 0.0 };
    // NVMe offload swaps through memory: the optimizer's states of a sub-group (`sub_group_size`) read in
    // and written back from a second buffer, and the parameter shard read ahead of its all-gather.
    let swap_buffers = if s.offload.nvme() {
        2.0 * ob as f64 * stepped.min(NVME_SUB_GROUP_SIZE) + if s.offload.params() { params } else { 0.0 }
    } else {
        0.0
    };
    let (host, nvme) = if s.offload.nvme() { (0.0, moved) } else { (moved, 0.0) };
    // On an accelerator the swap buffers are pinned host memory; on a CPU they are the rank's.
    let (resident, host) = if cluster.accelerator {
        (params + grads + optim - moved, host + swap_buffers)
    } else {
        (params + grads + optim - moved + swap_buffers, host)
    };

    let unit = model.largest_unit_params(ep) as f64 / t as f64;
    // Stage 3: the planner's configs leave the size keys to the engine, which sizes them from the units: two units
    // (the largest) live at a time, the one in use and the next one prefetched.
    let gathered = if s.stage == 3 { 2.0 * unit * pb as f64 } else { 0.0 };
    // The reduction's buffers: stage 1 stages the full gradients for one reduce-scatter; stages 2 and 3 reduce a
    // unit at a time: its gradients, staged, and the rank's part of them.
    let reduction = match s.stage {
        1 => local_params * gb as f64,
        2 | 3 => unit * gb as f64 * (2.0 + 1.0 / d as f64),
        _ => 0.0,
    };
    // 1F1B: the first stage holds min(p, m) micro-batches' activations of its layers.
    let in_flight = (p as f64).min(m);
    // Sequence parallelism divides every term by sp: the rank's tokens, and (Ulysses) heads / sp of the attention
    // over the whole sequence.
    let act_per_sample = activations::bytes_per_sample(model, local_layers, t, s.activation_checkpointing, e) / split;
    let activations = act_per_sample * b * in_flight;
    // What the forward creates besides what it keeps is reused, not retained at the peak: by an accelerator's
    // caching allocator and by zerorun's CPU allocator alike (what it keeps for reuse is bounded by the live peak).
    let created_per_sample = activations::created_bytes_per_sample(model, local_layers, t, e) / split;
    // Backward works through one layer at a time: the gradients of what that layer created.
    let layer_gradients = (b * activations::created_bytes_per_sample(model, 1, t, e)
        - b * activations::created_bytes_per_sample(model, 0, t, e))
        / split;
    // On a CPU the step peaks where backward starts (zerorun's allocator keeps nothing there): the logits'
    // gradient is the one temporary live. An accelerator's peak falls inside backward: a layer's gradients and
    // one MLP activation's beside it.
    let logits_gradient = match model {
        Model::Transformer(tr) => b * tr.seq_len as f64 / split * 4.0 * tr.vocab as f64 / t as f64,
        Model::Measured(_) => 0.0,
    };
    let within_backward = match model {
        Model::Transformer(tr) => layer_gradients + b * tr.seq_len as f64 / split * e * tr.ffn as f64 / t as f64,
        Model::Measured(_) => layer_gradients,
    };
    let temporaries = logits_gradient + if cluster.accelerator { within_backward } else { 0.0 };
    let peak = cluster.process_floor_bytes + resident + gathered + reduction + activations + temporaries;
    let host_per_host = cluster.ranks_per_host as f64 * (host + if cluster.accelerator { 0.0 } else { peak });
    let fits = peak <= cluster.memory_per_rank_bytes && host_per_host <= cluster.host_memory_bytes;

    // Time. Compute: FLOPs of the rank's share, recomputation adds a forward (a third of forward + backward).
    let flops = cluster.flops_per_rank.unwrap_or(1e11);
    let recompute = if s.activation_checkpointing { 4.0 / 3.0 } else { 1.0 };
    // Elementwise work streams what the forward creates through memory: written and read forward, the saved part
    // read and the gradients written and read backward (5 passes); recomputation adds the forward's 2.
    let passes = if s.activation_checkpointing { 7.0 } else { 5.0 };
    let memory_bw = cluster.memory_bytes_per_s();
    // And every operator costs its dispatch: about 100 per layer forward and backward (30 forward, twice that
    // backward, the norms' and residuals' included), 20 for the ends; recomputation runs the 30 again.
    let ops = local_layers as f64 * (90.0 + if s.activation_checkpointing { 30.0 } else { 0.0 }) + 20.0;
    let micro_compute = model.flops_per_sample() * b * recompute / (p * t) as f64 / split / flops
        + passes * created_per_sample * b / memory_bw
        + ops * cluster.op_overhead_s();
    // The pipeline's schedule: (m + p - 1) slots of one micro-batch's stage time.
    let slots = m + p as f64 - 1.0;
    let compute = slots * micro_compute;

    // The data-parallel group: t x d adjacent ranks (tensor innermost) inside one host, or across hosts.
    let dp_link = link_for(cluster, t * d);
    let (grad_bytes, param_bytes) = (local_params * gb as f64, local_params * pb as f64);
    let (dp_comm, copied) = match s.stage {
        0 => (dp_link.seconds(AllReduce, d, grad_bytes), 0.0),
        1 => (dp_link.seconds(ReduceScatter, d, grad_bytes) + dp_link.seconds(AllGather, d, param_bytes), grad_bytes),
        2 if ep > 1 => {
            // Each position's experts are reduced and refreshed over the d / E ranks at that position, a rank
            // moving its position's experts / E; the dense parameters over all d.
            let (dense, own, q) = (local_params - model.expert_params() as f64, position_experts(model, ep), d / ep);
            let reduce = dp_link.seconds(ReduceScatter, d, dense * gb as f64)
                + dp_link.seconds(ReduceScatter, q, own * gb as f64);
            let refresh =
                dp_link.seconds(AllGather, d, dense * pb as f64) + dp_link.seconds(AllGather, q, own * pb as f64);
            (m * reduce + refresh, m * (dense + own) * gb as f64 + (dense + own) * pb as f64)
        }
        2 => (
            m * dp_link.seconds(ReduceScatter, d, grad_bytes) + dp_link.seconds(AllGather, d, param_bytes),
            m * grad_bytes + param_bytes,
        ),
        _ if ep > 1 => {
            // Each position's experts are gathered and reduced over the d / E ranks at that position, a rank
            // moving its position's experts / E; the dense parameters over all d.
            let (dense, own, q) = (local_params - model.expert_params() as f64, position_experts(model, ep), d / ep);
            let over_all = 2.0 * dp_link.seconds(AllGather, d, dense * pb as f64)
                + dp_link.seconds(ReduceScatter, d, dense * gb as f64);
            let over_position = 2.0 * dp_link.seconds(AllGather, q, own * pb as f64)
                + dp_link.seconds(ReduceScatter, q, own * gb as f64);
            (m * (over_all + over_position), m * (dense + own) * (2.0 * pb as f64 + gb as f64))
        }
        _ => (
            m * (2.0 * dp_link.seconds(AllGather, d, param_bytes) + dp_link.seconds(ReduceScatter, d, grad_bytes)),
            m * (2.0 * param_bytes + grad_bytes),
        ),
    };
    // Sharded stages copy what they reduce or gather between the model's tensors and the flat buffers (read and
    // write), outside the collective itself, even on one data-parallel rank.
    let dp_comm = dp_comm + 2.0 * copied / memory_bw;
    let hidden_behind = (dp_comm * cluster.comm_overlap()).min(compute);
    let data_parallel_comm = dp_comm - hidden_behind;

    let (activation_msg, tp_per_layer) = match model {
        Model::Transformer(tr) => {
            let msg = b * tr.seq_len as f64 * tr.hidden as f64 * e;
            (msg, 4.0 * link_for(cluster, t).seconds(AllReduce, t, msg))
        }
        Model::Measured(_) => (0.0, 0.0),
    };
    let tensor_parallel_comm = slots * local_layers as f64 * tp_per_layer;
    // Ulysses: q, k, v and the output trade a rank's slice for its heads, forward and backward: 8 all-to-alls a
    // layer of the slice's activation, (sp - 1) / sp of it crossing (an all-gather's traffic for the same bytes).
    let sequence_parallel_comm = if sp > 1 {
        let slice = activation_msg / split;
        slots * local_layers as f64 * 8.0 * link_for(cluster, sp).seconds(AllGather, sp, slice)
    } else {
        0.0
    };
    // Expert parallelism: each layer sends a rank's token rows (top_k of them a token) to their experts' ranks and
    // the outputs back, forward and backward: 4 all-to-alls a layer, (E - 1) / E of each crossing; a recomputed
    // layer (activation checkpointing) runs its forward's 2 again.
    let expert_parallel_comm = match model {
        Model::Transformer(tr) if ep > 1 => {
            let rows = b * tr.seq_len as f64 * tr.top_k as f64 * tr.hidden as f64 * e;
            let all_to_alls = if s.activation_checkpointing { 6.0 } else { 4.0 };
            slots * local_layers as f64 * all_to_alls * link_for(cluster, ep).seconds(AllGather, ep, rows)
        }
        _ => 0.0,
    };
    // Each micro-batch's activation forward and its gradient backward cross every stage boundary.
    let pipeline_comm =
        if p > 1 { slots * 2.0 * link_for(cluster, t * d * p).send_seconds(activation_msg) } else { 0.0 };

    let (optimizer, offload) = if s.offload.optimizer() {
        let mut traffic = stepped * (gb + pb) as f64 / cluster.host_link_bytes_per_s();
        // NVMe is read and written in requests, each paying the disk's fixed cost beside its bytes.
        let request = cluster.nvme_request_latency_s.unwrap_or(0.0);
        if s.offload.nvme() {
            // fp32 master, momentum and variance read and written back, a sub-group at a time.
            let sub_groups = (stepped / NVME_SUB_GROUP_SIZE).ceil().max(1.0);
            traffic += 2.0 * stepped * ob as f64 / cluster.nvme_bytes_per_s.unwrap_or(f64::INFINITY)
                + 2.0 * sub_groups * request;
        }
        if s.offload.params() {
            // Forward and backward read the rank's parameter shard from where it lives: from NVMe a unit's
            // shard a request (the layers and the two ends).
            let bw = if s.offload.nvme() {
                traffic += m * 2.0 * (local_layers + 2) as f64 * request;
                cluster.nvme_bytes_per_s.unwrap_or(f64::INFINITY)
            } else {
                cluster.host_link_bytes_per_s()
            };
            traffic += m * 2.0 * params / bw;
        }
        (stepped / cluster.host_optimizer_params_per_s(), traffic)
    } else {
        (stepped / cluster.optimizer_params_per_s(), 0.0)
    };
    let time = Breakdown {
        compute,
        data_parallel_comm,
        tensor_parallel_comm,
        sequence_parallel_comm,
        expert_parallel_comm,
        pipeline_comm,
        optimizer,
        offload,
    };
    let step = compute
        + data_parallel_comm
        + tensor_parallel_comm
        + sequence_parallel_comm
        + expert_parallel_comm
        + pipeline_comm
        + optimizer
        + offload;
    let confidence = confidence(cluster, s, &time, step);
    Row {
        strategy: *s,
        peak_bytes_per_rank: peak,
        activation_bytes_per_rank: activations,
        model_state_bytes_per_rank: model_states_bytes(&input, s.stage) as f64,
        host_bytes_per_host: host_per_host,
        step_seconds: step,
        tokens_per_s: options.global_batch as f64 * model.seq_len() as f64 / step,
        fits,
        memory: MemoryParts {
            floor: cluster.process_floor_bytes,
            model_states: resident,
            gathered,
            reduction_buffers: reduction,
            activations,
            temporaries,
            host,
            nvme,
        },
        time,
        confidence,
    }
}

/// The link a group of `span` adjacent ranks crosses.
fn link_for(cluster: &Cluster, span: u64) -> Link {
    if span <= cluster.ranks_per_host {
        cluster.links.intra
    } else {
        cluster.inter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Links, Offload};

    #[test]
    fn one_strategy_by_hand() {
        // 1.2e9 FLOP/s, 2 ranks on one host at 1e9 B/s and no latency, a 2-layer GPT in fp32.
        let link = Link {
            latency_s: 0.0,
            bandwidth_bytes_per_s: 1e9,
            all_reduce: None,
            reduce_scatter: None,
            all_gather: None,
        };
        let cluster = Cluster {
            hosts: 1,
            ranks_per_host: 2,
            memory_per_rank_bytes: 1e10,
            host_memory_bytes: 2e10,
            flops_per_rank: Some(1.2e9),
            links: Links { intra: link, inter: None },
            accelerator: false,
            process_floor_bytes: 1e8,
            optimizer_params_per_s: Some(1e8),
            host_optimizer_params_per_s: None,
            host_link_bytes_per_s: None,
            nvme_bytes_per_s: None,
            memory_bytes_per_s: Some(1e10),
            op_overhead_s: Some(0.0),
            comm_overlap: None,
            cores_per_host: None,
            nvme_request_latency_s: None,
            measured: false,
        };
        let model =
            Model::from_json(r#"{"layers": 2, "hidden": 64, "heads": 4, "vocab": 65, "seq_len": 32}"#, "m").unwrap();
        let params = model.params() as f64; // 2 (12 h^2 + 13 h) + V h + s h + 2 h + V h + V
        assert_eq!(
            params,
            2.0 * (12.0 * 4096.0 + 13.0 * 64.0) + 65.0 * 64.0 + 32.0 * 64.0 + 128.0 + 65.0 * 64.0 + 65.0
        );
        let options = Options { global_batch: 8, precision: Precision::Fp32, max_micro_batch: 64 };
        let s = Strategy {
            stage: 2,
            offload: Offload::None,
            pipeline: 1,
            tensor: 1,
            sequence: 1,
            experts: 1,
            data: 2,
            micro_batch: 2,
            gradient_accumulation: 2,
            activation_checkpointing: false,
        };
        let row = predict(&model, &cluster, &options, &s);
        // Model states at stage 2, fp32 Adam: 4 P + (4 + 8) P / 2.
        assert_eq!(row.memory.model_states, 4.0 * params + 12.0 * params / 2.0);
        assert_eq!(row.model_state_bytes_per_rank, (4.0 * params + 12.0 * params / 2.0).round());
        // Activations: micro-batch 2 x the GPT's count per sample.
        let per_sample = 4.0 * (2.0 * (16.0 * 32.0 * 64.0 + 4.0 * 32.0 * 32.0) + 2.0 * 32.0 * 64.0 + 32.0 * 65.0);
        assert_eq!(row.activation_bytes_per_rank, 2.0 * per_sample);
        // Compute: 2 micro-batches of 2 samples at 6 x matrix params x s + 12 L s^2 h FLOPs each.
        let flops = 6.0 * (2.0 * 12.0 * 4096.0 + 65.0 * 64.0) * 32.0 + 12.0 * 2.0 * 32.0 * 32.0 * 64.0;
        // Elementwise: 5 passes over what the forward creates, per layer 2 s (h + 2 kv) + 4 a s^2 + 2 s h + 2 ffn s
        // values divided and 6 s h whole, plus the ends 2 s h + s V, in fp32, at 1e10 B/s.
        let created = 4.0
            * (2.0
                * (2.0 * 32.0 * 192.0
                    + 4.0 * 4.0 * 1024.0
                    + 2.0 * 32.0 * 64.0
                    + 2.0 * 256.0 * 32.0
                    + 6.0 * 32.0 * 64.0)
                + 2.0 * 32.0 * 64.0
                + 32.0 * 65.0);
        assert_eq!(created, 516_224.0);
        let micro = 2.0 * flops / 1.2e9 + 5.0 * created * 2.0 / 1e10;
        assert!((row.time.compute - 2.0 * micro).abs() < 1e-12);
        // Stage 2: a reduce-scatter per micro-batch, one all-gather per step, each (p-1)/p of 4 P bytes; no overlap
        // on a CPU cluster; the gradients and parameters copied in and out of the flat buffers (2 x 3 x 4 P bytes).
        let comm = 3.0 * 0.5 * 4.0 * params / 1e9 + 2.0 * 3.0 * 4.0 * params / 1e10;
        assert!((row.time.data_parallel_comm - comm).abs() < 1e-12);
        // The reduction's buffers at stage 2: the largest unit's gradients twice and its half (a block here).
        let block = 12.0 * 4096.0 + 13.0 * 64.0;
        assert_eq!(row.memory.reduction_buffers, block * 4.0 * 2.5);
        assert_eq!(row.memory.gathered, 0.0);
        // The optimizer steps half the parameters.
        assert!((row.time.optimizer - params / 2.0 / 1e8).abs() < 1e-12);
        assert_eq!(row.host_bytes_per_host, 2.0 * row.peak_bytes_per_rank);
        assert!(row.fits);
        // The same 2 ranks as one sequence group (one data-parallel rank, its 4 samples in 2 micro-batches of 2):
        // model states sharded the same, half the activations and the compute per rank, and the all-to-alls:
        // 8 a layer of half a micro-batch's activation (2 x 16 x 64 values), half of it crossing, at 1e9 B/s.
        let split =
            predict(&model, &cluster, &Options { global_batch: 4, ..options }, &Strategy { sequence: 2, data: 1, ..s });
        assert_eq!(split.memory.model_states, row.memory.model_states);
        assert_eq!(split.activation_bytes_per_rank, per_sample);
        assert!((split.time.compute - row.time.compute / 2.0).abs() < 1e-12);
        let all_to_alls = 2.0 * 2.0 * 8.0 * (0.5 * 2.0 * 16.0 * 64.0 * 4.0 / 1e9);
        assert!((split.time.sequence_parallel_comm - all_to_alls).abs() < 1e-12, "{:?}", split.time);
        assert_eq!(row.time.sequence_parallel_comm, 0.0);
        // Stage 3 with states and parameters on NVMe at 1e9 B/s and 1 ms a request: Adam's states (8 P / 2 bytes
        // in fp32, whose parameters are the master; one sub-group) read and written, two requests; each micro-batch reads the rank's parameter shard (4 P / 2
        // bytes) forward and backward, a unit (2 layers and the two ends) a request; the host link's share as before.
        let nvme = Cluster { nvme_bytes_per_s: Some(1e9), nvme_request_latency_s: Some(1e-3), ..cluster.clone() };
        let on_nvme = Strategy { stage: 3, offload: Offload::NvmeOptimizerParams, ..s };
        let row = predict(&model, &nvme, &options, &on_nvme);
        let host_link = (params / 2.0) * 8.0 / 2.5e10;
        let states = 2.0 * 8.0 * params / 2.0 / 1e9 + 2.0 * 1e-3;
        let parameters = 2.0 * 2.0 * 4.0 * params / 2.0 / 1e9 + 2.0 * 2.0 * 4.0 * 1e-3;
        assert!((row.time.offload - (host_link + states + parameters)).abs() < 1e-12, "{:?}", row.time);

        // A mixture of experts (4 SwiGLU experts of 128, top 2) at stage 3 on the 2 ranks, E = 1 and E = 2: the
        // experts of one position are gathered and reduced by the one rank at that position (no traffic), the dense
        // parameters over both; a layer's unit holds half its experts; four all-to-alls a layer of a micro-batch's
        // rows (2 samples x 32 tokens x 2 choices x 64 values), half of each crossing.
        let moe = Model::from_json(
            r#"{"layers": 2, "hidden": 64, "heads": 4, "vocab": 65, "seq_len": 32, "gated": true, "ffn": 128, "experts": 4, "top_k": 2}"#,
            "m",
        )
        .unwrap();
        let experts = 2.0 * 4.0 * 3.0 * 64.0 * 128.0;
        assert_eq!(moe.expert_params() as f64, experts);
        let stage3 = Strategy { stage: 3, ..s };
        let (one, two) = (
            predict(&moe, &cluster, &options, &stage3),
            predict(&moe, &cluster, &options, &Strategy { experts: 2, ..stage3 }),
        );
        let dense = moe.params() as f64 - experts;
        let comm =
            |gathered: f64, copied: f64| 2.0 * (3.0 * 0.5 * 4.0 * gathered / 1e9 + 2.0 * 3.0 * 4.0 * copied / 1e10);
        assert!((one.time.data_parallel_comm - comm(dense + experts, dense + experts)).abs() < 1e-12, "{:?}", one.time);
        assert!((two.time.data_parallel_comm - comm(dense, dense + experts / 2.0)).abs() < 1e-12, "{:?}", two.time);
        let layer_experts = experts / 2.0;
        let block = moe.largest_layer_params() as f64;
        assert_eq!(one.memory.gathered, 2.0 * block * 4.0);
        assert_eq!(two.memory.gathered, 2.0 * (block - layer_experts / 2.0) * 4.0);
        let rows = 2.0 * 32.0 * 2.0 * 64.0 * 4.0;
        assert!((two.time.expert_parallel_comm - 2.0 * 2.0 * 4.0 * 0.5 * rows / 1e9).abs() < 1e-12, "{:?}", two.time);
        assert_eq!(one.time.expert_parallel_comm, 0.0);
        assert_eq!(two.model_state_bytes_per_rank, one.model_state_bytes_per_rank);
    }

    #[test]
    fn expert_parallel_degrees_are_planned_at_stages_1_to_3_alone_and_with_checkpointing() {
        let cluster = Cluster::from_json(
            r#"{"hosts": 1, "ranks_per_host": 4, "memory_per_rank_bytes": 8e9, "host_memory_bytes": 3.2e10,
                "links": {"intra": {"latency_s": 0, "bandwidth_bytes_per_s": 1e9}}}"#,
            "c",
        )
        .unwrap();
        let moe = Model::from_json(
            r#"{"layers": 2, "hidden": 64, "heads": 4, "vocab": 65, "seq_len": 32, "gated": true, "ffn": 128, "experts": 4, "top_k": 2}"#,
            "m",
        )
        .unwrap();
        let options = Options { global_batch: 8, precision: Precision::Fp32, max_micro_batch: 2 };
        let all = crate::strategies(&moe, &cluster, &options);
        let degrees: std::collections::BTreeSet<u64> = all.iter().map(|s| s.experts).collect();
        assert_eq!(degrees.into_iter().collect::<Vec<_>>(), vec![1, 2, 4]);
        assert!(
            all.iter().all(|s| s.tensor == 1 && s.pipeline == 1 && s.sequence == 1),
            "no tensor, sequence or pipeline parallelism with experts"
        );
        for s in all.iter().filter(|s| s.experts > 1) {
            assert!(s.stage >= 1 && (s.tensor, s.pipeline, s.sequence) == (1, 1, 1), "{s:?}");
            assert_eq!(s.data % s.experts, 0, "{s:?}");
        }
        // At stages 1-2 a rank keeps its position's experts' values only: E = 2 holds half of them less (fp32).
        let at = |stage: u8, experts: u64| {
            let s = all.iter().find(|s| (s.stage, s.experts, s.offload) == (stage, experts, Offload::None)).unwrap();
            predict(&moe, &cluster, &options, s)
        };
        let saved = 4.0 * moe.expert_params() as f64 / 2.0;
        for row in [at(2, 1), at(2, 2)] {
            assert_eq!(row.model_state_bytes_per_rank.round(), row.memory.model_states.round(), "{row:?}");
        }
        assert_eq!((at(2, 1).memory.model_states - at(2, 2).memory.model_states).round(), saved.round());
        // Stage 1 keeps those experts' gradients too (twice as much less), beside an fp32 gradient shard.
        for row in [at(1, 1), at(1, 2)] {
            assert_eq!(row.model_state_bytes_per_rank.round(), row.memory.model_states.round(), "{row:?}");
        }
        let shard = 4.0 * moe.params() as f64 / 4.0;
        let less = at(1, 1).memory.model_states - at(1, 2).memory.model_states;
        assert_eq!(less.round(), (2.0 * saved - shard).round());
        assert_eq!(at(3, 1).memory.model_states, at(3, 2).memory.model_states);
        // Checkpointed layers recompute with their experts' unit nested: both, and the recomputation's forward
        // all-to-alls priced (6 a layer instead of 4).
        let e2: Vec<&Strategy> = all.iter().filter(|s| s.experts == 2 && s.micro_batch == 2).collect();
        let plain = e2.iter().find(|s| !s.activation_checkpointing).expect("E = 2 without");
        let checkpointed = e2.iter().find(|s| s.activation_checkpointing && s.offload == plain.offload).expect("with");
        let (a, b) = (predict(&moe, &cluster, &options, plain), predict(&moe, &cluster, &options, checkpointed));
        let ratio = b.time.expert_parallel_comm / a.time.expert_parallel_comm;
        assert!((ratio - 1.5).abs() < 1e-12, "{ratio}");
    }
}
