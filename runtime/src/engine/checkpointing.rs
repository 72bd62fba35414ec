//! Saving and loading the engine's state in the checkpoint format of [`crate::checkpoint`], and full weights out
//! of the engine (`full_parameters`, `save_16bit_model`).
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use super::plan::{AfterStep, FlatRange, Optimized};
use super::{views, Engine, ParamSlot};
use crate::checkpoint::files::{self, MappedTensors};
use crate::checkpoint::{
    CheckpointError, Manifest, ParamEntry, RankEntry, SavedCheckpoint, VariableEntry, FORMAT_VERSION,
};
use crate::comm::{Collectives, ReduceOp};
use crate::config::{Precision, TagValidation};
use crate::error::{Error, Result};

/// How [`Engine::save_checkpoint_with`] saves.
#[derive(Debug, Clone, Default)]
pub struct SaveOptions {
    /// The checkpoint's folder name under the directory; default `global_step{N}`.
    pub tag: Option<String>,
    /// Leave the frozen parameters out (DeepSpeed's `exclude_frozen_parameters`), for a frozen base model that
    /// is kept elsewhere: loading such a checkpoint keeps the model's own frozen values.
    pub exclude_frozen_parameters: bool,
}

/// safetensors' name of a tensor kind.
pub(super) fn dtype_of_kind(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "F32",
        Kind::Double => "F64",
        Kind::Half => "F16",
        Kind::BFloat16 => "BF16",
        Kind::Int64 => "I64",
        Kind::Int => "I32",
        Kind::Int16 => "I16",
        Kind::Int8 => "I8",
        Kind::Uint8 => "U8",
        Kind::Bool => "BOOL",
        _ => "UNSUPPORTED",
    }
}

fn kind_of_dtype(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "F32" => Kind::Float,
        "F64" => Kind::Double,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        "I64" => Kind::Int64,
        "I32" => Kind::Int,
        "I16" => Kind::Int16,
        "I8" => Kind::Int8,
        "U8" => Kind::Uint8,
        "BOOL" => Kind::Bool,
        _ => return None,
    })
}

fn entry(name: &str, shape: &[i64], kind: Kind) -> VariableEntry {
    VariableEntry { name: name.to_string(), shape: shape.to_vec(), dtype: dtype_of_kind(kind).to_string() }
}

/// Tensor `name` of a checkpoint's variables file, as a tensor of its saved dtype.
pub(super) fn read_variable(file: &MappedTensors, path: &Path, name: &str) -> Result<Tensor> {
    let (dtype, shape, bytes) = file.raw(name)?;
    let kind = kind_of_dtype(&dtype).ok_or_else(|| CheckpointError::Io {
        path: path.to_path_buf(),
        what: format!("tensor `{name}`: dtype {dtype} is not read back"),
    })?;
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    Ok(Tensor::f_from_data_size(bytes, &shape, kind)?)
}

/// Gives variable `name` the values `src`: same shape (else `mismatch(theirs, ours)`), converted to the variable's
/// dtype, its storage grown first where it was released (a stage-3 unit not materialized yet; a no-op otherwise).
pub(super) fn fill_variable(
    name: &str,
    dst: &Tensor,
    src: &Tensor,
    mismatch: impl FnOnce(&str, Vec<i64>, Vec<i64>) -> Error,
) -> Result<()> {
    if src.size() != dst.size() {
        return Err(mismatch(name, src.size(), dst.size()));
    }
    let bytes = dst.numel() * dst.kind().elt_size_in_bytes();
    if super::native::storage_nbytes(dst) < bytes {
        super::native::resize_storage(dst, bytes)?;
    }
    tch::no_grad(|| dst.shallow_clone().f_copy_(src))?;
    Ok(())
}

/// The error of a tensor of another shape in `path`.
pub(super) fn file_mismatch(path: &Path) -> impl FnOnce(&str, Vec<i64>, Vec<i64>) -> Error + '_ {
    move |name, theirs, ours| {
        CheckpointError::Mismatch {
            path: path.to_path_buf(),
            what: format!("`{name}` is {theirs:?} in the file and {ours:?} in the model"),
        }
        .into()
    }
}

