//! Every error prints each cause once: a message never repeats its source, so
//! `{:#}` (what the binary prints) shows the whole chain without duplicates.

use std::error::Error as _;
use std::io;

/// The chain of `e` printed as the binary prints it, with every link's own message.
fn printed(e: impl Into<anyhow::Error>) -> (String, Vec<String>) {
    let e = e.into();
    let links = e.chain().map(ToString::to_string).collect();
    (format!("{e:#}"), links)
}

/// `cause` appears exactly once in `{:#}`, and no link repeats the message of its source.
fn assert_printed_once(e: impl Into<anyhow::Error>, cause: &str) {
    let (text, links) = printed(e);
    assert_eq!(text.matches(cause).count(), 1, "{cause:?} in {text:?}");
    for pair in links.windows(2) {
        assert!(!pair[0].contains(&pair[1]), "{:?} repeats its source {:?}", pair[0], pair[1]);
    }
}

#[test]
fn a_stage_error_through_the_pipeline_prints_its_cause_once() {
    let tokenizer = metronome_core::Error::invalid("token 7", "is not in the vocabulary");
    let rollout = metronome_rollout::Error::Tokenizer(tokenizer);
    let generation =
        metronome_pipeline::Error::Generation { period: metronome_core::PeriodId(3), source: rollout.into() };
    assert!(generation.source().is_some(), "the chain is kept");
    assert_printed_once(generation, "is not in the vocabulary");
}

#[test]
fn file_errors_print_the_os_error_once() {
    let missing = || io::Error::new(io::ErrorKind::NotFound, "no such file");
    let data = metronome_dataloader::Error::Io { path: "prompts.jsonl".into(), source: missing() };
    assert_printed_once(metronome_core::Error::from(data), "no such file");
    let run = metronome_pipeline::Error::Io { path: "runs/a/metrics.jsonl".into(), source: missing() };
    let (text, _) = printed(run);
    assert_eq!(text, "cannot write or read `runs/a/metrics.jsonl`: no such file");
}

#[test]
fn a_nats_error_ends_the_chain_and_prints_the_clients_message() {
    let client = io::Error::new(io::ErrorKind::PermissionDenied, "authorization violation");
    let nats = metronome_transport::Error::Nats { op: "connect", error: Box::new(client) };
    // Retry loops and dead letters show it on one line, so its own message holds the cause.
    assert_eq!(nats.to_string(), "nats connect failed: authorization violation");
    assert_printed_once(metronome_core::Error::from(nats), "authorization violation");
}
