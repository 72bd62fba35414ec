//! Experts as SwiGLU MLPs, `down(silu(gate(x)) * up(x))` without biases, each under its expert index
//! (`experts.{i}.…`), as Hugging Face files name them.
use tch::{nn, Tensor};

/// The parameter names of one expert's three matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertNames {
    /// Mixtral's `w1` (gate), `w3` (up), `w2` (down).
    Mixtral,
    /// Qwen3-MoE's (and Llama's MLP's) `gate_proj`, `up_proj`, `down_proj`.
    GateUpDown,
}

impl ExpertNames {
    /// The (gate, up, down) names.
    pub fn names(self) -> [&'static str; 3] {
        match self {
            ExpertNames::Mixtral => ["w1", "w3", "w2"],
            ExpertNames::GateUpDown => ["gate_proj", "up_proj", "down_proj"],
        }
    }
}

/// Every expert of a layer.
#[derive(Debug)]
pub struct SwiGluExperts {
    /// Each expert's (gate [ffn, hidden], up [ffn, hidden], down [hidden, ffn]) weights.
    pub weights: Vec<[Tensor; 3]>,
}

impl SwiGluExperts {
    /// `count` experts under `path` (`path / "experts" / i / name / "weight"`), each initialised as `nn::linear`'s.
    pub fn new(path: &nn::Path, names: ExpertNames, hidden: i64, ffn: i64, count: i64) -> SwiGluExperts {
        let no_bias = nn::LinearConfig { bias: false, ..Default::default() };
        let [gate, up, down] = names.names();
        let weights = (0..count)
            .map(|i| {
                let p = path / "experts" / i;
                [
                    nn::linear(&p / gate, hidden, ffn, no_bias).ws,
                    nn::linear(&p / up, hidden, ffn, no_bias).ws,
                    nn::linear(&p / down, ffn, hidden, no_bias).ws,
                ]
            })
            .collect();
        SwiGluExperts { weights }
    }

    /// Experts.
    pub fn count(&self) -> i64 {
        self.weights.len() as i64
    }

    /// One expert on rows `x` [n, hidden].
    pub fn expert(&self, local: usize, x: &Tensor) -> Tensor {
        let [gate, up, down] = &self.weights[local];
        (x.matmul(&gate.tr()).silu() * x.matmul(&up.tr())).matmul(&down.tr())
    }

    /// Rows grouped by expert (`rows[e]` rows for expert `from + e`, in order) through their experts. Every
    /// expert of the range runs, on no rows when it received none, so each has a gradient (zeros) after every
    /// backward: a ZeRO stage that waits for each parameter's gradient never waits on an expert no token chose.
    pub fn forward_grouped(&self, x: &Tensor, rows: &[i64], from: usize) -> Tensor {
        assert!(from + rows.len() <= self.weights.len(), "one row count per expert of the range");
        let parts: Vec<Tensor> =
            x.split_with_sizes(rows, 0).iter().enumerate().map(|(e, x)| self.expert(from + e, x)).collect();
        Tensor::cat(&parts, 0)
    }
}
