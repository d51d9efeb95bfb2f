//! Finding the final answer in a completion: `\boxed{…}`, `<answer>…</answer>`,
//! `#### …`, "the answer is …", or the last number.
//!
//! Every extractor is a constant number of linear scans over a tail of the text that
//! the caller has already bounded, and charges its scans to a [`Meter`].

use serde::{Deserialize, Serialize};

use crate::meter::Meter;

/// One way of locating the final answer in a completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Extractor {
    /// The content of the last `\boxed{…}` (or `\fbox{…}`), braces balanced.
    Boxed,
    /// The content of the last `<answer>…</answer>`.
    AnswerTag,
    /// The rest of the line after the last `####` (GSM8K style).
    Hashes,
    /// The rest of the sentence after the last "the answer is" / "answer:".
    AnswerIs,
    /// The last number in the text (digits with signs, separators, decimals, `/`).
    LastNumber,
}

impl Extractor {
    /// Every extractor, most explicit first: the default search order.
    pub const ALL: [Self; 5] = [Self::Boxed, Self::AnswerTag, Self::Hashes, Self::AnswerIs, Self::LastNumber];

    /// The explicit markers only, without "last number" guessing.
    pub const MARKED: [Self; 4] = [Self::Boxed, Self::AnswerTag, Self::Hashes, Self::AnswerIs];

    /// The candidate answer this extractor finds in `text`, if any.
    pub fn find<'a>(self, text: &'a str, meter: &mut Meter) -> Option<&'a str> {
        let found = match self {
            Self::Boxed => boxed(text, meter),
            Self::AnswerTag => answer_tag(text, meter),
            Self::Hashes => hashes(text, meter),
            Self::AnswerIs => answer_is(text, meter),
            Self::LastNumber => last_number(text, meter),
        };
        found.map(str::trim).filter(|s| !s.is_empty())
    }
}

/// The first candidate found by `extractors`, tried in order.
pub fn extract<'a>(text: &'a str, extractors: &[Extractor], meter: &mut Meter) -> Option<&'a str> {
    extractors.iter().find_map(|e| e.find(text, meter))
}

/// The last `max_bytes` bytes of `text`, cut at a character boundary: final answers
/// sit at the end, and bounding the input bounds every scan after it.
#[must_use]
pub fn tail(text: &str, max_bytes: usize) -> &str {
    if text.len() <= max_bytes {
        return text;
    }
    let mut start = text.len() - max_bytes;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// The content of the `{…}` group that opens at `open` (which must be `{`), or `None`
/// when it is not closed. The depth is a counter, not recursion.
pub(crate) fn braced<'a>(s: &'a str, open: usize, meter: &mut Meter) -> Option<(&'a str, usize)> {
    let bytes = s.as_bytes();
    if bytes.get(open) != Some(&b'{') {
        return None;
    }
    let mut depth = 0usize;
    for (i, &b) in bytes.iter().enumerate().skip(open) {
        meter.charge(1);
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    // `{` and `}` are ASCII, so both cuts are character boundaries.
                    return Some((&s[open + 1..i], i + 1));
                }
            }
            _ => {}
        }
    }
    None
}

fn boxed<'a>(text: &'a str, meter: &mut Meter) -> Option<&'a str> {
    meter.charge(2 * text.len());
    let start = [("\\boxed", text.rfind("\\boxed")), ("\\fbox", text.rfind("\\fbox"))]
        .into_iter()
        .filter_map(|(name, at)| at.map(|at| at + name.len()))
        .max()?;
    let rest = &text[start..];
    let skipped = rest.len() - rest.trim_start().len();
    braced(text, start + skipped, meter).map(|(inner, _)| inner)
}

fn answer_tag<'a>(text: &'a str, meter: &mut Meter) -> Option<&'a str> {
    meter.charge(text.len());
    let close = text.rfind("</answer>")?;
    meter.charge(close);
    let open = text[..close].rfind("<answer>")? + "<answer>".len();
    Some(&text[open..close])
}

