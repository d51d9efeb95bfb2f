//! The NATS transport against a real `nats-server`: crash redelivery, weights
//! across processes, a server restart mid-stream, hostile messages.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use metronome_core::{
    ErrorChain, GroupKey, GroupReceiver, GroupSender, PolicyVersion, WeightPublisher, WeightSnapshot,
    WeightSubscriber,
};
use metronome_testkit::data::{scored_group, snapshot, snapshot_of_bytes};
use metronome_transport::nats::{NatsConfig, NatsTransport, NatsWeightSubscriber};
use metronome_transport::wire::{encode_group, encode_weights};

use metronome_testkit::server::NatsServer;

/// Environment variables that turn this test binary into a helper process.
const CHILD_ROLE: &str = "METRONOME_TRANSPORT_CHILD_ROLE";
const CHILD_URL: &str = "METRONOME_TRANSPORT_CHILD_URL";
const CHILD_PREFIX: &str = "METRONOME_TRANSPORT_CHILD_PREFIX";

/// The version and width of the tiny-model-shaped snapshot sent between processes.
const TINY_VERSION: u64 = 7;
const TINY_WIDTH: usize = 300;

/// A safety net against hangs; no test depends on speed.
const PATIENCE: Duration = Duration::from_secs(60);

fn config(server: &NatsServer, prefix: &str) -> NatsConfig {
    NatsConfig::with_prefix(vec![server.url()], prefix)
}

/// A transport of `server` that redelivers a group not acknowledged within `ack_wait_ms`.
async fn redelivering(server: &NatsServer, prefix: &str, ack_wait_ms: u64) -> NatsTransport {
    let mut cfg = config(server, prefix);
    cfg.groups.ack_wait_ms = ack_wait_ms;
    NatsTransport::connect(cfg).await.unwrap()
}

async fn next(receiver: &mut dyn GroupReceiver) -> metronome_core::Delivery {
    tokio::time::timeout(PATIENCE, receiver.recv())
        .await
        .expect("no group arrived in time")
        .expect("receiving failed")
        .expect("the group stream ended")
}

/// Entry point of the helper processes: a normal test run has no role set and
/// returns at once; the tests below run this binary again with a role.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(CHILD_ROLE) else { return };
    let url = std::env::var(CHILD_URL).expect("child url");
    let prefix = std::env::var(CHILD_PREFIX).expect("child prefix");
    let config = NatsConfig::with_prefix(vec![url], &prefix);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async move {
        let t = NatsTransport::connect(config).await.expect("child connects");
        match role.as_str() {
            "publish-weights" => {
                let p = t.weight_publisher().await.unwrap();
                p.publish(Arc::new(snapshot(TINY_VERSION, TINY_WIDTH))).await.unwrap();
                println!("published");
            }
            "consume-and-hang" => {
                let mut r = t.group_receiver().await.unwrap();
                let d = next(&mut r).await;
                println!("received {} {}", d.group.group.period, d.group.group.prompt.id);
                // Hold the delivery unacknowledged until the parent kills us.
                tokio::time::sleep(Duration::from_secs(600)).await;
                drop(d);
            }
            other => panic!("unknown child role {other}"),
        }
    });
}

/// A helper process, killed when dropped so that a failing test leaves nothing behind.
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for ChildGuard {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// Runs this test binary as a helper process with `role`.
fn spawn_child(role: &str, server: &NatsServer, prefix: &str) -> ChildGuard {
    ChildGuard(
        Command::new(std::env::current_exe().expect("test binary path"))
            .args(["--exact", "nats::child_process_entry", "--nocapture", "--test-threads=1"])
            .env(CHILD_ROLE, role)
            .env(CHILD_URL, server.url())
            .env(CHILD_PREFIX, prefix)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the helper process"),
    )
}

/// Reads the child's stdout until a line containing `prefix` (libtest may print
/// the test name before it on the same line) and returns the text from `prefix` on.
fn wait_for_line(child: &mut ChildGuard, prefix: &str) -> String {
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) if line.contains(prefix) => {
                // Keep draining, so the child's later output never hits a closed pipe.
                std::thread::spawn(move || lines.for_each(drop));
                return line[line.find(prefix).unwrap_or(0)..].to_owned();
            }
            Some(Ok(_)) => {}
            _ => panic!("the helper process ended without printing {prefix:?}"),
        }
    }
}

