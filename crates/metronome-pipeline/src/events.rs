//! What a run reports as it goes, as data: the library never prints or draws.
//!
//! Every role (`run`, `trainer`, `rollout-worker`, `serve`) tells its [`Observer`]
//! what happens; a front end renders it. The `metronome` binary draws progress bars
//! and prints a line per period, and `--events FILE` writes every event as a JSON
//! line (its tests read those); a library user passes a closure, or keeps the default,
//! which logs each event through `tracing` at debug level.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::report::PeriodReport;

/// One thing a run reports. Serialised with its name in the field `event`, e.g.
/// `{"event":"period_done","report":{...},"accuracy":null}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Event {
    /// The run directory holds a checkpoint: the run continues at `period`.
    Resuming {
        /// The period the run continues at.
        period: u64,
        /// The checkpoint it continues from.
        checkpoint: PathBuf,
    },
    /// A damaged checkpoint was left out of the resume: kept at `moved_to`, and the
    /// run resumes from the newest older one that is whole (`Resuming` follows).
    CheckpointSetAside {
        /// Where the damaged checkpoint is kept.
        moved_to: PathBuf,
        /// Which checkpoint, and what is wrong with it.
        reason: String,
    },
    /// The warm start continues from its checkpoint after `step` steps.
    WarmStartResuming {
        /// Steps done before.
        step: u64,
        /// The checkpoint it continues from.
        checkpoint: PathBuf,
    },
    /// One step of the supervised warm start.
    WarmStartStep {
        /// Steps done (1-based).
        step: u64,
        /// Steps in the warm start.
        steps: u64,
        /// Mean loss per target token of the step.
        loss: f64,
    },
    /// Held-out accuracy before any period (after the warm start); evaluations at
    /// the end of a period come with [`Event::PeriodDone`].
    Evaluated {
        /// How the answers were sampled (`eval`'s settings, in words).
        how: String,
        /// The fraction of correct answers.
        accuracy: f64,
    },
    /// The periods begin: `first` (after a resume, not 0) up to `periods`.
    PeriodsStarted {
        /// The first period this process runs.
        first: u64,
        /// The period count the run ends at.
        periods: u64,
    },
    /// A group was trained (accumulated) in `period`.
    GroupTrained {
        /// The period.
        period: u64,
        /// The group's prompt.
        prompt: u64,
    },
    /// A period ended: recorded, and evaluated when `accuracy` is set.
    PeriodDone {
        /// Everything measured in it.
        report: Box<PeriodReport>,
        /// Held-out accuracy of the weights its step produced, when evaluated.
        accuracy: Option<f64>,
    },
    /// The run ended; its directory holds the record, plots and final checkpoint.
    RunFinished {
        /// The run directory.
        dir: PathBuf,
    },
    /// A rollout worker is connected and takes claims.
    WorkerReady {
        /// Its id.
        worker: String,
    },
    /// A rollout worker installed new weights.
    WeightsInstalled {
        /// Its id.
        worker: String,
        /// The weights' version.
        version: u64,
        /// The period it fetched them for.
        period: u64,
    },
    /// A rollout worker left.
    WorkerDone {
        /// Its id.
        worker: String,
        /// What it did.
        outcome: WorkerOutcome,
    },
    /// `metronome serve` listens.
    Serving {
        /// The model name clients ask for.
        model: String,
        /// The address it listens on.
        addr: String,
    },
}

/// What a worker did before it left.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerOutcome {
    /// Groups it published.
    pub groups: u64,
    /// Tokens it generated.
    pub tokens: u64,
    /// Claims it took that another worker had held before (lease expired or released).
    pub redelivered_claims: u64,
    /// The weights versions it installed, in order.
    pub versions: Vec<u64>,
    /// The periods it contributed groups to.
    pub periods: Vec<u64>,
}

/// Receives a run's [`Event`]s; cheap to clone. Built from any
/// `Fn(&Event) + Send + Sync`.
#[derive(Clone)]
pub struct Observer(Arc<dyn Fn(&Event) + Send + Sync>);

impl Observer {
    /// An observer calling `f` with every event.
    pub fn new(f: impl Fn(&Event) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// Reports `event`.
    pub fn emit(&self, event: &Event) {
        (self.0)(event);
    }
}

impl Default for Observer {
    /// Logs every event through `tracing` at debug level.
    fn default() -> Self {
        Self::new(|event| tracing::debug!(?event, "run event"))
    }
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer").finish_non_exhaustive()
    }
}
