//! Tokenizers implementing [`metronome_core::Tokenizer`]: a built-in character
//! tokenizer for the tiny tasks, `tokenizer.json` files through the `tokenizers`
//! crate, and the GPT-2-style BPE embedded in GGUF files. Chat templates from the
//! model files are rendered with `minijinja`.

use std::path::Path;

use metronome_core::{ChatMessage, TokenId};
use serde_json::Value;

use crate::{Error, Result};

fn core_err(e: impl std::fmt::Display) -> metronome_core::Error {
    metronome_core::Error::stage("model", Error::Tokenizer(e.to_string()))
}

/// A character-level tokenizer: `<pad>`, `<bos>`, `<eos>`, then newline and the 95
/// printable ASCII characters, one id each. It has no chat template: tiny tasks
/// format prompts themselves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CharTokenizer;

impl CharTokenizer {
    /// Padding id.
    pub const PAD: TokenId = 0;
    /// Beginning-of-sequence id.
    pub const BOS: TokenId = 1;
    /// End-of-sequence id (the stop token).
    pub const EOS: TokenId = 2;
    /// The id of `'\n'`; printable ASCII `' '..='~'` follows from `NEWLINE + 1`.
    pub const NEWLINE: TokenId = 3;
    /// Number of ids: 3 specials, newline, 95 printable characters.
    pub const VOCAB_SIZE: usize = 99;

    /// The id of one character, if it is in the vocabulary.
    #[must_use]
    pub fn id_of(c: char) -> Option<TokenId> {
        match c {
            '\n' => Some(Self::NEWLINE),
            ' '..='~' => Some(Self::NEWLINE + 1 + (c as u32 - ' ' as u32)),
            _ => None,
        }
    }

    /// The character of a non-special id.
    #[must_use]
    pub fn char_of(id: TokenId) -> Option<char> {
        match id {
            Self::NEWLINE => Some('\n'),
            i if i > Self::NEWLINE && (i as usize) < Self::VOCAB_SIZE => {
                char::from_u32(' ' as u32 + i - Self::NEWLINE - 1)
            }
            _ => None,
        }
    }
}

impl metronome_core::Tokenizer for CharTokenizer {
    fn encode(&self, text: &str) -> metronome_core::Result<Vec<TokenId>> {
        text.chars()
            .enumerate()
            .map(|(i, c)| {
                Self::id_of(c).ok_or_else(|| {
                    metronome_core::Error::invalid(
                        format!("character {i} of the text"),
                        format!("{c:?} is outside the character vocabulary (newline and printable ASCII)"),
                    )
                })
            })
            .collect()
    }

    fn decode(&self, tokens: &[TokenId]) -> metronome_core::Result<String> {
        let mut text = String::with_capacity(tokens.len());
        text.extend(tokens.iter().filter_map(|&t| Self::char_of(t)));
        Ok(text)
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }

    fn stop_token_ids(&self) -> Vec<TokenId> {
        vec![Self::EOS]
    }
}

