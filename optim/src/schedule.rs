//! Learning-rate schedules by DeepSpeed name, with the formulas of DeepSpeed's `runtime/lr_schedules.py`.
//!
//! As in DeepSpeed, a schedule is stepped once after every optimizer step; `lr()` is the rate for the next step.
//! `last_batch_iteration` starts at -1, where WarmupLR-style schedules give their minimum.
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    Log,
    Linear,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WarmupLrParams {
    pub warmup_min_lr: f64,
    pub warmup_max_lr: f64,
    pub warmup_num_steps: u64,
    pub warmup_type: WarmupType,
    pub last_batch_iteration: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WarmupDecayLrParams {
    #[serde(flatten)]
    pub warmup: WarmupLrParams,
    pub total_num_steps: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WarmupCosineLrParams {
    pub total_num_steps: u64,
    pub warmup_min_ratio: f64,
    pub warmup_num_steps: u64,
    pub cos_min_ratio: f64,
    pub warmup_type: WarmupType,
    pub last_batch_iteration: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OneCycleParams {
    pub cycle_min_lr: f64,
    pub cycle_max_lr: f64,
    pub decay_lr_rate: f64,
    pub cycle_first_step_size: u64,
    pub cycle_second_step_size: u64,
    pub cycle_first_stair_count: u64,
    pub cycle_second_stair_count: u64,
    pub decay_step_size: u64,
    pub cycle_momentum: bool,
    pub cycle_min_mom: f64,
    pub cycle_max_mom: f64,
    pub decay_mom_rate: f64,
    pub last_batch_iteration: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LrRangeTestParams {
    pub lr_range_test_min_lr: f64,
    pub lr_range_test_step_size: u64,
    pub lr_range_test_step_rate: f64,
    pub lr_range_test_staircase: bool,
    pub last_batch_iteration: i64,
}

/// A schedule, serialized as DeepSpeed's `{"type": ..., "params": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "params")]
pub enum SchedulerConfig {
    WarmupLR(WarmupLrParams),
    WarmupDecayLR(WarmupDecayLrParams),
    WarmupCosineLR(WarmupCosineLrParams),
    OneCycle(OneCycleParams),
    LRRangeTest(LrRangeTestParams),
}

impl SchedulerConfig {
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
    pub config: SchedulerConfig,
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
