//! `memory.svg` and `memory.png`: one axis of resident memory. Every optimizer step is a bar at the step's highest
//! event, stacked floor, model states by kind, gathered units, buffers, activations, temporaries, what malloc
//! keeps, and what nothing explains; the resident memory is a red line over the bars (their tops, when the sum
//! closes) and the model-state estimate (in memory, not on NVMe) a black line above the floor. One panel per rank; beside each, the events
//! of the step that held the rank's peak (activations growing through forward, falling through backward).
//! [`draw_comparison`]: several runs side by side, every rank at its peak (`zerorun report compare`).
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::memory::{MemoryReport, MODEL_STATE_CATEGORIES};
use crate::{ReportError, Result};

/// Where Debian's fonts-dejavu-core puts its sans font (`make setup` installs it); plotters needs a font to
/// measure and draw text.
const FONT_PATHS: [&str; 2] =
    ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf"];

pub(crate) fn register_font() -> Result<()> {
    static FONT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let bytes = FONT_PATHS.iter().find_map(|p| std::fs::read(p).ok()).ok_or_else(|| {
            format!("no font for the memory plot (looked for {FONT_PATHS:?}; Debian: fonts-dejavu-core)")
        })?;
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| "the DejaVu font did not load".to_string())
    })
    .clone()
    .map_err(ReportError::Draw)
}

const MIB: f64 = 1024.0 * 1024.0;

/// Colors by category, in stacking order (model states first); event-only categories (`gradients_unit`) too.
/// Bytes on NVMe are not host memory: they are in the tables, never stacked with what is resident.
pub(crate) fn categories<'a>(reports: impl IntoIterator<Item = &'a MemoryReport>) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for r in reports {
        for n in r.categories.keys().chain(r.events.iter().flat_map(|e| e.categories.keys())) {
            if !names.contains(n) && !crate::memory::is_on_nvme(n) {
                names.push(n.clone());
            }
        }
    }
    names.sort_by_key(|n| (stack_order(n), n.clone()));
    names.insert(0, FLOOR.to_string());
    names.push(UNEXPLAINED.to_string());
    names
}

/// The bottom of every bar: the process before the engine (libraries, the program's data).
const FLOOR: &str = "floor";
/// The top: resident memory the floor and the categories leave unexplained.
const UNEXPLAINED: &str = "unaccounted";

/// Model states first, then the engine's other categories, then the measured ones.
fn stack_order(n: &str) -> usize {
    const MEASURED: [&str; 3] = ["activations", "temporaries", "allocator_retained"];
    let models = MODEL_STATE_CATEGORIES.len();
    match (MODEL_STATE_CATEGORIES.iter().position(|c| *c == n), MEASURED.iter().position(|c| *c == n)) {
        (Some(i), _) => i,
        (None, Some(i)) => models + 1 + i,
        (None, None) => models,
    }
}

/// One bar's segments: the floor, `categories` (resident ones), and the rest of `rss` they leave unexplained.
pub(crate) fn segments(categories: &BTreeMap<String, u64>, floor: u64, rss: u64) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> =
        categories.iter().filter(|(n, _)| !crate::memory::is_on_nvme(n)).map(|(n, b)| (n.clone(), *b)).collect();
    let held: u64 = out.values().sum::<u64>() + floor;
    out.insert(FLOOR.into(), floor);
    out.insert(UNEXPLAINED.into(), rss.saturating_sub(held));
    out
}

/// The x axis of a stacked chart: its title, a label for each x, and whether the resident memory is one line over
/// all bars (steps of one run) or a tick over each (separate runs).
struct XAxis<'a> {
    desc: &'a str,
    label: &'a dyn Fn(&f64) -> String,
    connect_rss: bool,
}

/// One bar of a stacked chart: where it stands, its segments (see [`segments`]), the resident memory then.
struct Point {
    x: f64,
    categories: BTreeMap<String, u64>,
    rss: u64,
}

