//! zerorun-optim
