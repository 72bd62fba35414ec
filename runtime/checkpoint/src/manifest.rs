//! The manifest: what a checkpoint holds and where.
use std::path::Path;

use serde::{Deserialize, Serialize};
use zerorun_optim::LossScalerState;

use super::{files, io_err, CheckpointError, Result};

/// Bumped when the layout of checkpoints changes; a newer version is refused with a clear error.
/// 2: rank files hold a list of flat ranges (stage 3 shards: one chunk per unit); version 1 files still load.
/// 3: buffers and frozen parameters are saved (`variables_file`); versions 1-2 load with the model's own.
/// A parameter may have several entries, each a slice of it (`ParamEntry::slice`, tensor parallelism); readers
/// that do not know slices see only a checkpoint saved without tensor parallelism, so the version stays 3.
pub const FORMAT_VERSION: u32 = 3;

/// Where a saved entry sits in its parameter's whole tensor: elements `start..start + len` of dimension `dim`
/// (whose whole extent is `full`), every index of the other dimensions. Tensor parallelism saves each rank's
/// slice so; a checkpoint loads at any tensor-parallel degree by reading the overlaps of slices. A layer that
/// padded the tensor to split it evenly (a vocabulary) saves slices that reach past `full`: those elements are
/// padding, which readers skip (consolidation writes `full`) and fill with zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    /// The dimension cut.
    pub dim: usize,
    /// Where this slice starts along it.
    pub start: i64,
    /// The whole tensor's size along it.
    pub full: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
/// A trainable parameter of the checkpoint: its name, shape and place in the flat layout.
pub struct ParamEntry {
    /// The variable's name in the VarStore.
    pub name: String,
    /// Its shape (a slice's own shape when saved in slices).
    pub shape: Vec<i64>,
    /// Flat element range in this checkpoint's layout.
    pub start: usize,
    /// Elements.
    pub len: usize,
    /// The model's dtype when saved ("F32", "BF16", "F16"); values in the rank files are the fp32 master.
    #[serde(default)]
    pub dtype: String,
    /// This entry is a slice of the parameter (`shape` is the slice's); None: the whole parameter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slice: Option<Slice>,
}

impl ParamEntry {
    /// The whole parameter's shape.
    pub fn full_shape(&self) -> Vec<i64> {
        let mut shape = self.shape.clone();
        if let Some(s) = self.slice {
            shape[s.dim] = s.full;
        }
        shape
    }

    /// The box this entry covers in the whole parameter, one index range per dimension.
    pub fn region(&self) -> Vec<std::ops::Range<i64>> {
        region_of(&self.shape, self.slice)
    }
}

/// The box a tensor of `shape` covers in its whole tensor when it is `slice` of it (or the whole).
pub fn region_of(shape: &[i64], slice: Option<Slice>) -> Vec<std::ops::Range<i64>> {
    shape
        .iter()
        .enumerate()
        .map(|(d, &n)| match slice {
            Some(s) if s.dim == d => s.start..s.start + n,
            _ => 0..n,
        })
        .collect()
}

/// A variable saved whole once, outside the rank files: a buffer or a frozen parameter, in its own dtype.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VariableEntry {
    /// The variable's name in the VarStore.
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// safetensors' dtype name ("F32", "I64", ...).
    pub dtype: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
/// One rank's file: which flat elements it holds and their checksum.
pub struct RankEntry {
    /// The file's name, inside the tag's folder.
    pub file: String,
    /// The first and last flat element this file covers (version 1: the one range it holds).
    pub start: usize,
    /// One past the last flat element this file covers.
    pub end: usize,
    /// The flat element ranges this file holds, concatenated in this order (`params` and every state buffer
    /// cover them). Empty in version 1: `start..end`.
    #[serde(default)]
    pub ranges: Vec<[usize; 2]>,
    /// CRC-32 of the file.
    pub crc32: u32,
}

impl RankEntry {
    /// An entry for `file` holding `ranges` (in order), with its CRC.
    pub fn new(file: String, ranges: &[std::ops::Range<usize>], crc32: u32) -> Self {
        RankEntry {
            file,
            start: ranges.first().map_or(0, |r| r.start),
            end: ranges.last().map_or(0, |r| r.end),
            ranges: ranges.iter().map(|r| [r.start, r.end]).collect(),
            crc32,
        }
    }

    /// The flat ranges of the file, in file order.
    pub fn pieces(&self) -> Vec<std::ops::Range<usize>> {
        if self.ranges.is_empty() {
            std::iter::once(self.start..self.end).collect()
        } else {
            self.ranges.iter().map(|r| r[0]..r[1]).collect()
        }
    }
}

