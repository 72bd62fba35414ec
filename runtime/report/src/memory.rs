//! The measured memory report. Schema (version [`SCHEMA_VERSION`]) of `memory_rank{r}.json`:
//!
//! ```text
//! { "schema_version": 1, "rank": r, "world_size": n, "stage": s, "precision": "fp32" | "bf16" | "fp16",
//!   "categories": { name: { "current_bytes": u64, "peak_bytes": u64 } },     // see Engine::memory_bytes
//!   "model_states": { "measured_bytes": u64, "estimated_bytes": u64 },       // params + gradients + optimizer
//!   "floor_rss_bytes": u64,                            // VmRSS at initialize less the model's variables
//!   "init_peak_rss_bytes": u64,                        // VmHWM when initialize returned
//!   "peak_rss_bytes": u64,                                                   // the process's VmHWM
//!   "steps": [ { "step": u64, "rss_bytes": u64, "categories": { name: u64 } } ] }      // parameters_gathered: the
//!                                                                                         // step's peak
//! ```
//!
//! `model_states.measured_bytes` sums what the engine keeps between steps (`parameters`, `parameters_nvme`,
//! `frozen_parameters`, `gradients_full`, `gradients_shard`, `master_fp32`, `optimizer_states`, `optimizer_states_nvme`); `estimated_bytes` is
//! `zerorun_config::estimate::model_states_bytes` for the run's stage, precision and optimizer. RSS is per process:
//! thread ranks of one process share it.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The process's resident memory ([`crate::rss`]), also under `memory::` where programs already read it.
pub use crate::rss::rss;
use crate::rss::{reset_high_water, rss_since_reset};
use crate::{ReportError, Result};

/// 2: `floor_rss_bytes`, `events` and `peak` (version 1 files read with those empty).
pub const SCHEMA_VERSION: u32 = 2;

/// What the engine holds, by kind: each a category of the report (its JSON name is [`MemoryCategory::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryCategory {
    /// The model-dtype values kept between steps: all of them at stages 0-2, this rank's shard at stage 3.
    Parameters,
    /// Stage 3's shard chunks on NVMe.
    ParametersNvme,
    /// Stage 3 units gathered now (persistent ones too).
    ParametersGathered,
    /// Autograd's `.grad` tensors of the model (stages 0-2), or the gradient-view buffer they are.
    GradientsFull,
    /// The fp32 reduced gradients of the optimized range.
    GradientsShard,
    /// One unit's gradients during stage 3's backward, before their reduction (events only).
    GradientsUnit,
    /// The fp32 master copy of 16-bit parameters.
    MasterFp32,
    /// The optimizer's states in memory.
    OptimizerStates,
    /// The optimizer's states on NVMe (outside the resident set).
    OptimizerStatesNvme,
    /// Reduction staging and partition buffers.
    CommunicationBuffers,
    /// The NVMe tiers' host buffers: swap buffers, reads ahead, the sub-group being stepped (copies, not states).
    OffloadBuffers,
    /// Frozen parameters: all of them at stages 0-2, this rank's shard at stage 3.
    FrozenParameters,
    /// Buffers (BatchNorm's statistics), whole on every rank.
    Buffers,
    /// Live tensors the model's forward made and autograd keeps for backward (and the forward's output); events only.
    Activations,
    /// Other live tensors made outside the engine: the program's inputs and loss, autograd's gradients before the
    /// engine takes them, backward's temporaries, tensors a program keeps; events only.
    Temporaries,
    /// Freed memory kept for reuse: the large blocks the counting allocator keeps for the next allocation of their
    /// size, and glibc's free blocks in its arenas (`mallinfo2().fordblks`), as far as the resident set shows them
    /// (at most what the floor and the other categories leave of it); events only.
    AllocatorRetained,
}

