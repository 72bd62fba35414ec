//! Full weights out of the engine: every parameter by name, the state dict, DeepSpeed's `save_16bit_model` and
//! Hugging Face's `save_pretrained` (safetensors shards and their index).
use super::*;

/// Full weights out of the engine: every parameter by name, and DeepSpeed's `save_16bit_model`.
impl Engine {
    /// Every parameter by name as full fp32 copies (identical on every rank). Collective at stage 3, where it
    /// gathers the units one at a time, and at stages 1-2 with units split over expert-parallel positions, whose
    /// experts come from their ranks: every rank calls it.
    pub fn full_parameters(&mut self) -> Result<Vec<(String, Tensor)>> {
        self.full_parameters_as(Kind::Float)
    }

    pub(super) fn full_parameters_as(&mut self, kind: Kind) -> Result<Vec<(String, Tensor)>> {
        // Stage 2 with units split over expert-parallel groups: another position's experts are not here either.
        if self.plan.partitions_parameters() || self.states.layout.has_groups() {
            return self.gather_full_parameters(kind, false);
        }
        Ok(self
            .states
            .layout
            .slots
            .iter()
            .zip(&self.states.params)
            .map(|(s, t)| (s.name.clone(), t.detach().to_kind(kind).copy()))
            .collect())
    }

    /// Every variable of the VarStore by name, full size: trainable parameters in the model's dtype, frozen
    /// parameters and buffers in theirs (buffers as this rank has them). It is what `VarStore::load` of the same
    /// model reads back once written with `Tensor::write_safetensors` (a `vs.save` at stage 3 would write the
    /// empty tensors of the released units). Collective at stage 3, where it gathers the units one at a time:
    /// every rank calls it.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use tch::nn::{self, Module};
    /// # use tch::{Device, Kind, Tensor};
    /// # let vs = nn::VarStore::new(Device::Cpu);
    /// # let (l0, l1) = (nn::linear(vs.root() / "l0", 4, 8, Default::default()), nn::linear(vs.root() / "l1", 8, 1, Default::default()));
    /// # let model = zerorun_runtime::engine::Sequence::new().unit(["l0"], move |x| l0.forward(x).relu()).unit(["l1"], move |x| l1.forward(x));
    /// # let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// # let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// # let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, zerorun_runtime::EngineOptions::default().units_of(&model))?;
    /// # let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// let weights = engine.state_dict()?; // full size even at stage 3
    /// let names: Vec<&str> = weights.iter().map(|(n, _)| n.as_str()).collect();
    /// assert_eq!(names, ["l0.bias", "l0.weight", "l1.bias", "l1.weight"]);
    /// # Ok(()) }
    /// ```
    pub fn state_dict(&mut self) -> Result<Vec<(String, Tensor)>> {
        self.model_tensors(Some(views::kind_of(self.precision())), true)
    }

