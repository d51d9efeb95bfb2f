//! `metronome`: run RL post-training from a config file.
//!
//! ```text
//! metronome run [--config FILE]... [--set key.path=value]... [--schedule S] [--periods N] [--workers N]
//! metronome config [--config FILE] [--set ...]     # print the resolved, validated config
//! metronome trainer [--config FILE] [--set ...]     # the trainer of a multi-process run
//! metronome rollout-worker --worker-id ID [--config FILE] [--set ...]
//! metronome report RUN_DIR                         # the summary again, and report.html
//! metronome export RUN_DIR [--checkpoint final|latest|period-N] [--out DIR] [--questions N] [--set ...]
//! metronome serve [--addr A] [--api-key-file F] [--weights-dir D] [--logprobs sampled|raw] [--config FILE] [--set ...]
//! ```
//!
//! Without `--config` the embedded default runs: the built-in arithmetic task on the
//! tiny model. Metrics are served for Prometheus on `--metrics-addr` (loopback by
//! default; `off` disables), labelled with the process's `role` and `worker` id.
//!
//! `trainer` and `rollout-worker` share one config file with `transport.kind = "nats"`
//! (see `deploy/README.md`); `run` is the single-process pipeline.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use metronome_pipeline::{PipelineConfig, Schedule};

mod render;

// Training allocates and frees many tensors per step; mimalloc avoids the page-fault
// churn of the system allocator (docs/design.md §6). Only the binary chooses an allocator.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "metronome",
    version,
    about = "RL post-training of language models with periodic asynchrony"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the pipeline in this process (SFT warm start, then RL). A run directory
    /// (`run.out_dir/run.name`) holding a checkpoint is resumed from it.
    Run {
        #[command(flatten)]
        config: ConfigArgs,
        /// Resume the run in this directory (`runs/<name>`) with its stored config
        /// (`--set` still applies); the same as running its config again.
        #[arg(long, value_name = "RUN_DIR")]
        resume: Option<PathBuf>,
        #[command(flatten)]
        training: TrainingArgs,
    },
    /// The trainer of a multi-process run (needs `transport.kind = "nats"`): publishes
    /// weights, offers each period's prompts as claims, trains the groups workers send.
    /// Restarted with the same `run.name`, it resumes from its last period checkpoint.
    #[cfg(feature = "nats")]
    Trainer {
        #[command(flatten)]
        config: ConfigArgs,
        #[command(flatten)]
        training: TrainingArgs,
    },
    /// A rollout worker of a multi-process run: takes prompt claims, generates with the
    /// weights they name, publishes groups. Leaves on the trainer's shutdown, SIGTERM or
    /// Ctrl-C after finishing the claims in hand.
    #[cfg(feature = "nats")]
    RolloutWorker {
        #[command(flatten)]
        config: ConfigArgs,
        /// This worker's name in logs and metrics (the `worker` label).
        #[arg(long, default_value = "0")]
        worker_id: String,
        /// Serve Prometheus metrics here; `off` disables.
        #[arg(long, default_value = "127.0.0.1:9465")]
        metrics_addr: String,
        #[command(flatten)]
        events: EventsArg,
    },
    /// Serve the config's model through its rollout engine with the OpenAI-compatible
    /// completions API (`/v1/completions`, `/v1/models`,
    /// `/metronome/v1/load_weights`) until SIGTERM or Ctrl-C.
    #[cfg(feature = "http")]
    Serve {
        #[command(flatten)]
        config: ConfigArgs,
        /// Where to listen; an address other machines can reach needs an API key.
        #[arg(long, default_value = "127.0.0.1:8000")]
        addr: SocketAddr,
        /// The model name clients ask for.
        #[arg(long, default_value = "metronome")]
        model_name: String,
        /// A file holding the API key clients must send (`Authorization: Bearer`);
        /// else `$METRONOME_API_KEY`, else none.
        #[arg(long, value_name = "FILE")]
        api_key_file: Option<PathBuf>,
        /// The only folder `load_weights` reads weights from (none: it is refused).
        #[arg(long, value_name = "DIR")]
        weights_dir: Option<PathBuf>,
        /// Requests generating at once; more get 429.
        #[arg(long, default_value_t = 16)]
        max_concurrent_requests: usize,
        /// Which log-probs answers carry: `sampled` (of the distribution each token
        /// was drawn from, what the trainer scores) or `raw` (of the model at
        /// temperature 1, as vLLM answers by default).
        #[arg(long, default_value = "sampled", value_parser = ["sampled", "raw"])]
        logprobs: String,
        #[command(flatten)]
        events: EventsArg,
    },
    /// Print a run's summary table again and write `report.html` in its directory: one
    /// self-contained page (plots, held-out accuracy, the config) that opens offline.
    Report {
        /// The run directory (`runs/<name>`).
        run: PathBuf,
    },
    /// Export a run's checkpoint as a Hugging Face folder (weights, the tokenizer
    /// where the model source has one) with Metronome's greedy answers to held-out
    /// questions, which `crates/metronome-pipeline/examples/check_export.py` compares
    /// with `transformers`.
    Export {
        /// The run directory (`runs/<name>`); its `config.toml` says the model and task.
        run: PathBuf,
        /// `final`, `latest` (the newest period checkpoint), `period-<n>`, or `base`:
        /// the model the run starts from, untrained.
        #[arg(long, default_value = "final")]
        checkpoint: String,
        /// Where to write the folder (default: `RUN/export`).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Held-out questions to answer greedily (the first of the run's held-out split).
        #[arg(long, default_value_t = 32)]
        questions: usize,
        /// Override a value of the run's stored config, e.g. `--set model.device="cpu"`
        /// or `--set model.path=FILE` where the model lives elsewhere on this machine.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
    },
    /// Write the prompts a run draws as JSON lines (id, text after the chat template,
    /// token ids, reference): the batches of its periods (`run.periods`, `--periods`)
    /// in release order, then its held-out split, for another framework to train and
    /// evaluate on the same data (`crates/metronome-pipeline/benches/trl_gsm.py`).
    Prompts {
        #[command(flatten)]
        config: ConfigArgs,
        /// Held-out prompts to write after them.
        #[arg(long, default_value_t = 0)]
        heldout: usize,
        /// The file to write (default: standard output).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Print the resolved configuration after overrides and validation.
    Config {
        #[command(flatten)]
        config: ConfigArgs,
    },
}

