//! `zerorun bench pipeline`: the pipeline engine's measured bubble beside the schedule's theory, for GPipe, 1F1B and
//! interleaved 1F1B on 2 and 4 stages of equal, known cost (see `zerorun_runtime::pipeline::bubble`).
use std::time::Duration;

use zerorun::runtime::pipeline::bubble::{measure, BubbleCase};

use super::{emit, CliError};

pub fn run(stage_ms: f64, steps: usize, json: bool) -> Result<(), CliError> {
    // Each rank thread sleeps or moves a few numbers: one libtorch thread each is plenty.
    tch::set_num_threads(1);
    let stage_time = Duration::from_secs_f64(stage_ms / 1000.0);
    let mut table = format!(
        "pipeline bubble: stages of equal cost ({stage_ms} ms forward and {stage_ms} ms backward per stage and micro-batch), median of {steps} steps\n{:<12} {:>6} {:>13} {:>7} {:>9} {:>7} {:>8}\n",
        "schedule", "stages", "micro-batches", "virtual", "measured", "theory", "ratio"
    );
    // Interleaving runs micro-batches in groups of one per stage.
    let cases: Vec<(usize, usize, &str, usize)> = [2usize, 4]
        .into_iter()
        .flat_map(|stages| [1usize, 2, 4, 8, 16].into_iter().map(move |m| (stages, m)))
        .flat_map(|(stages, m)| {
            [("gpipe", 1usize), ("1f1b", 1), ("interleaved", 2)].into_iter().map(move |(s, v)| (stages, m, s, v))
        })
        .filter(|&(stages, m, _, v)| v == 1 || m % stages == 0)
        .collect();
    let mut progress = super::cli::progress::Progress::new("bench pipeline", cases.len() as u64);
    for (stages, micro_batches, schedule, virtual_stages) in cases {
        progress.item(&format!("{schedule}, {stages} stages, {micro_batches} micro-batches"));
        let case = BubbleCase { schedule, stages, micro_batches, virtual_stages, stage_time, steps };
        let measured = measure(&case).map_err(|e| {
            CliError::Usage(format!("bench pipeline ({schedule}, {stages} stages, {micro_batches} micro-batches): {e}"))
        })?;
        progress.done();
        let theory = case.theory();
        if json {
            progress.suspend(|| {
                emit(
                    &serde_json::json!({
                        "schedule": schedule, "stages": stages, "micro_batches": micro_batches,
                        "virtual": virtual_stages, "bubble_measured": measured, "bubble_theory": theory,
                        "stage_ms": stage_ms,
                    })
                    .to_string(),
                )
            })?;
        } else {
            table.push_str(&format!(
                "{schedule:<12} {stages:>6} {micro_batches:>13} {virtual_stages:>7} {measured:>9.4} {theory:>7.4} {:>8.3}\n",
                measured / theory.max(1e-12)
            ));
        }
    }
    if !json {
        emit(table.trim_end())?;
    }
    Ok(())
}