/// A subscriber's `wait_for(min)` on a task of its own, handing the subscriber back
/// with the outcome.
fn wait_in_background(
    mut subscriber: NatsWeightSubscriber,
    min: PolicyVersion,
) -> tokio::task::JoinHandle<(NatsWeightSubscriber, metronome_core::Result<Arc<WeightSnapshot>>)> {
    tokio::spawn(async move {
        let got = subscriber.wait_for(min).await;
        (subscriber, got)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_published_by_one_process_are_fetched_bit_identically_by_another() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    let mut child = spawn_child("publish-weights", &server, "xproc");
    wait_for_line(&mut child, "published");
    assert!(child.wait().unwrap().success(), "the publishing process failed");

    let t = NatsTransport::connect(config(&server, "xproc")).await.unwrap();
    let mut subscriber = t.weight_subscriber().await.unwrap();
    let got = tokio::time::timeout(PATIENCE, subscriber.wait_for(PolicyVersion(TINY_VERSION)))
        .await
        .unwrap()
        .unwrap();
    let expected = snapshot(TINY_VERSION, TINY_WIDTH);
    assert_eq!(
        encode_weights(&got).unwrap(),
        encode_weights(&expected).unwrap(),
        "the fetched snapshot differs"
    );
    assert_eq!(subscriber.stats().messages_received, 1);
    // A second look is served from the cache, without fetching again.
    subscriber.latest().await.unwrap();
    assert_eq!(subscriber.stats().messages_received, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_before_acknowledging_gets_the_group_again_and_counts_it_once() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    // Redeliver quickly: the killed consumer never acknowledges.
    let t = redelivering(&server, "crash", 1_000).await;
    // Create the durable consumer with the short ack wait before the child uses it.
    drop(t.group_receiver().await.unwrap());
    let sender = t.group_sender().await.unwrap();
    let sent: Vec<_> = (0..3).map(|p| scored_group(1, p, 2, 4)).collect();
    for g in &sent {
        sender.send(g.clone()).await.unwrap();
    }

    let mut child = spawn_child("consume-and-hang", &server, "crash");
    let line = wait_for_line(&mut child, "received");
    assert_eq!(line, "received 1 0", "the first group goes to the first consumer");
    child.kill().unwrap();
    child.wait().unwrap();

    let mut receiver = t.group_receiver().await.unwrap();
    let mut counted = BTreeMap::<GroupKey, u32>::new();
    for _ in 0..sent.len() {
        let d = next(&mut receiver).await;
        *counted.entry(d.group.key()).or_default() += 1;
        d.acker.ack().await.unwrap();
    }
    let expected: BTreeMap<_, _> = sent.iter().map(|g| (g.key(), 1)).collect();
    assert_eq!(counted, expected, "every group must count exactly once");
    assert!(
        receiver.stats().redeliveries >= 1,
        "the killed consumer's group was not redelivered: {:?}",
        receiver.stats()
    );
    // Nothing else is pending: the next delivery is a new group, not a late duplicate.
    let sentinel = scored_group(2, 0, 2, 4);
    sender.send(sentinel.clone()).await.unwrap();
    assert_eq!(next(&mut receiver).await.group.key(), sentinel.key());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_mid_stream_loses_nothing_acknowledged_as_published() {
    let mut server = NatsServer::start(&[]).expect("start nats-server");
    let sending = NatsTransport::connect(config(&server, "restart")).await.unwrap();
    let receiving = NatsTransport::connect(config(&server, "restart")).await.unwrap();
    let mut receiver = receiving.group_receiver().await.unwrap();
    let sender = sending.group_sender().await.unwrap();

    let mut counted = BTreeMap::<GroupKey, u32>::new();
    for p in 0..10 {
        sender.send(scored_group(1, p, 2, 8)).await.unwrap();
    }
    for _ in 0..5 {
        let d = next(&mut receiver).await;
        *counted.entry(d.group.key()).or_default() += 1;
        d.acker.ack().await.unwrap();
    }

    server.restart().expect("restart nats-server");

    // Sends during and after the restart retry until the server has them.
    for p in 10..20 {
        tokio::time::timeout(PATIENCE, sender.send(scored_group(1, p, 2, 8))).await.unwrap().unwrap();
    }
    while counted.len() < 20 {
        let d = next(&mut receiver).await;
        *counted.entry(d.group.key()).or_default() += 1;
        d.acker.ack().await.unwrap();
    }
    let expected: BTreeMap<_, _> = (0..20).map(|p| (scored_group(1, p, 2, 8).key(), 1)).collect();
    assert_eq!(counted, expected, "a group was lost or counted twice across the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_messages_keep_coming_across_a_server_restart() {
    use metronome_core::{ControlMessage, PeriodId};
    use metronome_core::{ControlReceiver, ControlSender};
    let mut server = NatsServer::start(&[]).expect("start nats-server");
    let t = NatsTransport::connect(config(&server, "ctlrestart")).await.unwrap();
    let mut receiver = t.control_receiver().await.unwrap();
    let sender = t.control_sender().await.unwrap();
    let end = |p| ControlMessage::PeriodEnd { period: PeriodId(p) };
    sender.send(end(0)).await.unwrap();
    let got = tokio::time::timeout(PATIENCE, receiver.recv()).await.unwrap().unwrap();
    assert_eq!(got, Some(end(0)));

    tokio::task::block_in_place(|| server.restart()).expect("restart nats-server");
    tokio::time::timeout(PATIENCE, sender.send(end(1))).await.unwrap().unwrap();
    tokio::time::timeout(PATIENCE, sender.send(ControlMessage::Shutdown)).await.unwrap().unwrap();
    let got =
        tokio::time::timeout(PATIENCE, receiver.recv()).await.expect("no control message after the restart");
    assert_eq!(got.unwrap(), Some(end(1)));
    let got = tokio::time::timeout(PATIENCE, receiver.recv()).await.unwrap().unwrap();
    assert_eq!(got, Some(ControlMessage::Shutdown));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_oversized_and_duplicate_messages_are_rejected_and_counted() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    let t = NatsTransport::connect(config(&server, "hostile")).await.unwrap();
    let sender = t.group_sender().await.unwrap();
    let mut small = config(&server, "hostile");
    small.max_message_bytes = 4096;
    let small = NatsTransport::connect(small).await.unwrap();
    let mut receiver = small.group_receiver().await.unwrap();

    // The small receiver's sender refuses an oversized group before publishing it.
    let big = scored_group(0, 99, 8, 256);
    let err = small.group_sender().await.unwrap().send(big.clone()).await.unwrap_err();
    let err = ErrorChain(&err).to_string();
    assert!(err.contains("exceeds the limit of 4096 bytes"), "{err}");

    // Raw publications bypass the sender's checks and its message id.
    let subject = t.config().groups.subject.clone();
    let good = scored_group(0, 1, 2, 3);
    let mut truncated = encode_group(&good).unwrap();
    truncated.truncate(truncated.len() / 2);
    let mut newer = encode_group(&good).unwrap();
    newer[4] = 9;
    for payload in [
        b"not a group".to_vec(),
        truncated,
        newer,
        encode_group(&big).unwrap(),
        encode_group(&good).unwrap(),
        encode_group(&good).unwrap(),
    ] {
        let ack = t.client().clone();
        let js = async_nats::jetstream::new(ack);
        js.publish(subject.clone(), Bytes::from(payload)).await.unwrap().await.unwrap();
    }
    let marker = scored_group(0, 2, 2, 3);
    sender.send(marker.clone()).await.unwrap();

    let d = next(&mut receiver).await;
    assert_eq!(d.group, good);
    d.acker.ack().await.unwrap();
    let d = next(&mut receiver).await;
    assert_eq!(d.group.key(), marker.key(), "the duplicate of a delivered key was delivered again");
    d.acker.ack().await.unwrap();

    let stats = receiver.stats();
    let rejected: Vec<(&str, u64)> = stats.rejected.iter().map(|(k, v)| (*k, *v)).collect();
    assert_eq!(
        rejected,
        [("bad_magic", 1), ("incompatible_version", 1), ("oversized", 1), ("truncated", 1)],
        "{stats:?}"
    );
    assert_eq!(stats.duplicates, 1);
    assert_eq!(stats.messages_received, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_weight_versions_are_pruned_and_readable_by_any_object_store_client() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    let mut cfg = config(&server, "prune");
    cfg.weights.keep_versions = 2;
    // On disk and with the SHA-256 digest stock readers want (not the defaults).
    cfg.weights.storage = metronome_transport::nats::Storage::File;
    cfg.weights.object_store_digest = true;
    let t = NatsTransport::connect(cfg).await.unwrap();
    let publisher = t.weight_publisher().await.unwrap();
    for v in 1..=4 {
        publisher.publish(Arc::new(snapshot(v, 16))).await.unwrap();
    }
    let js = async_nats::jetstream::new(t.client().clone());
    let store = js.get_object_store(&t.config().weights.bucket).await.unwrap();
    let mut names = Vec::new();
    let mut list = store.list().await.unwrap();
    while let Some(info) = futures::StreamExt::next(&mut list).await {
        names.push(info.unwrap().name);
    }
    names.sort();
    assert_eq!(names, [format!("v{:020}", 3), format!("v{:020}", 4)]);
    // Any object store client reads what we stored: the stock reader checks the
    // SHA-256 digest and gets the exact encoding.
    let mut object = store.get(&names[1]).await.unwrap();
    let mut bytes = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut object, &mut bytes).await.unwrap();
    assert_eq!(bytes, encode_weights(&snapshot(4, 16)).unwrap());
    let mut subscriber = t.weight_subscriber().await.unwrap();
    assert_eq!(subscriber.latest().await.unwrap().unwrap().version, PolicyVersion(4));
}

/// A restarted trainer puts the version the dead one published again: the object
/// store purges the old chunks, maybe while a worker reads them. The read used to
/// wait for ever for chunks that were gone (holding the worker's claims: the cluster
/// kill test's hang); it gives up after the stall timeout and reads the new object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_put_again_while_read_is_read_from_the_new_object_never_waited_on_forever() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    let mut cfg = config(&server, "reput");
    cfg.weights.stall_timeout_ms = 300;
    let t = NatsTransport::connect(cfg).await.unwrap();
    let publisher = t.weight_publisher().await.unwrap();
    publisher.publish(Arc::new(snapshot(2, 16))).await.unwrap();
    // The chunks the announcement's object names go away, as the new put purges them.
    let js = async_nats::jetstream::new(t.client().clone());
    let bucket = t.config().weights.bucket.clone();
    let store = js.get_object_store(&bucket).await.unwrap();
    let info = store.info(format!("v{:020}", 2)).await.unwrap();
    let stream = js.get_stream(format!("OBJ_{bucket}")).await.unwrap();
    stream.purge().filter(format!("$O.{bucket}.C.{}", info.nuid)).await.unwrap();
    // ... and the new put lands a little later.
    let again = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        publisher.publish(Arc::new(snapshot(2, 16))).await.unwrap();
    });
    let mut subscriber = t.weight_subscriber().await.unwrap();
    let got = tokio::time::timeout(PATIENCE, subscriber.latest())
        .await
        .expect("a read waited for chunks that are gone");
    assert_eq!(got.unwrap().unwrap().version, PolicyVersion(2));
    again.await.unwrap();
}

/// Processes that start together create the streams and the weight bucket together:
/// every one of them gets its publisher, sender and receiver (workers of a cluster test
/// failed with the server's "subjects overlap with an existing stream" when they lost
/// that race, for the control stream and for the weight bucket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transports_creating_the_streams_at_once_all_succeed() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    for round in 0..3 {
        let prefix = format!("race{round}");
        // Half with a smaller message limit, as processes of one cluster may have: the
        // streams they ask for differ in it.
        let connecting = (0..8).map(|i| {
            let mut c = config(&server, &prefix);
            if i % 2 == 1 {
                c.max_message_bytes = 1 << 20;
            }
            NatsTransport::connect(c)
        });
        let transports: Vec<NatsTransport> =
            futures::future::join_all(connecting).await.into_iter().map(|t| t.expect("connects")).collect();
        let made = futures::future::join_all(transports.iter().map(|t| async move {
            t.weight_publisher().await.map(drop)?;
            t.control_sender().await.map(drop)?;
            t.control_receiver().await.map(drop)
        }))
        .await;
        for (i, m) in made.into_iter().enumerate() {
            m.unwrap_or_else(|e| panic!("round {round}, transport {i}: {e}"));
        }
    }
}

