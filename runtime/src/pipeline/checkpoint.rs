//! A pipeline's checkpoints: each stage's engine writes its files (prefixed `stage{s}.`, and `tp{t}.` with tensor
//! parallelism) into one staging folder, a stage's tensor-parallel parts merge into the stage's manifest, the
//! stages' manifests go to rank 0, which merges them into one manifest over one flat space
//! ([`Manifest::merge_stages`]) and publishes the folder. The checkpoint is so by parameter name, like any other:
//! it loads into a pipeline of another cut or data-parallel degree (each stage reads the ranges of its own
//! parameters), into a plain engine, and into `zerorun consolidate`, with no conversion step.
use std::path::{Path, PathBuf};

use super::link::{recv_bytes, send_bytes};
use super::PipelineEngine;
use crate::checkpoint::{CheckpointError, Manifest};
use crate::engine::checkpointing::{check_tag, prepare_staging, publish};
use crate::error::Result;

impl PipelineEngine<'_> {
    /// Saves under `dir/<tag>/` (default tag `global_step{N}`) and points `dir/latest` at it once every stage's
    /// files are complete. Collective over every rank. Returns the checkpoint's folder.
    pub fn save_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<PathBuf> {
        let dir = dir.as_ref();
        let tag = tag.map_or_else(|| format!("global_step{}", self.engine.global_steps()), str::to_string);
        check_tag(&tag)?;
        // Every stage steps together, so every stage refuses (or quiesces) alike.
        self.engine.ready_for_checkpoint()?;
        let staging = dir.join(format!(".{tag}.partial"));
        if self.placement.rank == 0 {
            prepare_staging(dir, &staging)?;
        }
        self.mesh.world().barrier()?;
        let stage = self.placement.stage;
        let prefix = format!("stage{stage}.{}", self.engine.tensor_parallel_prefix());
        let part = self.engine.save_part(&staging, &prefix, &tag, true)?;
        // Each stage's (and tensor-parallel rank's) first data-parallel rank has its manifest; a stage's tensor-
        // parallel parts merge at its first tensor-parallel rank, and the stages form the pipeline of rank 0.
        let part = match part {
            Some(part) => self.engine.merge_tensor_parallel_parts(&staging, part)?,
            None => None,
        };
        if let Some(part) = part {
            let c = self.pipe.as_ref();
            if stage > 0 {
                send_bytes(c, &serde_json::to_vec(&part).expect("manifests serialize"), 0)?;
            } else {
                let mut parts = vec![part];
                for from in 1..self.placement.stages {
                    let bytes = recv_bytes(c, from)?;
                    parts.push(serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Io {
                        path: staging.clone(),
                        what: format!("stage {from}'s manifest: {e}"),
                    })?);
                }
                let merged = Manifest::merge_stages(parts, self.placement.world_size);
                publish(dir, &staging, &tag, &merged)?;
            }
        }
        self.mesh.world().barrier()?;
        tracing::info!(tag, step = self.engine.global_steps(), "pipeline checkpoint saved");
        Ok(dir.join(tag))
    }

    /// Loads `dir/<tag>` (default: `dir/latest`), saved by a pipeline of any cut and data-parallel degree or by a
    /// plain engine: each stage reads its own parameters' ranges, by name. Collective over every rank.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<String> {
        let tag = self.engine.load_checkpoint_part(dir.as_ref(), tag)?;
        // Replicas of tied weights take their owner's loaded value.
        self.exchange_tied_values()?;
        self.mesh.world().barrier()?;
        Ok(tag)
    }
}
