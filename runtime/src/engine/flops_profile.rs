//! `flops_profiler`: one optimizer step (`profile_step`) profiled on the rank that writes the monitors. With units,
//! each unit's forward runs under libtorch's profiler (`with_flops`: FLOPs from the shapes its matmuls, linears,
//! convolutions and attention ran with), timed on its own; backward counts (2 + `recompute_fwd_factor`) x the
//! forward's FLOPs, as DeepSpeed's profiler does. Without units the whole step (forward, backward and the optimizer
//! step) runs under the profiler and its measured FLOPs are the model's row. The step's forward, backward and
//! optimizer latencies are the phase timers' (`wall_clock_breakdown`, which the profiler turns on).
use std::fmt::Write;
use std::time::Duration;

use super::device::native;
use super::Engine;
use crate::error::Result;
use crate::report::Phase;

/// One unit's forward in the profiled step (summed over its micro-batches and entries).
#[derive(Debug, Clone, Default)]
struct UnitRow {
    name: String,
    params: u64,
    flops: u64,
    time: Duration,
}

/// The profile in progress (or done) of one step.
#[derive(Debug, Default)]
pub(crate) struct FlopsProfile {
    rows: Vec<UnitRow>,
    /// Without units: the whole step ran under the profiler, started at the previous step's end.
    whole_step: bool,
    /// The finished report.
    pub report: Option<String>,
}

impl Engine {
    /// Whether the step in progress is the one `flops_profiler` profiles on this rank.
    pub(super) fn profiling_this_step(&self) -> bool {
        let p = &self.config.monitor.flops_profiler;
        p.enabled && self.progress.global_steps + 1 == p.profile_step && self.writes_monitors()
    }

    /// Runs a unit's forward (outermost scopes), counting its FLOPs when this step is profiled.
    pub(super) fn profile_unit<T>(
        &mut self,
        u: usize,
        name: &str,
        forward: impl FnOnce(&mut Engine) -> T,
    ) -> Result<T> {
        if !self.profiling_this_step() || self.watch.profile.whole_step {
            return Ok(forward(self));
        }
        native::flops_start()?;
        let started = std::time::Instant::now();
        let out = forward(self);
        let time = started.elapsed();
        let (flops, _) = native::flops_stop()?;
        let params = self.states.parameters.unit_elements(u);
        let rows = &mut self.watch.profile.rows;
        if rows.len() <= u {
            rows.resize(u + 1, UnitRow::default());
        }
        let row = &mut rows[u];
        row.name = name.to_string();
        row.params = params;
        row.flops += flops;
        row.time += time;
        Ok(out)
    }

    /// At the end of every step: starts the whole-step profile of a model without units before its profiled step
    /// (at set-up for step 1), and writes the report after it.
    pub(super) fn profile_step_boundary(&mut self, times: &[Duration; Phase::COUNT]) {
        let p = &self.config.monitor.flops_profiler;
        if !p.enabled || !self.writes_monitors() {
            return;
        }
        let (done, profile_step) = (self.progress.global_steps, p.profile_step);
        if done == profile_step {
            let whole = self.watch.profile.whole_step.then(native::flops_stop);
            let report = self.flops_report(times, whole.and_then(|r| r.ok()).map(|(f, _)| f));
            tracing::info!("\n{report}");
            if let Some(path) = &self.config.monitor.flops_profiler.output_file {
                if let Err(e) = std::fs::write(path, &report) {
                    tracing::error!(file = %path, "flops_profiler.output_file: {e}");
                }
            }
            self.watch.profile.report = Some(report);
        } else if done + 1 == profile_step {
            self.start_whole_step_profile();
        }
    }

    /// A model without units is profiled as one piece over its whole step.
    pub(super) fn start_whole_step_profile(&mut self) {
        if self.walk.unit_prefixes.is_empty() || self.plan.gradients != super::zero::plan::GradientPath::UnitWalk {
            self.watch.profile.whole_step = native::flops_start().is_ok();
        }
    }

    /// The flops profiler's report of its step (None before it ran, or when it is off).
    pub fn flops_profile(&self) -> Option<&str> {
        self.watch.profile.report.as_deref()
    }

