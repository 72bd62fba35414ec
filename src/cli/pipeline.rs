//! `zerorun pipeline schedule`: a schedule as the stages run it, checked by simulation before any rank does: the
//! table of compute by stage and time step, the bubble (idle fraction), and each stage's peak of activations held.
use clap::Subcommand;
use zerorun_schedule::{build, table, validate, Action, Kind};

use super::{emit, CliError};

#[derive(Subcommand)]
pub enum PipelineCommand {
    /// Every stage's actions for one optimizer step, simulated together.
    Schedule {
        /// Pipeline stages (ranks along the pipeline).
        #[arg(long)]
        stages: usize,
        /// Micro-batches per optimizer step (gradient_accumulation_steps).
        #[arg(long)]
        micro_batches: usize,
        /// gpipe, 1f1b or interleaved.
        #[arg(long, default_value = "1f1b")]
        schedule: String,
        /// Chunks of layers per stage for the interleaved schedule.
        #[arg(long = "virtual", default_value_t = 2)]
        virtual_stages: usize,
        /// Run with fewer micro-batches than stages (most stages idle most of the step).
        #[arg(long)]
        allow_fewer_micro_batches: bool,
        /// Also list each stage's actions in order (sends and receives included).
        #[arg(long)]
        actions: bool,
        /// One JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: PipelineCommand) -> Result<(), CliError> {
    let PipelineCommand::Schedule {
        stages,
        micro_batches,
        schedule,
        virtual_stages,
        allow_fewer_micro_batches,
        actions,
        json,
    } = command;
    let kind = Kind::from_name(&schedule.to_ascii_lowercase(), virtual_stages)
        .ok_or_else(|| CliError::Usage(format!("--schedule {schedule}: expected gpipe, 1f1b or interleaved")))?;
    let plan =
        build(kind, stages, micro_batches, allow_fewer_micro_batches).map_err(|e| CliError::Usage(e.to_string()))?;
    let sim = validate(&plan).map_err(|e| CliError::Usage(format!("the schedule does not hold: {e}")))?;
    let v = kind.chunks();
    let theory = (stages - 1) as f64 / (v * micro_batches + stages - 1) as f64;
    if json {
        let value = serde_json::json!({
            "schedule": schedule,
            "stages": stages,
            "micro_batches": micro_batches,
            "virtual": v,
            "steps": sim.steps,
            "bubble": sim.bubble,
            "bubble_theory": theory,
            "peak_activations": sim.peak_activations,
            "actions": plan.iter().map(|a| a.iter().map(Action::to_string).collect::<Vec<_>>()).collect::<Vec<_>>(),
        });
        return emit(&value.to_string());
    }
    let mut out = format!(
        "{schedule} schedule, {stages} stages, {micro_batches} micro-batches{}: {} time steps (a forward or a backward{} is one)\n",
        if v > 1 { format!(", {v} chunks per stage") } else { String::new() },
        sim.steps,
        if v > 1 { " of a chunk" } else { "" },
    );
    out.push_str(&table(&sim));
    out.push_str(&format!(
        "bubble: {:.4} of stage-time idle ((p - 1) / ({}m + p - 1) = {theory:.4})\n",
        sim.bubble,
        if v > 1 { "v" } else { "" }
    ));
    let peaks: Vec<String> = sim.peak_activations.iter().map(usize::to_string).collect();
    out.push_str(&format!(
        "peak activations held per stage{}: {}",
        if v > 1 { " (in chunks)" } else { "" },
        peaks.join(" ")
    ));
    if actions {
        for (s, a) in plan.iter().enumerate() {
            let list: Vec<String> = a.iter().map(Action::to_string).collect();
            out.push_str(&format!("\nstage {s}: {}", list.join(", ")));
        }
    }
    emit(&out)
}
