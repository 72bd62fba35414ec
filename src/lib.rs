//! zerorun: a ZeRO-style memory-sharding training runtime for tch (libtorch) training loops.
pub use zerorun_offload as offload;
pub use zerorun_optim as optim;
pub use zerorun_runtime as runtime;
pub use zerorun_runtime::config::{self, Config, ConfigError};
