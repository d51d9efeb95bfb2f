//! The typed entry of a crate's metrics catalogue.
//!
//! Every crate that emits metrics declares all of them in one `pub const METRICS:
//! &[Metric]`, written with [`metric_catalogue!`](crate::metric_catalogue), and emits
//! them through the `metrics` facade, from one module, by the entry's name. The
//! catalogue is plain data: the binary that installs an exporter describes every
//! catalogue to it (help text and unit), the dashboard tests check each entry is
//! charted, and a library user with another recorder can do the same.
//! This crate does not depend on the `metrics` facade; the entries only name things.

/// What kind of instrument a metric is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetricKind {
    /// A total that only grows; its name ends in `_total`.
    Counter,
    /// A value that is set (the newest wins).
    Gauge,
    /// A distribution of recorded values.
    Histogram,
}

/// The unit of a metric's values. The name carries it too (`_seconds`, `_bytes`,
/// `_ratio`), as Prometheus names do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetricUnit {
    /// A number of things (groups, tokens, versions) or a plain value.
    Count,
    /// Seconds.
    Seconds,
    /// Bytes.
    Bytes,
    /// A fraction between 0 and 1.
    Ratio,
}

impl MetricUnit {
    /// The suffix a metric name of this unit carries (before `_total`), if any.
    #[must_use]
    pub fn suffix(self) -> Option<&'static str> {
        match self {
            Self::Count => None,
            Self::Seconds => Some("_seconds"),
            Self::Bytes => Some("_bytes"),
            Self::Ratio => Some("_ratio"),
        }
    }
}

/// One metric: its name (`metronome_<stage>_<name>[_<unit>][_total]`), kind, unit,
/// the keys of its labels (bounded: never a prompt id) and a one-line help text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Metric {
    /// The full name.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: MetricKind,
    /// The unit of its values.
    pub unit: MetricUnit,
    /// The keys of the labels it is emitted with, in emission order.
    pub labels: &'static [&'static str],
    /// What it measures, for the exporter's help text.
    pub help: &'static str,
}

impl Metric {
    /// A metric without labels; [`Metric::counter`], [`Metric::gauge`],
    /// [`Metric::histogram`] and [`Metric::seconds`] name the usual kinds and units.
    #[must_use]
    pub const fn new(kind: MetricKind, unit: MetricUnit, name: &'static str, help: &'static str) -> Self {
        Self { name, kind, unit, labels: &[], help }
    }

    /// A counter of things.
    #[must_use]
    pub const fn counter(name: &'static str, help: &'static str) -> Self {
        Self::new(MetricKind::Counter, MetricUnit::Count, name, help)
    }

    /// A gauge of a count or plain value.
    #[must_use]
    pub const fn gauge(name: &'static str, help: &'static str) -> Self {
        Self::new(MetricKind::Gauge, MetricUnit::Count, name, help)
    }

    /// A histogram of counts or plain values.
    #[must_use]
    pub const fn histogram(name: &'static str, help: &'static str) -> Self {
        Self::new(MetricKind::Histogram, MetricUnit::Count, name, help)
    }

    /// A histogram of durations in seconds.
    #[must_use]
    pub const fn seconds(name: &'static str, help: &'static str) -> Self {
        Self::new(MetricKind::Histogram, MetricUnit::Seconds, name, help)
    }

    /// The same metric with another unit.
    #[must_use]
    pub const fn unit(self, unit: MetricUnit) -> Self {
        Self { unit, ..self }
    }

    /// The same metric with label keys.
    #[must_use]
    pub const fn labels(self, labels: &'static [&'static str]) -> Self {
        Self { labels, ..self }
    }

    /// What breaks the naming convention for a metric of `stage`, if anything: the
    /// `metronome_<stage>_` prefix, lower-case words, `_total` on counters and only
    /// on them, and the unit as a word of the name (`_seconds`, `_bytes`, `_ratio`).
    #[must_use]
    pub fn convention_error(&self, stage: &str) -> Option<String> {
        let name = self.name;
        let base = name.strip_suffix("_total");
        let problem = if !name.starts_with(&format!("metronome_{stage}_")) {
            format!("does not start with `metronome_{stage}_`")
        } else if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            "is not lower-case words joined by `_`".to_owned()
        } else if (self.kind == MetricKind::Counter) != base.is_some() {
            "must end in `_total` exactly when it is a counter".to_owned()
        } else if let Some(suffix) = self.unit.suffix()
            && !(base.unwrap_or(name).ends_with(suffix) || name.contains(&format!("{suffix}_")))
        {
            format!("is in {:?} but does not name the unit `{suffix}`", self.unit)
        } else if self.help.is_empty() {
            "has no help text".to_owned()
        } else {
            return None;
        };
        Some(format!("metric `{name}` {problem}"))
    }
}

/// Declares a catalogue of metrics: a `const` [`Metric`] for each entry, to emit it
/// by, and the catalogue slice that lists them all. Written once, no metric can be
/// declared and left out of the catalogue.
///
/// ```
/// use metronome_core::{Metric, metric_catalogue};
///
/// metric_catalogue! {
///     /// Every metric this crate emits.
///     pub const METRICS = [
///         GROUPS = Metric::counter("example_groups_total", "groups scored"),
///         STUCK = Metric::gauge("example_stuck_workers", "workers stuck").labels(&["pool"]),
///     ];
/// }
///
/// assert_eq!(METRICS, [GROUPS, STUCK]);
/// ```
#[macro_export]
macro_rules! metric_catalogue {
    (
        $(#[$doc:meta])*
        $vis:vis const $catalogue:ident = [
            $($(#[$attr:meta])* $name:ident = $metric:expr),* $(,)?
        ];
    ) => {
        $($(#[$attr])* const $name: $crate::Metric = $metric;)*

        $(#[$doc])*
        $vis const $catalogue: &[$crate::Metric] = &[$($name),*];
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `metronome_<rest>`, spelled so that the workspace's scan for metric names in
    /// the sources (every literal starting `"metronome_`) does not take these
    /// examples for metrics some crate emits.
    macro_rules! m {
        ($rest:literal) => {
            concat!("metronome", "_", $rest)
        };
    }

    #[test]
    fn the_naming_convention_is_checked() {
        let ok = [
            Metric::counter(m!("reward_groups_total"), "groups scored"),
            Metric::counter(m!("transport_bytes_sent_total"), "bytes").unit(MetricUnit::Bytes),
            Metric::seconds(m!("reward_group_seconds"), "time to score a group"),
            Metric::gauge(m!("rollout_active_slots"), "slots").labels(&["worker"]),
            Metric::histogram(m!("pipeline_staleness_versions"), "versions between sampling and training"),
        ];
        for m in ok {
            assert_eq!(m.convention_error(m.name.split('_').nth(1).unwrap()), None);
        }
        let bad = [
            (Metric::counter(m!("reward_groups"), "no _total"), "`_total`"),
            (Metric::gauge(m!("reward_groups_total"), "a gauge"), "`_total`"),
            (Metric::seconds(m!("reward_group_time"), "no unit"), "`_seconds`"),
            (Metric::counter(m!("rollout_groups_total"), "other stage"), "`metronome_reward_`"),
            (Metric::counter(m!("reward_Groups_total"), "case"), "lower-case"),
            (Metric::counter(m!("reward_groups_total"), ""), "help"),
        ];
        for (m, expected) in bad {
            let e = m.convention_error("reward").expect(m.name);
            assert!(e.contains(expected), "{e}");
        }
    }
}
