//! A credential in a config: usable by the code that needs it, invisible everywhere
//! else.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A password, token or API key. It prints and serialises as [`Secret::REDACTED`]
/// (in `Debug`, logs, `metronome config`, a run directory's `config.toml`); only
/// [`Secret::expose`] gives the value, to the code that sends it.
///
/// It deserialises from a string. Configs should not hold the string itself: the
/// pipeline's config loader reads `{ env = "VAR" }` or `{ file = "PATH" }` (for keys
/// named `password`, `token` or `api_key`) into it. A config written back holds the
/// redacted text, which is refused when read again, so a secret is given anew
/// (through the environment or a file) rather than copied into run directories.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// What a secret prints and serialises as.
    pub const REDACTED: &'static str = "<redacted>";

    /// A secret holding `value`.
    #[must_use]
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the code that sends it and nothing else.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(Self::REDACTED)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(Self::REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(Self::REDACTED)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = String::deserialize(deserializer)?;
        if value == Self::REDACTED {
            return Err(serde::de::Error::custom(
                "is a redacted secret (a config written back by metronome): give it again, as \
                 { env = \"VAR\" } or { file = \"PATH\" }",
            ));
        }
        Ok(Self(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_shows_only_through_expose() {
        let s = Secret::new("hunter2");
        assert_eq!(s.expose(), "hunter2");
        assert_eq!(format!("{s} {s:?} {:?}", Some(&s)), "<redacted> <redacted> Some(<redacted>)");
    }
}
