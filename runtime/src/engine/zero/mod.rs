//! ZeRO's partitioning of the model states: what the stage partitions (`plan.rs`) and the sizes it takes from the
//! model (`sizing.rs`), the flat layout of the parameters ([`layout`]), where their values live (`parameters.rs`:
//! the flat buffer of stages 0-2, packed by `pack.rs`, stage 3's shard and units, `sharded_unit.rs`, `frozen.rs`, `swapped_params.rs`
//! for NVMe), the model's units and the stage-3 walk over them (`units.rs`, `unit_walk.rs`, `builders.rs` for
//! models built unit by unit), the VarStore's variables (`variables.rs`); gradients in `grads/` and this rank's
//! optimizer in `optim/`.
pub mod builders;
pub(crate) mod expert_units;
pub(crate) mod frozen;
pub(crate) mod grads;
pub mod layout;
pub(crate) mod optim;
pub(crate) mod pack;
pub(crate) mod parameters;
pub(crate) mod plan;
pub mod scopes;
pub(crate) mod sharded_unit;
pub(crate) mod sizing;
pub(crate) mod swapped_params;
pub(crate) mod unit_walk;
pub mod units;
pub mod variables;

use tch::Tensor;

/// The model's states as the engine holds them: the layout of the trainable parameters, the model's tensors (views
/// into the flat buffer or their unit's), where the values live, and what every rank holds whole.
pub(crate) struct ModelStates {
    pub layout: layout::FlatLayout,
    /// The model's parameters, in layout order; views into `parameters.flat` (stages 0-2) or into their unit's
    /// buffer (stage 3).
    pub params: Vec<Tensor>,
    /// Where the parameter values live: the flat buffer (stages 0-2), or the shard and the units (stage 3).
    pub parameters: parameters::Parameters,
    /// Stages 0-2: the frozen parameters, whole on every rank (rank 0's values), by name.
    pub frozen: Vec<(String, Tensor)>,
    /// The model's buffers by name, whole on every rank, kept consistent by `buffer_sync`.
    pub buffers: Vec<(String, Tensor)>,
    pub buffer_sync: variables::BufferSync,
    /// Every variable of the VarStore is this engine's while it lives.
    pub _claim: variables::Claim,
}
