//! The distillation experiment shared by `tests/tests/distillation.rs` (short, asserts
//! the direction) and `tests/benches/distillation.rs` (longer, prints the tables).
//!
//! A teacher is trained first: the embedded default run on the task with a warm start
//! (and, for arithmetic, the default's GRPO periods); its final checkpoint's
//! `policy/` folder is the teacher. Then a fresh student is warm-started less, and
//! from that same student two runs of the same periods with the same settings: GRPO
//! alone, and on-policy distillation from the teacher (`trainer.distill`, the
//! teacher's per-token reverse KL alone as the advantage). Held-out accuracy is
//! measured every `eval_every` periods, sampled at temperature 1 as `[eval]` does.
//!
//! Two tasks:
//! - `Copy`: the copy task (`dbjj=` → `dbjj`, 3 to 10 characters, exact match). The
//!   reward is all or nothing over the whole string, so a weak student's groups are
//!   mostly all-zero and GRPO has little to learn from, while the teacher scores every
//!   character. The test runs it.
//! - `Arithmetic`: the literal setting: the teacher is the default e2e run
//!   (800 warm-start steps, 100 GRPO periods of 128 prompts), the student a fresh copy
//!   of its warm start (the same seed). The bench runs it as well.

use std::path::{Path, PathBuf};

use metronome_pipeline::{PipelineConfig, RunOptions, run};

/// The task of an experiment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Task {
    /// Copy a string of 3 to 10 characters; exact match.
    Copy,
    /// The embedded default's arithmetic.
    #[allow(dead_code, reason = "the bench runs it, the test does not")]
    Arithmetic,
}

/// The sizes of one experiment.
#[derive(Clone, Debug)]
pub(crate) struct Sizes {
    pub(crate) task: Task,
    /// The teacher's warm-start steps.
    pub(crate) teacher_sft: u64,
    /// The teacher's GRPO periods after it (at least 1: a run has a period).
    pub(crate) teacher_periods: u64,
    /// Prompts per teacher period.
    pub(crate) teacher_prompts: usize,
    /// The student's run seed (its initial weights).
    pub(crate) student_seed: u64,
    /// The student's warm-start steps.
    pub(crate) student_sft: u64,
    /// The student's periods, in each arm.
    pub(crate) periods: u64,
    /// Prompts per student period (`data.release.batch_size`).
    pub(crate) prompts_per_period: usize,
    /// Warm-up steps of both arms' learning rate (`trainer.schedule.warmup_steps`).
    pub(crate) warmup_steps: u64,
    /// Evaluate every this many periods (and before the first).
    pub(crate) eval_every: u64,
    /// Held-out prompts per evaluation.
    pub(crate) eval_prompts: usize,
    /// Answers sampled per held-out prompt.
    pub(crate) eval_samples: u32,
}

/// One student run.
#[derive(Clone, Debug)]
pub(crate) struct Arm {
    /// Held-out accuracy after 0, `eval_every`, … periods: (periods, accuracy).
    pub(crate) accuracy: Vec<(u64, f64)>,
    /// The mean reverse KL per token to the teacher in each period (empty without
    /// distillation).
    pub(crate) reverse_kl: Vec<f64>,
}

impl Arm {
    /// Accuracy after the last period minus accuracy before the first.
    pub(crate) fn gain(&self) -> f64 {
        self.accuracy.last().map_or(0.0, |l| l.1) - self.accuracy.first().map_or(0.0, |f| f.1)
    }
}

/// What the experiment measured.
#[derive(Clone, Debug)]
pub(crate) struct Outcome {
    /// The teacher's held-out accuracy.
    pub(crate) teacher: f64,
    /// The student trained with GRPO alone.
    pub(crate) grpo: Arm,
    /// The student trained by distillation from the teacher.
    pub(crate) distill: Arm,
}

