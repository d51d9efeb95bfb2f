//! SVG plots of a run, drawn from its period reports with plotters' SVG backend.
//!
//! Text is written as SVG `<text>` elements and laid out with plotters' built-in size
//! estimate, so no system font is needed to draw and any browser renders them. Each
//! function returns the whole document; [`crate::RunDir::write_plots`] names the files.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::{PeriodReport, StageKind};

const SIZE: (u32, u32) = (960, 540);
const GENERATION: RGBColor = RGBColor(31, 119, 180);
const SCORING: RGBColor = RGBColor(255, 127, 14);
const TRAINING: RGBColor = RGBColor(44, 160, 44);
const PUBLICATION: RGBColor = RGBColor(148, 103, 189);
const BOUNDARY: RGBColor = RGBColor(90, 90, 90);

/// Drawing errors carry the backend's error type; the caller only needs the words.
pub(crate) type Drawn = Result<String, String>;
/// A function drawing one plot.
pub(crate) type Draw = fn(&[PeriodReport]) -> Drawn;

fn text(e: impl std::fmt::Display) -> String {
    format!("drawing failed: {e}")
}

/// Reward mean and accuracy per period.
pub(crate) fn reward_svg(reports: &[PeriodReport]) -> Drawn {
    let reward: Vec<(f64, f64)> = points(reports, |r| Some(r.reward_mean));
    let accuracy: Vec<(f64, f64)> = points(reports, |r| r.accuracy);
    // Accuracy lives in [0, 1]; rewards usually do too, but a shaped reward may not.
    let (lo, hi) = bounds(reward.iter().chain(&accuracy).map(|p| p.1), 0.0, 1.0);
    let series = [("reward mean", GENERATION, reward), ("accuracy", TRAINING, accuracy)];
    lines_svg("Reward and accuracy per period", "reward / accuracy", period_range(reports), (lo, hi), &series)
}

/// Generation and training tokens per busy second, per period.
pub(crate) fn throughput_svg(reports: &[PeriodReport]) -> Drawn {
    let per_second = |tokens: u64, seconds: f64| (seconds > 0.0).then(|| tokens as f64 / seconds);
    let generation = points(reports, |r| per_second(r.generated_tokens, r.generation_s));
    let training = points(reports, |r| per_second(r.step.tokens, r.training_s));
    let (_, hi) = bounds(generation.iter().chain(&training).map(|p| p.1), 0.0, 1.0);
    let series = [("generation tokens/s", GENERATION, generation), ("training tokens/s", TRAINING, training)];
    lines_svg("Throughput per period", "tokens per busy second", period_range(reports), (0.0, hi), &series)
}

/// Held-out accuracy against the periods trained before it (0: after the warm start).
pub(crate) fn heldout_svg(evals: &[(u64, f64)]) -> Drawn {
    let points: Vec<(f64, f64)> =
        evals.iter().filter(|e| e.1.is_finite()).map(|&(after, a)| (after as f64, a)).collect();
    let last = evals.iter().map(|e| e.0).max().unwrap_or(0) as f64;
    let series = [("held-out accuracy", TRAINING, points)];
    lines_svg("Held-out accuracy", "accuracy after the period", (-0.5, last + 0.5), (0.0, 1.0), &series)
}

/// Periods as x and a finite y where `y` has one.
fn points(reports: &[PeriodReport], y: impl Fn(&PeriodReport) -> Option<f64>) -> Vec<(f64, f64)> {
    reports.iter().filter_map(|r| y(r).filter(|v| v.is_finite()).map(|v| (r.period.0 as f64, v))).collect()
}

/// A y range holding every finite value and at least `[lo, hi]`, with 5% head room.
fn bounds(values: impl Iterator<Item = f64>, lo: f64, hi: f64) -> (f64, f64) {
    let (lo, hi) = values.fold((lo, hi), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let pad = (hi - lo) * 0.05;
    (if lo < 0.0 { lo - pad } else { lo }, hi + pad)
}

/// The x range of the periods, half a period of margin on each side.
fn period_range(reports: &[PeriodReport]) -> (f64, f64) {
    let first = reports.iter().map(|r| r.period.0).min().unwrap_or(0) as f64;
    let last = reports.iter().map(|r| r.period.0).max().unwrap_or(0) as f64;
    (first - 0.5, last + 0.5)
}

/// Periods are whole numbers: ticks between them stay unlabelled.
fn period_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-9 && *x >= 0.0 { format!("{}", x.round()) } else { String::new() }
}

