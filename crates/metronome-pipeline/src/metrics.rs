//! The pipeline's metrics: the typed catalogues [`METRICS`] (every run) and
//! [`CLUSTER_METRICS`] (the multi-process roles), and the functions that emit them
//! through the `metrics` facade, once per group or period (never per token). Nothing
//! else in the crate emits. The binary installs the exporter and describes these
//! with the stage crates' catalogues (`crate::CATALOGUES`).

use metrics::{counter, gauge, histogram};
use metronome_core::{Metric, MetricUnit, metric_catalogue};

use crate::report::PeriodReport;

metric_catalogue! {
    /// Every metric a run emits (the scrape and dashboard tests hold the binary to it).
    pub const METRICS = [
        PERIODS = Metric::counter("metronome_pipeline_periods_total", "periods completed"),
        PERIOD_SECONDS = Metric::seconds("metronome_pipeline_period_seconds", "wall time of a period"),
        GENERATION_BUSY =
            Metric::seconds("metronome_pipeline_generation_busy_seconds", "generation busy time per period"),
        TRAINING_BUSY =
            Metric::seconds("metronome_pipeline_training_busy_seconds", "training busy time per period"),
        GENERATION_UTILISATION = Metric::gauge(
            "metronome_pipeline_generation_utilisation_ratio",
            "generation busy time / period time",
        )
        .unit(MetricUnit::Ratio),
        TRAINING_UTILISATION =
            Metric::gauge("metronome_pipeline_training_utilisation_ratio", "training busy time / period time")
                .unit(MetricUnit::Ratio),
        PUBLICATION_SECONDS = Metric::seconds(
            "metronome_pipeline_weight_publication_seconds",
            "time to publish and install weights",
        ),
        QUEUE_DEPTH =
            Metric::gauge("metronome_pipeline_queue_depth_groups", "groups received but not yet trained"),
        STALENESS = Metric::histogram(
            "metronome_pipeline_staleness_versions",
            "policy versions between sampling and training",
        ),
        GROUPS = Metric::counter("metronome_pipeline_groups_total", "groups trained"),
        DROPPED_STALE = Metric::counter(
            "metronome_pipeline_stale_groups_dropped_total",
            "groups dropped beyond the staleness bound",
        ),
        DUPLICATES =
            Metric::counter("metronome_pipeline_duplicate_groups_total", "redelivered groups ignored"),
        REJECTED = Metric::counter(
            "metronome_pipeline_rejected_groups_total",
            "groups not trained: prompt rejected by the engine, or a poison message (see the log)",
        ),
        FILTERED = Metric::counter(
            "metronome_pipeline_filtered_groups_total",
            "groups generated but not trained by dynamic sampling (all rewards equal, or the period \
             was full)",
        ),
        REFUSED_STEPS = Metric::counter(
            "metronome_pipeline_refused_steps_total",
            "steps whose update the trainer refused (non-finite loss or gradient); the weights stayed",
        ),
        GENERATED_TOKENS = Metric::counter("metronome_pipeline_generated_tokens_total", "tokens generated"),
        GENERATION_TOKENS_PER_SECOND = Metric::gauge(
            "metronome_pipeline_generation_tokens_per_second",
            "generated tokens per generation-busy second",
        ),
        TRAINING_TOKENS_PER_SECOND = Metric::gauge(
            "metronome_pipeline_training_tokens_per_second",
            "trained tokens per training-busy second",
        ),
        REWARD_MEAN = Metric::gauge("metronome_pipeline_reward_mean", "mean reward of the period"),
        ACCURACY = Metric::gauge(
            "metronome_pipeline_accuracy_ratio",
            "mean of the `correct` reward part of the period",
        )
        .unit(MetricUnit::Ratio),
        // The trainer's per-step values come back in its `StepReport`; the pipeline, which
        // drives it, is their one writer.
        LOSS = Metric::gauge("metronome_trainer_loss", "total loss of the step"),
        KL = Metric::gauge("metronome_trainer_kl", "mean KL to the reference"),
        CLIP_FRACTION =
            Metric::gauge("metronome_trainer_clip_fraction_ratio", "fraction of clipped token ratios")
                .unit(MetricUnit::Ratio),
        ENTROPY = Metric::gauge("metronome_trainer_entropy", "mean policy entropy"),
        GRAD_NORM = Metric::gauge("metronome_trainer_grad_norm", "gradient norm before clipping"),
        LEARNING_RATE = Metric::gauge("metronome_trainer_learning_rate", "learning rate of the step"),
        POLICY_VERSION =
            Metric::gauge("metronome_trainer_policy_version", "version of the trainer's weights"),
        // The train–rollout mismatch of the period's trained tokens (`StepReport::mismatch`).
        MISMATCH_MEAN = Metric::gauge(
            "metronome_trainer_mismatch_abs_mean",
            "mean |trainer − behaviour log-prob| of the period's trained tokens, nats",
        ),
        MISMATCH_P99 = Metric::gauge(
            "metronome_trainer_mismatch_abs_p99",
            "99th percentile of |trainer − behaviour log-prob| of the period's trained tokens, nats",
        ),
        MISMATCH_MAX = Metric::gauge(
            "metronome_trainer_mismatch_abs_max",
            "largest |trainer − behaviour log-prob| of the period's trained tokens, nats",
        ),
        MISMATCH_KL = Metric::gauge(
            "metronome_trainer_mismatch_kl_k3",
            "mean k3 estimate of KL(behaviour || trainer) per trained token",
        ),
        IS_TRUNCATED = Metric::gauge(
            "metronome_trainer_is_truncated_ratio",
            "share of the period's trained tokens whose importance weight tis_cap truncated",
        )
        .unit(MetricUnit::Ratio),
        IS_MASKED = Metric::gauge(
            "metronome_trainer_is_masked_ratio",
            "share of the period's trained tokens masked importance sampling dropped",
        )
        .unit(MetricUnit::Ratio),
        DISTILL_KL = Metric::gauge(
            "metronome_trainer_distill_reverse_kl",
            "mean per-token reverse KL from the policy to the distillation teacher on its own samples (0 \
             without a teacher)",
        ),
    ];
}

