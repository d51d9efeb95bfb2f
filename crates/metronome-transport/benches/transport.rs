//! Throughput of the transports, measured side by side on loopback:
//!
//! - a printed report first (`-- side_by_side` prints only it): rounds that interleave
//!   a memory copy, a plain TCP transfer of the encoded 100 MB snapshot into fresh and
//!   into reused memory, and a NATS publish then fetch with the default settings
//!   (memory storage, no SHA-256 digest) and with the durable ones (file storage and
//!   the digest stock object store readers check), each also streamed (a subscriber
//!   waiting for the version decodes it while it uploads: wall time of publish and
//!   fetch overlapped); medians of wall-clock and CPU time
//!   (this process plus the server), MB/s, and ratios to both TCP transfers. Taking
//!   every figure in the same rounds keeps the ratios honest on a machine that others
//!   use at the same time;
//! - `weights_100mb/*` (criterion): the same snapshot published and fetched over NATS
//!   (file and memory storage), beside the TCP transfer into fresh memory, the
//!   encode+decode pair alone, and a memory copy;
//! - `groups/*` (criterion): small groups (G = 4, 32 tokens) sent, received and
//!   acknowledged, in process and over NATS.
//!
//! Starts its own `nats-server` (`metronome_testkit::server`). Under `cargo test`
//! (no `--bench`), as CI runs it, the report takes one round of a 16 MiB snapshot:
//! a check that every path still works, not a measurement (seven rounds of 100 MB in
//! the debug build once stalled a streamed fetch past its 10 s timeout on a loaded
//! 2-core CI machine).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use metronome_core::{GroupReceiver, GroupSender, WeightPublisher, WeightSubscriber};
use metronome_testkit::data::{scored_group, snapshot_of_bytes};
use metronome_testkit::server;
use metronome_transport::nats::{NatsConfig, NatsTransport, Storage};
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

/// CPU time (user + system) of process `pid` so far, from `/proc/<pid>/stat`, in
/// clock ticks of 10 ms (`USER_HZ` is 100 on Linux); `None` elsewhere.
fn cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are the 12th and
    // 13th of them.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// CPU milliseconds of this process and of `server` while `f` runs, with its result.
fn with_cpu<T>(server: Option<u32>, f: impl FnOnce() -> T) -> (T, f64) {
    let ticks =
        || cpu_ticks("self").unwrap_or(0) + server.and_then(|p| cpu_ticks(&p.to_string())).unwrap_or(0);
    let before = ticks();
    let out = f();
    (out, (ticks() - before) as f64 * 10.0)
}

/// A plain TCP transfer into a buffer that was filled before, so that no page faults
/// are left in it: the path's limit for a receiver that reuses its memory.
fn tcp_transfer_into(bytes: &[u8], buffer: &mut Vec<u8>) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let len = bytes.len();
    let mut out = std::mem::take(buffer);
    let start = Instant::now();
    let reader = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        stream.read_exact(&mut out[..len]).expect("read");
        out
    });
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.write_all(bytes).expect("write");
    drop(stream);
    *buffer = reader.join().expect("reader");
    start.elapsed()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 { xs[n / 2] } else { (xs[n / 2 - 1] + xs[n / 2]) / 2.0 }
}

