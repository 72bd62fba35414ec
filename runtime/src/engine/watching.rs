//! Watching a run: DeepSpeed's monitors (`tensorboard`, `csv_monitor`) fed after every optimizer step by the rank
//! that writes them, throughput and model FLOPs utilisation when the program says what a sample costs
//! ([`Throughput`]), the communication logger's summary (`comms_logger`), evaluation that keeps nothing for backward
//! and the flops profiler's step (`flops_profiler`, in `flops_profile.rs`).
use std::sync::Arc;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::Engine;
use crate::comm::logged::{CommLog, LogPolicy, Logged};
use crate::comm::Communicator;
use crate::config::{comm_op_name, Config};
use crate::error::{Error, Result};
use crate::report::Phase;
use zerorun_monitor::{Event, Monitor};

/// What one sample costs, for tokens/s and MFU: the program knows its model, the engine its steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throughput {
    /// Tokens in a sample (a sequence model's context; 1 for a model of samples).
    pub tokens_per_sample: u64,
    /// Training FLOPs per token (forward and backward): [`Throughput::transformer_flops_per_token`] for a
    /// transformer, the program's own count otherwise.
    pub flops_per_token: f64,
    /// Peak FLOP/s of one rank; None: measured at start-up ([`measure_peak_flops`], the matmul `zerorun bench
    /// matmul` times).
    pub peak_flops_per_rank: Option<f64>,
}

impl Throughput {
    /// PaLM's count (arXiv 2204.02311, appendix B), as nanoGPT's `estimate_mfu` and torchtitan use it: 6N for the
    /// weights' matmuls forward and backward, plus 12·L·H·Q·T for attention's scores and values, with `n` the
    /// parameters (nanoGPT leaves the position embedding out), `layers`, `heads`, `head_dim` and `seq` the context.
    pub fn transformer_flops_per_token(n: u64, layers: u64, heads: u64, head_dim: u64, seq: u64) -> f64 {
        6.0 * n as f64 + 12.0 * (layers * heads * head_dim * seq) as f64
    }
}

/// The FLOP/s of fp32 matmuls of 1024 x 1024 on `device` with this process's threads: the peak MFU divides by (what
/// `zerorun bench matmul` and the planner measure). A few hundred milliseconds.
pub fn measure_peak_flops(device: Device) -> f64 {
    let n = 1024i64;
    let a = Tensor::randn([n, n], (Kind::Float, device));
    let b = Tensor::randn([n, n], (Kind::Float, device));
    let sync = || {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    let _ = a.matmul(&b);
    sync();
    let reps = 4;
    let started = Instant::now();
    for _ in 0..reps {
        let _ = a.matmul(&b);
    }
    sync();
    2.0 * (n * n * n) as f64 * reps as f64 / started.elapsed().as_secs_f64().max(1e-9)
}

/// The engine's watching part.
#[derive(Default)]
pub(crate) struct Watch {
    /// The file monitors, opened by the writing rank at its first step (None before, and on other ranks).
    monitor: Option<Monitor>,
    /// The monitors could not be opened or written: logged once, then left alone (the run goes on).
    monitor_failed: bool,
    /// `comms_logger`: what the engine's groups recorded.
    pub comm_log: Option<Arc<CommLog>>,
    throughput: Option<Throughput>,
    peak_flops_per_rank: f64,
    /// When the previous optimizer step ended (or the engine was made).
    last_step_end: Option<Instant>,
    /// The last step's rates.
    pub last: StepRates,
    /// Collective time (the comm log's) at the previous step's end.
    comm_seconds_before: f64,
    /// `flops_profiler`'s step.
    pub profile: super::flops_profile::FlopsProfile,
}

/// Rates of the last optimizer step (wall time from the previous step's end).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepRates {
    /// Seconds the step took.
    pub seconds: f64,
    /// Tokens per second over every data-parallel rank (samples/s when no [`Throughput`] was given).
    pub tokens_per_second: f64,
    /// Model FLOPs utilisation (0..1), when a [`Throughput`] was given.
    pub mfu: Option<f64>,
}

