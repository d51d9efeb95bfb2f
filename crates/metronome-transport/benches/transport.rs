//! Throughput of the transports, measured side by side on loopback:
//!
//! - `weights_100mb/*`: one 100 MB snapshot published and fetched over NATS (file and
//!   memory storage), beside a plain TCP transfer of the same encoded bytes (the
//!   path's limit), the encode+decode pair alone, and a memory copy;
//! - `groups/*`: small groups (G = 4, 32 tokens) sent, received and acknowledged, in
//!   process and over NATS.
//!
//! Starts its own `nats-server` (`metronome_transport::server`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use metronome_core::{GroupReceiver, GroupSender, WeightPublisher, WeightSubscriber};
use metronome_transport::nats::{NatsConfig, NatsTransport, Storage};
use metronome_transport::server;
use metronome_transport::testdata::{scored_group, snapshot_of_bytes};
use metronome_transport::wire::{WeightsDecoder, decode_weights, encode_weights, encode_weights_chunks};

const SNAPSHOT_BYTES: usize = 100 << 20;
const GROUPS: u64 = 500;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime")
}

fn tcp_transfer(bytes: &[u8]) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let len = bytes.len();
    let start = Instant::now();
    let reader = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let mut out = Vec::with_capacity(len);
        stream.read_to_end(&mut out).expect("read");
        assert_eq!(out.len(), len);
    });
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.write_all(bytes).expect("write");
    drop(stream);
    reader.join().expect("reader");
    start.elapsed()
}

fn weights(c: &mut Criterion) {
    let snapshot = Arc::new(snapshot_of_bytes(0, SNAPSHOT_BYTES));
    let encoded = encode_weights(&snapshot).expect("encode");
    let mut group = c.benchmark_group("weights_100mb");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(20))
        .throughput(Throughput::Bytes(encoded.len() as u64));

    group.bench_function("memcpy", |b| b.iter(|| std::hint::black_box(encoded.to_vec())));
    group.bench_function("encode_decode", |b| {
        b.iter(|| decode_weights(&encode_weights(&snapshot).expect("encode")).expect("decode"));
    });
    group.bench_function("encode_chunks_stream_decode", |b| {
        b.iter(|| {
            let chunks = encode_weights_chunks(&snapshot, 1 << 20).expect("encode");
            let mut decoder = WeightsDecoder::new(encoded.len() as u64);
            for c in &chunks {
                decoder.push(c).expect("decode");
            }
            decoder.finish().expect("decode")
        });
    });
    group.bench_function("tcp_loopback", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| tcp_transfer(&encoded)).sum())
    });

    let rt = runtime();
    let server = server::NatsServer::start(&[]).expect("start nats-server");
    for storage in [Storage::File, Storage::Memory] {
        let name = format!("nats_publish_fetch_{storage:?}").to_lowercase();
        let mut config = NatsConfig::with_prefix(vec![server.url()], &name);
        config.weights.storage = storage;
        let (publisher, mut subscriber) = rt.block_on(async {
            let t = NatsTransport::connect(config).await.expect("connect");
            (t.weight_publisher().await.expect("publisher"), t.weight_subscriber().await.expect("subscriber"))
        });
        let version = AtomicU64::new(0);
        group.bench_function(&name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let v = version.fetch_add(1, Ordering::Relaxed) + 1;
                        let mut s = (*snapshot).clone();
                        s.version = metronome_core::PolicyVersion(v);
                        let s = Arc::new(s);
                        let start = Instant::now();
                        publisher.publish(s).await.expect("publish");
                        let got = subscriber.latest().await.expect("fetch").expect("a snapshot");
                        total += start.elapsed();
                        assert_eq!(got.version.0, v);
                    }
                    total
                })
            });
        });
    }
    group.finish();
}

fn groups(c: &mut Criterion) {
    let batch: Vec<_> = (0..GROUPS).map(|p| scored_group(0, p, 4, 32)).collect();
    let mut group = c.benchmark_group("groups");
    group.sample_size(10).throughput(Throughput::Elements(GROUPS));
    let rt = runtime();
    let period = AtomicU64::new(0);

    group.bench_function("local", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let (sender, mut receiver) = metronome_transport::local::group_channel(64);
                    let batch = batch.clone();
                    let send = tokio::spawn(async move {
                        for g in batch {
                            sender.send(g).await.expect("send");
                        }
                    });
                    for _ in 0..GROUPS {
                        let d = receiver.recv().await.expect("recv").expect("a group");
                        d.acker.ack().await.expect("ack");
                    }
                    send.await.expect("sender");
                }
                start.elapsed()
            })
        });
    });

    let server = server::NatsServer::start(&[]).expect("start nats-server");
    let (sender, mut receiver) = rt.block_on(async {
        let t = NatsTransport::connect(NatsConfig::with_prefix(vec![server.url()], "bench_groups"))
            .await
            .expect("connect");
        (Arc::new(t.group_sender().await.expect("sender")), t.group_receiver().await.expect("receiver"))
    });
    group.bench_function("nats", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let p = period.fetch_add(1, Ordering::Relaxed);
                    let sender = Arc::clone(&sender);
                    let mut batch = batch.clone();
                    for g in &mut batch {
                        g.group.period = metronome_core::PeriodId(p);
                    }
                    // Several concurrent senders, as with several rollout workers.
                    let sends: Vec<_> = batch
                        .chunks(GROUPS as usize / 4)
                        .map(|chunk| {
                            let sender = Arc::clone(&sender);
                            let chunk = chunk.to_vec();
                            tokio::spawn(async move {
                                for g in chunk {
                                    sender.send(g).await.expect("send");
                                }
                            })
                        })
                        .collect();
                    for _ in 0..GROUPS {
                        let d = receiver.recv().await.expect("recv").expect("a group");
                        d.acker.ack().await.expect("ack");
                    }
                    for s in sends {
                        s.await.expect("sender");
                    }
                }
                start.elapsed()
            })
        });
    });
    group.finish();
}

criterion_group!(benches, weights, groups);
criterion_main!(benches);
