//! Many processes: one trainer and any number of rollout workers over NATS JetStream.
//!
//! The period protocol, each step idempotent so that a restarted trainer can repeat it:
//!
//! 1. the trainer publishes the weights of version `k` to the object store (publishing
//!    the same version again overwrites it with the same bytes), and meanwhile
//! 2. offers one *claim* per prompt of period `k` on the claim queue, so that workers
//!    fetch the weights while they upload (offered again after a restart, the server
//!    drops them as duplicates of `claim-<period>-<prompt>`), then announces
//!    `PeriodStart` on the control channel;
//! 3. workers take claims under a lease, fetch the version the claim names, generate,
//!    score, publish the group, and only then complete the claim; a worker that dies
//!    leaves its claims to expire and go to another worker;
//! 4. the trainer accumulates groups in arrival order, counting each (period, prompt)
//!    once; when all are in it steps, writes a checkpoint (weights, optimiser, data
//!    cursor, next period) and only then acknowledges the period's groups. A trainer
//!    killed mid-period restarts from that checkpoint, and the groups it had received
//!    but not acknowledged are delivered again: nothing acknowledged is lost and
//!    nothing is trained twice.
//!
//! What can never be trained is rejected instead of retried forever: a group that is
//! not one of the period's prompts, was sampled with other weights, or does not pack
//! is terminated, kept on the run's dead-letter stream with the reason, counted
//! (`rejected` in `metrics.jsonl`) and logged, and the period goes on; a prompt the
//! engine cannot generate from comes back as a rejected group (empty responses), and
//! so does a claim that every worker taking it failed on (more than
//! `transport.claims.max_deliveries` deliveries; a claim delivered again is
//! generated alone, so one bad prompt fails only itself). A worker whose batches fail
//! again and again leaves, for its supervisor to restart.
//!
//! Determinism (per-sample seeds from run seed, version, prompt and sample index)
//! makes a regenerated group identical, so the final weights equal the single-process
//! `periodic` run's.

mod trainer;
mod worker;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use metronome_transport::nats::{NatsConfig, NatsTransport};

use crate::config::{PipelineConfig, TransportConfig};
use crate::error::{Error, Result};

pub use trainer::run_trainer;
pub use worker::run_worker;

pub use crate::events::WorkerOutcome;

pub use crate::metrics::CLUSTER_METRICS;

/// The NATS settings of a config that selects `transport.kind = "nats"`, with every
/// stream, subject, consumer and bucket name it leaves unset derived from the run
/// (`run.name`, unless `transport.prefix` is set), so that runs sharing a server
/// never see each other's messages.
fn nats_config(config: &PipelineConfig, role: &str) -> Result<NatsConfig> {
    let mut nats = match &config.transport {
        TransportConfig::Nats(nats) => (**nats).clone(),
        TransportConfig::InProcess => {
            return Err(Error::Config {
                key: "transport.kind".into(),
                reason: format!(
                    "is `in-process`, but `metronome {role}` talks to other processes: set it to `nats`"
                ),
            });
        }
    };
    let Some(name) = &config.run.name else {
        return Err(Error::Config {
            key: "run.name".into(),
            reason: format!(
                "must be set for `metronome {role}`: the trainer and its workers find each other's \
                 streams by it, and a restarted trainer resumes from its run directory"
            ),
        });
    };
    // A prefix or a name the config sets is the user's; what it leaves unset is
    // derived from the run's name.
    nats.prefix.get_or_insert_with(|| format!("metronome-{}", scope_name(name)));
    let nats = nats.resolved();
    Ok(nats)
}

/// The part of stream and subject names that stands for `run.name`: the name itself
/// when it is made of `[a-z0-9_]` only, else those characters of it (others as `_`)
/// and a checksum of the whole name, so that names which differ (`exp 7`, `exp-7`,
/// `Exp_7`) never share streams although NATS names allow fewer characters and
/// stream names are upper-cased. (Only a name spelled exactly like another's
/// escaped form could collide with it.)
fn scope_name(name: &str) -> String {
    if !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        return name.to_owned();
    }
    let plain: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
    // FNV-1a: stable across releases and platforms, unlike the std hasher, so that a
    // restarted trainer finds its streams again.
    let hash =
        name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    format!("{plain}_{:08x}", hash >> 32)
}