metric_catalogue! {
    /// The metrics of the multi-process roles. They carry no labels of their own: the
    /// binary serves each process's with the global labels `role` and `worker`.
    pub const CLUSTER_METRICS = [
        CLAIMS_OFFERED =
            Metric::counter("metronome_cluster_claims_offered_total", "prompt claims offered by the trainer"),
        CLAIMS_TAKEN = Metric::counter("metronome_cluster_claims_taken_total", "claims taken by this worker"),
        CLAIMS_COMPLETED =
            Metric::counter("metronome_cluster_claims_completed_total", "claims completed (group published)"),
        CLAIM_REDELIVERIES = Metric::counter(
            "metronome_cluster_claim_redeliveries_total",
            "claims taken again after a lease expired or a worker released them",
        ),
        CLAIMS_OBSOLETE =
            Metric::counter("metronome_cluster_claims_obsolete_total", "claims for a period already stepped"),
        CLAIMS_RELEASED = Metric::counter(
            "metronome_cluster_claims_released_total",
            "claims given back by a worker leaving while it waited",
        ),
        CLAIMS_ABANDONED = Metric::counter(
            "metronome_cluster_claims_abandoned_total",
            "claims a worker held past transport.claims.max_hold_ms and stopped renewing, for another worker",
        ),
        CLAIMS_REJECTED = Metric::counter(
            "metronome_cluster_claims_rejected_total",
            "claims every worker failed on, published as rejected groups (transport.claims.max_deliveries)",
        ),
        WORKER_GROUPS =
            Metric::counter("metronome_cluster_worker_groups_total", "groups published by this worker"),
        WORKER_TOKENS =
            Metric::counter("metronome_cluster_worker_tokens_total", "tokens generated by this worker"),
        WEIGHT_FETCH = Metric::seconds(
            "metronome_cluster_weight_fetch_seconds",
            "time for a worker to fetch and install weights",
        ),
        TRAINER_RESUMES =
            Metric::counter("metronome_cluster_trainer_resumes_total", "trainer restarts from a checkpoint"),
        PERIOD = Metric::gauge("metronome_cluster_period", "the period in progress"),
    ];
}

