//! How the binary shows a role's [`Event`]s: progress bars and a line per period
//! on stderr for people, and with `--events FILE` every event as a JSON line (what
//! the binary's own tests read). The pipeline library reports; only this prints.

use std::io::Write;
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressStyle};
use metronome_pipeline::{Event, Observer};

/// Renders events; see the module docs.
pub(crate) struct Render {
    /// Draw progress bars (not with `--quiet`).
    progress: bool,
    json: Option<Mutex<Box<dyn Write + Send>>>,
    bars: Mutex<Bars>,
}

/// `eprintln!` that ignores a closed stderr (a supervisor gone): printing must never
/// panic the run it reports on.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

#[derive(Default)]
struct Bars {
    sft: Option<ProgressBar>,
    periods: Option<ProgressBar>,
}

impl Render {
    /// A renderer drawing bars when `progress`, and writing JSON lines to `events`
    /// (`-` for stdout) when given.
    pub(crate) fn new(progress: bool, events: Option<&std::path::Path>) -> anyhow::Result<Self> {
        let json: Option<Box<dyn Write + Send>> = match events {
            None => None,
            Some(p) if p.as_os_str() == "-" => Some(Box::new(std::io::stdout())),
            Some(p) => Some(Box::new(
                std::fs::File::create(p).map_err(|e| anyhow::anyhow!("--events {}: {e}", p.display()))?,
            )),
        };
        Ok(Self { progress, json: json.map(Mutex::new), bars: Mutex::default() })
    }

    /// The observer to hand the library.
    pub(crate) fn observer(self) -> Observer {
        Observer::new(move |event| self.event(event))
    }

    fn event(&self, event: &Event) {
        if let Some(json) = &self.json {
            let mut out = json.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            // A reader that went away must not stop the run.
            if let Err(e) =
                serde_json::to_writer(&mut *out, event).map_err(std::io::Error::from).and_then(|()| {
                    out.write_all(b"\n")?;
                    out.flush()
                })
            {
                tracing::warn!("cannot write an event: {e}");
            }
        }
        let mut bars = self.bars.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match event {
            Event::Resuming { period, checkpoint } => {
                say!("resuming at period {period} from {}", checkpoint.display());
            }
            Event::WarmStartResuming { step, checkpoint } => {
                say!("resuming the warm start after step {step} from {}", checkpoint.display());
            }
            Event::CheckpointSetAside { moved_to, reason } => {
                say!("checkpoint {reason}: set aside as {}, resuming from an older one", moved_to.display());
            }
            Event::WarmStartStep { step, steps, .. } if self.progress => {
                let bar = bars.sft.get_or_insert_with(|| bar(*steps, "sft"));
                bar.set_position(*step);
                if step >= steps {
                    bar.finish_and_clear();
                    bars.sft = None;
                }
            }
            Event::Evaluated { how, accuracy } => {
                say!("held-out accuracy ({how}) after warm start: {:.1}%", accuracy * 100.0);
            }
            Event::PeriodsStarted { first, periods } => {
                if let Some(sft) = bars.sft.take() {
                    sft.finish_and_clear();
                }
                if self.progress {
                    bars.periods = Some(bar(periods.saturating_sub(*first), "periods"));
                }
            }
            Event::PeriodDone { report, accuracy } => {
                let mut line = format!(
                    "period {:>3}  {:6.2}s  reward {:.3}  loss {:+.4}  kl {:.4}",
                    report.period, report.period_s, report.reward_mean, report.step.loss, report.step.kl
                );
                if !report.step.applied {
                    line.push_str("  step refused (non-finite)");
                }
                if report.rejected > 0 {
                    line.push_str(&format!("  {} groups rejected", report.rejected));
                }
                if report.filtered > 0 {
                    line.push_str(&format!("  {} filtered", report.filtered));
                }
                if report.duplicates > 0 {
                    line.push_str(&format!("  {} duplicates", report.duplicates));
                }
                if let Some(a) = accuracy {
                    line.push_str(&format!("  held-out accuracy {:.1}%", a * 100.0));
                }
                match &bars.periods {
                    Some(bar) => {
                        bar.inc(1);
                        bar.suspend(|| say!("{line}"));
                    }
                    None => say!("{line}"),
                }
            }
            Event::RunFinished { .. } => {
                if let Some(bar) = bars.periods.take() {
                    bar.finish_and_clear();
                }
            }
            Event::WorkerReady { worker } => say!("worker {worker}: ready"),
            Event::WeightsInstalled { worker, version, period } => {
                say!("worker {worker}: installed weights version {version} for period {period}");
            }
            Event::WorkerDone { worker, outcome: o } => say!(
                "worker {worker}: done: {} groups, {} tokens, {} redelivered claims, versions {:?}, periods {:?}",
                o.groups,
                o.tokens,
                o.redelivered_claims,
                o.versions,
                o.periods
            ),
            Event::Serving { model, addr } => say!("serving `{model}` on http://{addr}"),
            _ => {}
        }
    }
}

fn bar(len: u64, what: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{prefix:>8} [{bar:30}] {pos}/{len} {elapsed}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(what);
    bar
}