impl MemoryCategory {
    /// The name in the report's JSON, tables and pictures.
    pub fn name(self) -> &'static str {
        match self {
            MemoryCategory::Parameters => "parameters",
            MemoryCategory::ParametersNvme => "parameters_nvme",
            MemoryCategory::ParametersGathered => "parameters_gathered",
            MemoryCategory::GradientsFull => "gradients_full",
            MemoryCategory::GradientsShard => "gradients_shard",
            MemoryCategory::GradientsUnit => "gradients_unit",
            MemoryCategory::MasterFp32 => "master_fp32",
            MemoryCategory::OptimizerStates => "optimizer_states",
            MemoryCategory::OptimizerStatesNvme => "optimizer_states_nvme",
            MemoryCategory::CommunicationBuffers => "communication_buffers",
            MemoryCategory::OffloadBuffers => "offload_buffers",
            MemoryCategory::FrozenParameters => "frozen_parameters",
            MemoryCategory::Buffers => "buffers",
            MemoryCategory::Activations => "activations",
            MemoryCategory::Temporaries => "temporaries",
            MemoryCategory::AllocatorRetained => "allocator_retained",
        }
    }

    /// Counted as model states (what ZeRO's formulas describe).
    pub fn is_model_state(self) -> bool {
        MODEL_STATE_CATEGORIES.contains(&self.name())
    }
}

/// Categories counted as model states (what ZeRO's formulas describe), by name.
pub const MODEL_STATE_CATEGORIES: [&str; 8] = [
    "parameters",
    "parameters_nvme",
    "frozen_parameters",
    "gradients_full",
    "gradients_shard",
    "master_fp32",
    "optimizer_states",
    "optimizer_states_nvme",
];

/// Whether the category `name` lives on NVMe rather than in memory (reported beside RSS, never inside it).
pub fn is_on_nvme(name: &str) -> bool {
    name.ends_with("_nvme")
}

