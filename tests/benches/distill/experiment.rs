//! The distillation experiment shared by `tests/tests/distillation.rs` (short, asserts
//! the direction) and `tests/benches/distillation.rs` (longer, prints the tables).
//!
//! A teacher is trained first: the embedded default run on the task with a warm start
//! (and, for arithmetic, the default's GRPO periods); its final checkpoint's
//! `policy/` folder is the teacher. Then a fresh student is warm-started less, and
//! from that same student two runs of the same periods with the same settings: GRPO
//! alone, and on-policy distillation from the teacher (`trainer.distill` alone) with
//! each signal asked for: the sampled token's reverse KL as the advantage, or the
//! exact reverse KL over the vocabulary as the loss. Held-out accuracy is measured
//! every `eval_every` periods, sampled at temperature 1 as `[eval]` does.
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
    /// The student runs, each from the same warm-started student.
    pub(crate) students: Vec<Student>,
}

/// How one student run trains.
#[derive(Clone, Debug)]
pub(crate) struct Student {
    /// Its name in the tables.
    pub(crate) name: &'static str,
    /// `trainer.distill.signal` (`"sampled"`, `"full"`) of a distillation from the
    /// teacher (`mode = "alone"`, unless `overrides` set it); `None`: GRPO alone.
    pub(crate) signal: Option<&'static str>,
    /// Settings of its own beside the experiment's (`trainer.mini_steps=4`, say).
    pub(crate) overrides: &'static [&'static str],
}

impl Student {
    /// GRPO alone at the default's settings.
    pub(crate) const GRPO: Self = Self { name: "GRPO alone", signal: None, overrides: &[] };
}

/// One student run.
#[derive(Clone, Debug)]
pub(crate) struct Arm {
    /// Its [`Student::name`].
    pub(crate) name: &'static str,
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
    /// The student runs, in the order of [`Sizes::students`].
    pub(crate) arms: Vec<Arm>,
}

impl Outcome {
    /// The arm of the student named `name`.
    #[allow(dead_code, reason = "the test reads it, the bench does not")]
    pub(crate) fn arm(&self, name: &str) -> &Arm {
        self.arms.iter().find(|a| a.name == name).unwrap_or_else(|| panic!("no student `{name}`"))
    }
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

/// Runs the teacher, then each of the students from the same warm start.
pub(crate) async fn distillation(out: &Path, sizes: &Sizes) -> anyhow::Result<Outcome> {
    let (teacher_accuracy, teacher_path) = teacher(out, sizes).await?;
    let teacher_path = teacher_path.display().to_string();
    let mut arms = Vec::new();
    for student in &sizes.students {
        let name = student.name.replace(|c: char| !c.is_ascii_alphanumeric(), "_");
        let mut o = overrides(out, &name, sizes.student_seed, sizes);
        o.extend([
            format!("sft.steps={}", sizes.student_sft),
            format!("run.periods={}", sizes.periods),
            format!("data.release.batch_size={}", sizes.prompts_per_period),
            format!("trainer.schedule.warmup_steps={}", sizes.warmup_steps),
            format!("eval.every={}", sizes.eval_every),
        ]);
        o.extend(student.signal.map(|signal| {
            format!("trainer.distill={{ kind = \"hf\", path = {teacher_path:?}, signal = {signal:?} }}")
        }));
        o.extend(student.overrides.iter().map(|&s| s.to_owned()));
        let outcome = run(PipelineConfig::embedded(&o)?, RunOptions::default()).await?;
        arms.push(Arm {
            name: student.name,
            accuracy: outcome.evals.iter().map(|e| (e.after_periods, e.accuracy)).collect(),
            reverse_kl: outcome.periods.iter().filter_map(|p| p.step.distill_kl).collect(),
        });
    }
    Ok(Outcome { teacher: teacher_accuracy, arms })
}

/// The table of an outcome: held-out accuracy of every arm at every evaluation, and
/// beside each distilled one its reverse KL per token to the teacher in the period
/// before.
pub(crate) fn table(outcome: &Outcome) -> String {
    let mut s = format!("teacher held-out accuracy: {:.1}%\n| period |", 100.0 * outcome.teacher);
    let mut rule = String::from("|---:|");
    for arm in &outcome.arms {
        s.push_str(&format!(" {} |", arm.name));
        rule.push_str("---:|");
        if !arm.reverse_kl.is_empty() {
            s.push_str(" reverse KL |");
            rule.push_str("---:|");
        }
    }
    s.push_str(&format!("\n{rule}\n"));
    let points = outcome.arms.first().map_or(&[][..], |a| &a.accuracy[..]);
    for (i, (k, _)) in points.iter().enumerate() {
        s.push_str(&format!("| {k} |"));
        for arm in &outcome.arms {
            s.push_str(&format!(" {:.1}% |", 100.0 * arm.accuracy.get(i).map_or(f64::NAN, |a| a.1)));
            if !arm.reverse_kl.is_empty() {
                let kl = k.checked_sub(1).and_then(|p| arm.reverse_kl.get(p as usize));
                s.push_str(&format!(" {} |", kl.map_or_else(|| "–".to_owned(), |v| format!("{v:.3}"))));
            }
        }
        s.push('\n');
    }
    s
}
