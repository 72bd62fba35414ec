//! `scheduler`: `{type, params}` with the names and defaults of DeepSpeed's `runtime/lr_schedules.py`.
pub use zerorun_optim::schedule::{
    LrRangeTestParams, OneCycleParams, SchedulerConfig, WarmupCosineLrParams, WarmupDecayLrParams, WarmupLrParams,
    WarmupType,
};

use super::error::{ConfigError, Result};
use super::reader::{quoted_list, Section};

const KNOWN: &[&str] = &["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"];

fn warmup_type(p: &mut Section) -> Result<WarmupType> {
    Ok(match p.choice("warmup_type", &["log", "linear"], "log")? {
        "linear" => WarmupType::Linear,
        _ => WarmupType::Log,
    })
}

fn required_steps(p: &mut Section, key: &'static str, kind: &str) -> Result<u64> {
    let path = p.path_of(key);
    let v = p.opt_uint(key)?.ok_or_else(|| ConfigError::Missing { path: path.clone(), when: format!("for {kind}") })?;
    if v == 0 {
        return Err(ConfigError::Invalid { path, value: "0".into(), allowed: "must be >= 1".into() });
    }
    Ok(v)
}

/// Reads the section; `optimizer_lr` is the default of `warmup_max_lr`.
pub(crate) fn read_scheduler(mut s: Section, optimizer_lr: f64) -> Result<SchedulerConfig> {
    let type_path = s.path_of("type");
    let Some(name) = s.opt_string("type")? else {
        return Err(ConfigError::Missing { path: type_path, when: "when a scheduler section is given".into() });
    };
    let Some(kind) = KNOWN.iter().copied().find(|k| *k == name) else {
        return Err(ConfigError::Invalid {
            path: type_path,
            value: format!("\"{name}\""),
            allowed: format!("one of {}", quoted_list(KNOWN)),
        });
    };
    let mut p = s.section("params")?;
    let config = read_params(kind, &mut p, optimizer_lr);
    // Unknown keys first: a misspelt key reads as its default, which may then fail a range check that would hide
    // the typo (`warmup_num_step` -> warmup_num_steps 1000 > total_num_steps).
    p.finish()?;
    let config = config?;
    s.finish()?;
    Ok(config)
}

/// The `params` of a scheduler of type `kind`, their ranges checked.
fn read_params(kind: &str, p: &mut Section, optimizer_lr: f64) -> Result<SchedulerConfig> {
    let warmup = |p: &mut Section| -> Result<WarmupLrParams> {
        Ok(WarmupLrParams {
            warmup_min_lr: p.float("warmup_min_lr", 0.0)?,
            warmup_max_lr: p.float("warmup_max_lr", optimizer_lr)?,
            warmup_num_steps: p.uint("warmup_num_steps", 1000)?,
            warmup_type: warmup_type(p)?,
            last_batch_iteration: p.opt_int("last_batch_iteration")?.unwrap_or(-1),
        })
    };
    let config = match kind {
        "WarmupLR" => SchedulerConfig::WarmupLR(warmup(p)?),
        "WarmupDecayLR" => {
            let w = warmup(p)?;
            let total_num_steps = required_steps(p, "total_num_steps", kind)?;
            if w.warmup_num_steps > total_num_steps {
                return Err(ConfigError::Invalid {
                    path: p.path_of("warmup_num_steps"),
                    value: w.warmup_num_steps.to_string(),
                    allowed: format!("must be <= total_num_steps ({total_num_steps})"),
                });
            }
            SchedulerConfig::WarmupDecayLR(WarmupDecayLrParams { warmup: w, total_num_steps })
        }
        "WarmupCosineLR" => {
            let c = WarmupCosineLrParams {
                total_num_steps: required_steps(p, "total_num_steps", kind)?,
                warmup_min_ratio: p.float("warmup_min_ratio", 0.0)?,
                warmup_num_steps: p.uint("warmup_num_steps", 1000)?,
                cos_min_ratio: p.float("cos_min_ratio", 1e-4)?,
                warmup_type: warmup_type(p)?,
                last_batch_iteration: p.opt_int("last_batch_iteration")?.unwrap_or(-1),
            };
            if c.warmup_num_steps > c.total_num_steps {
                return Err(ConfigError::Invalid {
                    path: p.path_of("warmup_num_steps"),
                    value: c.warmup_num_steps.to_string(),
                    allowed: format!("must be <= total_num_steps ({})", c.total_num_steps),
                });
            }
            SchedulerConfig::WarmupCosineLR(c)
        }
        "OneCycle" => {
            let min_path = p.path_of("cycle_min_lr");
            let max_path = p.path_of("cycle_max_lr");
            let cycle_min_lr = p
                .opt_float("cycle_min_lr")?
                .ok_or(ConfigError::Missing { path: min_path, when: "for OneCycle".into() })?;
            let cycle_max_lr = p
                .opt_float("cycle_max_lr")?
                .ok_or(ConfigError::Missing { path: max_path, when: "for OneCycle".into() })?;
            let first = p.uint("cycle_first_step_size", 2000)?;
            let first_stairs = p.uint("cycle_first_stair_count", 0)?;
            let c = OneCycleParams {
                cycle_min_lr,
                cycle_max_lr,
                decay_lr_rate: p.float("decay_lr_rate", 0.0)?,
                cycle_first_step_size: first,
                cycle_second_step_size: p.opt_uint("cycle_second_step_size")?.unwrap_or(first),
                cycle_first_stair_count: first_stairs,
                cycle_second_stair_count: p.opt_uint("cycle_second_stair_count")?.unwrap_or(first_stairs),
                decay_step_size: p.uint("decay_step_size", 0)?,
                cycle_momentum: p.bool("cycle_momentum", true)?,
                cycle_min_mom: p.float("cycle_min_mom", 0.8)?,
                cycle_max_mom: p.float("cycle_max_mom", 0.9)?,
                decay_mom_rate: p.float("decay_mom_rate", 0.0)?,
                last_batch_iteration: p.opt_int("last_batch_iteration")?.unwrap_or(-1),
            };
            if c.cycle_min_lr > c.cycle_max_lr {
                return Err(ConfigError::Invalid {
                    path: p.path_of("cycle_min_lr"),
                    value: c.cycle_min_lr.to_string(),
                    allowed: format!("must be <= cycle_max_lr ({})", c.cycle_max_lr),
                });
            }
            if c.cycle_first_step_size == 0 {
                return Err(ConfigError::Invalid {
                    path: p.path_of("cycle_first_step_size"),
                    value: "0".into(),
                    allowed: "must be >= 1".into(),
                });
            }
            SchedulerConfig::OneCycle(c)
        }
        _ => {
            let c = LrRangeTestParams {
                lr_range_test_min_lr: p.float("lr_range_test_min_lr", 1e-3)?,
                lr_range_test_step_size: p.uint("lr_range_test_step_size", 2000)?,
                lr_range_test_step_rate: p.float("lr_range_test_step_rate", 1.0)?,
                lr_range_test_staircase: p.bool("lr_range_test_staircase", false)?,
                last_batch_iteration: p.opt_int("last_batch_iteration")?.unwrap_or(-1),
            };
            if c.lr_range_test_step_size == 0 {
                return Err(ConfigError::Invalid {
                    path: p.path_of("lr_range_test_step_size"),
                    value: "0".into(),
                    allowed: "must be >= 1".into(),
                });
            }
            SchedulerConfig::LRRangeTest(c)
        }
    };
    Ok(config)
}