/// Bars of `points` stacked by category (`names` gives order and colour) on one axis, the resident memory as a
/// red line (or a tick over each bar) on the same axis, and `estimate` (floor + the model states in memory) as a
/// black line.
fn stacked<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    x: &XAxis,
    names: &[String],
    points: &[Point],
    estimate: Option<u64>,
) -> std::result::Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let first = points.first().map_or(0.0, |p| p.x);
    let last = points.last().map_or(1.0, |p| p.x).max(first + 1.0);
    let stacked = |p: &Point| names.iter().filter_map(|n| p.categories.get(n)).sum::<u64>();
    let top = points.iter().map(|p| stacked(p).max(p.rss)).max().unwrap_or(0) as f64;
    let ymax = top.max(estimate.unwrap_or(0) as f64).max(1.0) * 1.1 / MIB;
    let x_range = (first - 0.5)..(last + 0.5);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(x_range, 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x.desc)
        .y_desc("resident MiB")
        // A label per bar when the bars fit (unit steps land on whole x), else about a dozen.
        .x_labels(if last - first <= 40.0 { (last - first) as usize + 1 } else { 12 })
        .x_label_formatter(x.label)
        .disable_x_mesh()
        .light_line_style(WHITE)
        .draw()
        .map_err(err)?;
    let rss_max = points.iter().map(|p| p.rss).max().unwrap_or(0) as f64;
    // 80% of the closest spacing, so neighbours never touch (comparisons leave gaps between runs).
    let spacing = points.windows(2).map(|w| w[1].x - w[0].x).fold(f64::INFINITY, f64::min);
    let width = if spacing.is_finite() { 0.8 * spacing } else { 0.8 };
    for (i, name) in names.iter().enumerate() {
        let color = colour(name, i);
        let bars = points.iter().map(|p| {
            let below: u64 = names[..i].iter().filter_map(|n| p.categories.get(n)).sum();
            let own = p.categories.get(name).copied().unwrap_or(0);
            Rectangle::new(
                [(p.x - width / 2.0, below as f64 / MIB), (p.x + width / 2.0, (below + own) as f64 / MIB)],
                color.filled(),
            )
        });
        chart.draw_series(bars).map_err(err)?;
    }
    if let Some(est) = estimate {
        let est = est as f64 / MIB;
        chart
            .draw_series(LineSeries::new([(first - 0.5, est), (last + 0.5, est)], BLACK.stroke_width(2)))
            .map_err(err)?;
    }
    if rss_max > 0.0 && x.connect_rss {
        let rss = points.iter().map(|p| (p.x, p.rss as f64 / MIB));
        chart.draw_series(LineSeries::new(rss, RED.stroke_width(2))).map_err(err)?;
    } else if rss_max > 0.0 {
        // Separate runs: a tick over each bar, no line between them.
        let ticks = points.iter().map(|p| {
            let y = p.rss as f64 / MIB;
            PathElement::new([(p.x - width / 2.0, y), (p.x + width / 2.0, y)], RED.stroke_width(3))
        });
        chart.draw_series(ticks).map_err(err)?;
    }
    Ok(())
}

/// The floor grey, what nothing explains light grey, the rest from the palette.
pub(crate) fn colour(name: &str, i: usize) -> RGBAColor {
    match name {
        FLOOR => RGBColor(150, 150, 150).to_rgba(),
        UNEXPLAINED => RGBColor(225, 225, 225).to_rgba(),
        _ => Palette99::pick(i).to_rgba(),
    }
}

