//! The argument checks every backend makes: locally (a buffer that does not split into equal parts, a bad root)
//! and across ranks (the same collective, size and element type everywhere: a mismatch is an error on every rank,
//! never corruption). Written once here.
use super::{BufMut, BufRef, CommError, CommResult, Dtype};

/// Elements per part when `len` elements split into `world_size` equal parts.
pub fn equal_parts(op: &'static str, rank: usize, world_size: usize, len: usize) -> CommResult<usize> {
    if len % world_size != 0 {
        return Err(CommError::BadArgument {
            op,
            rank,
            what: format!("{len} elements do not split into {world_size} equal parts"),
        });
    }
    Ok(len / world_size)
}

/// The part length of a reduce-scatter whose output must be one part of the input, of the same type.
pub fn scatter_output(
    op: &'static str,
    rank: usize,
    world_size: usize,
    input: &BufRef<'_>,
    output: &BufMut<'_>,
) -> CommResult<usize> {
    let part = equal_parts(op, rank, world_size, input.len())?;
    output_of(op, rank, input, output, part)?;
    Ok(part)
}

/// The part length of an all-to-all, whose output is as long as its input and of the same type.
pub fn exchange_output(
    op: &'static str,
    rank: usize,
    world_size: usize,
    input: &BufRef<'_>,
    output: &BufMut<'_>,
) -> CommResult<usize> {
    let part = equal_parts(op, rank, world_size, input.len())?;
    output_of(op, rank, input, output, input.len())?;
    Ok(part)
}

/// The output must hold `len` elements of the input's type.
fn output_of(op: &'static str, rank: usize, input: &BufRef<'_>, output: &BufMut<'_>, len: usize) -> CommResult<()> {
    if output.len() != len || output.dtype != input.dtype {
        return Err(CommError::BadArgument {
            op,
            rank,
            what: format!("output has {} {:?} elements, expected {len} {:?}", output.len(), output.dtype, input.dtype),
        });
    }
    Ok(())
}

/// `root` must be a rank of the group.
pub fn root(op: &'static str, rank: usize, world_size: usize, root: usize) -> CommResult<()> {
    if root >= world_size {
        return Err(CommError::BadArgument { op, rank, what: format!("root {root} is not a rank of {world_size}") });
    }
    Ok(())
}

const OPS: [&str; 6] = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "all_to_all"];
const DTYPES: [Dtype; 4] = [Dtype::F32, Dtype::Bf16, Dtype::F16, Dtype::I64];

/// What one rank passed to a collective, as three words a backend can publish anywhere (shared memory, MPI).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    /// The collective (an index into the known operations).
    pub op: u64,
    /// Elements.
    pub len: u64,
    /// The element type's code.
    pub dtype: u64,
}

impl Call {
    /// The call of `op` on `len` elements of `dtype`.
    pub fn new(op: &str, len: usize, dtype: Dtype) -> Call {
        Call {
            op: OPS.iter().position(|o| *o == op).unwrap_or(OPS.len()) as u64 + 1,
            len: len as u64,
            dtype: dtype.code(),
        }
    }

    /// As three words.
    pub fn words(self) -> [u64; 3] {
        [self.op, self.len, self.dtype]
    }

    /// From three words.
    pub fn from_words(w: &[u64]) -> Call {
        Call { op: w[0], len: w[1], dtype: w[2] }
    }
}

fn op_name(code: u64) -> &'static str {
    (code as usize).checked_sub(1).and_then(|i| OPS.get(i)).copied().unwrap_or("?")
}

fn dtype_of(code: u64) -> Dtype {
    DTYPES[(code as usize).saturating_sub(1).min(DTYPES.len() - 1)]
}

/// Errors unless every rank's call matches: the operation first, then the element type, then the length.
pub fn check(op: &'static str, rank: usize, calls: &[Call]) -> CommResult<()> {
    let first = calls[0];
    if calls.iter().any(|c| c.op != first.op) {
        return Err(CommError::OpMismatch { op, rank, ops: calls.iter().map(|c| op_name(c.op)).collect() });
    }
    if calls.iter().any(|c| c.dtype != first.dtype) {
        return Err(CommError::DtypeMismatch { op, rank, dtypes: calls.iter().map(|c| dtype_of(c.dtype)).collect() });
    }
    if calls.iter().any(|c| c.len != first.len) {
        return Err(CommError::SizeMismatch { op, rank, sizes: calls.iter().map(|c| c.len as usize).collect() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_first_kind_of_disagreement() {
        let a = Call::new("all_reduce", 4, Dtype::F32);
        assert_eq!(check("all_reduce", 0, &[a, a]), Ok(()));
        let e = check("all_reduce", 1, &[a, Call::new("barrier", 4, Dtype::F32)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "all_reduce on rank 1: ranks called different collectives ([\"all_reduce\", \"barrier\"] by rank)"
        );
        let e = check("all_reduce", 0, &[a, Call::new("all_reduce", 5, Dtype::Bf16)]).unwrap_err();
        assert!(matches!(e, CommError::DtypeMismatch { .. }));
        let e = check("all_reduce", 0, &[a, Call::new("all_reduce", 5, Dtype::F32)]).unwrap_err();
        assert_eq!(e, CommError::SizeMismatch { op: "all_reduce", rank: 0, sizes: vec![4, 5] });
        assert_eq!(Call::from_words(&a.words()), a);
    }
}