/// Differences between the model's variables of one role and a checkpoint's, as messages.
fn variable_problems(role: &str, ours: &[(String, Vec<i64>)], theirs: &[VariableEntry]) -> Vec<String> {
    let mut problems = Vec::new();
    for (name, shape) in ours {
        match theirs.iter().find(|e| &e.name == name) {
            None => problems.push(format!("model {role} `{name}` {shape:?} is not in the checkpoint")),
            Some(e) if &e.shape != shape => {
                problems.push(format!("model {role} `{name}` {shape:?} vs checkpoint {:?}", e.shape))
            }
            Some(_) => {}
        }
    }
    for e in theirs.iter().filter(|e| !ours.iter().any(|(n, _)| n == &e.name)) {
        problems.push(format!("checkpoint {role} `{}` {:?} is not in the model", e.name, e.shape));
    }
    problems
}

/// Loads every variable of `vs` from the safetensors file at `path` (pretrained weights, `save_16bit_model`'s or
/// `zerorun consolidate`'s output), one tensor at a time from the memory-mapped file, so the file is never read
/// whole into memory (`VarStore::load` reads it all first). Values convert to each variable's dtype; a variable
/// missing from the file or of another shape is an error naming it. Call it before `initialize`.
pub fn load_mapped(vs: &tch::nn::VarStore, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let file = MappedTensors::open(path)?;
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, var) in vars {
        fill_variable(&name, &var, &read_variable(&file, path, &name)?, file_mismatch(path))?;
    }
    Ok(())
}

impl Engine {
    /// `checkpoint.tag_validation`: the ranks compare their tags (a hash each, all-reduced) before anything is
    /// written. Tags that differ are an error on every rank under "Fail", a warning under "Warn" (the default) and
    /// nothing under "Ignore"; the checkpoint then takes rank 0's tag, so it stays one directory.
    fn agree_on_tag(&self, tag: String) -> Result<String> {
        if self.world_size() == 1 {
            return Ok(tag);
        }
        // The same binary on every rank: std's hasher (SipHash with fixed keys) gives every rank the same value.
        let hash = {
            use std::hash::{Hash, Hasher};
            let mut h = std::hash::DefaultHasher::new();
            tag.hash(&mut h);
            h.finish() as i64
        };
        // Max of the hash and of its negation: equal hashes everywhere iff max == -(-max of negation).
        let mut extremes = [hash, hash.wrapping_neg()];
        self.comm.all_reduce(&mut extremes, ReduceOp::Max)?;
        if extremes[0] == extremes[1].wrapping_neg() {
            return Ok(tag);
        }
        let mut len = [tag.len() as i64];
        self.comm.broadcast(&mut len, 0)?;
        let mut words = vec![0i64; (len[0] as usize).div_ceil(8)];
        if self.rank() == 0 {
            bytemuck::cast_slice_mut::<i64, u8>(&mut words)[..tag.len()].copy_from_slice(tag.as_bytes());
        }
        self.comm.broadcast(&mut words, 0)?;
        let root = String::from_utf8_lossy(&bytemuck::cast_slice::<i64, u8>(&words)[..len[0] as usize]).into_owned();
        let rank = self.rank();
        match self.config.checkpoint.tag_validation {
            TagValidation::Fail => {
                return Err(crate::Error::Usage(format!(
                    "checkpoint tags differ across ranks (rank 0 saves {root:?}, rank {rank} {tag:?}) and checkpoint.tag_validation is \"Fail\": nothing was written"
                )))
            }
            TagValidation::Warn if root != tag => {
                tracing::warn!(rank, tag, root_tag = root, "checkpoint tags differ across ranks; saving under rank 0's tag (checkpoint.tag_validation)")
            }
            _ => {}
        }
        Ok(root)
    }
}

fn check_tag(tag: &str) -> Result<()> {
    if tag.is_empty() || tag.starts_with('.') || tag.contains(['/', '\\']) || tag == "latest" {
        return Err(crate::Error::Usage(format!(
            "checkpoint tag {tag:?}: use a plain folder name (not `latest`, no '/')"
        )));
    }
    Ok(())
}

fn dtype_name(p: Precision) -> &'static str {
    match p {
        Precision::Fp32 => "F32",
        Precision::Bf16 => "BF16",
        Precision::Fp16 => "F16",
    }
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(text: &str) -> std::result::Result<Vec<u8>, String> {
    if text.len() % 2 != 0 {
        return Err("odd number of hex digits".into());
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).map_err(|e| format!("not hex at {i}: {e}")))
        .collect()
}

