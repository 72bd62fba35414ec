//! The monitoring sections: DeepSpeed's `tensorboard`, `csv_monitor`, `wandb`, `comet` (its monitor), the
//! `flops_profiler` and the `comms_logger`, read with DeepSpeed's keys and defaults
//! (deepspeed/monitor/config.py, profiling/constants.py, comm/constants.py).
use serde::Serialize;

use super::error::{ConfigError, Result};
use super::reader::Section;

/// DeepSpeed's default `job_name`: the run's subfolder under `output_path`.
pub const DEFAULT_JOB_NAME: &str = "DeepSpeedJobName";

/// A file monitor (`tensorboard`, `csv_monitor`): where rank 0 writes the run's scalars.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MonitorOutput {
    /// `enabled`.
    pub enabled: bool,
    /// `output_path`: the folder holding the job's folder ("" is the working directory, as DeepSpeed's code has it).
    pub output_path: String,
    /// `job_name`: the run's folder under `output_path`.
    pub job_name: String,
}

impl Default for MonitorOutput {
    fn default() -> Self {
        MonitorOutput { enabled: false, output_path: String::new(), job_name: DEFAULT_JOB_NAME.into() }
    }
}

impl MonitorOutput {
    fn read(mut s: Section) -> Result<Self> {
        let c = MonitorOutput {
            enabled: s.bool("enabled", false)?,
            output_path: s.opt_string("output_path")?.unwrap_or_default(),
            job_name: s.opt_string("job_name")?.unwrap_or_else(|| DEFAULT_JOB_NAME.into()),
        };
        if c.job_name.is_empty() || c.job_name.contains('/') || c.job_name == ".." {
            return Err(ConfigError::Invalid {
                path: s.path_of("job_name"),
                value: format!("\"{}\"", c.job_name),
                allowed: "a folder name (not empty, no '/')".into(),
            });
        }
        s.finish()?;
        Ok(c)
    }

    /// The run's folder: `<output_path>/<job_name>` (relative paths from the working directory).
    pub fn dir(&self) -> std::path::PathBuf {
        std::path::Path::new(&self.output_path).join(&self.job_name)
    }
}

/// `flops_profiler`: one step's profile of the units (rank 0).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FlopsProfilerConfig {
    /// `enabled` (turns `wall_clock_breakdown`'s timers on, as DeepSpeed does).
    pub enabled: bool,
    /// The optimizer step profiled (1: the first).
    pub profile_step: u64,
    /// `module_depth` (noticed: zerorun profiles its units, one level).
    pub module_depth: i64,
    /// `top_modules` (noticed, as `module_depth`).
    pub top_modules: u64,
    /// `detailed`: a row per unit; false prints the summary only.
    pub detailed: bool,
    /// Where the profile goes besides the log; None: rank 0's log only.
    pub output_file: Option<String>,
    /// Share of the forward recomputed in backward (activation checkpointing): backward counts (2 + this) x forward.
    pub recompute_fwd_factor: f64,
}

impl Default for FlopsProfilerConfig {
    fn default() -> Self {
        FlopsProfilerConfig {
            enabled: false,
            profile_step: 1,
            module_depth: -1,
            top_modules: 1,
            detailed: true,
            output_file: None,
            recompute_fwd_factor: 0.0,
        }
    }
}

impl FlopsProfilerConfig {
    fn read(mut s: Section) -> Result<Self> {
        let d = FlopsProfilerConfig::default();
        let c = FlopsProfilerConfig {
            enabled: s.bool("enabled", d.enabled)?,
            profile_step: s.uint("profile_step", d.profile_step)?,
            module_depth: s.opt_int("module_depth")?.unwrap_or(d.module_depth),
            top_modules: s.uint("top_modules", d.top_modules)?,
            detailed: s.bool("detailed", d.detailed)?,
            output_file: s.opt_string("output_file")?,
            recompute_fwd_factor: s.float("recompute_fwd_factor", d.recompute_fwd_factor)?,
        };
        if c.profile_step == 0 {
            return Err(ConfigError::Invalid {
                path: s.path_of("profile_step"),
                value: "0".into(),
                allowed: "must be >= 1 (the first optimizer step is 1)".into(),
            });
        }
        if c.recompute_fwd_factor.is_nan() || c.recompute_fwd_factor < 0.0 {
            return Err(ConfigError::Invalid {
                path: s.path_of("recompute_fwd_factor"),
                value: c.recompute_fwd_factor.to_string(),
                allowed: "must be >= 0".into(),
            });
        }
        s.finish()?;
        Ok(c)
    }
}

/// `comms_logger`: every collective timed and counted by name and message size.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct CommsLoggerConfig {
    /// `enabled`.
    pub enabled: bool,
    /// `verbose`: one log line per collective.
    pub verbose: bool,
    /// `prof_all`: every collective (else only `prof_ops`).
    pub prof_all: bool,
    /// `debug` (noticed: zerorun's records carry no caller names).
    pub debug: bool,
    /// `prof_ops`: the collectives logged when `prof_all` is false (all_reduce, all_gather, ...).
    pub prof_ops: Vec<String>,
}