/// Emits one period's numbers.
pub(crate) fn record_period(report: &PeriodReport) {
    counter!(PERIODS.name).increment(1);
    histogram!(PERIOD_SECONDS.name).record(report.period_s);
    histogram!(GENERATION_BUSY.name).record(report.generation_s);
    histogram!(TRAINING_BUSY.name).record(report.training_s);
    histogram!(PUBLICATION_SECONDS.name).record(report.publication_s);
    if report.period_s > 0.0 {
        gauge!(GENERATION_UTILISATION.name).set(report.generation_s / report.period_s);
        gauge!(TRAINING_UTILISATION.name).set(report.training_s / report.period_s);
    }
    for &s in &report.staleness {
        histogram!(STALENESS.name).record(s as f64);
    }
    counter!(GROUPS.name).increment(report.groups as u64);
    counter!(DROPPED_STALE.name).increment(report.dropped_stale as u64);
    counter!(DUPLICATES.name).increment(report.duplicates as u64);
    counter!(REJECTED.name).increment(report.rejected as u64);
    counter!(FILTERED.name).increment(report.filtered as u64);
    counter!(REFUSED_STEPS.name).increment(u64::from(!report.step.applied));
    counter!(GENERATED_TOKENS.name).increment(report.generated_tokens);
    if report.generation_s > 0.0 {
        gauge!(GENERATION_TOKENS_PER_SECOND.name).set(report.generated_tokens as f64 / report.generation_s);
    }
    if report.training_s > 0.0 {
        gauge!(TRAINING_TOKENS_PER_SECOND.name).set(report.step.tokens as f64 / report.training_s);
    }
    gauge!(REWARD_MEAN.name).set(report.reward_mean);
    if let Some(acc) = report.accuracy {
        gauge!(ACCURACY.name).set(acc);
    }
    let step = &report.step;
    gauge!(LOSS.name).set(step.loss);
    gauge!(KL.name).set(step.kl);
    gauge!(CLIP_FRACTION.name).set(step.clip_fraction);
    gauge!(ENTROPY.name).set(step.entropy);
    gauge!(GRAD_NORM.name).set(step.grad_norm);
    gauge!(LEARNING_RATE.name).set(step.learning_rate);
    gauge!(POLICY_VERSION.name).set(step.version.0 as f64);
    // Zeros when the period trained no token, as the loss and the KL are.
    let mismatch = &step.mismatch;
    gauge!(MISMATCH_MEAN.name).set(mismatch.mean_abs);
    gauge!(MISMATCH_P99.name).set(mismatch.p99_abs);
    gauge!(MISMATCH_MAX.name).set(mismatch.max_abs);
    gauge!(MISMATCH_KL.name).set(mismatch.kl_k3);
    gauge!(IS_TRUNCATED.name).set(mismatch.truncated_share);
    gauge!(IS_MASKED.name).set(mismatch.masked_share);
    // 0 without a teacher, as the KL is without a reference.
    gauge!(DISTILL_KL.name).set(step.distill_kl.unwrap_or(0.0));
}

/// Groups received and not yet trained (a later period's, or the period's backlog).
pub(crate) fn queue_depth(groups: usize) {
    gauge!(QUEUE_DEPTH.name).set(groups as f64);
}

/// The multi-process trainer offered a period's claims.
#[cfg(feature = "nats")]
pub(crate) fn claims_offered(period: u64, claims: usize) {
    gauge!(PERIOD.name).set(period as f64);
    counter!(CLAIMS_OFFERED.name).increment(claims as u64);
}

/// The multi-process trainer resumed from a checkpoint.
#[cfg(feature = "nats")]
pub(crate) fn trainer_resumed() {
    counter!(TRAINER_RESUMES.name).increment(1);
}

/// A worker took claims, `redelivered` of them held by another worker before.
#[cfg(feature = "nats")]
pub(crate) fn claims_taken(claims: usize, redelivered: u64) {
    counter!(CLAIMS_TAKEN.name).increment(claims as u64);
    counter!(CLAIM_REDELIVERIES.name).increment(redelivered);
}

/// A worker completed claims of a period already stepped, without generating.
#[cfg(feature = "nats")]
pub(crate) fn claims_obsolete(claims: usize) {
    counter!(CLAIMS_OBSOLETE.name).increment(claims as u64);
}

/// A worker gave claims back as it left.
#[cfg(feature = "nats")]
pub(crate) fn claims_released(claims: usize) {
    counter!(CLAIMS_RELEASED.name).increment(claims as u64);
}

/// A worker stopped renewing the leases of claims it held too long.
#[cfg(feature = "nats")]
pub(crate) fn claims_abandoned(claims: usize) {
    counter!(CLAIMS_ABANDONED.name).increment(claims as u64);
}

/// A worker published a claim every worker failed on as a rejected group.
#[cfg(feature = "nats")]
pub(crate) fn claim_rejected() {
    counter!(CLAIMS_REJECTED.name).increment(1);
}

/// A worker fetched and installed weights in `seconds`.
#[cfg(feature = "nats")]
pub(crate) fn weights_fetched(seconds: f64) {
    histogram!(WEIGHT_FETCH.name).record(seconds);
}

/// A worker published a group of `tokens` tokens, completing its claim if it had one.
#[cfg(feature = "nats")]
pub(crate) fn group_published(tokens: u64, completed_claim: bool) {
    if completed_claim {
        counter!(CLAIMS_COMPLETED.name).increment(1);
    }
    counter!(WORKER_GROUPS.name).increment(1);
    counter!(WORKER_TOKENS.name).increment(tokens);
}
