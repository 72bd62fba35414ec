//! The memory report as text: one table of every rank (categories by ranks, model states against the estimate,
//! the floor and the peaks), the peak's line per rank, what would help, and the peak's largest allocations.
use crate::memory::{DeviceMemory, EventSample, MemoryReport, PeakAllocations, PipelineStage, MODEL_STATE_CATEGORIES};

fn mib(b: u64) -> String {
    format!("{:.2}", b as f64 / (1024.0 * 1024.0))
}

/// One table: rows are categories (current / peak), columns are ranks; model states measured next to the
/// estimate; peak RSS.
pub fn table(reports: &[MemoryReport]) -> String {
    let mut names: Vec<&String> = Vec::new();
    for r in reports {
        for n in r.categories.keys() {
            if !names.contains(&n) {
                names.push(n);
            }
        }
    }
    let order = |n: &str| MODEL_STATE_CATEGORIES.iter().position(|c| *c == n).unwrap_or(MODEL_STATE_CATEGORIES.len());
    names.sort_by_key(|n| (order(n), n.to_string()));
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    for n in names {
        let cells = reports
            .iter()
            .map(|r| {
                r.categories.get(n).map_or("-".into(), |c| {
                    if c.peak_bytes > c.current_bytes {
                        format!("{} (peak {})", mib(c.current_bytes), mib(c.peak_bytes))
                    } else {
                        mib(c.current_bytes)
                    }
                })
            })
            .collect();
        rows.push((n.clone(), cells));
    }
    rows.push(("model states, measured".into(), reports.iter().map(|r| mib(r.model_states.measured_bytes)).collect()));
    rows.push(("model states, estimate".into(), reports.iter().map(|r| mib(r.model_states.estimated_bytes)).collect()));
    if reports.iter().any(|r| r.experts.is_some()) {
        // A mixture of experts: how much of the model states is the experts', and of that the parameters' part.
        let cell = |r: &MemoryReport, f: &dyn Fn(&crate::memory::ExpertStates) -> u64| {
            r.experts.as_ref().map_or("-".into(), |e| mib(f(e)))
        };
        rows.push(("model states, experts'".into(), reports.iter().map(|r| cell(r, &|e| e.bytes())).collect()));
        for name in ["parameters", "gradients_full", "gradients_shard", "master_fp32", "optimizer_states"] {
            if reports
                .iter()
                .any(|r| r.experts.as_ref().is_some_and(|e| e.categories.get(name).is_some_and(|b| *b > 0)))
            {
                rows.push((
                    format!("  of which {name}"),
                    reports.iter().map(|r| cell(r, &|e| e.categories.get(name).copied().unwrap_or(0))).collect(),
                ));
            }
        }
    }
    rows.push(("process floor (RSS at initialize)".into(), reports.iter().map(|r| mib(r.floor_rss_bytes)).collect()));
    rows.push(("peak RSS during initialize".into(), reports.iter().map(|r| mib(r.init_peak_rss_bytes)).collect()));
    rows.push((
        "peak event RSS".into(),
        reports.iter().map(|r| r.peak.as_ref().map_or("-".into(), |p| mib(p.rss_bytes))).collect(),
    ));
    rows.push((
        "unaccounted at the peak event".into(),
        reports
            .iter()
            .map(|r| r.peak.as_ref().map_or("-".into(), |p| mib_signed(p.unaccounted_bytes(r.floor_rss_bytes))))
            .collect(),
    ));
    rows.push(("peak RSS (process)".into(), reports.iter().map(|r| mib(r.peak_rss_bytes)).collect()));
    if reports.iter().any(|r| r.device_memory.is_some()) {
        let cell =
            |r: &MemoryReport, f: &dyn Fn(&DeviceMemory) -> String| r.device_memory.as_ref().map_or("-".into(), f);
        rows.insert(0, ("device".into(), reports.iter().map(|r| r.device.clone().unwrap_or("cpu".into())).collect()));
        rows.push((
            "device allocated (CUDA allocator)".into(),
            reports
                .iter()
                .map(|r| cell(r, &|d| format!("{} (peak {})", mib(d.allocated), mib(d.allocated_peak))))
                .collect(),
        ));
        rows.push((
            "device reserved (CUDA allocator)".into(),
            reports
                .iter()
                .map(|r| cell(r, &|d| format!("{} (peak {})", mib(d.reserved), mib(d.reserved_peak))))
                .collect(),
        ));
    }
    if reports.iter().any(|r| r.pipeline.is_some()) {
        let cell = |r: &MemoryReport, f: &dyn Fn(&PipelineStage) -> String| r.pipeline.as_ref().map_or("-".into(), f);
        rows.insert(
            0,
            ("pipeline stage layers".into(), reports.iter().map(|r| cell(r, &|p| p.layers.clone())).collect()),
        );
        let share = |part: &dyn Fn(&PipelineStage) -> f64| -> Vec<String> {
            reports
                .iter()
                .map(|r| cell(r, &|p| format!("{:.1}%", 100.0 * (part(p) / p.step_us.max(1) as f64).max(0.0))))
                .collect()
        };
        rows.push(("stage compute".into(), share(&|p| p.compute_us as f64)));
        rows.push(("stage optimizer step".into(), share(&|p| p.optimizer_us as f64)));
        rows.push(("stage waiting on neighbours".into(), share(&|p| p.wait_us as f64)));
        // Neither computing nor stepping: the schedule's bubble and the waits.
        rows.push((
            "stage idle (bubble and waits)".into(),
            share(&|p| p.step_us as f64 - p.compute_us as f64 - p.optimizer_us as f64),
        ));
    }
    let header: Vec<String> = reports
        .iter()
        .map(|r| match &r.pipeline {
            Some(p) => format!("rank {} (stage {})", r.rank, p.stage),
            None => format!("rank {}", r.rank),
        })
        .collect();
    let first = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max("memory (MiB)".len());
    let widths: Vec<usize> = (0..reports.len())
        .map(|i| rows.iter().map(|r| r.1[i].len()).chain([header[i].len()]).max().unwrap_or(0))
        .collect();
    let mut out = format!("{:<first$}", "memory (MiB)");
    for (h, w) in header.iter().zip(&widths) {
        out += &format!("  {h:>w$}");
    }
    for (name, cells) in rows {
        out += &format!("\n{name:<first$}");
        for (c, w) in cells.iter().zip(&widths) {
            out += &format!("  {c:>w$}");
        }
    }
    for r in reports {
        if let Some(p) = &r.peak {
            out += &format!("\nrank {}: {}", r.rank, describe_peak(p, r.floor_rss_bytes));
        }
        // The process's own peak, when it fell between events above the highest one.
        if let (Some(w), Some(p)) = (&r.peak_window, &r.peak) {
            if w.rss_bytes > p.rss_bytes {
                let after = w.after.as_ref().map_or("the start".to_string(), |a| format!("`{a}`"));
                out += &format!(
                    "\nrank {}: the process peaked at {} MiB in step {}, between {after} and `{}`",
                    r.rank,
                    mib(w.rss_bytes),
                    w.step,
                    w.before
                );
            }
        }
    }
    // What would help, per rank unless it says what the rank before said.
    let mut said: Vec<String> = Vec::new();
    for r in reports {
        let lines = crate::advice::advice(r);
        if !lines.is_empty() && lines != said {
            out += &format!("\nwhat would help (rank {}):", r.rank);
            for l in &lines {
                out += &format!("\n  - {l}");
            }
            said = lines;
        }
    }
    if let Some(snapshot) = reports.iter().find_map(|r| r.peak_allocations.as_ref().map(|p| (r.rank, p))) {
        out += &format!("\n{}", allocations_table(snapshot.0, snapshot.1));
    }
    out
}

