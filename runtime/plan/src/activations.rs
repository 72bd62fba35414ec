//! Activation memory: what autograd keeps for backward, per layer and per sample.
use serde::Serialize;

use crate::model::{Model, Transformer};

/// What a layer keeps for backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Everything the forward saves.
    None,
    /// Megatron's selective recomputation: the attention's s x s tensors are recomputed.
    Selective,
    /// Full recomputation (zerorun's activation checkpointing of a unit): the layer's input only.
    Full,
}

/// Korthikanti et al. (arXiv 2205.05198) Table 2: bytes one transformer layer keeps per micro-batch, 16-bit values
/// with dropout masks; s sequence, b micro-batch, h hidden, a heads, t tensor-parallel degree.
pub fn korthikanti_layer_bytes(s: f64, b: f64, h: f64, a: f64, t: f64, sequence_parallel: bool, r: Recompute) -> f64 {
    let sbh = s * b * h;
    let attention = 5.0 * a * s / h;
    match (r, sequence_parallel) {
        (Recompute::Full, false) => 2.0 * sbh,
        (Recompute::Full, true) => 2.0 * sbh / t,
        (Recompute::Selective, false) => sbh * (10.0 + 24.0 / t),
        (Recompute::Selective, true) => sbh * 34.0 / t,
        (Recompute::None, false) => sbh * (10.0 + 24.0 / t + attention / t),
        (Recompute::None, true) => sbh / t * (34.0 + attention),
    }
}

/// Values the MLP keeps per sample: GELU's two (2 ffn s), SwiGLU's four (4 ffn s); with experts, SwiGLU's for
/// each of a token's top-k experts, the rows gathered for them and their weighted outputs (2 k h s), and the
/// router's logits, probabilities and choice (3 experts s).
fn mlp_values(t: &Transformer) -> f64 {
    let (s, ffn) = (t.seq_len as f64, t.ffn as f64);
    if t.experts == 0 {
        return if t.gated { 4.0 } else { 2.0 } * ffn * s;
    }
    let k = t.top_k as f64;
    s * (k * (4.0 * ffn + 2.0 * t.hidden as f64) + 3.0 * t.experts as f64)
}

/// Values (not bytes) one layer of a transformer written in tch without dropout keeps per sample, split into the
/// part tensor parallelism divides and the part every tensor-parallel rank keeps whole. GPT's layer: the two
/// norms' inputs and outputs (4 sh, whole); q, k, v, the attention's output (4 sh), the softmax probabilities
/// (a s^2), the MLP's inner activation before and after GELU (2 ffn s), divided. Llama's SwiGLU keeps gate, its
/// SiLU, up and their product (4 ffn s).
pub fn layer_values(t: &Transformer) -> (f64, f64) {
    let (s, h, a) = (t.seq_len as f64, t.hidden as f64, t.heads as f64);
    let kv = (t.hidden / t.heads * t.kv_heads) as f64;
    let mlp = mlp_values(t);
    let probabilities = if t.flash_attention { 0.0 } else { a * s * s };
    let divided = s * (2.0 * h + 2.0 * kv) + probabilities + mlp;
    (divided, 4.0 * s * h)
}

/// Values one layer's forward creates per sample, saved or not (split as [`layer_values`]): besides what it
/// saves, the heads' contiguous copies of q, k, v, the scaled and masked scores, the merged heads, the projections'
/// and residuals' outputs. The elementwise work streams it through memory (the step time's memory term); what is
/// freed of it is reused, not resident at the peak.
pub fn layer_created_values(t: &Transformer) -> (f64, f64) {
    let (s, h, a) = (t.seq_len as f64, t.hidden as f64, t.heads as f64);
    let kv = (t.hidden / t.heads * t.kv_heads) as f64;
    let mlp = mlp_values(t);
    let scores = if t.flash_attention { 0.0 } else { 4.0 * a * s * s };
    let divided = 2.0 * s * (h + 2.0 * kv) + scores + 2.0 * s * h + mlp;
    (divided, 6.0 * s * h)
}

/// Bytes one rank's forward creates per sample ([`layer_created_values`] over its layers, the ends as
/// [`bytes_per_sample`] counts them); for a measured model, the saved bytes.
pub fn created_bytes_per_sample(model: &Model, layers: u64, tp: u64, value_bytes: f64) -> f64 {
    match model {
        Model::Transformer(t) => {
            let (divided, whole) = layer_created_values(t);
            let (s, h) = (t.seq_len as f64, t.hidden as f64);
            let ends = 2.0 * s * h + s * t.vocab as f64 / tp as f64;
            value_bytes * (layers as f64 * (divided / tp as f64 + whole) + ends)
        }
        Model::Measured(_) => bytes_per_sample(model, layers, tp, false, value_bytes),
    }
}