/// Reads this rank's optimized elements (optimizer order) from a checkpoint's rank files, any range at a time,
/// matching parameters by name. Each file is checksummed and mapped when first needed.
struct ShardReader<'a> {
    saved: &'a SavedCheckpoint,
    slots: &'a [ParamSlot],
    /// This rank's optimized flat ranges with where each starts in optimizer order.
    pieces: Vec<(usize, std::ops::Range<usize>)>,
    opened: Vec<Option<MappedTensors>>,
}

impl<'a> ShardReader<'a> {
    fn new(saved: &'a SavedCheckpoint, slots: &'a [ParamSlot], pieces: &[std::ops::Range<usize>]) -> Self {
        let mut base = 0;
        let pieces = pieces
            .iter()
            .map(|p| {
                base += p.len();
                (base - p.len(), p.clone())
            })
            .collect();
        let opened = (0..saved.manifest.ranks.len()).map(|_| None).collect();
        ShardReader { saved, slots, pieces, opened }
    }

    fn file(&mut self, entry: usize) -> Result<&MappedTensors> {
        if self.opened[entry].is_none() {
            self.opened[entry] = Some(self.saved.rank_file(entry)?);
        }
        Ok(self.opened[entry].as_ref().expect("opened above"))
    }

    /// Fills `out[i]` (each `want.len()` long) with tensor `names[i]` of the checkpoint over `want`, a range of
    /// this rank's optimized elements. Padding, which no file holds, is left as it is.
    fn read(&mut self, want: std::ops::Range<usize>, names: &[&str], out: &mut [&mut [f32]]) -> Result<()> {
        for (base, piece) in self.pieces.clone() {
            let (lo, hi) = (want.start.max(base), want.end.min(base + piece.len()));
            if lo >= hi {
                continue;
            }
            let flat = piece.start + (lo - base)..piece.start + (hi - base);
            for slot in self.slots {
                let (a, b) = (slot.range.start.max(flat.start), slot.range.end.min(flat.end));
                if a >= b {
                    continue;
                }
                let theirs = self.saved.manifest.param(&slot.name).expect("names checked before reading");
                let from = theirs.start + (a - slot.range.start);
                for loc in self.saved.manifest.locate(from..from + (b - a)) {
                    let at = base + (a - piece.start) - want.start + loc.dst_offset;
                    let dst = at..at + loc.file_range.len();
                    let file = self.file(loc.entry)?;
                    for (name, o) in names.iter().zip(out.iter_mut()) {
                        file.read_f32(name, loc.file_range.clone(), &mut o[dst.clone()])?;
                    }
                }
            }
        }
        Ok(())
    }
}

impl Engine {
    /// Every rank's CPU generator state, hex, on every rank (rank r fills slot r of a zeroed buffer; one sum).
    fn gather_rng_states(&mut self) -> Result<Vec<String>> {
        let mine = super::native::rng_state()?;
        let (ws, rank, n) = (self.world_size(), self.rank(), mine.len());
        let mut all = vec![0i64; ws * n];
        for (d, b) in all[rank * n..(rank + 1) * n].iter_mut().zip(&mine) {
            *d = *b as i64;
        }
        self.comm.all_reduce(&mut all, ReduceOp::Sum)?;
        Ok((0..ws).map(|r| to_hex(&all[r * n..(r + 1) * n].iter().map(|&x| x as u8).collect::<Vec<u8>>())).collect())
    }

    /// The flat ranges of the layout rank `r` optimizes, in the order of its optimized values: everything at
    /// stage 0, its partition at stages 1-2, a chunk of every unit at stage 3.
    fn optimized_pieces(&self, r: usize) -> Vec<std::ops::Range<usize>> {
        match self.plan.optimized(&self.layout, r) {
            Optimized::Flat(FlatRange(range)) => vec![range],
            Optimized::Shard(_) => self.layout.shard_pieces(r),
        }
    }

    /// The fp32 values of this rank's optimized range (the master copy, or the parameters themselves in fp32).
    fn optimized_values(&mut self) -> Result<Vec<f32>> {
        Ok(match &self.master {
            Some(m) => m.to_vec(),
            None => Vec::<f32>::try_from(&self.read_shard()?).expect("fp32 parameters"),
        })
    }

