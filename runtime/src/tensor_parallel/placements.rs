//! Where tensor-parallel layers split their parameters, recorded by the layers as they create them (Megatron-LM's
//! `partition_dim` on the parameter): the engine reads it to count whole parameters once in the gradient norm, to
//! save each slice by its place in the whole tensor, and to refuse replicas that differ. The program never declares
//! a split a second time.
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// How one parameter is split: along `dim`, evenly across the group in rank order. `whole` is the tensor's true
/// extent along `dim` when the layer padded it to split evenly (a vocabulary of 62 held as 64 rows at T = 2): the
/// rows past it are padding, which checkpoints, consolidation and whole copies leave out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// The dimension split.
    pub dim: usize,
    /// The true extent along `dim` (None: the members' parts together, no padding).
    pub whole: Option<i64>,
}

/// Parameter name -> how it is split. A parameter not named is held whole by every member. Clones share one record
/// (the mesh's and its tensor-parallel group's).
#[derive(Clone, Default)]
pub struct Placements(Arc<Mutex<BTreeMap<String, Split>>>);

impl std::fmt::Debug for Placements {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.lock().iter()).finish()
    }
}

impl Placements {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Split>> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records that parameter `name` is split along `dim` (a layer calls it for each variable it splits).
    pub fn split(&self, name: impl Into<String>, dim: usize) {
        self.lock().insert(name.into(), Split { dim, whole: None });
    }

    /// Records that parameter `name` is split along `dim` after padding it: its true extent there is `whole`.
    pub fn split_padded(&self, name: impl Into<String>, dim: usize, whole: i64) {
        self.lock().insert(name.into(), Split { dim, whole: Some(whole) });
    }

    /// How parameter `name` is split (None: held whole).
    pub fn get(&self, name: &str) -> Option<Split> {
        self.lock().get(name).copied()
    }

    /// The dimension parameter `name` is split along (None: held whole).
    pub fn split_dim(&self, name: &str) -> Option<usize> {
        self.get(name).map(|s| s.dim)
    }

    /// Whether some parameter holds padding: then even a group of one records where the true tensor ends.
    pub fn any_padded(&self) -> bool {
        self.lock().values().any(|s| s.whole.is_some())
    }
}