/// Connects, naming the servers in the error (wrong credentials and unreachable
/// servers fail here, within `transport.connect_timeout_ms`).
async fn connect(config: &PipelineConfig, role: &str, client_name: String) -> Result<NatsTransport> {
    let mut nats = nats_config(config, role)?;
    nats.client_name.get_or_insert(client_name);
    let urls = nats.urls.join(", ");
    NatsTransport::connect(nats).await.map_err(|e| Error::Config {
        key: "transport.urls".into(),
        reason: format!("cannot connect to NATS at {urls}: {e}"),
    })
}

/// A flag set when the process should finish its current work and leave (SIGTERM,
/// Ctrl-C, or the trainer's `Shutdown`).
#[derive(Clone, Debug, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    /// Asks to stop.
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// True once asked to stop.
    #[must_use]
    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(overrides: &[&str]) -> PipelineConfig {
        let overrides: Vec<String> = overrides.iter().map(|s| (*s).to_owned()).collect();
        PipelineConfig::embedded(&overrides).unwrap()
    }

    #[test]
    fn unset_names_are_scoped_to_the_run_and_set_ones_kept() {
        // A name set to what used to be the default is a name set: it is kept.
        let c = config(&[
            "transport.kind=nats",
            "run.name=exp_7",
            "transport.claims.stream=MINE",
            "transport.groups.stream=\"METRONOME_GROUPS\"",
        ]);
        let nats = nats_config(&c, "trainer").unwrap();
        assert_eq!(nats.groups.stream, "METRONOME_GROUPS");
        assert_eq!(nats.weights.bucket, "metronome-exp_7-weights");
        assert_eq!(nats.claims.subject, "metronome-exp_7.claims");
        assert_eq!(nats.claims.stream, "MINE");
        // A prefix the config sets is used instead of the run's name.
        let c = config(&["transport.kind=nats", "run.name=exp_7", "transport.prefix=\"team-a\""]);
        let nats = nats_config(&c, "trainer").unwrap();
        assert_eq!(
            (nats.groups.stream.as_str(), nats.claims.subject.as_str()),
            ("TEAM_A_GROUPS", "team-a.claims")
        );
    }

    #[test]
    fn run_names_that_differ_never_share_streams() {
        let names = ["exp_7", "exp 7", "exp-7", "exp.7", "Exp_7", "EXP_7", "exp_7 ", "é", "è", "_", " "];
        let mut streams = std::collections::BTreeSet::new();
        for name in names {
            let c = config(&["transport.kind=nats", &format!("run.name={name:?}")]);
            let nats = nats_config(&c, "trainer").unwrap();
            for n in [&nats.groups.stream, &nats.groups.subject, &nats.claims.stream, &nats.weights.bucket] {
                assert!(n.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b)), "{name:?}: {n}");
            }
            assert!(streams.insert(nats.groups.stream.clone()), "{name:?} shares {}", nats.groups.stream);
        }
        // Stable across releases: a restarted trainer must find its streams.
        assert_eq!(scope_name("exp 7"), "exp_7_db8c8c12");
    }

    #[tokio::test]
    async fn the_trainer_refuses_a_schedule_other_than_the_one_it_runs() {
        let out = tempfile::tempdir().unwrap();
        for schedule in ["sync", "stale:1"] {
            let c = config(&[
                "transport.kind=nats",
                "run.name=x",
                &format!("run.out_dir={:?}", out.path().display().to_string()),
                &format!("run.schedule=\"{schedule}\""),
                "trainer.loss.tis_cap=2.0",
            ]);
            let err = run_trainer(c, crate::RunOptions::default()).await.unwrap_err().to_string();
            assert!(err.contains("`run.schedule`") && err.contains(&format!("is `{schedule}`")), "{err}");
        }
        // Refused before anything is written: no run directory claims the name.
        assert!(!out.path().join("x").exists());
    }

    #[test]
    fn the_roles_need_nats_and_a_run_name() {
        let err = nats_config(&config(&["run.name=x"]), "trainer").unwrap_err().to_string();
        assert!(err.contains("transport.kind"), "{err}");
        let err = nats_config(&config(&["transport.kind=nats"]), "rollout-worker").unwrap_err().to_string();
        assert!(err.contains("run.name"), "{err}");
    }
}
