//! Learning-rate schedules by DeepSpeed name, with the formulas of DeepSpeed's `runtime/lr_schedules.py`.
//!
//! As in DeepSpeed, a schedule is stepped once after every optimizer step; `lr()` is the rate for the next step.
//! `last_batch_iteration` starts at -1, where WarmupLR-style schedules give their minimum.
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
/// How warmup grows the learning rate.
pub enum WarmupType {
    /// Logarithmically in the step (DeepSpeed's default).
    Log,
    /// Linearly.
    Linear,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
/// WarmupLR: from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then constant.
pub struct WarmupLrParams {
    /// The learning rate at the first step.
    pub warmup_min_lr: f64,
    /// The learning rate after warmup.
    pub warmup_max_lr: f64,
    /// Steps of warmup.
    pub warmup_num_steps: u64,
    /// How it grows.
    pub warmup_type: WarmupType,
    /// The step to resume after (-1: from the start).
    pub last_batch_iteration: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
/// WarmupDecayLR: WarmupLR, then linear decay to zero at `total_num_steps`.
pub struct WarmupDecayLrParams {
    #[serde(flatten)]
    /// The warmup.
    pub warmup: WarmupLrParams,
    /// The schedule's length.
    pub total_num_steps: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
/// WarmupCosineLR: warmup as a ratio of the optimizer's lr, then cosine decay to `cos_min_ratio`.
pub struct WarmupCosineLrParams {
    /// The schedule's length.
    pub total_num_steps: u64,
    /// Warmup's start, as a ratio of the base lr.
    pub warmup_min_ratio: f64,
    /// Steps of warmup.
    pub warmup_num_steps: u64,
    /// The floor, as a ratio of the base lr.
    pub cos_min_ratio: f64,
    /// How warmup grows.
    pub warmup_type: WarmupType,
    /// The step to resume after (-1: from the start).
    pub last_batch_iteration: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
/// OneCycle: up from `cycle_min_lr` to `cycle_max_lr` and down again, then decay; momentum cycles against it.
pub struct OneCycleParams {
    /// The lowest learning rate.
    pub cycle_min_lr: f64,
    /// The peak learning rate.
    pub cycle_max_lr: f64,
    /// Learning-rate decay after the cycle.
    pub decay_lr_rate: f64,
    /// Steps of the rising phase.
    pub cycle_first_step_size: u64,
    /// Steps of the falling phase.
    pub cycle_second_step_size: u64,
    /// Stairs in the rising phase (0: continuous).
    pub cycle_first_stair_count: u64,
    /// Stairs in the falling phase (0: continuous).
    pub cycle_second_stair_count: u64,
    /// Steps per decay interval after the cycle.
    pub decay_step_size: u64,
    /// Cycles the momentum (Adam's beta1, SGD's momentum) against the learning rate.
    pub cycle_momentum: bool,
    /// The lowest momentum.
    pub cycle_min_mom: f64,
    /// The highest momentum.
    pub cycle_max_mom: f64,
    /// Momentum decay after the cycle.
    pub decay_mom_rate: f64,
    /// The step to resume after (-1: from the start).
    pub last_batch_iteration: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
/// LRRangeTest: grows the learning rate from `lr_range_test_min_lr` to find a good one.
pub struct LrRangeTestParams {
    /// The starting learning rate.
    pub lr_range_test_min_lr: f64,
    /// Steps per interval.
    pub lr_range_test_step_size: u64,
    /// Growth per interval.
    pub lr_range_test_step_rate: f64,
    /// Grows in stairs instead of continuously.
    pub lr_range_test_staircase: bool,
    /// The step to resume after (-1: from the start).
    pub last_batch_iteration: i64,
}

/// A schedule, serialized as DeepSpeed's `{"type": ..., "params": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "params")]
pub enum SchedulerConfig {
    /// DeepSpeed's WarmupLR.
    WarmupLR(WarmupLrParams),
    /// DeepSpeed's WarmupDecayLR.
    WarmupDecayLR(WarmupDecayLrParams),
    /// DeepSpeed's WarmupCosineLR.
    WarmupCosineLR(WarmupCosineLrParams),
    /// DeepSpeed's OneCycle.
    OneCycle(OneCycleParams),
    /// DeepSpeed's LRRangeTest.
    LRRangeTest(LrRangeTestParams),
}

impl SchedulerConfig {
    /// The schedule's name, as ds_config's `scheduler.type` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            SchedulerConfig::WarmupLR(_) => "WarmupLR",
            SchedulerConfig::WarmupDecayLR(_) => "WarmupDecayLR",
            SchedulerConfig::WarmupCosineLR(_) => "WarmupCosineLR",
            SchedulerConfig::OneCycle(_) => "OneCycle",
            SchedulerConfig::LRRangeTest(_) => "LRRangeTest",
        }
    }