    /// Saves under `dir/<tag>/` (default tag `global_step{N}`) and points `dir/latest` at it once it is complete:
    /// the optimized values and optimizer states (each rank its own), and once, by name, the buffers and frozen
    /// parameters. Collective: every rank calls it. Returns the checkpoint's folder.
    pub fn save_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<PathBuf> {
        self.save_checkpoint_with(dir, &SaveOptions { tag: tag.map(str::to_string), ..SaveOptions::default() })
    }

    /// [`Engine::save_checkpoint`] with options (DeepSpeed's `exclude_frozen_parameters`).
    pub fn save_checkpoint_with(&mut self, dir: impl AsRef<Path>, options: &SaveOptions) -> Result<PathBuf> {
        let dir = dir.as_ref();
        let tag = options.tag.clone().unwrap_or_else(|| format!("global_step{}", self.global_steps));
        let with_frozen = !options.exclude_frozen_parameters;
        check_tag(&tag)?;
        let tag = self.agree_on_tag(tag)?;
        let (rank, ws, stage) = (self.rank(), self.world_size(), self.plan.stage());
        let per_rank = self.plan.partitions_optimizer();
        let staging = dir.join(format!(".{tag}.partial"));
        if rank == 0 {
            std::fs::create_dir_all(dir).map_err(|e| CheckpointError::Io { path: dir.into(), what: e.to_string() })?;
            if staging.exists() {
                std::fs::remove_dir_all(&staging)
                    .map_err(|e| CheckpointError::Io { path: staging.clone(), what: e.to_string() })?;
            }
            std::fs::create_dir(&staging)
                .map_err(|e| CheckpointError::Io { path: staging.clone(), what: e.to_string() })?;
        }
        self.comm.barrier()?;
        // Stage 0: every rank holds everything, so rank 0 writes it; stages 1-2: each rank its partition.
        let writes = per_rank || rank == 0;
        let mut crcs = vec![0i64; ws];
        if writes {
            let values = self.optimized_values()?;
            let mut tensors = vec![("params".to_string(), vec![values.len()])];
            tensors.extend(self.optimizer.state_names().into_iter().map(|n| (n, vec![values.len()])));
            let file = staging.join(format!("rank{rank}.safetensors"));
            // State buffers stream from wherever they live (NVMe: one sub-group at a time).
            let optimizer = &mut self.optimizer;
            let crc = files::write_safetensors(&file, &tensors, "F32", |i, w| {
                if i == 0 {
                    files::write_f32(w, &values)
                } else {
                    optimizer.write_state(i - 1, w)
                }
            })?;
            crcs[rank] = crc as i64;
        }
        self.comm.all_reduce(&mut crcs, ReduceOp::Sum)?;
        let rng_states = self.gather_rng_states()?;
        // The model's weights in its dtype, by name (DeepSpeed's model states file), with its buffers and frozen
        // parameters: a file `VarStore::load` reads. Stage 3 gathers the weights only when configured to; the
        // buffers and frozen parameters are saved either way, once, by rank 0.
        let whole = !self.plan.partitions_parameters()
            || self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save;
        let (file_name, model_weights) = if whole {
            ("model.safetensors", "model.safetensors".to_string())
        } else {
            ("variables.safetensors", "absent: stage 3 without zero_optimization.stage3_gather_16bit_weights_on_model_save; `zerorun consolidate` assembles them from the rank files".to_string())
        };
        let tensors = self.model_tensors(whole.then(|| views::kind_of(self.precision)), with_frozen)?;
        if rank == 0 {
            let file = staging.join(file_name);
            tch::Tensor::write_safetensors(&tensors, &file)
                .map_err(|e| CheckpointError::Io { path: file.clone(), what: e.to_string() })?;
        }
        drop(tensors);
        let buffer_entries: Vec<VariableEntry> =
            self.buffers.iter().map(|(n, t)| entry(n, &t.size(), t.kind())).collect();
        let frozen_entries: Vec<VariableEntry> = if with_frozen {
            self.frozen_specs().iter().map(|(n, shape, kind)| entry(n, shape, *kind)).collect()
        } else {
            Vec::new()
        };
        if rank == 0 {
            let layout = &self.layout;
            let ranks = (0..if per_rank { ws } else { 1 })
                .map(|r| RankEntry::new(format!("rank{r}.safetensors"), &self.optimized_pieces(r), crcs[r] as u32))
                .collect();
            let manifest = Manifest {
                format_version: FORMAT_VERSION,
                tag: tag.clone(),
                global_steps: self.global_steps,
                global_samples: self.global_samples,
                skipped_steps: self.skipped_steps,
                optimizer_steps: self.optimizer.step_count(),
                optimizer: self.optimizer.name().to_string(),
                state_names: self.optimizer.state_names(),
                scheduler_last_batch_iteration: self.scheduler.as_ref().map(|s| s.last_batch_iteration),
                loss_scaler: self.scaler.as_ref().map(|s| s.state.clone()),
                world_size: ws,
                stage,
                precision: format!("{:?}", self.precision).to_lowercase(),
                numel: layout.numel,
                params: layout
                    .slots
                    .iter()
                    .map(|s| ParamEntry {
                        name: s.name.clone(),
                        shape: s.shape.clone(),
                        start: s.range.start,
                        len: s.range.len(),
                        dtype: dtype_name(self.precision).into(),
                    })
                    .collect(),
                ranks,
                rng_states,
                model_weights: Some(model_weights),
                variables_file: Some(file_name.to_string()),
                buffers: buffer_entries,
                frozen: frozen_entries,
                frozen_excluded: !with_frozen,
                config: self.config.to_value(),
            };
            manifest.write(&staging.join("manifest.json"))?;
            files::sync_dir(&staging)?;
            // Put the complete folder in place, then point `latest` at it.
            let target = dir.join(&tag);
            let io = |p: &Path, e: std::io::Error| CheckpointError::Io { path: p.to_path_buf(), what: e.to_string() };
            if target.exists() {
                let old = dir.join(format!(".{tag}.old"));
                let _ = std::fs::remove_dir_all(&old);
                std::fs::rename(&target, &old).map_err(|e| io(&target, e))?;
                std::fs::rename(&staging, &target).map_err(|e| io(&staging, e))?;
                let _ = std::fs::remove_dir_all(&old);
            } else {
                std::fs::rename(&staging, &target).map_err(|e| io(&staging, e))?;
            }
            files::sync_dir(dir)?;
            files::write_atomic(&dir.join("latest"), tag.as_bytes())?;
        }
        self.comm.barrier()?;
        tracing::info!(tag, step = self.global_steps, "checkpoint saved");
        Ok(dir.join(tag))
    }