    /// The trainable parameters as `kind` (None: without them), the frozen ones (with `frozen`, in their dtype)
    /// and the buffers, by name. Stage 3 gathers the units one at a time (collective).
    pub(super) fn model_tensors(&mut self, kind: Option<Kind>, frozen: bool) -> Result<Vec<(String, Tensor)>> {
        let stage3 = self.plan.partitions_parameters();
        let mut out = match kind {
            // One walk over the units gathers both kinds of parameters.
            Some(kind) if stage3 => self.gather_full_parameters(kind, frozen)?,
            Some(kind) => self.full_parameters_as(kind)?,
            None => Vec::new(),
        };
        if frozen && !(stage3 && kind.is_some()) {
            match &mut self.states.parameters.frozen_units {
                Some(units) => out.extend(units.full_copies(self.comm.as_ref())?),
                None => out.extend(self.states.frozen.iter().map(|(n, t)| (n.clone(), t.detach().copy()))),
            }
        }
        out.extend(self.states.buffers.iter().map(|(n, t)| (n.clone(), t.detach().copy())));
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// (name, shape, kind) of every frozen parameter.
    pub(crate) fn frozen_specs(&self) -> Vec<(String, Vec<i64>, Kind)> {
        match &self.states.parameters.frozen_units {
            Some(units) => units.specs(),
            None => self.states.frozen.iter().map(|(n, t)| (n.clone(), t.size(), t.kind())).collect(),
        }
    }

    /// DeepSpeed's `save_16bit_model`: rank 0 writes [`Engine::state_dict`] (every parameter in the model's dtype,
    /// frozen parameters and buffers in theirs; safetensors, by name), a file `VarStore::load` reads.
    /// Collective. At stage 3 this gathers the units one at a time and needs
    /// `zero_optimization.stage3_gather_16bit_weights_on_model_save`; without it the weights exist only as
    /// shards, so it refuses and says where full weights come from instead of writing empty tensors.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use tch::nn::{self, Module};
    /// # use tch::{Device, Kind, Tensor};
    /// # let vs = nn::VarStore::new(Device::Cpu);
    /// # let (l0, l1) = (nn::linear(vs.root() / "l0", 4, 8, Default::default()), nn::linear(vs.root() / "l1", 8, 1, Default::default()));
    /// # let model = zerorun_runtime::engine::Sequence::new().unit(["l0"], move |x| l0.forward(x).relu()).unit(["l1"], move |x| l1.forward(x));
    /// # let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// # let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// # let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, zerorun_runtime::EngineOptions::default().units_of(&model))?;
    /// # let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// // At stage 3 the config needs `stage3_gather_16bit_weights_on_model_save: true`.
    /// engine.save_16bit_model("model.safetensors")?;
    /// # Ok(()) }
    /// ```
    pub fn save_16bit_model(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        if self.plan.partitions_parameters() && !self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save
        {
            return Err(Error::Unsupported {
                key: "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                value: "false".into(),
                why: "at stage 3 the weights are sharded across ranks; set it to true to gather them on save, or save_checkpoint and run `zerorun consolidate DIR OUT`",
            });
        }
        let params = self.state_dict()?;
        if self.rank() == 0 {
            Tensor::write_safetensors(&params, path)
                .map_err(|e| Error::Io { path: path.into(), what: e.to_string() })?;
        }
        self.comm.barrier_data()?;
        Ok(())
    }

    /// Every trainable parameter by name as full copies of `kind`, and with `frozen` every frozen one in its own
    /// dtype (stage 3 gathers unit by unit: collective there).
    pub(crate) fn gather_full_parameters(&mut self, kind: tch::Kind, frozen: bool) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(self.states.layout.slots.len());
        // A copy: the unit's storage may be freed after the visit.
        self.visit_units(kind, frozen, &mut |name, t| {
            out.push((name.to_string(), t.copy()));
            Ok(())
        })?;
        Ok(out)
    }

    /// Stage 3: gathers the units one at a time (collective) and shows `visit` each trainable parameter as `kind`
    /// and, with `frozen`, each frozen one in its own dtype, in the units' order, while its unit is gathered. A
    /// unit split over a group (one expert-parallel position's experts, at stages 1-2 too) is gathered by its ranks
    /// and sent to the others from the first of them, so every rank sees every parameter.
    fn visit_units(
        &mut self,
        kind: tch::Kind,
        frozen: bool,
        visit: &mut dyn FnMut(&str, &Tensor) -> Result<()>,
    ) -> Result<()> {
        let rank = self.rank();
        for i in 0..self.states.parameters.units.len() {
            let was = self.states.parameters.units[i].state();
            let span = self.states.parameters.units[i].span.clone();
            let holds = span.holds(rank);
            let full = if holds {
                self.gather_unit_exact(i)?;
                self.states.parameters.units[i].full().shallow_clone()
            } else {
                let like = self.states.parameters.units[i].full();
                Tensor::f_zeros([span.range.len() as i64], (like.kind(), like.device()))?
            };
            if let crate::engine::zero::layout::UnitRanks::Group(members) = &span.ranks {
                views::broadcast(self.residence, self.comm.as_ref(), &full, members[0])?;
            }
            for slot in &self.states.layout.slots[span.slots.clone()] {
                let at = (slot.range.start - span.range.start) as i64;
                let t = full.narrow(0, at, slot.range.len() as i64).view(slot.shape.as_slice());
                visit(&slot.name, &t.detach().to_kind(kind))?;
            }
            if let Some(units) = self.states.parameters.frozen_units.as_ref().filter(|_| frozen) {
                for (n, t) in units.named(i) {
                    visit(n, &t.detach())?;
                }
            }
            if was == crate::engine::zero::sharded_unit::UnitState::Sharded {
                self.release_unit(i)?;
            }
        }
        Ok(())
    }

