//! `zerorun estimate`: model-state memory per device and per host for every stage and offload option.
//!
//!     zerorun estimate --params P [--largest-layer-params L] [--frozen-params F [--frozen-bytes B]] [--nodes X] [--gpus-per-node Y] [--json]
//!     zerorun estimate --config ds_config.json --model MODEL_DESC.json [--nodes X] [--gpus-per-node Y]
use std::path::PathBuf;

use clap::Args;
use serde::Deserialize;
use zerorun_config::estimate::{estimate, row_for, EstimateInput};
use zerorun_config::Config;

use super::{emit, CliError};

#[derive(Args)]
pub struct EstimateArgs {
    /// Parameter count (accepts 1e9, 7.5e9, ...).
    #[arg(long)]
    params: Option<f64>,
    /// Parameters of the largest layer (stage 3 gathers it whole); default: from --model, else all.
    #[arg(long)]
    largest_layer_params: Option<f64>,
    /// Frozen parameters besides --params (requires_grad off: a frozen backbone, a LoRA base): their values
    /// only, no gradient or optimizer state; partitioned at stage 3.
    #[arg(long, default_value_t = 0.0)]
    frozen_params: f64,
    /// Bytes of one frozen value (2 for 16-bit, 4 for fp32); default: the trainable parameters'.
    #[arg(long)]
    frozen_bytes: Option<u64>,
    #[arg(long, default_value_t = 1)]
    nodes: u64,
    #[arg(long, default_value_t = 1)]
    gpus_per_node: u64,
    /// A ds_config.json: its precision and optimizer are used, and its row is marked.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A model description: {"layers", "hidden", "vocab", "seq_len"} of a GPT (with "heads" for --micro-batch; with
    /// "heads" and the planner's keys "kv_heads", "ffn", "gated", "flash_attention", "experts", "top_k" any of
    /// `zerorun plan`'s transformers, Llama's and Mixtral's), or {"params"}.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Samples per micro-batch: with a transformer --model that names "heads" and "seq_len", the activations one
    /// rank keeps for backward are estimated too.
    #[arg(long)]
    micro_batch: Option<u64>,
    /// Activations with every layer recomputed in backward (each layer keeps its input; one layer is rebuilt).
    #[arg(long)]
    activation_checkpointing: bool,
    /// Ranks each sequence is split over (DeepSpeed-Ulysses): a rank keeps 1/S of every activation (its slice of the
    /// tokens; its heads/S of the attention's probabilities). Default: --config's `sequence_parallel_size`, else 1.
    #[arg(long)]
    sequence_parallel: Option<u64>,
    /// Print `{"rows": [...]}`.
    #[arg(long)]
    json: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelDesc {
    params: Option<f64>,
    layers: Option<u64>,
    hidden: Option<u64>,
    vocab: Option<u64>,
    seq_len: Option<u64>,
    /// The output head shares the token embedding (GPT-2); default false.
    tied: Option<bool>,
    largest_layer_params: Option<f64>,
    /// Attention heads: with `seq_len`, what the activation estimate needs.
    heads: Option<u64>,
    /// The planner's transformer keys (`zerorun plan`'s model file): grouped-query attention, the MLP's width,
    /// Llama's SwiGLU, fused attention, Mixtral's experts. With them the counts are the planner's.
    kv_heads: Option<u64>,
    ffn: Option<u64>,
    gated: Option<bool>,
    flash_attention: Option<bool>,
    experts: Option<u64>,
    top_k: Option<u64>,
}

impl ModelDesc {
    /// (params, largest layer) of a GPT: 12 h^2 + 13 h per block (attention 4 h^2, MLP 8 h^2, biases, two norms),
    /// token and position embeddings, a final norm and (unless tied) the output head; the largest layer is the
    /// embedding or one block.
    /// With the planner's transformer (`planner`), its counts.
    fn sizes(
        &self,
        planner: Option<&zerorun_plan::Model>,
        file: &std::path::Path,
    ) -> Result<(u64, Option<u64>), CliError> {
        if let Some(p) = self.params {
            return Ok((p as u64, self.largest_layer_params.map(|l| l as u64)));
        }
        if let Some(model) = planner {
            let largest = self.largest_layer_params.map_or(model.largest_layer_params(), |x| x as u64);
            return Ok((model.params(), Some(largest)));
        }
        match (self.layers, self.hidden, self.vocab) {
            (Some(l), Some(h), Some(v)) => {
                let block = 12 * h * h + 13 * h;
                let embed = v * h + self.seq_len.unwrap_or(0) * h;
                let head = if self.tied.unwrap_or(false) { 0 } else { v * h + v };
                Ok((
                    l * block + embed + 2 * h + head,
                    Some(self.largest_layer_params.map_or(block.max(v * h), |x| x as u64)),
                ))
            }
            _ => Err(CliError::Usage(format!(
                "{}: give \"params\", or \"layers\", \"hidden\" and \"vocab\"",
                file.display()
            ))),
        }
    }

