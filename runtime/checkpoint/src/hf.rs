//! Hugging Face's weight files: a model folder's `model.safetensors`, or its shards and
//! `model.safetensors.index.json` (`{"metadata": {"total_size"}, "weight_map": {name: shard}}`), read mapped tensor
//! by tensor, and written the same way transformers' `save_pretrained` writes them (one file up to a size limit,
//! shards and an index past it), streamed so memory stays bounded by one tensor. `config.json` is copied with its
//! dtype set to what was written.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::files::{dtype_size, MappedTensors, SafetensorsWriter};
use crate::{io_err, CheckpointError, Result};

/// The single-file name transformers reads first.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of a sharded model.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// transformers' default `max_shard_size` ("5GB").
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Weights by name from one safetensors file or from a sharded model's files, each memory-mapped: only the pages
/// of the tensors read are loaded.
pub struct WeightFiles {
    files: Vec<(PathBuf, MappedTensors)>,
    /// Tensor name -> its file, for a sharded model (None: one file holds every tensor).
    index: Option<BTreeMap<String, usize>>,
}

#[derive(serde::Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

impl WeightFiles {
    /// Opens `path`: a safetensors file, a sharded model's index (`*.index.json`), or a model folder holding
    /// `model.safetensors.index.json` or `model.safetensors`.
    pub fn open(path: &Path) -> Result<WeightFiles> {
        let path = if path.is_dir() {
            let index = path.join(INDEX_FILE);
            if index.exists() {
                index
            } else if path.join(WEIGHTS_FILE).exists() {
                path.join(WEIGHTS_FILE)
            } else {
                return Err(CheckpointError::Missing {
                    path: path.to_path_buf(),
                    what: format!("the folder holds neither {WEIGHTS_FILE} nor {INDEX_FILE}"),
                });
            }
        } else {
            path.to_path_buf()
        };
        if !path.to_string_lossy().ends_with(".json") {
            let file = MappedTensors::open(&path)?;
            return Ok(WeightFiles { files: vec![(path, file)], index: None });
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|e| CheckpointError::Missing { path: path.clone(), what: e.to_string() })?;
        let parsed: Index = serde_json::from_str(&text)
            .map_err(|e| io_err(&path, format!("not a safetensors index (`weight_map`): {e}")))?;
        let folder = path.parent().unwrap_or(Path::new("."));
        let mut shards: BTreeMap<&str, usize> = BTreeMap::new();
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for (name, shard) in &parsed.weight_map {
            let at = match shards.get(shard.as_str()) {
                Some(&at) => at,
                None => {
                    let file_path = folder.join(shard);
                    let file = MappedTensors::open(&file_path).map_err(|e| match e {
                        CheckpointError::Missing { what, .. } => CheckpointError::Missing {
                            path: path.clone(),
                            what: format!("shard {shard} of tensor `{name}`: {what}"),
                        },
                        other => other,
                    })?;
                    files.push((file_path, file));
                    shards.insert(shard, files.len() - 1);
                    files.len() - 1
                }
            };
            index.insert(name.clone(), at);
        }
        Ok(WeightFiles { files, index: Some(index) })
    }

    /// The file holding tensor `name`, if any.
    fn file_of(&self, name: &str) -> Option<usize> {
        match &self.index {
            Some(index) => index.get(name).copied(),
            None => self.files[0].1.contains(name).then_some(0),
        }
    }

    /// Whether some file holds tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.file_of(name).is_some()
    }

    /// Tensor `name`: the file it is in, its safetensors dtype, shape and little-endian bytes (mapped). A tensor
    /// no file holds is an error naming the file (or index) and the tensor.
    pub fn raw(&self, name: &str) -> Result<(&Path, String, Vec<usize>, &[u8])> {
        let Some(at) = self.file_of(name) else {
            let (path, _) = &self.files[0];
            let place = match &self.index {
                Some(_) => "no shard of the index holds it".to_string(),
                None => format!("{} has no such tensor", path.display()),
            };
            return Err(CheckpointError::Missing { path: path.clone(), what: format!("tensor `{name}`: {place}") });
        };
        let (path, file) = &self.files[at];
        let (dtype, shape, bytes) = file.raw(name)?;
        Ok((path, dtype, shape, bytes))
    }

    /// The files read (one, or the shards).
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }
}

/// How [`plan_shards`] cut the tensors into files.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardPlan {
    /// Per file: its name and the tensors (indices into the list given) it holds, in order.
    pub files: Vec<(String, Vec<usize>)>,
    /// Bytes of every tensor together (the index's `metadata.total_size`).
    pub total_bytes: u64,
}