/// Bytes by category, as the engine reports them.
pub type CategoryList = [(MemoryCategory, usize)];

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
/// A category's bytes now and at most over the run.
pub struct CategoryBytes {
    /// Now.
    pub current_bytes: u64,
    /// At most.
    pub peak_bytes: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
/// Model states measured by the engine beside the estimator's count for the same config.
pub struct ModelStates {
    /// What the engine holds.
    pub measured_bytes: u64,
    /// What `zerorun estimate` predicts.
    pub estimated_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
/// The memory at the end of one optimizer step.
pub struct StepSample {
    /// The step (1 for the first).
    pub step: u64,
    /// Resident memory.
    pub rss_bytes: u64,
    /// Bytes by category.
    pub categories: BTreeMap<String, u64>,
    /// The step's event with the most resident memory (when events were sampled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_event: Option<EventSample>,
}

/// A sample at one of the engine's events inside a step (a unit gathered in forward, a unit's gradients computed
/// in backward, the optimizer step, ...): resident memory then, and what the engine held by category, with
/// transients that exist only around the event (`gradients_unit`: the unit's gradients before their reduction).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventSample {
    /// The optimizer step the event belongs to (1 for the first step; 0 for initialisation).
    pub step: u64,
    /// The event's name (`forward unit 3`, `optimizer step`, ...).
    pub event: String,
    /// Resident memory then.
    pub rss_bytes: u64,
    /// Bytes by category then.
    pub categories: BTreeMap<String, u64>,
}

impl EventSample {
    /// Resident memory the floor and the categories do not explain: activations, allocator caches, leaks. What
    /// is on NVMe (`*_nvme`) is not resident and stays out of the sum.
    pub fn unaccounted_bytes(&self, floor: u64) -> i64 {
        let resident: u64 = self.categories.iter().filter(|(name, _)| !is_on_nvme(name)).map(|(_, b)| *b).sum();
        self.rss_bytes as i64 - floor as i64 - resident as i64
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
/// One rank's memory report (`memory_rank{r}.json`): categories, samples per step, the peak event and its step's timeline.
pub struct MemoryReport {
    /// The format's version.
    pub schema_version: u32,
    /// The rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// The ZeRO stage.
    pub stage: u8,
    /// The model's dtype.
    pub precision: String,
    /// Every category's bytes, now and at most.
    pub categories: BTreeMap<String, CategoryBytes>,
    /// Model states, measured and estimated.
    pub model_states: ModelStates,
    /// The process floor: resident memory when `initialize` began less the model's variables (already built by
    /// the program): the libraries, libtorch first, and the program's own data. Peak RSS = floor + model states +
    /// activations and transients. 0 in reports written before it existed.
    #[serde(default)]
    pub floor_rss_bytes: u64,
    /// The process's peak resident memory when `initialize` returned: what start-up needed (the model built,
    /// packed and sharded). 0 in reports written before it existed.
    #[serde(default)]
    pub init_peak_rss_bytes: u64,
    /// The process's peak resident memory over the run.
    pub peak_rss_bytes: u64,
    /// One sample per optimizer step.
    pub steps: Vec<StepSample>,
    /// The event with the highest resident memory of the run.
    #[serde(default)]
    pub peak: Option<EventSample>,
    /// The events of the step that held that peak, in order: one step's timeline.
    #[serde(default)]
    pub events: Vec<EventSample>,
    /// A pipeline stage's rank: which stage, its layers and where its time went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineStage>,
    /// A model on a device: where ("cuda:0"); the categories then count bytes of that device's memory for the
    /// engine's buffers there (the optimizer's side is on the host when offloaded). Absent: the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// A model on a CUDA device: libtorch's CUDA caching allocator at the end of the run, beside the engine's
    /// categories (what they do not name is activations, temporaries and the allocator's cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<DeviceMemory>,
    /// Stage 3: live bytes each unit's forward left for its backward (activations per unit), from the last
    /// training forward. Empty without the counting allocator or units.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unit_activations_bytes: Vec<u64>,
    /// Stage 3: each unit's input, in bytes (what activation checkpointing keeps of a unit).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unit_input_bytes: Vec<u64>,
    /// The largest live allocations at the highest event (`ZERORUN_MEMORY_SNAPSHOT=1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_allocations: Option<PeakAllocations>,
    /// Model states other configurations would hold on this rank, by the estimator (for the report's advice).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alternatives: Vec<Alternative>,
    /// Where the process's resident memory peaked, between which events (when measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_window: Option<PeakWindow>,
    /// A mixture of experts: the part of this rank's model states that is the experts' (parameters named
    /// `experts.{i}.`). Absent for a dense model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertStates>,
}

/// The experts' part of one rank's model states: each model-state category's bytes in the proportion of expert
/// elements in what that category holds (every parameter at stages 0-2, this rank's partition otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ExpertStates {
    /// Expert parameters in the model.
    pub parameters: u64,
    /// Every trainable parameter of the model.
    pub model_parameters: u64,
    /// Expert bytes by model-state category.
    pub categories: BTreeMap<String, u64>,
}

impl ExpertStates {
    /// The experts' model-state bytes on this rank.
    pub fn bytes(&self) -> u64 {
        self.categories.values().sum()
    }
}

/// The largest live tensor allocations at one event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeakAllocations {
    /// The step of the event.
    pub step: u64,
    /// The event.
    pub event: String,
    /// Resident memory then.
    pub rss_bytes: u64,
    /// Live bytes of every counted allocation then.
    pub live_bytes: u64,
    /// Largest first.
    pub allocations: Vec<Allocation>,
}

/// One live allocation of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// Its size.
    pub bytes: u64,
    /// Whose: `forward` (activations), `backward`, `engine` or `program`.
    pub owner: String,
    /// The operator that made it, outermost > innermost (libtorch's RecordFunction); empty outside operators.
    pub op: String,
    /// The engine's phase when it was made (`forward: unit 3`, `backward`, `optimizer step`, ...).
    pub phase: String,
}

/// Another configuration and the model states it would leave resident on this rank (the estimator's count).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Alternative {
    /// The change, in ds_config terms (`zero_optimization.stage: 3`).
    pub change: String,
    /// Resident model-state bytes per rank with it.
    pub model_states_bytes: u64,
}

/// A CUDA caching allocator's statistics for one device, in bytes (`torch.cuda.memory_stats()`'s
/// `allocated_bytes.all.*` and `reserved_bytes.all.*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// Bytes in live tensors at the end.
    pub allocated: u64,
    /// At most over the run.
    pub allocated_peak: u64,
    /// Bytes the allocator holds from the driver at the end.
    pub reserved: u64,
    /// At most over the run.
    pub reserved_peak: u64,
}

