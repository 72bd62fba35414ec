//! What the engine tells the user about a run: memory per category (sampled every optimizer step, written per
//! rank as JSON and drawn as a picture) and where the time of a step went.
pub use zerorun_report::{advice, memory, plot, table, ReportError};
pub mod allocations;
pub mod timing;

pub use memory::{CategoryBytes, MemoryCategory, MemoryReport, ModelStates, StepSample, SCHEMA_VERSION};
pub use timing::{Phase, PhaseTimes};