#[tokio::test]
async fn connecting_to_nothing_is_a_clear_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut cfg = NatsConfig::with_prefix(vec![format!("nats://127.0.0.1:{port}")], "none");
    cfg.connect_timeout_ms = 500;
    let err = NatsTransport::connect(cfg).await.unwrap_err();
    assert!(err.to_string().starts_with("nats connect failed"), "{err}");
    let err = NatsTransport::connect(NatsConfig { urls: vec![], ..NatsConfig::default() }).await.unwrap_err();
    assert!(err.to_string().contains("urls"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_many_chunks_round_trips() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    let mut cfg = config(&server, "chunks");
    // Small chunks, so that the pipelined upload and the streaming decode see many.
    cfg.weights.chunk_bytes = 64 * 1024;
    let t = NatsTransport::connect(cfg).await.unwrap();
    let publisher = t.weight_publisher().await.unwrap();
    let mut subscriber = t.weight_subscriber().await.unwrap();
    // Several versions, so that pruning runs between fetches.
    for v in 1..=4 {
        let s = Arc::new(snapshot_of_bytes(v, 6 << 20));
        tokio::time::timeout(PATIENCE, publisher.publish(Arc::clone(&s))).await.unwrap().unwrap();
        let got = tokio::time::timeout(PATIENCE, subscriber.latest()).await.unwrap().unwrap().unwrap();
        assert_eq!(encode_weights(&got).unwrap(), encode_weights(&s).unwrap());
    }
}

fn first_data_ptr(s: &metronome_core::WeightSnapshot) -> usize {
    match &s.tensors[0].data {
        metronome_core::TensorData::F32(v) => v.as_ptr() as usize,
        metronome_core::TensorData::Bf16(v) | metronome_core::TensorData::F16(v) => v.as_ptr() as usize,
        metronome_core::TensorData::Resident(_) => panic!("a decoded snapshot is in host memory"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_in_memory_without_the_sha_digest_round_trip_and_reuse_dropped_buffers() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    // The default store: memory, no SHA-256 digest.
    let mut cfg = config(&server, "fastweights");
    cfg.weights.keep_versions = 1;
    cfg.weights.chunk_bytes = 64 * 1024;
    let t = NatsTransport::connect(cfg).await.unwrap();
    let publisher = t.weight_publisher().await.unwrap();
    let mut subscriber = t.weight_subscriber().await.unwrap();

    tokio::time::timeout(PATIENCE, publisher.publish(Arc::new(snapshot(1, 300)))).await.unwrap().unwrap();
    let first = tokio::time::timeout(PATIENCE, subscriber.latest()).await.unwrap().unwrap().unwrap();
    assert_eq!(encode_weights(&first).unwrap(), encode_weights(&snapshot(1, 300)).unwrap());
    // Still held by the caller: the next fetch must not write into it.
    tokio::time::timeout(PATIENCE, publisher.publish(Arc::new(snapshot(2, 300)))).await.unwrap().unwrap();
    let second = tokio::time::timeout(PATIENCE, subscriber.latest()).await.unwrap().unwrap().unwrap();
    assert_eq!(encode_weights(&first).unwrap(), encode_weights(&snapshot(1, 300)).unwrap());
    assert_eq!(encode_weights(&second).unwrap(), encode_weights(&snapshot(2, 300)).unwrap());
    assert_ne!(first_data_ptr(&first), first_data_ptr(&second));
    // Dropped by the caller: the next version is decoded into its buffers.
    let reusable = first_data_ptr(&second);
    drop((first, second));
    tokio::time::timeout(PATIENCE, publisher.publish(Arc::new(snapshot(3, 300)))).await.unwrap().unwrap();
    let third = tokio::time::timeout(PATIENCE, subscriber.latest()).await.unwrap().unwrap().unwrap();
    assert_eq!(encode_weights(&third).unwrap(), encode_weights(&snapshot(3, 300)).unwrap());
    assert_eq!(first_data_ptr(&third), reusable);

    // The bucket lives in memory, keeps one version, and records no digest.
    let js = async_nats::jetstream::new(t.client().clone());
    let mut stream = js.get_stream(format!("OBJ_{}", t.config().weights.bucket)).await.unwrap();
    let storage = stream.info().await.unwrap().config.storage;
    assert_eq!(storage, async_nats::jetstream::stream::StorageType::Memory);
    let store = js.get_object_store(&t.config().weights.bucket).await.unwrap();
    let mut names = Vec::new();
    let mut list = store.list().await.unwrap();
    while let Some(info) = tokio::time::timeout(PATIENCE, futures::StreamExt::next(&mut list)).await.unwrap()
    {
        let info = info.unwrap();
        assert_eq!(info.digest, None);
        names.push(info.name);
    }
    assert_eq!(names, [format!("v{:020}", 3)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_kept_in_memory_outlive_server_restarts_before_and_during_an_upload() {
    let mut server = NatsServer::start(&[]).expect("start nats-server");
    let t = NatsTransport::connect(config(&server, "wrestart")).await.unwrap();
    let publisher = t.weight_publisher().await.unwrap();
    let first = Arc::new(snapshot(1, 300));
    publisher.publish(Arc::clone(&first)).await.unwrap();

    // The server comes back without the weights it held in memory; the publisher
    // uploads them again, so a worker that joins now still gets version 1.
    tokio::task::block_in_place(|| server.restart()).expect("restart nats-server");
    let joining = NatsTransport::connect(config(&server, "wrestart")).await.unwrap();
    let mut subscriber = joining.weight_subscriber().await.unwrap();
    let got = tokio::time::timeout(PATIENCE, subscriber.wait_for(PolicyVersion(1))).await.unwrap().unwrap();
    assert_eq!(encode_weights(&got).unwrap(), encode_weights(&first).unwrap());

    // A restart while a version uploads: the publication starts again and completes.
    let begins = format!("{}.begins", t.config().weights.announce_subject);
    let mut begins = t.client().subscribe(begins).await.unwrap();
    let second = Arc::new(snapshot_of_bytes(2, 32 << 20));
    let publishing = {
        let second = Arc::clone(&second);
        tokio::spawn(async move {
            publisher.publish(second).await.unwrap();
            publisher
        })
    };
    tokio::time::timeout(PATIENCE, futures::StreamExt::next(&mut begins)).await.unwrap().unwrap();
    tokio::task::block_in_place(|| server.restart()).expect("restart nats-server");
    let publisher = tokio::time::timeout(PATIENCE, publishing).await.unwrap().unwrap();
    let got = tokio::time::timeout(PATIENCE, subscriber.wait_for(PolicyVersion(2))).await.unwrap().unwrap();
    assert_eq!(encode_weights(&got).unwrap(), encode_weights(&second).unwrap());
    // Version 1 twice (the second time restored), then version 2.
    assert_eq!(publisher.stats().messages_sent, 3, "{:?}", publisher.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_fetch_cut_by_a_server_restart_gets_the_version_uploaded_again() {
    let mut server = NatsServer::start(&[]).expect("start nats-server");
    let mut cfg = streaming_config(&server, "streamrestart");
    cfg.weights.stall_timeout_ms = 5_000;
    let t = NatsTransport::connect(cfg.clone()).await.unwrap();
    let publisher = t.weight_publisher().await.unwrap();
    let mut subscriber = NatsTransport::connect(cfg).await.unwrap().weight_subscriber().await.unwrap();
    publisher.publish(Arc::new(snapshot(1, 300))).await.unwrap();
    assert_eq!(subscriber.latest().await.unwrap().unwrap().version, PolicyVersion(1));

    let waiter = wait_in_background(subscriber, PolicyVersion(2));
    tokio::time::sleep(SETTLE).await;
    let begins = format!("{}.begins", t.config().weights.announce_subject);
    let mut begins = t.client().subscribe(begins).await.unwrap();
    let second = Arc::new(snapshot_of_bytes(2, 32 << 20));
    let publishing = {
        let second = Arc::clone(&second);
        tokio::spawn(async move { publisher.publish(second).await.unwrap() })
    };
    // The subscriber streams from here on; the server dies under it.
    tokio::time::timeout(PATIENCE, futures::StreamExt::next(&mut begins)).await.unwrap().unwrap();
    tokio::task::block_in_place(|| server.restart()).expect("restart nats-server");
    tokio::time::timeout(PATIENCE, publishing).await.unwrap().unwrap();
    let (_, got) = tokio::time::timeout(PATIENCE, waiter).await.unwrap().unwrap();
    let got = got.expect("the restart ended the wait with an error");
    assert_eq!(encode_weights(&got).unwrap(), encode_weights(&second).unwrap());
}

/// A subscriber that subscribed before the publication starts has had time to
/// register with the server after this long; only which path it takes depends on it.
const SETTLE: Duration = Duration::from_secs(1);

fn streaming_config(server: &NatsServer, prefix: &str) -> NatsConfig {
    let mut cfg = config(server, prefix);
    cfg.weights.chunk_bytes = 64 * 1024;
    cfg.weights.stall_timeout_ms = 500;
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_subscriber_streams_a_version_while_it_uploads_bit_identically() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    let cfg = streaming_config(&server, "streamed");
    let publisher = NatsTransport::connect(cfg.clone()).await.unwrap().weight_publisher().await.unwrap();
    let mut subscriber = NatsTransport::connect(cfg).await.unwrap().weight_subscriber().await.unwrap();
    let v1 = Arc::new(snapshot_of_bytes(1, 1 << 20));
    publisher.publish(Arc::clone(&v1)).await.unwrap();
    assert_eq!(subscriber.latest().await.unwrap().unwrap().version, PolicyVersion(1));

    let waiter = wait_in_background(subscriber, PolicyVersion(2));
    tokio::time::sleep(SETTLE).await;
    let v2 = Arc::new(snapshot_of_bytes(2, 8 << 20));
    tokio::time::timeout(PATIENCE, publisher.publish(Arc::clone(&v2))).await.unwrap().unwrap();
    let (mut subscriber, got) = tokio::time::timeout(PATIENCE, waiter).await.unwrap().unwrap();
    let got = got.unwrap();
    assert_eq!(encode_weights(&got).unwrap(), encode_weights(&v2).unwrap());
    assert_eq!(subscriber.streamed_fetches(), 1, "the version was not streamed");
    // The complete object is also there for every other reader.
    let again = subscriber.latest().await.unwrap().unwrap();
    assert!(Arc::ptr_eq(&again, &got), "the streamed version is the cached one");
    let late = NatsTransport::connect(streaming_config(&server, "streamed")).await.unwrap();
    let mut late = late.weight_subscriber().await.unwrap();
    let fetched = late.wait_for(PolicyVersion(2)).await.unwrap();
    assert_eq!(encode_weights(&fetched).unwrap(), encode_weights(&v2).unwrap());
    assert_eq!(late.streamed_fetches(), 0, "a late subscriber reads the complete object");
}

/// Uploads by hand the first `chunks_sent` chunks of version 2 (1 MiB, 64 KiB
/// chunks); returns its begins announcement's subject and payload, which carries
/// the format's checksum plus `checksum_offset`.
async fn handmade_upload(t: &NatsTransport, checksum_offset: u64, chunks_sent: usize) -> (String, Bytes) {
    let bucket = t.config().weights.bucket.clone();
    let encoded = encode_weights(&snapshot_of_bytes(2, 1 << 20)).unwrap();
    let chunks: Vec<&[u8]> = encoded.chunks(64 * 1024).collect();
    let nuid = format!("handmade{checksum_offset}");
    let js = async_nats::jetstream::new(t.client().clone());
    for c in chunks.iter().take(chunks_sent) {
        let subject = format!("$O.{bucket}.C.{nuid}");
        js.publish(subject, Bytes::copy_from_slice(c)).await.unwrap().await.unwrap();
    }
    let checksum = u64::from_le_bytes(encoded[16..24].try_into().unwrap()).wrapping_add(checksum_offset);
    let begins = serde_json::json!({
        "format": 1, "version": 2, "object": format!("v{:020}", 2), "bucket": bucket, "nuid": nuid,
        "bytes": encoded.len(), "chunks": chunks.len(), "checksum": checksum,
    });
    let subject = format!("{}.begins", t.config().weights.announce_subject);
    (subject, Bytes::from(serde_json::to_vec(&begins).unwrap()))
}

/// Publishes by hand what a publisher that died mid-upload leaves behind: a begins
/// announcement and the first chunks of version 2, again every 100 ms (so the
/// waiting subscriber cannot miss it), until `waiter` ends.
async fn half_upload<T>(
    t: &NatsTransport,
    checksum_offset: u64,
    chunks_sent: usize,
    waiter: tokio::task::JoinHandle<T>,
) -> T {
    let (subject, payload) = handmade_upload(t, checksum_offset, chunks_sent).await;
    tokio::time::timeout(PATIENCE, async {
        let mut waiter = waiter;
        loop {
            t.client().publish(subject.clone(), payload.clone()).await.unwrap();
            tokio::select! {
                out = &mut waiter => return out.unwrap(),
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    })
    .await
    .expect("the subscriber hung on a dead upload")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_starts_waiting_after_an_upload_began_streams_it() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    let t = NatsTransport::connect(streaming_config(&server, "lateb")).await.unwrap();
    t.weight_publisher().await.unwrap().publish(Arc::new(snapshot(1, 300))).await.unwrap();
    // What a publisher sends before the version is complete: the begins
    // announcement (once, before anyone waits) and the chunks; no announcement of
    // the complete object follows, so only streaming can return version 2.
    let (subject, payload) = handmade_upload(&t, 0, usize::MAX).await;
    let js = async_nats::jetstream::new(t.client().clone());
    js.publish(subject, payload).await.unwrap().await.unwrap();

    let mut subscriber = t.weight_subscriber().await.unwrap();
    let got = tokio::time::timeout(PATIENCE, subscriber.wait_for(PolicyVersion(2)))
        .await
        .expect("the upload that began before the wait was not seen")
        .unwrap();
    let expected = snapshot_of_bytes(2, 1 << 20);
    assert_eq!(encode_weights(&got).unwrap(), encode_weights(&expected).unwrap());
    assert_eq!(subscriber.streamed_fetches(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_or_mismatched_upload_is_a_clear_error_and_the_previous_version_stays() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    let t = NatsTransport::connect(streaming_config(&server, "stall")).await.unwrap();
    let v1 = Arc::new(snapshot(1, 300));
    t.weight_publisher().await.unwrap().publish(Arc::clone(&v1)).await.unwrap();

    // Stalled: 3 of 16 chunks, then nothing.
    let subscriber = t.weight_subscriber().await.unwrap();
    let waiter = wait_in_background(subscriber, PolicyVersion(2));
    let (mut subscriber, got) = half_upload(&t, 0, 3, waiter).await;
    let err = ErrorChain(&got.unwrap_err()).to_string();
    assert!(err.contains("stalled") && err.contains("500 ms"), "{err}");
    let previous = subscriber.latest().await.unwrap().unwrap();
    assert_eq!(encode_weights(&previous).unwrap(), encode_weights(&v1).unwrap());
    assert_eq!(subscriber.stats().rejected.get("stalled"), Some(&1));

    // Every chunk, but not the checksum the begins announcement promised.
    let waiter = wait_in_background(subscriber, PolicyVersion(2));
    let (mut subscriber, got) = half_upload(&t, 1, 16, waiter).await;
    let err = ErrorChain(&got.unwrap_err()).to_string();
    assert!(err.contains("checksum"), "{err}");
    assert_eq!(subscriber.latest().await.unwrap().unwrap().version, PolicyVersion(1));
    assert_eq!(subscriber.streamed_fetches(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_aborted_mid_upload_leaves_an_error_or_a_whole_snapshot_never_a_hang() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    let cfg = streaming_config(&server, "aborted");
    let publisher = NatsTransport::connect(cfg.clone()).await.unwrap();
    let publisher = Arc::new(publisher.weight_publisher().await.unwrap());
    let t = NatsTransport::connect(cfg).await.unwrap();
    let mut subscriber = t.weight_subscriber().await.unwrap();
    let v1 = Arc::new(snapshot(1, 300));
    publisher.publish(Arc::clone(&v1)).await.unwrap();
    assert_eq!(subscriber.latest().await.unwrap().unwrap().version, PolicyVersion(1));

    let waiter = wait_in_background(subscriber, PolicyVersion(2));
    tokio::time::sleep(SETTLE).await;
    let js = async_nats::jetstream::new(t.client().clone());
    let mut objects = js.get_stream(format!("OBJ_{}", t.config().weights.bucket)).await.unwrap();
    let before = objects.info().await.unwrap().state.messages;
    let v2 = Arc::new(snapshot_of_bytes(2, 48 << 20));
    let upload = tokio::spawn({
        let (publisher, v2) = (Arc::clone(&publisher), Arc::clone(&v2));
        async move { publisher.publish(v2).await }
    });
    // Abort once a few chunks are stored (or the upload already ended).
    tokio::time::timeout(PATIENCE, async {
        while !upload.is_finished() && objects.info().await.unwrap().state.messages < before + 4 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .unwrap();
    upload.abort();
    let (mut subscriber, got) = tokio::time::timeout(PATIENCE, waiter).await.expect("hung").unwrap();
    let whole = encode_weights(&v2).unwrap();
    match got {
        Ok(s) => assert_eq!(encode_weights(&s).unwrap(), whole, "a partial snapshot"),
        Err(e) => assert!(ErrorChain(&e).to_string().contains("stalled"), "{e:?}"),
    }
    let now = subscriber.latest().await.unwrap().unwrap();
    let now = encode_weights(&now).unwrap();
    assert!(
        now == whole || now == encode_weights(&v1).unwrap(),
        "neither the previous nor the whole snapshot"
    );

    // The next publication purges the chunks the aborted one left behind: only the
    // objects in the store keep chunks (version 3, and 2 if it was completed; version
    // 1 falls out of `keep_versions` = 2).
    let v3 = Arc::new(snapshot(3, 300));
    publisher.publish(Arc::clone(&v3)).await.unwrap();
    let bucket = t.config().weights.bucket.clone();
    let mut subjects = objects.info_with_subjects(format!("$O.{bucket}.C.>")).await.unwrap();
    let mut chunk_subjects = 0;
    while let Some(entry) = futures::StreamExt::next(&mut subjects).await {
        entry.unwrap();
        chunk_subjects += 1;
    }
    let expected = if now == whole { 2 } else { 1 };
    assert_eq!(chunk_subjects, expected, "chunks of the aborted upload were left behind");
    let newest = subscriber.latest().await.unwrap().unwrap();
    assert_eq!(encode_weights(&newest).unwrap(), encode_weights(&v3).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_pulls_cut_by_server_restarts_come_back_and_every_claim_is_taken() {
    use std::collections::BTreeSet;

    use metronome_core::{PeriodId, Prompt, PromptId};
    // Workers take claims in a loop, as here, while the server restarts in the
    // middle of a period's claims: every claim is still taken. (A pull the dead
    // server never answered used to hang a worker for good; the cluster test's
    // server restart shows it, this interleaving rarely does.)
    let mut server = NatsServer::start(&[]).expect("start nats-server");
    let mut cfg = config(&server, "claimrestart");
    cfg.claims.lease_ms = 1_000;
    let t = NatsTransport::connect(cfg).await.unwrap();
    let offerer = t.claim_offerer().await.unwrap();
    let taker = t.claim_taker().await.unwrap();
    let (taken_tx, mut taken) = tokio::sync::mpsc::unbounded_channel();
    let worker = tokio::spawn(async move {
        loop {
            // Errors while the server is away are retried, as the worker does.
            if let Ok(claims) = taker.take(4, Duration::from_millis(200)).await {
                for c in claims {
                    let _ = taken_tx.send((c.period.0, c.prompt.id.0));
                    if c.complete().await.is_err() {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        }
    });
    for round in 0..3u64 {
        let prompts: Vec<Prompt> = (0..60)
            .map(|i| Prompt { id: PromptId(i), text: format!("{i}+1="), ..Prompt::default() })
            .collect();
        tokio::time::timeout(PATIENCE, offerer.offer(PeriodId(round), PolicyVersion(round), &prompts))
            .await
            .unwrap()
            .unwrap();
        // Restart at a different point of the period's claims each time.
        tokio::time::sleep(Duration::from_millis(5 + 11 * round)).await;
        tokio::task::block_in_place(|| server.restart()).expect("restart nats-server");
        let mut ids = BTreeSet::new();
        while ids.len() < prompts.len() {
            let (period, id) = tokio::time::timeout(PATIENCE, taken.recv())
                .await
                .unwrap_or_else(|_| panic!("round {round}: {} of 60 claims taken, then none", ids.len()))
                .unwrap();
            if period == round {
                ids.insert(id);
            }
        }
    }
    worker.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_period_larger_than_the_servers_default_ack_cap_arrives_whole() {
    // A trainer holds a whole period unacknowledged until its checkpoint. An earlier
    // run left the consumer at the server's default cap (1000 pending): this run's
    // setting replaces it, and 1100 held deliveries all arrive.
    let server = NatsServer::start(&[]).expect("start nats-server");
    let mut earlier = config(&server, "bigperiod");
    earlier.groups.max_ack_pending = 1000;
    drop(NatsTransport::connect(earlier.clone()).await.unwrap().group_receiver().await.unwrap());
    let mut now = earlier;
    now.groups.max_ack_pending = 2000;
    let t = NatsTransport::connect(now).await.unwrap();
    let mut receiver = t.group_receiver().await.unwrap();
    let sender = t.group_sender().await.unwrap();
    for p in 0..1100 {
        sender.send(scored_group(0, p, 1, 2)).await.unwrap();
    }
    let mut held = Vec::with_capacity(1100);
    while held.len() < 1100 {
        let d = tokio::time::timeout(Duration::from_secs(20), receiver.recv())
            .await
            .unwrap_or_else(|_| panic!("delivery stopped after {} unacknowledged groups", held.len()))
            .unwrap()
            .unwrap();
        held.push(d);
    }
    for d in held {
        d.acker.ack().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_left_with_other_settings_are_updated_or_named_in_a_clear_error() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    // An earlier run with a smaller stream: updated to this run's limit.
    let mut earlier = config(&server, "leftover");
    earlier.groups.max_pending = 10;
    NatsTransport::connect(earlier.clone()).await.unwrap().group_sender().await.unwrap();
    let t = NatsTransport::connect(config(&server, "leftover")).await.unwrap();
    t.group_sender().await.expect("a larger limit is an update");
    let stream = t.client().clone();
    let info =
        async_nats::jetstream::new(stream).get_stream("LEFTOVER_GROUPS").await.unwrap().cached_info().clone();
    assert_eq!(info.config.max_messages, 4096);
    // One the server cannot change in place (storage): a clear error, not a hang.
    let mut memory = config(&server, "leftover");
    memory.groups.storage = metronome_transport::nats::Storage::Memory;
    let err = NatsTransport::connect(memory).await.unwrap().group_sender().await.unwrap_err().to_string();
    assert!(
        err.contains("`LEFTOVER_GROUPS`")
            && err.contains("storage: File -> Memory")
            && err.contains("another name"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_group_is_kept_as_a_dead_letter_and_never_delivered_again() {
    let server = NatsServer::start(&[]).expect("start nats-server");
    let t = redelivering(&server, "poison", 300).await;
    let mut receiver = t.group_receiver().await.unwrap();
    let sender = t.group_sender().await.unwrap();
    sender.send(scored_group(3, 1, 2, 4)).await.unwrap();
    // Undecodable bytes are rejected by the receiver itself.
    let js = async_nats::jetstream::new(t.client().clone());
    js.publish(t.config().groups.subject.clone(), Bytes::from_static(b"junk")).await.unwrap().await.unwrap();
    sender.send(scored_group(3, 2, 2, 4)).await.unwrap();

    let d = next(&mut receiver).await;
    assert_eq!(d.group.key(), scored_group(3, 1, 2, 4).key());
    d.acker.reject("it names weights version 9, the period's are 3").await.unwrap();
    // Well past the acknowledgement wait: the rejected group is not delivered again.
    let d = next(&mut receiver).await;
    assert_eq!(d.group.key(), scored_group(3, 2, 2, 4).key());
    d.acker.ack().await.unwrap();
    let again = tokio::time::timeout(Duration::from_millis(1500), receiver.recv()).await;
    assert!(
        again.is_err(),
        "a rejected group came back: {:?}",
        again.map(|d| d.map(|d| d.map(|d| d.group.key())))
    );

    // Both are on the dead-letter stream, with what was wrong.
    let dead = js.get_stream("POISON_DEAD").await.unwrap();
    let mut reasons = Vec::new();
    for seq in 1..=2 {
        let m = dead.get_raw_message(seq).await.unwrap();
        assert_eq!(m.subject.as_str(), "poison.dead.group");
        let reason = m.headers.get("Metronome-Reason").map(|v| v.to_string()).unwrap_or_default();
        reasons.push(reason);
    }
    reasons.sort();
    assert!(reasons[0].contains("bad_magic") || reasons[0].contains("magic"), "{reasons:?}");
    assert_eq!(reasons[1], "it names weights version 9, the period's are 3");
}
