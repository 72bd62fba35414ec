//! `zerorun report DIR --html OUT`: the run's memory report as one self-contained page (styles, script and
//! pictures inline: it opens with no network). Per rank: the events of the step that held its peak, stacked by
//! category on one axis of resident memory with the peak's window marked; every step at its highest event; the
//! categories named in a legend with their peaks; what would help (the advice lines); the table of every rank.
//! The pictures are inline SVG (hover shows each segment's bytes); the script only fills the readout beside them.
use std::collections::BTreeMap;
use std::fmt::Write;

use plotters::style::Color;

use crate::memory::{EventSample, MemoryReport};
use crate::plot::{categories, colour, segments};

const MIB: f64 = 1024.0 * 1024.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn css_colour(name: &str, i: usize) -> String {
    let c = colour(name, i);
    let (r, g, b) = c.rgb();
    format!("rgb({r},{g},{b})")
}

/// One bar of a chart: its label, its segments by category, the resident memory.
struct Bar {
    label: String,
    segments: BTreeMap<String, u64>,
    rss: u64,
    marked: bool,
}

/// Stacked bars on one axis (MiB), the resident memory as a red tick over each bar.
fn chart(title: &str, names: &[String], bars: &[Bar]) -> String {
    let (w, h, left, bottom, top) = (900.0, 320.0, 70.0, 90.0, 28.0);
    let plot_h = h - bottom - top;
    let ymax = bars
        .iter()
        .map(|b| names.iter().filter_map(|n| b.segments.get(n)).sum::<u64>().max(b.rss))
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.1;
    let y = |bytes: f64| top + plot_h - bytes / ymax * plot_h;
    let slot = (w - left - 10.0) / bars.len().max(1) as f64;
    let bar_w = (slot * 0.8).max(1.0);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" aria-label="{t}"><text x="{left}" y="18" class="title">{t}</text>"#,
        t = esc(title)
    );
    for i in 0..=4 {
        let v = ymax / 1.1 * i as f64 / 4.0;
        let _ = write!(
            s,
            r#"<line x1="{left}" x2="{x2}" y1="{y0:.1}" y2="{y0:.1}" class="grid"/><text x="{tx}" y="{ty:.1}" class="axis" text-anchor="end">{mib:.0} MiB</text>"#,
            x2 = w - 10.0,
            y0 = y(v),
            tx = left - 6.0,
            ty = y(v) + 4.0,
            mib = v / MIB
        );
    }
    for (i, b) in bars.iter().enumerate() {
        let x = left + i as f64 * slot + (slot - bar_w) / 2.0;
        if b.marked {
            let _ = write!(
                s,
                r#"<rect x="{:.1}" y="{top}" width="{:.1}" height="{plot_h}" class="peak"><title>the peak's window closes here</title></rect>"#,
                x - (slot - bar_w) / 2.0,
                slot
            );
        }
        let mut below = 0u64;
        for (k, name) in names.iter().enumerate() {
            let Some(&bytes) = b.segments.get(name) else { continue };
            if bytes == 0 {
                continue;
            }
            let (y1, y0) = (y((below + bytes) as f64), y(below as f64));
            let _ = write!(
                s,
                r#"<rect x="{x:.1}" y="{y1:.1}" width="{bar_w:.1}" height="{:.1}" fill="{}" data-category="{}" data-bytes="{bytes}" data-label="{}"><title>{}: {} — {:.2} MiB</title></rect>"#,
                (y0 - y1).max(0.0),
                css_colour(name, k),
                esc(name),
                esc(&b.label),
                esc(&b.label),
                esc(name),
                bytes as f64 / MIB
            );
            below += bytes;
        }
        let ry = y(b.rss as f64);
        let _ = write!(
            s,
            r#"<line x1="{x:.1}" x2="{:.1}" y1="{ry:.1}" y2="{ry:.1}" class="rss"><title>resident {:.2} MiB</title></line>"#,
            x + bar_w,
            b.rss as f64 / MIB
        );
        // At most about 30 labels: every k-th bar's when there are more (hover names every bar).
        let every = bars.len().div_ceil(30).max(1);
        if i % every == 0 {
            let (lx, ly) = (x + bar_w / 2.0, h - bottom + 12.0);
            let _ = write!(
                s,
                r#"<text x="{lx:.1}" y="{ly:.1}" class="axis" transform="rotate(40 {lx:.1} {ly:.1})">{}</text>"#,
                esc(&shorten(&b.label, 26))
            );
        }
    }
    s.push_str("</svg>");
    s
}

fn shorten(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n - 1).collect::<String>())
    }
}

fn event_bar(e: &EventSample, floor: u64, marked: bool) -> Bar {
    Bar { label: e.event.clone(), segments: segments(&e.categories, floor, e.rss_bytes), rss: e.rss_bytes, marked }
}