/// A Jinja chat template with the special tokens it may reference.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// A template from its Jinja source.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Self {
        Self { source: source.into(), bos_token: bos_token.into(), eos_token: eos_token.into() }
    }

    /// The Jinja source.
    #[must_use]
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` as Hugging Face's `apply_chat_template` does.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let mut env = minijinja::Environment::new();
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source)
            .map_err(|e| Error::Tokenizer(format!("chat template does not parse: {e}")))?;
        let tmpl = env.get_template("chat").map_err(|e| Error::Tokenizer(e.to_string()))?;
        let messages: Vec<_> = messages
            .iter()
            .map(|m| minijinja::context! { role => m.role.clone(), content => m.content.clone() })
            .collect();
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        })
        .map_err(|e| Error::Tokenizer(format!("chat template failed to render: {e}")))
    }
}

/// A `tokenizers` tokenizer with the model's stop tokens and chat template.
#[derive(Clone, Debug)]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    stop_tokens: Vec<TokenId>,
    template: Option<ChatTemplate>,
}

impl HfTokenizer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json` (chat
    /// template, `bos_token`, `eos_token`).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| Error::Tokenizer(format!("{}: not JSON: {e}", config_path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(e) => return Err(Error::io(config_path, e)),
        };
        // Special tokens appear either as strings or as `{"content": ...}` objects.
        let token_text = |name: &str| -> Option<String> {
            match config.get(name)? {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
                _ => None,
            }
        };
        let bos = token_text("bos_token").unwrap_or_default();
        let eos = token_text("eos_token").unwrap_or_default();
        let template = match config.get("chat_template") {
            Some(Value::String(s)) => Some(ChatTemplate::new(s.clone(), bos, eos.clone())),
            _ => None,
        };
        let stop_tokens = inner.token_to_id(&eos).into_iter().collect();
        Ok(Self { inner, stop_tokens, template })
    }

    /// Wraps an existing tokenizer.
    #[must_use]
    pub fn new(
        inner: tokenizers::Tokenizer,
        stop_tokens: Vec<TokenId>,
        template: Option<ChatTemplate>,
    ) -> Self {
        Self { inner, stop_tokens, template }
    }

    /// The wrapped `tokenizers` tokenizer.
    #[must_use]
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The chat template, when the model files carry one.
    #[must_use]
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Encodes with special tokens in the text recognised (`<|im_start|>` stays one id)
    /// but none added.
    pub fn encode_text(&self, text: &str) -> Result<Vec<TokenId>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }
}

impl metronome_core::Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> metronome_core::Result<Vec<TokenId>> {
        Ok(self.encode_text(text)?)
    }

    fn decode(&self, tokens: &[TokenId]) -> metronome_core::Result<String> {
        self.inner.decode(tokens, true).map_err(core_err)
    }

    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn stop_token_ids(&self) -> Vec<TokenId> {
        self.stop_tokens.clone()
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> metronome_core::Result<String> {
        match &self.template {
            Some(t) => Ok(t.render(messages, add_generation_prompt)?),
            None => Err(metronome_core::Error::invalid("tokenizer", "has no chat template")),
        }
    }
}

/// The GPT-2-style byte-level BPE stored in a GGUF file's `tokenizer.ggml.*`
/// metadata, with its chat template. Built by [`crate::Model::load_gguf`].
#[derive(Clone, Debug)]
pub struct GgufTokenizer {
    inner: HfTokenizer,
    bos: Option<TokenId>,
}

