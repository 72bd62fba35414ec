//! What the engine measures for the memory report and the wall-clock breakdown, and the engine's methods that
//! read it: memory by category (they walk every part), the samples at its events and after every optimizer step,
//! the measured categories (activations, temporaries, what malloc keeps), the report's files at the end.
use std::path::PathBuf;

use tch::Tensor;

use super::Engine;
use crate::config::Precision;
use crate::error::Result;
use crate::estimate::{model_states_bytes, EstimateInput};
use crate::report::allocations::{self, Counting, Owner};
use crate::report::memory::{self, MemoryCategory, MemoryReport, ModelStates, SCHEMA_VERSION};

pub use crate::comm::env::MEMORY_REPORT_ENV;

/// What [`Engine::finish_memory_report`](crate::engine::Engine::finish_memory_report) wrote (rank 0 also drew the picture and made the table).
#[derive(Debug, Clone)]
pub struct MemoryReportFiles {
    /// This rank's report.
    pub json: PathBuf,
    /// Rank 0: the table of every rank and the pictures.
    pub table: Option<String>,
    /// Rank 0: the per-step picture (SVG).
    pub svg: Option<PathBuf>,
    /// Rank 0: the same as PNG.
    pub png: Option<PathBuf>,
}

/// What the engine measures for its reports.
#[derive(Default)]
pub(crate) struct Reporting {
    /// Resident memory when the engine's set-up began, less the model's variables: the process floor the memory
    /// report names.
    pub floor_rss_bytes: u64,
    /// The process's peak resident memory when set-up ended.
    pub init_peak_rss_bytes: u64,
    /// Whether the engine samples memory at its events (a report is asked for; see `memory_event`).
    pub sample_events: bool,
    pub memory: crate::report::memory::MemoryTracker,
    /// The counting allocator's share: the measured categories (activations, temporaries) come from it. None:
    /// turned off (`ZERORUN_COUNT_ALLOCATIONS=0`).
    pub counting: Option<Counting>,
    /// Recording the largest allocations at the highest event (`ZERORUN_MEMORY_SNAPSHOT=1`).
    pub snapshot: bool,
    /// The largest live allocations at the highest event so far.
    pub peak_allocations: Option<memory::PeakAllocations>,
    /// Stage 3: live bytes each unit's forward kept, and each unit's input bytes (the last training forward).
    pub unit_activations: Vec<u64>,
    pub unit_inputs: Vec<u64>,
    pub times: crate::report::PhaseTimes,
    pub comm_volume: crate::engine::CommVolume,
}

/// What the engine reports: memory by category, the memory report's files, the wall-clock breakdown.
impl Engine {
    /// Bytes this rank holds, by category: `parameters` (the model-dtype values kept between steps: all of them
    /// at stages 0-2, the shard at stage 3), `parameters_nvme` (the shard's chunks on NVMe), `parameters_gathered` (stage 3 units gathered now), `gradients_full`
    /// (autograd's `.grad` tensors of the model, stages 0-2), `gradients_shard` (the fp32 reduced gradients of the
    /// optimized range), `master_fp32`, `optimizer_states` (in memory), `optimizer_states_nvme`,
    /// `communication_buffers` (reduction staging), `offload_buffers` (the NVMe tiers' swap buffers and staging),
    /// `frozen_parameters` (all of them at stages 0-2; at stage 3 this rank's shard; gathered units,
    /// persistent ones too, count in `parameters_gathered`) and `buffers` (BatchNorm's statistics, whole on every rank).
    pub fn memory_bytes(&self) -> Vec<(MemoryCategory, usize)> {
        let bytes = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        let (view_buffer, staging, partition) = self.gradients.buffer_bytes();
        // With gradient views the `.grad` tensors are the gradient buffer: counted once, as the full gradients.
        let full = match view_buffer {
            Some(b) => b,
            None => self.states.params.iter().map(|t| t.grad()).filter(Tensor::defined).map(|g| bytes(&g)).sum(),
        };
        // Stage 0 reducing in the staging buffer: it is the full gradients (views) or the reduced ones.
        let in_staging =
            !self.plan.partitions_optimizer() && (view_buffer.is_some() || self.gradients.in_flat_buffer());
        let shard = if !self.plan.partitions_optimizer() && view_buffer.is_none() && self.gradients.in_flat_buffer() {
            staging
        } else {
            self.gradients.accumulator_bytes()
        };
        let staging = if in_staging { 0 } else { staging };
        let (params_kept, params_nvme, params_buffers) = self.states.parameters.kept_bytes();
        use MemoryCategory::*;
        vec![
            (Parameters, params_kept),
            (ParametersNvme, params_nvme),
            (ParametersGathered, self.states.parameters.gathered.current),
            (GradientsFull, full),
            (GradientsShard, shard),
            (MasterFp32, self.shard.master.as_ref().map_or(0, |m| m.numel() * 4)),
            (OptimizerStates, self.shard.tier.resident_bytes()),
            (OptimizerStatesNvme, self.shard.tier.swapped_bytes()),
            (CommunicationBuffers, staging + partition),
            (OffloadBuffers, params_buffers + self.shard.tier.buffer_bytes()),
            (
                FrozenParameters,
                self.states
                    .parameters
                    .frozen_units
                    .as_ref()
                    .map_or_else(|| crate::engine::zero::variables::bytes_of(&self.states.frozen), |f| f.shard_bytes()),
            ),
            (Buffers, crate::engine::zero::variables::bytes_of(&self.states.buffers)),
        ]
    }