impl Watch {
    /// Wraps the engine's groups in the communication logger when the config asks for it.
    pub fn wrap_comms(
        config: &Config,
        shard: Box<dyn Communicator>,
        replicas: Option<Box<dyn Communicator>>,
    ) -> (Watch, Box<dyn Communicator>, Option<Box<dyn Communicator>>) {
        let c = &config.monitor.comms_logger;
        let mut watch = Watch { last_step_end: Some(Instant::now()), ..Default::default() };
        if !c.enabled {
            return (watch, shard, replicas);
        }
        let only = (!c.prof_all).then(|| c.prof_ops.iter().filter_map(|op| comm_op_name(op)).collect());
        let log = CommLog::new(LogPolicy { only, verbose: c.verbose });
        let shard = Box::new(Logged::new(shard, log.clone())) as Box<dyn Communicator>;
        let replicas = replicas.map(|r| Box::new(Logged::new(r, log.clone())) as Box<dyn Communicator>);
        watch.comm_log = Some(log);
        (watch, shard, replicas)
    }
}

impl Engine {
    /// Tells the engine what a sample costs, so step lines and monitors carry tokens/s and MFU
    /// ([`Engine::step_rates`]). Measures this rank's peak FLOP/s now unless given.
    pub fn set_throughput(&mut self, throughput: Throughput) {
        self.watch.peak_flops_per_rank =
            throughput.peak_flops_per_rank.unwrap_or_else(|| measure_peak_flops(self.device()));
        tracing::info!(
            peak_flops_per_rank = self.watch.peak_flops_per_rank,
            flops_per_token = throughput.flops_per_token,
            "MFU against this peak"
        );
        self.watch.throughput = Some(throughput);
    }

    /// The last optimizer step's time, tokens/s and MFU.
    pub fn step_rates(&self) -> StepRates {
        self.watch.last
    }

    /// The peak FLOP/s of one rank MFU divides by (0 before [`Engine::set_throughput`]).
    pub fn peak_flops_per_rank(&self) -> f64 {
        self.watch.peak_flops_per_rank
    }

    /// Runs `f` as an evaluation: under `no_grad`, so stage 3 gathers each unit for its forward and releases it
    /// after, keeping nothing for backward; the wall-clock breakdown and the communication logger leave it out (they
    /// count training steps).
    pub fn evaluate<R>(&mut self, f: impl FnOnce(&mut Engine) -> Result<R>) -> Result<R> {
        let paused = self.watch.comm_log.as_ref().map(|log| log.pause());
        let out = tch::no_grad(|| f(self));
        if let (Some(log), Some(was)) = (self.watch.comm_log.as_ref(), paused) {
            log.resume(was);
        }
        // The next step's time (tokens/s, MFU) starts after the evaluation.
        self.watch.last_step_end = Some(Instant::now());
        out
    }

    /// Writes `(tag, value)` scalars at the current step (samples seen) to the monitors, as DeepSpeed's
    /// `monitor.write_events` (the writing rank only; a no-op elsewhere or without monitors).
    pub fn write_events(&mut self, scalars: &[(&str, f64)]) -> Result<()> {
        let step = self.progress.global_samples;
        let events: Vec<Event> = scalars.iter().map(|(t, v)| Event::new(*t, *v, step)).collect();
        self.write_monitor(&events)
    }

    /// A held-out loss, written as `Train/Samples/eval_loss` at the current step.
    pub fn record_eval_loss(&mut self, loss: f64) -> Result<()> {
        self.write_events(&[("Train/Samples/eval_loss", loss)])
    }

    /// The communication logger's table (`comms_logger`): a row per collective, group size and message size, and
    /// the bytes this rank sent per optimizer step. None when the logger is off.
    pub fn comms_summary(&self) -> Option<String> {
        self.watch.comm_log.as_ref().map(|log| log.summary(self.progress.global_steps))
    }

    /// Bus bytes this rank sent per optimizer step so far (`comms_logger`; None when off).
    pub fn comm_bytes_per_step(&self) -> Option<f64> {
        let log = self.watch.comm_log.as_ref()?;
        Some(log.bus_bytes() / self.progress.global_steps.max(1) as f64)
    }

    /// Whether this engine writes the monitors: data-parallel rank 0 of the first model-parallel rank (DeepSpeed's
    /// global rank 0).
    pub(super) fn writes_monitors(&self) -> bool {
        self.rank() == 0 && self.placement.model_parallel.as_ref().map_or(true, |g| g.rank() == 0)
    }

