//! `cargo xtask bench pipeline`: time per period of `sync`, `periodic` and `stale:1`
//! on the same workload, side by side in one run, with each stage's busy time.
//!
//! It prints, per workload, the realised `sync`/`periodic` speed-up beside its ideal
//! (T_gen + T_train) / max(T_gen, T_train) from the stage times measured under `sync`,
//! and the overlap efficiency of `periodic`: max(generation busy, training busy) /
//! period time. Two workloads: the default (short responses, training-heavy) and one
//! with longer forced responses on fewer KV slots that balances generation and training.
//!
//! Under `cargo test` (no `--bench` argument) it runs one short period per schedule
//! as a smoke test.

use metronome_pipeline::{PeriodReport, PipelineConfig, Runner, RunnerOptions, Schedule};

struct Measured {
    period_s: f64,
    generation_s: f64,
    training_s: f64,
}

fn measure(reports: &[PeriodReport], warmup: usize) -> Measured {
    let kept = &reports[warmup.min(reports.len() - 1)..];
    let n = kept.len() as f64;
    Measured {
        period_s: kept.iter().map(|r| r.period_s).sum::<f64>() / n,
        generation_s: kept.iter().map(|r| r.generation_s).sum::<f64>() / n,
        training_s: kept.iter().map(|r| r.training_s).sum::<f64>() / n,
    }
}

async fn run(workload: &[String], schedule: Schedule, periods: u64) -> Vec<PeriodReport> {
    let mut overrides = workload.to_vec();
    overrides.push(format!("run.schedule=\"{schedule}\""));
    overrides.push(format!("run.periods={periods}"));
    if !schedule.is_on_policy() {
        overrides.push("trainer.loss.tis_cap=2.0".into());
    }
    let mut config = PipelineConfig::embedded(&overrides).expect("bench config is valid");
    config.prepare().expect("bench config is valid");
    let (model, tokenizer) = metronome_pipeline::load_model(&config, config.trainer_device()).expect("model");
    let (stages, _) = metronome_pipeline::build_stages(&config, model, tokenizer).expect("stages");
    let transport = (schedule != Schedule::Sync).then(|| metronome_pipeline::local_transport(&config));
    let options = RunnerOptions { schedule, periods, ..RunnerOptions::from(&config) };
    Runner::new(stages, transport, options).expect("runner").run().await.expect("run").reports
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let (periods, warmup) = if bench { (6, 1) } else { (1, 0) };
    // An untrained model scores 0 everywhere; train every group anyway so the training
    // stage does the work a learning run would.
    let common = [
        "sft.steps=0",
        "eval.prompts=0",
        "data.release.batch_size=16",
        "run.group_size=8",
        "trainer.skip_zero_advantage_groups=false",
    ];
    let workloads: Vec<(&str, Vec<String>)> = vec![
        ("default (8-token responses)", common.iter().map(|s| (*s).to_owned()).collect()),
        // Longer responses alone no longer balance the stages: with fused decode
        // attention the tiny model generates 40-token responses in a quarter of the
        // period (26% / 74% measured). Four KV slots make generation decode-bound, as
        // it is for real models with long responses.
        (
            "balanced (40-token forced responses, 4 KV slots)",
            common
                .iter()
                .map(|s| (*s).to_owned())
                .chain([
                    "rollout.sampling.max_new_tokens=40".to_owned(),
                    "rollout.sampling.ignore_eos=true".to_owned(),
                    "rollout.max_num_seqs=4".to_owned(),
                ])
                .collect(),
        ),
    ];
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    for (name, workload) in workloads {
        let mut rows = Vec::new();
        for schedule in [Schedule::Sync, Schedule::Periodic, Schedule::Stale(1)] {
            let reports = runtime.block_on(run(&workload, schedule, periods + warmup as u64));
            rows.push((schedule, measure(&reports, warmup)));
        }
        let sync = &rows[0].1;
        let periodic = &rows[1].1;
        let ideal = (sync.generation_s + sync.training_s) / sync.generation_s.max(sync.training_s);
        let realised = sync.period_s / periodic.period_s;
        let efficiency = periodic.generation_s.max(periodic.training_s) / periodic.period_s;
        println!("\nworkload: {name}");
        println!("{:>10}  {:>9}  {:>9}  {:>10}", "schedule", "period s", "gen busy", "train busy");
        for (schedule, m) in &rows {
            println!(
                "{:>10}  {:>9.3}  {:>9.3}  {:>10.3}",
                schedule.to_string(),
                m.period_s,
                m.generation_s,
                m.training_s
            );
        }
        println!(
            "stage balance (sync): generation {:.0}% / training {:.0}%",
            100.0 * sync.generation_s / (sync.generation_s + sync.training_s),
            100.0 * sync.training_s / (sync.generation_s + sync.training_s)
        );
        println!(
            "sync/periodic speed-up {realised:.2}x vs ideal {ideal:.2}x ({:.0}% of ideal); \
             periodic overlap efficiency {efficiency:.2}; sync/stale:1 speed-up {:.2}x",
            100.0 * realised / ideal,
            sync.period_s / rows[2].1.period_s
        );
    }
}
