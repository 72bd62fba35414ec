//! A box of a parameter's whole tensor assembled from the entries that hold it: one entry when it was saved whole,
//! the overlapping slices when tensor parallelism saved it in parts. This is how a checkpoint loads at another
//! tensor-parallel degree (each rank reads its slice's box) and how `zerorun consolidate` writes whole tensors.
use std::ops::Range;

use crate::{CheckpointError, Manifest, Result};

/// Reads a flat range of the checkpoint's rank files (one tensor: the values or an optimizer state) into `out`.
pub type ReadFlat<'a> = dyn FnMut(Range<usize>, &mut [f32]) -> Result<()> + 'a;

/// The values of parameter `name` over `want` (one index range per dimension of the whole tensor), row-major,
/// from every entry that overlaps it. `read_flat(range, out)` reads a flat range of the checkpoint (one tensor of
/// the rank files: the values or an optimizer state). Every element of `want` inside the whole tensor must be held
/// by some entry (the error names the parameter and the manifest); elements past its end (a padded slice's rows
/// past the true size, [`crate::Slice::full`]) are padding and read as zeros.
pub fn read_region(
    manifest: &Manifest,
    manifest_path: &std::path::Path,
    name: &str,
    want: &[Range<i64>],
    read_flat: &mut ReadFlat<'_>,
) -> Result<Vec<f32>> {
    let want_shape: Vec<i64> = want.iter().map(|r| r.end - r.start).collect();
    let mut out = vec![0f32; want_shape.iter().product::<i64>() as usize];
    let mut covered = 0usize;
    let mut entry_values = Vec::new();
    let mut inside: Option<usize> = None;
    for entry in manifest.entries(name) {
        if inside.is_none() {
            // The elements of `want` inside the whole tensor, which the entries must cover.
            let full = entry.full_shape();
            let n = want.iter().zip(full.iter().chain(std::iter::repeat(&i64::MAX)));
            inside = Some(n.map(|(r, &f)| (r.end.min(f) - r.start.min(f)).max(0) as usize).product());
        }
        let theirs = entry.region();
        if theirs.len() != want.len() {
            return Err(CheckpointError::Mismatch {
                path: manifest_path.to_path_buf(),
                what: format!(
                    "`{name}` has {} dimensions in the checkpoint, {} in the model",
                    theirs.len(),
                    want.len()
                ),
            });
        }
        // Their box, the box wanted and the whole tensor (a padded slice's padding is no value).
        let full = entry.full_shape();
        let overlap: Vec<Range<i64>> = theirs
            .iter()
            .zip(want)
            .zip(&full)
            .map(|((a, b), &f)| a.start.max(b.start)..a.end.min(b.end).min(f))
            .collect();
        if overlap.iter().any(|r| r.start >= r.end) {
            continue;
        }
        entry_values.clear();
        entry_values.resize(entry.len, 0f32);
        read_flat(entry.start..entry.start + entry.len, &mut entry_values)?;
        covered += copy_box(&entry_values, &theirs, &mut out, want, &overlap);
    }
    let inside = inside.unwrap_or(out.len());
    if covered != inside {
        return Err(CheckpointError::Mismatch {
            path: manifest_path.to_path_buf(),
            what: format!(
                "the checkpoint's entries of `{name}` hold {covered} of the {inside} elements wanted (box {want:?})"
            ),
        });
    }
    Ok(out)
}

