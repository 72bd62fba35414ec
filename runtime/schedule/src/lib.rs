//! Pipeline schedules as data (torch.distributed.pipelining's representation, DeepSpeed's TrainSchedule's steps):
//! for `p` stages and `m` micro-batches, each stage's ordered actions for one optimizer step. Tensor-free, so the
//! schedules are proven here by simulation before any rank runs one.
//!
//! - GPipe: every forward, then every backward; a stage holds all `m` micro-batches' activations.
//! - 1F1B: stage `s` runs `p - s - 1` forwards ahead (the warm-up), then alternates one forward and one backward,
//!   then drains the backwards: it holds at most `min(p - s, m)` activations, whatever `m` is.
//! - Interleaved 1F1B (Narayanan et al. 2021): each rank holds `v` chunks of layers, virtual stage `c * p + r` on
//!   rank `r`, and runs micro-batches in groups of `p` through its chunks in turn (Megatron-LM's order). A chunk's
//!   forward is `1/v` of a stage's, so the bubble shrinks by about `v`, for `v` times the messages.
//!
//! Sends are asynchronous (posted, then waited on at the end of the step), receives block and take messages in
//! the order they were sent on their channel (one per pair of ranks and direction, as the runtime's links are):
//! [`validate`] simulates exactly that.
#![warn(missing_docs)]
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;

/// What a stage does, in order. `chunk` is the rank's model chunk (always 0 but for interleaved schedules).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Receive micro-batch `mb`'s activation from the previous (virtual) stage.
    RecvActivation {
        /// The micro-batch.
        mb: usize,
        /// The model chunk.
        chunk: usize,
    },
    /// Run micro-batch `mb` forward through chunk `chunk`.
    Forward {
        /// The micro-batch.
        mb: usize,
        /// The model chunk.
        chunk: usize,
    },
    /// Send micro-batch `mb`'s output to the next (virtual) stage.
    SendActivation {
        /// The micro-batch.
        mb: usize,
        /// The model chunk.
        chunk: usize,
    },
    /// Receive the gradient of micro-batch `mb`'s output from the next (virtual) stage.
    RecvGradient {
        /// The micro-batch.
        mb: usize,
        /// The model chunk.
        chunk: usize,
    },
    /// Run micro-batch `mb` backward through chunk `chunk`.
    Backward {
        /// The micro-batch.
        mb: usize,
        /// The model chunk.
        chunk: usize,
    },
    /// Send the gradient of micro-batch `mb`'s input to the previous (virtual) stage.
    SendGradient {
        /// The micro-batch.
        mb: usize,
        /// The model chunk.
        chunk: usize,
    },
    /// Reduce this stage's gradients over its data-parallel group (once, after the last backward).
    ReduceGradients,
    /// Step the stage's optimizer (once, after the reduction).
    OptimizerStep,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = |f: &mut fmt::Formatter<'_>, name: &str, mb: usize, chunk: usize| {
            if chunk == 0 {
                write!(f, "{name}{mb}")
            } else {
                write!(f, "{name}{mb}.{chunk}")
            }
        };
        match *self {
            Action::RecvActivation { mb, chunk } => at(f, "recv-act ", mb, chunk),
            Action::Forward { mb, chunk } => at(f, "F", mb, chunk),
            Action::SendActivation { mb, chunk } => at(f, "send-act ", mb, chunk),
            Action::RecvGradient { mb, chunk } => at(f, "recv-grad ", mb, chunk),
            Action::Backward { mb, chunk } => at(f, "B", mb, chunk),
            Action::SendGradient { mb, chunk } => at(f, "send-grad ", mb, chunk),
            Action::ReduceGradients => write!(f, "reduce"),
            Action::OptimizerStep => write!(f, "step"),
        }
    }
}

/// Which schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward in the steady state (PipeDream-Flush).
    OneFOneB,
    /// Interleaved 1F1B with this many chunks per rank (at least 2).
    Interleaved(usize),
}

impl Kind {
    /// `gpipe`, `1f1b` or `interleaved` (with `virtual_stages` chunks per rank).
    pub fn from_name(name: &str, virtual_stages: usize) -> Option<Kind> {
        match name {
            "gpipe" => Some(Kind::GPipe),
            "1f1b" => Some(Kind::OneFOneB),
            "interleaved" => Some(Kind::Interleaved(virtual_stages)),
            _ => None,
        }
    }

