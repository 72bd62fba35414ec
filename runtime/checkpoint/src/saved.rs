//! A saved checkpoint opened for reading: its folder (`dir/<tag>`, the tag defaulting to what `dir/latest`
//! names), its manifest, and its rank files, each checksummed against the manifest before it is mapped. The
//! engine's load and `zerorun consolidate` both read through it.
use std::path::{Path, PathBuf};

use crate::files::{self, MappedTensors};
use crate::{latest_tag, CheckpointError, Manifest, Result};

/// A checkpoint on disk, opened: its folder, tag and manifest, checked before anything is read.
pub struct SavedCheckpoint {
    /// Its tag.
    pub tag: String,
    /// `dir/<tag>`.
    pub folder: PathBuf,
    /// Its table of contents.
    pub manifest: Manifest,
}

impl SavedCheckpoint {
    /// Opens `dir/<tag>` (default: the tag `dir/latest` names) and reads its manifest.
    /// ```no_run
    /// # fn main() -> Result<(), zerorun_checkpoint::CheckpointError> {
    /// let saved = zerorun_checkpoint::SavedCheckpoint::open(std::path::Path::new("checkpoints"), None)?; // `latest`
    /// let m = &saved.manifest;
    /// println!("{}: step {}, saved by {} ranks at stage {}", saved.tag, m.global_steps, m.world_size, m.stage);
    /// # Ok(()) }
    /// ```
    pub fn open(dir: &Path, tag: Option<&str>) -> Result<SavedCheckpoint> {
        let tag = match tag {
            Some(t) => t.to_string(),
            None => latest_tag(dir)?,
        };
        let folder = dir.join(&tag);
        let manifest = Manifest::read(&folder.join("manifest.json"))?;
        Ok(SavedCheckpoint { tag, folder, manifest })
    }

    /// Every file of the checkpoint present and intact: each rank file's checksum against the manifest, the
    /// variables files readable. Reads the whole checkpoint once; the first fault is the error, naming its file.
    pub fn verify(&self) -> Result<()> {
        for i in 0..self.manifest.ranks.len() {
            self.rank_file(i)?;
        }
        self.variables_files().map(|_| ())
    }

    /// The checkpoints in `dir`, newest first: the tag `latest` names, then every other tag with a manifest by its
    /// step, highest first (staging folders of unfinished saves are not checkpoints).
    pub fn candidates(dir: &Path) -> Vec<String> {
        let latest = latest_tag(dir).ok();
        let mut tags: Vec<(u64, String)> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') || Some(&name) == latest.as_ref() {
                    return None;
                }
                let manifest = Manifest::read(&e.path().join("manifest.json")).ok()?;
                Some((manifest.global_steps, name))
            })
            .collect();
        tags.sort_by(|a, b| b.cmp(a));
        latest.into_iter().chain(tags.into_iter().map(|(_, t)| t)).collect()
    }

    /// The manifest's path, which errors about the checkpoint as a whole name.
    pub fn manifest_path(&self) -> PathBuf {
        self.folder.join("manifest.json")
    }

    /// Rank file `entry` of the manifest, its checksum verified, mapped.
    pub fn rank_file(&self, entry: usize) -> Result<MappedTensors> {
        let e = &self.manifest.ranks[entry];
        let path = self.folder.join(&e.file);
        let crc = files::crc_of(&path)?;
        if crc != e.crc32 {
            return Err(CheckpointError::Checksum { path, expected: e.crc32, actual: crc });
        }
        MappedTensors::open(&path)
    }

    /// The files of buffers and frozen parameters (format 3; a pipeline's: one per stage), mapped.
    pub fn variables_files(&self) -> Result<VariableFiles> {
        let files = self
            .manifest
            .variables_files()
            .into_iter()
            .map(|name| {
                let path = self.folder.join(name);
                MappedTensors::open(&path).map(|f| (path, f))
            })
            .collect::<Result<_>>()?;
        Ok(VariableFiles { files })
    }
}

/// A checkpoint's files of buffers and frozen parameters, searched in order for a variable's name.
pub struct VariableFiles {
    files: Vec<(PathBuf, MappedTensors)>,
}

impl VariableFiles {
    /// None when the checkpoint has no such file (before format 3).
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Variable `name`: the file holding it, its dtype, shape and bytes.
    pub fn raw(&self, name: &str) -> Result<(&Path, String, Vec<usize>, &[u8])> {
        for (path, file) in &self.files {
            if file.contains(name) {
                let (dtype, shape, bytes) = file.raw(name)?;
                return Ok((path, dtype, shape, bytes));
            }
        }
        let path = self.files.first().map_or_else(PathBuf::new, |(p, _)| p.clone());
        Err(CheckpointError::Io { path, what: format!("no tensor `{name}` in the checkpoint's variables files") })
    }
}
