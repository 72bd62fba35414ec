//! The engine's end of the memory report and the wall-clock breakdown: what it holds by category, sampling after
//! every optimizer step, printing every `steps_per_print`, and the files at the end of the run.
use std::path::PathBuf;

use tch::Tensor;

use crate::config::Precision;
use crate::engine::Engine;
use crate::error::Result;
use crate::estimate::{model_states_bytes, EstimateInput};
use crate::report::memory::{self, MemoryCategory, MemoryReport, ModelStates, SCHEMA_VERSION};

pub use crate::comm::env::MEMORY_REPORT_ENV;

/// What [`Engine::finish_memory_report`] wrote (rank 0 also drew the picture and made the table).
#[derive(Debug, Clone)]
pub struct MemoryReportFiles {
    pub json: PathBuf,
    /// Rank 0: the table of every rank and the pictures.
    pub table: Option<String>,
    pub svg: Option<PathBuf>,
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
    pub times: crate::report::PhaseTimes,
    pub comm_volume: crate::engine::CommVolume,
}

impl Engine {
    /// Bytes this rank holds, by category: `parameters` (the model-dtype values kept between steps: all of them
    /// at stages 0-2, the shard at stage 3), `parameters_nvme` (the shard's chunks on NVMe), `parameters_gathered` (stage 3 units gathered now), `gradients_full`
    /// (autograd's `.grad` tensors of the model, stages 0-2), `gradients_shard` (the fp32 reduced gradients of the
    /// optimized range), `master_fp32`, `optimizer_states`, `communication_buffers` (reduction staging),
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
        let (params_kept, params_nvme) = self.states.parameters.kept_bytes();
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
        if !self.report.sample_events {
            return;
        }
        let mut now = self.memory_bytes();
        now.extend_from_slice(extra);
        let step = self.progress.global_steps + 1;
        self.report.memory.event(step, label(), &now);
    }

    /// The sample after `initialize`: the initialisation's own timeline (step 0).
    pub(super) fn memory_event_initialized(&mut self) {
        if !self.report.sample_events {
            return;
        }
        let now = self.memory_bytes();
        self.report.memory.event(0, "initialized".into(), &now);
        self.report.memory.end_step();
    }

    /// After every optimizer step (taken or skipped): a memory sample and the step's phase times.
    pub(super) fn end_of_step(&mut self) {
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
                "wall_clock_breakdown"
            );
        }
        self.progress.step_started = None;
    }

    /// Time spent updating the parameters (the optimizer's own work, without the norm's collectives) so far.
    pub(crate) fn optimizer_time(&self) -> std::time::Duration {
        self.report.times.total(crate::report::Phase::Step)
    }

    /// The mean time per step of each phase so far, as one line (`wall_clock_breakdown`).
    pub fn wall_clock_summary(&self) -> String {
        self.report.times.summary()
    }

    /// Model-state bytes by ZeRO's formula for this run (the estimator's number).
    pub fn estimated_model_state_bytes(&self) -> u64 {
        let (frozen_params, frozen_bytes) = match &self.states.parameters.frozen_units {
            Some(f) => (f.layout.numel as u64, f.specs().first().map(|s| s.2.elt_size_in_bytes() as u64)),
            None => (
                self.states.frozen.iter().map(|(_, t)| t.numel() as u64).sum(),
                self.states.frozen.first().map(|(_, t)| t.kind().elt_size_in_bytes() as u64),
            ),
        };
        let input = EstimateInput {
            gpus_per_node: self.world_size() as u64,
            frozen_params,
            frozen_bytes_per_param: frozen_bytes,
            ..EstimateInput::new(self.states.layout.numel as u64)
        }
        .with_config(&self.config);
        model_states_bytes(&input, self.plan.stage())
    }

    /// This rank's report: the categories' current and peak bytes, model states measured and estimated, the
    /// process's peak RSS and the per-step samples.
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
        }
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
        self.comm.barrier()?;
        let mut files = MemoryReportFiles { json, table: None, svg: None, png: None };
        if self.rank() == 0 {
            let reports = (0..self.world_size())
                .map(|r| MemoryReport::read(&dir, r))
                .collect::<zerorun_report::Result<Vec<_>>>()?;
            let (svg, png) = crate::report::plot::draw_memory(&dir, &reports)?;
            files.table = Some(memory::table(&reports));
            files.svg = Some(svg);
            files.png = Some(png);
        }
        self.comm.barrier()?;
        Ok(files)
    }
}