/// The legend in a strip at the top, as many entries a row as the width holds (five at most), so it never hides
/// bars and no entry is cut off: a swatch per category, then `lines`. Returns the area below it.
fn legend<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    names: &[String],
    lines: &[(&str, RGBColor)],
) -> std::result::Result<DrawingArea<DB, Shift>, String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    const ENTRY_WIDTH: u32 = 188;
    let per_row = ((root.dim_in_pixel().0.saturating_sub(12)) / ENTRY_WIDTH).clamp(1, 5) as usize;
    let rows = (names.len() + lines.len()).div_ceil(per_row) as u32;
    let (strip, body) = root.split_vertically(12 + 20 * rows);
    let entry = |i: usize| (12 + (i % per_row) as i32 * ENTRY_WIDTH as i32, 10 + (i / per_row) as i32 * 20);
    let font = ("sans-serif", 13).into_font();
    for (i, name) in names.iter().enumerate() {
        let (x, y) = entry(i);
        strip.draw(&Rectangle::new([(x, y + 2), (x + 14, y + 14)], colour(name, i).filled())).map_err(err)?;
        strip.draw(&Text::new(name.clone(), (x + 20, y + 1), font.clone())).map_err(err)?;
    }
    for (k, (label, color)) in lines.iter().enumerate() {
        let (x, y) = entry(names.len() + k);
        strip.draw(&PathElement::new([(x, y + 8), (x + 14, y + 8)], color.stroke_width(2))).map_err(err)?;
        strip.draw(&Text::new(*label, (x + 20, y + 1), font.clone())).map_err(err)?;
    }
    Ok(body)
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, reports: &[MemoryReport]) -> std::result::Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let names = categories(reports);
    let lines = [("floor + states in memory (est.)", BLACK), ("resident memory", RED)];
    let body = legend(&root, &names, &lines)?;
    let panels = body.split_evenly((reports.len().max(1), 1));
    for (panel, r) in panels.iter().zip(reports) {
        // Left: every optimizer step; right: the events of the step that held the run's peak (when recorded).
        let (steps_area, events_area) = if r.events.is_empty() {
            (panel.clone(), None)
        } else {
            let (a, b) = panel.split_horizontally(panel.dim_in_pixel().0 * 3 / 5);
            (a, Some(b))
        };
        // Each step at its highest event when events were sampled, else its end.
        let points: Vec<Point> = r
            .steps
            .iter()
            .map(|s| {
                let (categories, rss) =
                    s.peak_event.as_ref().map_or((&s.categories, s.rss_bytes), |e| (&e.categories, e.rss_bytes));
                Point { x: s.step as f64, categories: segments(categories, r.floor_rss_bytes, rss), rss }
            })
            .collect();
        let caption = format!("rank {} of {}: ZeRO stage {}, {}", r.rank, r.world_size, r.stage, r.precision);
        let step_number = |x: &f64| format!("{x:.0}");
        let steps = XAxis { desc: "optimizer step", label: &step_number, connect_rss: true };
        // The estimate's resident part: what is on NVMe (measured equal to its estimate) is not in memory.
        let on_nvme: u64 =
            r.categories.iter().filter(|(name, _)| crate::memory::is_on_nvme(name)).map(|(_, b)| b.peak_bytes).sum();
        let estimate = r.floor_rss_bytes + r.model_states.estimated_bytes.saturating_sub(on_nvme);
        stacked(&steps_area, &caption, &steps, &names, &points, Some(estimate))?;
        if let Some(area) = events_area {
            let points: Vec<Point> = r
                .events
                .iter()
                .enumerate()
                .map(|(i, e)| Point {
                    x: i as f64,
                    categories: segments(&e.categories, r.floor_rss_bytes, e.rss_bytes),
                    rss: e.rss_bytes,
                })
                .collect();
            let step = r.events[0].step;
            let events = XAxis { desc: "event (gather, gradients, step)", label: &step_number, connect_rss: true };
            stacked(&area, &format!("events of step {step} (the peak's)"), &events, &names, &points, None)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Draws `memory.svg` and `memory.png` into `dir` from every rank's report.
pub fn draw_memory(dir: &Path, reports: &[MemoryReport]) -> Result<(std::path::PathBuf, std::path::PathBuf)> {
    register_font()?;
    let (svg, png) = (dir.join("memory.svg"), dir.join("memory.png"));
    let wide = reports.iter().any(|r| !r.events.is_empty());
    let size = (if wide { 1440 } else { 960 }, 80 + 320 * reports.len().max(1) as u32);
    draw(SVGBackend::new(&svg, size).into_drawing_area(), reports)
        .map_err(|e| ReportError::Io { path: svg.clone(), what: e })?;
    draw(BitMapBackend::new(&png, size).into_drawing_area(), reports)
        .map_err(|e| ReportError::Io { path: png.clone(), what: e })?;
    Ok((svg, png))
}

/// A rank's bar at its peak: the peak event's categories and resident memory when events were recorded, else the
/// step sample with the most resident memory.
fn at_peak(r: &MemoryReport) -> Option<(&BTreeMap<String, u64>, u64)> {
    match &r.peak {
        Some(p) => Some((&p.categories, p.rss_bytes)),
        None => r.steps.iter().max_by_key(|s| s.rss_bytes).map(|s| (&s.categories, s.rss_bytes)),
    }
}

fn draw_runs<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    runs: &[(String, Vec<MemoryReport>)],
) -> std::result::Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    // Bars are host memory (`categories` leaves out what is on NVMe).
    let names: Vec<String> = categories(runs.iter().flat_map(|(_, r)| r));
    let body = legend(&root, &names, &[("resident memory at the peak event", RED)])?;
    // One bar per rank, runs in groups with a gap between them.
    let mut points = Vec::new();
    let mut labels: Vec<(f64, String)> = Vec::new();
    let mut x = 0.0;
    for (label, reports) in runs {
        for r in reports {
            if let Some((categories, rss)) = at_peak(r) {
                points.push(Point { x, categories: segments(categories, r.floor_rss_bytes, rss), rss });
                labels.push((x, format!("{label} r{}", r.rank)));
            }
            x += 1.0;
        }
        x += 1.0;
    }
    let label_of =
        |x: &f64| labels.iter().find(|(at, _)| (at - x).abs() < 0.5).map_or(String::new(), |(_, l)| l.clone());
    let ranks = runs.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
    let caption = format!("resident memory at each rank's peak, explained ({} runs of {ranks} ranks)", runs.len());
    let x = XAxis { desc: "run and rank", label: &label_of, connect_rss: false };
    stacked(&body, &caption, &x, &names, &points, None)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Several runs side by side: for every run (a label and its ranks' reports) and rank, the engine's bytes by
/// category at the rank's peak, stacked, and the peak resident memory as a red line. Writes `{stem}.svg` and
/// `{stem}.png`.
pub fn draw_comparison(
    stem: &Path,
    runs: &[(String, Vec<MemoryReport>)],
) -> Result<(std::path::PathBuf, std::path::PathBuf)> {
    register_font()?;
    let (svg, png) = (stem.with_extension("svg"), stem.with_extension("png"));
    let bars: usize = runs.iter().map(|(_, r)| r.len() + 1).sum();
    let size = ((200 + 90 * bars as u32).max(720), 560);
    draw_runs(SVGBackend::new(&svg, size).into_drawing_area(), runs)
        .map_err(|e| ReportError::Io { path: svg.clone(), what: e })?;
    draw_runs(BitMapBackend::new(&png, size).into_drawing_area(), runs)
        .map_err(|e| ReportError::Io { path: png.clone(), what: e })?;
    Ok((svg, png))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bar is the resident memory: floor, the resident categories, and what they leave unexplained on top;
    /// bytes on NVMe are not part of it.
    #[test]
    fn a_bar_stacks_to_the_resident_memory() {
        let categories: BTreeMap<String, u64> =
            [("parameters", 30), ("optimizer_states_nvme", 500), ("activations", 20)]
                .map(|(n, b)| (n.to_string(), b))
                .into();
        let bar = segments(&categories, 40, 100);
        assert_eq!(bar.values().sum::<u64>(), 100);
        assert_eq!((bar[FLOOR], bar[UNEXPLAINED], bar.get("optimizer_states_nvme")), (40, 10, None));
        // Categories over the resident memory leave nothing unexplained (the bar then stands above the line).
        assert_eq!(segments(&categories, 90, 100)[UNEXPLAINED], 0);
        assert!(stack_order("parameters") < stack_order("parameters_gathered"));
        assert!(stack_order("parameters_gathered") < stack_order("activations"));
        assert!(stack_order("temporaries") < stack_order("allocator_retained"));
    }
}
