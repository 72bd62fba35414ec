//! Writing a checkpoint: every rank's optimizer file, rank 0's manifest and variables, renamed into place only
//! when all of them are complete. Full weights out of the engine are `export.rs`'s.
use super::*;

impl Engine {
    /// Every rank's CPU generator state, hex, on every rank (rank r fills slot r of a zeroed buffer; one sum).
    fn gather_rng_states(&mut self) -> Result<Vec<String>> {
        let mine = crate::engine::device::native::rng_state()?;
        let (ws, rank, n) = (self.comm.world_size(), self.comm.rank(), mine.len());
        let mut all = vec![0i64; ws * n];
        for (d, b) in all[rank * n..(rank + 1) * n].iter_mut().zip(&mine) {
            *d = *b as i64;
        }
        self.comm.all_reduce(&mut all, ReduceOp::Sum)?;
        Ok((0..ws).map(|r| to_hex(&all[r * n..(r + 1) * n].iter().map(|&x| x as u8).collect::<Vec<u8>>())).collect())
    }

    /// The flat ranges of the layout rank `r` optimizes, in the order of its optimized values: everything at
    /// stage 0, its partition at stages 1-2, a chunk of every unit at stage 3.
    pub(crate) fn optimized_pieces(&self, r: usize) -> Vec<std::ops::Range<usize>> {
        match self.plan.optimized(&self.states.layout, r) {
            Optimized::Flat(FlatRange(range)) => vec![range],
            Optimized::Shard(_) => self.states.layout.shard_pieces(r),
        }
    }

    /// The fp32 values of this rank's optimized range (the master copy, or the parameters themselves in fp32).
    pub(crate) fn optimized_values(&mut self) -> Result<Vec<f32>> {
        Ok(match &self.shard.master {
            Some(m) => Vec::<f32>::try_from(m)?,
            None => Vec::<f32>::try_from(&self.read_shard()?).expect("fp32 parameters"),
        })
    }

    /// Saves under `dir/<tag>/` (default tag `global_step{N}`) and points `dir/latest` at it once it is complete:
    /// the optimized values and optimizer states (each rank its own), and once, by name, the buffers and frozen
    /// parameters. Collective: every rank calls it. Returns the checkpoint's folder.
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
    /// let dir = std::env::temp_dir().join(format!("zerorun-doc-save-{}", std::process::id()));
    /// let folder = engine.save_checkpoint(&dir, None)?; // dir/global_step0, and dir/latest names it
    /// assert!(folder.ends_with("global_step0"));
    /// let tag = engine.load_checkpoint(&dir, None)?; // the latest, at any world size and stage
    /// assert_eq!(tag, "global_step0");
    /// # std::fs::remove_dir_all(&dir)?;
    /// # Ok(()) }
    /// ```
    pub fn save_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<PathBuf> {
        self.save_checkpoint_with(dir, &SaveOptions { tag: tag.map(str::to_string), ..SaveOptions::default() })
    }

    /// [`Engine::save_checkpoint`] with options (DeepSpeed's `exclude_frozen_parameters`).
    pub fn save_checkpoint_with(&mut self, dir: impl AsRef<Path>, options: &SaveOptions) -> Result<PathBuf> {
        let Some(replicas) = self.comm.replicas().cloned() else {
            return self.save_group_checkpoint(dir.as_ref(), options);
        };
        // Shard groups hold the same states: the first group writes the checkpoint (a checkpoint of its ranks,
        // which loads at any world size), the others wait for its verdict.
        let saved = match replicas.index() {
            0 => self.save_group_checkpoint(dir.as_ref(), options),
            _ => {
                let tag = options.tag.clone().unwrap_or_else(|| format!("global_step{}", self.progress.global_steps));
                Ok(dir.as_ref().join(tag))
            }
        };
        let mut failed = [if saved.is_err() { 1.0f32 } else { 0.0 }];
        replicas.with(|g| crate::comm::Collectives::all_reduce(g, &mut failed, ReduceOp::Max))?;
        match saved {
            Ok(_) if failed[0] > 0.0 => Err(Error::Io {
                path: dir.as_ref().to_path_buf(),
                what: "the first shard group, which writes the checkpoint, could not save it (see its ranks' errors)"
                    .into(),
            }),
            saved => saved,
        }
    }

