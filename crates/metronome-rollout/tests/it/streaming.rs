//! Groups are emitted in completion order, before the whole batch is done.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use metronome_core::{Group, GroupSink, PeriodId, PolicyVersion, RolloutEngine, RolloutRequest};
use metronome_rollout::{Engine, EngineConfig};

use crate::common::{Watch, Watched, prompts, sampling, tiny_model, tokenizer};

/// A gate on the tiny model's decode steps: once any sequence has finished, decode
/// steps wait until the test's sink has received a group. If groups were only emitted at the end
/// of the batch the engine would stall at the gate (until the 20 s safety timeout) and
/// the assertions below would fail; with streaming it never stalls for long.
#[derive(Default)]
struct Gate {
    finished: AtomicUsize,
    decode_steps: AtomicUsize,
    opened: Mutex<bool>,
    cv: Condvar,
    timed_out: AtomicBool,
}

impl Watch for Arc<Gate> {
    fn before_decode(&self, _: usize) {
        if self.finished.load(Ordering::SeqCst) > 0 {
            let opened = self.opened.lock().unwrap();
            let (opened, timeout) =
                self.cv.wait_timeout_while(opened, Duration::from_secs(20), |o| !*o).unwrap();
            if timeout.timed_out() && !*opened {
                self.timed_out.store(true, Ordering::SeqCst);
            }
        }
        self.decode_steps.fetch_add(1, Ordering::SeqCst);
    }

    fn freed(&self) {
        self.finished.fetch_add(1, Ordering::SeqCst);
    }
}

struct RecordingSink {
    gate: Arc<Gate>,
    groups: Mutex<Vec<(Group, usize)>>,
}

#[async_trait]
impl GroupSink for RecordingSink {
    async fn emit(&self, group: Group) -> metronome_core::Result<()> {
        let steps = self.gate.decode_steps.load(Ordering::SeqCst);
        self.groups.lock().unwrap().push((group, steps));
        *self.gate.opened.lock().unwrap() = true;
        self.gate.cv.notify_all();
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_stream_out_in_completion_order_before_the_batch_ends() {
    let gate = Arc::new(Gate::default());
    let model = Watched { model: tiny_model(7), watch: Arc::clone(&gate) };
    // Several stop tokens make response lengths differ.
    let mut s = sampling(48);
    s.stop_token_ids = Some(vec![2, 10, 20, 30, 40, 50, 60]);
    let config = EngineConfig {
        workers: 1,
        max_num_seqs: 4,
        max_seq_len: 128,
        sampling: s,
        ..EngineConfig::default()
    };
    let engine = Engine::new(model, PolicyVersion(0), tokenizer(), config).unwrap();
    let sink = RecordingSink { gate: Arc::clone(&gate), groups: Mutex::new(Vec::new()) };
    let request = RolloutRequest { period: PeriodId(1), prompts: prompts(8), group_size: 1 };
    engine.generate(request, &sink).await.unwrap();

    assert!(
        !gate.timed_out.load(Ordering::SeqCst),
        "the engine waited at the gate: groups were not streamed"
    );
    let groups = sink.groups.into_inner().unwrap();
    assert_eq!(groups.len(), 8);
    let total_steps = gate.decode_steps.load(Ordering::SeqCst);
    let (first, steps_at_first) = &groups[0];
    assert!(
        *steps_at_first < total_steps,
        "first group emitted after {steps_at_first} of {total_steps} decode steps"
    );
    let longest = groups.iter().map(|(g, _)| g.completions[0].tokens.len()).max().unwrap();
    assert!(first.completions[0].tokens.len() < longest, "lengths did not differ");
    // Completion order: emission times never go backwards, and decode progress at each
    // emission never goes backwards.
    for w in groups.windows(2) {
        assert!(w[0].0.timing.finished_s <= w[1].0.timing.finished_s);
        assert!(w[0].1 <= w[1].1);
    }
    // Not simply the release order.
    let order: Vec<u64> = groups.iter().map(|(g, _)| g.prompt.id.0).collect();
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_ne!(order, sorted, "groups came out in release order: {order:?}");
}