impl GgufTokenizer {
    /// Builds the tokenizer from GGUF metadata; `file` names the source in errors.
    pub(crate) fn from_metadata(
        md: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
        file: &str,
    ) -> Result<Self> {
        use candle_core::quantized::gguf_file::Value as G;
        use tokenizers::models::bpe::BPE;
        use tokenizers::pre_tokenizers::{
            PreTokenizerWrapper, byte_level::ByteLevel, digits::Digits, sequence::Sequence,
        };

        let key = |k: &str| format!("{file}: metadata `{k}`");
        let get = |k: &str| md.get(k).ok_or_else(|| Error::checkpoint(key(k), "is missing"));
        let model = get("tokenizer.ggml.model")?
            .to_string()
            .map_err(|e| Error::checkpoint(key("tokenizer.ggml.model"), e.to_string()))?;
        if model != "gpt2" {
            return Err(Error::checkpoint(
                key("tokenizer.ggml.model"),
                format!("`{model}` is not supported (gpt2)"),
            ));
        }
        let strings = |k: &str| -> Result<Vec<String>> {
            let arr = get(k)?.to_vec().map_err(|e| Error::checkpoint(key(k), e.to_string()))?;
            arr.iter()
                .map(|v| v.to_string().cloned().map_err(|e| Error::checkpoint(key(k), e.to_string())))
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges: Vec<(String, String)> = strings("tokenizer.ggml.merges")?
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())).ok_or_else(|| {
                    Error::checkpoint(key("tokenizer.ggml.merges"), format!("entry {i} `{m}` is not a pair"))
                })
            })
            .collect::<Result<_>>()?;
        let types: Vec<i64> = match md.get("tokenizer.ggml.token_type") {
            Some(G::Array(a)) => a
                .iter()
                .map(|v| match v {
                    G::I32(x) => i64::from(*x),
                    G::U32(x) => i64::from(*x),
                    _ => 1,
                })
                .collect(),
            _ => vec![1; tokens.len()],
        };
        let vocab: tokenizers::models::bpe::Vocab =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| Error::Tokenizer(format!("{file}: bpe: {e}")))?;
        let mut tok = tokenizers::Tokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, true, true);
        let pre = md.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok()).map(String::as_str);
        // llama.cpp's `smollm` pre-tokenizer is SmolLM's tokenizer.json: single digits,
        // then GPT-2's byte-level split.
        let pre_tok: PreTokenizerWrapper = if pre == Some("smollm") {
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
        } else {
            byte_level.into()
        };
        tok.with_pre_tokenizer(Some(pre_tok));
        tok.with_decoder(Some(ByteLevel::default()));
        // Control (3) and user-defined (4) tokens are matched whole in the text.
        let specials: Vec<tokenizers::AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == 3 || **t == 4)
            .map(|(s, t)| tokenizers::AddedToken::from(s.clone(), *t == 3))
            .collect();
        tok.add_special_tokens(specials).map_err(|e| Error::Tokenizer(format!("{file}: {e}")))?;
        let id = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
        let bos = id("tokenizer.ggml.bos_token_id");
        let eos = id("tokenizer.ggml.eos_token_id");
        let text_of = |i: Option<u32>| i.and_then(|i| tokens.get(i as usize).cloned()).unwrap_or_default();
        let template = md
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .map(|s| ChatTemplate::new(s.clone(), text_of(bos), text_of(eos)));
        let mut stops: Vec<TokenId> = eos.into_iter().collect();
        // Chat models end a turn with `<|im_end|>` even when eos is another token.
        if let Some(im_end) = tokens.iter().position(|t| t == "<|im_end|>")
            && !stops.contains(&(im_end as u32))
        {
            stops.push(im_end as u32);
        }
        Ok(Self { inner: HfTokenizer::new(tok, stops, template), bos })
    }

    /// The beginning-of-sequence id, when the file names one.
    #[must_use]
    pub fn bos_token_id(&self) -> Option<TokenId> {
        self.bos
    }

    /// The same tokenizer as an [`HfTokenizer`].
    #[must_use]
    pub fn as_hf(&self) -> &HfTokenizer {
        &self.inner
    }
}

impl metronome_core::Tokenizer for GgufTokenizer {
    fn encode(&self, text: &str) -> metronome_core::Result<Vec<TokenId>> {
        self.inner.encode(text)
    }

    fn decode(&self, tokens: &[TokenId]) -> metronome_core::Result<String> {
        self.inner.decode(tokens)
    }

    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    fn stop_token_ids(&self) -> Vec<TokenId> {
        self.inner.stop_token_ids()
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> metronome_core::Result<String> {
        self.inner.apply_chat_template(messages, add_generation_prompt)
    }
}

#[cfg(test)]
mod tests {
    use metronome_core::Tokenizer;

    use super::*;

    #[test]
    fn char_tokenizer_round_trips_printable_ascii() {
        let text: String = (' '..='~').chain(['\n']).collect();
        let ids = CharTokenizer.encode(&text).unwrap();
        assert!(ids.iter().all(|&i| i > CharTokenizer::EOS && (i as usize) < CharTokenizer::VOCAB_SIZE));
        assert_eq!(CharTokenizer.decode(&ids).unwrap(), text);
        let mut with_specials = vec![CharTokenizer::BOS];
        with_specials.extend(&ids);
        with_specials.push(CharTokenizer::EOS);
        assert_eq!(CharTokenizer.decode(&with_specials).unwrap(), text);
        assert!(CharTokenizer.encode("é").unwrap_err().to_string().contains("character 0"));
        assert_eq!(CharTokenizer.stop_token_ids(), vec![CharTokenizer::EOS]);
    }

    #[test]
    fn chat_template_renders_like_transformers() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}\
             {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "",
            "<|im_end|>",
        );
        let out = t.render(&[ChatMessage::new("user", "hi")], true).unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        let bad = ChatTemplate::new("{{ raise_exception('no system') }}", "", "");
        assert!(bad.render(&[], false).unwrap_err().to_string().contains("no system"));
    }
}