/// What `run` and `trainer` share: the roles that train.
#[derive(Debug, Args)]
struct TrainingArgs {
    /// Resume even when the config changes what the run trains.
    #[arg(long)]
    allow_config_change: bool,
    /// Serve Prometheus metrics here; `off` disables.
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_addr: String,
    /// No progress bars (logs only).
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    events: EventsArg,
}

impl TrainingArgs {
    fn options(&self) -> Result<metronome_pipeline::RunOptions> {
        Ok(metronome_pipeline::RunOptions {
            observer: self.events.observer(!self.quiet)?,
            allow_config_change: self.allow_config_change,
        })
    }
}

#[derive(Debug, Args)]
struct EventsArg {
    /// Write every event of the run (periods, evaluations, resumption, workers' weights)
    /// as a JSON line to FILE; `-` is standard output.
    #[arg(long = "events", value_name = "FILE")]
    path: Option<PathBuf>,
}

impl EventsArg {
    fn observer(&self, progress: bool) -> Result<metronome_pipeline::Observer> {
        Ok(render::Render::new(progress, self.path.as_deref())?.observer())
    }
}

/// Prints a finished run's summary table and where it is.
fn print_summary(outcome: &metronome_pipeline::RunOutcome) {
    eprintln!("\n{}", metronome_pipeline::summary_table(&outcome.periods));
    eprintln!("run directory: {}", outcome.dir.path().display());
}

