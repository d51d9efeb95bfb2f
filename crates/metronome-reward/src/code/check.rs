//! Running a program against its tests in the sandbox, and the verdict.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use metronome_core::{CodeTests, IoCase, mix64};

use super::sandbox::{KILL_GRACE, Run, SIGXCPU, Sandbox, Stopped};

/// The harness of assert-style tests (see its own comments).
const HARNESS: &str = include_str!("harness.py");

/// How a program did, as a bounded set of reasons (the `verdict` label of
/// `metronome_reward_code_executions_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum VerdictKind {
    /// Every test passed.
    Passed,
    /// The program ran to the end and a test failed (an assertion, a wrong output).
    Failed,
    /// The program did not run to the tests: a syntax error, an exception, an exit.
    Error,
    /// It ran past the wall-time limit (sleeping, waiting).
    Timeout,
    /// It used up its CPU time (a busy loop).
    CpuLimit,
    /// It ran out of address space.
    MemoryLimit,
    /// It wrote more than the output limit.
    OutputLimit,
    /// A signal ended it (its own, or the hard CPU limit).
    Killed,
    /// The completion holds no program (no fenced block, or a blank one).
    NoProgram,
    /// The program is longer than the configured maximum.
    TooLong,
}

impl VerdictKind {
    /// Every kind, in the order of the enum.
    pub const ALL: [Self; 10] = [
        Self::Passed,
        Self::Failed,
        Self::Error,
        Self::Timeout,
        Self::CpuLimit,
        Self::MemoryLimit,
        Self::OutputLimit,
        Self::Killed,
        Self::NoProgram,
        Self::TooLong,
    ];

    /// The name used in metric labels and reward parts.
    #[must_use]
    pub const fn label(self) -> &'static str {
        match self {
            Self::Passed => "passed",
            Self::Failed => "failed",
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::CpuLimit => "cpu_limit",
            Self::MemoryLimit => "memory_limit",
            Self::OutputLimit => "output_limit",
            Self::Killed => "killed",
            Self::NoProgram => "no_program",
            Self::TooLong => "too_long",
        }
    }
}

/// The outcome of running one program against its tests.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// Why it scored what it did.
    pub kind: VerdictKind,
    /// Tests passed.
    pub passed: usize,
    /// Tests in all.
    pub total: usize,
    /// The reason in words (`test 2 of 3 failed: AssertionError`, `ran past its wall-time
    /// limit of 4000 ms`).
    pub detail: String,
    /// Wall time of the sandboxed runs.
    pub elapsed: Duration,
}

impl Verdict {
    /// The fraction of tests passed (0 with no test).
    #[must_use]
    pub fn fraction(&self) -> f32 {
        if self.total == 0 { 0.0 } else { self.passed as f32 / self.total as f32 }
    }

    pub(crate) fn without_run(kind: VerdictKind, total: usize, detail: impl Into<String>) -> Self {
        Self { kind, passed: 0, total, detail: detail.into(), elapsed: Duration::ZERO }
    }
}

/// A fresh nonce per run: the harness's reports carry it and the program never sees it.
fn nonce() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    // `RandomState` keys come from the OS's random source.
    let mut a = std::collections::hash_map::RandomState::new().build_hasher();
    a.write_u64(count);
    let mut b = std::collections::hash_map::RandomState::new().build_hasher();
    b.write_u64(mix64(count));
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("mtr{:016x}{:016x}", a.finish() ^ nanos as u64, b.finish())
}

/// What a run that was stopped, or killed by a signal, says about the program; `None`
/// for a run that ended by itself with an exit code.
fn limit_of(run: &Run, sandbox: &Sandbox, wall: Duration) -> Option<(VerdictKind, String)> {
    let c = sandbox.config();
    match run.stopped {
        Some(Stopped::WallTime) => {
            return Some((
                VerdictKind::Timeout,
                format!("ran past its wall-time limit of {} ms", wall.as_millis()),
            ));
        }
        Some(Stopped::Output) => {
            return Some((
                VerdictKind::OutputLimit,
                format!("wrote more than {} bytes of output", c.output_bytes),
            ));
        }
        None => {}
    }
    match run.signal() {
        Some(SIGXCPU) => {
            Some((VerdictKind::CpuLimit, format!("used up its cpu time limit of {} s", c.cpu_s)))
        }
        Some(signal) => Some((VerdictKind::Killed, format!("was killed by signal {signal}"))),
        None => None,
    }
}

/// The last line of standard error that says something, for an error's reason.
fn last_words(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let line = text.lines().rev().map(str::trim).find(|l| !l.is_empty()).unwrap_or("no message");
    clip(line, 200)
}

fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

fn is_memory(reason: &str) -> bool {
    reason.starts_with("MemoryError")
}

/// Runs `program` against `tests` within `budget`; `stop_early` ends the io cases at
/// the first that does not pass. An `Err` is the sandbox failing to run, not the
/// program.
pub(crate) fn check(
    sandbox: &Sandbox,
    program: &str,
    tests: &CodeTests,
    budget: Duration,
    stop_early: bool,
) -> std::io::Result<Verdict> {
    let start = Instant::now();
    let mut verdict = match tests {
        CodeTests::Assert { prefix, setup, tests } => {
            check_asserts(sandbox, &format!("{prefix}{program}"), setup, tests, budget)?
        }
        CodeTests::Io { cases } => check_io(sandbox, program, cases, start + budget, stop_early)?,
    };
    verdict.elapsed = start.elapsed();
    Ok(verdict)
}

