//! The training rows the data contract names (the main module's docs): a mapped `--data` file or the corpus's
//! bytes.
use std::path::Path;

use tch::Tensor;
use zerorun::runtime::checkpoint::files::MappedTensors;

/// Training rows: [N, T+1] token ids, mapped (`--data`) or the corpus's bytes.
pub(super) enum Rows {
    File { file: MappedTensors, int32: bool, n: usize, width: usize },
    Bytes { bytes: Vec<u8>, width: usize },
}

impl Rows {
    /// Opens `--data` (checking dtype, shape and every id against `vocab`), or the corpus's bytes.
    pub(super) fn open(data: Option<&Path>, vocab: i64, seq_len: i64) -> Result<Rows, String> {
        let Some(path) = data else {
            if vocab < 256 {
                return Err(format!(
                    "the corpus's bytes need a vocabulary of at least 256 (it is {vocab}): give --data or --vocab 256"
                ));
            }
            let bytes = include_bytes!("../data/shakespeare.txt").to_vec();
            return Ok(Rows::Bytes { bytes, width: seq_len as usize + 1 });
        };
        let at = |e: String| format!("--data {}: {e}", path.display());
        let file = MappedTensors::open(path).map_err(|e| at(e.to_string()))?;
        let (dtype, shape, bytes) = file.raw("tokens").map_err(|e| at(e.to_string()))?;
        let int32 = match dtype.as_str() {
            "I64" => false,
            "I32" => true,
            other => return Err(at(format!("tensor `tokens` is {other}: int64 or int32 token ids wanted"))),
        };
        if shape.len() != 2 || shape[1] < 2 || shape[0] == 0 {
            return Err(at(format!("tensor `tokens` is {shape:?}: [N, T+1] rows of at least 2 tokens wanted")));
        }
        let ids: Vec<i64> = if int32 {
            bytemuck::pod_collect_to_vec::<u8, i32>(bytes).into_iter().map(i64::from).collect()
        } else {
            bytemuck::pod_collect_to_vec::<u8, i64>(bytes)
        };
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id < 0 || id >= vocab) {
            let (row, col) = (i / shape[1], i % shape[1]);
            return Err(at(format!(
                "tensor `tokens` holds id {id} at row {row}, column {col}: not in the vocabulary 0..{vocab}"
            )));
        }
        Ok(Rows::File { file, int32, n: shape[0], width: shape[1] })
    }

    fn len(&self) -> usize {
        match self {
            Rows::File { n, .. } => *n,
            Rows::Bytes { bytes, width } => (bytes.len() - 1) / (width - 1),
        }
    }

    fn width(&self) -> usize {
        match self {
            Rows::File { width, .. } | Rows::Bytes { width, .. } => *width,
        }
    }

    /// Row `i` (mod N).
    fn row(&self, i: u64) -> Vec<i64> {
        let i = (i % self.len() as u64) as usize;
        let w = self.width();
        match self {
            Rows::File { file, int32, .. } => {
                let (_, _, bytes) = file.raw("tokens").expect("checked when opened");
                let size = if *int32 { 4 } else { 8 };
                let row = &bytes[i * w * size..(i + 1) * w * size];
                match int32 {
                    true => bytemuck::pod_collect_to_vec::<u8, i32>(row).into_iter().map(i64::from).collect(),
                    false => bytemuck::pod_collect_to_vec::<u8, i64>(row),
                }
            }
            Rows::Bytes { bytes, .. } => bytes[i * (w - 1)..i * (w - 1) + w].iter().map(|&b| b as i64).collect(),
        }
    }

    /// Inputs and targets [rows, T] of rows `first .. first + count`.
    pub(super) fn batch(&self, first: u64, count: u64) -> (Tensor, Tensor) {
        let w = self.width() as i64;
        let ids: Vec<i64> = (first..first + count).flat_map(|i| self.row(i)).collect();
        let all = Tensor::from_slice(&ids).view([count as i64, w]);
        (all.narrow(1, 0, w - 1), all.narrow(1, 1, w - 1))
    }
}
