//! The code-execution reward: programs run in the bubblewrap sandbox against
//! assert-style and stdin/stdout tests; bad tasks and configs give errors that name
//! the place.

use metronome_core::{CodeTests, IoCase, Prompt, PromptId, RewardFn};
use metronome_reward::{
    CodeConfig, CodeReward, CodeScoring, Extract, PoolConfig, RewardConfig, SandboxConfig, ScorerConfig,
    VerdictKind,
};

use crate::common::{completion, group};

/// Limits small enough for quick tests.
pub(crate) fn quick() -> CodeConfig {
    CodeConfig {
        time_budget_ms: 2_000,
        sandbox: SandboxConfig { wall_ms: 2_000, cpu_s: 1, memory_mb: 256, ..SandboxConfig::default() },
        ..CodeConfig::default()
    }
}

pub(crate) fn reward(config: CodeConfig) -> CodeReward {
    config.build().expect("the sandbox starts on this machine (bubblewrap installed, user namespaces on)")
}

pub(crate) fn task(tests: &CodeTests) -> Prompt {
    Prompt { id: PromptId(3), reference: Some(serde_json::to_string(tests).unwrap()), ..Prompt::default() }
}

fn asserts(tests: &[&str]) -> CodeTests {
    CodeTests::Assert {
        prefix: String::new(),
        setup: String::new(),
        tests: tests.iter().map(|t| (*t).to_owned()).collect(),
    }
}

fn io(cases: &[(&str, &str)]) -> CodeTests {
    CodeTests::Io {
        cases: cases.iter().map(|(i, o)| IoCase { input: (*i).into(), output: (*o).into() }).collect(),
    }
}

#[test]
fn assert_tests_pass_fail_and_count() {
    let code = reward(CodeConfig { scoring: CodeScoring::Fraction, ..quick() });
    let tests = asserts(&["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0"]);
    let right = code.verdict_for("```python\ndef add(a, b):\n    return a + b\n```", &tests).unwrap();
    assert_eq!((right.kind, right.passed, right.total), (VerdictKind::Failed, 2, 3), "{right:?}");
    assert!(right.detail.contains("test 1 failed: AssertionError"), "{}", right.detail);
    let reward = code.reward_of(&right);
    assert!((reward.total - 2.0 / 3.0).abs() < 1e-6);
    assert_eq!(reward.parts["correct"], 0.0);
    assert_eq!(reward.parts["failed"], 1.0);

    let all = asserts(&["assert add(1, 2) == 3", "assert add(0, 0) == 0"]);
    let pass = code.verdict_for("```python\ndef add(a, b):\n    return a + b\n```", &all).unwrap();
    assert_eq!((pass.kind, pass.passed), (VerdictKind::Passed, 2), "{pass:?}");
    assert_eq!(code.reward_of(&pass).parts["correct"], 1.0);

    let broken = code.verdict_for("```python\ndef add(a, b)\n    return a + b\n```", &all).unwrap();
    assert_eq!(broken.kind, VerdictKind::Error, "{broken:?}");
    assert!(broken.detail.contains("SyntaxError"), "{}", broken.detail);
    assert_eq!(code.reward_of(&broken).total, 0.0);
}

#[test]
fn humaneval_style_prefix_setup_and_check() {
    let code = reward(quick());
    let tests = CodeTests::Assert {
        prefix: "from typing import List\n\ndef total(xs: List[int]) -> int:\n    \"\"\"Sum.\"\"\"\n".into(),
        setup: "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n"
            .into(),
        tests: vec!["check(total)".into()],
    };
    // A base model continues the prompt with the body only.
    let body = Extract::Whole;
    let code_whole = reward(CodeConfig { extract: body, ..quick() });
    let v = code_whole.verdict_for("    return sum(xs)\n", &tests).unwrap();
    assert_eq!(v.kind, VerdictKind::Passed, "{v:?}");
    // A chat model writes the whole function in a block; the prefix's imports still count.
    let v = code
        .verdict_for("Sure:\n```python\ndef total(xs: List[int]) -> int:\n    return 0\n```", &tests)
        .unwrap();
    assert_eq!(v.kind, VerdictKind::Failed, "{v:?}");
}

#[test]
fn io_cases_compare_outputs_outside_the_sandbox() {
    let tests = io(&[("1 2\n", "3\n"), ("10 5\n", "15"), ("-3 3", "0\n\n")]);
    let code = reward(CodeConfig { scoring: CodeScoring::Fraction, ..quick() });
    let sum = "```python\na, b = map(int, input().split())\nprint(a + b)   \n```";
    let v = code.verdict_for(sum, &tests).unwrap();
    assert_eq!((v.kind, v.passed, v.total), (VerdictKind::Passed, 3, 3), "{v:?}");
    let v = code.verdict_for("```python\nprint(3)\n```", &tests).unwrap();
    assert_eq!((v.kind, v.passed), (VerdictKind::Failed, 1), "{v:?}");
    assert!(v.detail.contains("expected `15`, got `3`"), "{}", v.detail);
    // Pass/fail scoring stops at the first case that fails.
    let all = reward(quick());
    let v = all.verdict_for("```python\nprint(3)\n```", &tests).unwrap();
    assert_eq!((v.kind, v.passed), (VerdictKind::Failed, 1), "{v:?}");
    assert_eq!(all.reward_of(&v).total, 0.0);
    // A large input is fed while the output is read.
    let big = "7\n".repeat(200_000);
    let tests = io(&[(&big, "1400000")]);
    let v = code
        .verdict_for("```python\nimport sys\nprint(sum(map(int, sys.stdin.read().split())))\n```", &tests)
        .unwrap();
    assert_eq!(v.kind, VerdictKind::Passed, "{v:?}");
}

