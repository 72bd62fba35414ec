//! `wall_clock_breakdown`: where the time of each optimizer step went. Phases are disjoint: forward and
//! backward exclude the collectives the engine runs inside them, which count as all-gather or reduce-scatter.
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// A part of the optimizer step, timed by `wall_clock_breakdown`.
pub enum Phase {
    /// Forward compute.
    Forward,
    /// Backward compute.
    Backward,
    /// The optimizer step.
    Step,
    /// Parameter all-gathers.
    AllGather,
    /// Gradient reductions.
    ReduceScatter,
    /// NVMe reads and writes not hidden behind compute.
    OffloadIo,
    /// The arithmetic of compressed exchanges (1-bit signs packed and unpacked, PowerSGD's factor products), taken
    /// out of the phase that ran them so that phase's time is the wire's.
    Compression,
    /// The model's own exchanges inside forward and backward (a mixture of experts' and Ulysses' all-to-alls of
    /// rows, ring attention's hops), taken out of forward and backward (the comm crate's `coding::EXCHANGE` clock).
    AllToAll,
}

impl Phase {
    /// How many phases there are.
    pub const COUNT: usize = 8;

    /// Every phase, in report order.
    pub const ALL: [Phase; Phase::COUNT] = [
        Phase::Forward,
        Phase::Backward,
        Phase::Step,
        Phase::AllGather,
        Phase::ReduceScatter,
        Phase::OffloadIo,
        Phase::Compression,
        Phase::AllToAll,
    ];

    /// A tracing span for this phase (`RUST_LOG=zerorun_runtime=trace` with a span-aware subscriber shows them).
    pub fn span(self) -> tracing::Span {
        tracing::trace_span!("phase", name = self.name())
    }

    /// The phase's name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Step => "step",
            Phase::AllGather => "all_gather",
            Phase::ReduceScatter => "reduce_scatter",
            Phase::OffloadIo => "offload_io",
            Phase::Compression => "compression",
            Phase::AllToAll => "all_to_all",
        }
    }
}

/// Time per phase in the current optimizer step and over the run.
#[derive(Debug, Default, Clone)]
pub struct PhaseTimes {
    current: [Duration; Phase::COUNT],
    total: [Duration; Phase::COUNT],
    steps: u64,
}

impl PhaseTimes {
    /// Adds `d` to `phase`, less the compression arithmetic this thread ran since the last `add` (the comm
    /// crate's coding clock), which goes to [`Phase::Compression`].
    /// Forward and backward also give up the model's exchanges this thread ran since their last `add`
    /// (the comm crate's `coding::EXCHANGE` clock), which go to [`Phase::AllToAll`]; the clock runs on through other phases' adds
    /// (a stage-3 gather inside forward does not take it).
    pub fn add(&mut self, phase: Phase, d: Duration) {
        let coding = crate::comm::coding::take().min(d);
        let exchange = match phase {
            Phase::Forward | Phase::Backward => crate::comm::coding::EXCHANGE.take().min(d - coding),
            _ => Duration::ZERO,
        };
        for (p, t) in [(phase, d - coding - exchange), (Phase::Compression, coding), (Phase::AllToAll, exchange)] {
            self.current[p as usize] += t;
            self.total[p as usize] += t;
        }
    }

    /// Collective time so far (to take out of the phase that ran them).
    /// The time spent in `phase` since the start.
    pub fn total(&self, phase: Phase) -> Duration {
        self.total[phase as usize]
    }

    /// Collective time so far (all-gather, reduce-scatter and the compression of what they send).
    pub fn comm(&self) -> Duration {
        self.total[Phase::AllGather as usize]
            + self.total[Phase::ReduceScatter as usize]
            + self.total[Phase::Compression as usize]
            + self.total[Phase::AllToAll as usize]
    }

    /// Ends an optimizer step; returns its times.
    pub fn end_step(&mut self) -> [Duration; Phase::COUNT] {
        self.steps += 1;
        std::mem::take(&mut self.current)
    }

    /// Optimizer steps timed.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Mean milliseconds per step of each phase over the run.
    pub fn mean_ms(&self) -> Vec<(&'static str, f64)> {
        let n = self.steps.max(1) as f64;
        Phase::ALL.iter().map(|p| (p.name(), self.total[*p as usize].as_secs_f64() * 1e3 / n)).collect()
    }

    /// One line: mean ms per step by phase.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self.mean_ms().into_iter().map(|(n, ms)| format!("{n} {ms:.3}")).collect();
        format!("wall_clock_breakdown over {} steps, mean ms per step: {}", self.steps, parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_add_up_per_step_and_over_the_run() {
        let mut t = PhaseTimes::default();
        t.add(Phase::Forward, Duration::from_millis(4));
        t.add(Phase::AllGather, Duration::from_millis(2));
        assert_eq!(t.comm(), Duration::from_millis(2));
        let s = t.end_step();
        assert_eq!(s[Phase::Forward as usize], Duration::from_millis(4));
        t.add(Phase::Forward, Duration::from_millis(2));
        t.end_step();
        assert_eq!(t.mean_ms()[0], ("forward", 3.0));
        assert!(t
            .summary()
            .starts_with("wall_clock_breakdown over 2 steps, mean ms per step: forward 3.000, backward 0.000"));
    }

    #[test]
    fn compression_arithmetic_leaves_the_phase_that_ran_it() {
        let mut t = PhaseTimes::default();
        crate::comm::coding::take();
        crate::comm::coding::timed(|| std::thread::sleep(Duration::from_millis(3)));
        t.add(Phase::Step, Duration::from_millis(10));
        let s = t.end_step();
        let (step, coding) = (s[Phase::Step as usize], s[Phase::Compression as usize]);
        assert!(coding >= Duration::from_millis(3) && coding <= Duration::from_millis(10), "{coding:?}");
        assert_eq!(step + coding, Duration::from_millis(10));
    }

    #[test]
    fn the_models_exchanges_leave_forward_and_backward_not_a_gather() {
        let mut t = PhaseTimes::default();
        crate::comm::coding::EXCHANGE.take();
        crate::comm::coding::EXCHANGE.timed(|| std::thread::sleep(Duration::from_millis(3)));
        // A stage-3 gather between the exchange and forward's end keeps its own time...
        t.add(Phase::AllGather, Duration::from_millis(5));
        // ...and forward gives the exchange up.
        t.add(Phase::Forward, Duration::from_millis(20));
        let s = t.end_step();
        let exchange = s[Phase::AllToAll as usize];
        assert_eq!(s[Phase::AllGather as usize], Duration::from_millis(5));
        assert!(exchange >= Duration::from_millis(3) && exchange <= Duration::from_millis(20), "{exchange:?}");
        assert_eq!(s[Phase::Forward as usize] + exchange, Duration::from_millis(20));
        assert_eq!(Phase::AllToAll.name(), "all_to_all");
    }
}
