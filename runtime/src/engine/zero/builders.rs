//! A model given as one builder per unit, so that stage 3 never holds the whole model (DeepSpeed's `zero.Init`,
//! FSDP2's meta-device construction). At stage 3 [`Engine::from_builders`] runs each unit's builder on the
//! VarStore and at once releases the storage of the parameters it created (they keep name, shape and dtype); the
//! engine then packs the units one at a time, and right before packing unit i it re-runs that builder on a scratch
//! VarStore from the generator state the first run started from, copies the values in, keeps this rank's shard and
//! frees the rest. Start-up so holds at most two full units beside the shard, and the initial values are exactly
//! those of building the whole model in order from the same generator state (then converting it to the config's
//! precision, as `vs.bfloat16()` does). At stages 0-2 the builders simply build the model.
use std::collections::HashSet;
use std::path::PathBuf;

use tch::{nn, Tensor};

use crate::engine::device::native;
use crate::engine::zero::units::UnitModel;
use crate::error::Result;

/// A unit's forward, as a builder returns it.
pub type UnitForward<'a> = Box<dyn Fn(&Tensor) -> Tensor + 'a>;

type Builder<'a> = Box<dyn Fn(&nn::Path) -> UnitForward<'a> + 'a>;

/// The model as builders, one per unit, in execution order.
#[derive(Default)]
pub struct UnitBuilders<'a> {
    pub(crate) units: Vec<(Vec<String>, Builder<'a>)>,
    /// Pretrained weights to start from instead of the builders' initial values.
    pub(crate) init: Option<PathBuf>,
}

impl<'a> UnitBuilders<'a> {
    pub fn new() -> Self {
        UnitBuilders { units: Vec::new(), init: None }
    }

    /// Starts from the weights in a safetensors file (every variable by name, as `save_16bit_model`, `zerorun
    /// consolidate` or `Tensor::write_safetensors` write them) instead of the builders' initial values. At stage 3
    /// each unit's tensors are read from the memory-mapped file right before the unit is packed, so neither the
    /// file nor the model is ever whole in memory.
    pub fn init_from(mut self, path: impl Into<PathBuf>) -> Self {
        self.init = Some(path.into());
        self
    }

    /// Appends a unit: the parameter-name prefixes it owns (as [`UnitModel::unit_prefixes`]) and a builder that
    /// creates its variables under the path it is given (the VarStore's root) and returns its forward. At stage 3
    /// a builder runs more than once: each run must create the same variables and draw only from libtorch's
    /// generator (`tch::manual_seed`), as tch's own initialisers do.
    pub fn unit<S: Into<String>>(
        mut self,
        prefixes: impl IntoIterator<Item = S>,
        build: impl Fn(&nn::Path) -> UnitForward<'a> + 'a,
    ) -> Self {
        self.units.push((prefixes.into_iter().map(Into::into).collect(), Box::new(build)));
        self
    }
}

/// The model the builders made: its units' forwards, run through `engine.forward` as any [`UnitModel`].
pub struct BuiltModel<'a> {
    pub(crate) prefixes: Vec<Vec<String>>,
    pub(crate) forwards: Vec<UnitForward<'a>>,
}

impl UnitModel for BuiltModel<'_> {
    fn unit_prefixes(&self) -> Vec<Vec<String>> {
        self.prefixes.clone()
    }

    fn forward_unit(&self, unit: usize, input: &Tensor) -> Tensor {
        (self.forwards[unit])(input)
    }
}

/// Converts the floating variables of `vs` created since `known` to `kind` (what `vs.bfloat16()` does to all);
/// with `release`, the parameters among them (tch's trainable list) keep name, shape and dtype but no storage.
pub(crate) fn settle_new_variables(
    vs: &nn::VarStore,
    known: &HashSet<String>,
    kind: tch::Kind,
    release: bool,
) -> Result<()> {
    let listed: HashSet<usize> = vs.trainable_variables().iter().map(native::tensor_identity).collect();
    for (name, t) in vs.variables() {
        if known.contains(&name) {
            continue;
        }
        let target = if t.is_floating_point() { kind } else { t.kind() };
        let mut t = t;
        if release && listed.contains(&native::tensor_identity(&t)) {
            let hollow = Tensor::f_empty(t.size(), (target, t.device()))?;
            native::resize_storage(&hollow, 0)?;
            tch::no_grad(|| t.set_data(&hollow));
        } else if t.kind() != target {
            let converted = t.to_kind(target);
            tch::no_grad(|| t.set_data(&converted));
        }
    }
    Ok(())
}
