//! Hugging Face files: `--save-hf` from the engine (data-parallel runs) or from whole tensors a pipeline or
//! tensor-parallel run assembled, and `--hf`'s weights read by each rank.
use std::path::Path;

use tch::{nn, Kind, Tensor};
use zerorun::runtime::tensor_parallel::TensorParallel;
use zerorun::{Engine, PretrainedOptions};

use super::model_parallel::Run;
use super::support::llama_model::LlamaConfig;

/// `--save-hf OUT`: the weights as transformers writes them and the config.json (`--hf`'s, or this shape's).
pub(super) fn save_hf(
    engine: &mut Engine,
    hf: Option<&Path>,
    c: &LlamaConfig,
    out: &Path,
    kind: Kind,
    max_shard_bytes: u64,
) -> Result<(), String> {
    let at = |e: String| format!("--save-hf {}: {e}", out.display());
    let source = match hf {
        Some(dir) => dir.join("config.json"),
        None => {
            // This shape's config.json, written first; save_pretrained sets its dtype.
            let path = out.join("config.json");
            if engine.rank() == 0 {
                std::fs::create_dir_all(out).map_err(|e| at(e.to_string()))?;
                let text = serde_json::to_string_pretty(&c.to_json()).expect("config serializes");
                std::fs::write(&path, text).map_err(|e| at(e.to_string()))?;
            }
            path
        }
    };
    let options = PretrainedOptions { config: Some(&source), kind, max_shard_bytes };
    let files = engine.save_pretrained(out, &options).map_err(|e| at(e.to_string()))?;
    if engine.rank() == 0 {
        println!(
            "saved for transformers: {}",
            files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(())
}

impl Run<'_> {
    /// `--save-hf` of whole tensors assembled by the caller (rank 0 writes).
    pub(super) fn write_hf(&self, whole: &[(String, Tensor)], rank: usize) -> Result<(), String> {
        let Some(out) = &self.args.save_hf else { return Ok(()) };
        if rank != 0 {
            return Ok(());
        }
        let at = |e: String| format!("--save-hf {}: {e}", out.display());
        let source = match &self.args.hf {
            Some(dir) => dir.join("config.json"),
            None => {
                std::fs::create_dir_all(out).map_err(|e| at(e.to_string()))?;
                let path = out.join("config.json");
                let text = serde_json::to_string_pretty(&self.model.to_json()).expect("config serializes");
                std::fs::write(&path, text).map_err(|e| at(e.to_string()))?;
                path
            }
        };
        let options =
            PretrainedOptions { config: Some(&source), kind: self.kind, max_shard_bytes: self.max_shard_bytes };
        let files = zerorun::runtime::engine::write_pretrained(out, whole, &options).map_err(|e| at(e.to_string()))?;
        println!(
            "saved for transformers: {}",
            files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        );
        Ok(())
    }

    /// The starting weights: `--hf`'s, each rank cutting its slices (tensor parallel) or reading its stage's.
    pub(super) fn load(&self, vs: &nn::VarStore, tp: Option<&TensorParallel>) -> Result<(), String> {
        let Some(dir) = &self.args.hf else { return Ok(()) };
        let loaded = match tp {
            Some(tp) => zerorun::runtime::engine::load_mapped_slices(vs, dir, tp.rank(), tp.size(), tp.placements()),
            None => zerorun::runtime::engine::load_mapped(vs, dir),
        };
        loaded.map_err(|e| format!("--hf {}: {e}", dir.display()))
    }
}
