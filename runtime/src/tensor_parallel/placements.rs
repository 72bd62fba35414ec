//! Where tensor-parallel layers split their parameters, recorded by the layers as they create them (Megatron-LM's
//! `partition_dim` on the parameter): the engine reads it to count whole parameters once in the gradient norm, to
//! save each slice by its place in the whole tensor, and to refuse replicas that differ. The program never declares
//! a split a second time.
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Parameter name -> the dimension it is split along, evenly across the group in rank order. A parameter not
/// named is held whole by every member. Clones share one record (the mesh's and its tensor-parallel group's).
#[derive(Clone, Default)]
pub struct Placements(Arc<Mutex<BTreeMap<String, usize>>>);

impl std::fmt::Debug for Placements {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.lock().iter()).finish()
    }
}

impl Placements {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, usize>> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records that parameter `name` is split along `dim` (a layer calls it for each variable it splits).
    pub fn split(&self, name: impl Into<String>, dim: usize) {
        self.lock().insert(name.into(), dim);
    }

    /// The dimension parameter `name` is split along (None: held whole).
    pub fn split_dim(&self, name: &str) -> Option<usize> {
        self.lock().get(name).copied()
    }
}
