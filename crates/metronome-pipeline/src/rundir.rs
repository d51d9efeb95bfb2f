//! The run directory: everything a run leaves behind for people and tools.
//!
//! ```text
//! <root>/<name>/
//!   config.toml      the resolved configuration (defaults, file and flags merged)
//!   metrics.jsonl    one `PeriodReport` as JSON per line, appended as each period ends
//!   checkpoints/     written by the trainer's checkpointing
//!   reward.svg       reward mean and accuracy per period
//!   throughput.svg   generation and training tokens/s per period
//!   timeline.svg     busy intervals of each stage, with period boundaries (the last 40 periods)
//! ```
//!
//! `metrics.jsonl` is the record of truth: each line is written whole and flushed to
//! the disk before `append_period` returns, so a crash loses no finished period, and
//! the plots can always be redrawn from it ([`RunDir::read_periods`]).

use std::fs::{self, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Component, Path, PathBuf};

use crate::checkpoint::Checkpoints;
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::plots;
use crate::report::PeriodReport;

/// The resolved configuration's file name.
pub(crate) const CONFIG_FILE: &str = "config.toml";
/// The per-period metrics file name.
pub(crate) const METRICS_FILE: &str = "metrics.jsonl";
/// The checkpoint folder's name.
pub(crate) const CHECKPOINTS_DIR: &str = "checkpoints";
/// The reward and accuracy plot's file name.
pub(crate) const REWARD_PLOT: &str = "reward.svg";
/// The tokens/s plot's file name.
pub(crate) const THROUGHPUT_PLOT: &str = "throughput.svg";
/// The stage timeline's file name.
pub(crate) const TIMELINE_PLOT: &str = "timeline.svg";
/// The held-out accuracy plot's file name (drawn when the run evaluated).
pub(crate) const HELDOUT_PLOT: &str = "heldout.svg";

/// A run's output folder, `<root>/<name>/`. Cheap to clone; holds no open files,
/// so it can be shared with hooks on other threads.
///
/// ```
/// # fn main() -> metronome_pipeline::Result<()> {
/// use metronome_pipeline::{PeriodReport, RunDir, summary_table};
///
/// # let root = tempfile::tempdir().unwrap();
/// let dir = RunDir::create(root.path(), "arith-periodic-seed1")?;
/// dir.write_config("[run]\nschedule = \"periodic\"\n")?;
/// // From the runner's period hook, as each period ends:
/// let report = PeriodReport::default();
/// dir.append_period(&report)?;
/// // At the end (or every few periods): plots and the table, from the record on disk.
/// let reports = dir.read_periods()?;
/// dir.write_plots(&reports)?;
/// print!("{}", summary_table(&reports));
/// assert!(dir.path().join("timeline.svg").is_file());
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunDir {
    path: PathBuf,
}

/// A run directory opened for a run ([`RunDir::open_run`]).
#[derive(Debug)]
pub(crate) struct OpenRun {
    /// The run directory.
    pub(crate) dir: RunDir,
    /// The folder of the run's period checkpoints.
    pub(crate) checkpoints: PathBuf,
    /// The checkpoint the run resumes from and the period it resumes at.
    pub(crate) resume: Option<(PathBuf, u64)>,
    /// Damaged checkpoints left out of the resume, newest first.
    pub(crate) set_aside: Vec<crate::checkpoint::SetAside>,
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

impl RunDir {
    /// Creates `<root>/<name>/` and its `checkpoints/` folder (and `root` if missing).
    ///
    /// An existing folder is reused and `metrics.jsonl` is appended to, so a resumed
    /// run continues its own record; pick a fresh `name` for a fresh run.
    ///
    /// # Errors
    /// [`Error::Io`] when `name` is not a single plain folder name (empty, `..`, a
    /// separator) or a folder cannot be created.
    pub fn create(root: &Path, name: &str) -> Result<Self> {
        let path = root.join(name);
        let mut components = Path::new(name).components();
        let plain = matches!(components.next(), Some(Component::Normal(_))) && components.next().is_none();
        if !plain {
            return Err(Error::Io {
                path,
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("the run name {name:?} must be one plain folder name"),
                ),
            });
        }
        let checkpoints = path.join(CHECKPOINTS_DIR);
        fs::create_dir_all(&checkpoints).map_err(io_error(&checkpoints))?;
        Ok(Self { path })
    }