/// The settings of a run of `sizes.task` named `name`.
fn overrides(out: &Path, name: &str, seed: u64, sizes: &Sizes) -> Vec<String> {
    let mut o = vec![
        format!("run.out_dir={:?}", out.display().to_string()),
        format!("run.name={name:?}"),
        format!("run.seed={seed}"),
        format!("eval.prompts={}", sizes.eval_prompts),
        format!("eval.samples={}", sizes.eval_samples),
    ];
    if sizes.task == Task::Copy {
        o.extend(
            [
                "data.source={ kind = \"copy\", size = 4000, length = { min = 3, max = 10 }, tail = 0.0, \
                 holdout = { split = \"train\", percent = 10 } }",
                "data.prompt.max_tokens=24",
                "rollout.sampling.max_new_tokens=24",
                "reward.scorer={ kind = \"exact_match\", extractors = [], normalise = false }",
            ]
            .map(str::to_owned),
        );
    }
    o
}

/// Trains the teacher; its held-out accuracy and its weights' folder.
async fn teacher(out: &Path, sizes: &Sizes) -> anyhow::Result<(f64, PathBuf)> {
    let mut o = overrides(out, "teacher", 0, sizes);
    o.extend([
        format!("sft.steps={}", sizes.teacher_sft),
        format!("run.periods={}", sizes.teacher_periods),
        format!("data.release.batch_size={}", sizes.teacher_prompts),
        format!("eval.every={}", sizes.teacher_periods),
    ]);
    let outcome = run(PipelineConfig::embedded(&o)?, RunOptions::default()).await?;
    let accuracy = outcome.evals.last().map_or(f64::NAN, |e| e.accuracy);
    Ok((accuracy, outcome.dir.checkpoints().join("final").join("policy")))
}

/// Runs the teacher, then the student twice: GRPO alone and distillation.
pub(crate) async fn distillation(out: &Path, sizes: &Sizes) -> anyhow::Result<Outcome> {
    let (teacher_accuracy, teacher_path) = teacher(out, sizes).await?;
    let distill =
        format!("trainer.distill={{ kind = \"hf\", path = {:?} }}", teacher_path.display().to_string());
    let mut arms = Vec::new();
    for (name, extra) in [("grpo", None), ("distill", Some(distill))] {
        let mut o = overrides(out, name, sizes.student_seed, sizes);
        o.extend([
            format!("sft.steps={}", sizes.student_sft),
            format!("run.periods={}", sizes.periods),
            format!("data.release.batch_size={}", sizes.prompts_per_period),
            format!("trainer.schedule.warmup_steps={}", sizes.warmup_steps),
            format!("eval.every={}", sizes.eval_every),
        ]);
        o.extend(extra);
        let outcome = run(PipelineConfig::embedded(&o)?, RunOptions::default()).await?;
        arms.push(Arm {
            accuracy: outcome.evals.iter().map(|e| (e.after_periods, e.accuracy)).collect(),
            reverse_kl: outcome.periods.iter().filter_map(|p| p.step.distill_kl).collect(),
        });
    }
    let distill = arms.pop().expect("two arms");
    let grpo = arms.pop().expect("two arms");
    Ok(Outcome { teacher: teacher_accuracy, grpo, distill })
}

/// The table of an outcome: held-out accuracy of both arms at every evaluation, and
/// the distilled student's reverse KL to the teacher in the period before it.
pub(crate) fn table(outcome: &Outcome) -> String {
    let mut s = format!(
        "teacher held-out accuracy: {:.1}%\n| period | GRPO alone | distillation | reverse KL per token |\n|---:|---:|---:|---:|\n",
        100.0 * outcome.teacher,
    );
    for ((k, g), (_, d)) in outcome.grpo.accuracy.iter().zip(&outcome.distill.accuracy) {
        let kl = k.checked_sub(1).and_then(|i| outcome.distill.reverse_kl.get(i as usize));
        let kl = kl.map_or_else(|| "–".to_owned(), |v| format!("{v:.3}"));
        s.push_str(&format!("| {k} | {:.1}% | {:.1}% | {kl} |\n", 100.0 * g, 100.0 * d));
    }
    s
}