    /// A memory sample at one of the engine's events (`label()` names it; `extra`: transient bytes that exist only
    /// around it, such as a unit's gradients before their reduction). Events belong to the step in progress.
    /// Sampled only when a report is asked for (`memory_breakdown`, `zerorun launch --memory-report`): each
    /// sample reads /proc and walks the categories, too much for every unit of every step otherwise.
    pub(super) fn memory_event(&mut self, label: impl FnOnce() -> String, extra: &[(MemoryCategory, usize)]) {
        if self.report.sample_events {
            self.sample_event(self.progress.global_steps + 1, label(), extra);
        }
    }

    /// One event of step `step`: the engine's categories with `extra` and the measured ones, the process's window
    /// (where this engine is the process's one: windows reset its VmHWM), and the largest allocations when it is
    /// the highest event so far and they are recorded. Returns the event's resident memory.
    fn sample_event(&mut self, step: u64, label: String, extra: &[(MemoryCategory, usize)]) -> u64 {
        let mut now = self.memory_bytes();
        now.extend_from_slice(extra);
        let measured = self.measured_categories(&now);
        now.extend(measured);
        let highest = self.report.memory.highest_rss();
        let live = self.live_bytes();
        self.report.memory.measure_windows = live.is_some();
        let rss = self.report.memory.event(step, label.clone(), &now);
        if self.report.snapshot && rss > highest {
            let allocations = allocations::largest(20)
                .into_iter()
                .map(|b| memory::Allocation { bytes: b.bytes, owner: b.owner.name().into(), op: b.op, phase: b.phase })
                .collect();
            self.report.peak_allocations = Some(memory::PeakAllocations {
                step,
                event: label,
                rss_bytes: rss,
                live_bytes: live.unwrap_or_default().total,
                allocations,
            });
        }
        rss
    }

    /// The counting allocator's counters, when this engine is the only counting one in the process.
    fn live_bytes(&self) -> Option<allocations::LiveBytes> {
        self.report.counting.as_ref().and_then(Counting::live)
    }

    /// The phase the allocations from now on belong to, for the largest-allocations snapshot (when it is on).
    pub(super) fn enter_phase(&self, phase: impl FnOnce() -> String) {
        if self.report.snapshot {
            allocations::set_phase(&phase());
        }
    }

