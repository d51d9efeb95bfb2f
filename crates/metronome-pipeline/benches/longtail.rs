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
//! share of that time the trainer was idle, the groups dropped as too stale, and the
//! held-out accuracy after the last period, so that speed is not bought with learning.
//! Each schedule runs once per round, in turn, three rounds: the table gives medians
//! (and the range of held-out accuracy), the partial rollouts' ratio to `stale:2` is
//! the median of the per-round ratios.
//!
//! Under `cargo test` (no `--bench` argument) it runs two short periods per schedule as
//! a smoke test.

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
}

/// The rounds of a `--bench` run: every variant once per round, in turn, so that a
/// slow spell of the machine falls on all of them; the table gives medians.
const ROUNDS: usize = 3;

fn main() -> anyhow::Result<()> {
    let bench = std::env::args().any(|a| a == "--bench");
    let preset = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/longtail_copy.toml");
    let out = tempfile::tempdir()?;
    // Every prompt of a period in a slot at once: the period waits on its slowest.
    let common: Vec<String> = [
        format!("run.out_dir={:?}", out.path().display().to_string()),
        format!("run.periods={}", if bench { 40 } else { 2 }),
        format!("sft.steps={}", if bench { 600 } else { 20 }),
        format!("eval.prompts={}", if bench { 400 } else { 8 }),
        format!("eval.every={}", if bench { 40 } else { 2 }),
        "data.release.batch_size=8".to_owned(),
        "run.group_size=16".to_owned(),
        "rollout.max_num_seqs=128".to_owned(),
    ]
    .into();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut rows: Vec<Vec<Row>> = VARIANTS.iter().map(|_| Vec::new()).collect();
    for round in 0..if bench { ROUNDS } else { 1 } {
        for (variant, runs) in VARIANTS.iter().zip(&mut rows) {
            let mut overrides = common.clone();
            let name = variant.name.replace([':', ' ', '+', ','], "_");
            overrides.push(format!("run.name=\"{name}_{round}\""));
            overrides.extend(variant.overrides.iter().map(|s| (*s).to_owned()));
            let config = PipelineConfig::load(&preset, &overrides)?;
            let outcome = runtime.block_on(metronome_pipeline::run(config, RunOptions::default()))?;
            let wall: f64 = outcome.periods.iter().map(|r| r.period_s).sum();
            let training: f64 = outcome.periods.iter().map(|r| r.training_s).sum();
            let tokens: u64 = outcome.periods.iter().map(|r| r.generated_tokens).sum();
            runs.push(Row {
                tokens_per_s: tokens as f64 / wall,
                trainer_idle: 1.0 - training / wall,
                dropped_stale: outcome.periods.iter().map(|r| r.dropped_stale).sum(),
                warm: outcome.evals.iter().find(|e| e.after_periods == 0).map_or(f64::NAN, |e| e.accuracy),
                accuracy: outcome.evals.last().map_or(f64::NAN, |e| e.accuracy),
            });
        }
    }
    println!(
        "\nlong-tail copy (Zipf 1.2 over 1..=40 characters), tiny model, 8 prompts x 16 per period, 128 KV slots; \
         medians of {} round(s); held-out accuracy after the warm start {:.1}%",
        rows[0].len(),
        100.0 * rows[0][0].warm
    );
    println!(
        "{:<30}  {:>9}  {:>7}  {:>12}  {:>13}  {:>17}",
        "schedule", "tokens/s", "vs sync", "trainer idle", "dropped stale", "held-out (range)"
    );
    let tokens = |runs: &[Row]| median(runs.iter().map(|r| r.tokens_per_s));
    for (variant, runs) in VARIANTS.iter().zip(&rows) {
        let (lo, hi) =
            runs.iter().fold((f64::MAX, f64::MIN), |(l, h), r| (l.min(r.accuracy), h.max(r.accuracy)));
        println!(
            "{:<30}  {:>9.0}  {:>6.2}x  {:>11.0}%  {:>13}  {:>5.1}% ({:.1}-{:.1})",
            variant.name,
            tokens(runs),
            tokens(runs) / tokens(&rows[0]),
            100.0 * median(runs.iter().map(|r| r.trainer_idle)),
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