/// Cuts `tensors` (name, shape, dtype), in their order, into files of at most `max_shard_bytes` (a tensor larger
/// than that gets a file of its own), named as transformers names them: `model.safetensors` when one file holds
/// everything, else `model-00001-of-0000N.safetensors`.
pub fn plan_shards(tensors: &[(String, Vec<usize>, String)], max_shard_bytes: u64) -> ShardPlan {
    let bytes =
        |t: &(String, Vec<usize>, String)| (t.1.iter().product::<usize>() * dtype_size(&t.2).unwrap_or(0)) as u64;
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut current = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let b = bytes(t);
        match groups.last_mut() {
            Some(g) if current + b <= max_shard_bytes => {
                g.push(i);
                current += b;
            }
            _ => {
                groups.push(vec![i]);
                current = b;
            }
        }
    }
    let n = groups.len();
    let files = groups
        .into_iter()
        .enumerate()
        .map(|(k, g)| {
            let name =
                if n == 1 { WEIGHTS_FILE.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", k + 1) };
            (name, g)
        })
        .collect();
    ShardPlan { files, total_bytes: tensors.iter().map(bytes).sum() }
}

/// A model's weights written into `dir` as transformers writes them ([`plan_shards`]; with several files, the
/// index `model.safetensors.index.json` last), one tensor at a time in the order given: push each tensor's bytes
/// with [`ShardedWriter::tensor`], then [`ShardedWriter::finish`]. Each file appears under its name only when
/// complete.
pub struct ShardedWriter {
    dir: PathBuf,
    tensors: Vec<(String, Vec<usize>, String)>,
    plan: ShardPlan,
    /// The file being written and how many of its tensors are written.
    open: Option<(usize, SafetensorsWriter, usize)>,
    next_file: usize,
}

impl ShardedWriter {
    /// Plans the files of `tensors` (name, shape, safetensors dtype) in `dir` (created when missing).
    pub fn create(dir: &Path, tensors: Vec<(String, Vec<usize>, String)>, max_shard_bytes: u64) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        let plan = plan_shards(&tensors, max_shard_bytes);
        Ok(ShardedWriter { dir: dir.to_path_buf(), tensors, plan, open: None, next_file: 0 })
    }

    /// How the tensors are cut into files.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// The next tensor's bytes (little-endian, exactly its shape and dtype's size).
    pub fn tensor(&mut self, fill: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>) -> Result<()> {
        if self.open.is_none() {
            let (name, members) = self
                .plan
                .files
                .get(self.next_file)
                .ok_or_else(|| io_err(&self.dir, "more tensors than were planned"))?;
            let specs: Vec<_> = members.iter().map(|&i| self.tensors[i].clone()).collect();
            let w = SafetensorsWriter::create(&self.dir.join(name), &specs)?;
            self.open = Some((self.next_file, w, 0));
            self.next_file += 1;
        }
        let (file, mut w, written) = self.open.take().expect("opened above");
        w.tensor(fill)?;
        if written + 1 == self.plan.files[file].1.len() {
            w.finish()?;
        } else {
            self.open = Some((file, w, written + 1));
        }
        Ok(())
    }

    /// Writes the index when there are several files; every tensor must have been written.
    pub fn finish(self) -> Result<Vec<PathBuf>> {
        if self.open.is_some() || self.next_file != self.plan.files.len() {
            return Err(io_err(&self.dir, "not every tensor was written"));
        }
        let mut paths: Vec<PathBuf> = self.plan.files.iter().map(|(n, _)| self.dir.join(n)).collect();
        if self.plan.files.len() > 1 {
            let mut weight_map = BTreeMap::new();
            for (name, members) in &self.plan.files {
                for &i in members {
                    weight_map.insert(self.tensors[i].0.clone(), name.clone());
                }
            }
            let index = serde_json::json!({
                "metadata": {"total_size": self.plan.total_bytes},
                "weight_map": weight_map,
            });
            let path = self.dir.join(INDEX_FILE);
            let text = serde_json::to_string_pretty(&index).expect("index serializes");
            crate::files::write_atomic(&path, text.as_bytes())?;
            paths.push(path);
        }
        // A stale single file or index of an earlier save would shadow or contradict this one.
        let stale = if self.plan.files.len() > 1 { WEIGHTS_FILE } else { INDEX_FILE };
        let _ = std::fs::remove_file(self.dir.join(stale));
        Ok(paths)
    }
}

/// A size as transformers' `max_shard_size` takes it: "5GB", "500MB", "10KB" (decimal), "1GiB", "512MiB", "4KiB"
/// (binary), or a number of bytes.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let scale = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("{text:?}: unknown unit {other:?} (B, KB, MB, GB, KiB, MiB or GiB)")),
    };
    let n: f64 = digits.parse().map_err(|_| format!("{text:?} is not a size (e.g. 5GB)"))?;
    Ok((n * scale) as u64)
}