    /// What the counting allocator and malloc say at an event, beside the engine's categories `now`:
    /// `activations` (live bytes the model's forward made), `temporaries` (live bytes of the program and of
    /// autograd's backward, less the gradients the engine counts already) and `allocator_retained` (the blocks the
    /// counting allocator keeps for reuse and malloc's free blocks). Nothing when the allocator does not count for this engine alone.
    fn measured_categories(&self, now: &[(MemoryCategory, usize)]) -> Vec<(MemoryCategory, usize)> {
        let Some(live) = self.live_bytes() else { return Vec::new() };
        let engine_counted =
            |c: MemoryCategory| now.iter().filter(|(n, _)| *n == c).map(|(_, b)| *b as u64).sum::<u64>();
        // Autograd allocates the `.grad` tensors (unless they are views of the engine's buffer) and a stage 3
        // unit's gradients in backward: the engine counts them already.
        let autograd_grads =
            if self.gradients.buffer_bytes().0.is_none() { engine_counted(MemoryCategory::GradientsFull) } else { 0 }
                + engine_counted(MemoryCategory::GradientsUnit);
        let temporaries = (live.of(Owner::Program) + live.of(Owner::Backward)).saturating_sub(autograd_grads);
        let activations = live.of(Owner::Forward);
        // The kept blocks and malloc's free blocks, as far as resident memory shows them: a trimmed heap keeps its
        // free blocks in the books (`fordblks`) but not in memory, so the rest of the resident set bounds them.
        let resident: u64 =
            now.iter().filter(|(n, _)| !memory::is_on_nvme(n.name())).map(|(_, b)| *b as u64).sum::<u64>()
                + activations
                + temporaries;
        let unexplained = memory::rss().0.saturating_sub(self.report.floor_rss_bytes + resident);
        let kept = live.kept + crate::comm::region::kept_bytes() as u64;
        let retained = (kept + allocations::malloc_free_bytes()).min(unexplained);
        vec![
            (MemoryCategory::Activations, activations as usize),
            (MemoryCategory::Temporaries, temporaries as usize),
            (MemoryCategory::AllocatorRetained, retained as usize),
        ]
    }

    /// Stage 3, after unit `i`'s forward: what it left alive for backward since `before` (forward's live bytes
    /// then) and its input's bytes.
    pub(super) fn record_unit_activations(&mut self, i: usize, before: u64, input: &Tensor) {
        self.record_unit_activation_bytes(i, before, (input.numel() * input.kind().elt_size_in_bytes()) as u64);
    }

    /// [`Engine::record_unit_activations`] with the input's bytes given (0 for a scope, whose inputs are whatever
    /// its closure reads).
    pub(super) fn record_unit_activation_bytes(&mut self, i: usize, before: u64, input_bytes: u64) {
        let Some(live) = self.live_bytes() else { return };
        let n = self.states.parameters.units.len();
        self.report.unit_activations.resize(n, 0);
        self.report.unit_inputs.resize(n, 0);
        self.report.unit_activations[i] = live.of(Owner::Forward).saturating_sub(before);
        self.report.unit_inputs[i] = input_bytes;
    }

    /// Live bytes of the model's forward now (0 without counting).
    pub(super) fn forward_live_bytes(&self) -> u64 {
        self.live_bytes().map_or(0, |l| l.of(Owner::Forward))
    }

    /// The sample after `initialize`: the initialisation's own timeline (step 0).
    pub(super) fn memory_event_initialized(&mut self) {
        if !self.report.sample_events {
            return;
        }
        self.sample_event(0, "initialized".into(), &[]);
        self.report.memory.end_step();
    }

    /// After every optimizer step (taken or skipped): a memory sample and the step's phase times (returned).
    pub(super) fn end_of_step(&mut self) -> [std::time::Duration; crate::report::Phase::COUNT] {
        // The step's last event: after the step's own tail (stage 3 regathers kept units), so its window ends.
        if self.report.sample_events {
            self.sample_event(self.progress.global_steps, "step done".into(), &[]);
        }
        let now = self.memory_bytes();
        let peaks = [(MemoryCategory::ParametersGathered, self.states.parameters.gathered.step_peak)];
        self.report.memory.sample(self.progress.global_steps, &now, &peaks);
        self.states.parameters.gathered.step_peak = self.states.parameters.gathered.current;
        let times = self.report.times.end_step();
        if self.config.wall_clock_breakdown
            && self.rank() == 0
            && self.config.steps_per_print.is_some_and(|k| self.progress.global_steps % k == 0)
        {
            let ms = |p: crate::report::Phase| times[p as usize].as_secs_f64() * 1e3;
            use crate::report::Phase::*;
            tracing::info!(
                step = self.progress.global_steps,
                forward_ms = ms(Forward),
                backward_ms = ms(Backward),
                step_ms = ms(Step),
                all_gather_ms = ms(AllGather),
                reduce_scatter_ms = ms(ReduceScatter),
                offload_io_ms = ms(OffloadIo),
                compression_ms = ms(Compression),
                all_to_all_ms = ms(AllToAll),
                "wall_clock_breakdown"
            );
        }
        self.progress.step_started = None;
        times
    }

