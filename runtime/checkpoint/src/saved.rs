//! A saved checkpoint opened for reading: its folder (`dir/<tag>`, the tag defaulting to what `dir/latest`
//! names), its manifest, and its rank files, each checksummed against the manifest before it is mapped. The
//! engine's load and `zerorun consolidate` both read through it.
use std::path::{Path, PathBuf};

use crate::files::{self, MappedTensors};
use crate::{latest_tag, CheckpointError, Manifest, Result};

pub struct SavedCheckpoint {
    pub tag: String,
    /// `dir/<tag>`.
    pub folder: PathBuf,
    pub manifest: Manifest,
}

impl SavedCheckpoint {
    /// Opens `dir/<tag>` (default: the tag `dir/latest` names) and reads its manifest.
    pub fn open(dir: &Path, tag: Option<&str>) -> Result<SavedCheckpoint> {
        let tag = match tag {
            Some(t) => t.to_string(),
            None => latest_tag(dir)?,
        };
        let folder = dir.join(&tag);
        let manifest = Manifest::read(&folder.join("manifest.json"))?;
        Ok(SavedCheckpoint { tag, folder, manifest })
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

    /// The variables file (buffers and frozen parameters, format 3), when the checkpoint has one.
    pub fn variables_file(&self) -> Result<Option<MappedTensors>> {
        self.manifest.variables_file.as_ref().map(|name| MappedTensors::open(&self.folder.join(name))).transpose()
    }
}
