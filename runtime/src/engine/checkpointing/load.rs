//! Reading a checkpoint back: the manifest checked against this engine, this rank's values read from the saved
//! ranks' files by range (any world size), the variables, the counters.
use super::*;
use crate::checkpoint::files::MappedTensors;

/// Reads this rank's optimized elements (optimizer order) from a checkpoint's rank files, any range at a time,
/// matching parameters by name. Each file is checksummed and mapped when first needed. A parameter saved as this
/// engine holds it (whole, or the same slice) is read by flat range; one held in other slices (another tensor-
/// parallel degree) is assembled from the overlapping slices, by its box in the whole tensor.
struct ShardReader<'a> {
    saved: &'a SavedCheckpoint,
    slots: &'a [ParamSlot],
    /// Per slot: the slice of the whole parameter this engine holds (None: the whole).
    slices: Vec<Option<Slice>>,
    /// This rank's optimized flat ranges with where each starts in optimizer order.
    pieces: Vec<(usize, std::ops::Range<usize>)>,
    opened: Vec<Option<MappedTensors>>,
}

/// Reads flat range `range` of tensor `name` of the rank files into `out`.
fn read_flat(
    saved: &SavedCheckpoint,
    opened: &mut [Option<MappedTensors>],
    name: &str,
    range: std::ops::Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    for loc in saved.manifest.locate(range) {
        if opened[loc.entry].is_none() {
            opened[loc.entry] = Some(saved.rank_file(loc.entry)?);
        }
        let file = opened[loc.entry].as_ref().expect("opened above");
        let dst = loc.dst_offset..loc.dst_offset + loc.file_range.len();
        file.read_f32(name, loc.file_range, &mut out[dst])?;
    }
    Ok(())
}

impl<'a> ShardReader<'a> {
    fn new(
        saved: &'a SavedCheckpoint,
        slots: &'a [ParamSlot],
        slices: Vec<Option<Slice>>,
        pieces: &[std::ops::Range<usize>],
    ) -> Self {
        let mut base = 0;
        let pieces = pieces
            .iter()
            .map(|p| {
                base += p.len();
                (base - p.len(), p.clone())
            })
            .collect();
        let opened = (0..saved.manifest.ranks.len()).map(|_| None).collect();
        ShardReader { saved, slots, slices, pieces, opened }
    }

    /// The checkpoint's entry of slot `i` when it holds the slot as this engine does (the same slice or whole).
    fn same_entry(&self, i: usize) -> Option<&'a ParamEntry> {
        let slot = &self.slots[i];
        let mut entries = self.saved.manifest.entries(&slot.name);
        let first = entries.next()?;
        let alone = entries.next().is_none();
        (alone && first.slice == self.slices[i] && first.shape == slot.shape).then_some(first)
    }

    /// Fills `out[i]` (each `want.len()` long) with tensor `names[i]` of the checkpoint over `want`, a range of
    /// this rank's optimized elements. Padding, which no file holds, is left as it is.
    fn read(&mut self, want: std::ops::Range<usize>, names: &[&str], out: &mut [&mut [f32]]) -> Result<()> {
        // Slots assembled from other slices, per tensor name, while this read lasts.
        let mut assembled: std::collections::HashMap<(usize, usize), Vec<f32>> = Default::default();
        for (base, piece) in self.pieces.clone() {
            let (lo, hi) = (want.start.max(base), want.end.min(base + piece.len()));
            if lo >= hi {
                continue;
            }
            let flat = piece.start + (lo - base)..piece.start + (hi - base);
            for (i, slot) in self.slots.iter().enumerate() {
                let (a, b) = (slot.range.start.max(flat.start), slot.range.end.min(flat.end));
                if a >= b {
                    continue;
                }
                let at = base + (a - piece.start) - want.start;
                if let Some(theirs) = self.same_entry(i) {
                    let from = theirs.start + (a - slot.range.start);
                    for (name, o) in names.iter().zip(out.iter_mut()) {
                        read_flat(self.saved, &mut self.opened, name, from..from + (b - a), &mut o[at..at + (b - a)])?;
                    }
                    continue;
                }
                let region = region_of(&slot.shape, self.slices[i]);
                for (n, (name, o)) in names.iter().zip(out.iter_mut()).enumerate() {
                    let values = match assembled.entry((i, n)) {
                        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                        std::collections::hash_map::Entry::Vacant(e) => {
                            let (saved, opened) = (self.saved, &mut self.opened);
                            e.insert(read_region(
                                &saved.manifest,
                                &saved.manifest_path(),
                                &slot.name,
                                &region,
                                &mut |range, dst| read_flat(saved, opened, name, range, dst).map_err(box_checkpoint),
                            )?)
                        }
                    };
                    let local = a - slot.range.start..b - slot.range.start;
                    o[at..at + (b - a)].copy_from_slice(&values[local]);
                }
            }
        }
        Ok(())
    }
}

