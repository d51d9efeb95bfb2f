//! Multi-turn environments: tool calls parsed from the policy's text, a calculator
//! tool, and countdown with feedback, implementing `metronome_core::Environment`.
//!
//! A turn's tool call is read in one of two formats ([`ToolCallFormat`]):
//! - `json`, as the Qwen and Hermes chat templates write it:
//!   `<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>`;
//! - `tag`, shorter for small models: `<calculator>3*4</calculator>`.
//!
//! A bad call (malformed JSON, an unknown tool, missing arguments) is data: the
//! observation says what was wrong and the episode goes on. A result longer than
//! `max_observation_chars` is cut, saying so. A turn without a call is the final
//! answer: the episode ends and the environment scores it.

use std::sync::Arc;

use async_trait::async_trait;
use metronome_core::{
    ChatMessage, Completion, Environment, Episode, Observation, Prompt, RewardFn, ToolCallSyntax,
    ToolCallText,
};
use serde::{Deserialize, Serialize};

use crate::{CountdownChecker, CountdownConfig, CountdownVerdict, Error, MathVerifier, Meter, Result};

/// How tool calls are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallFormat {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, answered with
    /// `<tool_response>…</tool_response>`.
    #[default]
    Json,
    /// `<NAME>INPUT</NAME>` for a tool `NAME`, answered with `<result>…</result>`.
    Tag,
}

/// A parsed tool call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments: a JSON object (in the tag format, `{"input": INPUT}`).
    pub arguments: serde_json::Value,
}

/// What a turn holds.
#[derive(Clone, Debug, PartialEq)]
pub enum ParsedTurn {
    /// No tool call: a final answer.
    Answer,
    /// A well-formed call.
    Call(ToolCall),
    /// A call that cannot be read; why.
    Malformed(String),
}

/// Reads the last tool call of `turn` in `format`; `tools` are the known names (the
/// tag format only recognises those).
#[must_use]
pub fn parse_tool_call(format: ToolCallFormat, turn: &str, tools: &[&str]) -> ParsedTurn {
    match format {
        ToolCallFormat::Json => parse_json_call(turn),
        ToolCallFormat::Tag => parse_tag_call(turn, tools),
    }
}

fn parse_json_call(turn: &str) -> ParsedTurn {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let Some(at) = turn.rfind(OPEN) else {
        return ParsedTurn::Answer;
    };
    let body = &turn[at + OPEN.len()..];
    let Some(end) = body.find(CLOSE) else {
        return ParsedTurn::Malformed(format!("the tool call has no closing {CLOSE}"));
    };
    let value: serde_json::Value = match serde_json::from_str(body[..end].trim()) {
        Ok(v) => v,
        Err(e) => return ParsedTurn::Malformed(format!("the tool call is not valid JSON: {e}")),
    };
    let Some(obj) = value.as_object() else {
        return ParsedTurn::Malformed("the tool call is not a JSON object".into());
    };
    let Some(name) = obj.get("name").and_then(|n| n.as_str()) else {
        return ParsedTurn::Malformed("the tool call has no string `name`".into());
    };
    let arguments = match obj.get("arguments") {
        None => serde_json::Value::Object(serde_json::Map::new()),
        // Some templates write the arguments as a JSON string.
        Some(serde_json::Value::String(s)) => match serde_json::from_str(s) {
            Ok(v @ serde_json::Value::Object(_)) => v,
            _ => {
                return ParsedTurn::Malformed(
                    "the tool call's `arguments` string is not a JSON object".into(),
                );
            }
        },
        Some(v @ serde_json::Value::Object(_)) => v.clone(),
        Some(_) => return ParsedTurn::Malformed("the tool call's `arguments` is not an object".into()),
    };
    ParsedTurn::Call(ToolCall { name: name.to_owned(), arguments })
}

fn parse_tag_call(turn: &str, tools: &[&str]) -> ParsedTurn {
    // The last opening tag of a known tool.
    let Some((at, name)) = tools
        .iter()
        .filter_map(|t| turn.rfind(&format!("<{t}>")).map(|at| (at, *t)))
        .max_by_key(|(at, _)| *at)
    else {
        return ParsedTurn::Answer;
    };
    let body = &turn[at + name.len() + 2..];
    let close = format!("</{name}>");
    let Some(end) = body.find(&close) else {
        return ParsedTurn::Malformed(format!("the tool call has no closing {close}"));
    };
    let input = body[..end].trim().to_owned();
    ParsedTurn::Call(ToolCall { name: name.to_owned(), arguments: serde_json::json!({ "input": input }) })
}