    fn flops_report(&self, times: &[Duration; Phase::COUNT], whole_step_flops: Option<u64>) -> String {
        let p = &self.config.monitor.flops_profiler;
        let ms = |phase: Phase| times[phase as usize].as_secs_f64() * 1e3;
        let (fwd, bwd, step) = (
            ms(Phase::Forward) + ms(Phase::AllGather),
            ms(Phase::Backward) + ms(Phase::ReduceScatter),
            ms(Phase::Step),
        );
        let iter = fwd + bwd + step;
        let bwd_factor = 2.0 + p.recompute_fwd_factor;
        let model_params = self.states.layout.numel as u64;
        let held = match self.plan.partitions_parameters() {
            true => self.states.layout.shard_len(self.rank()) as u64,
            false => model_params,
        };
        let b = self.batch;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "-------------------------- zerorun flops profiler: step {} --------------------------",
            p.profile_step
        );
        let _ = writeln!(s, "world size:                     {}", self.world_size());
        let _ = writeln!(
            s,
            "batch size per rank:            {}",
            b.train_micro_batch_size_per_gpu * b.gradient_accumulation_steps
        );
        let _ = writeln!(s, "params of model:                {}", human(model_params as f64, ""));
        let _ = writeln!(s, "params held per rank:           {}", human(held as f64, ""));
        let fwd_flops: u64 = match whole_step_flops {
            Some(total) => {
                let _ = writeln!(s, "flops of the step per rank:     {} (measured over forward, backward and the optimizer step: no units to split it by)", human(total as f64, "FLOPs"));
                let _ = writeln!(
                    s,
                    "FLOPS per rank:                 {}",
                    human(total as f64 / (iter / 1e3).max(1e-9), "FLOPS")
                );
                (total as f64 / (1.0 + bwd_factor)) as u64
            }
            None => self.watch.profile.rows.iter().map(|r| r.flops).sum(),
        };
        let secs = |ms: f64| (ms / 1e3).max(1e-9);
        if whole_step_flops.is_none() {
            let _ = writeln!(s, "fwd flops per rank:             {}", human(fwd_flops as f64, "FLOPs"));
            let _ = writeln!(s, "fwd latency:                    {fwd:.2} ms");
            let _ = writeln!(s, "fwd FLOPS per rank:             {}", human(fwd_flops as f64 / secs(fwd), "FLOPS"));
            let _ = writeln!(s, "bwd latency:                    {bwd:.2} ms");
            let _ = writeln!(
                s,
                "bwd FLOPS per rank:             {}",
                human(bwd_factor * fwd_flops as f64 / secs(bwd), "FLOPS")
            );
            let _ = writeln!(
                s,
                "fwd+bwd FLOPS per rank:         {}",
                human((1.0 + bwd_factor) * fwd_flops as f64 / secs(fwd + bwd), "FLOPS")
            );
        }
        let _ = writeln!(s, "step latency:                   {step:.2} ms");
        let _ = writeln!(s, "iter latency:                   {iter:.2} ms");
        if whole_step_flops.is_none() {
            let _ = writeln!(
                s,
                "FLOPS per rank:                 {}",
                human((1.0 + bwd_factor) * fwd_flops as f64 / secs(iter), "FLOPS")
            );
        }
        let _ = writeln!(s, "samples/second:                 {:.2}", b.train_batch_size as f64 / secs(iter));
        if p.detailed && whole_step_flops.is_none() {
            let total_time: f64 = self.watch.profile.rows.iter().map(|r| r.time.as_secs_f64()).sum();
            let _ = writeln!(
                s,
                "\n{:<24}{:>12}{:>10}{:>14}{:>10}{:>14}{:>11}{:>14}",
                "unit", "params", "% params", "fwd FLOPs", "% FLOPs", "fwd latency", "% latency", "fwd FLOPS"
            );
            for r in self.watch.profile.rows.iter().filter(|r| !r.name.is_empty()) {
                let t = r.time.as_secs_f64();
                let _ = writeln!(
                    s,
                    "{:<24}{:>12}{:>9.2}%{:>14}{:>9.2}%{:>11.2} ms{:>10.2}%{:>14}",
                    r.name,
                    human(r.params as f64, ""),
                    100.0 * r.params as f64 / model_params.max(1) as f64,
                    human(r.flops as f64, ""),
                    100.0 * r.flops as f64 / fwd_flops.max(1) as f64,
                    t * 1e3,
                    100.0 * t / total_time.max(1e-12),
                    human(r.flops as f64 / t.max(1e-9), "")
                );
            }
            let _ = writeln!(s, "(units' latencies are their forwards' own, gathers excluded; the fwd latency above is the step's forward, gathers included)");
        }
        s
    }
}

/// 1000-based, as DeepSpeed's profiler prints counts ("6.28 G").
fn human(v: f64, unit: &str) -> String {
    let (scaled, prefix) = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")]
        .into_iter()
        .find(|(f, _)| v >= *f)
        .map_or((v, ""), |(f, p)| (v / f, p));
    match unit {
        "" => format!("{scaled:.2}{prefix}"),
        _ => format!("{scaled:.2} {prefix}{unit}"),
    }
}