#[derive(Debug, Args)]
struct ConfigArgs {
    /// A TOML config file laid over the embedded default; repeat it to lay several in
    /// order (`--config base.toml --config sweep.toml`): each sets only the keys it
    /// names.
    #[arg(long, short)]
    config: Vec<PathBuf>,
    /// Override any value: `--set trainer.schedule.lr=3e-4` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Shorthand for `--set run.schedule=...`: sync, periodic or `stale:<s>`.
    #[arg(long)]
    schedule: Option<Schedule>,
    /// Shorthand for `--set run.periods=N`.
    #[arg(long)]
    periods: Option<u64>,
    /// Shorthand for `--set rollout.workers=N`.
    #[arg(long)]
    workers: Option<usize>,
    /// Shorthand for `--set run.seed=N`.
    #[arg(long)]
    seed: Option<u64>,
    /// Shorthand for `--set run.out_dir=DIR`.
    #[arg(long)]
    out_dir: Option<PathBuf>,
}

/// The truncated importance-sampling cap `--schedule stale:<s>` brings when the config
/// sets none: the value the pipeline bench runs `stale:1` with.
const STALE_TIS_CAP: f64 = 2.0;

impl ConfigArgs {
    /// Points these arguments at the run in `dir`: its stored config (unless
    /// `--config` names another), its folder and name.
    fn resume_from(&mut self, dir: &std::path::Path) -> Result<()> {
        let stored = dir.join("config.toml");
        if !stored.is_file() {
            anyhow::bail!("--resume {}: no config.toml there; is it a run directory?", dir.display());
        }
        let name = dir
            .file_name()
            .and_then(|n| n.to_str())
            .with_context(|| format!("--resume {}: not a run directory", dir.display()))?;
        let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        if self.config.is_empty() {
            self.config.push(stored);
        }
        self.out_dir = Some(parent.to_path_buf());
        // The name first, so that a `--set run.name=...` given too still wins.
        self.overrides.insert(0, format!("run.name={name:?}"));
        Ok(())
    }

    fn load(&self) -> Result<PipelineConfig> {
        let mut overrides = self.overrides.clone();
        if let Some(n) = self.periods {
            overrides.push(format!("run.periods={n}"));
        }
        if let Some(n) = self.workers {
            overrides.push(format!("rollout.workers={n}"));
        }
        if let Some(n) = self.seed {
            overrides.push(format!("run.seed={n}"));
        }
        if let Some(dir) = &self.out_dir {
            overrides.push(format!("run.out_dir={:?}", dir.display().to_string()));
        }
        if let Some(s) = self.schedule {
            // `--schedule stale:2` alone must run (`cargo xtask e2e --schedule stale:2`):
            // stale samples need importance-sampling correction, so bring a cap unless
            // the configuration chose one.
            if !s.is_on_policy() && self.parse(&overrides)?.trainer.loss.tis_cap.is_none() {
                tracing::info!("{s} corrects stale samples with trainer.loss.tis_cap = {STALE_TIS_CAP}");
                overrides.push(format!("trainer.loss.tis_cap={STALE_TIS_CAP:?}"));
            }
            overrides.push(format!("run.schedule=\"{s}\""));
        }
        self.parse(&overrides)
    }

    fn parse(&self, overrides: &[String]) -> Result<PipelineConfig> {
        Ok(PipelineConfig::load_layers(&self.config, overrides)?)
    }
}