    /// Loads `dir/<tag>` (default: the tag `dir/latest` names), written at any world size and stage 0-3: each rank
    /// reads only the element ranges it optimizes, matching parameters by name. Collective. Returns the tag loaded.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<String> {
        let saved = SavedCheckpoint::open(dir.as_ref(), tag)?;
        let (m, path, manifest_path) = (&saved.manifest, &saved.folder, saved.manifest_path());
        let tag = saved.tag.clone();
        let mismatch = |what: String| CheckpointError::Mismatch { path: manifest_path.clone(), what };
        // Parameters are matched by name, so layouts in another order (stage 3 lays out by unit) load too.
        let mut problems: Vec<String> = Vec::new();
        for slot in &self.layout.slots {
            match m.param(&slot.name) {
                None => problems.push(format!("model `{}` {:?} is not in the checkpoint", slot.name, slot.shape)),
                Some(p) if p.shape != slot.shape => {
                    problems.push(format!("model `{}` {:?} vs checkpoint {:?}", slot.name, slot.shape, p.shape))
                }
                Some(_) => {}
            }
        }
        if problems.is_empty() && m.params.len() != self.layout.slots.len() {
            let extra: Vec<&str> = m
                .params
                .iter()
                .filter(|p| !self.layout.slots.iter().any(|s| s.name == p.name))
                .map(|p| p.name.as_str())
                .take(3)
                .collect();
            problems.push(format!(
                "the checkpoint has {} parameters, the model {} (not in the model: {extra:?})",
                m.params.len(),
                self.layout.slots.len()
            ));
        }
        if !problems.is_empty() {
            problems.truncate(3);
            return Err(mismatch(format!("parameters differ: {}", problems.join("; "))).into());
        }
        if m.variables_file.is_some() {
            let buffers: Vec<(String, Vec<i64>)> = self.buffers.iter().map(|(n, t)| (n.clone(), t.size())).collect();
            let mut problems = variable_problems("buffer", &buffers, &m.buffers);
            if !m.frozen_excluded {
                let frozen: Vec<(String, Vec<i64>)> = self.frozen_specs().into_iter().map(|(n, s, _)| (n, s)).collect();
                problems.extend(variable_problems("frozen parameter", &frozen, &m.frozen));
            }
            if !problems.is_empty() {
                problems.truncate(3);
                return Err(mismatch(format!("variables differ: {}", problems.join("; "))).into());
            }
        }
        let our_states: Vec<String> = self.optimizer.state_names();
        if self.optimizer.name() != m.optimizer || our_states != m.state_names {
            return Err(mismatch(format!(
                "optimizer {} with {:?}, but the config builds {} with {:?}",
                m.optimizer,
                m.state_names,
                self.optimizer.name(),
                our_states
            ))
            .into());
        }