    /// Every variable of the model in the order [`Engine::visit_model`] shows them: (name, shape, kind), the
    /// trainable parameters as `kind`, floating frozen parameters and buffers too.
    fn model_specs(&self, kind: Kind) -> Vec<(String, Vec<i64>, Kind)> {
        let as_run =
            |k: Kind| if matches!(k, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16) { kind } else { k };
        let mut specs = Vec::new();
        let layout = &self.states.layout;
        if self.plan.partitions_parameters() {
            for (i, unit) in self.states.parameters.units.iter().enumerate() {
                specs.extend(
                    layout.slots[unit.span.slots.clone()].iter().map(|s| (s.name.clone(), s.shape.clone(), kind)),
                );
                if let Some(units) = &self.states.parameters.frozen_units {
                    specs.extend(units.named(i).map(|(n, t)| (n.to_string(), units_shape(units, n), as_run(t.kind()))));
                }
            }
        } else {
            specs.extend(layout.slots.iter().map(|s| (s.name.clone(), s.shape.clone(), kind)));
            specs.extend(self.frozen_specs().into_iter().map(|(n, shape, k)| (n, shape, as_run(k))));
        }
        specs.extend(self.states.buffers.iter().map(|(n, t)| (n.clone(), t.size(), as_run(t.kind()))));
        specs
    }

    /// Shows `visit` every variable of the model whole, floating ones as `kind`, one at a time: at stage 3 unit by
    /// unit, each while it is gathered (collective: every rank calls it), so no rank holds more than a unit.
    fn visit_model(&mut self, kind: Kind, visit: &mut dyn FnMut(&str, &Tensor) -> Result<()>) -> Result<()> {
        let as_run = |t: &Tensor| if t.is_floating_point() { t.to_kind(kind) } else { t.shallow_clone() };
        if self.plan.partitions_parameters() {
            self.visit_units(kind, true, &mut |n, t| visit(n, &as_run(t)))?;
        } else {
            if self.states.layout.has_groups() {
                self.visit_units(kind, false, visit)?;
            } else {
                for (slot, t) in self.states.layout.slots.iter().zip(&self.states.params) {
                    visit(&slot.name, &t.detach().to_kind(kind))?;
                }
            }
            let frozen = match &mut self.states.parameters.frozen_units {
                Some(units) => units.full_copies(self.comm.as_ref())?,
                None => self.states.frozen.iter().map(|(n, t)| (n.clone(), t.detach())).collect(),
            };
            for (n, t) in &frozen {
                visit(n, &as_run(t))?;
            }
        }
        for (n, t) in &self.states.buffers {
            visit(n, &as_run(&t.detach()))?;
        }
        Ok(())
    }

    /// The model as transformers' `save_pretrained` writes it, into `dir`: `model.safetensors`, or shards of at
    /// most `options.max_shard_bytes` and `model.safetensors.index.json`, every variable by name in `options.kind`
    /// (integer buffers in theirs), and with `options.config` that `config.json` copied with its dtype set. So a
    /// model whose variable names are transformers' (the Llama example's) loads with `from_pretrained(dir)`.
    /// Streamed: at stage 3 the units are gathered one at a time and written as they come, so no rank holds more
    /// than a unit and rank 0 one tensor's bytes besides. Collective: every rank calls it; rank 0 writes. A write
    /// that fails is an error on every rank (the others' says rank 0 failed), after the walk ends, so no rank waits.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use tch::nn::{self, Module};
    /// # use tch::{Device, Kind, Tensor};
    /// # let vs = nn::VarStore::new(Device::Cpu);
    /// # let (l0, l1) = (nn::linear(vs.root() / "l0", 4, 8, Default::default()), nn::linear(vs.root() / "l1", 8, 1, Default::default()));
    /// # let model = zerorun_runtime::engine::Sequence::new().unit(["l0"], move |x| l0.forward(x).relu()).unit(["l1"], move |x| l1.forward(x));
    /// # let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// # let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// # let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, zerorun_runtime::EngineOptions::default().units_of(&model))?;
    /// # let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// use zerorun_runtime::PretrainedOptions;
    /// let options = PretrainedOptions { config: Some(std::path::Path::new("hf-model/config.json")), kind: Kind::BFloat16, ..Default::default() };
    /// let files = engine.save_pretrained("out", &options)?; // out/model.safetensors (+ config.json)
    /// # Ok(()) }
    /// ```
    pub fn save_pretrained(&mut self, dir: impl AsRef<Path>, options: &PretrainedOptions<'_>) -> Result<Vec<PathBuf>> {
        let dir = dir.as_ref();
        let specs: Vec<(String, Vec<usize>, String)> = self
            .model_specs(options.kind)
            .into_iter()
            .map(|(n, shape, k)| (n, shape.iter().map(|&d| d as usize).collect(), dtype_of_kind(k).to_string()))
            .collect();
        let mut writer = match self.rank() {
            0 => Some(crate::checkpoint::hf::ShardedWriter::create(dir, specs, options.max_shard_bytes)),
            _ => None,
        };
        let mut failed: Option<Error> = None;
        self.visit_model(options.kind, &mut |_name, t| {
            if let Some(Ok(w)) = writer.as_mut().filter(|_| failed.is_none()) {
                let t = t.contiguous();
                let mut bytes = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
                t.f_copy_data_u8(&mut bytes, t.numel())?;
                if let Err(e) = w.tensor(|out| out.write_all(&bytes)) {
                    failed = Some(e.into());
                }
            }
            Ok(())
        })?;
        let written = match writer {
            Some(Ok(w)) if failed.is_none() => w.finish().map_err(Error::from),
            Some(Ok(_)) => Err(failed.take().expect("a failure")),
            Some(Err(e)) => Err(e.into()),
            None => Ok(Vec::new()),
        };
        let written = written.and_then(|mut paths| {
            if let (Some(config), 0) = (options.config, self.rank()) {
                paths.push(crate::checkpoint::hf::write_config(config, dir, dtype_of_kind(options.kind))?);
            }
            Ok(paths)
        });
        // Rank 0's verdict, on every rank.
        let mut verdict = [if written.is_err() { 1.0f32 } else { 0.0 }];
        self.comm.all_reduce_data(&mut verdict, crate::comm::ReduceOp::Max)?;
        match written {
            Err(e) => Err(e),
            Ok(_) if verdict[0] > 0.0 => Err(Error::Io {
                path: dir.to_path_buf(),
                what: "rank 0 could not write the model (see its error)".into(),
            }),
            Ok(paths) => Ok(paths),
        }
    }
}