/// Where part of a flat range lives: in rank file `entry`, elements `file_range` of its tensors, to go to
/// `dst_offset` of the wanted range.
#[derive(Debug, Clone, PartialEq)]
pub struct Located {
    /// The rank file (index into `Manifest::ranks`).
    pub entry: usize,
    /// Elements of its tensors.
    pub file_range: std::ops::Range<usize>,
    /// Where they go in the range asked for.
    pub dst_offset: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
/// A checkpoint's table of contents (`manifest.json`): what was saved, by whom, and where each element is.
pub struct Manifest {
    /// The layout's version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// The tag (`global_step8`, or the caller's).
    pub tag: String,
    /// Optimizer steps taken.
    pub global_steps: u64,
    /// Samples trained on over all ranks (the data cursor).
    pub global_samples: u64,
    /// Steps skipped for fp16 overflow.
    pub skipped_steps: u64,
    /// The optimizer's own step count (bias correction).
    pub optimizer_steps: u64,
    /// The optimizer's name.
    pub optimizer: String,
    /// Optimizer state buffers, stored as tensors of these names in every rank file.
    pub state_names: Vec<String>,
    /// The LR schedule's position.
    pub scheduler_last_batch_iteration: Option<i64>,
    /// fp16's loss scaler, when used.
    pub loss_scaler: Option<LossScalerState>,
    /// Data-parallel ranks that saved it.
    pub world_size: usize,
    /// The ZeRO stage that saved it.
    pub stage: u8,
    /// The model's dtype ("fp32", "bf16", "fp16").
    pub precision: String,
    /// Real (unpadded) parameter elements.
    pub numel: usize,
    /// Every trainable parameter.
    pub params: Vec<ParamEntry>,
    /// Every rank's file.
    pub ranks: Vec<RankEntry>,
    /// libtorch's CPU generator state of every rank, hex (restored when resuming at the same world size).
    #[serde(default)]
    pub rng_states: Vec<String>,
    /// `model.safetensors` in the tag folder: every parameter in the model's dtype by name, or why it is absent
    /// (stage 3 without `stage3_gather_16bit_weights_on_model_save`).
    #[serde(default)]
    pub model_weights: Option<String>,
    /// The file in the tag folder holding `buffers` and `frozen` by name (`model.safetensors` when that holds
    /// the whole model, else `variables.safetensors`); None before format 3.
    #[serde(default)]
    pub variables_file: Option<String>,
    /// A pipeline's later stages' files of buffers and frozen parameters (each stage saves its own; the first
    /// stage's is `variables_file`). A variable is read from whichever file holds it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_variables_files: Vec<String>,
    /// Pipeline stages of the run that saved it (0: none); the values are one flat space whatever the cut.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pipeline_stages: usize,
    /// Tensor-parallel degree of the run that saved it (0: none); its sliced parameters have an entry per slice.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tensor_parallel: usize,
    /// DiLoCo's outer optimizer state (`async_training`): the anchor and the momentum by parameter name
    /// (`anchor/<name>`, `momentum/<name>`, fp32), in this file of the tag folder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outer_state_file: Option<String>,
    /// The 1-bit optimizers' per-rank state (error feedback, 0/1 Adam's schedule), one file per rank of the run that
    /// saved it, by rank: each rank's own, restored at the same world size.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_state_files: Vec<String>,
    /// The model's buffers (BatchNorm's running statistics), rank 0's.
    #[serde(default)]
    pub buffers: Vec<VariableEntry>,
    /// The frozen parameters (empty when saved with `exclude_frozen_parameters`).
    #[serde(default)]
    pub frozen: Vec<VariableEntry>,
    /// Whether frozen parameters were left out on purpose (`SaveOptions::exclude_frozen_parameters`).
    #[serde(default)]
    pub frozen_excluded: bool,
    /// The resolved config of the run that saved it.
    pub config: serde_json::Value,
}

/// Appends the entries of `more` whose names `to` lacks.
fn add_new(to: &mut Vec<VariableEntry>, more: &[VariableEntry]) {
    for v in more {
        if !to.iter().any(|e| e.name == v.name) {
            to.push(v.clone());
        }
    }
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl Manifest {
    /// One manifest for a pipeline's stages (each saved by its stage's engine, in stage order): the stages' flat
    /// spaces laid end to end, so every parameter keeps one range and the checkpoint loads at any cut, any
    /// data-parallel degree, or without a pipeline. Counters come from the first stage (every stage steps
    /// together); generator states are left out (a stage's engine numbers its ranks within its stage).
    pub fn merge_stages(stages: Vec<Manifest>, world_size: usize) -> Manifest {
        let pipeline_stages = stages.len();
        let mut merged = Self::merge_parts(stages, world_size);
        merged.pipeline_stages = pipeline_stages;
        merged.model_weights = Some(
            "absent: a pipeline's stages save their own weights; `zerorun consolidate` assembles them from the rank files"
                .into(),
        );
        merged
    }

    /// One manifest for the parts of a tensor-parallel group (each saved by its engine, in tensor-parallel rank
    /// order, with the slices it holds): their flat spaces end to end; a sliced parameter keeps every part's slice,
    /// one replicated on every part (a norm, a bias added after the sum) keeps the first part's copy.
    pub fn merge_tensor_parallel(parts: Vec<Manifest>, world_size: usize) -> Manifest {
        let degree = parts.len();
        let mut merged = Self::merge_parts(parts, world_size);
        merged.tensor_parallel = degree;
        merged.model_weights = Some(
            "absent: each tensor-parallel rank holds slices; `zerorun consolidate` assembles the whole tensors from the rank files"
                .into(),
        );
        merged
    }

    /// Parts' manifests laid end to end in one flat space. A parameter entry that is whole (no slice) and a
    /// variable are kept once, from the first part that has them; slices are all kept.
    fn merge_parts(parts: Vec<Manifest>, world_size: usize) -> Manifest {
        let mut parts = parts.into_iter();
        let mut merged = parts.next().expect("at least one part");
        let extent = |m: &Manifest| {
            let ranks = m.ranks.iter().flat_map(RankEntry::pieces).map(|r| r.end).max().unwrap_or(0);
            let params = m.params.iter().map(|p| p.start + p.len).max().unwrap_or(0);
            ranks.max(params)
        };
        let mut base = extent(&merged);
        for m in parts {
            for p in &m.params {
                if p.slice.is_some() || merged.param(&p.name).is_none() {
                    merged.numel += p.len;
                    merged.params.push(ParamEntry { start: p.start + base, ..p.clone() });
                }
            }
            merged.ranks.extend(m.ranks.iter().map(|r| {
                let pieces: Vec<std::ops::Range<usize>> =
                    r.pieces().into_iter().map(|x| x.start + base..x.end + base).collect();
                RankEntry::new(r.file.clone(), &pieces, r.crc32)
            }));
            merged.stage_variables_files.extend(m.variables_file.clone());
            add_new(&mut merged.buffers, &m.buffers);
            add_new(&mut merged.frozen, &m.frozen);
            merged.frozen_excluded |= m.frozen_excluded;
            base += extent(&m);
        }
        merged.world_size = world_size;
        merged.rng_states.clear();
        merged
    }

    /// The parameters' names, each once, in entry order.
    pub fn param_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for p in &self.params {
            if !names.contains(&p.name.as_str()) {
                names.push(&p.name);
            }
        }
        names
    }

    /// Every entry of parameter `name` (several when it was saved in slices).
    pub fn entries<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a ParamEntry> + 'a {
        self.params.iter().filter(move |p| p.name == name)
    }

