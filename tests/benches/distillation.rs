//! `cargo bench -p metronome-tests --bench distillation`: on-policy distillation
//! against GRPO alone from the same student, held-out accuracy every few periods,
//! printed as tables: on the copy task (the test's setting, run three times longer)
//! and on the default arithmetic run with its trained model as the teacher
//! (`distill/experiment.rs` says what runs).
//!
//! Under `cargo test` (no `--bench` argument) it runs a few small periods of the copy
//! task as a smoke test; `tests/tests/distillation.rs` runs the test-sized
//! experiment and asserts its direction.

#[path = "distill/experiment.rs"]
mod experiment;

use experiment::{Sizes, Student, Task, distillation, table};

fn main() -> anyhow::Result<()> {
    let bench = std::env::args().any(|a| a == "--bench");
    let copy = Sizes {
        task: Task::Copy,
        teacher_sft: 600,
        teacher_periods: 1,
        teacher_prompts: 8,
        student_seed: 1,
        student_sft: 150,
        periods: 60,
        prompts_per_period: 64,
        warmup_steps: 3,
        eval_every: 10,
        eval_prompts: 400,
        eval_samples: 2,
        students: students(),
    };
    // The default e2e run (`cargo xtask e2e`) as the teacher, a fresh copy of its
    // warm start as the student, the default's settings in both arms.
    let arithmetic = Sizes {
        task: Task::Arithmetic,
        teacher_sft: 800,
        teacher_periods: 100,
        teacher_prompts: 128,
        student_seed: 0,
        student_sft: student_sft()?,
        periods: 40,
        prompts_per_period: 128,
        warmup_steps: 10,
        eval_every: 10,
        eval_prompts: 400,
        eval_samples: 16,
        students: arithmetic_students(),
    };
    let smoke = Sizes {
        teacher_sft: 20,
        student_sft: 10,
        periods: 2,
        prompts_per_period: 8,
        eval_every: 1,
        eval_prompts: 8,
        eval_samples: 1,
        ..copy.clone()
    };
    // `DISTILL_TASKS=arithmetic` (or `copy`) runs one of the two; `DISTILL_STUDENT_SFT`
    // warm-starts the arithmetic student less than the teacher ([`student_sft`]).
    let only = std::env::var("DISTILL_TASKS").unwrap_or_default();
    anyhow::ensure!(
        ["", "copy", "arithmetic"].contains(&only.to_ascii_lowercase().as_str()),
        "DISTILL_TASKS={only:?}: expected `copy` or `arithmetic`"
    );
    let runs = if bench { vec![copy, arithmetic] } else { vec![smoke] };
    let runs =
        runs.into_iter().filter(|s| only.is_empty() || format!("{:?}", s.task).eq_ignore_ascii_case(&only));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    for sizes in runs {
        let out = tempfile::tempdir()?;
        let start = std::time::Instant::now();
        let outcome = runtime.block_on(distillation(out.path(), &sizes))?;
        println!(
            "\n{:?}: on-policy distillation vs GRPO alone, tiny model, {} prompts x 8 per period; teacher: {} \
             warm-start steps + {} GRPO periods of {} prompts (seed 0); student: seed {}, {} warm-start steps; \
             held-out accuracy of {} prompts x {} samples at temperature 1 ({:.0} s)",
            sizes.task,
            sizes.prompts_per_period,
            sizes.teacher_sft,
            sizes.teacher_periods,
            sizes.teacher_prompts,
            sizes.student_seed,
            sizes.student_sft,
            sizes.eval_prompts,
            sizes.eval_samples,
            start.elapsed().as_secs_f64()
        );
        print!("{}", table(&outcome));
        let gains: Vec<String> = outcome
            .arms
            .iter()
            .map(|arm| format!("{} {:+.1} points", arm.name, 100.0 * arm.gain()))
            .collect();
        println!("gain over {} periods: {}", sizes.periods, gains.join(", "));
    }
    Ok(())
}

/// The arithmetic student's warm-start steps: the teacher's 800 (a fresh copy of its
/// warm start), or `DISTILL_STUDENT_SFT` (a weaker student, further from the teacher).
fn student_sft() -> anyhow::Result<u64> {
    match std::env::var("DISTILL_STUDENT_SFT") {
        Err(_) => Ok(800),
        Ok(v) => {
            v.parse().map_err(|_| anyhow::anyhow!("DISTILL_STUDENT_SFT={v:?}: expected a number of steps"))
        }
    }
}

/// GRPO alone and distillation alone with each signal, at the default's settings.
fn students() -> Vec<Student> {
    vec![
        Student::GRPO,
        Student { name: "distillation, sampled", signal: Some("sampled"), overrides: &[] },
        Student { name: "distillation, full", signal: Some("full"), overrides: &[] },
    ]
}

/// [`students`], then GRPO with four optimiser steps per period, and each signal
/// added to GRPO's advantages (`mode = "add"`, weight 1).
fn arithmetic_students() -> Vec<Student> {
    const ADD: &[&str] = &["trainer.distill.mode=\"add\""];
    let mut students = students();
    students.extend([
        Student { name: "GRPO alone, 4 mini-steps", signal: None, overrides: &["trainer.mini_steps=4"] },
        Student { name: "GRPO + sampled", signal: Some("sampled"), overrides: ADD },
        Student { name: "GRPO + full", signal: Some("full"), overrides: ADD },
    ]);
    students
}
