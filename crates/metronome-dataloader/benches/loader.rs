//! Throughput of the data loader's parts: reading files, shuffling, generating tasks
//! and planning a batch (render + tokenise). Compare the numbers as ratios between
//! benches of one run (e.g. Parquet vs JSONL reading of the same records).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{ArrayRef, RecordBatch, StringArray};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use metronome_core::{RunSeed, TokenId, Tokenizer};
use metronome_dataloader::{
    ArithmeticConfig, ArithmeticTask, BadRecordPolicy, CountdownConfig, CountdownTask, Dataset, FieldMapping,
    FileDataset, PromptConfig, PromptLoader, ReleaseConfig, epoch_order,
};

const RECORDS: usize = 10_000;

#[derive(Debug)]
struct Bytes;

impl Tokenizer for Bytes {
    fn encode(&self, text: &str) -> metronome_core::Result<Vec<TokenId>> {
        Ok(text.bytes().map(TokenId::from).collect())
    }
    fn decode(&self, tokens: &[TokenId]) -> metronome_core::Result<String> {
        Ok(tokens.iter().filter_map(|&t| char::from_u32(t)).collect())
    }
    fn vocab_size(&self) -> usize {
        256
    }
    fn stop_token_ids(&self) -> Vec<TokenId> {
        Vec::new()
    }
}

fn files(dir: &tempfile::TempDir) -> (std::path::PathBuf, std::path::PathBuf) {
    let questions: Vec<String> = (0..RECORDS)
        .map(|i| format!("Question {i}: what is {i} plus {}? Think step by step.", i * 7))
        .collect();
    let answers: Vec<String> = (0..RECORDS).map(|i| (i * 8).to_string()).collect();
    let jsonl = dir.path().join("bench.jsonl");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&jsonl).unwrap());
    for (q, a) in questions.iter().zip(&answers) {
        writeln!(file, "{}", serde_json::json!({"question": q, "answer": a, "level": "3"})).unwrap();
    }
    file.flush().unwrap();
    let parquet = dir.path().join("bench.parquet");
    let batch = RecordBatch::try_from_iter([
        ("question", Arc::new(StringArray::from(questions)) as ArrayRef),
        ("answer", Arc::new(StringArray::from(answers)) as ArrayRef),
        ("level", Arc::new(StringArray::from_iter_values((0..RECORDS).map(|_| "3"))) as ArrayRef),
    ])
    .unwrap();
    let mut writer =
        parquet::arrow::ArrowWriter::try_new(std::fs::File::create(&parquet).unwrap(), batch.schema(), None)
            .unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
    (jsonl, parquet)
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let (jsonl, parquet) = files(&dir);
    let fields = FieldMapping {
        prompt: "question".into(),
        reference: Some("answer".into()),
        metadata: BTreeMap::from([("level".into(), "level".into())]),
    };

    let mut group = c.benchmark_group("read_10k_records");
    group.throughput(Throughput::Elements(RECORDS as u64));
    group.sample_size(10);
    group.bench_function("jsonl", |b| {
        b.iter(|| FileDataset::open_jsonl(&jsonl, &fields, BadRecordPolicy::Fail).unwrap().len())
    });
    group.bench_function("parquet", |b| {
        b.iter(|| FileDataset::open_parquet(&parquet, &fields, BadRecordPolicy::Fail).unwrap().len())
    });
    group.finish();

    let mut group = c.benchmark_group("generate_1k_items");
    group.throughput(Throughput::Elements(1000));
    let arithmetic = ArithmeticTask::new(ArithmeticConfig::default(), RunSeed(0)).unwrap();
    let countdown = CountdownTask::new(CountdownConfig::default(), RunSeed(0)).unwrap();
    group.bench_function("arithmetic", |b| {
        b.iter(|| (0..1000).map(|i| arithmetic.record(i).unwrap().metadata.len()).sum::<usize>())
    });
    group.bench_function("countdown", |b| {
        b.iter(|| (0..1000).map(|i| countdown.record(i).unwrap().metadata.len()).sum::<usize>())
    });
    group.finish();

    let mut group = c.benchmark_group("shuffle");
    group.throughput(Throughput::Elements(100_000));
    group.bench_function("epoch_order_100k", |b| {
        b.iter(|| epoch_order(RunSeed(1), black_box(3), 100_000, true))
    });
    group.finish();

    // How long `next_batch` keeps a period waiting for a batch of 64: planned on demand
    // (prefetch off), and prefetched while a simulated 2 ms period runs (only the call
    // is timed). The ratio is what prefetching saves at each period start.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let dataset: Arc<dyn Dataset> =
        Arc::new(FileDataset::open_jsonl(&jsonl, &fields, BadRecordPolicy::Fail).unwrap());
    let mut group = c.benchmark_group("next_batch_wait");
    group.throughput(Throughput::Elements(64));
    group.sample_size(20);
    for prefetch in [false, true] {
        let release = ReleaseConfig { batch_size: 64, prefetch, ..ReleaseConfig::default() };
        let mut loader = PromptLoader::new(
            Arc::clone(&dataset),
            Arc::new(Bytes),
            RunSeed(0),
            release,
            PromptConfig::default(),
        )
        .unwrap();
        let name = if prefetch { "b64_prefetched" } else { "b64_on_demand" };
        group.bench_function(name, |b| {
            b.iter_custom(|iterations| {
                let mut waited = Duration::ZERO;
                for _ in 0..iterations {
                    let started = Instant::now();
                    black_box(runtime.block_on(loader.next()).unwrap().unwrap());
                    waited += started.elapsed();
                    std::thread::sleep(Duration::from_millis(2));
                }
                waited
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