impl ToolCallFormat {
    /// Where the last call of `turn` begins (its opening tag), whether or not it is
    /// well-formed.
    fn call_start(self, turn: &str, tools: &[&str]) -> Option<usize> {
        match self {
            Self::Json => turn.rfind("<tool_call>"),
            Self::Tag => tools.iter().filter_map(|t| turn.rfind(&format!("<{t}>"))).max(),
        }
    }
}

/// The formats as an OpenAI-compatible chat server reads and writes calls: the
/// calls a model trained in these environments writes.
impl ToolCallSyntax for ToolCallFormat {
    fn turn_stops(&self, tools: &[&str]) -> Vec<String> {
        match self {
            Self::Json => vec!["</tool_call>".into()],
            Self::Tag => tools.iter().map(|t| format!("</{t}>")).collect(),
        }
    }

    fn parse(&self, text: &str, tools: &[&str]) -> Option<(usize, ToolCallText)> {
        let ParsedTurn::Call(call) = parse_tool_call(*self, text, tools) else {
            return None;
        };
        let at = self.call_start(text, tools)?;
        Some((at, ToolCallText { name: call.name, arguments: call.arguments.to_string() }))
    }

    fn render(&self, call: &ToolCallText) -> metronome_core::Result<String> {
        let arguments: serde_json::Value = serde_json::from_str(&call.arguments)
            .ok()
            .filter(serde_json::Value::is_object)
            .ok_or_else(|| {
                metronome_core::Error::invalid(
                    format!("tool call `{}`", call.name),
                    "has `arguments` that are not a JSON object",
                )
            })?;
        Ok(match self {
            // As `CalculatorEnv::call` writes it, so a re-sent call renders as sampled.
            Self::Json => {
                let call = serde_json::json!({ "name": call.name, "arguments": arguments });
                format!("<tool_call>{call}</tool_call>")
            }
            Self::Tag => {
                let Some(input) = arguments.get("input").and_then(serde_json::Value::as_str) else {
                    return Err(metronome_core::Error::invalid(
                        format!("tool call `{}`", call.name),
                        "needs a string argument `input` in the tag format",
                    ));
                };
                format!("<{0}>{input}</{0}>", call.name)
            }
        })
    }
}

/// Which environment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvKind {
    /// A `calculator` tool (`+ - * /` and parentheses over exact rationals) for
    /// arithmetic word problems; the final answer is checked against the prompt's
    /// reference by the math verifier.
    #[default]
    Calculator,
    /// Countdown with feedback: each turn's expression is checked against the
    /// prompt's `numbers` and `target`; a wrong or invalid one is answered with what
    /// was wrong, a correct one ends the episode.
    Countdown,
}

/// The `[env]` table: which environment and the limits of its episodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvConfig {
    /// Which environment.
    pub kind: EnvKind,
    /// How tool calls are written (the calculator).
    pub format: ToolCallFormat,
    /// Most policy turns per episode.
    pub max_turns: u32,
    /// Time limit of one environment step, in milliseconds.
    pub tool_time_limit_ms: u64,
    /// Most environment steps running at once, timed-out ones that have not returned
    /// included; past it a turn's step is refused and its episode ends.
    pub max_running_tool_calls: usize,
    /// Longest observation text; longer results are cut, saying so.
    pub max_observation_chars: usize,
    /// Reward of a correct final answer.
    pub correct_reward: f32,
    /// Reward of a wrong or missing final answer.
    pub wrong_reward: f32,
}

impl Default for EnvConfig {
    fn default() -> Self {
        Self {
            kind: EnvKind::Calculator,
            format: ToolCallFormat::Json,
            max_turns: 4,
            tool_time_limit_ms: 2_000,
            max_running_tool_calls: 64,
            max_observation_chars: 256,
            correct_reward: 1.0,
            wrong_reward: 0.0,
        }
    }
}