/// The collectives' names as DeepSpeed's logger writes them.
pub const COMM_OPS: &[&str] =
    &["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv", "barrier"];

impl CommsLoggerConfig {
    fn read(mut s: Section) -> Result<Self> {
        let enabled = s.bool("enabled", false)?;
        let verbose = s.bool("verbose", false)?;
        let prof_all = s.bool("prof_all", true)?;
        let debug = s.bool("debug", false)?;
        let prof_ops = match s.take("prof_ops") {
            None => Vec::new(),
            Some(v) => {
                let list = v
                    .as_array()
                    .and_then(|a| a.iter().map(|x| x.as_str().map(str::to_string)).collect::<Option<Vec<_>>>());
                let Some(list) = list else {
                    return Err(ConfigError::Type {
                        path: s.path_of("prof_ops"),
                        expected: "an array of strings",
                        got: super::reader::describe(&v),
                    });
                };
                for op in &list {
                    // DeepSpeed's `_tensor` / `_single` / `_into_tensor` variants name the same collectives.
                    if comm_op_name(op).is_none() {
                        return Err(ConfigError::Invalid {
                            path: s.path_of("prof_ops"),
                            value: format!("\"{op}\""),
                            allowed: format!("collectives among {}", super::reader::quoted_list(COMM_OPS)),
                        });
                    }
                }
                list
            }
        };
        s.finish()?;
        Ok(CommsLoggerConfig { enabled, verbose, prof_all, debug, prof_ops })
    }

    /// Whether the collective `op` (one of [`COMM_OPS`]) is logged.
    pub fn logs(&self, op: &str) -> bool {
        self.enabled && (self.prof_all || self.prof_ops.iter().any(|p| comm_op_name(p) == Some(op)))
    }
}

/// The collective a DeepSpeed op name stands for (`reduce_scatter_tensor` is `reduce_scatter`).
pub fn comm_op_name(name: &str) -> Option<&'static str> {
    let base = name
        .trim_end_matches("_coalesced")
        .trim_end_matches("_into_tensor")
        .trim_end_matches("_tensor")
        .trim_end_matches("_single")
        .trim_start_matches('i');
    let base = match base {
        "send" | "isend" => "send",
        "recv" | "irecv" => "recv",
        b => b,
    };
    COMM_OPS.iter().copied().find(|op| *op == base || *op == name)
}

/// The monitoring sections together.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct MonitorConfig {
    /// `tensorboard`.
    pub tensorboard: MonitorOutput,
    /// `csv_monitor`.
    pub csv_monitor: MonitorOutput,
    /// `flops_profiler`.
    pub flops_profiler: FlopsProfilerConfig,
    /// `comms_logger`.
    pub comms_logger: CommsLoggerConfig,
}

impl MonitorConfig {
    /// Reads the sections from the top level; `wandb` and `comet` enabled are refused with the alternative.
    pub(crate) fn read(s: &mut Section) -> Result<Self> {
        const WANDB: &[&str] = &["group", "team", "project"];
        const COMET: &[&str] = &[
            "samples_log_interval",
            "project",
            "workspace",
            "api_key",
            "experiment_name",
            "experiment_key",
            "online",
            "mode",
        ];
        for (key, what, others) in [("wandb", "Weights & Biases", WANDB), ("comet", "Comet", COMET)] {
            let mut section = s.section(key)?;
            let enabled = section.bool("enabled", false)?;
            // The section's other keys are DeepSpeed's; they do nothing while it is off.
            for k in others {
                section.take(k);
            }
            section.finish()?;
            if enabled {
                let import = if key == "wandb" {
                    " (event files TensorBoard reads, which W&B's TensorBoard integration can import)"
                } else {
                    ""
                };
                return Err(ConfigError::Conflict {
                    path: format!("{key}.enabled"),
                    message: format!(
                        "zerorun does not log to {what}: set this to false and turn on `tensorboard`{import} or `csv_monitor` instead"
                    ),
                });
            }
        }
        Ok(MonitorConfig {
            tensorboard: MonitorOutput::read(s.section("tensorboard")?)?,
            csv_monitor: MonitorOutput::read(s.section("csv_monitor")?)?,
            flops_profiler: FlopsProfilerConfig::read(s.section("flops_profiler")?)?,
            comms_logger: CommsLoggerConfig::read(s.section("comms_logger")?)?,
        })
    }

    /// Whether a file monitor writes scalars.
    pub fn writes_scalars(&self) -> bool {
        self.tensorboard.enabled || self.csv_monitor.enabled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deepspeed_op_names_map_to_collectives() {
        assert_eq!(comm_op_name("reduce_scatter_tensor"), Some("reduce_scatter"));
        assert_eq!(comm_op_name("all_gather_into_tensor"), Some("all_gather"));
        assert_eq!(comm_op_name("all_to_all_single"), Some("all_to_all"));
        assert_eq!(comm_op_name("isend"), Some("send"));
        assert_eq!(comm_op_name("all_reduce_coalesced"), Some("all_reduce"));
        assert_eq!(comm_op_name("allreduce"), None);
    }
}
