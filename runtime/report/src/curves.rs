//! Line charts of several runs' curves on shared axes (`zerorun bench async`: training loss against samples seen,
//! one curve per mode), written as SVG and PNG like the memory plots.
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::{ReportError, Result};

/// One curve: its label and its (x, y) points in x order.
pub struct Curve {
    /// The legend's text.
    pub label: String,
    /// (x, y) in x order.
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    (x_desc, y_desc): (&str, &str),
    curves: &[Curve],
) -> std::result::Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let points = || curves.iter().flat_map(|c| c.points.iter());
    let drawable = |p: &&(f64, f64)| p.1.is_finite() && p.1 > 0.0;
    let x_max = points().fold(0f64, |x, p| x.max(p.0));
    let (y_min, y_max) = points().filter(drawable).fold((f64::MAX, 0f64), |(lo, hi), p| (lo.min(p.1), hi.max(p.1)));
    let (y_min, y_max) = if y_max > 0.0 { (y_min / 1.2, y_max * 1.2) } else { (0.1, 1.0) };
    // Losses span decades: a log axis shows the start and the end alike.
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max.max(1.0), (y_min..y_max).log_scale())
        .map_err(err)?;
    chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).draw().map_err(err)?;
    for (i, c) in curves.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(c.points.iter().filter(drawable).copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(c.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Draws `curves` into `{stem}.svg` and `{stem}.png`.
pub fn draw_curves(stem: &Path, title: &str, axes: (&str, &str), curves: &[Curve]) -> Result<(PathBuf, PathBuf)> {
    crate::plot::register_font()?;
    let (svg, png) = (stem.with_extension("svg"), stem.with_extension("png"));
    let size = (960, 540);
    draw(SVGBackend::new(&svg, size).into_drawing_area(), title, axes, curves)
        .map_err(|e| ReportError::Io { path: svg.clone(), what: e })?;
    draw(BitMapBackend::new(&png, size).into_drawing_area(), title, axes, curves)
        .map_err(|e| ReportError::Io { path: png.clone(), what: e })?;
    Ok((svg, png))
}
