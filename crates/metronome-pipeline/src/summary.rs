//! The table printed at the end of a run: one row per period and a totals line.

use std::fmt::Write as _;

use crate::report::PeriodReport;

const HEADERS: [&str; 10] =
    ["period", "seconds", "gen busy", "train busy", "overlap", "reward", "accuracy", "loss", "KL", "groups"];

/// A fixed-width text table of the periods: period, wall seconds, generation and
/// training busy seconds, overlap efficiency (max(gen, train) / seconds), mean
/// reward, accuracy, loss, KL (in scientific notation: it is often below 1e-3) and
/// groups trained; then a line with the totals
/// (seconds, busy times, groups), the whole run's overlap efficiency and the means
/// over periods of the rest (accuracy over the periods that report one).
///
/// Columns are right-aligned and as wide as their widest cell; a missing accuracy
/// shows as `-`. Ends with a newline.
#[must_use]
pub fn summary_table(reports: &[PeriodReport]) -> String {
    let mut rows: Vec<[String; 10]> = reports.iter().map(row).collect();
    let totals = totals(reports);
    let widths: [usize; 10] = std::array::from_fn(|c| {
        rows.iter().chain([&totals]).map(|r| r[c].len()).fold(HEADERS[c].len(), usize::max)
    });
    let mut out = String::new();
    line(&mut out, &HEADERS.map(str::to_owned), &widths);
    let rule = widths.map(|w| "-".repeat(w));
    line(&mut out, &rule, &widths);
    for r in rows.drain(..) {
        line(&mut out, &r, &widths);
    }
    line(&mut out, &rule, &widths);
    line(&mut out, &totals, &widths);
    out
}

fn line(out: &mut String, cells: &[String; 10], widths: &[usize; 10]) {
    let mut text = String::new();
    for (cell, width) in cells.iter().zip(widths) {
        // Writing to a String cannot fail.
        let _ = write!(text, "{cell:>width$}  ");
    }
    out.push_str(text.trim_end());
    out.push('\n');
}

fn row(r: &PeriodReport) -> [String; 10] {
    [
        r.period.to_string(),
        format!("{:.2}", r.period_s),
        format!("{:.2}", r.generation_s),
        format!("{:.2}", r.training_s),
        format!("{:.2}", r.overlap_efficiency()),
        format!("{:.3}", r.reward_mean),
        r.accuracy.map_or_else(|| "-".to_owned(), |a| format!("{a:.3}")),
        format!("{:.4}", r.step.loss),
        format!("{:.2e}", r.step.kl),
        r.groups.to_string(),
    ]
}

fn totals(reports: &[PeriodReport]) -> [String; 10] {
    let sum = |f: fn(&PeriodReport) -> f64| reports.iter().map(f).sum::<f64>();
    let (seconds, generation, training) =
        (sum(|r| r.period_s), sum(|r| r.generation_s), sum(|r| r.training_s));
    let overlap = if seconds > 0.0 { generation.max(training) / seconds } else { 0.0 };
    let mean =
        |values: Vec<f64>| (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64);
    let show = |value: Option<f64>, fmt: fn(f64) -> String| value.map_or_else(|| "-".to_owned(), fmt);
    [
        format!("all {}", reports.len()),
        format!("{seconds:.2}"),
        format!("{generation:.2}"),
        format!("{training:.2}"),
        format!("{overlap:.2}"),
        show(mean(reports.iter().map(|r| r.reward_mean).collect()), |v| format!("{v:.3}")),
        show(mean(reports.iter().filter_map(|r| r.accuracy).collect()), |v| format!("{v:.3}")),
        show(mean(reports.iter().map(|r| r.step.loss).collect()), |v| format!("{v:.4}")),
        show(mean(reports.iter().map(|r| r.step.kl).collect()), |v| format!("{v:.2e}")),
        reports.iter().map(|r| r.groups).sum::<usize>().to_string(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_core::PeriodId;

    #[test]
    fn columns_line_up_and_totals_add_up() {
        let reports: Vec<PeriodReport> = (0..3)
            .map(|k| PeriodReport {
                period: PeriodId(k),
                period_s: 2.0,
                generation_s: 1.0 + k as f64 * 0.5,
                training_s: 1.0,
                groups: 8,
                reward_mean: 0.5,
                accuracy: (k != 1).then_some(0.25 * k as f64),
                ..PeriodReport::default()
            })
            .collect();
        let table = summary_table(&reports);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2 + 3 + 2, "{table}");
        assert!(lines.iter().all(|l| l.len() == lines[0].len()), "{table}");
        let total: Vec<&str> = lines[6].split_whitespace().collect();
        // "all 3", seconds, gen, train, overlap, reward, accuracy, loss, KL, groups
        assert_eq!(
            total,
            ["all", "3", "6.00", "4.50", "3.00", "0.75", "0.500", "0.250", "0.0000", "0.00e0", "24"]
        );
        assert!(lines[3].contains(" - "), "missing accuracy shows as -: {}", lines[3]);
    }

    #[test]
    fn no_periods_is_a_header_and_an_empty_totals_line() {
        let table = summary_table(&[]);
        assert_eq!(table.lines().count(), 4);
        assert!(table.lines().last().unwrap().ends_with(" 0"));
    }
}
