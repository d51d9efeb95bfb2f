//! `report.html`: one self-contained page of a run, for people: the summary table,
//! the plots (inline SVG), held-out accuracy over time, and the resolved config.
//!
//! It references nothing outside itself (no scripts, styles, fonts or images to
//! fetch), so it opens offline and can be mailed or attached as it is.
//! `metronome report runs/<name>` writes it; `xtask/scripts/report-screenshot.sh`
//! renders it in headless Chromium.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::plots;
use crate::report::PeriodReport;
use crate::rundir::{CONFIG_FILE, RunDir};
use crate::summary::summary_table;
use crate::tensorboard::heldout_accuracy;

/// The page's file name in the run directory.
pub const REPORT_FILE: &str = "report.html";

/// Writes `report.html` in the run directory; its path.
pub fn write_html_report(dir: &RunDir) -> Result<PathBuf> {
    let reports = dir.read_periods()?;
    let evals = heldout_accuracy(dir.path())?;
    let config_path = dir.path().join(CONFIG_FILE);
    let config = std::fs::read_to_string(&config_path).unwrap_or_else(|e| format!("(no {CONFIG_FILE}: {e})"));
    let path = dir.path().join(REPORT_FILE);
    let html = page(dir.path(), &reports, &evals, &config)
        .map_err(|reason| Error::Io { path: path.clone(), source: std::io::Error::other(reason) })?;
    std::fs::write(&path, html).map_err(|source| Error::Io { path: path.clone(), source })?;
    Ok(path)
}

fn page(dir: &Path, reports: &[PeriodReport], evals: &[(u64, f64)], config: &str) -> Result<String, String> {
    let name =
        dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    let mut html = String::new();
    let w = &mut html;
    let _ = write!(
        w,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>Metronome run {name}</title>\n<style>\n{STYLE}</style>\n</head>\n<body>\n\
         <h1>Metronome run <code>{name}</code></h1>\n",
        name = escape(&name)
    );
    let last = reports.last();
    let _ = writeln!(
        w,
        "<p>{} periods recorded{}.</p>",
        reports.len(),
        last.map_or(String::new(), |r| format!(", the last {}", r.period))
    );
    if let (Some((_, first)), Some((after, last))) = (evals.first(), evals.last()) {
        let _ = writeln!(
            w,
            "<p>Held-out accuracy {:.1}% at the start, {:.1}% after {after} periods.</p>",
            first * 100.0,
            last * 100.0
        );
    }
    let _ = writeln!(w, "<h2>Summary</h2>\n<pre>{}</pre>", escape(&summary_table(reports)));
    let mut figures = vec![("Reward and accuracy", plots::reward_svg(reports)?)];
    if !evals.is_empty() {
        figures.push(("Held-out accuracy", plots::heldout_svg(evals)?));
    }
    figures.push(("Throughput", plots::throughput_svg(reports)?));
    figures.push(("Stage timeline", plots::timeline_svg(reports)?));
    for (title, svg) in figures {
        let _ = writeln!(w, "<h2>{title}</h2>\n<figure>{}</figure>", inline(&svg));
    }
    if !evals.is_empty() {
        let _ = writeln!(
            w,
            "<h2>Held-out evaluations</h2>\n<table>\n<tr><th>after periods</th><th>accuracy</th></tr>"
        );
        for (after, accuracy) in evals {
            let _ = writeln!(w, "<tr><td>{after}</td><td>{:.1}%</td></tr>", accuracy * 100.0);
        }
        let _ = writeln!(w, "</table>");
    }
    let _ = writeln!(w, "<h2>Configuration</h2>\n<pre>{}</pre>\n</body>\n</html>", escape(config));
    Ok(html)
}

const STYLE: &str = "body { font-family: sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }\n\
pre { background: #f4f4f4; padding: 1em; overflow-x: auto; font-size: 13px; }\n\
figure { margin: 0; } figure svg { max-width: 100%; height: auto; }\n\
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: 0.2em 0.8em; text-align: right; }\n";

/// An SVG document as an element of the page: its XML declaration, if any, dropped.
fn inline(svg: &str) -> &str {
    match svg.find("<svg") {
        Some(at) => &svg[at..],
        None => svg,
    }
}

/// Text as HTML: the config and names are the user's, and may hold `<` or `&`.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_and_svg_inlined() {
        assert_eq!(escape("a<b & \"c\">"), "a&lt;b &amp; &quot;c&quot;&gt;");
        assert_eq!(inline("<?xml version=\"1.0\"?>\n<svg width=\"1\"/>"), "<svg width=\"1\"/>");
    }
}
