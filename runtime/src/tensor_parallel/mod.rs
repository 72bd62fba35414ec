//! Tensor (intra-layer) model parallelism, Megatron-LM's: a layer's weight split across the ranks of a tensor-
//! parallel group, with the conjugate operators between the split and the whole (`regions.rs`: copy / reduce,
//! scatter / gather, and the sequence-parallel pair) as autograd functions of the C++ shim whose collectives are
//! this group's communicator, and the layers built from them (`layers.rs`: column- and row-parallel linear, the
//! vocabulary-parallel embedding and cross-entropy), which record where they split each parameter
//! (`placements.rs`) for the engine to read.
mod layers;
mod placements;
mod regions;

pub use layers::{vocab_parallel_cross_entropy, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding};
pub use placements::{Placements, Split};
pub use regions::{TensorParallel, TensorParallelCounts};