    /// Model chunks per rank.
    pub fn chunks(&self) -> usize {
        match self {
            Kind::Interleaved(v) => *v,
            _ => 1,
        }
    }
}

/// A schedule that cannot be made or does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("a pipeline of {stages} stages needs at least one stage and one micro-batch ({micro_batches} given)")]
    /// No stage or no micro-batch.
    Empty {
        /// Stages.
        stages: usize,
        /// Micro-batches.
        micro_batches: usize,
    },
    #[error(
        "{micro_batches} micro-batches for {stages} stages: fewer micro-batches than stages leaves stages idle for most of the step (and hangs some implementations); use at least {stages}, or allow it explicitly (pipeline.allow_fewer_micro_batches)"
    )]
    /// Fewer micro-batches than stages, not allowed by the config.
    FewerMicroBatchesThanStages {
        /// Stages.
        stages: usize,
        /// Micro-batches.
        micro_batches: usize,
    },
    #[error("interleaved 1F1B with {virtual_stages} chunks per rank on {stages} stages and {micro_batches} micro-batches: {why}")]
    /// Interleaving that cannot run with these numbers.
    Interleaving {
        /// Stages.
        stages: usize,
        /// Micro-batches.
        micro_batches: usize,
        /// Chunks per rank.
        virtual_stages: usize,
        /// Why it cannot interleave.
        why: &'static str,
    },
    #[error("the schedule deadlocks: stage {stage} waits at action {index} ({action}) and no stage can move")]
    /// Every stage waits for another: the schedule deadlocks.
    Deadlock {
        /// The stage that waits.
        stage: usize,
        /// Its action's index.
        index: usize,
        /// The action.
        action: Action,
    },
    #[error("stage {stage}: {what}")]
    /// A stage's actions are wrong (a backward before its forward, say).
    Invalid {
        /// The stage.
        stage: usize,
        /// What is wrong.
        what: String,
    },
}

/// Every stage's actions for one optimizer step: `p` stages, `m` micro-batches. `m < p` is an error unless
/// `allow_fewer_micro_batches`.
pub fn build(
    kind: Kind,
    stages: usize,
    micro_batches: usize,
    allow_fewer_micro_batches: bool,
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    let (p, m) = (stages, micro_batches);
    if p == 0 || m == 0 {
        return Err(ScheduleError::Empty { stages: p, micro_batches: m });
    }
    if m < p && !allow_fewer_micro_batches {
        return Err(ScheduleError::FewerMicroBatchesThanStages { stages: p, micro_batches: m });
    }
    let v = kind.chunks();
    if let Kind::Interleaved(_) = kind {
        let refuse = |why| Err(ScheduleError::Interleaving { stages: p, micro_batches: m, virtual_stages: v, why });
        if v < 2 {
            return refuse("it needs at least 2 chunks per rank (1 is plain 1F1B)");
        }
        if p < 2 {
            return refuse("it needs at least 2 stages");
        }
        if m % p != 0 {
            return refuse(
                "the micro-batches run in groups of one per stage, so their number must be a multiple of the stages",
            );
        }
    }
    Ok((0..p)
        .map(|s| {
            let last_virtual = p * v - 1;
            let forward = |mb: usize, chunk: usize, out: &mut Vec<Action>| {
                let vs = chunk * p + s;
                if vs > 0 {
                    out.push(Action::RecvActivation { mb, chunk });
                }
                out.push(Action::Forward { mb, chunk });
                if vs < last_virtual {
                    out.push(Action::SendActivation { mb, chunk });
                }
            };
            let backward = |mb: usize, chunk: usize, out: &mut Vec<Action>| {
                let vs = chunk * p + s;
                if vs < last_virtual {
                    out.push(Action::RecvGradient { mb, chunk });
                }
                out.push(Action::Backward { mb, chunk });
                if vs > 0 {
                    out.push(Action::SendGradient { mb, chunk });
                }
            };
            // The k-th forward (backward) of this rank: which micro-batch and chunk.
            let order = |k: usize, forward: bool| -> (usize, usize) {
                if v == 1 {
                    return (k, 0);
                }
                let group = k / (p * v);
                let in_group = k % (p * v);
                let chunk = in_group / p;
                let mb = group * p + in_group % p;
                (mb, if forward { chunk } else { v - 1 - chunk })
            };
            let total = m * v;
            let warmup = match kind {
                Kind::GPipe => total,
                Kind::OneFOneB => (p - s - 1).min(m),
                Kind::Interleaved(_) => ((p - s - 1) * 2 + (v - 1) * p).min(total),
            };
            let mut out = Vec::new();
            let (mut f, mut b) = (0, 0);
            while f < warmup {
                let (mb, c) = order(f, true);
                forward(mb, c, &mut out);
                f += 1;
            }
            while f < total {
                let (mb, c) = order(f, true);
                forward(mb, c, &mut out);
                f += 1;
                let (mb, c) = order(b, false);
                backward(mb, c, &mut out);
                b += 1;
            }
            while b < total {
                let (mb, c) = order(b, false);
                backward(mb, c, &mut out);
                b += 1;
            }
            out.push(Action::ReduceGradients);
            out.push(Action::OptimizerStep);
            out
        })
        .collect())
}