    /// Time spent updating the parameters (the optimizer's own work, without the norm's collectives) so far.
    pub(crate) fn optimizer_time(&self) -> std::time::Duration {
        self.report.times.total(crate::report::Phase::Step)
    }

    /// The mean time per step of each phase so far, as one line (`wall_clock_breakdown`).
    pub fn wall_clock_summary(&self) -> String {
        self.report.times.summary()
    }

    /// Model states other configurations would leave resident on this rank (the estimator's counts): the higher
    /// stages, the optimizer's states offloaded, at stage 3 the parameters too, and at stage 2 of a mixture of
    /// experts the widest expert-parallel degree (each position's experts a unit of their own). To NVMe on a CPU model (its
    /// memory is the host's), to the host on a device.
    fn alternatives(&self) -> Vec<memory::Alternative> {
        use crate::config::OffloadDevice;
        let input = self.estimate_input();
        let stage = self.plan.stage();
        let (_, g, o) = input.bytes_per_param();
        let (psi, n) = (input.params as f64, self.comm.world_size().max(1) as f64);
        let z = &self.config.zero_optimization;
        let mut out: Vec<memory::Alternative> = (stage + 1..=3)
            .map(|s| memory::Alternative {
                change: format!("zero_optimization.stage: {s}"),
                model_states_bytes: model_states_bytes(&input, s),
            })
            .collect();
        let to = if self.device() == tch::Device::Cpu { "nvme" } else { "cpu" };
        let now = model_states_bytes(&input, stage);
        if self.plan.partitions_optimizer() && z.offload_optimizer.device == OffloadDevice::None {
            out.push(memory::Alternative {
                change: format!("zero_optimization.offload_optimizer.device: {to}"),
                model_states_bytes: now.saturating_sub((psi * o as f64 / n).round() as u64),
            });
        }
        if self.plan.partitions_parameters() && z.offload_param.device == OffloadDevice::None {
            out.push(memory::Alternative {
                change: format!("zero_optimization.offload_optimizer.device and offload_param.device: {to}"),
                model_states_bytes: (psi * g as f64 / n).round() as u64,
            });
        }
        // Stage 2 with units: at the widest expert-parallel degree the model allows, with each position's experts
        // a unit (`MoeLayer::expert_units`, as the Llama example gives them), a rank keeps its own experts only.
        if self.plan.shard_in_pieces() && self.plan.gradients == crate::engine::zero::plan::GradientPath::UnitWalk {
            let layout = &self.states.layout;
            let names = layout.slots.iter().map(|s| s.name.as_str());
            let degrees = crate::engine::zero::expert_units::allowed_degrees(names, self.comm.world_size());
            if let Some(&e) = degrees.last().filter(|&&e| e as u64 > input.expert_parallel) {
                let experts = layout.slots.iter().filter(|s| crate::moe::is_expert_parameter(&s.name));
                let input = EstimateInput { expert_parallel: e as u64, ..input.clone() }
                    .with_experts(experts.map(|s| s.range.len() as u64).sum());
                out.push(memory::Alternative {
                    change: format!("expert_parallel.autoep_size: {e}"),
                    model_states_bytes: model_states_bytes(&input, stage),
                });
            }
        }
        out
    }

    fn estimate_input(&self) -> EstimateInput {
        let (frozen_params, frozen_bytes) = match &self.states.parameters.frozen_units {
            Some(f) => (f.layout.numel as u64, f.specs().first().map(|s| s.2.elt_size_in_bytes() as u64)),
            None => (
                self.states.frozen.iter().map(|(_, t)| t.numel() as u64).sum(),
                self.states.frozen.first().map(|(_, t)| t.kind().elt_size_in_bytes() as u64),
            ),
        };
        // Units of one expert-parallel position's experts, split over that position's ranks.
        let layout = &self.states.layout;
        let grouped = layout.units.iter().filter(|u| u.ranks != crate::engine::zero::layout::UnitRanks::All);
        let expert_params = grouped.flat_map(|u| &layout.slots[u.slots.clone()]).map(|s| s.range.len() as u64).sum();
        EstimateInput {
            gpus_per_node: self.comm.world_size() as u64,
            frozen_params,
            frozen_bytes_per_param: frozen_bytes,
            ..EstimateInput::new(layout.numel as u64)
        }
        .with_config(&self.config)
        .with_experts(expert_params)
    }