impl EnvConfig {
    /// Checks every field; the error names it.
    pub fn validate(&self) -> Result<()> {
        if self.max_turns == 0 {
            return Err(Error::config("env.max_turns", "is 0 (expected >= 1)"));
        }
        if self.tool_time_limit_ms == 0 {
            return Err(Error::config("env.tool_time_limit_ms", "is 0 (expected a positive limit)"));
        }
        if self.max_running_tool_calls == 0 {
            return Err(Error::config("env.max_running_tool_calls", "is 0 (expected >= 1)"));
        }
        if self.max_observation_chars < 16 {
            return Err(Error::config(
                "env.max_observation_chars",
                format!(
                    "is {} (expected >= 16, room for a result and the cut note)",
                    self.max_observation_chars
                ),
            ));
        }
        for (field, v) in
            [("env.correct_reward", self.correct_reward), ("env.wrong_reward", self.wrong_reward)]
        {
            if !v.is_finite() {
                return Err(Error::config(field, format!("is {v} (expected a finite number)")));
            }
        }
        Ok(())
    }

    /// The environment.
    pub fn build(&self) -> Result<Arc<dyn Environment>> {
        self.validate()?;
        Ok(match self.kind {
            EnvKind::Calculator => Arc::new(CalculatorEnv::new(self.clone())),
            EnvKind::Countdown => Arc::new(CountdownEnv::new(self.clone())?),
        })
    }
}

/// `text` cut to `max` characters, saying how much was left out.
fn bounded(text: &str, max: usize) -> String {
    let n = text.chars().count();
    if n <= max {
        return text.to_owned();
    }
    // The note for `n` cut characters is at least as long as the real one.
    let room = max.saturating_sub(format!("… ({n} more characters cut)").chars().count());
    let keep: String = text.chars().take(room).collect();
    format!("{keep}… ({} more characters cut)", n - room)
}

/// The calculator environment: see [`EnvKind::Calculator`].
#[derive(Clone, Debug)]
pub struct CalculatorEnv {
    config: EnvConfig,
    checker: CountdownChecker,
    verifier: Arc<MathVerifier>,
}

impl CalculatorEnv {
    /// The tool's name.
    pub const TOOL: &'static str = "calculator";

    /// The environment with `config`'s format, limits and rewards.
    #[must_use]
    pub fn new(config: EnvConfig) -> Self {
        Self { config, checker: CountdownChecker::new(), verifier: Arc::new(MathVerifier::new()) }
    }

    /// The tool's answer to `call`: the value, or what was wrong.
    fn run(&self, call: &ToolCall) -> String {
        if call.name != Self::TOOL {
            return format!("error: unknown tool `{}` (available: {})", call.name, Self::TOOL);
        }
        let field = match self.config.format {
            ToolCallFormat::Json => "expression",
            ToolCallFormat::Tag => "input",
        };
        let Some(expr) = call.arguments.get(field).and_then(|e| e.as_str()) else {
            return format!("error: the calculator needs a string argument `{field}`");
        };
        match self.checker.evaluate_any(expr, &mut Meter::new()) {
            Ok(v) => v.to_string(),
            Err(e) => format!("error: {e}"),
        }
    }

    /// A call of the calculator on `expression`, written in the configured format.
    #[must_use]
    pub fn call(&self, expression: &str) -> String {
        match self.config.format {
            ToolCallFormat::Json => {
                let call =
                    serde_json::json!({ "name": Self::TOOL, "arguments": { "expression": expression } });
                format!("<tool_call>{call}</tool_call>")
            }
            ToolCallFormat::Tag => format!("<{0}>{expression}</{0}>", Self::TOOL),
        }
    }

    /// The tool's `result` as the observation: in the format's own wrapping, and as
    /// a `tool` message for a chat template to render.
    fn respond(&self, result: &str) -> Observation {
        let result = bounded(result, self.config.max_observation_chars);
        let text = match self.config.format {
            ToolCallFormat::Json => format!("\n<tool_response>\n{result}\n</tool_response>\n"),
            ToolCallFormat::Tag => format!("<result>{result}</result>"),
        };
        Observation::reply(text).with_message(ChatMessage::new("tool", result))
    }
}

impl Environment for CalculatorEnv {
    fn start(&self, prompt: &Prompt, _sample_index: u32) -> metronome_core::Result<Box<dyn Episode>> {
        Ok(Box::new(CalculatorEpisode { env: self.clone(), prompt: prompt.clone() }))
    }

    fn turn_stops(&self) -> Vec<String> {
        match self.config.format {
            ToolCallFormat::Json => vec!["</tool_call>".into()],
            ToolCallFormat::Tag => vec![format!("</{}>", Self::TOOL)],
        }
    }

