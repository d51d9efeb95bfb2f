//! `cargo bench -p metronome-pipeline --bench longtail`: the schedules on long-tail
//! generation lengths, side by side in one run.
//!
//! The workload is `configs/longtail_copy.toml` (copy a string whose length follows a
//! Zipf law over 1..=40 characters) on the tiny model, warm-started, then the same
//! periods under `sync`, `periodic`, `stale:2` and `stale:2` with partial rollouts
//! (the running responses' caches rebuilt under new weights, and kept). A
//! period's prompts all fit the KV-cache slots at once, so without partial rollouts a
//! period's generation lasts as long as its slowest response while most slots sit
//! empty; with them the next period's responses fill the slots as they free up, and
//! responses still running continue under the newest weights. It prints, per
//! schedule, the generated tokens per second of wall time over the RL periods, the
//! share of that time the trainer was idle, how many cores the process kept busy (the
//! ceiling of any schedule's gain on the machine), the engine's mean rows per decode
//! step (how full the tail kept its steps), the groups dropped as too stale, and
//! the held-out accuracy after the last period, so that speed is not bought with
//! learning.
//! Each schedule runs once per round, in turn, three rounds: the table gives medians
//! (and the range of held-out accuracy), the partial rollouts' ratio to `stale:2` is
//! the median of the per-round ratios.
//!
//! Under `cargo test` (no `--bench` argument) it runs two short periods per schedule as
//! a smoke test. `LONGTAIL_ONLY='stale:2|sync'` runs only the schedules named,
//! `LONGTAIL_ROUNDS` sets the rounds, and `LONGTAIL_SET='run.periods=50;sft.steps=100'`
//! adds overrides to every run (a profile, a quick look).

use metronome_pipeline::{PipelineConfig, RunOptions};

/// One schedule's run: its overrides of the preset.
struct Variant {
    name: &'static str,
    overrides: &'static [&'static str],
}

const STALE: [&str; 2] = ["run.schedule=\"stale:2\"", "trainer.loss.tis_cap=2.0"];

const VARIANTS: [Variant; 5] = [
    Variant { name: "sync", overrides: &["run.schedule=\"sync\""] },
    Variant { name: "periodic", overrides: &["run.schedule=\"periodic\""] },
    Variant { name: "stale:2", overrides: &STALE },
    Variant {
        name: "stale:2 + partial",
        overrides: &[
            STALE[0],
            STALE[1],
            "rollout.partial_rollouts=true",
            "rollout.partial_cache=\"rebuild\"",
        ],
    },
    Variant {
        name: "stale:2 + partial, kept cache",
        overrides: &[STALE[0], STALE[1], "rollout.partial_rollouts=true", "rollout.partial_cache=\"keep\""],
    },
];

struct Row {
    tokens_per_s: f64,
    trainer_idle: f64,
    dropped_stale: usize,
    /// Held-out accuracy after the warm start, and after the last period.
    warm: f64,
    accuracy: f64,
    /// CPU time over wall time between the first and the last-but-one period's end
    /// (the last one's evaluation left out): how many cores the run kept busy.
    cores_busy: f64,
    /// The rollout engine's decode rows per decode step over the same periods
    /// (`metronome_rollout_decode_{rows,steps}_total`): how full the tail kept its steps.
    rows_per_step: f64,
}

/// What the process had done at each period's end: its CPU time and the engine's
/// decode steps and rows (see [`Row::cores_busy`], [`Row::rows_per_step`]).
#[derive(Clone)]
struct Marks {
    marks: std::sync::Arc<std::sync::Mutex<Vec<Mark>>>,
    metrics: metrics_util::debugging::Snapshotter,
}

#[derive(Clone, Copy)]
struct Mark {
    at: std::time::Instant,
    cpu_s: f64,
    steps: f64,
    rows: f64,
}

impl Marks {
    fn new(metrics: metrics_util::debugging::Snapshotter) -> Self {
        Self { marks: std::sync::Arc::default(), metrics }
    }

    fn observer(&self) -> metronome_pipeline::Observer {
        let this = self.clone();
        metronome_pipeline::Observer::new(move |event| {
            if let metronome_pipeline::Event::PeriodDone { .. } = event
                && let Some(cpu_s) = process_cpu_s()
            {
                let (steps, rows) = this.decode_counters();
                let mut marks = this.marks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let (before_steps, before_rows) = marks.last().map_or((0.0, 0.0), |m| (m.steps, m.rows));
                let (steps, rows) = (before_steps + steps, before_rows + rows);
                marks.push(Mark { at: std::time::Instant::now(), cpu_s, steps, rows });
            }
        })
    }