/// Bytes of activations one rank keeps per sample of a micro-batch, for `layers` layers of the model (its pipeline
/// stage), at tensor-parallel degree `tp`, with values of `value_bytes`. The embedding's output, the final norm and
/// the logits (2 sh + s V / tp values) count once per rank.
pub fn bytes_per_sample(model: &Model, layers: u64, tp: u64, recompute: bool, value_bytes: f64) -> f64 {
    match model {
        Model::Transformer(t) => {
            let (divided, whole) = layer_values(t);
            let full = divided / tp as f64 + whole;
            let (s, h) = (t.seq_len as f64, t.hidden as f64);
            // With recomputation every layer keeps its input, and backward rebuilds one layer at a time.
            let per_layers = if recompute { layers as f64 * s * h + full } else { layers as f64 * full };
            let ends = 2.0 * s * h + s * t.vocab as f64 / tp as f64;
            value_bytes * (per_layers + ends)
        }
        Model::Measured(m) => {
            let all = m.activation_bytes_per_sample as f64 / tp as f64;
            let share = all * layers as f64 / m.layers as f64;
            if recompute {
                // Inputs of the layers, and one layer rebuilt; without a shape, the input is taken as 1/16 of a layer
                // (the GPT layer's input over everything it saves).
                let layer = all / m.layers as f64;
                layer * (layers as f64 / 16.0 + 1.0)
            } else {
                share
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn korthikanti_table_2_by_hand() {
        // GPT-3 175B's layer (s 2048, h 12288, a 96), micro-batch 1, t = 8.
        let (s, b, h, a, t) = (2048.0, 1.0, 12288.0, 96.0, 8.0);
        let sbh = s * b * h;
        let k = |sp, r| korthikanti_layer_bytes(s, b, h, a, t, sp, r);
        assert_eq!(korthikanti_layer_bytes(s, b, h, a, 1.0, false, Recompute::None), sbh * (34.0 + 5.0 * a * s / h));
        assert_eq!(k(false, Recompute::None), sbh * (10.0 + 24.0 / 8.0 + 5.0 * 96.0 * 2048.0 / (12288.0 * 8.0)));
        assert_eq!(k(true, Recompute::Selective), sbh * 34.0 / 8.0);
        assert_eq!(k(false, Recompute::Full), 2.0 * sbh);
        // Per layer: 23 sbh = 0.539 GiB with tensor parallelism alone, 4.25 sbh with sequence parallelism and
        // selective recomputation: the paper's "5x" (5.4x here).
        let gib = |x: f64| x / (1u64 << 30) as f64;
        assert!((gib(k(false, Recompute::None)) - 0.5391).abs() < 1e-4);
        assert!((k(false, Recompute::None) / k(true, Recompute::Selective) - 23.0 / 4.25).abs() < 1e-9);
    }

    #[test]
    fn the_example_gpt_count() {
        // The demo's GPT (8 x 512, 8 heads, block 64, vocabulary 65) at micro-batch 12 keeps
        // L (64 s b h + 4 a s^2 b) + 8 s b h + 4 s b V bytes in fp32 (#40: within 0.15% of PyTorch's profiler).
        let m =
            Model::from_json(r#"{"layers": 8, "hidden": 512, "heads": 8, "vocab": 65, "seq_len": 64}"#, "m").unwrap();
        let (s, b, h, a, v, l) = (64.0, 12.0, 512.0, 8.0, 65.0, 8.0);
        let expected = l * (64.0 * s * b * h + 4.0 * a * s * s * b) + 8.0 * s * b * h + 4.0 * s * b * v;
        assert_eq!(bytes_per_sample(&m, 8, 1, false, 4.0) * b, expected);
        // Recomputation: every layer's input, one layer rebuilt.
        let ac = bytes_per_sample(&m, 8, 1, true, 4.0) * b;
        assert_eq!(
            ac,
            l * 4.0 * s * b * h + (64.0 * s * b * h + 4.0 * a * s * s * b) + 8.0 * s * b * h + 4.0 * s * b * v
        );
    }
}