    fn write_monitor(&mut self, events: &[Event]) -> Result<()> {
        if !self.config.monitor.writes_scalars() || !self.writes_monitors() || self.watch.monitor_failed {
            return Ok(());
        }
        let written = match self.watch.monitor.as_mut() {
            Some(m) => m.write_events(events),
            None => Monitor::from_config(&self.config.monitor).and_then(|m| {
                let mut m = m.expect("a monitor is on");
                if let Some(f) = m.event_file() {
                    tracing::info!(file = %f.display(), "TensorBoard events");
                }
                let r = m.write_events(events);
                self.watch.monitor = Some(m);
                r
            }),
        };
        written.map_err(|e| {
            self.watch.monitor_failed = true;
            Error::Usage(format!("{e} (the monitors stop; training goes on if this error is ignored)"))
        })
    }

    /// After every optimizer step (taken or skipped): the rates, and the step's scalars to the monitors. A monitor
    /// that cannot write is logged once and turned off: a full disk does not stop the training.
    pub(super) fn watch_step(
        &mut self,
        loss: f64,
        lr: f64,
        grad_norm: Option<f64>,
        times: [std::time::Duration; crate::report::Phase::COUNT],
    ) {
        let now = Instant::now();
        let seconds = self.watch.last_step_end.map_or(0.0, |t| now.duration_since(t).as_secs_f64());
        self.watch.last_step_end = Some(now);
        let samples = self.batch.train_batch_size as f64;
        let mut rates = StepRates { seconds, tokens_per_second: samples / seconds.max(1e-9), mfu: None };
        if let Some(t) = self.watch.throughput {
            let tokens = samples * t.tokens_per_sample as f64;
            rates.tokens_per_second = tokens / seconds.max(1e-9);
            let peak = self.watch.peak_flops_per_rank * self.world_size() as f64;
            rates.mfu = (peak > 0.0).then(|| tokens * t.flops_per_token / seconds.max(1e-9) / peak);
        }
        self.watch.last = rates;
        self.profile_step_boundary(&times);
        if !self.config.monitor.writes_scalars() || !self.writes_monitors() {
            return;
        }
        let step = self.progress.global_samples;
        let mut events =
            vec![Event::new("Train/Samples/train_loss", loss, step), Event::new("Train/Samples/lr", lr, step)];
        if self.config.fp16.enabled {
            events.push(Event::new("Train/Samples/loss_scale", self.loss_scale(), step));
        }
        if self.config.wall_clock_breakdown {
            let ms = |p: Phase| times[p as usize].as_secs_f64() * 1e3;
            for (tag, v) in [
                ("forward", ms(Phase::Forward) + ms(Phase::AllGather)),
                ("backward", ms(Phase::Backward) + ms(Phase::ReduceScatter)),
                ("backward_inner", ms(Phase::Backward)),
                ("backward_allreduce", ms(Phase::ReduceScatter)),
                ("step", ms(Phase::Step)),
            ] {
                events.push(Event::new(format!("Train/Samples/elapsed_time_ms_{tag}"), v, step));
            }
            // zerorun's own: a compressed exchange's arithmetic, which the phases above leave out.
            if ms(Phase::AllToAll) > 0.0 {
                events.push(Event::new("Train/Samples/elapsed_time_ms_all_to_all", ms(Phase::AllToAll), step));
            }
            if ms(Phase::Compression) > 0.0 {
                events.push(Event::new("Train/Samples/elapsed_time_ms_compression", ms(Phase::Compression), step));
            }
        }
        // zerorun's own, beside DeepSpeed's.
        if let Some(g) = grad_norm {
            events.push(Event::new("Train/Samples/grad_norm", g, step));
        }
        let rate_tag =
            if self.watch.throughput.is_some() { "Train/Samples/tokens_per_s" } else { "Train/Samples/samples_per_s" };
        events.push(Event::new(rate_tag, rates.tokens_per_second, step));
        if let Some(mfu) = rates.mfu {
            events.push(Event::new("Train/Samples/mfu", mfu, step));
        }
        let comm_seconds = match &self.watch.comm_log {
            Some(log) => log.total_time().as_secs_f64(),
            None => self.report.times.comm().as_secs_f64(),
        };
        events.push(Event::new(
            "Train/Samples/comm_time_ms",
            (comm_seconds - self.watch.comm_seconds_before) * 1e3,
            step,
        ));
        self.watch.comm_seconds_before = comm_seconds;
        events.push(Event::new("Memory/peak_rss_bytes", crate::report::memory::rss().1 as f64, step));
        for (category, bytes) in self.memory_bytes() {
            events.push(Event::new(format!("Memory/{}", category.name()), bytes as f64, step));
        }
        if let Err(e) = self.write_monitor(&events) {
            tracing::error!("{e}");
        }
    }
}
