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

use crate::comm::Communicator;
use crate::config::Config;
use crate::engine::checkpointing::{fill_variable, load_variable};
use crate::engine::device::native;
use crate::engine::device::views;
use crate::engine::zero::plan::Strategy;
use crate::engine::zero::units::UnitModel;
use crate::engine::{Engine, EngineOptions};
use crate::error::{Error, Result};

/// A unit's forward, as a builder returns it.
pub type UnitForward<'a> = Box<dyn Fn(&Tensor) -> Tensor + 'a>;

type Builder<'a> = Box<dyn Fn(&nn::Path) -> UnitForward<'a> + 'a>;

/// The model as builders, one per unit, in execution order.
#[derive(Default)]
/// At stage 3 each unit's parameters are sharded as soon as its builder made them, so no rank ever holds the whole
/// model ([`Engine::from_builders`](crate::Engine::from_builders)):
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tch::nn::{self, Module};
/// use tch::Tensor;
/// let builders = (0..4).fold(zerorun_runtime::UnitBuilders::new(), |b, i| {
///     b.unit([format!("layers.{i}")], move |p: &nn::Path| {
///         let layer = nn::linear(p / "layers" / i, 16, 16, Default::default());
///         Box::new(move |x: &Tensor| layer.forward(x).relu())
///     })
/// });
/// let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let comm = zerorun_runtime::comm::threads::group(1, std::time::Duration::from_secs(60)).remove(0);
/// let (mut engine, model) =
///     zerorun_runtime::Engine::from_builders(&vs, config, Box::new(comm), Default::default(), builders)?;
/// let y = engine.forward(&model, &Tensor::ones([2, 16], (tch::Kind::Float, tch::Device::Cpu)))?;
/// assert_eq!(y.size(), [2, 16]);
/// # Ok(()) }
/// ```
pub struct UnitBuilders<'a> {
    units: Vec<(Vec<String>, Builder<'a>)>,
    /// Pretrained weights to start from instead of the builders' initial values.
    init: Option<PathBuf>,
}

impl<'a> UnitBuilders<'a> {
    /// No unit yet.
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
    prefixes: Vec<Vec<String>>,
    forwards: Vec<UnitForward<'a>>,
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
fn settle_new_variables(vs: &nn::VarStore, known: &HashSet<String>, kind: tch::Kind, release: bool) -> Result<()> {
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

impl<'a> UnitBuilders<'a> {
    /// [`Engine::from_builders`]: builds every unit on `vs` (each rank, in order, noting the generator's state
    /// before each), then the engine over them; at stage 3 each unit's values are made again (rank 0) or read from
    /// the initial weights right before the unit is packed, so no rank holds the whole model.
    pub(crate) fn build_engine(
        self,
        vs: &nn::VarStore,
        config: Config,
        comm: Box<dyn Communicator>,
        options: EngineOptions,
    ) -> Result<(Engine, BuiltModel<'a>)> {
        let builders = self;
        if builders.units.is_empty() {
            return Err(Error::Usage("UnitBuilders has no unit".into()));
        }
        let kind = views::kind_of(config.precision());
        let stage3 = Strategy::of_stage(config.zero_optimization.stage) == Strategy::PartitionedParameters;
        let prefixes: Vec<Vec<String>> = builders.units.iter().map(|(p, _)| p.clone()).collect();
        if stage3 && !options.keep_allocator_settings {
            crate::engine::device::allocator::fix_mmap_threshold();
        }
        let mut starts = Vec::with_capacity(builders.units.len());
        let mut forwards = Vec::with_capacity(builders.units.len());
        for (_, build) in &builders.units {
            starts.push(native::rng_state()?);
            let known: HashSet<String> = vs.variables().into_keys().collect();
            forwards.push(build(&vs.root()));
            settle_new_variables(vs, &known, kind, stage3)?;
            if stage3 {
                crate::engine::device::allocator::return_freed_memory();
            }
        }
        let model = BuiltModel { prefixes, forwards };
        let options = EngineOptions { units: Some(model.unit_prefixes()), ..options };
        if !stage3 {
            if let Some(path) = &builders.init {
                crate::engine::checkpointing::load_mapped(vs, path)?;
            }
            return Ok((Engine::new(vs, config, comm, options)?, model));
        }
        // Shard groups (MiCS) split the communicator here; each group's first rank makes the values below.
        let groups = crate::engine::data_groups::DataGroups::of(comm, &config)?;
        let init_replicas = groups.replicas_again()?;
        let crate::engine::data_groups::DataGroups { shard: comm, replicas, mesh } = groups;
        if let Some(path) = &builders.init {
            // Every rank reads its units from the file; nothing draws from the generator.
            let files = crate::checkpoint::hf::WeightFiles::open(path)?;
            let mut materialize = |_unit: usize, vars: &[(&str, &Tensor)]| -> Result<()> {
                for (name, t) in vars {
                    load_variable(&files, name, t)?;
                }
                Ok(())
            };
            let mut engine = Engine::new_materialized(vs, config, comm, replicas, options, Some(&mut materialize))?;
            engine.placement.mesh = mesh;
            return Ok((engine, model));
        }
        let end = native::rng_state()?;
        // Every rank takes rank 0's values when the unit is packed, so only rank 0 builds them again; the others
        // only give the variables their storage (and never touch the generator, which thread ranks share).
        let rank = comm.rank();
        let mut materialize = |unit: usize, vars: &[(&str, &Tensor)]| -> Result<()> {
            if rank != 0 {
                for (_, t) in vars {
                    native::resize_storage(t, t.numel() * t.kind().elt_size_in_bytes())?;
                }
                return Ok(());
            }
            let scratch = nn::VarStore::new(tch::Device::Cpu);
            {
                let _generator = native::generator_lock();
                native::set_rng_state(&starts[unit])?;
                let _forward = (builders.units[unit].1)(&scratch.root());
            }
            let values = scratch.variables();
            for (name, t) in vars {
                let v = values.get(*name).ok_or_else(|| Error::Parameter { name: name.to_string(), why: format!("the builder of unit {unit} did not create it again (builders must create the same variables every run)") })?;
                fill_variable(name, t, v, |name, again, first| Error::Parameter {
                    name: name.into(),
                    why: format!("the builder of unit {unit} made it {first:?}, then {again:?}"),
                })?;
            }
            // Shard groups: every group's first rank takes the first group's values (its own generator may differ).
            if let Some(replicas) = &init_replicas {
                let tensors: Vec<&Tensor> = vars.iter().map(|(_, t)| *t).collect();
                crate::engine::zero::variables::broadcast_values(replicas.as_ref(), &tensors)?;
            }
            Ok(())
        };
        let engine = Engine::new_materialized(vs, config, comm, replicas, options, Some(&mut materialize));
        {
            let _generator = native::generator_lock();
            native::set_rng_state(&end)?;
        }
        let mut engine = engine?;
        engine.placement.mesh = mesh;
        drop(init_replicas);
        Ok((engine, model))
    }
}