/// What a pipeline stage's report adds (`rank` and `world_size` are then the job's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineStage {
    /// This rank's stage.
    pub stage: usize,
    /// Stages in the pipeline.
    pub stages: usize,
    /// The stage's layers, e.g. `embed..blocks.1`.
    pub layers: String,
    /// Trainable parameters of the stage.
    pub parameters: usize,
    /// Mean per optimizer step, microseconds: the whole step, forward and backward compute, blocked on the
    /// neighbours, and the optimizer step (with the tied weights' exchange).
    pub step_us: u64,
    /// Forward and backward compute, microseconds.
    pub compute_us: u64,
    /// Waiting for the neighbours, microseconds.
    pub wait_us: u64,
    #[serde(default)]
    /// The optimizer step, microseconds.
    pub optimizer_us: u64,
}

/// The engine's running record: per-category current and peak, one sample per optimizer step, and the samples at
/// the engine's events (the run's peak event and the timeline of its step).
#[derive(Debug, Default)]
pub struct MemoryTracker {
    /// Every category's bytes, now and at most.
    pub categories: BTreeMap<String, CategoryBytes>,
    /// One sample per optimizer step.
    pub steps: Vec<StepSample>,
    /// The event with the highest resident memory so far.
    pub peak: Option<EventSample>,
    /// The timeline of the step that holds `peak`.
    pub peak_step_events: Vec<EventSample>,
    /// The events of the step in progress.
    current_events: Vec<EventSample>,
    /// Measure the process's peak between events: at each event VmHWM is read and reset (`/proc/self/clear_refs`),
    /// so each window's peak is known. Only where one tracker owns the process (the engine decides per event).
    pub measure_windows: bool,
    /// The most resident memory the process reached in any window so far.
    pub process_peak_bytes: u64,
    /// The window that held `process_peak_bytes`.
    pub peak_window: Option<PeakWindow>,
    /// The step and name of the last event, where the next window begins.
    last_event: Option<(u64, String)>,
}

/// Where the process's resident memory peaked: between two events (the engine's events sample the memory at
/// points; the peak can fall between them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeakWindow {
    /// The step of the event that closed the window.
    pub step: u64,
    /// The event that opened it (None: the start of the run).
    pub after: Option<String>,
    /// The event that closed it.
    pub before: String,
    /// The peak resident memory in it.
    pub rss_bytes: u64,
}

impl MemoryTracker {
    /// Folds in the bytes held now; `peaks` are peaks the engine tracked between samples (e.g. gathered units).
    pub fn observe(&mut self, now: &CategoryList, peaks: &CategoryList) {
        for (category, b) in now {
            let c = self.categories.entry(category.name().to_string()).or_default();
            c.current_bytes = *b as u64;
            c.peak_bytes = c.peak_bytes.max(*b as u64);
        }
        for (category, b) in peaks {
            let c = self.categories.entry(category.name().to_string()).or_default();
            c.peak_bytes = c.peak_bytes.max(*b as u64);
        }
    }

    /// One sample at the end of optimizer step `step`: the bytes held now, except categories in `peaks`,
    /// which report their peak within the step (gathered stage 3 units are released by its end).
    pub fn sample(&mut self, step: u64, now: &CategoryList, peaks: &CategoryList) {
        self.observe(now, peaks);
        let categories = now
            .iter()
            .map(|(n, b)| {
                (n.name().to_string(), peaks.iter().find(|(p, _)| p == n).map_or(*b, |(_, pb)| (*pb).max(*b)) as u64)
            })
            .collect();
        self.steps.push(StepSample { step, rss_bytes: rss().0, categories, peak_event: None });
        self.end_step();
    }

    /// A sample at an event of step `step`: resident memory now and `now` by category (their peaks too). Returns
    /// the sample's resident memory.
    pub fn event(&mut self, step: u64, event: String, now: &CategoryList) -> u64 {
        for (category, b) in now {
            let c = self.categories.entry(category.name().to_string()).or_default();
            c.peak_bytes = c.peak_bytes.max(*b as u64);
        }
        let (resident, high_water) = rss_since_reset();
        if self.measure_windows {
            if high_water > self.process_peak_bytes {
                self.process_peak_bytes = high_water;
                let after =
                    self.last_event
                        .as_ref()
                        .map(|(s, e)| if *s == step { e.clone() } else { format!("{e} (step {s})") });
                self.peak_window = Some(PeakWindow { step, after, before: event.clone(), rss_bytes: high_water });
            }
            reset_high_water(high_water);
        }
        self.last_event = Some((step, event.clone()));
        let sample = EventSample {
            step,
            event,
            rss_bytes: resident,
            categories: now.iter().map(|(n, b)| (n.name().to_string(), *b as u64)).collect(),
        };
        let rss = sample.rss_bytes;
        self.current_events.push(sample);
        rss
    }

