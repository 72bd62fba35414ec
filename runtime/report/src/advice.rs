//! "What would help": lines computed from one rank's report alone (its measured categories at the peak event,
//! the units' activations, the estimator's model states under other configurations), never generic advice.
use crate::memory::{EventSample, MemoryReport};

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

fn at(e: &EventSample, name: &str) -> u64 {
    e.categories.get(name).copied().unwrap_or(0)
}

/// The lines for `report`, largest saving first; empty without a peak event.
pub fn advice(report: &MemoryReport) -> Vec<String> {
    let Some(peak) = &report.peak else { return Vec::new() };
    let mut lines: Vec<(u64, String)> = Vec::new();
    // Activations: what checkpointing keeps of the units (their inputs, one unit recomputed at a time) against
    // what the peak holds.
    let end_of_forward = report.events.iter().find(|e| e.event == "forward").map_or(0, |e| at(e, "activations"));
    let held = at(peak, "activations");
    if !report.unit_activations_bytes.is_empty() && end_of_forward > 0 {
        let units = report.unit_activations_bytes.len();
        let inputs: u64 = report.unit_input_bytes.iter().sum();
        let one = report.unit_activations_bytes.iter().copied().max().unwrap_or(0);
        let kept = inputs + one;
        if held > kept {
            lines.push((
                held - kept,
                format!(
                    "activation checkpointing of the {units} units would lower the peak by about {} (activations at the peak {}, at the end of forward {}; kept: the units' inputs {} and one unit recomputed {})",
                    mib(held - kept), mib(held), mib(end_of_forward), mib(inputs), mib(one)
                ),
            ));
        } else if held == 0 {
            lines.push((
                0,
                format!(
                    "activations ({} at the end of forward) are freed before the peak (`{}`): activation checkpointing would not lower it",
                    mib(end_of_forward), peak.event
                ),
            ));
        }
    } else if held > 0 {
        lines.push((
            held / 2,
            format!(
                "activations hold {} at the peak ({} at the end of forward): activation checkpointing (`engine.unit_checkpointed` for a scope, EngineOptions::activation_checkpointing for `engine.forward`'s units) keeps only each unit's input",
                mib(held), mib(end_of_forward)
            ),
        ));
    }
    // Model states under other configurations (the estimator's count for this rank).
    let now = report.model_states.estimated_bytes;
    for alt in &report.alternatives {
        if alt.model_states_bytes < now {
            let saved = now - alt.model_states_bytes;
            lines.push((
                saved,
                format!(
                    "`{}` would hold {} of model states here instead of {} ({} less)",
                    alt.change,
                    mib(alt.model_states_bytes),
                    mib(now),
                    mib(saved)
                ),
            ));
        }
    }
    let retained = at(peak, "allocator_retained");
    if retained * 10 > peak.rss_bytes {
        lines.push((
            retained,
            format!(
                "malloc keeps {} of freed blocks at the peak ({:.0}% of it): the pages of freed blocks below 256 KiB stay in its heap, and blocks from there up are kept for the next allocation of their size within the live peak plus the largest block; ZERORUN_ALLOCATOR_CACHE=peak keeps within the peak alone, 0 none (each freed block unmapped at once, at the price of mapping it again), and a program that keeps many small tensors across steps holds their heap pages itself",
                mib(retained),
                100.0 * retained as f64 / peak.rss_bytes.max(1) as f64
            ),
        ));
    }
    let temporaries = at(peak, "temporaries");
    if temporaries * 10 > peak.rss_bytes {
        let largest = report
            .peak_allocations
            .as_ref()
            .and_then(|p| p.allocations.iter().find(|a| a.owner == "program" || a.owner == "backward"))
            .map_or(String::new(), |a| format!("; the largest: {} from `{}` during `{}`", mib(a.bytes), a.op, a.phase));
        lines.push((
            temporaries,
            format!(
                "temporaries hold {} at the peak: tensors the program keeps (inputs, the loss, data) and backward's{largest}",
                mib(temporaries)
            ),
        ));
    }
    lines.sort_by_key(|l| std::cmp::Reverse(l.0));
    lines.into_iter().map(|(_, l)| l).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Alternative, ModelStates, SCHEMA_VERSION};

    const MIB: u64 = 1 << 20;

    fn event(name: &str, rss: u64, categories: &[(&str, u64)]) -> EventSample {
        EventSample {
            step: 2,
            event: name.into(),
            rss_bytes: rss,
            categories: categories.iter().map(|(n, b)| (n.to_string(), *b)).collect(),
        }
    }

    fn report(peak: EventSample, forward: EventSample) -> MemoryReport {
        MemoryReport {
            schema_version: SCHEMA_VERSION,
            rank: 0,
            world_size: 2,
            stage: 3,
            precision: "fp32".into(),
            categories: Default::default(),
            model_states: ModelStates { measured_bytes: 400 * MIB, estimated_bytes: 400 * MIB },
            floor_rss_bytes: 100 * MIB,
            init_peak_rss_bytes: 0,
            peak_rss_bytes: peak.rss_bytes,
            steps: Vec::new(),
            events: vec![forward, peak.clone()],
            peak: Some(peak),
            pipeline: None,
            device: None,
            device_memory: None,
            unit_activations_bytes: vec![20 * MIB; 10],
            unit_input_bytes: vec![2 * MIB; 10],
            peak_allocations: None,
            peak_window: None,
            experts: None,
            alternatives: vec![
                Alternative {
                    change: "zero_optimization.offload_optimizer.device: nvme".into(),
                    model_states_bytes: 150 * MIB,
                },
                Alternative { change: "never smaller".into(), model_states_bytes: 500 * MIB },
            ],
        }
    }

    #[test]
    fn lines_come_from_the_reports_numbers_largest_saving_first() {
        let peak = event(
            "backward: unit 8 reduced",
            1000 * MIB,
            &[("activations", 180 * MIB), ("allocator_retained", 200 * MIB)],
        );
        let forward = event("forward", 900 * MIB, &[("activations", 200 * MIB)]);
        let lines = advice(&report(peak, forward));
        assert_eq!(lines.len(), 3, "{lines:#?}");
        // Offload saves 250 MiB, malloc keeps 200 MiB, checkpointing keeps 20 MiB of inputs + one 20 MiB unit.
        assert!(lines[0].starts_with("`zero_optimization.offload_optimizer.device: nvme` would hold 150.0 MiB of model states here instead of 400.0 MiB (250.0 MiB less)"), "{lines:#?}");
        assert!(lines[1].starts_with("malloc keeps 200.0 MiB of freed blocks at the peak (20% of it)"), "{lines:#?}");
        assert!(lines[2].starts_with("activation checkpointing of the 10 units would lower the peak by about 140.0 MiB (activations at the peak 180.0 MiB, at the end of forward 200.0 MiB; kept: the units' inputs 20.0 MiB and one unit recomputed 20.0 MiB)"), "{lines:#?}");
    }

    #[test]
    fn freed_activations_are_said_to_be_no_help() {
        let peak = event("optimizer step", 1000 * MIB, &[("activations", 0)]);
        let forward = event("forward", 900 * MIB, &[("activations", 200 * MIB)]);
        let mut r = report(peak, forward);
        r.alternatives.clear();
        assert_eq!(
            advice(&r),
            ["activations (200.0 MiB at the end of forward) are freed before the peak (`optimizer step`): activation checkpointing would not lower it"]
        );
        r.peak = None;
        assert!(advice(&r).is_empty());
    }
}