fn hashes<'a>(text: &'a str, meter: &mut Meter) -> Option<&'a str> {
    meter.charge(text.len());
    let start = text.rfind("####")? + 4;
    let rest = text[start..].trim_start_matches('#');
    meter.charge(rest.len());
    Some(rest.lines().next().unwrap_or(""))
}

fn answer_is<'a>(text: &'a str, meter: &mut Meter) -> Option<&'a str> {
    // ASCII lower-casing keeps byte offsets, so positions found in `lower` index `text`.
    let lower = text.to_ascii_lowercase();
    meter.charge(text.len());
    let end = ["answer is", "answer:", "answer is:"]
        .iter()
        .filter_map(|p| {
            meter.charge(text.len());
            lower.rfind(p).map(|at| at + p.len())
        })
        .max()?;
    let rest = text[end..].trim_start_matches([':', ' ', '\t', '*']);
    let line = rest.lines().next().unwrap_or("");
    meter.charge(line.len());
    // The answer ends with its sentence; a separator inside a number has no space after it.
    let cut = [". ", ", ", "; ", " because", " since", " which"]
        .iter()
        .filter_map(|p| line.find(p))
        .min()
        .unwrap_or(line.len());
    meter.charge(6 * line.len());
    Some(&line[..cut])
}

fn last_number<'a>(text: &'a str, meter: &mut Meter) -> Option<&'a str> {
    let bytes = text.as_bytes();
    meter.charge(bytes.len());
    let last_digit = bytes.iter().rposition(u8::is_ascii_digit)?;
    let mut start = last_digit;
    while start > 0 && matches!(bytes[start - 1], b'0'..=b'9' | b'.' | b',' | b'/') {
        start -= 1;
    }
    if start > 0 && bytes[start - 1] == b'$' {
        start -= 1;
    }
    if start > 0 && bytes[start - 1] == b'-' {
        start -= 1;
    }
    let mut end = last_digit + 1;
    if bytes.get(end) == Some(&b'%') {
        end += 1;
    }
    // All cut points are ASCII bytes, hence character boundaries.
    let s = &text[start..end];
    Some(s.trim_start_matches([',', '/']))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find(e: Extractor, text: &str) -> Option<&str> {
        e.find(text, &mut Meter::new())
    }

    #[test]
    fn boxed_takes_the_last_and_balances_braces() {
        assert_eq!(
            find(Extractor::Boxed, r"first \boxed{1} then \boxed{\frac{1}{2}}."),
            Some(r"\frac{1}{2}")
        );
        assert_eq!(find(Extractor::Boxed, r"\fbox{7}"), Some("7"));
        assert_eq!(find(Extractor::Boxed, r"\boxed {3}"), Some("3"));
        assert_eq!(find(Extractor::Boxed, r"\boxed{unclosed"), None);
    }

    #[test]
    fn markers() {
        assert_eq!(find(Extractor::AnswerTag, "<answer> 42 </answer>"), Some("42"));
        assert_eq!(find(Extractor::Hashes, "so\n#### 1,234\nmore"), Some("1,234"));
        assert_eq!(find(Extractor::AnswerIs, "Thus, the answer is 12. Done"), Some("12"));
        assert_eq!(find(Extractor::AnswerIs, "Final Answer: -3.5"), Some("-3.5"));
        assert_eq!(find(Extractor::LastNumber, "it costs $1,250.50."), Some("$1,250.50"));
        assert_eq!(find(Extractor::LastNumber, "so 3/4 of -7"), Some("-7"));
        assert_eq!(find(Extractor::LastNumber, "no digits"), None);
    }

    #[test]
    fn tail_cuts_at_char_boundary() {
        let s = "ééé";
        assert_eq!(tail(s, 3), "é");
        assert_eq!(tail(s, 100), s);
    }
}
