//! Pipeline parallelism (issue 20, first piece): schedules as data. A schedule gives every stage its list of
//! actions for one optimizer step; [`schedule::validate`] simulates all stages together to prove a schedule pairs
//! every send with a receive and terminates, and measures the activations each stage holds and the bubble.
pub mod schedule;
