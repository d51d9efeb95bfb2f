//! Publish policy weights to NATS JetStream and fetch them back, as a trainer and a
//! rollout worker in different processes would.
//!
//! ```text
//! cargo run -p metronome-transport --example nats_weights [-- --url nats://127.0.0.1:4222]
//! ```
//! Without `--url` the example starts its own `nats-server` (JetStream on, storage in a
//! temporary directory) on a free loopback port and stops it at the end. The server is
//! the Debian package `nats-server`; `NATS_SERVER_BIN` may name another binary.

use std::sync::Arc;

use anyhow::Context;
use metronome_core::{
    HostTensor, PolicyVersion, TensorData, WeightPublisher, WeightSnapshot, WeightSubscriber,
};
use metronome_testkit::server::NatsServer;
use metronome_transport::nats::{NatsConfig, NatsTransport};

/// Weights as the trainer's `snapshot()` returns them: named host tensors.
fn snapshot(version: u64) -> WeightSnapshot {
    let tensor = |name: &str, shape: Vec<usize>| {
        let n = shape.iter().product::<usize>();
        let data = (0..n).map(|i| (i as f32 * 0.01 + version as f32).sin()).collect();
        HostTensor { name: name.into(), shape, data: TensorData::F32(data) }
    };
    WeightSnapshot {
        version: PolicyVersion(version),
        tensors: vec![
            tensor("model.embed_tokens.weight", vec![99, 128]),
            tensor("model.layers.0.mlp.up_proj.weight", vec![344, 128]),
            tensor("model.norm.weight", vec![128]),
        ],
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let url = args.iter().position(|a| a == "--url").and_then(|i| args.get(i + 1)).cloned();
    // `server::NatsServer` is the crate's helper for tests and examples: a real
    // `nats-server` on a free loopback port, stopped when dropped.
    let (_server, url) = match url {
        Some(url) => (None, url),
        None => {
            let server = NatsServer::start(&[]).context("pass --url to use a running server")?;
            let url = server.url();
            (Some(server), url)
        }
    };
    println!("NATS at {url}");

    // Every stream and bucket name gets a prefix, so runs can share one server.
    let config = NatsConfig::with_prefix(vec![url], &format!("example-{}", std::process::id()));
    // The trainer side and the rollout side would each connect from their own process.
    let trainer_side = NatsTransport::connect(config.clone()).await?;
    let rollout_side = NatsTransport::connect(config).await?;
    let publisher = trainer_side.weight_publisher().await?;
    let mut subscriber = rollout_side.weight_subscriber().await?;

    for version in 0..3 {
        let weights = Arc::new(snapshot(version));
        // Weights go to the JetStream object store by version and are announced.
        publisher.publish(weights.clone()).await?;
        // A rollout worker waits for at least the version its period needs.
        let got = subscriber.wait_for(PolicyVersion(version)).await?;
        println!(
            "published and fetched v{}: {} tensors, {} bytes, identical: {}",
            got.version,
            got.tensors.len(),
            got.num_bytes(),
            *got == *weights
        );
        anyhow::ensure!(*got == *weights, "the fetched weights differ from the published ones");
    }
    // A late subscriber sees only the newest version: weights are state, not a log.
    let newest = rollout_side.weight_subscriber().await?.latest().await?.context("no weights published")?;
    println!("newest version seen by a new subscriber: v{}", newest.version);
    Ok(())
}