/// The largest live allocations at a rank's highest event, one line each.
pub fn allocations_table(rank: usize, p: &PeakAllocations) -> String {
    let mut out = format!(
        "largest live allocations on rank {rank} at step {}, `{}` ({} MiB resident, {} MiB in live tensors):",
        p.step,
        p.event,
        mib(p.rss_bytes),
        mib(p.live_bytes)
    );
    out += &format!("\n  {:>10}  {:<8}  {:<28}  operator", "MiB", "owner", "phase");
    for a in &p.allocations {
        let op = if a.op.is_empty() { "-" } else { &a.op };
        out += &format!("\n  {:>10}  {:<8}  {:<28}  {op}", mib(a.bytes), a.owner, a.phase);
    }
    out
}

/// "peak 3.06 GiB at step 2, backward: unit 2 gradients: parameters_gathered 544.0 MiB, ..., unaccounted 12.0 MiB"
pub fn describe_peak(p: &EventSample, floor: u64) -> String {
    let mut parts: Vec<(&String, &u64)> = p.categories.iter().filter(|(_, b)| **b > 0).collect();
    parts.sort_by(|a, b| b.1.cmp(a.1));
    let held: Vec<String> = parts.iter().map(|(n, b)| format!("{n} {} MiB", mib(**b))).collect();
    format!(
        "peak {} MiB at step {}, {}: floor {} MiB, {}, unaccounted {} MiB",
        mib(p.rss_bytes),
        p.step,
        p.event,
        mib(floor),
        held.join(", "),
        mib_signed(p.unaccounted_bytes(floor))
    )
}

fn mib_signed(b: i64) -> String {
    if b < 0 {
        format!("-{}", mib(b.unsigned_abs()))
    } else {
        mib(b as u64)
    }
}
