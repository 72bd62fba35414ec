//! The engine's state in the checkpoint format of [`crate::checkpoint`]: `save.rs` writes it (atomically, with
//! checksums), `load.rs` reads it back at any world size; `save.rs` also gives full weights out of the engine
//! (`full_parameters`, `state_dict`, `save_16bit_model`). This file holds what they share: the options, the tag
//! rules, dtype names, variable entries.
pub(crate) mod background;
mod export;
mod load;
mod save;
pub use export::{write_pretrained, PretrainedOptions};
pub(crate) use save::{prepare_staging, publish};

use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use crate::checkpoint::files;
use crate::checkpoint::hf::WeightFiles;
use crate::checkpoint::{
    read_region, region_of, CheckpointError, Manifest, ParamEntry, RankEntry, SavedCheckpoint, Slice, VariableEntry,
    FORMAT_VERSION,
};
use crate::comm::{Collectives, Communicator, ReduceOp};
use crate::config::{Precision, TagValidation};
use crate::engine::device::views;
use crate::engine::zero::plan::{AfterStep, FlatRange, Optimized};
use crate::engine::{Engine, ParamSlot};
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

/// Variable `name` of a checkpoint's variables files, as a tensor of its saved dtype.
pub(super) fn read_saved_variable(files: &crate::checkpoint::VariableFiles, name: &str) -> Result<Tensor> {
    let (path, dtype, shape, bytes) = files.raw(name)?;
    tensor_of(path, name, &dtype, &shape, bytes)
}

/// Tensor `name` of weight files (a checkpoint's variables file, pretrained weights), as a tensor of its saved
/// dtype, and the file it is in.
pub(crate) fn read_variable<'a>(files: &'a WeightFiles, name: &str) -> Result<(&'a Path, Tensor)> {
    let (path, dtype, shape, bytes) = files.raw(name)?;
    Ok((path, tensor_of(path, name, &dtype, &shape, bytes)?))
}

/// Gives variable `var` (named `name`) the values of tensor `name` of `files`, converted to its dtype; another
/// shape is an error naming the file and the tensor.
pub(crate) fn load_variable(files: &WeightFiles, name: &str, var: &Tensor) -> Result<()> {
    let (path, value) = read_variable(files, name)?;
    fill_variable(name, var, &value, file_mismatch(path))
}

/// A saved tensor's bytes as a tensor of its dtype (`path` names the file in errors).
fn tensor_of(path: &Path, name: &str, dtype: &str, shape: &[usize], bytes: &[u8]) -> Result<Tensor> {
    let kind = kind_of_dtype(dtype).ok_or_else(|| CheckpointError::Io {
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
    if crate::engine::device::native::storage_nbytes(dst) < bytes {
        crate::engine::device::native::resize_storage(dst, bytes)?;
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
/// `part`: the model is a part of the checkpoint's (a pipeline stage), so the checkpoint's other variables are
/// expected.
fn variable_problems(role: &str, ours: &[(String, Vec<i64>)], theirs: &[VariableEntry], part: bool) -> Vec<String> {
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
    for e in theirs.iter().filter(|e| !part && !ours.iter().any(|(n, _)| n == &e.name)) {
        problems.push(format!("checkpoint {role} `{}` {:?} is not in the model", e.name, e.shape));
    }
    problems
}

/// Loads every variable of `vs` from the safetensors weights at `path` (pretrained weights, `save_16bit_model`'s
/// or `zerorun consolidate`'s output; a Hugging Face model folder or its sharded index too, see
/// [`WeightFiles::open`]), one tensor at a time from the memory-mapped files, so they are never read whole into
/// memory (`VarStore::load` reads a file all first). Values convert to each variable's dtype; a variable missing
/// from the files or of another shape is an error naming it and the file. Call it before `initialize`.
pub fn load_mapped(vs: &tch::nn::VarStore, path: impl AsRef<Path>) -> Result<()> {
    let files = WeightFiles::open(path.as_ref())?;
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, var) in vars {
        load_variable(&files, &name, &var)?;
    }
    Ok(())
}

/// [`load_mapped`] for member `rank` of a tensor-parallel group of `size`: a parameter `placements` splits is cut
/// from the file's whole tensor (this rank's part along that dimension, evenly in rank order; a padded parameter's
/// rows past its true size are zeros), the others are read whole. So a run at any tensor-parallel degree starts
/// from the whole weights a run at degree 1 (or `zerorun consolidate`, or `TensorParallel::gather_whole`) wrote.
/// Call it before `initialize`, with the group's placements (`tp.placements()`).
pub fn load_mapped_slices(
    vs: &tch::nn::VarStore,
    path: impl AsRef<Path>,
    rank: usize,
    size: usize,
    placements: &crate::tensor_parallel::Placements,
) -> Result<()> {
    let files = WeightFiles::open(path.as_ref())?;
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, var) in vars {
        let (path, whole) = read_variable(&files, &name)?;
        let part = match placements.get(&name) {
            Some(split) if split.dim < var.dim() && whole.dim() == var.dim() => {
                let (d, n) = (split.dim, var.size()[split.dim]);
                let extent = split.whole.unwrap_or(n * size as i64);
                if whole.size()[d] != extent {
                    let mut wanted = var.size();
                    wanted[d] = extent;
                    return Err(file_mismatch(path)(&name, whole.size(), wanted));
                }
                let start = rank as i64 * n;
                let held = (extent - start).clamp(0, n);
                let part = whole.narrow(d as i64, start.min(extent), held);
                if held < n {
                    let mut pad = var.size();
                    pad[d] = n - held;
                    Tensor::cat(&[part, Tensor::zeros(pad.as_slice(), (whole.kind(), whole.device()))], d as i64)
                } else {
                    part
                }
            }
            Some(split) => {
                let mut wanted = var.size();
                if split.dim < wanted.len() {
                    wanted[split.dim] = split.whole.unwrap_or(wanted[split.dim] * size as i64);
                }
                return Err(file_mismatch(path)(&name, whole.size(), wanted));
            }
            None => whole,
        };
        fill_variable(&name, &var, &part, file_mismatch(path))?;
    }
    Ok(())
}

/// `checkpoint.tag_validation`: the ranks of `comm` compare their tags (a hash each, all-reduced) before anything
/// is written. Tags that differ are an error on every rank under "Fail", a warning under "Warn" (the default) and
/// nothing under "Ignore"; the checkpoint then takes rank 0's tag, so it stays one directory.
fn agree_on_tag(comm: &dyn Communicator, validation: TagValidation, tag: String) -> Result<String> {
    if comm.world_size() == 1 {
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
    comm.all_reduce(&mut extremes, ReduceOp::Max)?;
    if extremes[0] == extremes[1].wrapping_neg() {
        return Ok(tag);
    }
    let mut len = [tag.len() as i64];
    comm.broadcast(&mut len, 0)?;
    let mut words = vec![0i64; (len[0] as usize).div_ceil(8)];
    if comm.rank() == 0 {
        bytemuck::cast_slice_mut::<i64, u8>(&mut words)[..tag.len()].copy_from_slice(tag.as_bytes());
    }
    comm.broadcast(&mut words, 0)?;
    let root = String::from_utf8_lossy(&bytemuck::cast_slice::<i64, u8>(&words)[..len[0] as usize]).into_owned();
    let rank = comm.rank();
    match validation {
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

pub(crate) fn check_tag(tag: &str) -> Result<()> {
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