    /// The highest event so far (kept or of the step in progress): its resident memory.
    pub fn highest_rss(&self) -> u64 {
        let kept = self.peak.as_ref().map_or(0, |p| p.rss_bytes);
        self.current_events.iter().map(|e| e.rss_bytes).fold(kept, u64::max)
    }

    /// Closes the step's timeline: it replaces the kept one when it holds a new peak; the step's sample (when
    /// taken) keeps its highest event.
    pub fn end_step(&mut self) {
        let events = std::mem::take(&mut self.current_events);
        let Some(top) = peak_of(&events) else { return };
        if let Some(last) = self.steps.last_mut().filter(|s| s.step == top.step) {
            last.peak_event = Some(top.clone());
        }
        if self.peak.as_ref().map_or(true, |p| top.rss_bytes > p.rss_bytes) {
            self.peak = Some(top.clone());
            self.peak_step_events = events;
        }
    }
}

/// Resident memory within this much of a step's highest event counts as the same level (pages touched by small
/// allocations in between, not a new need).
const FLAT_PEAK_SLACK: u64 = 4 << 20;

/// A step's peak event: its highest, or, where several are within [`FLAT_PEAK_SLACK`] of it, the one of them with
/// the least memory retained by the allocator (the most live). The engine's allocator keeps freed blocks up to
/// the step's own peak for the next step, so resident memory stays at its high-water mark from the moment the
/// step reached it (the end of forward, say) to its end; the event that explains the peak is the one where the
/// live bytes were there, not a later one where the same pages are kept for reuse.
fn peak_of(events: &[EventSample]) -> Option<&EventSample> {
    let highest = events.iter().map(|e| e.rss_bytes).max()?;
    let retained = |e: &EventSample| e.categories.get("allocator_retained").copied().unwrap_or(0);
    events
        .iter()
        .filter(|e| e.rss_bytes + FLAT_PEAK_SLACK >= highest)
        .min_by_key(|e| (retained(e), u64::MAX - e.rss_bytes))
}

/// Model-state bytes of a category list (see [`MODEL_STATE_CATEGORIES`]).
pub fn model_state_bytes(now: &CategoryList) -> u64 {
    now.iter().filter(|(n, _)| n.is_model_state()).map(|(_, b)| *b as u64).sum()
}

/// Where rank `rank`'s report goes in `dir`.
pub fn report_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("memory_rank{rank}.json"))
}

