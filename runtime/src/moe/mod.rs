//! Mixture of experts as tch layers a model composes (Mixtral's and Qwen3-MoE's sparse blocks, DeepSpeed-MoE's
//! options): a router that picks each token's top-k experts (`router.rs`, with transformers' load-balancing loss),
//! experts as SwiGLU MLPs (`experts.rs`), and the dispatch that brings each token to its experts and their outputs
//! back (`dispatch.rs`): dropless by default (tokens sorted by expert, every one computed), or with DeepSpeed's
//! capacity factor (the tokens over an expert's capacity dropped, their slot passing nothing, so the block's
//! residual carries them). With an [`ExpertParallel`] group (`crate::exchange`) of E ranks each rank computes
//! `experts / E` of the experts and tokens travel to them by an all-to-all of rows, forward and backward; every rank
//! builds every expert's parameters, which ZeRO shards over all data-parallel ranks as it does the dense ones, or at
//! stages 2 and 3, where each position's experts are a unit of their own, over the ranks at that position only,
//! the other ranks keeping none of their values (`engine/zero/expert_units.rs`).
mod dispatch;
mod experts;
mod router;

pub use crate::exchange::AllToAllCounts;
pub use dispatch::{Capacity, ExpertsScope, MoeLayer, MoeOutput};
pub use experts::{ExpertNames, SwiGluExperts};

/// The ranks that compute different experts of each layer: tokens travel to their experts' ranks by an all-to-all
/// of rows, forward and backward.
pub type ExpertParallel = crate::exchange::AllToAllGroup;
pub use router::{load_balancing_loss, Router, Routing};

/// Whether a parameter is an expert's: a name with an `experts.{index}` part, as zerorun's [`SwiGluExperts`] and
/// Hugging Face's MoE models name them (`...block_sparse_moe.experts.3.w1.weight`). The memory report counts these
/// apart from the dense parameters.
pub fn is_expert_parameter(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    parts.windows(2).any(|w| w[0] == "experts" && !w[1].is_empty() && w[1].bytes().all(|b| b.is_ascii_digit()))
}
