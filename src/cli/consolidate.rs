//! `zerorun consolidate CHECKPOINT_DIR OUT.safetensors [--tag TAG] [--dtype fp32|bf16]`: the whole model by
//! variable name from a sharded checkpoint (trainable parameters in `--dtype`, buffers and frozen parameters as
//! saved), tensor by tensor (memory bounded by the largest tensor): a file `VarStore::load` reads. With
//! `--hf-config DIR`, OUT is a Hugging Face model folder instead: `DIR/config.json` copied with its dtype set, and
//! `model.safetensors` (or shards past `--max-shard-size` and their index), which `from_pretrained(OUT)` loads.
use std::path::PathBuf;

use clap::Args;
use zerorun_checkpoint::{files, hf};
use zerorun_checkpoint::{read_region, region_of, CheckpointError, ParamEntry, SavedCheckpoint};

use super::{emit, CliError};

#[derive(Args)]
pub struct ConsolidateArgs {
    /// The folder given to save_checkpoint (holds `latest` and the tags).
    dir: PathBuf,
    /// Output safetensors file.
    out: PathBuf,
    /// Which checkpoint (default: the one `latest` names).
    #[arg(long)]
    tag: Option<String>,
    /// fp32 (the master weights, exact) or bf16.
    #[arg(long, default_value = "fp32")]
    dtype: String,
    /// Write OUT as a Hugging Face model folder, with this folder's config.json (the model's, as it came from the
    /// hub) beside the weights.
    #[arg(long, value_name = "DIR")]
    hf_config: Option<PathBuf>,
    /// With --hf-config: the largest weights file before sharding, as transformers' `max_shard_size` (5GB, 500MB,
    /// or bytes).
    #[arg(long, default_value = "5GB", value_parser = parse_size)]
    max_shard_size: u64,
}

/// `--max-shard-size`, as transformers reads it.
fn parse_size(text: &str) -> Result<u64, String> {
    hf::parse_size(text)
}

fn ck(e: CheckpointError) -> CliError {
    CliError::Usage(e.to_string())
}

pub fn run(a: ConsolidateArgs) -> Result<(), CliError> {
    let dtype = match a.dtype.as_str() {
        "fp32" => "F32",
        "bf16" => "BF16",
        other => return Err(CliError::Usage(format!("--dtype {other:?}: choose fp32 or bf16"))),
    };
    let saved = SavedCheckpoint::open(&a.dir, a.tag.as_deref()).map_err(ck)?;
    let m = &saved.manifest;
    // Verify and open every rank file once.
    let mut opened = Vec::with_capacity(m.ranks.len());
    for (i, r) in m.ranks.iter().enumerate() {
        opened.push((r, saved.rank_file(i).map_err(ck)?));
    }
    // Buffers and frozen parameters (format 3) are copied as saved, in their own dtypes, so the file is the
    // whole model: what `VarStore::load` of it reads.
    let variables = saved.variables_files().map_err(ck)?;
    let extras: Vec<&str> = m.buffers.iter().chain(&m.frozen).map(|e| e.name.as_str()).collect();
    // A parameter saved in slices (tensor parallelism) is one whole tensor here.
    let params: Vec<&ParamEntry> = m.param_names().into_iter().filter_map(|n| m.param(n)).collect();
    let mut tensors: Vec<(String, Vec<usize>, String)> = params
        .iter()
        .map(|p| (p.name.clone(), p.full_shape().iter().map(|&d| d as usize).collect(), dtype.to_string()))
        .collect();
    if !variables.is_empty() {
        for name in &extras {
            let (_, dt, shape, _) = variables.raw(name).map_err(ck)?;
            tensors.push((name.to_string(), shape, dt));
        }
    }
    let fill_tensor = |i: usize, w: &mut dyn std::io::Write| -> std::io::Result<()> {
        if i >= params.len() {
            let (_, _, _, bytes) =
                variables.raw(extras[i - params.len()]).map_err(|e| std::io::Error::other(e.to_string()))?;
            return w.write_all(bytes);
        }
        let p = params[i];
        let whole = region_of(&p.full_shape(), None);
        let buf = read_region(m, &saved.manifest_path(), &p.name, &whole, &mut |range, out| {
            for loc in m.locate(range) {
                let dst = loc.dst_offset..loc.dst_offset + loc.file_range.len();
                opened[loc.entry].1.read_f32("params", loc.file_range, &mut out[dst])?;
            }
            Ok(())
        })
        .map_err(|e| std::io::Error::other(e.to_string()))?;
        if dtype == "BF16" {
            let v: Vec<u16> = buf.iter().map(|x| half::bf16::from_f32(*x).to_bits()).collect();
            w.write_all(bytemuck::cast_slice(&v))
        } else {
            files::write_f32(w, &buf)
        }
    };
    let progress = std::cell::RefCell::new(super::progress::Progress::new("consolidate", tensors.len() as u64));
    let fill = |i: usize, w: &mut dyn std::io::Write| -> std::io::Result<()> {
        progress.borrow_mut().item(&tensors[i].0);
        let written = fill_tensor(i, w);
        progress.borrow_mut().done();
        written
    };
    match &a.hf_config {
        None => {
            files::write_safetensors_typed(&a.out, &tensors, fill).map_err(ck)?;
        }
        Some(config) => {
            let source = if config.is_dir() { config.join("config.json") } else { config.clone() };
            hf::write_config(&source, &a.out, dtype).map_err(ck)?;
            let mut writer = hf::ShardedWriter::create(&a.out, tensors.clone(), a.max_shard_size).map_err(ck)?;
            for i in 0..tensors.len() {
                writer.tensor(|w| fill(i, w)).map_err(ck)?;
            }
            writer.finish().map_err(ck)?;
        }
    }
    let excluded = if m.frozen_excluded { " (saved without frozen parameters)" } else { "" };
    emit(&format!(
        "{}: {} parameters ({} elements), {} buffers, {} frozen parameters{excluded} from {} ({} rank files, world size {}, stage {})",
        a.out.display(),
        params.len(),
        m.numel,
        m.buffers.len(),
        m.frozen.len(),
        saved.folder.display(),
        m.ranks.len(),
        m.world_size,
        m.stage
    ))
}