/// The side-by-side report of the 100 MB weight path: rounds that interleave a memory
/// copy, a plain TCP transfer into fresh and into reused memory, and a NATS publish
/// followed by a fetch in two configurations (the defaults: memory storage without
/// the object store's SHA-256 digest; and file storage with it), so that every ratio compares
/// measurements taken under the same load. Also the CPU time each takes (this
/// process and the server together), which other work on the machine disturbs less
/// than the wall-clock time. `TRANSPORT_ROUNDS` sets the rounds (default 7; one under
/// `cargo test`, of `bytes` = 16 MiB).
fn weights_side_by_side(bench: bool) {
    let rounds: usize = std::env::var("TRANSPORT_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if bench { 7 } else { 1 });
    let bytes = if bench { SNAPSHOT_BYTES } else { 16 << 20 };
    let snapshot = Arc::new(snapshot_of_bytes(0, bytes));
    let encoded = encode_weights(&snapshot).expect("encode");
    let mb = encoded.len() as f64 / 1e6;
    let rt = runtime();
    // `TRANSPORT_MAX_PAYLOAD` raises the server's message size limit (the deployment
    // setting `max_payload`, 1 MiB by default), `TRANSPORT_CHUNK_BYTES` the chunk size
    // of the default configuration.
    let env = |name: &str| std::env::var(name).ok().and_then(|s| s.parse::<usize>().ok());
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("nats.conf");
    let mut args = Vec::new();
    if let Some(max) = env("TRANSPORT_MAX_PAYLOAD") {
        std::fs::write(&conf, format!("max_payload: {max}\n")).expect("write nats.conf");
        args = vec!["-c".to_owned(), conf.display().to_string()];
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = server::NatsServer::start(&args).expect("start nats-server");
    let pid = server.pid();
    let mut defaults = NatsConfig::with_prefix(vec![server.url()], "side_default");
    if let Some(chunk) = env("TRANSPORT_CHUNK_BYTES") {
        defaults.weights.chunk_bytes = chunk;
    }
    let mut durable = NatsConfig::with_prefix(vec![server.url()], "side_durable");
    durable.weights.storage = Storage::File;
    durable.weights.object_store_digest = true;
    let configs = [("nats defaults", defaults), ("nats file, sha-256", durable)];
    // Each configuration: a publisher, a subscriber that fetches after the publication
    // (`latest`), and one on its own connection that waits for the version and
    // streams it while it uploads (`wait_for`, `weights.streaming`).
    let mut endpoints: Vec<_> = configs
        .iter()
        .map(|(_, c)| {
            rt.block_on(async {
                let t = NatsTransport::connect(c.clone()).await.expect("connect");
                let other = NatsTransport::connect(c.clone()).await.expect("connect");
                (
                    t.weight_publisher().await.expect("publisher"),
                    t.weight_subscriber().await.expect("subscriber"),
                    Some(other.weight_subscriber().await.expect("subscriber")),
                )
            })
        })
        .collect();
    // Rounds that took the streamed path, per configuration and way of waiting.
    let mut streamed_rounds = vec![[0usize; 2]; configs.len()];
    let begins_subjects: Vec<String> =
        configs.iter().map(|(_, c)| format!("{}.begins", c.weights.announce_subject)).collect();
    let watcher = rt.block_on(async_nats::connect(server.url())).expect("connect");
    let mut warm = encoded.clone();
    // wall ms, cpu ms per row; NATS rows also keep publish and fetch apart.
    let mut rows: Vec<(String, Vec<f64>, Vec<f64>)> = ["memcpy", "tcp (fresh buffer)", "tcp (reused buffer)"]
        .iter()
        .map(|n| ((*n).to_owned(), vec![], vec![]))
        .collect();
    for (name, _) in &configs {
        for part in [
            "publish",
            "fetch",
            "publish+fetch",
            "publish || fetch, streamed",
            "streamed, joining after the begins",
        ] {
            rows.push((format!("{name}: {part}"), vec![], vec![]));
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for round in 0..rounds {
        let (d, cpu) = with_cpu(None, || {
            let t = Instant::now();
            std::hint::black_box(encoded.to_vec());
            t.elapsed()
        });
        rows[0].1.push(ms(d));
        rows[0].2.push(cpu);
        let (d, cpu) = with_cpu(None, || tcp_transfer(&encoded));
        rows[1].1.push(ms(d));
        rows[1].2.push(cpu);
        let (d, cpu) = with_cpu(None, || tcp_transfer_into(&encoded, &mut warm));
        rows[2].1.push(ms(d));
        rows[2].2.push(cpu);
        let version = 3 * round as u64 + 1;
        let with_version = |v: u64| {
            let mut s = (*snapshot).clone();
            s.version = metronome_core::PolicyVersion(v);
            Arc::new(s)
        };
        let s = with_version(version);
        for (i, (publisher, subscriber, streamer)) in endpoints.iter_mut().enumerate() {
            let ((publish, cpu_publish), (fetch, cpu_fetch)) = rt.block_on(async {
                let p = async_cpu(pid, async {
                    let t = Instant::now();
                    publisher.publish(Arc::clone(&s)).await.expect("publish");
                    t.elapsed()
                })
                .await;
                let f = async_cpu(pid, async {
                    let t = Instant::now();
                    let got = subscriber.latest().await.expect("fetch").expect("a snapshot");
                    assert_eq!(got.version.0, version);
                    t.elapsed()
                })
                .await;
                (p, f)
            });
            // Streamed: the subscriber waits for the next version on its own task,
            // from before the publication starts, or from when its begins
            // announcement went out (as a worker that takes a claim offered during
            // the upload); wall time from the start of the publication until both
            // ended.
            let mut overlapped = [(Duration::ZERO, 0.0); 2];
            for (way, joins_late) in [false, true].into_iter().enumerate() {
                let want = metronome_core::PolicyVersion(version + 1 + way as u64);
                let next = with_version(want.0);
                let mut streamer_now = streamer.take().expect("streaming subscriber");
                let (wall, cpu, back, before) = rt.block_on(async {
                    // Up to date first, so that `wait_for` only waits.
                    streamer_now.latest().await.expect("catch up");
                    let before = streamer_now.streamed_fetches();
                    let mut begins = watcher.subscribe(begins_subjects[i].clone()).await.expect("subscribe");
                    let waiter = tokio::spawn(async move {
                        if joins_late {
                            futures::StreamExt::next(&mut begins).await.expect("a begins announcement");
                        }
                        let got = streamer_now.wait_for(want).await.expect("streamed fetch");
                        assert_eq!(got.version, want);
                        (streamer_now, Instant::now())
                    });
                    // Time for the subscriptions to reach the server.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let ((wall, back), cpu) = async_cpu(pid, async {
                        let t = Instant::now();
                        publisher.publish(Arc::clone(&next)).await.expect("publish");
                        let published = Instant::now();
                        let (back, fetched) = waiter.await.expect("waiter");
                        (published.max(fetched) - t, back)
                    })
                    .await;
                    (wall, cpu, back, before)
                });
                if back.streamed_fetches() > before {
                    streamed_rounds[i][way] += 1;
                }
                *streamer = Some(back);
                overlapped[way] = (wall, cpu);
            }
            let base = 3 + 5 * i;
            for (row, wall, cpu) in [
                (base, ms(publish), cpu_publish),
                (base + 1, ms(fetch), cpu_fetch),
                (base + 2, ms(publish + fetch), cpu_publish + cpu_fetch),
                (base + 3, ms(overlapped[0].0), overlapped[0].1),
                (base + 4, ms(overlapped[1].0), overlapped[1].1),
            ] {
                rows[row].1.push(wall);
                rows[row].2.push(cpu);
            }
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "weights_{}mb side by side: {rounds} interleaved rounds, medians; load average {}",
        bytes >> 20,
        load.trim()
    );
    let tcp_wall = median(rows[1].1.clone());
    let tcp_cpu = median(rows[1].2.clone());
    let warm_wall = median(rows[2].1.clone());
    println!(
        "{:<54} {:>9} {:>9} {:>9} {:>9} {:>11}",
        "", "wall ms", "MB/s", "cpu ms", "x tcp", "x tcp reuse"
    );
    for (name, wall, cpu) in &rows {
        let (w, c) = (median(wall.clone()), median(cpu.clone()));
        println!(
            "{name:<54} {w:>9.1} {:>9.0} {c:>9.0} {:>9.2} {:>11.2}",
            mb / (w / 1e3),
            w / tcp_wall,
            w / warm_wall
        );
    }
    println!("cpu ratio (publish+fetch over tcp fresh, this process + server): {}", {
        let parts: Vec<String> = rows
            .iter()
            .filter(|(n, _, _)| {
                n.ends_with("publish+fetch") || n.contains("streamed") || n.contains("begins")
            })
            .map(|(n, _, c)| format!("{n} {:.2}", median(c.clone()) / tcp_cpu.max(1.0)))
            .collect();
        parts.join("; ")
    });
    for ((name, _), [early, late]) in configs.iter().zip(&streamed_rounds) {
        println!(
            "{name}: {early} of {rounds} rounds took the streamed path ({late} waiting from after the begins)"
        );
    }
}

/// CPU milliseconds of this process and the server while `f` runs.
async fn async_cpu<T>(server: Option<u32>, f: impl std::future::Future<Output = T>) -> (T, f64) {
    let ticks =
        || cpu_ticks("self").unwrap_or(0) + server.and_then(|p| cpu_ticks(&p.to_string())).unwrap_or(0);
    let before = ticks();
    let out = f.await;
    (out, (ticks() - before) as f64 * 10.0)
}

criterion_group!(benches, weights, groups);

fn main() {
    // `cargo bench -p metronome-transport -- side_by_side` prints only the report;
    // any other filter goes to criterion.
    let args: Vec<String> = std::env::args().collect();
    let filter = args.iter().skip(1).find(|a| !a.starts_with('-'));
    if filter.is_none_or(|f| "weights_100mb side_by_side".contains(f.as_str())) {
        weights_side_by_side(args.iter().any(|a| a == "--bench"));
    }
    if filter.is_some_and(|f| f == "side_by_side") {
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