    /// Every file of buffers and frozen parameters, in the order to search them.
    pub fn variables_files(&self) -> Vec<&str> {
        self.variables_file.iter().chain(&self.stage_variables_files).map(String::as_str).collect()
    }

    /// The pieces of flat range `want` held by the rank files (elements no file holds, padding, are absent).
    pub fn locate(&self, want: std::ops::Range<usize>) -> Vec<Located> {
        let mut out = Vec::new();
        for (entry, r) in self.ranks.iter().enumerate() {
            let mut file_offset = 0;
            for piece in r.pieces() {
                let (lo, hi) = (piece.start.max(want.start), piece.end.min(want.end));
                if lo < hi {
                    let at = file_offset + (lo - piece.start);
                    out.push(Located { entry, file_range: at..at + (hi - lo), dst_offset: lo - want.start });
                }
                file_offset += piece.len();
            }
        }
        out
    }

    /// The entry of parameter `name`.
    pub fn param(&self, name: &str) -> Option<&ParamEntry> {
        self.params.iter().find(|p| p.name == name)
    }

    /// Reads `manifest.json` at `path`.
    pub fn read(path: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CheckpointError::Missing { path: path.to_path_buf(), what: e.to_string() })?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| io_err(path, format!("not valid JSON: {e}")))?;
        let found = v.get("format_version").and_then(|x| x.as_u64()).unwrap_or(0) as u32;
        if found > FORMAT_VERSION {
            return Err(CheckpointError::NewerFormat { path: path.to_path_buf(), found, supported: FORMAT_VERSION });
        }
        serde_json::from_value(v).map_err(|e| io_err(path, format!("not a zerorun manifest: {e}")))
    }

    /// Writes it to `path` atomically (a temporary file, then a rename).
    pub fn write(&self, path: &Path) -> Result<()> {
        files::write_atomic(path, serde_json::to_string_pretty(self).expect("manifest serializes").as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manifest of two ranks with these parameters and rank files, everything else empty.
    fn manifest(numel: usize, params: Vec<ParamEntry>, ranks: Vec<RankEntry>) -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            tag: "t".into(),
            global_steps: 0,
            global_samples: 0,
            skipped_steps: 0,
            optimizer_steps: 0,
            optimizer: "adamw".into(),
            state_names: vec![],
            scheduler_last_batch_iteration: None,
            loss_scaler: None,
            world_size: 2,
            stage: 0,
            precision: "fp32".into(),
            numel,
            params,
            ranks,
            rng_states: vec![],
            model_weights: None,
            variables_file: None,
            stage_variables_files: vec![],
            pipeline_stages: 0,
            tensor_parallel: 0,
            outer_state_file: None,
            rank_state_files: vec![],
            buffers: vec![],
            frozen: vec![],
            frozen_excluded: false,
            config: serde_json::Value::Null,
        }
    }

    #[test]
    fn locate_walks_the_ranges_of_every_file_in_order() {
        // Two units 0..10 and 10..14, chunks of 5 and 2.
        let m = Manifest {
            stage: 3,
            ..manifest(
                14,
                vec![],
                vec![
                    RankEntry::new("rank0".into(), &[0..5, 10..12], 0),
                    RankEntry::new("rank1".into(), &[5..10, 12..14], 0),
                ],
            )
        };
        let got = m.locate(4..13);
        assert_eq!(
            got,
            vec![
                Located { entry: 0, file_range: 4..5, dst_offset: 0 },
                Located { entry: 0, file_range: 5..7, dst_offset: 6 },
                Located { entry: 1, file_range: 0..5, dst_offset: 1 },
                Located { entry: 1, file_range: 5..6, dst_offset: 8 },
            ]
        );
        // Version 1 entries: one range from start and end.
        let v1: RankEntry =
            serde_json::from_str(r#"{"file": "rank0.safetensors", "start": 3, "end": 9, "crc32": 1}"#).unwrap();
        assert_eq!(v1.pieces(), vec![3..9]);
    }

    #[test]
    fn stages_merge_into_one_flat_space() {
        let stage = |names: &[&str], ranks: Vec<RankEntry>, file: &str| {
            let params = names
                .iter()
                .enumerate()
                .map(|(i, n)| ParamEntry {
                    name: n.to_string(),
                    shape: vec![6],
                    start: 6 * i,
                    len: 6,
                    dtype: "F32".into(),
                    slice: None,
                })
                .collect();
            Manifest {
                stage: 1,
                rng_states: vec!["00".into()],
                model_weights: Some("model.safetensors".into()),
                variables_file: Some(file.into()),
                ..manifest(6 * names.len(), params, ranks)
            }
        };
        // Stage 0: a and b over two data-parallel ranks, padded to 14; stage 1: c on one rank.
        let s0 = stage(
            &["a", "b"],
            vec![
                RankEntry::new("s0.r0".into(), std::slice::from_ref(&(0..7)), 1),
                RankEntry::new("s0.r1".into(), std::slice::from_ref(&(7..14)), 2),
            ],
            "s0.v",
        );
        let s1 = stage(&["c"], vec![RankEntry::new("s1.r0".into(), std::slice::from_ref(&(0..6)), 3)], "s1.v");
        let m = Manifest::merge_stages(vec![s0, s1], 3);
        assert_eq!(m.param("c").unwrap().start, 14);
        assert_eq!(m.ranks[2].pieces(), vec![14..20]);
        assert_eq!(m.numel, 18);
        assert_eq!((m.world_size, m.pipeline_stages), (3, 2));
        assert_eq!(m.variables_files(), vec!["s0.v", "s1.v"]);
        assert!(m.rng_states.is_empty());
        // `c` is read from the second stage's file, from its start.
        assert_eq!(m.locate(14..20), vec![Located { entry: 2, file_range: 0..6, dst_offset: 0 }]);
    }
}