    /// An existing run directory (one holding `config.toml` or `metrics.jsonl`), to read.
    ///
    /// # Errors
    /// [`Error::Io`] naming the folder when it is not a run directory.
    pub fn open(path: &Path) -> Result<Self> {
        if !(path.join(CONFIG_FILE).is_file() || path.join(METRICS_FILE).is_file()) {
            return Err(Error::Io {
                path: path.to_owned(),
                source: io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("is not a run directory: it holds neither {CONFIG_FILE} nor {METRICS_FILE}"),
                ),
            });
        }
        Ok(Self { path: path.to_owned() })
    }

    /// The run directory of a run of `config` (`run.out_dir/run.name`, a fresh
    /// timestamped name when unset), whose period checkpoints go to
    /// `checkpoints/<store>`, opened in one step: a checkpoint there means a resume,
    /// refused when `config` would make a different run unless `allow_config_change`;
    /// the resolved config is written, and the period record is cut back to where the
    /// run resumes (or emptied for a fresh start).
    ///
    /// # Errors
    /// [`Error::Config`] naming the keys that differ from the stored config;
    /// [`Error::Io`] naming the file at fault.
    pub(crate) fn open_run(
        config: &PipelineConfig,
        store: &str,
        allow_config_change: bool,
    ) -> Result<OpenRun> {
        let name = config.run.name.clone().unwrap_or_else(|| {
            let secs =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            format!("{}-{secs}", config.run.schedule).replace(':', "")
        });
        let dir = Self::create(&config.run.out_dir, &name)?;
        let checkpoints = dir.checkpoints().join(store);
        let store = Checkpoints::new(checkpoints.clone());
        let set_aside = if checkpoints.is_dir() { store.recover()? } else { Vec::new() };
        let latest = store.latest()?;
        // A warm start that checkpointed resumes too (`warm_start.rs`).
        let warm_start = Checkpoints::new(dir.warm_start_checkpoints()).latest().ok().flatten();
        if latest.is_some() || warm_start.is_some() {
            dir.check_resumable(config, allow_config_change)?;
        }
        dir.write_config(&config.to_toml()?)?;
        // A directory without a checkpoint holds nothing to continue: start over.
        let resume = latest.map(|(checkpoint, state)| (checkpoint, state.next_period));
        dir.resume_record(resume.as_ref().map_or(0, |r| r.1))?;
        Ok(OpenRun { dir, checkpoints, resume, set_aside })
    }

    /// Refuses to resume a run whose stored config differs from `config` in a key
    /// that changes what is trained, unless `allow`ed.
    fn check_resumable(&self, config: &PipelineConfig, allow: bool) -> Result<()> {
        let path = self.path.join(CONFIG_FILE);
        let stored = fs::read_to_string(&path).map_err(io_error(&path))?;
        let changed = config.resume_changes(&stored)?;
        if changed.is_empty() {
            return Ok(());
        }
        if allow {
            tracing::warn!(?changed, "resuming with a changed config, as asked");
            return Ok(());
        }
        Err(Error::Config {
            key: changed.join(", "),
            reason: format!(
                "differs from the config of the run being resumed ({}): it would make a different run; \
                 keep the stored values, start a new run.name, or resume anyway (--allow-config-change)",
                path.display()
            ),
        })
    }

    /// The run's folder.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The folder checkpoints go to.
    #[must_use]
    pub fn checkpoints(&self) -> PathBuf {
        self.path.join(CHECKPOINTS_DIR)
    }

    /// The folder of the warm start's checkpoints (`checkpoints/sft`).
    #[must_use]
    pub fn warm_start_checkpoints(&self) -> PathBuf {
        self.checkpoints().join("sft")
    }

    /// The `metrics.jsonl` file.
    #[must_use]
    pub fn metrics_path(&self) -> PathBuf {
        self.path.join(METRICS_FILE)
    }

    /// Writes the resolved configuration to `config.toml`, replacing an older one.
    ///
    /// # Errors
    /// [`Error::Io`] naming `config.toml`.
    pub fn write_config(&self, resolved_toml: &str) -> Result<()> {
        let path = self.path.join(CONFIG_FILE);
        write_file(&path, resolved_toml.as_bytes())
    }

    /// Appends one period as a JSON line to `metrics.jsonl` and flushes it to the disk.
    /// A last line cut short by a crash is removed first, never appended after.
    ///
    /// # Errors
    /// [`Error::Io`] naming `metrics.jsonl`.
    pub fn append_period(&self, report: &PeriodReport) -> Result<()> {
        let path = self.metrics_path();
        let mut line =
            serde_json::to_vec(report).map_err(|e| Error::Io { path: path.clone(), source: e.into() })?;
        line.push(b'\n');
        let mut file = OpenOptions::new().create(true).append(true).open(&path).map_err(io_error(&path))?;
        cut_torn_line(&file, &path)?;
        // One write of the whole line: an appending reader (or a crash) never sees half a
        // record followed by the next one.
        file.write_all(&line).map_err(io_error(&path))?;
        file.sync_data().map_err(io_error(&path))?;
        Ok(())
    }

    /// Prepares the record for a run resumed at `next_period`: keeps the periods
    /// before it (a period the resumed run repeats would otherwise be recorded
    /// twice) and drops a torn last line; the file is replaced atomically.
    ///
    /// # Errors
    /// [`Error::Io`] naming `metrics.jsonl` (or its line at fault).
    pub fn resume_record(&self, next_period: u64) -> Result<()> {
        let kept: Vec<PeriodReport> =
            self.read_periods()?.into_iter().filter(|r| r.period.0 < next_period).collect();
        let mut text = Vec::new();
        for report in &kept {
            let path = self.metrics_path();
            serde_json::to_writer(&mut text, report).map_err(|e| Error::Io { path, source: e.into() })?;
            text.push(b'\n');
        }
        write_file(&self.metrics_path(), &text)
    }

    /// Reads `metrics.jsonl` back, one report per line (empty when no period ended yet).
    ///
    /// A last line without its newline is the trace of a crash mid-write and is
    /// skipped; any other unparsable line is an error naming its number.
    ///
    /// # Errors
    /// [`Error::Io`] naming `metrics.jsonl` and the line at fault.
    pub fn read_periods(&self) -> Result<Vec<PeriodReport>> {
        let path = self.metrics_path();
        let file = match fs::File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::Io { path, source: e }),
        };
        let mut reader = BufReader::new(file);
        let mut reports = Vec::new();
        let mut line = String::new();
        for number in 1.. {
            line.clear();
            if reader.read_line(&mut line).map_err(io_error(&path))? == 0 {
                break;
            }
            let complete = line.ends_with('\n');
            if line.trim().is_empty() {
                continue;
            }
            match parse_line(&line) {
                Ok(report) => reports.push(report),
                Err(_) if !complete => break,
                Err(e) => {
                    return Err(Error::Io {
                        path,
                        source: io::Error::new(io::ErrorKind::InvalidData, format!("line {number}: {e}")),
                    });
                }
            }
        }
        Ok(reports)
    }

    /// Draws `reward.svg`, `throughput.svg` and `timeline.svg` from the periods so far,
    /// replacing older ones, and `heldout.svg` (held-out accuracy against the periods
    /// trained) when the run's event files hold evaluations. With no periods the plots
    /// are drawn with empty axes.
    ///
    /// # Errors
    /// [`Error::Io`] naming the plot that could not be drawn or written (event files
    /// that cannot be read only leave `heldout.svg` out, with a warning).
    pub fn write_plots(&self, reports: &[PeriodReport]) -> Result<()> {
        let plots: [(&str, plots::Draw); 3] = [
            (REWARD_PLOT, plots::reward_svg),
            (THROUGHPUT_PLOT, plots::throughput_svg),
            (TIMELINE_PLOT, plots::timeline_svg),
        ];
        for (name, draw) in plots {
            self.write_plot(name, draw(reports))?;
        }
        // From the event files, as `report.html` reads them: a resumed run's
        // evaluations before the resume are there too. A damaged event file costs
        // this plot, not the run that has just finished training.
        match crate::tensorboard::heldout_accuracy(&self.path) {
            Ok(evals) if evals.is_empty() => Ok(()),
            Ok(evals) => self.write_plot(HELDOUT_PLOT, plots::heldout_svg(&evals)),
            Err(e) => {
                tracing::warn!("not drawing {HELDOUT_PLOT}: {}", metronome_core::ErrorChain(&e));
                Ok(())
            }
        }
    }

    fn write_plot(&self, name: &str, drawn: plots::Drawn) -> Result<()> {
        let path = self.path.join(name);
        let svg =
            drawn.map_err(|reason| Error::Io { path: path.clone(), source: io::Error::other(reason) })?;
        write_file(&path, svg.as_bytes())
    }
}