    /// For a prompt whose metadata names its `expression` (the arithmetic task's
    /// do) and that has a reference answer: call the calculator on the expression,
    /// then answer with the reference.
    fn demonstration(&self, prompt: &Prompt) -> Option<Vec<String>> {
        let expression = prompt.metadata.get("expression")?;
        let answer = prompt.reference.as_ref()?;
        Some(vec![self.call(expression), answer.clone()])
    }
}

struct CalculatorEpisode {
    env: CalculatorEnv,
    prompt: Prompt,
}

#[async_trait]
impl Episode for CalculatorEpisode {
    async fn step(&mut self, turn: &str) -> metronome_core::Result<Observation> {
        let env = &self.env;
        match parse_tool_call(env.config.format, turn, &[CalculatorEnv::TOOL]) {
            ParsedTurn::Call(call) => Ok(env.respond(&env.run(&call))),
            ParsedTurn::Malformed(why) => Ok(env.respond(&format!("error: {why}"))),
            ParsedTurn::Answer => {
                let answer = Completion { text: turn.to_owned(), ..Completion::default() };
                let correct = env.verifier.score(&self.prompt, &answer).total > 0.0;
                let c = &env.config;
                Ok(Observation::done(Some(if correct { c.correct_reward } else { c.wrong_reward })))
            }
        }
    }
}

/// Countdown with feedback: see [`EnvKind::Countdown`].
#[derive(Clone, Debug)]
pub struct CountdownEnv {
    config: EnvConfig,
    countdown: CountdownConfig,
    checker: CountdownChecker,
}

impl CountdownEnv {
    /// The environment with `config`'s limits and rewards, checking with the default
    /// countdown rules.
    pub fn new(config: EnvConfig) -> Result<Self> {
        let countdown = CountdownConfig::default();
        Ok(Self { checker: countdown.build()?, countdown, config })
    }
}

impl Environment for CountdownEnv {
    fn start(&self, prompt: &Prompt, _sample_index: u32) -> metronome_core::Result<Box<dyn Episode>> {
        let field = |name: &str| prompt.metadata.get(name).map(String::as_str);
        let numbers = field(&self.countdown.numbers_field).and_then(crate::countdown::parse_numbers);
        let target = field(&self.countdown.target_field).and_then(|t| t.trim().parse::<i128>().ok());
        let (Some(numbers), Some(target)) = (numbers, target) else {
            return Err(metronome_core::Error::invalid(
                format!("prompt {}", prompt.id),
                format!(
                    "has no usable `{}` and `{}` metadata for the countdown environment",
                    self.countdown.numbers_field, self.countdown.target_field
                ),
            ));
        };
        Ok(Box::new(CountdownEpisode { env: self.clone(), numbers, target }))
    }
}

struct CountdownEpisode {
    env: CountdownEnv,
    numbers: Vec<i128>,
    target: i128,
}