    /// The decode steps and rows every engine of the process has counted since the last
    /// call (a snapshot of the debugging recorder takes its counters back to 0).
    fn decode_counters(&self) -> (f64, f64) {
        let (mut steps, mut rows) = (0.0, 0.0);
        for (key, _, _, value) in self.metrics.snapshot().into_vec() {
            let metrics_util::debugging::DebugValue::Counter(n) = value else { continue };
            match key.key().name() {
                "metronome_rollout_decode_steps_total" => steps += n as f64,
                "metronome_rollout_decode_rows_total" => rows += n as f64,
                _ => {}
            }
        }
        (steps, rows)
    }

    /// The change in `num` over the change in `den` from the first mark to the
    /// last-but-one.
    fn between(&self, num: impl Fn(&Mark) -> f64, den: impl Fn(&Mark) -> f64) -> f64 {
        let marks = self.marks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match (marks.first(), marks.len().checked_sub(2).map(|i| marks[i])) {
            (Some(a), Some(b)) if den(&b) > den(a) => (num(&b) - num(a)) / (den(&b) - den(a)),
            _ => f64::NAN,
        }
    }

    fn cores(&self) -> f64 {
        let t0 = self.marks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).first().map(|m| m.at);
        let since = move |m: &Mark| t0.map_or(0.0, |t0| m.at.duration_since(t0).as_secs_f64());
        self.between(|m| m.cpu_s, since)
    }

    fn rows_per_step(&self) -> f64 {
        self.between(|m| m.rows, |m| m.steps)
    }
}

/// The process's user and system CPU seconds (Linux; `None` elsewhere).
fn process_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at the state, field 3;
    // utime and stime are fields 14 and 15, in clock ticks (100 a second on Linux).
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let ticks: f64 = fields.next()?.parse::<f64>().ok()? + fields.next()?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// The RL periods of a `--bench` run. At 40 (about 1.5 s of periods on 2 cores) the
/// start of the pipeline weighed on every figure and the same schedule's tokens/s
/// moved 30% from run to run; at 200 the periods take 6-12 s.
const PERIODS: u64 = 200;

/// The rounds of a `--bench` run: every variant once per round, in turn, so that a
/// slow spell of the machine falls on all of them; the table gives medians.
const ROUNDS: usize = 3;

