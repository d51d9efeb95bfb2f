//! The tests of a code task: what the data loader puts in [`crate::Prompt::reference`]
//! (as JSON) and the code-execution reward runs a program against.
//!
//! ```json
//! {"kind": "assert", "prefix": "def add(a, b):\n", "setup": "", "tests": ["assert add(1, 2) == 3"]}
//! {"kind": "io", "cases": [{"input": "1 2\n", "output": "3\n"}]}
//! ```
//!
//! Both sides use this one type, so a task and its scorer cannot disagree on the
//! format; the JSON itself is written and read by the crates that do I/O.

use serde::{Deserialize, Serialize};

/// How a program is tested.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum CodeTests {
    /// Assert-style (HumanEval, MBPP): `prefix`, then the program, then `setup` run
    /// as one module; then each of `tests` in turn in the same namespace. A test
    /// passes when it raises nothing.
    Assert {
        /// Code placed before the program (HumanEval's prompt: imports and the
        /// signature a body-only answer continues). May be empty.
        #[serde(default)]
        prefix: String,
        /// Code run after the program, before the tests (HumanEval's `check`
        /// definition, MBPP's `test_setup_code`). May be empty.
        #[serde(default)]
        setup: String,
        /// The tests, one statement or block each (`assert f(1) == 2`, `check(f)`).
        tests: Vec<String>,
    },
    /// Standard input and output: the program runs once per case with `input` on
    /// its standard input and passes the case when its standard output equals
    /// `output` (trailing whitespace of every line and of the whole ignored).
    Io {
        /// The cases.
        cases: Vec<IoCase>,
    },
}

/// One stdin/stdout case of [`CodeTests::Io`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoCase {
    /// Written to the program's standard input.
    pub input: String,
    /// The expected standard output.
    pub output: String,
}

impl CodeTests {
    /// How many tests (asserts or cases) there are.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Self::Assert { tests, .. } => tests.len(),
            Self::Io { cases } => cases.len(),
        }
    }

    /// True when there is no test at all: such a task cannot be scored.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
