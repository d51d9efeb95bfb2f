//! On-policy distillation (`trainer.distill`) on the CPU: from the same warm-started
//! student, held-out accuracy rises towards a better teacher's faster per period
//! with either signal of the teacher's reverse KL (sampled or full) than with GRPO
//! alone (`../benches/distill/experiment.rs` says what runs; `cargo bench -p
//! metronome-tests --bench distillation` runs it longer, on this task and on the
//! default arithmetic run, and prints the tables); and a teacher that cannot serve
//! stops the run before it starts.

#[path = "../benches/distill/experiment.rs"]
mod experiment;

use experiment::{Sizes, Student, Task, distillation, table};

/// The copy task (exact match over 3 to 10 characters): a teacher warm-started 600
/// steps answers about 80% of held-out strings, a student of another seed
/// warm-started 150 steps about 8%. Measured in the bench's first 20 periods (the
/// same runs, 400 held-out answers): GRPO alone 8.2% → 3.1% → 4.9% (the first steps
/// of a fresh AdamW cost accuracy; GRPO's groups are then mostly all-zero and teach
/// nothing), the sampled signal 8.2% → 7.4% → 12.1% (reverse KL per token 1.26 →
/// 0.97) and the full one 8.2% → 7.6% → 13.4% (1.12 → 0.86). The bench's 60 periods
/// show the arms apart at every point. Both signals are held to the same margin.
const STUDENTS: [Student; 3] = [
    Student::GRPO,
    Student { name: "sampled", signal: Some("sampled"), overrides: &[] },
    Student { name: "full", signal: Some("full"), overrides: &[] },
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distillation_from_a_better_teacher_beats_grpo_alone_per_period() {
    let sizes = Sizes {
        task: Task::Copy,
        teacher_sft: 600,
        teacher_periods: 1,
        teacher_prompts: 8,
        student_seed: 1,
        student_sft: 150,
        periods: 20,
        prompts_per_period: 64,
        warmup_steps: 3,
        eval_every: 10,
        eval_prompts: 200,
        eval_samples: 2,
        students: STUDENTS.to_vec(),
    };
    let out = tempfile::tempdir().unwrap();
    let outcome = distillation(out.path(), &sizes).await.unwrap();
    eprintln!("{}", table(&outcome));
    let grpo = outcome.arm(Student::GRPO.name);
    let points: Vec<u64> = grpo.accuracy.iter().map(|p| p.0).collect();
    assert_eq!(points, [0, 10, 20]);
    let start = grpo.accuracy[0].1;
    assert!(outcome.teacher > start + 0.3, "the teacher must be better: {} vs {start}", outcome.teacher);
    assert!(grpo.reverse_kl.is_empty(), "no teacher, no reverse KL");
    for student in &STUDENTS[1..] {
        let distill = outcome.arm(student.name);
        let what = student.name;
        assert_eq!(distill.accuracy.iter().map(|p| p.0).collect::<Vec<_>>(), points, "{what}");
        assert_eq!(start, distill.accuracy[0].1, "{what}: every arm starts from the same student");
        // Closer to the teacher at the end, by a margin beyond the evaluation's noise
        // (400 answers: about 1.5 points at 8%).
        assert!(
            distill.gain() > grpo.gain() + 0.03,
            "{what}: distillation should gain more than GRPO alone: {:+.3} vs {:+.3}",
            distill.gain(),
            grpo.gain()
        );
        // The student comes closer to the teacher: its reverse KL per token falls.
        let kl = &distill.reverse_kl;
        assert_eq!(kl.len(), 20, "{what}");
        let mean = |k: &[f64]| k.iter().sum::<f64>() / k.len() as f64;
        assert!(mean(&kl[15..]) < 0.9 * mean(&kl[..5]), "{what}: reverse KL per token {kl:?}");
    }
}

/// A teacher that does not load (no such folder, or a folder read as GGUF), or that
/// has another vocabulary than the student, stops the run before its warm start,
/// with an error naming `trainer.distill.path`: no warm-start step, no evaluation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teacher_that_does_not_load_or_has_another_vocabulary_stops_the_run_before_it_starts() {
    use std::sync::{Arc, Mutex};

    use metronome_model::{Device, DeviceSpec, Model, ModelConfig};
    use metronome_pipeline::{Event, Observer, PipelineConfig, RunOptions, load_model, run};

    let out = tempfile::tempdir().unwrap();
    let student = load_model(&PipelineConfig::embedded(&[]).unwrap(), DeviceSpec::Cpu).unwrap().0;
    let vocab = student.config().vocab_size;
    let other = out.path().join("other-vocabulary");
    let cfg = ModelConfig { vocab_size: vocab + 5, ..student.config().clone() };
    Model::new(cfg, &Device::Cpu, 3).unwrap().save_hf(&other).unwrap();
    let missing = out.path().join("missing");
    let cases = [
        ("hf", &missing, "the teacher does not load as Hf"),
        ("gguf", &other, "the teacher does not load as Gguf"),
        ("hf", &other, &format!("the teacher has a vocabulary of {} tokens, the student {vocab}", vocab + 5)),
    ];
    for (i, (kind, path, why)) in cases.iter().enumerate() {
        let overrides = [
            format!("run.out_dir={:?}", out.path().display().to_string()),
            format!("run.name=\"bad-teacher-{i}\""),
            format!("trainer.distill={{ kind = {kind:?}, path = {:?} }}", path.display().to_string()),
        ];
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&events);
        let options = RunOptions {
            observer: Observer::new(move |e: &Event| sink.lock().unwrap().push(format!("{e:?}"))),
            ..RunOptions::default()
        };
        let err = run(PipelineConfig::embedded(&overrides).unwrap(), options).await.unwrap_err().to_string();
        assert!(
            err.starts_with("invalid configuration `trainer.distill.path`")
                && err.contains(&path.display().to_string())
                && err.contains(why),
            "{kind} {}: {err}",
            path.display()
        );
        let events = events.lock().unwrap();
        assert!(
            !events.iter().any(|e| e.starts_with("WarmStartStep") || e.starts_with("Evaluated")),
            "the run started: {events:?}"
        );
    }
}