/// Where a float field of a report is.
type Float = fn(&mut PeriodReport) -> &mut f64;

/// JSON has no NaN or infinity, so `serde_json` writes a non-finite float as `null`,
/// which it then refuses to read back as an `f64`. A skipped step (non-finite loss or
/// gradient norm) is exactly such a period; these fields (by JSON pointer, and where
/// they go in the report) read back as NaN.
const FLOATS: &[(&str, Float)] = &[
    ("/period_s", |r| &mut r.period_s),
    ("/generation_s", |r| &mut r.generation_s),
    ("/training_s", |r| &mut r.training_s),
    ("/publication_s", |r| &mut r.publication_s),
    ("/reward_mean", |r| &mut r.reward_mean),
    ("/step/loss", |r| &mut r.step.loss),
    ("/step/policy_loss", |r| &mut r.step.policy_loss),
    ("/step/kl", |r| &mut r.step.kl),
    ("/step/clip_fraction", |r| &mut r.step.clip_fraction),
    ("/step/entropy", |r| &mut r.step.entropy),
    ("/step/grad_norm", |r| &mut r.step.grad_norm),
    ("/step/learning_rate", |r| &mut r.step.learning_rate),
    ("/step/logprob_gap", |r| &mut r.step.logprob_gap),
    ("/step/mismatch/mean_abs", |r| &mut r.step.mismatch.mean_abs),
    ("/step/mismatch/p99_abs", |r| &mut r.step.mismatch.p99_abs),
    ("/step/mismatch/max_abs", |r| &mut r.step.mismatch.max_abs),
    ("/step/mismatch/kl_k3", |r| &mut r.step.mismatch.kl_k3),
];