    /// The checkpoint of this engine's (shard) group.
    pub(crate) fn save_group_checkpoint(&mut self, dir: &Path, options: &SaveOptions) -> Result<PathBuf> {
        let _owner = crate::report::allocations::owned_by(crate::report::allocations::Owner::Engine);
        // One save in flight at a time: the previous asynchronous one finishes first (its error is this one's).
        if self.in_flight.is_busy() {
            tracing::info!("waiting for the previous asynchronous checkpoint before the next");
        }
        self.in_flight.wait()?;
        self.ready_for_checkpoint()?;
        let tag = options.tag.clone().unwrap_or_else(|| format!("global_step{}", self.progress.global_steps));
        check_tag(&tag)?;
        let tag = agree_on_tag(self.comm.as_ref(), self.config.checkpoint.tag_validation, tag)?;
        let staging = dir.join(format!(".{tag}.partial"));
        let tp = self.placement.tensor_parallel.as_ref().map(|p| (p.rank, p.size));
        if self.comm.rank() == 0 && matches!(tp, None | Some((0, _))) {
            prepare_staging(dir, &staging)?;
        }
        // With tensor parallelism the job's first rank prepared it: its tensor-parallel group, then each group's
        // data-parallel ranks, wait for it.
        self.tensor_parallel_barrier()?;
        self.comm.barrier()?;
        // States on NVMe stay a synchronous save's: a snapshot would bring them all into host memory.
        let on_nvme = self.shard.tier.swapped_bytes() > 0;
        if self.config.checkpoint.async_save && on_nvme && self.comm.rank() == 0 {
            tracing::warn!("checkpoint.async_save: the optimizer states are on NVMe, so this save is synchronous (a snapshot would hold them all in host memory)");
        }
        if self.config.checkpoint.async_save && tp.is_none() && !on_nvme {
            return self.save_in_background(dir, &staging, &tag, !options.exclude_frozen_parameters);
        }
        let manifest =
            self.save_part(&staging, &self.tensor_parallel_prefix(), &tag, !options.exclude_frozen_parameters)?;
        match manifest {
            Some(manifest) if tp.is_none() => publish(dir, &staging, &tag, &manifest)?,
            Some(manifest) => {
                if let Some(merged) = self.merge_tensor_parallel_parts(&staging, manifest)? {
                    publish(dir, &staging, &tag, &merged)?
                }
            }
            None => {}
        }
        // Nobody returns before the checkpoint is published: the job's first rank publishes before it reaches its
        // tensor-parallel group's barrier, which every data-parallel group's first rank passes before its own.
        self.tensor_parallel_barrier()?;
        self.comm.barrier()?;
        tracing::info!(tag, step = self.progress.global_steps, "checkpoint saved");
        Ok(dir.join(tag))
    }

    /// The asynchronous save of [`Engine::save_checkpoint_with`]: the snapshot (collective, like the rest of a
    /// save), then this rank's writer thread; rank 0's publishes. Returns the checkpoint's folder-to-be.
    fn save_in_background(&mut self, dir: &Path, staging: &Path, tag: &str, with_frozen: bool) -> Result<PathBuf> {
        let started = std::time::Instant::now();
        let mut writes = Vec::new();
        let manifest = self.save_part_to(staging, "", tag, with_frozen, Some(&mut writes))?;
        let timeout = std::time::Duration::from_secs_f64(self.config.comms_timeout);
        let publication = manifest.map(|manifest| background::Publication {
            dir: dir.to_path_buf(),
            tag: tag.to_string(),
            manifest,
            timeout,
        });
        self.in_flight.start(staging.to_path_buf(), writes, publication)?;
        tracing::info!(
            tag,
            step = self.progress.global_steps,
            snapshot_s = started.elapsed().as_secs_f64(),
            "checkpoint snapshot taken; writing in the background"
        );
        Ok(dir.join(tag))
    }