/// What [`validate`] found: each stage's peak of activations held (forwards whose backward has not run, counted
/// in chunks), and the bubble: the idle fraction of stage-time when a chunk's forward or backward takes one time
/// step and a stage waits for its inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    /// Each stage's peak of activations held, in chunks.
    pub peak_activations: Vec<usize>,
    /// Compute steps until the last stage's last action.
    pub steps: usize,
    /// The idle fraction of stage-time.
    pub bubble: f64,
    /// Per time step, per stage: the compute action run then (None: idle).
    pub timeline: Vec<Vec<Option<Action>>>,
}

/// A channel of the simulation: (from rank, to rank, activations?).
type ChannelKey = (usize, usize, bool);
/// A message in flight: (micro-batch, chunk at the receiver).
type Message = (usize, usize);

/// Runs every stage's actions together: sends are posted at once, receives wait for theirs (in order, per channel:
/// one per pair of ranks and direction), forwards and backwards take one time step each. Fails on a deadlock, a
/// receive that meets another message than it expects, a backward before its forward, or a message left
/// unreceived.
pub fn validate(plan: &[Vec<Action>]) -> Result<Simulation, ScheduleError> {
    let p = plan.len();
    let chunk_of = |a: &Action| match *a {
        Action::RecvActivation { chunk, .. }
        | Action::Forward { chunk, .. }
        | Action::SendActivation { chunk, .. }
        | Action::RecvGradient { chunk, .. }
        | Action::Backward { chunk, .. }
        | Action::SendGradient { chunk, .. } => chunk,
        _ => 0,
    };
    let v = plan.iter().flatten().map(chunk_of).max().unwrap_or(0) + 1;
    let virtual_stages = p * v;
    let mut channels: HashMap<ChannelKey, VecDeque<Message>> = HashMap::new();
    let mut at = vec![0usize; p];
    let mut held = vec![0usize; p];
    let mut peak = vec![0usize; p];
    let mut forwarded: Vec<HashSet<(usize, usize)>> = vec![HashSet::new(); p];
    let mut timeline = Vec::new();
    loop {
        // One time step: every stage first does what costs no time (sends, receives that are ready, the step),
        // then at most one compute action.
        let mut row: Vec<Option<Action>> = vec![None; p];
        let mut moved = false;
        // What is sent in this step arrives for the next one (a compute's output is not anyone's input in the
        // same step).
        let mut posted: Vec<(ChannelKey, Message)> = Vec::new();
        for s in 0..p {
            while let Some(&action) = plan[s].get(at[s]) {
                let bad = |what: String| ScheduleError::Invalid { stage: s, what };
                match action {
                    Action::SendActivation { mb, chunk } => {
                        let next = chunk * p + s + 1;
                        if next >= virtual_stages {
                            return Err(bad(format!("sends activation {mb} past the last stage")));
                        }
                        posted.push(((s, next % p, true), (mb, next / p)));
                    }
                    Action::SendGradient { mb, chunk } => {
                        let vs = chunk * p + s;
                        if vs == 0 {
                            return Err(bad(format!("sends gradient {mb} before the first stage")));
                        }
                        posted.push(((s, (vs - 1) % p, false), (mb, (vs - 1) / p)));
                    }
                    Action::RecvActivation { mb, chunk } | Action::RecvGradient { mb, chunk } => {
                        let activation = matches!(action, Action::RecvActivation { .. });
                        let vs = chunk * p + s;
                        let from = match (activation, vs) {
                            (true, 0) => return Err(bad(format!("receives activation {mb} at the first stage"))),
                            (true, _) => (vs - 1) % p,
                            (false, _) if vs + 1 >= virtual_stages => {
                                return Err(bad(format!("receives gradient {mb} at the last stage")))
                            }
                            (false, _) => (vs + 1) % p,
                        };
                        let what = if activation { "activation" } else { "gradient" };
                        let channel = channels.entry((from, s, activation)).or_default();
                        match channel.front().copied() {
                            Some(got) if got == (mb, chunk) => {
                                channel.pop_front();
                            }
                            Some((got, c)) => {
                                return Err(bad(format!(
                                    "expects {what} {mb} (chunk {chunk}), the next one is {got} (chunk {c})"
                                )))
                            }
                            None => break,
                        }
                    }
                    Action::ReduceGradients | Action::OptimizerStep => {}
                    Action::Forward { mb, chunk } | Action::Backward { mb, chunk } => {
                        if row[s].is_some() {
                            break;
                        }
                        if let Action::Forward { .. } = action {
                            forwarded[s].insert((mb, chunk));
                            held[s] += 1;
                            peak[s] = peak[s].max(held[s]);
                        } else {
                            if !forwarded[s].contains(&(mb, chunk)) {
                                return Err(bad(format!("runs backward {mb} (chunk {chunk}) before its forward")));
                            }
                            held[s] -= 1;
                        }
                        row[s] = Some(action);
                    }
                }
                at[s] += 1;
                moved = true;
            }
        }
        if row.iter().any(Option::is_some) {
            timeline.push(row);
        }
        for (channel, message) in posted {
            channels.entry(channel).or_default().push_back(message);
        }
        if (0..p).all(|s| at[s] == plan[s].len()) {
            break;
        }
        if !moved {
            let s = (0..p).find(|&s| at[s] < plan[s].len()).expect("some stage is not done");
            return Err(ScheduleError::Deadlock { stage: s, index: at[s], action: plan[s][at[s]] });
        }
    }
    if let Some((&(from, _, _), _)) = channels.iter().find(|(_, q)| !q.is_empty()) {
        return Err(ScheduleError::Invalid { stage: from, what: "sent messages nobody received".into() });
    }
    let steps = timeline.len();
    let busy: usize = timeline.iter().map(|r| r.iter().filter(|a| a.is_some()).count()).sum();
    let bubble = if steps == 0 { 0.0 } else { 1.0 - busy as f64 / (steps * p) as f64 };
    Ok(Simulation { peak_activations: peak, steps, bubble, timeline })
}

