//! When a response ends: stop tokens, stop strings, and the token budget.

use metronome_core::{FinishReason, TokenId};

/// The stop conditions of one request, resolved against the tokenizer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopConditions {
    /// Token ids that end a response; the stop token stays the response's last token.
    pub token_ids: Vec<TokenId>,
    /// Strings that end a response when they appear in its decoded text.
    pub strings: Vec<String>,
}

impl StopConditions {
    /// True when `token` is a stop token.
    #[must_use]
    pub fn is_stop_token(&self, token: TokenId) -> bool {
        self.token_ids.contains(&token)
    }

    /// The earliest stop string in `text` as `(byte offset, byte length)`, looking only
    /// at matches that end after byte `checked` (the text length at the previous check,
    /// so each step scans only the new tail). Among matches at the same offset the
    /// longest wins.
    #[must_use]
    pub fn find_stop_string(&self, text: &str, checked: usize) -> Option<(usize, usize)> {
        let longest = self.strings.iter().map(String::len).max()?;
        let mut from = checked.saturating_sub(longest.saturating_sub(1)).min(text.len());
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        self.strings
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|i| (from + i, s.len())))
            .min_by_key(|&(at, len)| (at, std::cmp::Reverse(len)))
    }
}

/// What ended a response, with the byte length its text keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Finish {
    pub(crate) reason: FinishReason,
    /// For a stop string: where the text is cut (at the start of the stop string, or
    /// after it when the config keeps it).
    pub(crate) text_len: Option<usize>,
}

impl Finish {
    pub(crate) fn new(reason: FinishReason) -> Self {
        Self { reason, text_len: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_found_across_token_boundaries() {
        let stop = StopConditions { token_ids: vec![2], strings: vec!["</a>".into(), "##".into()] };
        assert!(stop.is_stop_token(2));
        assert!(!stop.is_stop_token(3));
        assert_eq!(stop.find_stop_string("x = 1 </", 0), None);
        // The string completes over the previous check's boundary (8 bytes checked).
        assert_eq!(stop.find_stop_string("x = 1 </a>", 8), Some((6, 4)));
        assert_eq!(stop.find_stop_string("a##b</a>", 0), Some((1, 2)));
        // Matches wholly inside the already-checked text are not reported again.
        assert_eq!(stop.find_stop_string("##abcdefgh", 10), None);
        // Multi-byte text never splits a character.
        assert_eq!(stop.find_stop_string("ééé##", 5), Some((6, 2)));
        assert_eq!(StopConditions::default().find_stop_string("anything", 0), None);
    }
}
