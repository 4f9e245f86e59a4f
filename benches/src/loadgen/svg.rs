//! The run's picture (issue 5 item 3, issue 24 item 4): one SVG with (a) latency by
//! percentile per response state — x on a "nines" scale (0, 90, 99, 99.9, 99.99 %), y in ms
//! on a log scale — with the buyers' time to a final answer (retry waits included) dashed
//! beside them, (b) throughput over time, requests scheduled, sent and answered per second,
//! (c) what the answers were each second: accepted (QUEUED / QUEUED_PENDING), sold out,
//! shed (OVERLOADED) and the rest, and (d) when the report has samples of it, the engine's
//! adaptive admission limit over time with the stretches it kept the instance unready.
//!
//! Drawn with plotters' SVG backend only (no bitmap, no `ttf`): text goes into the SVG as
//! `<text>` elements for the viewer to render, so nothing here reads system fonts and the
//! build works on a bare Debian.
//!
//! Read next: `report.rs` (the curves come from there).

use std::path::Path;

use plotters::coord::cartesian::Cartesian2d;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::report::Report;
use super::stats::SecondCounts;

const WIDTH_PX: u32 = 1_000;
const HEIGHT_PX: u32 = 1_250;
/// The admission panel's height, added below the others when the report has samples.
const ADMISSION_PANEL_PX: u32 = 280;
const LATENCY_PANEL_PX: u32 = 520;
const THROUGHPUT_PANEL_PX: u32 = 365;
/// The buyers' time-to-final curve's colour (dashed).
const FINAL_COLOR: RGBColor = RGBColor(90, 90, 90);

/// A fixed colour per state, so pictures of different runs compare at a glance.
fn color(state: &str) -> RGBColor {
    match state {
        "ALL" => RGBColor(0, 0, 0),
        "QUEUED" => RGBColor(0, 150, 60),
        "QUEUED_PENDING" => RGBColor(120, 190, 40),
        "SOLD_OUT" => RGBColor(30, 90, 200),
        "DUPLICATE_USER" => RGBColor(230, 130, 0),
        "OVERLOADED" => RGBColor(210, 30, 30),
        "SYSTEM_BUSY" => RGBColor(150, 0, 90),
        "UNKNOWN" => RGBColor(130, 60, 200),
        "RATE_LIMITED" => RGBColor(200, 170, 0),
        _ => RGBColor(120, 120, 120),
    }
}

fn nines_label(x: f64) -> String {
    // x = -log10(1 - p): 0 → 0%, 1 → 90%, 2 → 99%, 3 → 99.9%, 4 → 99.99%.
    let p = (1.0 - 10f64.powf(-x)) * 100.0;
    // One more decimal per nine past the second: 99%, 99.9%, 99.99%.
    let digits = (x.ceil() as usize).saturating_sub(2);
    format!("{p:.digits$}%")
}

/// Writes the picture of `report` to `path`.
pub fn write_svg(report: &Report, path: &Path) -> Result<(), String> {
    let extra = if report.admission.is_empty() { 0 } else { ADMISSION_PANEL_PX };
    let root = SVGBackend::new(path, (WIDTH_PX, HEIGHT_PX + extra)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (top, rest) = root.split_vertically(LATENCY_PANEL_PX);
    let (middle, rest) = rest.split_vertically(THROUGHPUT_PANEL_PX);
    let (bottom, last) = rest.split_vertically(HEIGHT_PX - LATENCY_PANEL_PX - THROUGHPUT_PANEL_PX);
    draw_latency(report, &top)?;
    draw_throughput(report, &middle)?;
    draw_answers(report, &bottom)?;
    if extra > 0 {
        draw_admission(report, &last)?;
    }
    root.present().map_err(|e| format!("write {}: {e}", path.display()))
}

fn draw_latency<DB: DrawingBackend>(
    report: &Report,
    area: &DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), String> {
    let points = report.percentile_curves.values().flatten().chain(&report.time_to_final_curve);
    let y_max = points.clone().map(|p| p.ms).fold(1.0f64, f64::max) * 1.5;
    let y_min = points.map(|p| p.ms).filter(|ms| *ms > 0.0).fold(y_max, f64::min).max(0.001) / 1.5;
    let caption = format!(
        "Latency by percentile, from the intended send time — {}, achieved {:.0} req/s",
        report.run.profile, report.achieved_rps
    );
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(15)
        // Room for the last x label ("99.99%"), centred on the right edge.
        .margin_right(40)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..4f64, (y_min..y_max).log_scale())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        // One label per nine: 0%, 90%, 99%, 99.9%, 99.99%.
        .x_labels(5)
        .x_label_formatter(&|x| nines_label(*x))
        .y_label_formatter(&|y| format!("{y}"))
        .x_desc("percentile")
        .y_desc("latency (ms, log scale)")
        .draw()
        .map_err(|e| e.to_string())?;
    for (state, curve) in &report.percentile_curves {
        if curve.is_empty() {
            continue;
        }
        let c = color(state);
        let width = if state == "ALL" { 3 } else { 2 };
        let n = if state == "ALL" {
            report.answered
        } else {
            report.counts.get(state).copied().unwrap_or(0)
        };
        chart
            .draw_series(LineSeries::new(
                curve.iter().map(|p| (p.nines, p.ms.max(y_min))),
                c.stroke_width(width),
            ))
            .map_err(|e| e.to_string())?
            .label(format!("{state} ({n})"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
    }
    if !report.time_to_final_curve.is_empty() {
        let points: Vec<(f64, f64)> =
            report.time_to_final_curve.iter().map(|p| (p.nines, p.ms.max(y_min))).collect();
        chart
            .draw_series(DashedLineSeries::new(points, 8, 5, FINAL_COLOR.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(format!(
                "buyer's time to final answer ({})",
                report.intents.counts.final_answered
            ))
            .legend(|(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], FINAL_COLOR.stroke_width(2))
            });
    }
    // Curves rise to the right and sit above the fastest answers: the lower right is free.
    legend(&mut chart, SeriesLabelPosition::LowerRight)
}

/// The series' legend, framed, at `position`.
fn legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(position)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()
        .map_err(|e| e.to_string())
}

/// A panel over the run's seconds, from 0 to `y_max`, with its mesh drawn.
fn over_time<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, plotters::coord::Shift>,
    caption: impl AsRef<str>,
    seconds: f64,
    y_max: f64,
    y_desc: &str,
) -> Result<ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>, String> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption.as_ref(), ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..seconds, 0f64..y_max)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("seconds since start")
        .y_desc(y_desc)
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(chart)
}