impl MemoryReport {
    /// Writes the report to `dir` (atomically); returns its path.
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        let path = report_path(dir, self.rank);
        std::fs::create_dir_all(dir).map_err(|e| ReportError::Io { path: dir.into(), what: e.to_string() })?;
        let text = serde_json::to_string_pretty(self).expect("the report serializes");
        zerorun_checkpoint::files::write_atomic(&path, text.as_bytes())
            .map_err(|e| ReportError::Io { path: path.clone(), what: e.to_string() })?;
        Ok(path)
    }

    /// Reads `memory_rank{r}.json`; a newer schema or a malformed file is an error naming it.
    /// ```no_run
    /// # fn main() -> Result<(), zerorun_report::ReportError> {
    /// // What `zerorun launch --memory-report run1` wrote for rank 0.
    /// let report = zerorun_report::memory::MemoryReport::read(std::path::Path::new("run1"), 0)?;
    /// if let Some(peak) = &report.peak {
    ///     println!("peak at `{}` of step {}: {} bytes resident", peak.event, peak.step, peak.rss_bytes);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn read(dir: &Path, rank: usize) -> Result<MemoryReport> {
        let path = report_path(dir, rank);
        let text =
            std::fs::read_to_string(&path).map_err(|e| ReportError::Io { path: path.clone(), what: e.to_string() })?;
        let format = |what: String| ReportError::Format { path: path.clone(), what };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format(format!("not JSON: {e}")))?;
        let found = v.get("schema_version").and_then(|x| x.as_u64()).unwrap_or(0) as u32;
        if found > SCHEMA_VERSION {
            return Err(format(format!("schema version {found} is newer than this zerorun reads ({SCHEMA_VERSION})")));
        }
        serde_json::from_value(v).map_err(|e| format(format!("not a zerorun memory report: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::{describe_peak, table};

    fn report(rank: usize) -> MemoryReport {
        let mut t = MemoryTracker::default();
        use MemoryCategory::*;
        t.sample(1, &[(Parameters, 1 << 20), (OptimizerStates, 2 << 20)], &[]);
        t.sample(2, &[(Parameters, 1 << 20), (OptimizerStates, 2 << 20)], &[(ParametersGathered, 3 << 20)]);
        MemoryReport {
            schema_version: SCHEMA_VERSION,
            rank,
            world_size: 2,
            stage: 3,
            precision: "fp32".into(),
            categories: t.categories,
            model_states: ModelStates { measured_bytes: 3 << 20, estimated_bytes: 3 << 20 },
            floor_rss_bytes: 1 << 20,
            init_peak_rss_bytes: 2 << 20,
            peak_rss_bytes: 100 << 20,
            steps: t.steps,
            peak: Some(EventSample {
                step: 2,
                event: "backward: unit 1 gradients".into(),
                rss_bytes: 10 << 20,
                categories: [("parameters_gathered".to_string(), 3 << 20)].into(),
            }),
            events: Vec::new(),
            pipeline: None,
            device: None,
            device_memory: None,
            unit_activations_bytes: Vec::new(),
            unit_input_bytes: Vec::new(),
            peak_allocations: None,
            alternatives: Vec::new(),
            peak_window: None,
            experts: None,
        }
    }

    /// A CUDA rank's report keeps the allocator's numbers through its file, and the table shows them.
    #[test]
    fn device_memory_travels_through_the_file_and_into_the_table() {
        let dir = std::env::temp_dir().join(format!("zerorun-device-memory-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut r = report(0);
        r.device = Some("cuda:0".into());
        r.device_memory = Some(DeviceMemory {
            allocated: 5 << 20,
            allocated_peak: 7 << 20,
            reserved: 8 << 20,
            reserved_peak: 9 << 20,
        });
        r.write(&dir).unwrap();
        let back = MemoryReport::read(&dir, 0).unwrap();
        assert_eq!(back.device.as_deref(), Some("cuda:0"));
        assert_eq!(back.device_memory, r.device_memory);
        let t = table(&[back, report(1)]);
        assert!(t.contains("device allocated (CUDA allocator)"), "{t}");
        assert!(t.contains("cuda:0"), "{t}");
        assert!(table(&[report(0)]).find("CUDA allocator").is_none(), "a CPU run's table names no device memory");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_flat_high_water_is_explained_where_the_live_bytes_reached_it() {
        let event = |name: &str, rss: u64, retained: u64| EventSample {
            step: 1,
            event: name.into(),
            rss_bytes: rss << 20,
            categories: [("allocator_retained".to_string(), retained << 20)].into(),
        };
        // Resident memory flat from forward's end to the step's end (freed blocks kept for the next step): the
        // peak is forward's end, where they were live, though the step's end sits 1 MiB higher.
        let flat = [event("forward: unit 0", 600, 300), event("forward", 749, 35), event("step done", 750, 242)];
        assert_eq!(peak_of(&flat).unwrap().event, "forward");
        // A clearly higher event is the peak whatever it retains.
        let higher = [event("forward", 749, 35), event("optimizer step", 760, 250)];
        assert_eq!(peak_of(&higher).unwrap().event, "optimizer step");
        assert!(peak_of(&[]).is_none());
    }

    #[test]
    fn the_peak_event_and_its_steps_timeline_are_kept() {
        let mut t = MemoryTracker::default();
        let (a, b) = (MemoryCategory::Parameters, MemoryCategory::GradientsUnit);
        t.event(1, "forward: unit 0 gathered".into(), &[(a, 1)]);
        t.event(1, "backward: unit 0 gradients".into(), &[(a, 1), (b, 2)]);
        t.end_step();
        let first = t.peak.clone().unwrap();
        assert_eq!(t.peak_step_events.len(), 2);
        // A step whose events all sit lower keeps the first step's timeline; a higher one replaces it.
        t.event(2, "x".into(), &[]);
        t.peak_step_events[0].rss_bytes = 0;
        t.current_events[0].rss_bytes = first.rss_bytes.saturating_sub(1);
        t.end_step();
        assert_eq!(t.peak.as_ref().unwrap().step, 1);
        t.event(3, "y".into(), &[]);
        t.current_events[0].rss_bytes = first.rss_bytes + 1;
        t.end_step();
        assert_eq!((t.peak.as_ref().unwrap().step, t.peak_step_events.len()), (3, 1));
        let p = EventSample {
            step: 4,
            event: "backward: unit 2 gradients".into(),
            rss_bytes: 100 << 20,
            categories: [(a.name().to_string(), 60 << 20), (b.name().to_string(), 30 << 20)].into(),
        };
        assert_eq!(p.unaccounted_bytes(4 << 20), 6 << 20);
        assert_eq!(
            describe_peak(&p, 4 << 20),
            "peak 100.00 MiB at step 4, backward: unit 2 gradients: floor 4.00 MiB, parameters 60.00 MiB, gradients_unit 30.00 MiB, unaccounted 6.00 MiB"
        );
    }

    #[test]
    fn version_1_reports_read_with_no_events() {
        let dir = std::env::temp_dir().join(format!("zerorun-report-v1-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut v = serde_json::to_value(report(0)).unwrap();
        let o = v.as_object_mut().unwrap();
        for k in ["peak", "events", "floor_rss_bytes"] {
            o.remove(k);
        }
        o.insert("schema_version".into(), 1.into());
        std::fs::write(report_path(&dir, 0), v.to_string()).unwrap();
        let r = MemoryReport::read(&dir, 0).unwrap();
        assert_eq!((r.peak, r.events.len(), r.floor_rss_bytes), (None, 0, 0));
        v["schema_version"] = 3.into();
        std::fs::write(report_path(&dir, 0), v.to_string()).unwrap();
        let e = MemoryReport::read(&dir, 0).unwrap_err().to_string();
        assert!(e.ends_with("schema version 3 is newer than this zerorun reads (2)"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reports_round_trip_and_newer_schemas_are_refused() {
        let dir = std::env::temp_dir().join(format!("zerorun-memreport-{}", std::process::id()));
        let r = report(1);
        let path = r.write(&dir).unwrap();
        assert_eq!(path, dir.join("memory_rank1.json"));
        assert_eq!(MemoryReport::read(&dir, 1).unwrap(), r);
        let text = std::fs::read_to_string(&path).unwrap().replace("\"schema_version\": 2", "\"schema_version\": 7");
        std::fs::write(&path, text).unwrap();
        let e = MemoryReport::read(&dir, 1).unwrap_err().to_string();
        assert_eq!(e, format!("{}: schema version 7 is newer than this zerorun reads (2)", path.display()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_table_has_a_row_per_category_and_a_column_per_rank() {
        let t = table(&[report(0), report(1)]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("memory (MiB)") && lines[0].ends_with("rank 1"), "{t}");
        assert!(lines[1].starts_with("parameters ") && lines[1].ends_with("1.00"), "{t}");
        assert!(t.contains("parameters_gathered") && t.contains("0.00 (peak 3.00)"), "{t}");
        assert!(t.contains("model states, estimate") && t.contains("peak RSS (process)"), "{t}");
        assert!(t.lines().any(|l| l.starts_with("process floor (RSS at initialize)") && l.ends_with("1.00")), "{t}");
        assert!(t.lines().any(|l| l.starts_with("unaccounted at the peak event") && l.ends_with("6.00")), "{t}");
        assert!(t.contains("rank 1: peak 10.00 MiB at step 2, backward: unit 1 gradients: floor 1.00 MiB, parameters_gathered 3.00 MiB, unaccounted 6.00 MiB"), "{t}");
    }
}