/// The schedule as a table, one row per stage and one column per time step (`F3`, `B3`, `.` idle; `F3.1` is chunk 1).
pub fn table(sim: &Simulation) -> String {
    let p = sim.timeline.first().map_or(0, Vec::len);
    let cell = |a: &Option<Action>| a.map_or(".".to_string(), |a| a.to_string());
    let width = sim.timeline.iter().flatten().map(|a| cell(a).len()).max().unwrap_or(1);
    let mut out = String::new();
    for s in 0..p {
        let cells: Vec<String> = sim.timeline.iter().map(|row| format!("{:>width$}", cell(&row[s]))).collect();
        out.push_str(&format!("stage {s}: {}\n", cells.join(" ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_schedule_pairs_its_messages_and_terminates() {
        for kind in [Kind::GPipe, Kind::OneFOneB] {
            for p in 1..=8 {
                for m in p..=32 {
                    let plan = build(kind, p, m, false).unwrap();
                    let sim = validate(&plan).unwrap_or_else(|e| panic!("{kind:?} p {p} m {m}: {e}"));
                    // Every stage runs m forwards and m backwards.
                    for (s, actions) in plan.iter().enumerate() {
                        let f = actions.iter().filter(|a| matches!(a, Action::Forward { .. })).count();
                        let b = actions.iter().filter(|a| matches!(a, Action::Backward { .. })).count();
                        assert_eq!((f, b), (m, m), "{kind:?} p {p} m {m} stage {s}");
                    }
                    // 2(m + p - 1) time steps, and the bubble (p - 1) / (m + p - 1).
                    assert_eq!(sim.steps, 2 * (m + p - 1), "{kind:?} p {p} m {m}");
                    let bubble = (p - 1) as f64 / (m + p - 1) as f64;
                    assert!((sim.bubble - bubble).abs() < 1e-12, "{kind:?} p {p} m {m}: {} vs {bubble}", sim.bubble);
                    for s in 0..p {
                        let expect = match kind {
                            Kind::GPipe => m,
                            Kind::OneFOneB => (p - s).min(m),
                            Kind::Interleaved(_) => unreachable!(),
                        };
                        assert_eq!(sim.peak_activations[s], expect, "{kind:?} p {p} m {m} stage {s}");
                    }
                }
            }
        }
    }

    #[test]
    fn fewer_micro_batches_than_stages_is_refused_unless_asked() {
        let e = build(Kind::OneFOneB, 4, 2, false).unwrap_err();
        assert_eq!(e, ScheduleError::FewerMicroBatchesThanStages { stages: 4, micro_batches: 2 });
        assert!(e.to_string().contains("2 micro-batches for 4 stages"));
        // Allowed, it still runs (the lecture's naive model parallelism is m = 1).
        let sim = validate(&build(Kind::OneFOneB, 4, 1, true).unwrap()).unwrap();
        assert_eq!(sim.steps, 2 * 4);
        assert_eq!(build(Kind::GPipe, 0, 3, false).unwrap_err(), ScheduleError::Empty { stages: 0, micro_batches: 3 });
    }

    #[test]
    fn broken_schedules_are_caught() {
        // A receive of the wrong micro-batch.
        let mut plan = build(Kind::GPipe, 2, 2, false).unwrap();
        plan[1].swap(0, 3); // recv-act 1 first
        assert!(matches!(validate(&plan), Err(ScheduleError::Invalid { stage: 1, .. })), "{:?}", validate(&plan));
        // A receive nobody sends: a deadlock, naming a stage that waits and what for.
        let mut plan = build(Kind::OneFOneB, 2, 2, false).unwrap();
        plan[0].retain(|a| !matches!(a, Action::SendActivation { mb: 1, .. }));
        let e = validate(&plan).unwrap_err();
        assert!(matches!(e, ScheduleError::Deadlock { .. }), "{e:?}");
        assert!(e.to_string().starts_with("the schedule deadlocks: stage "), "{e}");
        // A message left unreceived.
        let mut plan = build(Kind::GPipe, 2, 2, false).unwrap();
        plan[0].insert(0, Action::SendActivation { mb: 9, chunk: 0 });
        assert!(validate(&plan).is_err());
    }

    #[test]
    fn interleaving_divides_the_bubble_by_the_chunks() {
        for p in 2..=8 {
            for v in 2..=4 {
                for m in (p..=32).step_by(p) {
                    let plan = build(Kind::Interleaved(v), p, m, false).unwrap();
                    let sim = validate(&plan).unwrap_or_else(|e| panic!("p {p} v {v} m {m}: {e}"));
                    for (s, actions) in plan.iter().enumerate() {
                        for chunk in 0..v {
                            let f = actions
                                .iter()
                                .filter(|a| matches!(a, Action::Forward { chunk: c, .. } if *c == chunk))
                                .count();
                            let b = actions
                                .iter()
                                .filter(|a| matches!(a, Action::Backward { chunk: c, .. } if *c == chunk))
                                .count();
                            assert_eq!((f, b), (m, m), "p {p} v {v} m {m} stage {s} chunk {chunk}");
                        }
                        // Warm-up forwards plus one, in chunks: (p - s - 1) * 2 + (v - 1) * p + 1, at most all.
                        let expect = ((p - s - 1) * 2 + (v - 1) * p + 1).min(m * v);
                        assert_eq!(sim.peak_activations[s], expect, "p {p} v {v} m {m} stage {s}");
                    }
                    // A chunk's pass is one time step: 2(vm + p - 1) steps, the bubble (p - 1) / (vm + p - 1).
                    assert_eq!(sim.steps, 2 * (v * m + p - 1), "p {p} v {v} m {m}");
                    let bubble = (p - 1) as f64 / (v * m + p - 1) as f64;
                    assert!((sim.bubble - bubble).abs() < 1e-12, "p {p} v {v} m {m}: {} vs {bubble}", sim.bubble);
                }
            }
        }
        let e = build(Kind::Interleaved(2), 4, 6, false).unwrap_err();
        assert!(e.to_string().contains("must be a multiple of the stages"), "{e}");
        assert!(build(Kind::Interleaved(1), 4, 8, false).is_err());
        assert!(build(Kind::Interleaved(2), 1, 8, false).is_err());
    }

    #[test]
    fn the_table_shows_each_stage_by_time_step() {
        let sim = validate(&build(Kind::OneFOneB, 2, 2, false).unwrap()).unwrap();
        assert_eq!(table(&sim), "stage 0: F0 F1  . B0  . B1\nstage 1:  . F0 B0 F1 B1  .\n");
    }
}