        // Values first (the master or the parameters), then the optimizer state, which an NVMe run takes one
        // sub-group at a time, so the whole state is never assembled in memory.
        let pieces = self.optimized_pieces(self.rank());
        let mut reader = ShardReader::new(&saved, &self.layout.slots, &pieces);
        let mut values = vec![0f32; self.optimized.len()];
        reader.read(0..values.len(), &["params"], &mut [&mut values])?;
        let names: Vec<&str> = m.state_names.iter().map(String::as_str).collect();
        self.optimizer.import_from(m.optimizer_steps, &mut |range, out| {
            reader.read(range, &names, out).map_err(|e| zerorun_offload::TierError::Fill(Box::new(e)))
        })?;
        if let Some(master) = &mut self.master {
            master.copy_from_slice(&values);
        }
        self.write_shard(&tch::Tensor::from_slice(&values))?;
        match self.plan.after_step() {
            AfterStep::Nothing => {}
            AfterStep::AllGatherFlat => views::all_gather(self.comm.as_ref(), &self.flat_params)?,
            AfterStep::RefreshGatheredUnits => self.refresh_gathered_units()?,
        }
        self.load_variables(m, path)?;
        if let (Some(s), Some(it)) = (self.scheduler.as_mut(), m.scheduler_last_batch_iteration) {
            s.last_batch_iteration = it;
        }
        if let (Some(s), Some(state)) = (self.scaler.as_mut(), m.loss_scaler.clone()) {
            s.state = state;
        }
        match m.rng_states.get(self.rank()) {
            Some(hex) if m.world_size == self.world_size() => super::native::set_rng_state(
                &from_hex(hex).map_err(|what| mismatch(format!("rng_states[{}]: {what}", self.rank())))?,
            )?,
            _ if !m.rng_states.is_empty() => tracing::warn!(
                from = m.world_size,
                to = self.world_size(),
                "another world size: the CPU generator is not restored"
            ),
            _ => {}
        }
        if let Some(p) = m.params.iter().find(|p| !p.dtype.is_empty() && p.dtype != dtype_name(self.precision)) {
            tracing::info!(saved = %p.dtype, now = dtype_name(self.precision), "the checkpoint was saved in another precision; values come from its fp32 master");
        }
        self.global_steps = m.global_steps;
        self.global_samples = m.global_samples;
        self.skipped_steps = m.skipped_steps;
        self.micro_steps = 0;
        self.loss_sum = 0.0;
        self.loss_count = 0;
        self.gradients.clear_accumulator();
        self.gradients.consume()?;
        self.grad_mark = self.gradient_fingerprint();
        self.comm.barrier()?;
        tracing::info!(
            tag,
            step = self.global_steps,
            from_world_size = m.world_size,
            from_stage = m.stage,
            "checkpoint loaded"
        );
        Ok(tag)
    }
}

/// Full weights out of the engine: every parameter by name, and DeepSpeed's `save_16bit_model`.
impl Engine {
    /// Every parameter by name as full fp32 copies (identical on every rank). Collective at stage 3, where it
    /// gathers the units one at a time: every rank calls it.
    pub fn full_parameters(&mut self) -> Result<Vec<(String, Tensor)>> {
        self.full_parameters_as(Kind::Float)
    }