/// transformers' name of a safetensors dtype (`torch_dtype` in config.json).
pub fn torch_dtype_name(dtype: &str) -> Option<&'static str> {
    Some(match dtype {
        "F32" => "float32",
        "BF16" => "bfloat16",
        "F16" => "float16",
        _ => return None,
    })
}

/// Copies the model's `config.json` from `source` into `dir`, its dtype set to `dtype` (safetensors' name) under
/// `torch_dtype` and, where the source has it, transformers 4.56+'s `dtype`.
pub fn write_config(source: &Path, dir: &Path, dtype: &str) -> Result<PathBuf> {
    let text = std::fs::read_to_string(source)
        .map_err(|e| CheckpointError::Missing { path: source.to_path_buf(), what: e.to_string() })?;
    let mut config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| io_err(source, format!("not JSON: {e}")))?;
    let name = torch_dtype_name(dtype).ok_or_else(|| io_err(source, format!("no torch dtype for {dtype}")))?;
    let object = config.as_object_mut().ok_or_else(|| io_err(source, "not a JSON object"))?;
    object.insert("torch_dtype".into(), name.into());
    if object.contains_key("dtype") {
        object.insert("dtype".into(), name.into());
    }
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config).expect("config serializes");
    crate::files::write_atomic(&path, text.as_bytes())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, n: usize) -> (String, Vec<usize>, String) {
        (name.to_string(), vec![n], "F32".to_string())
    }

    #[test]
    fn sizes_read_as_transformers_reads_them() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("100KB"), Ok(100_000));
        assert_eq!(parse_size("2MiB"), Ok(2 * 1024 * 1024));
        assert_eq!(parse_size("1234"), Ok(1234));
        assert_eq!(parse_size("5 TB").unwrap_err(), "\"5 TB\": unknown unit \"TB\" (B, KB, MB, GB, KiB, MiB or GiB)");
    }

    #[test]
    fn shards_are_cut_in_order_at_the_limit_and_named_as_transformers_names_them() {
        let tensors = vec![spec("a", 10), spec("b", 10), spec("c", 30), spec("d", 1)];
        let one = plan_shards(&tensors, 1000);
        assert_eq!(one.files, vec![(WEIGHTS_FILE.to_string(), vec![0, 1, 2, 3])]);
        assert_eq!(one.total_bytes, 204);
        // 80 bytes: a and b (80) fill the first; c (120) is larger than the limit: a file of its own.
        let cut = plan_shards(&tensors, 80);
        let names: Vec<&str> = cut.files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors"
            ]
        );
        assert_eq!(cut.files.iter().map(|f| f.1.clone()).collect::<Vec<_>>(), vec![vec![0, 1], vec![2], vec![3]]);
    }

    #[test]
    fn a_sharded_model_reads_back_by_name_and_a_missing_tensor_is_named() {
        let dir = std::env::temp_dir().join(format!("zerorun-hf-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let tensors = vec![spec("x.weight", 3), spec("y.weight", 2), spec("z.bias", 4)];
        let mut w = ShardedWriter::create(&dir, tensors.clone(), 16).unwrap();
        for (i, t) in tensors.iter().enumerate() {
            let values: Vec<f32> = (0..t.1[0]).map(|k| (10 * i + k) as f32).collect();
            w.tensor(|out| out.write_all(bytemuck::cast_slice(&values))).unwrap();
        }
        let paths = w.finish().unwrap();
        assert_eq!(paths.len(), 4, "{paths:?}");
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
        assert_eq!(index["metadata"]["total_size"], 36);
        assert_eq!(index["weight_map"]["z.bias"], "model-00003-of-00003.safetensors");
        let files = WeightFiles::open(&dir).unwrap();
        let (path, dtype, shape, bytes) = files.raw("z.bias").unwrap();
        assert!(path.ends_with("model-00003-of-00003.safetensors"));
        assert_eq!((dtype.as_str(), shape), ("F32", vec![4]));
        assert_eq!(bytemuck::cast_slice::<u8, f32>(bytes), [20.0, 21.0, 22.0, 23.0]);
        let err = files.raw("w.weight").err().unwrap().to_string();
        assert!(err.contains("tensor `w.weight`: no shard of the index holds it"), "{err}");
        std::fs::remove_file(dir.join("model-00002-of-00003.safetensors")).unwrap();
        let err = WeightFiles::open(&dir).err().unwrap().to_string();
        assert!(err.contains("shard model-00002-of-00003.safetensors of tensor `y.weight`"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