/// `read_region` takes a reader of the checkpoint crate's error type; a file error keeps its message.
fn box_checkpoint(e: Error) -> CheckpointError {
    match e {
        Error::Checkpoint(c) => c,
        other => CheckpointError::Io { path: PathBuf::new(), what: other.to_string() },
    }
}

impl Engine {
    /// Loads `dir/<tag>` (default: the tag `dir/latest` names), written at any world size and stage 0-3: each rank
    /// reads only the element ranges it optimizes, matching parameters by name. Collective. Returns the tag loaded.
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
    /// let dir = std::env::temp_dir().join(format!("zerorun-doc-load-{}", std::process::id()));
    /// engine.save_checkpoint(&dir, Some("before"))?;
    /// engine.load_checkpoint(&dir, Some("before"))?;
    /// # std::fs::remove_dir_all(&dir)?;
    /// # Ok(()) }
    /// ```
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<String> {
        let _owner = crate::report::allocations::owned_by(crate::report::allocations::Owner::Engine);
        self.load_checkpoint_impl(dir.as_ref(), tag, false)
    }

    /// Loads the newest intact checkpoint in `dir`: the one `latest` names, else (its files damaged or missing) the
    /// next newest by step, and so on, each skipped one warned about with the file at fault. Returns the tag
    /// loaded; an error when none is intact (or `dir` holds none). Collective: the data-parallel group's first
    /// rank verifies a candidate's every file (reading the checkpoint once) and every rank takes its verdict, so
    /// all load the same one. This is what a restarted job wants: a crash while a checkpoint was written, or a
    /// disk that lost a file, costs the steps back to the previous checkpoint, not the run.
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
    /// let dir = std::env::temp_dir().join(format!("zerorun-doc-intact-{}", std::process::id()));
    /// // What a restarted job does first: resume from what survived, or start from step 0.
    /// match engine.load_latest_intact_checkpoint(&dir) {
    ///     Ok(tag) => println!("resumed from {tag} at step {}", engine.global_steps()),
    ///     Err(_) => println!("no checkpoint yet in {}: starting from step 0", dir.display()),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn load_latest_intact_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<String> {
        let dir = dir.as_ref();
        let candidates = SavedCheckpoint::candidates(dir);
        if candidates.is_empty() {
            return Err(CheckpointError::Missing {
                path: dir.to_path_buf(),
                what: "no checkpoint with a manifest".into(),
            }
            .into());
        }
        let mut faults = Vec::new();
        for tag in &candidates {
            let verdict = match self.comm.rank() {
                0 => SavedCheckpoint::open(dir, Some(tag)).and_then(|saved| saved.verify()).err(),
                _ => None,
            };
            let mut bad = [if verdict.is_some() { 1.0f32 } else { 0.0 }];
            self.comm.all_reduce(&mut bad, ReduceOp::Max)?;
            if bad[0] == 0.0 {
                if !faults.is_empty() {
                    tracing::warn!(tag = %tag, skipped = faults.len(), "loading an older checkpoint: the newer ones are damaged");
                }
                return self.load_checkpoint(dir, Some(tag));
            }
            let why =
                verdict.map_or_else(|| "damaged (rank 0 of the group found it so)".to_string(), |e| e.to_string());
            tracing::warn!(tag = %tag, "checkpoint not loaded: {why}");
            faults.push(format!("{tag}: {why}"));
        }
        Err(CheckpointError::Missing {
            path: dir.to_path_buf(),
            what: format!("no intact checkpoint: {}", faults.join("; ")),
        }
        .into())
    }

    /// [`Engine::load_checkpoint`] of a model that is part of the checkpoint's (a pipeline stage): every parameter
    /// and variable of this engine must be in it, the checkpoint's others are left alone.
    pub(crate) fn load_checkpoint_part(&mut self, dir: &Path, tag: Option<&str>) -> Result<String> {
        self.load_checkpoint_impl(dir, tag, true)
    }

    fn load_checkpoint_impl(&mut self, dir: &Path, tag: Option<&str>, part: bool) -> Result<String> {
        let saved = SavedCheckpoint::open(dir, tag)?;
        let (m, manifest_path) = (&saved.manifest, saved.manifest_path());
        let tag = saved.tag.clone();
        let mismatch = |what: String| CheckpointError::Mismatch { path: manifest_path.clone(), what };
        // Parameters are matched by name, so layouts in another order (stage 3 lays out by unit) load too.
        let mut problems: Vec<String> = Vec::new();
        // Whole shapes are compared: a slice of another tensor-parallel degree is read by its place.
        for (i, slot) in self.states.layout.slots.iter().enumerate() {
            let whole =
                ParamEntry { shape: slot.shape.clone(), slice: self.placement.slot_slice(i), ..Default::default() };
            match m.param(&slot.name) {
                None => problems.push(format!("model `{}` {:?} is not in the checkpoint", slot.name, slot.shape)),
                Some(p) if p.full_shape() != whole.full_shape() => problems.push(format!(
                    "model `{}` {:?} vs checkpoint {:?}",
                    slot.name,
                    whole.full_shape(),
                    p.full_shape()
                )),
                Some(_) => {}
            }
        }
        let names = m.param_names();
        if problems.is_empty() && !part && names.len() != self.states.layout.slots.len() {
            let extra: Vec<&str> = names
                .iter()
                .filter(|n| !self.states.layout.slots.iter().any(|s| &s.name == *n))
                .copied()
                .take(3)
                .collect();
            problems.push(format!(
                "the checkpoint has {} parameters, the model {} (not in the model: {extra:?})",
                names.len(),
                self.states.layout.slots.len()
            ));
        }
        if !problems.is_empty() {
            problems.truncate(3);
            return Err(mismatch(format!("parameters differ: {}", problems.join("; "))).into());
        }
        if m.variables_file.is_some() {
            let buffers: Vec<(String, Vec<i64>)> =
                self.states.buffers.iter().map(|(n, t)| (n.clone(), t.size())).collect();
            let mut problems = variable_problems("buffer", &buffers, &m.buffers, part);
            if !m.frozen_excluded {
                let frozen: Vec<(String, Vec<i64>)> = self.frozen_specs().into_iter().map(|(n, s, _)| (n, s)).collect();
                problems.extend(variable_problems("frozen parameter", &frozen, &m.frozen, part));
            }
            if !problems.is_empty() {
                problems.truncate(3);
                return Err(mismatch(format!("variables differ: {}", problems.join("; "))).into());
            }
        }
        let our_states: Vec<String> = self.shard.tier.state_names();
        if self.shard.tier.name() != m.optimizer || our_states != m.state_names {
            return Err(mismatch(format!(
                "optimizer {} with {:?}, but the config builds {} with {:?}",
                m.optimizer,
                m.state_names,
                self.shard.tier.name(),
                our_states
            ))
            .into());
        }

        // Values first (the master or the parameters), then the optimizer state, which an NVMe run takes one
        // sub-group at a time, so the whole state is never assembled in memory.
        let pieces = self.optimized_pieces(self.comm.rank());
        let slices = (0..self.states.layout.slots.len()).map(|i| self.placement.slot_slice(i)).collect();
        let mut reader = ShardReader::new(&saved, &self.states.layout.slots, slices, &pieces);
        let mut values = vec![0f32; self.shard.optimized.len()];
        reader.read(0..values.len(), &["params"], &mut [&mut values])?;
        let names: Vec<&str> = m.state_names.iter().map(String::as_str).collect();
        self.shard.tier.import_from(m.optimizer_steps, &mut |range, out| {
            reader.read(range, &names, out).map_err(|e| zerorun_offload::TierError::Fill(Box::new(e)))
        })?;
        let values = tch::Tensor::from_slice(&values);
        if let Some(master) = &mut self.shard.master {
            tch::no_grad(|| master.f_copy_(&values))?;
        }
        self.write_shard(&values)?;
        match self.plan.after_step() {
            AfterStep::Nothing => {}
            AfterStep::AllGatherFlat => {
                views::all_gather(self.residence, self.comm.as_ref(), &self.states.parameters.flat)?
            }
            AfterStep::RefreshGatheredUnits => self.refresh_gathered_units()?,
        }
        self.load_variables(&saved)?;
        self.load_outer_state(&saved)?;
        crate::engine::compression::restore(
            self.shard.tier.optimizer_mut(),
            self.gradients.powersgd.as_mut(),
            self.gradients.sharded_signs.as_mut(),
            &saved.folder,
            &m.rank_state_files,
            self.comm.rank(),
            self.comm.world_size(),
        )?;
        if let (Some(s), Some(it)) = (self.shard.scheduler.as_mut(), m.scheduler_last_batch_iteration) {
            s.last_batch_iteration = it;
        }
        if let (Some(s), Some(state)) = (self.shard.scaler.as_mut(), m.loss_scaler.clone()) {
            s.state = state;
        }
        match m.rng_states.get(self.comm.rank()) {
            Some(hex) if m.world_size == self.comm.world_size() && !part => {
                let state =
                    from_hex(hex).map_err(|what| mismatch(format!("rng_states[{}]: {what}", self.comm.rank())))?;
                let _generator = crate::engine::device::native::generator_lock();
                crate::engine::device::native::set_rng_state(&state)?
            }
            _ if !m.rng_states.is_empty() => tracing::warn!(
                from = m.world_size,
                to = self.comm.world_size(),
                "another world size: the CPU generator is not restored"
            ),
            _ => {}
        }
        if let Some(p) = m.params.iter().find(|p| !p.dtype.is_empty() && p.dtype != dtype_name(self.precision())) {
            tracing::info!(saved = %p.dtype, now = dtype_name(self.precision()), "the checkpoint was saved in another precision; values come from its fp32 master");
        }
        self.progress.global_steps = m.global_steps;
        self.progress.global_samples = m.global_samples;
        self.progress.skipped_steps = m.skipped_steps;
        self.progress.micro_steps = 0;
        self.progress.micro_at_boundary = 0;
        self.progress.loss_sum = 0.0;
        self.progress.loss_count = 0;
        self.progress.backwards = 0;
        self.gradients.clear_accumulator();
        self.gradients.consume()?;
        self.gradients.mark = self.gradient_fingerprint();
        self.comm.barrier()?;
        if self.sync.is_stale() {
            // The owners start again from the loaded values.
            self.sync = crate::engine::async_training::Synchronization::Synchronous;
            self.comm.barrier()?;
            self.start_bounded_staleness()?;
        }
        tracing::info!(
            tag,
            step = self.progress.global_steps,
            from_world_size = m.world_size,
            from_stage = m.stage,
            "checkpoint loaded"
        );
        Ok(tag)
    }

    /// DiLoCo's anchor and momentum, by parameter name; a checkpoint without them (saved synchronously or by local
    /// SGD) starts the outer optimizer from the loaded parameters, with no momentum.
    fn load_outer_state(&mut self, saved: &SavedCheckpoint) -> Result<()> {
        let Some(meetings) = self.sync.meetings_mut() else { return Ok(()) };
        if !meetings.has_outer_state() {
            return Ok(());
        }
        let slots = self.states.layout.slots.clone();
        match &saved.manifest.outer_state_file {
            Some(name) => {
                let path = saved.folder.join(name);
                let file = crate::checkpoint::hf::WeightFiles::open(&path)?;
                meetings.load_outer_state(&slots, &mut |n| read_variable(&file, n).map(|(_, t)| t))
            }
            None => {
                tracing::info!(
                    "the checkpoint has no DiLoCo outer state: the anchor is the loaded parameters, the momentum zero"
                );
                // A 16-bit model's ranks meet by their fp32 master.
                let values = match &self.shard.master {
                    Some(master) => master.copy(),
                    None => self.states.parameters.flat.shallow_clone(),
                };
                *meetings =
                    crate::engine::async_training::meetings::Meetings::new(&self.config.async_training, &values)
                        .expect("DiLoCo has meetings");
                Ok(())
            }
        }
    }

    /// Restores the buffers and frozen parameters of a checkpoint (names checked before anything was loaded).
    /// Every rank reads them from the checkpoint's variables files.
    fn load_variables(&mut self, saved: &SavedCheckpoint) -> Result<()> {
        let m = &saved.manifest;
        let files = saved.variables_files()?;
        if files.is_empty() {
            if !self.states.buffers.is_empty() || !self.frozen_specs().is_empty() {
                tracing::warn!(
                    format = m.format_version,
                    "a checkpoint from before format 3 holds no buffers or frozen parameters: the model keeps its own"
                );
            }
            return Ok(());
        }
        tch::no_grad(|| -> Result<()> {
            for (name, t) in &self.states.buffers {
                t.shallow_clone().f_copy_(&read_saved_variable(&files, name)?)?;
            }
            Ok(())
        })?;
        if m.frozen_excluded {
            if !self.frozen_specs().is_empty() {
                tracing::info!("the checkpoint was saved with exclude_frozen_parameters: frozen parameters keep the model's values");
            }
            return Ok(());
        }
        match self.states.parameters.frozen_units.as_mut() {
            Some(units) => units.load(self.comm.as_ref(), &mut |name| read_saved_variable(&files, name).map(Some)),
            None => tch::no_grad(|| -> Result<()> {
                for (name, t) in &self.states.frozen {
                    t.shallow_clone().f_copy_(&read_saved_variable(&files, name)?)?;
                }
                Ok(())
            }),
        }
    }
}
