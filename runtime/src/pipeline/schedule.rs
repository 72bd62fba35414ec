//! Pipeline schedules as data (torch.distributed.pipelining's representation, DeepSpeed's TrainSchedule's steps):
//! for `p` stages and `m` micro-batches, each stage's ordered actions for one optimizer step. Tensor-free, so the
//! schedules are proven here by simulation before any rank runs one.
//!
//! - GPipe: every forward, then every backward; a stage holds all `m` micro-batches' activations.
//! - 1F1B: stage `s` runs `p - s - 1` forwards ahead (the warm-up), then alternates one forward and one backward,
//!   then drains the backwards: it holds at most `min(p - s, m)` activations, whatever `m` is.
//!
//! Sends are asynchronous (posted, then waited on before the buffer is reused), receives block: [`validate`]
//! simulates exactly that.
use std::collections::VecDeque;
use std::fmt;

/// What a stage does, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Receive micro-batch `mb`'s activation from the previous stage.
    RecvActivation {
        mb: usize,
    },
    Forward {
        mb: usize,
    },
    /// Send micro-batch `mb`'s output to the next stage.
    SendActivation {
        mb: usize,
    },
    /// Receive the gradient of micro-batch `mb`'s output from the next stage.
    RecvGradient {
        mb: usize,
    },
    Backward {
        mb: usize,
    },
    /// Send the gradient of micro-batch `mb`'s input to the previous stage.
    SendGradient {
        mb: usize,
    },
    /// Reduce this stage's gradients over its data-parallel group (once, after the last backward).
    ReduceGradients,
    OptimizerStep,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::RecvActivation { mb } => write!(f, "recv-act {mb}"),
            Action::Forward { mb } => write!(f, "F{mb}"),
            Action::SendActivation { mb } => write!(f, "send-act {mb}"),
            Action::RecvGradient { mb } => write!(f, "recv-grad {mb}"),
            Action::Backward { mb } => write!(f, "B{mb}"),
            Action::SendGradient { mb } => write!(f, "send-grad {mb}"),
            Action::ReduceGradients => write!(f, "reduce"),
            Action::OptimizerStep => write!(f, "step"),
        }
    }
}

/// Which schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    GPipe,
    OneFOneB,
}

impl Kind {
    pub fn from_name(name: &str) -> Option<Kind> {
        match name {
            "gpipe" => Some(Kind::GPipe),
            "1f1b" => Some(Kind::OneFOneB),
            _ => None,
        }
    }
}

/// A schedule that cannot be made or does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("a pipeline of {stages} stages needs at least one stage and one micro-batch ({micro_batches} given)")]
    Empty { stages: usize, micro_batches: usize },
    #[error(
        "{micro_batches} micro-batches for {stages} stages: fewer micro-batches than stages leaves stages idle for most of the step (and hangs some implementations); use at least {stages}, or allow it explicitly"
    )]
    FewerMicroBatchesThanStages { stages: usize, micro_batches: usize },
    #[error("the schedule deadlocks: stage {stage} waits at action {index} ({action}) and no stage can move")]
    Deadlock { stage: usize, index: usize, action: Action },
    #[error("stage {stage}: {what}")]
    Invalid { stage: usize, what: String },
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
    Ok((0..p)
        .map(|s| {
            let forward = |mb: usize, out: &mut Vec<Action>| {
                if s > 0 {
                    out.push(Action::RecvActivation { mb });
                }
                out.push(Action::Forward { mb });
                if s + 1 < p {
                    out.push(Action::SendActivation { mb });
                }
            };
            let backward = |mb: usize, out: &mut Vec<Action>| {
                if s + 1 < p {
                    out.push(Action::RecvGradient { mb });
                }
                out.push(Action::Backward { mb });
                if s > 0 {
                    out.push(Action::SendGradient { mb });
                }
            };
            let mut out = Vec::new();
            match kind {
                Kind::GPipe => {
                    (0..m).for_each(|mb| forward(mb, &mut out));
                    (0..m).for_each(|mb| backward(mb, &mut out));
                }
                Kind::OneFOneB => {
                    let warmup = (p - s - 1).min(m);
                    let (mut f, mut b) = (0, 0);
                    while f < warmup {
                        forward(f, &mut out);
                        f += 1;
                    }
                    while f < m {
                        forward(f, &mut out);
                        f += 1;
                        backward(b, &mut out);
                        b += 1;
                    }
                    while b < m {
                        backward(b, &mut out);
                        b += 1;
                    }
                }
            }
            out.push(Action::ReduceGradients);
            out.push(Action::OptimizerStep);
            out
        })
        .collect())
}

/// What [`validate`] found: each stage's peak of activations held (forwards whose backward has not run), and the
/// bubble: the idle fraction of stage-time when a forward or a backward takes one time step and a stage waits for
/// its inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    pub peak_activations: Vec<usize>,
    /// Compute steps until the last stage's last action.
    pub steps: usize,
    pub bubble: f64,
    /// Per time step, per stage: the compute action run then (None: idle).
    pub timeline: Vec<Vec<Option<Action>>>,
}