fn main() -> ExitCode {
    set_process_defaults();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: logs read by services and tests stay plain.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// mimalloc's `mi_option_purge_delay`, which `libmimalloc-sys` does not name: the entry
/// before `mi_option_use_numa_nodes` (16) in `mi_option_e` of the mimalloc it builds
/// (v3's `include/mimalloc.h`; the test below holds the neighbour).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// The process-wide settings of candle, rayon and mimalloc that a run needs, each kept
/// when the caller set it:
///
/// - candle sizes its spinning element-wise pool from `CANDLE_NUM_THREADS` once,
///   process wide; left to default it takes every core and oversubscribes the stages'
///   own pools (docs/design.md §6). 1.
/// - `RAYON_NUM_THREADS`, which candle reads once for the parallelism of its matmuls
///   (`get_num_threads`; it used to count the cores from /proc on every matmul without
///   it, which made a period of the default run 4x slower in system time). The cores,
///   what candle would compute, so `sync` still splits its matmuls.
/// - mimalloc, by default, hands freed memory back to the OS after a short delay, and a
///   training step then faults it in zeroed again: about a fifth of the model bench's
///   CPU time. Never (`MIMALLOC_PURGE_DELAY=-1`, set as its option).
/// - mimalloc asks for transparent huge pages for its arenas; the kernel's shrinker
///   splits those it finds mostly zero and frees their zero pages, and the next step
///   faults a whole 2 MiB page in again, zeroed: 1.35% of a period of the TRL-matched
///   run in `clear_page_erms` (0.01% without), in bursts, at the same tokens/s. Off
///   ([`turn_off_huge_pages`]).
///
/// The binary used to re-execute itself with the variables set, to stay free of
/// `unsafe`; the second start-up of a 200 MB binary doubled its page faults (1,211 vs
/// 786 for the TRL-matched run), so they are set in place, before any thread exists.
#[allow(unsafe_code, reason = "setting the environment and an allocator option before any thread starts")]
fn set_process_defaults() {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get).to_string();
    for (key, value) in [("CANDLE_NUM_THREADS", "1"), ("RAYON_NUM_THREADS", cores.as_str())] {
        if std::env::var_os(key).is_none() {
            // SAFETY: called first in `main`, before this process starts any thread (no
            // dependency starts one before `main`), so nothing reads the environment
            // while it changes.
            unsafe { std::env::set_var(key, value) };
        }
    }
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: mimalloc's documented option setter, on an option it reads when it
        // next purges; no precondition beyond a valid option id.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
    turn_off_huge_pages();
}

/// Transparent huge pages off for this process, unless `MIMALLOC_ALLOW_THP` says how
/// to treat them: `prctl(PR_SET_THP_DISABLE)`, the flag the kernel checks at each
/// fault. Not mimalloc's own `allow_thp` option: its first arena is mapped before
/// `main`, and the option only reaches the arenas mapped after it is set.
fn turn_off_huge_pages() {
    #[cfg(target_os = "linux")]
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none()
        && let Err(e) = nix::sys::prctl::set_thp_disable(true)
    {
        // Only a cost, never a wrong result: say so and go on.
        eprintln!("metronome: could not turn transparent huge pages off ({e}); running with them");
    }
}

/// Installs the Prometheus exporter with the process's labels.
#[cfg(feature = "nats")]
fn serve_metrics(addr: &str, role: &str, worker: Option<&str>) -> Result<()> {
    if addr == "off" {
        return Ok(());
    }
    let addr: SocketAddr = addr.parse().with_context(|| format!("--metrics-addr `{addr}`"))?;
    let mut builder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .add_global_label("role", role);
    if let Some(worker) = worker {
        builder = builder.add_global_label("worker", worker);
    }
    builder.install().with_context(|| format!("serving metrics on {addr}"))?;
    describe_metrics();
    eprintln!("metrics: http://{addr}/metrics");
    Ok(())
}

/// Gives the installed exporter the help text and unit of every metric a run may
/// emit, from each crate's typed catalogue.
fn describe_metrics() {
    use metronome_core::{MetricKind, MetricUnit};
    let catalogues = metronome_pipeline::CATALOGUES.iter().copied();
    metrics::with_recorder(|recorder| {
        for m in catalogues.flatten() {
            let unit = match m.unit {
                MetricUnit::Count => Some(metrics::Unit::Count),
                MetricUnit::Seconds => Some(metrics::Unit::Seconds),
                MetricUnit::Bytes => Some(metrics::Unit::Bytes),
                // `metrics` has percent (0 to 100) but no fraction.
                MetricUnit::Ratio => None,
            };
            let (name, help) = (metrics::KeyName::from_const_str(m.name), m.help.into());
            match m.kind {
                MetricKind::Counter => recorder.describe_counter(name, unit, help),
                MetricKind::Gauge => recorder.describe_gauge(name, unit, help),
                MetricKind::Histogram => recorder.describe_histogram(name, unit, help),
            }
        }
    });
}