/// Copies box `overlap` (whole-tensor coordinates) from `src`, a row-major tensor over box `src_box`, into `dst`,
/// one over `dst_box`. Returns the elements copied.
fn copy_box(
    src: &[f32],
    src_box: &[Range<i64>],
    dst: &mut [f32],
    dst_box: &[Range<i64>],
    overlap: &[Range<i64>],
) -> usize {
    let strides = |b: &[Range<i64>]| {
        let mut s = vec![1i64; b.len()];
        for d in (0..b.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * (b[d + 1].end - b[d + 1].start);
        }
        s
    };
    let (ss, ds) = (strides(src_box), strides(dst_box));
    let dims = overlap.len();
    if dims == 0 {
        dst[0] = src[0];
        return 1;
    }
    // Contiguous runs along the last dimension, for every index of the others.
    let run = (overlap[dims - 1].end - overlap[dims - 1].start) as usize;
    let mut index: Vec<i64> = overlap.iter().map(|r| r.start).collect();
    let mut copied = 0;
    loop {
        let offset = |b: &[Range<i64>], s: &[i64]| -> usize {
            index.iter().zip(b).zip(s).map(|((i, r), st)| (i - r.start) * st).sum::<i64>() as usize
        };
        let (from, to) = (offset(src_box, &ss), offset(dst_box, &ds));
        dst[to..to + run].copy_from_slice(&src[from..from + run]);
        copied += run;
        // Next index of the dimensions before the last, odometer order.
        let mut d = dims - 1;
        loop {
            if d == 0 {
                return copied;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < overlap[d].end {
                break;
            }
            index[d] = overlap[d].start;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{ParamEntry, Slice};

    fn entry(shape: Vec<i64>, start: usize, slice: Option<Slice>) -> ParamEntry {
        let len = shape.iter().product::<i64>() as usize;
        ParamEntry { name: "w".into(), shape, start, len, dtype: "F32".into(), slice }
    }

    fn manifest(params: Vec<ParamEntry>) -> Manifest {
        let mut m: Manifest = serde_json::from_value(serde_json::json!({
            "format_version": 3, "tag": "t", "global_steps": 0, "global_samples": 0, "skipped_steps": 0,
            "optimizer_steps": 0, "optimizer": "adamw", "state_names": [], "scheduler_last_batch_iteration": null,
            "loss_scaler": null, "world_size": 1, "stage": 0, "precision": "fp32", "numel": 0, "params": [],
            "ranks": [], "config": null
        }))
        .unwrap();
        m.params = params;
        m
    }

    /// A whole 4 x 6 tensor w[i][j] = 10 i + j saved as two column slices (dimension 1) and read back as two row
    /// slices, a box in the middle and the whole: every element where it belongs.
    #[test]
    fn slices_along_one_dimension_read_back_along_another() {
        let whole: Vec<f32> = (0..4).flat_map(|i| (0..6).map(move |j| (10 * i + j) as f32)).collect();
        let col = |j0: i64| -> Vec<f32> {
            (0..4).flat_map(|i| (j0..j0 + 3).map(move |j| (10 * i + j) as f32)).collect::<Vec<f32>>()
        };
        // Flat space: the first slice at 0..12, the second at 100..112.
        let mut flat = vec![f32::NAN; 112];
        flat[..12].copy_from_slice(&col(0));
        flat[100..].copy_from_slice(&col(3));
        let m = manifest(vec![
            entry(vec![4, 3], 0, Some(Slice { dim: 1, start: 0, full: 6 })),
            entry(vec![4, 3], 100, Some(Slice { dim: 1, start: 3, full: 6 })),
        ]);
        assert_eq!(m.params[1].full_shape(), vec![4, 6]);
        let mut read = |r: Range<usize>, out: &mut [f32]| -> Result<()> {
            out.copy_from_slice(&flat[r]);
            Ok(())
        };
        let p = std::path::Path::new("m.json");
        assert_eq!(read_region(&m, p, "w", &[0..4, 0..6], &mut read).unwrap(), whole);
        let rows = read_region(&m, p, "w", &[2..4, 0..6], &mut read).unwrap();
        assert_eq!(rows, whole[12..].to_vec());
        let middle = read_region(&m, p, "w", &[1..3, 2..5], &mut read).unwrap();
        assert_eq!(middle, vec![12.0, 13.0, 14.0, 22.0, 23.0, 24.0]);
        // A box no entry covers whole is an error naming the parameter.
        let half = manifest(vec![m.params[0].clone()]);
        let err = read_region(&half, p, "w", &[0..4, 0..6], &mut read).unwrap_err().to_string();
        assert!(err.contains("entries of `w` hold 12 of the 24 elements"), "{err}");
    }

    /// A vocabulary of 5 rows padded to 6 and saved as two 3-row slices (the second holds one row of padding):
    /// the whole tensor is its 5 true rows, and a padded box reads the padding as zeros.
    #[test]
    fn padded_slices_read_back_without_their_padding() {
        let rows = |from: i64, n: i64| -> Vec<f32> { (from..from + n).flat_map(|i| [i as f32, -i as f32]).collect() };
        let mut flat = rows(0, 3);
        flat.extend(rows(3, 2));
        flat.extend([f32::NAN, f32::NAN]);
        let m = manifest(vec![
            entry(vec![3, 2], 0, Some(Slice { dim: 0, start: 0, full: 5 })),
            entry(vec![3, 2], 6, Some(Slice { dim: 0, start: 3, full: 5 })),
        ]);
        assert_eq!(m.params[0].full_shape(), vec![5, 2]);
        let mut read = |r: Range<usize>, out: &mut [f32]| -> Result<()> {
            out.copy_from_slice(&flat[r]);
            Ok(())
        };
        let p = std::path::Path::new("m.json");
        assert_eq!(read_region(&m, p, "w", &[0..5, 0..2], &mut read).unwrap(), rows(0, 5));
        let mut second = rows(3, 2);
        second.extend([0.0, 0.0]);
        assert_eq!(read_region(&m, p, "w", &[3..6, 0..2], &mut read).unwrap(), second);
        // Padding at another degree: one rank holding all 5 rows as 8.
        let mut one = rows(0, 5);
        one.extend([0.0; 6]);
        assert_eq!(read_region(&m, p, "w", &[0..8, 0..2], &mut read).unwrap(), one);
    }
}