/// Runs every stage's actions together: sends are posted at once, receives wait for theirs (in order, per channel),
/// forwards and backwards take one time step each. Fails on a deadlock, a receive that meets another micro-batch
/// than it expects, a backward before its forward, or a message left unreceived.
pub fn validate(plan: &[Vec<Action>]) -> Result<Simulation, ScheduleError> {
    let p = plan.len();
    // Channels: activations s -> s+1, gradients s+1 -> s.
    let mut activations: Vec<VecDeque<usize>> = vec![VecDeque::new(); p];
    let mut gradients: Vec<VecDeque<usize>> = vec![VecDeque::new(); p];
    let mut at = vec![0usize; p];
    let mut held = vec![0usize; p];
    let mut peak = vec![0usize; p];
    let mut forwarded: Vec<Vec<bool>> = vec![Vec::new(); p];
    let mut timeline = Vec::new();
    loop {
        // One time step: every stage first does what costs no time (sends, receives that are ready, the step),
        // then at most one compute action.
        let mut row: Vec<Option<Action>> = vec![None; p];
        let mut moved = false;
        // What is sent in this step arrives for the next one (a compute's output is not anyone's input in the
        // same step): (activation channel?, channel index, micro-batch).
        let mut posted: Vec<(bool, usize, usize)> = Vec::new();
        for s in 0..p {
            while let Some(&action) = plan[s].get(at[s]) {
                let bad = |what: String| ScheduleError::Invalid { stage: s, what };
                match action {
                    Action::SendActivation { mb } => {
                        if s + 1 >= p {
                            return Err(bad(format!("sends activation {mb} past the last stage")));
                        }
                        posted.push((true, s, mb));
                    }
                    Action::SendGradient { mb } => {
                        if s == 0 {
                            return Err(bad(format!("sends gradient {mb} before the first stage")));
                        }
                        posted.push((false, s - 1, mb));
                    }
                    Action::RecvActivation { mb } => {
                        let channel = if s == 0 { None } else { Some(&mut activations[s - 1]) };
                        match channel.and_then(|c| c.front().copied()) {
                            Some(got) if got == mb => {
                                activations[s - 1].pop_front();
                            }
                            Some(got) => return Err(bad(format!("expects activation {mb}, the next one is {got}"))),
                            None => break,
                        }
                    }
                    Action::RecvGradient { mb } => match gradients[s].front().copied() {
                        Some(got) if got == mb => {
                            gradients[s].pop_front();
                        }
                        Some(got) => return Err(bad(format!("expects gradient {mb}, the next one is {got}"))),
                        None => break,
                    },
                    Action::ReduceGradients | Action::OptimizerStep => {}
                    Action::Forward { mb } | Action::Backward { mb } => {
                        if row[s].is_some() {
                            break;
                        }
                        if let Action::Forward { .. } = action {
                            if forwarded[s].len() <= mb {
                                forwarded[s].resize(mb + 1, false);
                            }
                            forwarded[s][mb] = true;
                            held[s] += 1;
                            peak[s] = peak[s].max(held[s]);
                        } else {
                            if !forwarded[s].get(mb).copied().unwrap_or(false) {
                                return Err(bad(format!("runs backward {mb} before its forward")));
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
        for &(activation, channel, mb) in &posted {
            if activation {
                activations[channel].push_back(mb);
            } else {
                gradients[channel].push_back(mb);
            }
        }
        if (0..p).all(|s| at[s] == plan[s].len()) {
            break;
        }
        if !moved {
            let s = (0..p).find(|&s| at[s] < plan[s].len()).expect("some stage is not done");
            return Err(ScheduleError::Deadlock { stage: s, index: at[s], action: plan[s][at[s]] });
        }
    }
    if let Some(s) = (0..p).find(|&s| !activations[s].is_empty() || !gradients[s].is_empty()) {
        return Err(ScheduleError::Invalid { stage: s, what: "sent messages nobody received".into() });
    }
    let steps = timeline.len();
    let busy: usize = timeline.iter().map(|r| r.iter().filter(|a| a.is_some()).count()).sum();
    let bubble = if steps == 0 { 0.0 } else { 1.0 - busy as f64 / (steps * p) as f64 };
    Ok(Simulation { peak_activations: peak, steps, bubble, timeline })
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
        plan[0].retain(|a| !matches!(a, Action::SendActivation { mb: 1 }));
        let e = validate(&plan).unwrap_err();
        assert!(matches!(e, ScheduleError::Deadlock { .. }), "{e:?}");
        assert!(e.to_string().starts_with("the schedule deadlocks: stage "), "{e}");
        // A message left unreceived.
        let mut plan = build(Kind::GPipe, 2, 2, false).unwrap();
        plan[0].insert(0, Action::SendActivation { mb: 9 });
        assert!(validate(&plan).is_err());
    }
}