fn parse_line(line: &str) -> serde_json::Result<PeriodReport> {
    let mut value: serde_json::Value = serde_json::from_str(line)?;
    let mut nulls = Vec::new();
    for &(pointer, field) in FLOATS {
        if let Some(v) = value.pointer_mut(pointer).filter(|v| v.is_null()) {
            *v = 0.0.into();
            nulls.push(field);
        }
    }
    let mut report: PeriodReport = serde_json::from_value(value)?;
    for field in nulls {
        *field(&mut report) = f64::NAN;
    }
    Ok(report)
}

/// Writes a whole file through a temporary sibling and a rename, so a reader (a
/// browser refreshing a plot) never sees it half written.
/// Removes a last line without its newline (a write cut short by a crash) from the
/// file `file` is open on, so that the next line does not run into it.
fn cut_torn_line(file: &fs::File, path: &Path) -> Result<()> {
    let len = file.metadata().map_err(io_error(path))?.len();
    if len == 0 {
        return Ok(());
    }
    let mut reader = fs::File::open(path).map_err(io_error(path))?;
    reader.seek(SeekFrom::End(-1)).map_err(io_error(path))?;
    let mut last = [0u8];
    reader.read_exact(&mut last).map_err(io_error(path))?;
    if last[0] == b'\n' {
        return Ok(());
    }
    // Rare (once after a crash): read it all to find the last whole line.
    let bytes = fs::read(path).map_err(io_error(path))?;
    let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    tracing::warn!(
        "{}: removing a last line cut short by a crash ({} bytes)",
        path.display(),
        len - keep as u64
    );
    file.set_len(keep as u64).map_err(io_error(path))?;
    file.sync_data().map_err(io_error(path))
}

/// Replaces `path` atomically with `bytes`, synced to the disk.
fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = fs::File::create(&tmp).map_err(io_error(&tmp))?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(io_error(&tmp))?;
    fs::rename(&tmp, path).map_err(|source| {
        let _ = fs::remove_file(&tmp);
        Error::Io { path: path.to_path_buf(), source }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_are_not_one_folder_are_refused() {
        let root = tempfile::tempdir().unwrap();
        for bad in ["", "..", "a/b", "/abs", "."] {
            let err = RunDir::create(root.path(), bad).unwrap_err();
            assert!(matches!(err, Error::Io { .. }), "{bad:?}: {err}");
            let chain = metronome_core::ErrorChain(&err).to_string();
            assert!(chain.contains("plain folder name"), "{chain}");
        }
    }

    #[test]
    fn a_torn_last_line_is_skipped_but_a_bad_middle_line_is_named() {
        let root = tempfile::tempdir().unwrap();
        let dir = RunDir::create(root.path(), "run").unwrap();
        dir.append_period(&PeriodReport::default()).unwrap();
        let mut text = fs::read_to_string(dir.metrics_path()).unwrap();
        text.push_str("{\"period\":1,\"peri");
        fs::write(dir.metrics_path(), &text).unwrap();
        assert_eq!(dir.read_periods().unwrap().len(), 1);

        text.push('\n');
        fs::write(dir.metrics_path(), &text).unwrap();
        let err = metronome_core::ErrorChain(&dir.read_periods().unwrap_err()).to_string();
        assert!(err.contains("metrics.jsonl") && err.contains("line 2"), "{err}");
    }

    #[test]
    fn no_metrics_file_reads_as_no_periods() {
        let root = tempfile::tempdir().unwrap();
        let dir = RunDir::create(root.path(), "run").unwrap();
        assert!(dir.read_periods().unwrap().is_empty());
    }
}