#[test]
fn extraction_modes_and_program_size() {
    let tests = asserts(&["assert f() == 1"]);
    let fenced = reward(CodeConfig { extract: Extract::Fenced, ..quick() });
    let v = fenced.verdict_for("def f():\n    return 1\n", &tests).unwrap();
    assert_eq!(v.kind, VerdictKind::NoProgram);
    let small = reward(CodeConfig { max_program_bytes: 10, ..quick() });
    let v = small.verdict_for("```python\ndef f():\n    return 1\n```", &tests).unwrap();
    assert_eq!(v.kind, VerdictKind::TooLong, "{v:?}");
    assert_eq!(small.reward_of(&v).parts["too_long"], 1.0);
}

#[test]
fn tasks_without_usable_tests_are_scoring_failures_naming_the_prompt() {
    let code = reward(quick());
    let c = completion(0, "```python\nprint(1)\n```");
    let cases = [
        (Prompt { id: PromptId(11), ..Prompt::default() }, "prompt 11 has no code tests"),
        (
            Prompt { id: PromptId(12), reference: Some("assert f() == 1".into()), ..Prompt::default() },
            "prompt 12 reference is not a code test spec",
        ),
        (task(&asserts(&[])), "prompt 3 has a code test spec without any test"),
        (
            Prompt {
                id: PromptId(13),
                reference: Some(r#"{"kind": "io", "cases": [{"input": 1}]}"#.into()),
                ..Prompt::default()
            },
            "prompt 13 reference is not a code test spec",
        ),
    ];
    for (prompt, expected) in cases {
        let r = code.score(&prompt, &c);
        let failure = r.failure.expect("a scoring failure");
        assert!(failure.contains(expected), "{failure}");
        assert_eq!(r.total, 0.0);
    }
}

#[test]
fn a_sandbox_that_cannot_start_is_an_error_at_build_time() {
    let missing = CodeConfig {
        sandbox: SandboxConfig { bwrap: "/nonexistent/bwrap".into(), ..SandboxConfig::default() },
        ..CodeConfig::default()
    };
    let e = missing.build().unwrap_err().to_string();
    assert!(e.starts_with("code sandbox cannot start on this machine"), "{e}");
    assert!(e.contains("/nonexistent/bwrap") && e.contains("sandbox.bwrap"), "{e}");
    // An interpreter the sandbox does not show (a pyenv shim under a home directory).
    let hidden = CodeConfig {
        sandbox: SandboxConfig {
            interpreter: "/root/.pyenv/shims/python3".into(),
            ..SandboxConfig::default()
        },
        ..CodeConfig::default()
    };
    let e = hidden.build().unwrap_err().to_string();
    assert!(e.contains("sandbox.interpreter") && e.contains("read_only"), "{e}");
    // A probe that fails inside the sandbox: an interpreter that exits non-zero.
    let failing = CodeConfig {
        sandbox: SandboxConfig { interpreter: "/usr/bin/false".into(), ..SandboxConfig::default() },
        ..CodeConfig::default()
    };
    let e = failing.build().unwrap_err().to_string();
    assert!(e.contains("a probe program failed"), "{e}");
    let bad = CodeConfig {
        sandbox: SandboxConfig { processes: 1, ..SandboxConfig::default() },
        ..CodeConfig::default()
    };
    assert!(bad.build().unwrap_err().to_string().contains("sandbox.processes"));
}

#[test]
fn the_pool_time_limit_must_cover_the_code_budget() {
    let config = |time_limit_ms| RewardConfig::Local {
        scorer: ScorerConfig::Code(CodeConfig { time_budget_ms: 6_000, ..CodeConfig::default() }),
        pool: PoolConfig { time_limit_ms, ..PoolConfig::default() },
    };
    let e = config(5_000).build(Default::default()).err().expect("too short a time limit").to_string();
    assert!(e.contains("pool.time_limit_ms") && e.contains("7000"), "{e}");
    assert!(config(8_000).build(Default::default()).is_ok());
    // From TOML, as a run config writes it.
    let toml_config: RewardConfig = toml::from_str(
        "kind = \"local\"\npool = { workers = 2, time_limit_ms = 9000 }\n[scorer]\nkind = \"code\"\nscoring = \"fraction\"\nsandbox = { wall_ms = 1500 }\n",
    )
    .unwrap();
    assert!(toml_config.build(Default::default()).is_ok());
}

#[test]
fn a_group_is_scored_on_the_pool_with_the_reason_in_the_parts() {
    let scorer = RewardConfig::Local {
        scorer: ScorerConfig::Code(quick()),
        pool: PoolConfig { workers: 4, time_limit_ms: 4_000, ..PoolConfig::default() },
    }
    .build(Default::default())
    .unwrap();
    let tests = asserts(&["assert f(2) == 4"]);
    let texts = [
        "```python\ndef f(x):\n    return 2 * x\n```",
        "```python\ndef f(x):\n    return x + 1\n```",
        "```python\nimport time\ntime.sleep(60)\n```",
        "no code here, just words",
    ];
    let g = group(task(&tests), &texts);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let scored = runtime.block_on(scorer.score(g)).unwrap();
    let totals: Vec<f32> = scored.rewards.iter().map(|r| r.total).collect();
    assert_eq!(totals, [1.0, 0.0, 0.0, 0.0]);
    assert_eq!(scored.rewards[1].parts.get("failed"), Some(&1.0));
    assert_eq!(scored.rewards[2].parts.get("timeout"), Some(&1.0));
    // Words are run as a program (fenced_or_whole) and fail as one.
    assert_eq!(scored.rewards[3].parts.get("error"), Some(&1.0));
    assert!(scored.rewards.iter().all(|r| r.failure.is_none()), "{:?}", scored.rewards);
}