    /// Waits until the asynchronous checkpoint in flight (`checkpoint.async_save`) is written and, on rank 0,
    /// published; its error if it failed. Nothing to wait for otherwise. [`Engine::finish`] calls it; a program
    /// that reads the checkpoint's files itself calls it first.
    pub fn wait_for_checkpoint(&mut self) -> Result<()> {
        self.in_flight.wait()
    }

    fn tensor_parallel_barrier(&self) -> Result<()> {
        if let Some(p) = &self.placement.tensor_parallel {
            p.group.barrier()?;
        }
        Ok(())
    }

    /// The tensor-parallel parts' manifests (each data-parallel group's first rank has its part's) go to the
    /// group's first rank, which returns them merged into one ([`Manifest::merge_tensor_parallel`]); the others
    /// return None. Without tensor parallelism: `manifest` itself.
    pub(crate) fn merge_tensor_parallel_parts(&self, staging: &Path, manifest: Manifest) -> Result<Option<Manifest>> {
        use crate::pipeline::link::{recv_bytes, send_bytes};
        let Some(p) = &self.placement.tensor_parallel else { return Ok(Some(manifest)) };
        if p.rank > 0 {
            send_bytes(p.group.as_ref(), &serde_json::to_vec(&manifest).expect("manifests serialize"), 0)?;
            return Ok(None);
        }
        let mut parts = vec![manifest];
        for from in 1..p.size {
            let bytes = recv_bytes(p.group.as_ref(), from)?;
            parts.push(serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Io {
                path: staging.to_path_buf(),
                what: format!("tensor-parallel rank {from}'s manifest: {e}"),
            })?);
        }
        Ok(Some(Manifest::merge_tensor_parallel(parts, self.comm.world_size() * p.size)))
    }

    /// This engine's prefix of file names in a checkpoint: its tensor-parallel rank's.
    pub(crate) fn tensor_parallel_prefix(&self) -> String {
        self.placement.tensor_parallel.as_ref().map_or_else(String::new, |p| format!("tp{}.", p.rank))
    }

    /// What asynchronous training needs before a checkpoint: local SGD and DiLoCo refuse one between meetings (the
    /// ranks' parameters differ); bounded staleness makes it a meeting (every step applied, one model), after which
    /// it is stage 1's. Collective.
    pub(crate) fn ready_for_checkpoint(&mut self) -> Result<()> {
        if let Some(why) = self.sync.meetings().and_then(|m| m.refuses_checkpoint(self.progress.global_steps)) {
            return Err(crate::error::Error::Usage(why));
        }
        if let Some(why) = self.shard.tier.optimizer().and_then(|o| o.ranks_differ()) {
            return Err(crate::error::Error::Usage(format!("{why}; save right after a meeting")));
        }
        let parts = stale_parts!(self);
        match self.sync.stale_mut() {
            Some(stale) => stale.quiesce(parts),
            None => Ok(()),
        }
    }

    /// Writes this engine's files into `staging` (their names prefixed by `prefix`) and returns, on rank 0, the
    /// manifest that describes them; publishing it is the caller's. Collective over the engine's ranks.
    pub(crate) fn save_part(
        &mut self,
        staging: &Path,
        prefix: &str,
        tag: &str,
        with_frozen: bool,
    ) -> Result<Option<Manifest>> {
        self.save_part_to(staging, prefix, tag, with_frozen, None)
    }

    /// [`Engine::save_part`]; with `deferred`, the files are not written but their contents copied there (this
    /// rank's values and optimizer states as bytes, rank 0's model tensors), and the manifest's checksums are left
    /// for the writer to fill in ([`background`]).
    fn save_part_to(
        &mut self,
        staging: &Path,
        prefix: &str,
        tag: &str,
        with_frozen: bool,
        mut deferred: Option<&mut Vec<background::Write>>,
    ) -> Result<Option<Manifest>> {
        let (rank, ws, stage) = (self.comm.rank(), self.comm.world_size(), self.plan.stage());
        let per_rank = self.plan.partitions_optimizer();
        // Stage 0: every rank holds everything, so rank 0 writes it; stages 1-2: each rank its partition.
        let writes = per_rank || rank == 0;
        let mut crcs = vec![0i64; ws];
        if let (true, Some(deferred)) = (writes, deferred.as_deref_mut()) {
            // A snapshot in host memory: training may change the values and states as soon as this returns.
            let values = self.optimized_values()?;
            let mut names = vec!["params".to_string()];
            names.extend(self.shard.tier.state_names());
            let mut states = Vec::with_capacity(names.len() - 1);
            for i in 0..names.len() - 1 {
                let mut bytes = Vec::with_capacity(values.len() * 4);
                let io = |e: std::io::Error| Error::Io { path: staging.into(), what: e.to_string() };
                self.shard.tier.write_state(i, &mut bytes).map_err(io)?;
                states.push(bytes);
            }
            let file = staging.join(format!("{prefix}rank{rank}.safetensors"));
            let tensors = names.into_iter().map(|n| (n, vec![values.len()])).collect();
            deferred.push(background::Write::RankFile { file, tensors, values, states });
        } else if writes {
            let values = self.optimized_values()?;
            let mut tensors = vec![("params".to_string(), vec![values.len()])];
            tensors.extend(self.shard.tier.state_names().into_iter().map(|n| (n, vec![values.len()])));
            let file = staging.join(format!("{prefix}rank{rank}.safetensors"));
            // State buffers stream from wherever they live (NVMe: one sub-group at a time).
            let optimizer = &mut self.shard.tier;
            let crc = files::write_safetensors(&file, &tensors, "F32", |i, w| {
                if i == 0 {
                    files::write_f32(w, &values)
                } else {
                    optimizer.write_state(i - 1, w)
                }
            })?;
            crcs[rank] = crc as i64;
        }
        if deferred.is_none() {
            self.comm.all_reduce(&mut crcs, ReduceOp::Sum)?;
        }
        let rng_states = self.gather_rng_states()?;
        // The model's weights in its dtype, by name (DeepSpeed's model states file), with its buffers and frozen
        // parameters: a file `VarStore::load` reads. Stage 3 gathers the weights only when configured to; the
        // buffers and frozen parameters are saved either way, once, by rank 0.
        let whole = !self.plan.partitions_parameters()
            || self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save;
        let (file_name, model_weights) = if whole {
            (format!("{prefix}model.safetensors"), format!("{prefix}model.safetensors"))
        } else {
            (format!("{prefix}variables.safetensors"), "absent: stage 3 without zero_optimization.stage3_gather_16bit_weights_on_model_save; `zerorun consolidate` assembles them from the rank files".to_string())
        };
        let tensors = self.model_tensors(whole.then(|| views::kind_of(self.precision())), with_frozen)?;
        match (rank, deferred) {
            (0, Some(deferred)) => {
                deferred.push(background::Write::Tensors { file: staging.join(&file_name), tensors })
            }
            (0, None) => {
                let file = staging.join(&file_name);
                tch::Tensor::write_safetensors(&tensors, &file)
                    .map_err(|e| CheckpointError::Io { path: file.clone(), what: e.to_string() })?;
            }
            _ => drop(tensors),
        }
        // DiLoCo's outer state: the same on every rank right after a meeting; rank 0 writes it.
        let outer = self.sync.meetings().map(|m| m.outer_state(&self.states.layout.slots)).unwrap_or_default();
        let outer_state_file = (!outer.is_empty()).then(|| format!("{prefix}outer.safetensors"));
        if let (0, Some(name)) = (rank, &outer_state_file) {
            let file = staging.join(name);
            tch::Tensor::write_safetensors(&outer, &file)
                .map_err(|e| CheckpointError::Io { path: file.clone(), what: e.to_string() })?;
        }
        let rank_state_files = crate::engine::compression::save_rank_state(
            crate::engine::compression::rank_state(
                self.shard.tier.optimizer(),
                self.gradients.powersgd.as_ref(),
                self.gradients.sharded_signs.as_ref(),
            ),
            staging,
            prefix,
            rank,
            ws,
        )?;
        if !rank_state_files.is_empty() {
            // Every rank's file is in the staging folder before rank 0 publishes it.
            self.comm.barrier()?;
        }
        if rank != 0 {
            return Ok(None);
        }
        let buffer_entries: Vec<VariableEntry> =
            self.states.buffers.iter().map(|(n, t)| entry(n, &t.size(), t.kind())).collect();
        let frozen_entries: Vec<VariableEntry> = if with_frozen {
            self.frozen_specs().iter().map(|(n, shape, kind)| entry(n, shape, *kind)).collect()
        } else {
            Vec::new()
        };
        let layout = &self.states.layout;
        let ranks = (0..if per_rank { ws } else { 1 })
            .map(|r| RankEntry::new(format!("{prefix}rank{r}.safetensors"), &self.optimized_pieces(r), crcs[r] as u32))
            .collect();
        Ok(Some(Manifest {
            format_version: FORMAT_VERSION,
            tag: tag.to_string(),
            global_steps: self.progress.global_steps,
            global_samples: self.progress.global_samples,
            skipped_steps: self.progress.skipped_steps,
            optimizer_steps: self.shard.tier.step_count(),
            optimizer: self.shard.tier.name().to_string(),
            state_names: self.shard.tier.state_names(),
            scheduler_last_batch_iteration: self.shard.scheduler.as_ref().map(|s| s.last_batch_iteration),
            loss_scaler: self.shard.scaler.as_ref().map(|s| s.state.clone()),
            world_size: ws,
            stage,
            precision: format!("{:?}", self.precision()).to_lowercase(),
            numel: layout.numel,
            params: layout
                .slots
                .iter()
                .enumerate()
                .map(|(i, s)| ParamEntry {
                    name: s.name.clone(),
                    shape: s.shape.clone(),
                    start: s.range.start,
                    len: s.range.len(),
                    dtype: dtype_name(self.precision()).into(),
                    slice: self.placement.slot_slice(i),
                })
                .collect(),
            ranks,
            rng_states,
            model_weights: Some(model_weights),
            variables_file: Some(file_name),
            stage_variables_files: Vec::new(),
            pipeline_stages: 0,
            tensor_parallel: 0,
            outer_state_file,
            rank_state_files,
            buffers: buffer_entries,
            frozen: frozen_entries,
            frozen_excluded: !with_frozen,
            config: self.config.to_value(),
        }))
    }
}

