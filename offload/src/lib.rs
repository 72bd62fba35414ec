//! zerorun-offload
