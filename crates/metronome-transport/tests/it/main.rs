//! Integration tests of metronome-transport: the wire formats against hostile input,
//! the conformance suite run by both transports, and the NATS transport against a
//! real `nats-server` (started on a free loopback port by `metronome_testkit::server::NatsServer`).

mod codec;
#[cfg(any(feature = "local", feature = "nats"))]
mod conformance;
#[cfg(feature = "local")]
mod local;
#[cfg(feature = "nats")]
mod nats;