/// A fresh staging folder for a checkpoint in `dir` (a stale one from an interrupted save is removed).
pub(crate) fn prepare_staging(dir: &Path, staging: &Path) -> Result<()> {
    let io = |p: &Path, e: std::io::Error| CheckpointError::Io { path: p.to_path_buf(), what: e.to_string() };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    if staging.exists() {
        std::fs::remove_dir_all(staging).map_err(|e| io(staging, e))?;
    }
    std::fs::create_dir(staging).map_err(|e| io(staging, e))?;
    Ok(())
}

/// Writes the manifest into the complete staging folder, puts the folder in place as `dir/<tag>` and points
/// `dir/latest` at it: until the last rename, the previous checkpoint and `latest` are untouched.
pub(crate) fn publish(dir: &Path, staging: &Path, tag: &str, manifest: &Manifest) -> Result<()> {
    manifest.write(&staging.join("manifest.json"))?;
    files::sync_dir(staging)?;
    let target = dir.join(tag);
    let io = |p: &Path, e: std::io::Error| CheckpointError::Io { path: p.to_path_buf(), what: e.to_string() };
    if target.exists() {
        let old = dir.join(format!(".{tag}.old"));
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&target, &old).map_err(|e| io(&target, e))?;
        std::fs::rename(staging, &target).map_err(|e| io(staging, e))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        std::fs::rename(staging, &target).map_err(|e| io(staging, e))?;
    }
    files::sync_dir(dir)?;
    files::write_atomic(&dir.join("latest"), tag.as_bytes())?;
    Ok(())
}