/// Whole tensors by name written as transformers' `save_pretrained` writes them (see
/// [`Engine::save_pretrained`], which streams them out of an engine): for models assembled elsewhere, such as a
/// pipeline's stages or a tensor-parallel group's slices made whole. Floating tensors are written as
/// `options.kind`. Not collective: the caller picks the rank that writes.
pub fn write_pretrained(
    dir: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
    options: &PretrainedOptions<'_>,
) -> Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    let floating = |t: &Tensor| matches!(t.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16);
    let as_run = |t: &Tensor| if floating(t) { t.to_kind(options.kind) } else { t.shallow_clone() };
    let specs = tensors
        .iter()
        .map(|(n, t)| {
            let kind = if floating(t) { options.kind } else { t.kind() };
            (n.clone(), t.size().iter().map(|&d| d as usize).collect(), dtype_of_kind(kind).to_string())
        })
        .collect();
    let mut writer = crate::checkpoint::hf::ShardedWriter::create(dir, specs, options.max_shard_bytes)?;
    for (_, t) in tensors {
        let t = as_run(t).contiguous();
        let mut bytes = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, t.numel())?;
        writer.tensor(|out| out.write_all(&bytes))?;
    }
    let mut paths = writer.finish()?;
    if let Some(config) = options.config {
        paths.push(crate::checkpoint::hf::write_config(config, dir, dtype_of_kind(options.kind))?);
    }
    Ok(paths)
}

/// A frozen unit's variable shape by name.
fn units_shape(units: &crate::engine::zero::frozen::FrozenUnits, name: &str) -> Vec<i64> {
    units.layout.slots.iter().find(|s| s.name == name).map_or_else(Vec::new, |s| s.shape.clone())
}

/// What [`Engine::save_pretrained`] writes.
#[derive(Debug, Clone, Copy)]
pub struct PretrainedOptions<'a> {
    /// The model's `config.json` to copy beside the weights (its dtype set to `kind`); None: weights only.
    pub config: Option<&'a Path>,
    /// The dtype of the floating variables written (fp32, bf16 or fp16).
    pub kind: Kind,
    /// Largest file before the weights are sharded (transformers' `max_shard_size`, 5 GB by default).
    pub max_shard_bytes: u64,
}

impl Default for PretrainedOptions<'_> {
    fn default() -> Self {
        PretrainedOptions {
            config: None,
            kind: Kind::Float,
            max_shard_bytes: crate::checkpoint::hf::DEFAULT_MAX_SHARD_BYTES,
        }
    }
}