    /// The planner's transformer (the file `text` read by the planner), when the description names heads and a
    /// sequence length (what it needs) and no `params`; an error when it gives the planner's own keys without them.
    fn planner_model(&self, text: &str, file: &std::path::Path) -> Result<Option<zerorun_plan::Model>, CliError> {
        if self.params.is_some() {
            return Ok(None);
        }
        let planner_only = self.kv_heads.is_some()
            || self.ffn.is_some()
            || self.gated.is_some()
            || self.flash_attention.is_some()
            || self.experts.is_some()
            || self.top_k.is_some();
        let shaped = [self.layers, self.hidden, self.heads, self.vocab, self.seq_len].iter().all(Option::is_some);
        match (shaped, planner_only) {
            (true, _) => zerorun_plan::Model::from_json(text, &file.display().to_string())
                .map(Some)
                .map_err(|e| CliError::Usage(e.to_string())),
            (false, true) => Err(CliError::Usage(format!(
                "{}: kv_heads, ffn, gated, flash_attention, experts and top_k describe a transformer with \"layers\", \"hidden\", \"heads\", \"vocab\" and \"seq_len\"",
                file.display()
            ))),
            (false, false) => Ok(None),
        }
    }
}

/// The activations of one micro-batch of `micro` samples on one rank (values of `value_bytes`): kept at the end of
/// forward, and at the peak of backward (with recomputation, one layer rebuilt on top). The count is the planner's
/// (`zerorun_plan::activations`): what a tch transformer layer without dropout saves.
fn activations(model: &zerorun_plan::Model, micro: u64, recompute: bool, value_bytes: f64) -> (f64, f64) {
    let layers = model.layers();
    let per_sample = zerorun_plan::activations::bytes_per_sample(model, layers, 1, recompute, value_bytes);
    let layer = zerorun_plan::activations::bytes_per_sample(model, 1, 1, false, value_bytes)
        - zerorun_plan::activations::bytes_per_sample(model, 0, 1, false, value_bytes);
    let peak = per_sample * micro as f64;
    let end_of_forward = if recompute { peak - layer * micro as f64 } else { peak };
    (end_of_forward, peak)
}

/// Bytes in the largest binary unit that keeps the number >= 1.
fn human(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

pub fn run(a: EstimateArgs) -> Result<(), CliError> {
    let config = a.config.as_ref().map(Config::from_file).transpose()?;
    if a.micro_batch.is_some() && a.model.is_none() {
        return Err(CliError::Usage("--micro-batch needs --model MODEL_DESC.json (a transformer's shape)".into()));
    }
    let mut activation_bytes = None;
    let (params, mut largest, expert_params) = match (&a.model, a.params) {
        (Some(path), None) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| CliError::Io { context: format!("reading {}", path.display()), source: e })?;
            let desc: ModelDesc =
                serde_json::from_str(&text).map_err(|e| CliError::Usage(format!("{}: {e}", path.display())))?;
            let planner = desc.planner_model(&text, path)?;
            if let Some(micro) = a.micro_batch {
                let model = planner.as_ref().ok_or_else(|| {
                    CliError::Usage(format!(
                        "{}: --micro-batch needs a transformer description with \"layers\", \"hidden\", \"heads\", \"vocab\" and \"seq_len\"",
                        path.display()
                    ))
                })?;
                let value_bytes = match config.as_ref().map(Config::precision) {
                    Some(zerorun_config::Precision::Fp32) | None => 4.0,
                    _ => 2.0,
                };
                let s = a.sequence_parallel.or(config.as_ref().map(|c| c.sequence_parallel_size)).unwrap_or(1);
                if s == 0 || desc.seq_len.is_some_and(|t| t % s != 0) {
                    return Err(CliError::Usage(format!(
                        "--sequence-parallel {s}: the sequence of {} tokens does not split into {s} slices",
                        desc.seq_len.unwrap_or(0)
                    )));
                }
                let (end, peak) = activations(model, micro.max(1), a.activation_checkpointing, value_bytes);
                activation_bytes = Some((micro, (end / s as f64, peak / s as f64), s));
            }
            let (params, largest) = desc.sizes(planner.as_ref(), path)?;
            (params, largest, planner.as_ref().map_or(0, zerorun_plan::Model::expert_params))
        }
        (None, Some(p)) if p >= 1.0 => (p as u64, None, 0),
        (Some(_), Some(_)) => return Err(CliError::Usage("give --params or --model, not both".into())),
        _ => return Err(CliError::Usage("give --params P (>= 1) or --model MODEL_DESC.json".into())),
    };
    if let Some(l) = a.largest_layer_params {
        largest = Some(l as u64);
    }
    if a.nodes == 0 || a.gpus_per_node == 0 {
        return Err(CliError::Usage("--nodes and --gpus-per-node must be >= 1".into()));
    }
    if a.frozen_params < 0.0 || a.frozen_bytes.is_some_and(|b| ![1, 2, 4, 8].contains(&b)) {
        return Err(CliError::Usage("--frozen-params must be >= 0 and --frozen-bytes one of 1, 2, 4, 8".into()));
    }
    let mut input = EstimateInput {
        largest_layer_params: largest,
        nodes: a.nodes,
        gpus_per_node: a.gpus_per_node,
        frozen_params: a.frozen_params as u64,
        frozen_bytes_per_param: a.frozen_bytes,
        ..EstimateInput::new(params)
    };
    if let Some(c) = &config {
        // With `expert_parallel`, stages 1-2 keep a rank's position's experts only (a model of units, as the Llama
        // example's).
        input = input.with_config(c).with_experts(expert_params);
    }
    let rows = estimate(&input);
    let mine = config.as_ref().and_then(|c| row_for(&rows, c));
    let activations_json = activation_bytes.map(|(micro, (end, peak), s)| {
        serde_json::json!({"micro_batch": micro, "activation_checkpointing": a.activation_checkpointing,
            "sequence_parallel": s, "end_of_forward_bytes": end.round() as u64, "peak_bytes": peak.round() as u64})
    });
    if a.json {
        return emit(&serde_json::json!({ "params": params, "frozen_params": input.frozen_params, "ranks": a.nodes * a.gpus_per_node, "rows": rows, "activations": activations_json }).to_string());
    }
    let frozen = if input.frozen_params > 0 { format!(" and {} frozen", input.frozen_params) } else { String::new() };
    emit(&format!(
        "Model states for {params} parameters{frozen} ({:?}, {} optimizer values per parameter) on {} node(s) x {} device(s):",
        input.precision, input.optimizer_states, a.nodes, a.gpus_per_node
    ))?;
    if largest.is_none() {
        emit("(largest layer not given: stage-3 rows leave out the gathered layer; pass --largest-layer-params)")?;
    }
    emit(&format!("{:>12} {:>12} {:>14}  {}", "per device", "per host", "model states", "options"))?;
    for r in &rows {
        let mark = if mine == Some(r) { "   <- this config" } else { "" };
        let off = |d| format!("{d:?}").to_lowercase();
        emit(&format!(
            "{:>12} {:>12} {:>14}  stage {}, offload_optimizer {}, offload_param {}{mark}",
            human(r.per_device_bytes),
            human(r.per_host_bytes),
            human(r.model_states_bytes),
            r.stage,
            off(r.offload_optimizer),
            off(r.offload_param)
        ))?;
    }
    emit(
        "per device: accelerator memory per rank (a rank process's memory on a CPU cluster), DeepSpeed's estimator; \
         per host: CPU memory per node for what is offloaded, DeepSpeed's estimator with its buffer factor; \
         model states: the exact parameter, gradient and optimizer-state bytes one rank holds wherever they live \
         (device, host or NVMe), no buffers",
    )?;
    if let Some((micro, (end, peak), s)) = activation_bytes {
        let how = if a.activation_checkpointing { "with every layer recomputed" } else { "without recomputation" };
        let split = if s > 1 { format!(", each sequence split over {s} ranks") } else { String::new() };
        emit(&format!(
            "Activations per rank, micro-batch {micro}, {how}{split}: {} at the end of forward, {} at the peak of backward (not in the rows above; `zerorun plan` adds them up)",
            human(end.round() as u64),
            human(peak.round() as u64)
        ))?;
    }
    Ok(())
}
