//! Which part of a completion is the program.

use serde::{Deserialize, Serialize};

/// Where the program is in a completion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Extract {
    /// The last fenced block (```` ``` ````, ```` ```python ````, ```` ```py ````);
    /// a completion without one has no program. A block still open at the end (a
    /// response cut at its token limit) runs to the end of the text.
    Fenced,
    /// The whole completion, as written (a base model continuing HumanEval's prompt).
    Whole,
    /// The last fenced block when there is one, else the whole completion.
    #[default]
    FencedOrWhole,
}

/// Languages whose fenced blocks hold the program (an untagged fence counts too).
const PYTHON_TAGS: &[&str] = &["", "python", "py", "python3"];

/// The program of `text` under `mode`, or `None` when there is none (or it is blank).
#[must_use]
pub fn extract_program(text: &str, mode: Extract) -> Option<&str> {
    let program = match mode {
        Extract::Fenced => last_fenced(text)?,
        Extract::Whole => text,
        Extract::FencedOrWhole => last_fenced(text).unwrap_or(text),
    };
    (!program.trim().is_empty()).then_some(program)
}

/// The body of the last Python (or untagged) fenced block.
fn last_fenced(text: &str) -> Option<&str> {
    let mut found = None;
    // (offset of the body, whether the block holds Python)
    let mut open: Option<(usize, bool)> = None;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let start = offset;
        offset += line.len();
        let trimmed = line.trim();
        let Some(tag) = trimmed.strip_prefix("```") else { continue };
        match open {
            None => open = Some((offset, PYTHON_TAGS.contains(&tag.trim().to_ascii_lowercase().as_str()))),
            // A closing fence is bare; a tagged one inside a block is content.
            Some((body, python)) if tag.trim().is_empty() => {
                if python {
                    found = Some(&text[body..start]);
                }
                open = None;
            }
            Some(_) => {}
        }
    }
    match open {
        Some((body, true)) => Some(&text[body..]),
        _ => found,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_last_python_block() {
        let text =
            "First:\n```python\nx = 1\n```\nthen\n```bash\nls\n```\nfinally\n```py\nprint(2)\n```\nbye";
        assert_eq!(extract_program(text, Extract::Fenced), Some("print(2)\n"));
        assert_eq!(extract_program("```\nprint(3)\n```", Extract::Fenced), Some("print(3)\n"));
        // Cut off before the closing fence.
        assert_eq!(extract_program("```python\nprint(4)\nprint(", Extract::Fenced), Some("print(4)\nprint("));
    }

    #[test]
    fn modes_fall_back_or_not() {
        let plain = "    return a + b\n";
        assert_eq!(extract_program(plain, Extract::Fenced), None);
        assert_eq!(extract_program(plain, Extract::Whole), Some(plain));
        assert_eq!(extract_program(plain, Extract::FencedOrWhole), Some(plain));
        assert_eq!(extract_program("```bash\nls\n```", Extract::Fenced), None);
        assert_eq!(extract_program("```python\n\n```", Extract::FencedOrWhole), None);
        assert_eq!(extract_program("  \n", Extract::Whole), None);
    }
}
