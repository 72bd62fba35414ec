//! The runs with model parallelism: tensor parallelism alone, and pipeline stages (with tensor parallelism inside
//! them or not). A data-parallel run is the main module's.
use std::time::Duration;

use tch::{Kind, Tensor};
use zerorun::runtime::tensor_parallel::TensorParallel;
use zerorun::{Dim, EngineOptions, Mesh, MeshOptions, MicroBatch, StagePlacement};

use super::rows::Rows;
use super::support::llama_model::{self, LlamaConfig};
use super::support::*;
use super::Args;

/// What a pipeline or tensor-parallel run reads.
pub(super) struct Run<'a> {
    pub(super) args: &'a Args,
    pub(super) config: &'a zerorun::Config,
    pub(super) model: &'a LlamaConfig,
    pub(super) rows: Option<&'a Rows>,
    pub(super) kind: Kind,
    pub(super) max_shard_bytes: u64,
}

impl Run<'_> {
    /// This data-parallel rank's micro-batch `m` of step `step` (0-based), by the data contract.
    fn micro_batch(&self, b: zerorun::config::BatchSizes, step: u64, m: u64, data: (usize, usize)) -> (Tensor, Tensor) {
        let (global, micro) = (b.train_batch_size, b.train_micro_batch_size_per_gpu);
        let base = step * global + data.0 as u64 * (global / data.1 as u64);
        self.rows.expect("opened when steps run").batch(base + m * micro, micro)
    }

    /// `--tensor-parallel T` without pipeline stages: groups of T adjacent ranks split every layer; each rank's
    /// engine runs ZeRO over the ranks at its position in the other groups.
    pub(super) fn tensor_parallel(&self, t: usize) -> Result<(), String> {
        let a = &self.args.common;
        let timeout = Duration::from_secs_f64(self.config.comms_timeout);
        let summary = run_ranks(a.ranks, timeout, |comm| {
            let options = MeshOptions { tensor_parallel: Some(t), ..Default::default() };
            let mesh = Mesh::from_config(comm, self.config, options).map_err(|e| e.to_string())?;
            let rank = mesh.rank();
            let data = (mesh.coordinate(Dim::Shard), mesh.shape().data());
            let tp = mesh.tensor_parallel().map_err(|e| e.to_string())?;
            let (mut vs, model) =
                build_model(a.seed, None, |vs| llama_model::tp::TpLlama::new(&vs.root(), &tp, self.model))?;
            self.load(&vs, Some(&tp))?;
            to_config_precision(self.config, &mut vs);
            let options = EngineOptions { activation_checkpointing: a.activation_checkpointing, ..Default::default() }
                .units_of(&model);
            let mut engine =
                zerorun::initialize_with(&vs, self.config.clone(), mesh, options).map_err(|e| e.to_string())?;
            let b = engine.batch_sizes();
            let mut progress = Progress::new(a.steps).in_tokens(self.args.seq_len);
            let first = resume(a, &mut engine)?;
            for step in first..a.steps {
                for m in 0..b.gradient_accumulation_steps {
                    let (x, y) = self.micro_batch(b, step, m, data);
                    let logits = engine.forward(&model, &x).map_err(|e| e.to_string())?;
                    let loss = llama_model::tp::loss(&tp, self.model, &logits, &y).map_err(|e| e.to_string())?;
                    engine.backward_units(&model, &loss).map_err(|e| e.to_string())?;
                    let outcome = engine.step().map_err(|e| e.to_string())?;
                    progress.record_for(rank == 0, b.train_batch_size, outcome);
                    maybe_save(a, &mut engine, outcome)?;
                }
            }
            engine.finish().map_err(|e| e.to_string())?;
            if self.args.save_hf.is_some() {
                let whole = whole_parameters(&tp, engine.full_parameters().map_err(|e| e.to_string())?)?;
                self.write_hf(&whole, rank)?;
            }
            finish_reports(&mut engine)?;
            Ok((progress.first_loss.unwrap_or(f64::NAN), progress.last_loss, progress.median_step_s()))
        })?;
        let Some((first, last, median)) = summary else { return Ok(()) };
        println!("median_step_s {median:.4}");
        println!(
            "summary: Llama {} layers x {} hidden, tensor parallel {t}, ZeRO stage {}, {} optimizer steps, loss {first:.4} -> {last:.4}",
            self.model.num_hidden_layers,
            self.model.hidden_size,
            self.config.stage(),
            a.steps
        );
        Ok(())
    }

    /// `--pipeline-stages P` (with `--tensor-parallel T` inside each stage): each rank builds and trains only its
    /// stage's layers.
    pub(super) fn pipeline(&self, stages: usize) -> Result<(), String> {
        let a = &self.args.common;
        if a.activation_checkpointing {
            return Err("--pipeline-stages runs without --activation-checkpointing (stage 3's)".into());
        }
        if self.model.tie_word_embeddings {
            return Err("--pipeline-stages: tied embeddings are not supported (the embedding and the head sit on different stages)".into());
        }
        let timeout = Duration::from_secs_f64(self.config.comms_timeout);
        let summary = run_ranks(a.ranks, timeout, |comm| {
            let options = MeshOptions { pipeline_stages: Some(stages), tensor_parallel: self.args.tensor_parallel };
            let mesh = Mesh::from_config(comm, self.config, options).map_err(|e| e.to_string())?;
            let placement = StagePlacement::of(&mesh, &self.config.pipeline);
            let tp = match self.args.tensor_parallel {
                Some(_) => Some(mesh.tensor_parallel().map_err(|e| e.to_string())?),
                None => None,
            };
            let model = match &tp {
                Some(tp) => llama_model::tp::pipeline_model(self.model, tp),
                None => llama_model::pipeline_model(self.model),
            };
            let partition = &self.config.pipeline.partition;
            let (mut vs, stage) = build_model(a.seed, None, |vs| model.build_stage(vs, &placement, partition))?;
            let stage = stage.map_err(|e| e.to_string())?;
            self.load(&vs, tp.as_ref())?;
            to_config_precision(self.config, &mut vs);
            let mut pipe =
                zerorun::initialize_pipeline(&vs, self.config.clone(), mesh, stage, EngineOptions::default())
                    .map_err(|e| e.to_string())?;
            let b = pipe.engine().batch_sizes();
            let (first, last) = (placement.takes_inputs(), placement.takes_labels());
            let data = (placement.data_index, placement.data_parallel);
            let mut progress = Progress::new(a.steps).in_tokens(self.args.seq_len);
            let world = placement.stages * placement.data_parallel * self.args.tensor_parallel.unwrap_or(1);
            let first_step = resume_with(a, placement.rank == 0, world, |dir| {
                pipe.load_checkpoint(dir, None).map_err(|e| e.to_string())?;
                Ok(pipe.engine().global_steps())
            })?;
            for step in first_step..a.steps {
                let mut micro_batches = (0..b.gradient_accumulation_steps).map(|m| {
                    let (x, y) = self.micro_batch(b, step, m, data);
                    MicroBatch { inputs: first.then_some(x), labels: last.then_some(y) }
                });
                let outcome = pipe.train_batch(&mut micro_batches).map_err(|e| e.to_string())?;
                progress.record_for(placement.rank == 0, b.train_batch_size, outcome);
                if let (Some(dir), Some(every)) = (&a.checkpoint_dir, a.save_every) {
                    if (step + 1) % every == 0 {
                        pipe.save_checkpoint(dir, None).map_err(|e| e.to_string())?;
                    }
                }
            }
            pipe.finish().map_err(|e| e.to_string())?;
            if self.args.save_hf.is_some() {
                // Stage 0's ranks receive every stage's parameters; their tensor-parallel groups make them whole.
                let params = pipe.full_parameters().map_err(|e| e.to_string())?;
                let params = match &tp {
                    Some(tp) if placement.stage == 0 => whole_parameters(tp, params)?,
                    _ => params,
                };
                self.write_hf(&params, placement.rank)?;
            }
            println!("peak_rss_bytes {}", zerorun::runtime::report::memory::rss().1);
            Ok((progress.first_loss.unwrap_or(f64::NAN), progress.last_loss, progress.median_step_s()))
        })?;
        let Some((first, last, median)) = summary else { return Ok(()) };
        println!("median_step_s {median:.4}");
        println!(
            "summary: Llama {} layers x {} hidden, {stages} pipeline stages, tensor parallel {}, ZeRO stage {} per stage, {} optimizer steps, loss {first:.4} -> {last:.4}",
            self.model.num_hidden_layers,
            self.model.hidden_size,
            self.args.tensor_parallel.unwrap_or(1),
            self.config.stage(),
            a.steps
        );
        Ok(())
    }
}

/// Every parameter whole: the tensor-parallel slices gathered along the dimension they split, padding left out.
/// Collective over the group.
fn whole_parameters(tp: &TensorParallel, params: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>, String> {
    params
        .into_iter()
        .map(|(name, p)| tp.gather_whole(&name, &p).map(|w| (name, w)).map_err(|e| e.to_string()))
        .collect()
}