fn main() -> anyhow::Result<()> {
    let bench = std::env::args().any(|a| a == "--bench");
    let only = std::env::var("LONGTAIL_ONLY").ok();
    if let Some(unknown) =
        only.iter().flat_map(|o| o.split('|')).find(|o| VARIANTS.iter().all(|v| v.name != *o))
    {
        let names: Vec<&str> = VARIANTS.iter().map(|v| v.name).collect();
        anyhow::bail!("LONGTAIL_ONLY: no schedule {unknown:?} (the schedules: {})", names.join(" | "));
    }
    let extra: Vec<String> = std::env::var("LONGTAIL_SET")
        .map(|s| s.split(';').filter(|o| !o.is_empty()).map(str::to_owned).collect())
        .unwrap_or_default();
    let rounds: usize = match std::env::var("LONGTAIL_ROUNDS") {
        Ok(r) => r.parse().map_err(|e| anyhow::anyhow!("LONGTAIL_ROUNDS={r:?}: {e}"))?,
        Err(_) => ROUNDS,
    };
    let preset = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/longtail_copy.toml");
    let out = tempfile::tempdir()?;
    // Every prompt of a period in a slot at once: the period waits on its slowest.
    let common: Vec<String> = [
        format!("run.out_dir={:?}", out.path().display().to_string()),
        format!("run.periods={}", if bench { PERIODS } else { 2 }),
        format!("sft.steps={}", if bench { 600 } else { 20 }),
        format!("eval.prompts={}", if bench { 400 } else { 8 }),
        format!("eval.every={}", if bench { PERIODS } else { 2 }),
        "data.release.batch_size=8".to_owned(),
        "run.group_size=16".to_owned(),
        "rollout.max_num_seqs=128".to_owned(),
    ]
    .into();
    // The engines' decode counters, read at each period's end (`Marks`).
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().map_err(|e| anyhow::anyhow!("installing the metrics recorder: {e}"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut rows: Vec<Vec<Row>> = VARIANTS.iter().map(|_| Vec::new()).collect();
    for round in 0..if bench { rounds } else { 1 } {
        for (variant, runs) in VARIANTS.iter().zip(&mut rows) {
            if only.as_ref().is_some_and(|o| !o.split('|').any(|o| variant.name == o)) {
                continue;
            }
            let mut overrides = common.clone();
            let name = variant.name.replace([':', ' ', '+', ','], "_");
            overrides.push(format!("run.name=\"{name}_{round}\""));
            overrides.extend(variant.overrides.iter().map(|s| (*s).to_owned()));
            overrides.extend(extra.iter().cloned());
            let config = PipelineConfig::load(&preset, &overrides)?;
            let marks = Marks::new(snapshotter.clone());
            let options = RunOptions { observer: marks.observer(), ..RunOptions::default() };
            let outcome = runtime.block_on(metronome_pipeline::run(config, options))?;
            let wall: f64 = outcome.periods.iter().map(|r| r.period_s).sum();
            let training: f64 = outcome.periods.iter().map(|r| r.training_s).sum();
            let tokens: u64 = outcome.periods.iter().map(|r| r.generated_tokens).sum();
            eprintln!(
                "{} round {round}: {wall:.1} s, training {training:.1} s, generation {:.1} s, {tokens} tokens",
                variant.name,
                outcome.periods.iter().map(|r| r.generation_s).sum::<f64>()
            );
            runs.push(Row {
                tokens_per_s: tokens as f64 / wall,
                trainer_idle: 1.0 - training / wall,
                dropped_stale: outcome.periods.iter().map(|r| r.dropped_stale).sum(),
                warm: outcome.evals.iter().find(|e| e.after_periods == 0).map_or(f64::NAN, |e| e.accuracy),
                accuracy: outcome.evals.last().map_or(f64::NAN, |e| e.accuracy),
                cores_busy: marks.cores(),
                rows_per_step: marks.rows_per_step(),
            });
        }
    }
    println!(
        "\nlong-tail copy (Zipf 1.2 over 1..=40 characters), tiny model, 8 prompts x 16 per period, 128 KV slots; \
         medians of {} round(s); held-out accuracy after the warm start {:.1}%",
        rows.iter().map(Vec::len).max().unwrap_or(0),
        100.0 * rows.iter().flatten().next().map_or(f64::NAN, |r| r.warm)
    );
    println!(
        "{:<30}  {:>9}  {:>7}  {:>12}  {:>10}  {:>13}  {:>13}  {:>17}",
        "schedule",
        "tokens/s",
        "vs sync",
        "trainer idle",
        "cores busy",
        "rows per step",
        "dropped stale",
        "held-out (range)"
    );
    let tokens = |runs: &[Row]| median(runs.iter().map(|r| r.tokens_per_s));
    for (variant, runs) in VARIANTS.iter().zip(&rows).filter(|(_, runs)| !runs.is_empty()) {
        let (lo, hi) =
            runs.iter().fold((f64::MAX, f64::MIN), |(l, h), r| (l.min(r.accuracy), h.max(r.accuracy)));
        println!(
            "{:<30}  {:>9.0}  {:>6.2}x  {:>11.0}%  {:>10.2}  {:>13.1}  {:>13}  {:>5.1}% ({:.1}-{:.1})",
            variant.name,
            tokens(runs),
            tokens(runs) / tokens(&rows[0]),
            100.0 * median(runs.iter().map(|r| r.trainer_idle)),
            median(runs.iter().map(|r| r.cores_busy)),
            median(runs.iter().map(|r| r.rows_per_step)),
            runs.iter().map(|r| r.dropped_stale).max().unwrap_or(0),
            100.0 * median(runs.iter().map(|r| r.accuracy)),
            100.0 * lo,
            100.0 * hi
        );
    }
    // The ratio within each round, then its median: the fairest pairing.
    let ratio = |k: usize| median(rows[k].iter().zip(&rows[2]).map(|(p, s)| p.tokens_per_s / s.tokens_per_s));
    println!(
        "partial rollouts vs stale:2 without them: {:.2}x tokens/s (cache rebuilt), {:.2}x (cache kept)",
        ratio(3),
        ratio(4)
    );
    Ok(())
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