    fn initial_iteration(&self) -> i64 {
        match self {
            SchedulerConfig::WarmupLR(p) => p.last_batch_iteration,
            SchedulerConfig::WarmupDecayLR(p) => p.warmup.last_batch_iteration,
            SchedulerConfig::WarmupCosineLR(p) => p.last_batch_iteration,
            SchedulerConfig::OneCycle(p) => p.last_batch_iteration,
            SchedulerConfig::LRRangeTest(p) => p.last_batch_iteration,
        }
    }
}

/// A running schedule: the config, the optimizer's base lr (WarmupCosineLR scales it) and the iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct LrScheduler {
    /// The schedule.
    pub config: SchedulerConfig,
    /// The optimizer's learning rate.
    pub base_lr: f64,
    /// Index of the last optimizer step taken; -1 before the first.
    pub last_batch_iteration: i64,
}

fn warmup_gamma(iteration: i64, warmup_num_steps: u64, kind: WarmupType) -> Option<f64> {
    let steps = warmup_num_steps.max(2);
    (iteration < steps as i64).then(|| match kind {
        WarmupType::Log => ((iteration + 1) as f64).ln() / (steps as f64).ln(),
        WarmupType::Linear => iteration as f64 / steps as f64,
    })
}

impl LrScheduler {
    /// The schedule before its first step.
    pub fn new(config: SchedulerConfig, base_lr: f64) -> Self {
        let last_batch_iteration = config.initial_iteration();
        LrScheduler { config, base_lr, last_batch_iteration }
    }

    /// Advances by one optimizer step.
    pub fn step(&mut self) {
        self.last_batch_iteration += 1;
    }

    /// The learning rate for the next optimizer step.
    pub fn lr(&self) -> f64 {
        let it = self.last_batch_iteration;
        match &self.config {
            SchedulerConfig::WarmupLR(p) => warmup_lr(p, it),
            SchedulerConfig::WarmupDecayLR(p) => {
                let w = &p.warmup;
                if it < 0 || warmup_gamma(it, w.warmup_num_steps, w.warmup_type).is_some() {
                    return warmup_lr(w, it);
                }
                let warm = w.warmup_num_steps.max(2) as f64;
                let total = p.total_num_steps as f64;
                let gamma = ((total - it as f64) / (total - warm).max(1.0)).max(0.0);
                w.warmup_min_lr + (w.warmup_max_lr - w.warmup_min_lr) * gamma
            }
            SchedulerConfig::WarmupCosineLR(p) => self.base_lr * cosine_ratio(p, it),
            SchedulerConfig::OneCycle(p) => one_cycle(p, it).0,
            SchedulerConfig::LRRangeTest(p) => {
                let x = (it + 1) as f64 / p.lr_range_test_step_size as f64;
                let interval = if p.lr_range_test_staircase { x.floor() } else { x };
                p.lr_range_test_min_lr * (1.0 + p.lr_range_test_step_rate * interval)
            }
        }
    }

    /// OneCycle's beta1 for the next step (None for other schedules or with cycle_momentum off).
    pub fn momentum(&self) -> Option<f64> {
        match &self.config {
            SchedulerConfig::OneCycle(p) if p.cycle_momentum => Some(one_cycle(p, self.last_batch_iteration).1),
            _ => None,
        }
    }
}

fn warmup_lr(p: &WarmupLrParams, it: i64) -> f64 {
    if it < 0 {
        return p.warmup_min_lr;
    }
    let gamma = warmup_gamma(it, p.warmup_num_steps, p.warmup_type).unwrap_or(1.0);
    p.warmup_min_lr + (p.warmup_max_lr - p.warmup_min_lr) * gamma
}

fn cosine_ratio(p: &WarmupCosineLrParams, it: i64) -> f64 {
    if it < 0 {
        return 0.0;
    }
    if let Some(r) = warmup_gamma(it, p.warmup_num_steps, p.warmup_type) {
        return p.warmup_min_ratio + r * (1.0 - p.warmup_min_ratio);
    }
    let warm = p.warmup_num_steps.max(2) as f64;
    let real_last_step = it as f64 - warm + 1.0;
    let real_total_steps = p.total_num_steps as f64 - warm;
    let ratio = (1.0 + (std::f64::consts::PI * real_last_step / real_total_steps).cos()) / 2.0;
    (p.cos_min_ratio + (1.0 - p.cos_min_ratio) * ratio).max(0.0)
}

/// (lr, beta1) of OneCycle at iteration `it`.
fn one_cycle(p: &OneCycleParams, it: i64) -> (f64, f64) {
    let total = p.cycle_first_step_size as f64 + p.cycle_second_step_size as f64;
    if (it as f64) < total {
        let step_ratio = p.cycle_first_step_size as f64 / total;
        let b = (it + 1) as f64;
        let cycle = (1.0 + b / total).floor();
        let x = 1.0 + b / total - cycle;
        let scale = if x <= step_ratio { x / step_ratio } else { (x - 1.0) / (step_ratio - 1.0) };
        let lr = p.cycle_min_lr + (p.cycle_max_lr - p.cycle_min_lr) * scale;
        let mom = p.cycle_max_mom - (p.cycle_max_mom - p.cycle_min_mom) * scale;
        return (lr, mom);
    }
    let decay_iteration = it as f64 - total + 1.0;
    let interval = if p.decay_step_size == 0 { 0.0 } else { decay_iteration / p.decay_step_size as f64 };
    let lr = if p.decay_step_size == 0 || p.decay_lr_rate == 0.0 {
        p.cycle_min_lr
    } else {
        p.cycle_min_lr / (1.0 + p.decay_lr_rate * interval)
    };
    let mom = if p.decay_step_size == 0 || p.decay_mom_rate == 0.0 {
        p.cycle_max_mom
    } else {
        p.cycle_max_mom * (1.0 + p.decay_mom_rate * interval)
    };
    (lr, mom)
}