    /// Model-state bytes by ZeRO's formula for this run (the estimator's number).
    pub fn estimated_model_state_bytes(&self) -> u64 {
        model_states_bytes(&self.estimate_input(), self.plan.stage())
    }

    /// This rank's report: the categories' current and peak bytes, model states measured and estimated, the
    /// process's peak RSS and the per-step samples.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use tch::nn::{self, Module};
    /// # use tch::{Device, Kind, Tensor};
    /// # let vs = nn::VarStore::new(Device::Cpu);
    /// # let (l0, l1) = (nn::linear(vs.root() / "l0", 4, 8, Default::default()), nn::linear(vs.root() / "l1", 8, 1, Default::default()));
    /// # let model = zerorun_runtime::engine::Sequence::new().unit(["l0"], move |x| l0.forward(x).relu()).unit(["l1"], move |x| l1.forward(x));
    /// # let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// # let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// # let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, zerorun_runtime::EngineOptions::default().units_of(&model))?;
    /// # let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// let report = engine.memory_report();
    /// let model_states = report.model_states.measured_bytes;
    /// assert!(model_states > 0 && report.peak_rss_bytes > model_states);
    /// # Ok(()) }
    /// ```
    pub fn memory_report(&self) -> MemoryReport {
        let now = self.memory_bytes();
        let mut tracker_categories = self.report.memory.categories.clone();
        for (category, b) in &now {
            let c = tracker_categories.entry(category.name().to_string()).or_default();
            c.current_bytes = *b as u64;
            c.peak_bytes = c.peak_bytes.max(*b as u64);
        }
        MemoryReport {
            schema_version: SCHEMA_VERSION,
            rank: self.rank(),
            world_size: self.world_size(),
            stage: self.plan.stage(),
            precision: match self.precision() {
                Precision::Fp32 => "fp32",
                Precision::Bf16 => "bf16",
                Precision::Fp16 => "fp16",
            }
            .into(),
            categories: tracker_categories,
            model_states: ModelStates {
                measured_bytes: memory::model_state_bytes(&now),
                estimated_bytes: self.estimated_model_state_bytes(),
            },
            floor_rss_bytes: self.report.floor_rss_bytes,
            init_peak_rss_bytes: self.report.init_peak_rss_bytes,
            peak: self.report.memory.peak.clone(),
            events: self.report.memory.peak_step_events.clone(),
            peak_rss_bytes: memory::rss().1,
            steps: self.report.memory.steps.clone(),
            pipeline: None,
            device: (self.device() != tch::Device::Cpu).then(|| match self.device() {
                tch::Device::Cuda(i) => format!("cuda:{i}"),
                other => format!("{other:?}"),
            }),
            device_memory: crate::cuda::device_memory(self.device()),
            unit_activations_bytes: self.report.unit_activations.clone(),
            unit_input_bytes: self.report.unit_inputs.clone(),
            peak_allocations: self.report.peak_allocations.clone(),
            alternatives: self.alternatives(),
            peak_window: self.report.memory.peak_window.clone(),
            experts: self.expert_states(&now),
        }
    }