#[async_trait]
impl Episode for CountdownEpisode {
    async fn step(&mut self, turn: &str) -> metronome_core::Result<Observation> {
        let env = &self.env;
        let target = crate::Rational::integer(self.target);
        let feedback = match env.checker.check(turn, &self.numbers, target, &mut Meter::new()) {
            CountdownVerdict::Correct => return Ok(Observation::done(Some(env.config.correct_reward))),
            CountdownVerdict::WrongValue(v) => format!("that makes {v}, not {}; try again", self.target),
            CountdownVerdict::Invalid(e) => format!("invalid expression: {e}; try again"),
        };
        let text = bounded(&feedback, env.config.max_observation_chars);
        let message = ChatMessage::new("user", text.clone());
        Ok(Observation::reply(format!("\n<feedback>{text}</feedback>\n")).with_message(message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a chat server reads from a turn and writes back renders as sampled, in
    /// both formats, so a re-sent conversation extends the one sampled.
    #[test]
    fn calls_read_by_a_chat_server_render_back_as_written() {
        for format in [ToolCallFormat::Json, ToolCallFormat::Tag] {
            let env = CalculatorEnv::new(EnvConfig { format, ..EnvConfig::default() });
            let turn = format!("Let me compute. {}", env.call("3*4"));
            let (at, call) = format.parse(&turn, &["calculator"]).expect("a call");
            assert_eq!(&turn[..at], "Let me compute. ");
            assert_eq!(call.name, "calculator");
            assert_eq!(format.render(&call).unwrap(), &turn[at..]);
            assert!(format.turn_stops(&["calculator"]).iter().any(|s| turn.ends_with(s.as_str())));
            assert_eq!(format.parse("the answer is 12", &["calculator"]), None);
        }
        let bad = ToolCallText { name: "calculator".into(), arguments: "[1]".into() };
        assert!(ToolCallFormat::Json.render(&bad).unwrap_err().to_string().contains("not a JSON object"));
        let no_input = ToolCallText { name: "calculator".into(), arguments: "{}".into() };
        assert!(ToolCallFormat::Tag.render(&no_input).unwrap_err().to_string().contains("`input`"));
    }
    use proptest::prelude::*;

    fn call(name: &str, arguments: serde_json::Value) -> ParsedTurn {
        ParsedTurn::Call(ToolCall { name: name.into(), arguments })
    }

    #[test]
    fn json_calls_are_read_as_the_chat_templates_write_them() {
        let j = ToolCallFormat::Json;
        let t = r#"Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>"#;
        assert_eq!(parse_tool_call(j, t, &[]), call("calculator", serde_json::json!({"expression": "3*4"})));
        let s = r#"<tool_call>{"name": "calculator", "arguments": "{\"expression\": \"1+1\"}"}</tool_call>"#;
        assert_eq!(parse_tool_call(j, s, &[]), call("calculator", serde_json::json!({"expression": "1+1"})));
        assert_eq!(parse_tool_call(j, "The answer is 12.", &[]), ParsedTurn::Answer);
        for (text, why) in [
            ("<tool_call>{\"name\": \"calculator\"", "no closing </tool_call>"),
            ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
            ("<tool_call>[1, 2]</tool_call>", "not a JSON object"),
            ("<tool_call>{\"arguments\": {}}</tool_call>", "no string `name`"),
            ("<tool_call>{\"name\": \"c\", \"arguments\": 3}</tool_call>", "`arguments` is not an object"),
        ] {
            match parse_tool_call(j, text, &[]) {
                ParsedTurn::Malformed(m) => assert!(m.contains(why), "{text}: {m}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn tag_calls_name_a_known_tool() {
        let tools = ["calculator"];
        let tag = ToolCallFormat::Tag;
        assert_eq!(
            parse_tool_call(tag, "so <calculator> 12*7 </calculator>", &tools),
            call("calculator", serde_json::json!({"input": "12*7"}))
        );
        assert_eq!(parse_tool_call(tag, "<search>x</search>", &tools), ParsedTurn::Answer);
        assert!(matches!(parse_tool_call(tag, "<calculator>1+", &tools), ParsedTurn::Malformed(_)));
    }

    fn calculator(format: ToolCallFormat) -> CalculatorEnv {
        CalculatorEnv::new(EnvConfig { format, max_observation_chars: 80, ..EnvConfig::default() })
    }

    fn step(env: &dyn Environment, prompt: &Prompt, turn: &str) -> Observation {
        let mut ep = env.start(prompt, 0).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(ep.step(turn)).unwrap()
    }

    #[test]
    fn the_calculator_answers_bad_calls_with_a_clear_observation() {
        let env = calculator(ToolCallFormat::Json);
        let p = Prompt { reference: Some("84".into()), ..Prompt::default() };
        let json =
            |args: &str| format!(r#"<tool_call>{{"name": "calculator", "arguments": {args}}}</tool_call>"#);
        for (turn, expected) in [
            (json(r#"{"expression": "12*7"}"#), "84"),
            (json(r#"{"expression": "1/3+1/6"}"#), "1/2"),
            (json(r#"{"expression": "1/0"}"#), "error: divides by zero"),
            (json(r#"{"expression": "__import__('os')"}"#), "error: syntax error at byte 0"),
            (json(r#"{"expr": "1"}"#), "error: the calculator needs a string argument `expression`"),
            (
                r#"<tool_call>{"name": "search", "arguments": {}}</tool_call>"#.into(),
                "error: unknown tool `search`",
            ),
            ("<tool_call>{oops}</tool_call>".into(), "error: the tool call is not valid JSON"),
        ] {
            let obs = step(&env, &p, &turn);
            assert!(!obs.done, "{turn}");
            assert!(obs.text.contains(expected), "{turn}: {}", obs.text);
            assert!(obs.text.starts_with("\n<tool_response>\n"), "{}", obs.text);
        }
        // An oversized result is cut, saying so.
        let small = CalculatorEnv::new(EnvConfig { max_observation_chars: 20, ..EnvConfig::default() });
        let obs = step(&small, &p, &json(r#"{"expression": "999999999999*999999999999*999999999999"}"#));
        assert!(obs.text.contains("more characters cut)"), "{}", obs.text);
        let long = bounded(&"x".repeat(100), 32);
        assert!(long.chars().count() <= 32 && long.starts_with("xxxxx"), "{long}");
        assert!(long.ends_with("characters cut)"), "{long}");
        // A final answer ends the episode with the math verifier's judgement.
        assert_eq!(step(&env, &p, "The answer is 84.").reward, Some(1.0));
        assert_eq!(step(&env, &p, "The answer is 85.").reward, Some(0.0));
        let tag = calculator(ToolCallFormat::Tag);
        assert_eq!(tag.turn_stops(), ["</calculator>"]);
        let obs = step(&tag, &p, "<calculator>2*(3+4)</calculator>");
        assert_eq!(obs.text, "<result>14</result>");
        // For a chat template: the bare result as a tool message.
        assert_eq!(obs.message, Some(ChatMessage::new("tool", "14")));
    }

    #[test]
    fn a_calculator_demonstration_calls_the_tool_and_answers_what_it_said() {
        let mut p = Prompt { reference: Some("-21".into()), ..Prompt::default() };
        assert_eq!(calculator(ToolCallFormat::Tag).demonstration(&p), None, "needs an expression");
        p.metadata.insert("expression".into(), "12-3*11".into());
        for format in [ToolCallFormat::Tag, ToolCallFormat::Json] {
            let env = calculator(format);
            let turns = env.demonstration(&p).unwrap();
            assert_eq!(turns.len(), 2);
            // The call parses as one (the same parser reads the policy's turns) and the
            // environment's result is the reference, which it then accepts.
            assert!(matches!(parse_tool_call(format, &turns[0], &["calculator"]), ParsedTurn::Call(_)));
            assert!(step(&env, &p, &turns[0]).text.contains("-21"), "{format:?}");
            assert_eq!(step(&env, &p, &turns[1]).reward, Some(1.0));
            assert!(env.turn_stops().iter().any(|stop| turns[0].ends_with(stop.as_str())));
        }
        assert_eq!(CountdownEnv::new(EnvConfig::default()).unwrap().demonstration(&p), None);
    }

    #[test]
    fn countdown_gives_feedback_until_the_target_is_hit() {
        let env = CountdownEnv::new(EnvConfig::default()).unwrap();
        let mut p = Prompt::default();
        p.metadata.insert("numbers".into(), "[3, 5, 7]".into());
        p.metadata.insert("target".into(), "22".into());
        let wrong = step(&env, &p, "<answer>3*5+7+0</answer>");
        assert!(wrong.text.contains("invalid expression"), "{}", wrong.text);
        let off = step(&env, &p, "<answer>3+5+7</answer>");
        assert!(off.text.contains("that makes 15, not 22"), "{}", off.text);
        let hit = step(&env, &p, "<answer>3*5+7</answer>");
        assert_eq!((hit.done, hit.reward), (true, Some(1.0)));
        let err = env.start(&Prompt::default(), 0).err().unwrap().to_string();
        assert!(err.contains("`numbers` and `target`"), "{err}");
    }

    #[test]
    fn config_errors_name_the_key() {
        let bad = EnvConfig { max_turns: 0, ..EnvConfig::default() };
        assert_eq!(
            bad.validate().unwrap_err().to_string(),
            "reward config field `env.max_turns` is 0 (expected >= 1)"
        );
        let err = toml::from_str::<EnvConfig>("kind = \"calculator\"\nmax_turn = 3").unwrap_err().to_string();
        assert!(err.contains("max_turn"), "{err}");
        let cfg: EnvConfig = toml::from_str("kind = \"countdown\"\nformat = \"tag\"").unwrap();
        assert_eq!((cfg.kind, cfg.format), (EnvKind::Countdown, ToolCallFormat::Tag));
    }

    proptest! {
        /// No turn text makes the parsers or the calculator panic.
        #[test]
        fn any_turn_is_answered_without_a_panic(turn in ".{0,200}", body in "[{}\\[\\]\":,a-z0-9 ]{0,80}") {
            let env = calculator(ToolCallFormat::Json);
            let p = Prompt::default();
            let _ = step(&env, &p, &turn);
            let _ = step(&env, &p, &format!("<tool_call>{body}</tool_call>"));
            let _ = step(&calculator(ToolCallFormat::Tag), &p, &format!("<calculator>{turn}</calculator>"));
        }
    }
}