/// Resolves on SIGTERM or Ctrl-C.
#[cfg(any(feature = "nats", feature = "http"))]
async fn stop_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Runs `work` on a fresh runtime and then shuts the runtime down without waiting
/// for stray background work: a finished role exits promptly.
#[cfg(any(feature = "nats", feature = "http"))]
fn run_role<F: std::future::Future<Output = Result<()>>>(work: impl FnOnce() -> F) -> Result<()> {
    let runtime = runtime()?;
    let result = runtime.block_on(work());
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    result
}

#[cfg(any(feature = "nats", feature = "http"))]
fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Report { run } => {
            let dir = metronome_pipeline::RunDir::open(&run)?;
            let periods = dir.read_periods()?;
            let page = metronome_pipeline::write_html_report(&dir)?;
            eprintln!("{}", metronome_pipeline::summary_table(&periods));
            eprintln!("report: {}", page.display());
            Ok(())
        }
        Command::Export { run, checkpoint, out, questions, overrides } => {
            let stored = run.join("config.toml");
            if !stored.is_file() {
                anyhow::bail!("{}: no config.toml there; is it a run directory?", run.display());
            }
            let config = PipelineConfig::load(&stored, &overrides)?;
            let out = out.unwrap_or_else(|| run.join("export"));
            let options = metronome_pipeline::ExportOptions { checkpoint, out, questions };
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            let done = runtime.block_on(metronome_pipeline::export(&run, &config, &options))?;
            eprintln!("exported {} to {}", done.checkpoint.display(), done.out.display());
            if !done.tokenizer {
                eprintln!("(the run's character-level tokenizer has no Hugging Face form: weights only)");
            }
            eprintln!(
                "greedy answers to {} held-out questions, {} correct, in {}",
                done.questions,
                done.correct,
                done.out.join(metronome_pipeline::GREEDY_ANSWERS_FILE).display()
            );
            Ok(())
        }
        Command::Prompts { config, heldout, out } => {
            let config = config.load()?;
            let periods = config.run.periods;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            let lines = runtime.block_on(metronome_pipeline::prompt_lines(&config, periods, heldout))?;
            let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
            match out {
                Some(path) => {
                    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
                    eprintln!("{} prompts written to {}", lines.len(), path.display());
                }
                None => print!("{text}"),
            }
            Ok(())
        }
        Command::Config { config } => {
            print!("{}", config.load()?.to_toml()?);
            Ok(())
        }
        #[cfg(feature = "http")]
        Command::Serve {
            config,
            addr,
            model_name,
            api_key_file,
            weights_dir,
            max_concurrent_requests,
            logprobs,
            events,
        } => {
            let config = config.load()?;
            let api_key = match (&api_key_file, std::env::var("METRONOME_API_KEY")) {
                (Some(path), _) => Some(
                    metronome_pipeline::read_secret_file(path)
                        .with_context(|| format!("--api-key-file {}", path.display()))?,
                ),
                (None, Ok(key)) => Some(key),
                (None, Err(_)) => None,
            };
            let server = metronome_pipeline::ServerConfig {
                model_name,
                api_key: api_key.map(metronome_pipeline::Secret::new),
                weights_dir,
                max_concurrent_requests,
                logprobs: if logprobs == "raw" {
                    metronome_pipeline::LogprobsMode::Raw
                } else {
                    metronome_pipeline::LogprobsMode::Sampled
                },
                ..metronome_pipeline::ServerConfig::default()
            };
            let observer = events.observer(false)?;
            run_role(|| async {
                metronome_pipeline::serve(config, server, addr, stop_signal(), observer).await?;
                anyhow::Ok(())
            })
        }
        #[cfg(feature = "nats")]
        Command::Trainer { config, training } => {
            let config = config.load()?;
            let options = training.options()?;
            run_role(|| async {
                serve_metrics(&training.metrics_addr, "trainer", None)?;
                print_summary(&metronome_pipeline::cluster::run_trainer(config, options).await?);
                anyhow::Ok(())
            })
        }
        #[cfg(feature = "nats")]
        Command::RolloutWorker { config, worker_id, metrics_addr, events } => {
            let config = config.load()?;
            let observer = events.observer(false)?;
            run_role(|| async {
                serve_metrics(&metrics_addr, "rollout-worker", Some(&worker_id))?;
                let stop = metronome_pipeline::cluster::StopFlag::default();
                let on_signal = stop.clone();
                tokio::spawn(async move {
                    use std::io::Write as _;
                    stop_signal().await;
                    on_signal.stop();
                    // Not `eprintln!`: with the supervisor gone, stderr is a closed pipe,
                    // and a panic here would have left the flag unset (a worker that
                    // never left).
                    let _ = writeln!(
                        std::io::stderr(),
                        "leaving after the claims in hand (signal again to leave now)"
                    );
                    // Finishing the claims in hand may take long (a server gone, a
                    // publish retried up to `transport.publish_timeout_ms`): a second
                    // signal leaves at once, and the claims' leases expire for another
                    // worker.
                    stop_signal().await;
                    let _ = writeln!(
                        std::io::stderr(),
                        "leaving now; claims in hand go back when their leases expire"
                    );
                    std::process::exit(130);
                });
                metronome_pipeline::cluster::run_worker(config, &worker_id, stop, observer).await?;
                anyhow::Ok(())
            })
        }
        Command::Run { mut config, resume, training } => {
            if let Some(dir) = &resume {
                config.resume_from(dir)?;
            }
            let config = config.load()?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            runtime.block_on(async {
                let metrics_addr = &training.metrics_addr;
                if metrics_addr != "off" {
                    let addr: SocketAddr =
                        metrics_addr.parse().with_context(|| format!("--metrics-addr `{metrics_addr}`"))?;
                    metrics_exporter_prometheus::PrometheusBuilder::new()
                        .with_http_listener(addr)
                        .install()
                        .with_context(|| format!("serving metrics on {addr}"))?;
                    describe_metrics();
                    eprintln!("metrics: http://{addr}/metrics");
                }
                let outcome = metronome_pipeline::run(config, training.options()?).await?;
                print_summary(&outcome);
                if let (Some(first), Some(last)) = (outcome.evals.first(), outcome.evals.last()) {
                    eprintln!(
                        "held-out accuracy: {:.1}% after warm start, {:.1}% after {} periods",
                        first.accuracy * 100.0,
                        last.accuracy * 100.0,
                        last.after_periods
                    );
                }
                anyhow::Ok(())
            })
        }
    }
}