    /// A mixture of experts' part of this rank's model states (`moe::is_expert_parameter` names them): each
    /// category in the proportion of expert elements in what it holds: every parameter (stages 0-2's parameters but
    /// another expert-parallel position's experts, full gradients), or this rank's optimized pieces (its partition: stage 3's parameters, the gradient shard,
    /// the master and the optimizer's states). None for a model without experts.
    fn expert_states(&self, now: &[(MemoryCategory, usize)]) -> Option<crate::report::memory::ExpertStates> {
        let layout = &self.states.layout;
        let expert = |slot: &crate::engine::ParamSlot| crate::moe::is_expert_parameter(&slot.name);
        let parameters: usize = layout.slots.iter().filter(|s| expert(s)).map(|s| s.range.len()).sum();
        if parameters == 0 {
            return None;
        }
        let whole = parameters as f64 / layout.numel as f64;
        let pieces = self.optimized_pieces(self.comm.rank());
        let elements = |pick: &dyn Fn(&crate::engine::ParamSlot) -> bool| -> usize {
            pieces.iter().flat_map(|p| layout.runs_where(p.clone(), pick)).map(|r| r.len()).sum()
        };
        let held = elements(&|_| true);
        let partition = if held == 0 { 0.0 } else { elements(&expert) as f64 / held as f64 };
        // Stage 2 with units split over expert-parallel groups: the parameters are the units this rank holds.
        let rank = self.comm.rank();
        let resident = if layout.has_groups() && !self.plan.partitions_parameters() {
            let held = layout.units.iter().filter(|u| u.holds(rank));
            let experts: usize = held.flat_map(|u| layout.runs_where(u.range.clone(), &expert)).map(|r| r.len()).sum();
            experts as f64 / layout.resident_len(rank).max(1) as f64
        } else {
            whole
        };
        let stage3 = self.plan.stage() == 3;
        use MemoryCategory::*;
        let categories = now
            .iter()
            .filter_map(|(category, bytes)| {
                let share = match category {
                    Parameters | ParametersNvme if stage3 => partition,
                    Parameters | ParametersNvme => resident,
                    GradientsFull => whole,
                    GradientsShard | MasterFp32 | OptimizerStates | OptimizerStatesNvme => partition,
                    _ => return None,
                };
                Some((category.name().to_string(), (*bytes as f64 * share).round() as u64))
            })
            .collect();
        Some(crate::report::memory::ExpertStates {
            parameters: parameters as u64,
            model_parameters: layout.numel as u64,
            categories,
        })
    }

    /// Where the memory report goes: `zerorun launch --memory-report DIR` (through the environment), else the
    /// working directory when the config sets `memory_breakdown`; None: no report.
    pub fn memory_report_dir(&self) -> Option<PathBuf> {
        match std::env::var(MEMORY_REPORT_ENV) {
            Ok(d) if !d.is_empty() => Some(PathBuf::from(d)),
            _ => self.config.memory_breakdown.then(|| PathBuf::from(".")),
        }
    }

    /// At the end of a run, when a report is asked for: every rank writes `memory_rank{r}.json`; rank 0 then
    /// reads them all, draws `memory.svg` and `memory.png` and returns the table. Collective. None: no report.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use tch::nn::{self, Module};
    /// # use tch::{Device, Kind, Tensor};
    /// # let vs = nn::VarStore::new(Device::Cpu);
    /// # let (l0, l1) = (nn::linear(vs.root() / "l0", 4, 8, Default::default()), nn::linear(vs.root() / "l1", 8, 1, Default::default()));
    /// # let model = zerorun_runtime::engine::Sequence::new().unit(["l0"], move |x| l0.forward(x).relu()).unit(["l1"], move |x| l1.forward(x));
    /// # let config: zerorun_runtime::Config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 3}}"#.parse()?;
    /// # let mesh = zerorun_runtime::Mesh::from_env(&config, Default::default())?;
    /// # let mut engine = zerorun_runtime::initialize_with(&vs, config, mesh, zerorun_runtime::EngineOptions::default().units_of(&model))?;
    /// # let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    /// // With `zerorun launch --memory-report DIR` (or `memory_breakdown: true`): files and, on rank 0, the table.
    /// if let Some(files) = engine.finish_memory_report()? {
    ///     if let Some(table) = files.table { println!("{table}") }
    /// }
    /// # Ok(()) }
    /// ```
    pub fn finish_memory_report(&mut self) -> Result<Option<MemoryReportFiles>> {
        match self.memory_report_dir() {
            Some(dir) => self.write_memory_report(&dir).map(Some),
            None => Ok(None),
        }
    }

    /// Writes the memory report into `dir` now (see [`Engine::finish_memory_report`]). Collective.
    pub fn write_memory_report(&mut self, dir: &std::path::Path) -> Result<MemoryReportFiles> {
        let dir = dir.to_path_buf();
        let json = self.memory_report().write(&dir)?;
        self.comm.barrier_data()?;
        let mut files = MemoryReportFiles { json, table: None, svg: None, png: None };
        if self.rank() == 0 {
            let reports = (0..self.world_size())
                .map(|r| MemoryReport::read(&dir, r))
                .collect::<zerorun_report::Result<Vec<_>>>()?;
            let (svg, png) = crate::report::plot::draw_memory(&dir, &reports)?;
            files.table = Some(crate::report::table::table(&reports));
            files.svg = Some(svg);
            files.png = Some(png);
        }
        self.comm.barrier_data()?;
        Ok(files)
    }
}