/// One line of the throughput panel: name, colour, width in px, and the count it draws.
type ThroughputSeries = (&'static str, RGBColor, u32, fn(&SecondCounts) -> u64);

fn draw_throughput<DB: DrawingBackend>(
    report: &Report,
    area: &DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), String> {
    // Scheduled (the open-loop plan) grey and widest, sent light, answered narrow on top: all
    // three stay visible when they are equal, and a target that falls behind shows as a gap.
    let series: [ThroughputSeries; 3] = [
        ("scheduled", RGBColor(190, 190, 190), 8, |s| s.scheduled),
        ("sent", RGBColor(120, 160, 230), 5, |s| s.sent),
        ("answered", RGBColor(0, 130, 50), 2, |s| s.answered),
    ];
    let caption = "Throughput per second";
    draw_steps(report, area, caption, "requests / s", &series, SeriesLabelPosition::LowerRight)
}

/// What the answers of each second were: accepted, sold out, shed beside each other.
fn draw_answers<DB: DrawingBackend>(
    report: &Report,
    area: &DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), String> {
    let shed_total: u64 = report.throughput.iter().map(|s| s.shed).sum();
    let caption = format!(
        "Answers per second: accepted, sold out, shed (OVERLOADED: {shed_total} in all), other"
    );
    let series: [ThroughputSeries; 4] = [
        ("accepted (QUEUED, QUEUED_PENDING)", color("QUEUED"), 3, |s| s.accepted),
        ("sold out", color("SOLD_OUT"), 3, |s| s.sold_out),
        ("shed (OVERLOADED)", color("OVERLOADED"), 3, |s| s.shed),
        ("other", color("OTHER"), 2, |s| s.other),
    ];
    draw_steps(report, area, caption, "answers / s", &series, SeriesLabelPosition::UpperRight)
}

/// A panel of per-second counts, a step per second (each count covers its whole second),
/// scaled to the largest of them.
fn draw_steps<DB: DrawingBackend>(
    report: &Report,
    area: &DrawingArea<DB, plotters::coord::Shift>,
    caption: impl AsRef<str>,
    y_desc: &str,
    series: &[ThroughputSeries],
    position: SeriesLabelPosition,
) -> Result<(), String> {
    let seconds = report.throughput.len().max(1) as f64;
    let values = report.throughput.iter().flat_map(|s| series.iter().map(move |l| (l.3)(s)));
    let y_max = values.max().unwrap_or(1).max(1) as f64 * 1.15;
    let mut chart = over_time(area, caption, seconds, y_max, y_desc)?;
    for &(name, c, width, value) in series {
        let steps = report.throughput.iter().flat_map(|s| {
            let v = value(s) as f64;
            let x = f64::from(s.second);
            [(x, v), (x + 1.0, v)]
        });
        chart
            .draw_series(LineSeries::new(steps, c.stroke_width(width)))
            .map_err(|e| e.to_string())?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
    }
    legend(&mut chart, position)
}

/// The adaptive limit (places on the expensive path) over the run; red bands where it kept
/// the instance unready.
fn draw_admission<DB: DrawingBackend>(
    report: &Report,
    area: &DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), String> {
    let seconds = report.throughput.len().max(1) as f64;
    let points = &report.admission;
    let (min, max) = report.admission_limit_range().unwrap_or((0, 0));
    let y_max = max.max(1) as f64 * 1.15;
    let caption = format!("Adaptive admission limit (places on the expensive path): {min}..{max}");
    let mut chart = over_time(area, caption, seconds, y_max, "limit")?;
    let unready = points.iter().filter(|p| !p.ready).map(|p| {
        let x = p.t_ms as f64 / 1e3;
        Rectangle::new([(x, 0.0), (x + 0.1, y_max)], color("OVERLOADED").mix(0.2).filled())
    });
    chart.draw_series(unready).map_err(|e| e.to_string())?;
    let line = points.iter().map(|p| (p.t_ms as f64 / 1e3, p.limit as f64));
    chart
        .draw_series(LineSeries::new(line, BLACK.stroke_width(2)))
        .map_err(|e| e.to_string())?
        .label("limit (red bands: not ready)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(3)));
    legend(&mut chart, SeriesLabelPosition::UpperRight)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nines_axis_labels() {
        assert_eq!(nines_label(0.0), "0%");
        assert_eq!(nines_label(1.0), "90%");
        assert_eq!(nines_label(2.0), "99%");
        assert_eq!(nines_label(2.5), "99.7%");
        assert_eq!(nines_label(3.0), "99.9%");
        assert_eq!(nines_label(4.0), "99.99%");
    }
}