#[cfg(test)]
mod tests {
    /// The purge-delay option is the one before the NUMA-node count, as in mimalloc's
    /// header, and setting it reads back.
    #[test]
    #[allow(unsafe_code, reason = "mimalloc's option getter and setter")]
    fn the_purge_delay_option_is_mimallocs() {
        assert_eq!(super::MI_OPTION_PURGE_DELAY + 1, libmimalloc_sys::mi_option_use_numa_nodes);
        // SAFETY: mimalloc's documented option accessors, on a valid option id.
        unsafe {
            let before = libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY);
            libmimalloc_sys::mi_option_set(super::MI_OPTION_PURGE_DELAY, 12_345);
            assert_eq!(libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY), 12_345);
            libmimalloc_sys::mi_option_set(super::MI_OPTION_PURGE_DELAY, before);
        }
    }

    /// `turn_off_huge_pages` (which `set_process_defaults` calls; that one sets
    /// environment variables, which a test process with threads must not) leaves the
    /// flag the kernel checks at each fault set: it reads back so (in the test
    /// binary's own process, harmlessly).
    #[test]
    #[cfg(target_os = "linux")]
    fn transparent_huge_pages_are_turned_off() {
        if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
            return;
        }
        super::turn_off_huge_pages();
        assert!(nix::sys::prctl::get_thp_disable().unwrap());
    }
}
