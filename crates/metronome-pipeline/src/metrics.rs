//! The pipeline's metrics, emitted through the `metrics` facade once per group or
//! period (never per token). The binary installs the Prometheus exporter.

use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};

use crate::report::PeriodReport;

/// Every metric the pipeline emits: (name, kind, unit, help). The Grafana dashboard
/// and the scrape test are held to this list.
pub const METRICS: &[(&str, &str, &str)] = &[
    ("metronome_pipeline_periods_total", "counter", "periods completed"),
    ("metronome_pipeline_period_seconds", "histogram", "wall time of a period"),
    ("metronome_pipeline_generation_busy_seconds", "histogram", "generation busy time per period"),
    ("metronome_pipeline_training_busy_seconds", "histogram", "training busy time per period"),
    ("metronome_pipeline_generation_utilisation_ratio", "gauge", "generation busy time / period time"),
    ("metronome_pipeline_training_utilisation_ratio", "gauge", "training busy time / period time"),
    ("metronome_pipeline_weight_publication_seconds", "histogram", "time to publish and install weights"),
    ("metronome_pipeline_queue_depth_groups", "gauge", "groups received but not yet trained"),
    ("metronome_pipeline_staleness_versions", "histogram", "policy versions between sampling and training"),
    ("metronome_pipeline_groups_total", "counter", "groups trained"),
    ("metronome_pipeline_stale_groups_dropped_total", "counter", "groups dropped beyond the staleness bound"),
    ("metronome_pipeline_duplicate_groups_total", "counter", "redelivered groups ignored"),
    (
        "metronome_pipeline_rejected_groups_total",
        "counter",
        "groups not trained: prompt rejected by the engine, or a poison message (see the log)",
    ),
    (
        "metronome_pipeline_filtered_groups_total",
        "counter",
        "groups generated but not trained by dynamic sampling (all rewards equal, or the period was full)",
    ),
    (
        "metronome_pipeline_refused_steps_total",
        "counter",
        "steps whose update the trainer refused (non-finite loss or gradient); the weights stayed",
    ),
    ("metronome_pipeline_generated_tokens_total", "counter", "tokens generated"),
    (
        "metronome_pipeline_generation_tokens_per_second",
        "gauge",
        "generated tokens per generation-busy second",
    ),
    ("metronome_pipeline_training_tokens_per_second", "gauge", "trained tokens per training-busy second"),
    ("metronome_pipeline_reward_mean", "gauge", "mean reward of the period"),
    ("metronome_pipeline_accuracy_ratio", "gauge", "mean of the `correct` reward part of the period"),
    ("metronome_trainer_loss", "gauge", "total loss of the step"),
    ("metronome_trainer_kl", "gauge", "mean KL to the reference"),
    ("metronome_trainer_clip_fraction_ratio", "gauge", "fraction of clipped token ratios"),
    ("metronome_trainer_entropy", "gauge", "mean policy entropy"),
    ("metronome_trainer_grad_norm", "gauge", "gradient norm before clipping"),
    ("metronome_trainer_learning_rate", "gauge", "learning rate of the step"),
    ("metronome_trainer_policy_version", "gauge", "version of the trainer's weights"),
];

/// Registers help texts and units with the installed recorder.
pub fn describe_metrics() {
    for &(name, kind, help) in METRICS {
        let unit = if name.ends_with("_seconds") { Some(Unit::Seconds) } else { None };
        match (kind, unit) {
            ("counter", _) => describe_counter!(name, help),
            ("gauge", Some(u)) => describe_gauge!(name, u, help),
            ("gauge", None) => describe_gauge!(name, help),
            (_, Some(u)) => describe_histogram!(name, u, help),
            (_, None) => describe_histogram!(name, help),
        }
    }
}

/// Emits one period's numbers.
pub(crate) fn record_period(report: &PeriodReport) {
    counter!("metronome_pipeline_periods_total").increment(1);
    histogram!("metronome_pipeline_period_seconds").record(report.period_s);
    histogram!("metronome_pipeline_generation_busy_seconds").record(report.generation_s);
    histogram!("metronome_pipeline_training_busy_seconds").record(report.training_s);
    histogram!("metronome_pipeline_weight_publication_seconds").record(report.publication_s);
    if report.period_s > 0.0 {
        gauge!("metronome_pipeline_generation_utilisation_ratio").set(report.generation_s / report.period_s);
        gauge!("metronome_pipeline_training_utilisation_ratio").set(report.training_s / report.period_s);
    }
    for &s in &report.staleness {
        histogram!("metronome_pipeline_staleness_versions").record(s as f64);
    }
    counter!("metronome_pipeline_groups_total").increment(report.groups as u64);
    counter!("metronome_pipeline_stale_groups_dropped_total").increment(report.dropped_stale as u64);
    counter!("metronome_pipeline_duplicate_groups_total").increment(report.duplicates as u64);
    counter!("metronome_pipeline_rejected_groups_total").increment(report.rejected as u64);
    counter!("metronome_pipeline_filtered_groups_total").increment(report.filtered as u64);
    counter!("metronome_pipeline_refused_steps_total").increment(u64::from(!report.step.applied));
    counter!("metronome_pipeline_generated_tokens_total").increment(report.generated_tokens);
    if report.generation_s > 0.0 {
        gauge!("metronome_pipeline_generation_tokens_per_second")
            .set(report.generated_tokens as f64 / report.generation_s);
    }
    if report.training_s > 0.0 {
        gauge!("metronome_pipeline_training_tokens_per_second")
            .set(report.step.tokens as f64 / report.training_s);
    }
    gauge!("metronome_pipeline_reward_mean").set(report.reward_mean);
    if let Some(acc) = report.accuracy {
        gauge!("metronome_pipeline_accuracy_ratio").set(acc);
    }
    let step = &report.step;
    gauge!("metronome_trainer_loss").set(step.loss);
    gauge!("metronome_trainer_kl").set(step.kl);
    gauge!("metronome_trainer_clip_fraction_ratio").set(step.clip_fraction);
    gauge!("metronome_trainer_entropy").set(step.entropy);
    gauge!("metronome_trainer_grad_norm").set(step.grad_norm);
    gauge!("metronome_trainer_learning_rate").set(step.learning_rate);
    gauge!("metronome_trainer_policy_version").set(step.version.0 as f64);
}