type Series = (&'static str, RGBColor, Vec<(f64, f64)>);

fn lines_svg(caption: &str, y_desc: &str, x: (f64, f64), y: (f64, f64), series: &[Series]) -> Drawn {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(text)?;
        let (x0, x1) = x;
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, y.0..y.1)
            .map_err(text)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("period")
            .y_desc(y_desc)
            .x_label_formatter(&period_label)
            .y_label_formatter(&|v| if y.1 - y.0 >= 10.0 { format!("{v:.0}") } else { format!("{v:.2}") })
            .draw()
            .map_err(text)?;
        for (name, colour, data) in series {
            let colour = *colour;
            chart
                .draw_series(LineSeries::new(data.iter().copied(), colour.stroke_width(2)))
                .map_err(text)?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
            chart.draw_series(data.iter().map(|&p| Circle::new(p, 3, colour.filled()))).map_err(text)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(text)?;
        root.present().map_err(text)?;
    }
    Ok(svg)
}

const LANES: [(StageKind, &str, RGBColor); 4] = [
    (StageKind::Generation, "generation", GENERATION),
    (StageKind::Scoring, "scoring", SCORING),
    (StageKind::Training, "training", TRAINING),
    (StageKind::Publication, "publication", PUBLICATION),
];

/// The periods the timeline draws, the last ones of the run. Its point is how the
/// stages overlap within a period and across its neighbours, which a few dozen show;
/// with every period it held a bar per busy interval of the whole run, 10 MB at 2,000
/// periods, and bars no wider than a pixel. `metrics.jsonl` keeps every interval.
pub(crate) const TIMELINE_PERIODS: usize = 40;

/// The stage timeline, like Figure 1 of the periodic-asynchrony paper: one lane per
/// stage, a bar per busy interval (alternate periods in alternate shades, so a bar's
/// period is visible where periods overlap), and a dashed line where each period
/// ended with its optimiser step. Of a longer run, the last [`TIMELINE_PERIODS`].
pub(crate) fn timeline_svg(reports: &[PeriodReport]) -> Drawn {
    let all = reports.len();
    let reports = &reports[all.saturating_sub(TIMELINE_PERIODS)..];
    let caption = if reports.len() < all {
        format!("Stage timeline: the last {} of {all} periods", reports.len())
    } else {
        "Stage timeline".to_owned()
    };
    let intervals: Vec<_> = reports
        .iter()
        .flat_map(|r| &r.intervals)
        .filter(|i| i.start_s.is_finite() && i.end_s.is_finite())
        .collect();
    // Lanes for the stages that worked; generation and training always, they are the point.
    let lanes: Vec<_> = LANES
        .iter()
        .filter(|(kind, ..)| {
            matches!(kind, StageKind::Generation | StageKind::Training)
                || intervals.iter().any(|i| i.stage == *kind)
        })
        .collect();
    let lane_of = |kind: StageKind| lanes.iter().position(|(k, ..)| *k == kind);
    let boundaries: Vec<(u64, f64, f64)> = reports.iter().filter_map(period_span).collect();
    // From the run's start, or from the first period drawn when earlier ones are not.
    let first = intervals.iter().map(|i| i.start_s).fold(f64::INFINITY, f64::min);
    let t0 = if reports.len() < all && first.is_finite() { first } else { first.min(0.0) };
    let t1 = intervals.iter().map(|i| i.end_s).chain(boundaries.iter().map(|b| b.2)).fold(0.0, f64::max);
    let t1 = if t1 > t0 { t1 + (t1 - t0) * 0.02 } else { t0 + 1.0 };
    let n = lanes.len() as f64;
    // A strip above the lanes for the period names.
    let top = n + 0.3;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(text)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(100)
            .build_cartesian_2d(t0..t1, 0.0..top)
            .map_err(text)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .y_label_formatter(&|_| String::new())
            .light_line_style(WHITE)
            .x_desc("seconds since the run started (shades alternate by period; dashed: the period's optimiser step)")
            .draw()
            .map_err(text)?;

        // Generation on top: lane i is drawn from the top down.
        let band = |lane: usize| (n - lane as f64 - 0.85, n - lane as f64 - 0.15);
        chart
            .draw_series(intervals.iter().filter_map(|i| {
                let lane = lane_of(i.stage)?;
                let (_, _, colour) = lanes[lane];
                let shade = if i.period.0 % 2 == 0 { 0.9 } else { 0.5 };
                let (lo, hi) = band(lane);
                Some(Rectangle::new(
                    [(i.start_s, lo), (i.end_s.max(i.start_s), hi)],
                    colour.mix(shade).filled(),
                ))
            }))
            .map_err(text)?;
        for &(period, start, end) in &boundaries {
            chart
                .draw_series(DashedLineSeries::new([(end, 0.0), (end, top)], 6, 4, BOUNDARY.stroke_width(1)))
                .map_err(text)?;
            let style =
                TextStyle::from(("sans-serif", 12).into_font()).pos(Pos::new(HPos::Center, VPos::Center));
            let label = Text::new(format!("p{period}"), ((start + end) / 2.0, (n + top) / 2.0), style);
            chart.draw_series(std::iter::once(label)).map_err(text)?;
        }
        for (lane, (_, name, colour)) in lanes.iter().enumerate() {
            let (lo, hi) = band(lane);
            let at = chart.backend_coord(&(t0, (lo + hi) / 2.0));
            let style = ("sans-serif", 14).into_font().color(colour).pos(Pos::new(HPos::Right, VPos::Center));
            root.draw(&Text::new(name.to_string(), (at.0 - 8, at.1), style)).map_err(text)?;
        }
        root.present().map_err(text)?;
    }
    Ok(svg)
}

