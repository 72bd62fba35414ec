//! The engine's place in a model split across ranks (a pipeline's stages, a tensor-parallel group).
pub(crate) mod placement;