    pub(super) fn full_parameters_as(&mut self, kind: Kind) -> Result<Vec<(String, Tensor)>> {
        if self.plan.partitions_parameters() {
            return self.gather_full_parameters(kind, false);
        }
        Ok(self
            .layout
            .slots
            .iter()
            .zip(&self.params)
            .map(|(s, t)| (s.name.clone(), t.detach().to_kind(kind).copy()))
            .collect())
    }

    /// Every variable of the VarStore by name, full size: trainable parameters in the model's dtype, frozen
    /// parameters and buffers in theirs (buffers as this rank has them). It is what `VarStore::load` of the same
    /// model reads back once written with `Tensor::write_safetensors` (a `vs.save` at stage 3 would write the
    /// empty tensors of the released units). Collective at stage 3, where it gathers the units one at a time:
    /// every rank calls it.
    pub fn state_dict(&mut self) -> Result<Vec<(String, Tensor)>> {
        self.model_tensors(Some(views::kind_of(self.precision)), true)
    }

    /// The trainable parameters as `kind` (None: without them), the frozen ones (with `frozen`, in their dtype)
    /// and the buffers, by name. Stage 3 gathers the units one at a time (collective).
    fn model_tensors(&mut self, kind: Option<Kind>, frozen: bool) -> Result<Vec<(String, Tensor)>> {
        let stage3 = self.plan.partitions_parameters();
        let mut out = match kind {
            // One walk over the units gathers both kinds of parameters.
            Some(kind) if stage3 => self.gather_full_parameters(kind, frozen)?,
            Some(kind) => self.full_parameters_as(kind)?,
            None => Vec::new(),
        };
        if frozen && !(stage3 && kind.is_some()) {
            match &mut self.frozen_units {
                Some(units) => out.extend(units.full_copies(self.comm.as_ref())?),
                None => out.extend(self.frozen.iter().map(|(n, t)| (n.clone(), t.detach().copy()))),
            }
        }
        out.extend(self.buffers.iter().map(|(n, t)| (n.clone(), t.detach().copy())));
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// (name, shape, kind) of every frozen parameter.
    fn frozen_specs(&self) -> Vec<(String, Vec<i64>, Kind)> {
        match &self.frozen_units {
            Some(units) => units.specs(),
            None => self.frozen.iter().map(|(n, t)| (n.clone(), t.size(), t.kind())).collect(),
        }
    }

    /// Restores the buffers and frozen parameters of a checkpoint (names checked before anything was loaded).
    /// Every rank reads them from the one file.
    fn load_variables(&mut self, m: &Manifest, folder: &Path) -> Result<()> {
        let Some(file_name) = &m.variables_file else {
            if !self.buffers.is_empty() || !self.frozen_specs().is_empty() {
                tracing::warn!(
                    format = m.format_version,
                    "a checkpoint from before format 3 holds no buffers or frozen parameters: the model keeps its own"
                );
            }
            return Ok(());
        };
        let path = folder.join(file_name);
        let file = MappedTensors::open(&path)?;
        tch::no_grad(|| -> Result<()> {
            for (name, t) in &self.buffers {
                t.shallow_clone().f_copy_(&read_variable(&file, &path, name)?)?;
            }
            Ok(())
        })?;
        if m.frozen_excluded {
            if !self.frozen_specs().is_empty() {
                tracing::info!("the checkpoint was saved with exclude_frozen_parameters: frozen parameters keep the model's values");
            }
            return Ok(());
        }
        match self.frozen_units.as_mut() {
            Some(units) => units.load(self.comm.as_ref(), &mut |name| read_variable(&file, &path, name).map(Some)),
            None => tch::no_grad(|| -> Result<()> {
                for (name, t) in &self.frozen {
                    t.shallow_clone().f_copy_(&read_variable(&file, &path, name)?)?;
                }
                Ok(())
            }),
        }
    }

    /// DeepSpeed's `save_16bit_model`: rank 0 writes [`Engine::state_dict`] (every parameter in the model's dtype,
    /// frozen parameters and buffers in theirs; safetensors, by name), a file `VarStore::load` reads.
    /// Collective. At stage 3 this gathers the units one at a time and needs
    /// `zero_optimization.stage3_gather_16bit_weights_on_model_save`; without it the weights exist only as
    /// shards, so it refuses and says where full weights come from instead of writing empty tensors.
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
        self.comm.barrier()?;
        Ok(())
    }
}