/// The page for every rank's report (rank 0 first).
pub fn html(reports: &[MemoryReport]) -> String {
    let names = categories(reports);
    let mut body = String::new();
    let first = &reports[0];
    let _ = write!(
        body,
        "<h1>zerorun memory report</h1><p class=\"meta\">{} ranks · ZeRO stage {} · {}{}</p>",
        first.world_size,
        first.stage,
        esc(&first.precision),
        first.device.as_ref().map_or(String::new(), |d| format!(" · {}", esc(d)))
    );
    body.push_str("<h2>Categories</h2><ul class=\"legend\">");
    for (i, n) in names.iter().enumerate() {
        let peak = reports.iter().filter_map(|r| r.categories.get(n)).map(|c| c.peak_bytes).max();
        let _ = write!(
            body,
            "<li data-category=\"{n}\"><span class=\"swatch\" style=\"background:{}\"></span>{n}{}</li>",
            css_colour(n, i),
            peak.map_or(String::new(), |p| format!(" <small>(peak {:.2} MiB)</small>", p as f64 / MIB)),
            n = esc(n)
        );
    }
    // What lives on NVMe is named too, beside the resident memory (never stacked in it).
    let mut on_nvme: Vec<&String> =
        reports.iter().flat_map(|r| r.categories.keys()).filter(|n| crate::memory::is_on_nvme(n)).collect();
    on_nvme.sort();
    on_nvme.dedup();
    for n in on_nvme {
        let peak = reports.iter().filter_map(|r| r.categories.get(n)).map(|c| c.peak_bytes).max().unwrap_or(0);
        let _ = write!(
            body,
            "<li data-category=\"{n}\"><span class=\"swatch nvme\"></span>{n} <small>(on NVMe, not resident: peak {:.2} MiB)</small></li>",
            peak as f64 / MIB,
            n = esc(n)
        );
    }
    body.push_str("<li><span class=\"swatch rss\"></span>resident memory (RSS)</li></ul>");
    for r in reports {
        let _ = write!(
            body,
            "<section class=\"rank\" id=\"rank{0}\"><h2>Rank {0}</h2><p>peak resident {1:.2} MiB; floor {2:.2} MiB; model states {3:.2} MiB measured, {4:.2} MiB estimated</p>",
            r.rank,
            r.peak_rss_bytes as f64 / MIB,
            r.floor_rss_bytes as f64 / MIB,
            r.model_states.measured_bytes as f64 / MIB,
            r.model_states.estimated_bytes as f64 / MIB
        );
        if let Some(w) = &r.peak_window {
            let _ = write!(
                body,
                "<p class=\"window\">The peak ({:.2} MiB) fell in step {} between <b>{}</b> and <b>{}</b>.</p>",
                w.rss_bytes as f64 / MIB,
                w.step,
                esc(w.after.as_deref().unwrap_or("the start")),
                esc(&w.before)
            );
        }
        if !r.events.is_empty() {
            let step = r.events[0].step;
            let closing = r.peak_window.as_ref().map(|w| w.before.clone());
            let bars: Vec<Bar> = r
                .events
                .iter()
                .map(|e| event_bar(e, r.floor_rss_bytes, closing.as_deref() == Some(e.event.as_str())))
                .collect();
            body.push_str(&chart(
                &format!("rank {}: the events of step {step} (its peak step)", r.rank),
                &names,
                &bars,
            ));
        }
        if !r.steps.is_empty() {
            let bars: Vec<Bar> = r
                .steps
                .iter()
                .map(|s| Bar {
                    label: format!("step {}", s.step),
                    segments: segments(&s.categories, r.floor_rss_bytes, s.rss_bytes),
                    rss: s.rss_bytes,
                    marked: false,
                })
                .collect();
            body.push_str(&chart(&format!("rank {}: every step at its highest event", r.rank), &names, &bars));
        }
        let advice = crate::advice::advice(r);
        if !advice.is_empty() {
            body.push_str("<h3>What would help</h3><ul class=\"advice\">");
            for a in advice {
                let _ = write!(body, "<li>{}</li>", esc(&a));
            }
            body.push_str("</ul>");
        }
        body.push_str("</section>");
    }
    let _ = write!(body, "<h2>Table</h2><pre>{}</pre>", esc(&crate::table::table(reports)));
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>zerorun memory report</title>
<style>
body {{ font: 14px/1.4 sans-serif; margin: 24px; color: #222; max-width: 960px; }}
.meta {{ color: #555; }}
.legend {{ list-style: none; padding: 0; display: flex; flex-wrap: wrap; gap: 6px 18px; }}
.swatch {{ display: inline-block; width: 12px; height: 12px; margin-right: 6px; vertical-align: -1px; border: 1px solid #888; }}
.swatch.nvme {{ background: repeating-linear-gradient(45deg, #fff, #fff 2px, #888 2px, #888 4px); }}
.swatch.rss {{ background: #d00; height: 3px; vertical-align: 3px; }}
svg.chart {{ display: block; margin: 8px 0 16px; }}
svg .title {{ font-weight: bold; font-size: 13px; }}
svg .axis {{ font-size: 10px; fill: #444; }}
svg .grid {{ stroke: #e5e5e5; }}
svg .rss {{ stroke: #d00; stroke-width: 2; }}
svg .peak {{ fill: #ffd54f; opacity: 0.35; }}
#readout {{ position: sticky; top: 0; background: #fff; border-bottom: 1px solid #ddd; padding: 4px 0; min-height: 1.4em; }}
pre {{ font-size: 11px; overflow-x: auto; }}
</style></head>
<body>
<div id="readout">Hover a segment for its bytes.</div>
{body}
<script>
// Fills the readout from the segment under the pointer; marks the page rendered (the tests read it).
document.querySelectorAll("rect[data-category]").forEach(function (r) {{
  r.addEventListener("mouseover", function () {{
    document.getElementById("readout").textContent = r.dataset.label + ": " + r.dataset.category + " " +
      (Number(r.dataset.bytes) / 1048576).toFixed(2) + " MiB";
  }});
}});
document.body.dataset.rendered = document.querySelectorAll("svg.chart").length;
</script>
</body></html>
"#
    )
}