/// A period's first instant and where it ended: its last training interval (the
/// optimiser step), else its last interval of any kind.
fn period_span(report: &PeriodReport) -> Option<(u64, f64, f64)> {
    let start = report.intervals.iter().map(|i| i.start_s).filter(|t| t.is_finite()).reduce(f64::min)?;
    let last = |training_only: bool| {
        report
            .intervals
            .iter()
            .filter(|i| !training_only || i.stage == StageKind::Training)
            .map(|i| i.end_s)
            .filter(|t| t.is_finite())
            .reduce(f64::max)
    };
    last(true).or_else(|| last(false)).map(|end| (report.period.0, start, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Interval;
    use metronome_core::PeriodId;

    fn report(period: u64, start: f64) -> PeriodReport {
        let interval = |stage, a: f64, b: f64| Interval {
            stage,
            period: PeriodId(period),
            start_s: start + a,
            end_s: start + b,
        };
        PeriodReport {
            period: PeriodId(period),
            period_s: 2.0,
            generation_s: 1.5,
            training_s: 1.2,
            generated_tokens: 300,
            reward_mean: 0.25 * period as f64,
            accuracy: Some(0.1 * period as f64),
            intervals: vec![
                interval(StageKind::Publication, 0.0, 0.1),
                interval(StageKind::Generation, 0.1, 1.6),
                interval(StageKind::Training, 0.5, 1.7),
                interval(StageKind::Training, 1.8, 2.0),
            ],
            ..PeriodReport::default()
        }
    }

    /// The contents of the `<text>` elements.
    fn texts(svg: &str) -> Vec<&str> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| Some(t[t.find('>')? + 1..t.find("</text>")?].trim()))
            .collect()
    }

    #[test]
    fn the_period_ends_with_its_last_training_interval() {
        assert_eq!(period_span(&report(3, 10.0)), Some((3, 10.0, 12.0)));
        assert_eq!(period_span(&PeriodReport::default()), None);
    }

    #[test]
    fn the_timeline_has_a_bar_per_interval_and_a_boundary_per_period() {
        let reports = [report(0, 0.0), report(1, 2.0)];
        let svg = timeline_svg(&reports).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
        // One background rectangle, the plotting area's, then a bar per interval.
        let bars = svg.matches("<rect").count();
        assert!(bars >= 8, "{bars} rectangles");
        let texts = texts(&svg);
        for label in ["p0", "p1", "generation", "training", "publication"] {
            assert!(texts.contains(&label), "no {label} in {texts:?}");
        }
        assert!(!texts.contains(&"scoring"), "no scoring interval, so no scoring lane");
    }

    #[test]
    fn the_timeline_of_a_long_run_draws_its_last_periods_in_a_file_that_stays_small() {
        let reports: Vec<_> = (0..400).map(|p| report(p, 2.0 * p as f64)).collect();
        let whole = timeline_svg(&reports[..TIMELINE_PERIODS]).unwrap();
        let svg = timeline_svg(&reports).unwrap();
        let texts = texts(&svg);
        assert!(texts.contains(&"Stage timeline: the last 40 of 400 periods"), "{texts:?}");
        assert!(texts.contains(&"p399") && texts.contains(&"p360"), "{texts:?}");
        assert!(!texts.contains(&"p359") && !texts.contains(&"p0"), "{texts:?}");
        // The axis starts at the first period drawn, not at the run's start.
        let labels: Vec<f64> = texts.iter().filter_map(|t| t.parse().ok()).collect();
        assert!(labels.iter().all(|&x| x >= 700.0), "axis labels {labels:?}");
        assert!(svg.len() < whole.len() * 11 / 10, "{} bytes against {}", svg.len(), whole.len());
    }

    #[test]
    fn plots_draw_without_periods_and_with_non_finite_numbers() {
        for draw in [reward_svg, throughput_svg, timeline_svg] {
            assert!(draw(&[]).unwrap().starts_with("<svg"));
            let mut bad = report(0, 0.0);
            bad.reward_mean = f64::NAN;
            bad.intervals[0].end_s = f64::INFINITY;
            assert!(draw(&[bad]).unwrap().starts_with("<svg"));
        }
    }

    #[test]
    fn bounds_keep_the_unit_interval_and_grow_for_outliers() {
        assert_eq!(bounds([0.2, 0.7].into_iter(), 0.0, 1.0), (0.0, 1.05));
        let (lo, hi) = bounds([-1.0, 2.0].into_iter(), 0.0, 1.0);
        assert!(lo < -1.0 && hi > 2.0);
    }
}