fn check_asserts(
    sandbox: &Sandbox,
    program: &str,
    setup: &str,
    tests: &[String],
    budget: Duration,
) -> std::io::Result<Verdict> {
    let total = tests.len();
    let nonce = nonce();
    let args = ["-c".to_owned(), HARNESS.to_owned(), program.to_owned()];
    // The tests go on standard input, not the command line, where the program could
    // read them (`/proc/self/cmdline`) and answer them from a table.
    let spec = serde_json::json!({ "setup": setup, "tests": tests });
    let input = format!("{nonce}\n{spec}\n");
    let wall = budget.min(Duration::from_millis(sandbox.config().wall_ms));
    let run = sandbox.run(&args, input.as_bytes(), wall)?;

    // The harness's reports: lines that start with the nonce.
    let stdout = String::from_utf8_lossy(&run.stdout);
    let prefix = format!("{nonce} ");
    let mut passed = 0;
    let mut first_failure: Option<(usize, String)> = None;
    let mut error: Option<String> = None;
    let mut done = false;
    let mut ready = false;
    for line in stdout.lines().filter_map(|l| l.strip_prefix(&prefix)) {
        let mut words = line.splitn(3, ' ');
        match (words.next(), words.next(), words.next()) {
            (Some("pass"), Some(_), _) => passed += 1,
            (Some("fail"), Some(i), reason) if first_failure.is_none() => {
                first_failure = Some((i.parse().unwrap_or(0), reason.unwrap_or("").to_owned()));
            }
            (Some("error"), Some(part), reason) => error = Some(format!("{part}: {}", reason.unwrap_or(""))),
            (Some("ready"), _, _) => ready = true,
            (Some("done"), _, _) => done = true,
            _ => {}
        }
    }
    let passed = passed.min(total);
    let verdict = |kind, detail: String| Verdict { kind, passed, total, detail, elapsed: run.elapsed };
    if let Some((kind, detail)) = limit_of(&run, sandbox, wall) {
        let at = if ready { format!(" after {passed} of {total} tests passed") } else { String::new() };
        return Ok(verdict(kind, format!("{detail}{at}")));
    }
    if let Some(error) = error {
        let kind = if error.split_once(": ").is_some_and(|(_, r)| is_memory(r)) {
            VerdictKind::MemoryLimit
        } else {
            VerdictKind::Error
        };
        return Ok(verdict(kind, format!("the {error}")));
    }
    if !done {
        // No final report: the process ended (or was ended) before the tests did.
        let detail = format!(
            "the process ended before the tests finished ({}, {passed} of {total} passed); stderr: {}",
            run.status,
            last_words(&run.stderr)
        );
        return Ok(verdict(VerdictKind::Error, detail));
    }
    Ok(match first_failure {
        None if passed == total => verdict(VerdictKind::Passed, format!("all {total} tests passed")),
        None => verdict(VerdictKind::Error, format!("only {passed} of {total} tests reported")),
        Some((i, reason)) => {
            let kind = if is_memory(&reason) { VerdictKind::MemoryLimit } else { VerdictKind::Failed };
            let mut detail = format!("{passed} of {total} tests passed; test {i} failed");
            if !reason.is_empty() {
                let _ = write!(detail, ": {reason}");
            }
            verdict(kind, detail)
        }
    })
}

/// Output compared line by line without trailing whitespace, trailing blank lines ignored.
fn normalise(text: &str) -> String {
    let mut lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    while lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    lines.join("\n")
}

fn check_io(
    sandbox: &Sandbox,
    program: &str,
    cases: &[IoCase],
    deadline: Instant,
    stop_early: bool,
) -> std::io::Result<Verdict> {
    let total = cases.len();
    let args = ["-c".to_owned(), program.to_owned()];
    let mut passed = 0;
    let mut first: Option<(VerdictKind, String)> = None;
    for (i, case) in cases.iter().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(50) {
            first.get_or_insert((
                VerdictKind::Timeout,
                format!("the time budget ran out before case {i} of {total}"),
            ));
            break;
        }
        let wall = left.min(Duration::from_millis(sandbox.config().wall_ms));
        let run = sandbox.run(&args, case.input.as_bytes(), wall)?;
        let outcome = if let Some(limit) = limit_of(&run, sandbox, wall) {
            Some(limit)
        } else if !run.status.success() {
            let words = last_words(&run.stderr);
            let kind = if is_memory(&words) { VerdictKind::MemoryLimit } else { VerdictKind::Error };
            Some((kind, format!("exited with {}: {words}", run.status)))
        } else {
            let got = normalise(&String::from_utf8_lossy(&run.stdout));
            (got != normalise(&case.output)).then(|| {
                (
                    VerdictKind::Failed,
                    format!(
                        "wrong output: expected `{}`, got `{}`",
                        clip(&normalise(&case.output), 60),
                        clip(&got, 60)
                    ),
                )
            })
        };
        match outcome {
            None => passed += 1,
            Some((kind, detail)) => {
                first.get_or_insert((kind, format!("case {i} of {total}: {detail}")));
                if stop_early {
                    break;
                }
            }
        }
    }
    let (kind, detail) = first.unwrap_or((VerdictKind::Passed, format!("all {total} cases passed")));
    let detail =
        if kind == VerdictKind::Passed { detail } else { format!("{passed} of {total} passed; {detail}") };
    Ok(Verdict { kind, passed, total, detail, elapsed: Duration::ZERO })
}

/// The longest a check can take: the budget, and the kill grace of its last run.
pub(crate) fn worst_case(budget: Duration) -> Duration {
    budget + KILL_GRACE * 2
}
