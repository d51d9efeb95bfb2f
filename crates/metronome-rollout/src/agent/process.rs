//! One agent process: started in a process group of its own with the episode's
//! address and key, given the task, watched against its time limit, and killed
//! with everything it started when it ends, overruns, or its episode is ended.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

use super::{AgentConfig, TaskInput};

/// The most bytes of an agent's stdout kept (its last line is its report).
const MAX_STDOUT: usize = 1 << 20;

/// How an agent process ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Exit {
    /// It exited with status 0; its stdout's last non-empty line.
    Done { last_line: Option<String> },
    /// It exited otherwise (a status, or a signal).
    Crashed(String),
    /// It ran past the time limit and was killed.
    TimedOut,
    /// Its episode was ended from outside (it used another episode's address).
    Ended,
    /// It could not be started.
    NotStarted(String),
}

/// What an agent process is given.
pub(crate) struct Launch<'a> {
    pub(crate) base_url: &'a str,
    pub(crate) api_key: &'a str,
    pub(crate) model: &'a str,
    pub(crate) task: &'a str,
}

/// Runs the agent of `config` for one episode until it exits, its time limit passes
/// or `end` is notified; every process of its group is killed before this returns.
pub(crate) async fn run(config: &AgentConfig, launch: &Launch<'_>, end: &Notify) -> Exit {
    let Some((program, args)) = config.command.split_first() else {
        return Exit::NotStarted("rollout.agent.command is empty".into());
    };
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .envs(&config.env)
        .env("OPENAI_BASE_URL", launch.base_url)
        .env("OPENAI_API_KEY", launch.api_key)
        .env("METRONOME_MODEL", launch.model)
        .stdin(if config.task_input == TaskInput::Stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    if config.task_input == TaskInput::Env {
        command.env("METRONOME_TASK", launch.task);
    }
    if let Some(dir) = &config.working_dir {
        command.current_dir(dir);
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => return Exit::NotStarted(format!("{program}: {e}")),
    };
    let group = child.id();
    if let Some(mut stdin) = child.stdin.take() {
        let task = launch.task.as_bytes().to_vec();
        // An agent that never reads its stdin must not block the episode.
        tokio::spawn(async move {
            let _ = stdin.write_all(&task).await;
        });
    }
    let mut stdout = child.stdout.take();
    let read = async {
        let mut kept = Vec::new();
        if let Some(out) = &mut stdout {
            let mut buf = [0u8; 8192];
            while let Ok(n) = out.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > MAX_STDOUT {
                    kept.drain(..kept.len() - MAX_STDOUT);
                }
            }
        }
        kept
    };
    let limit = Duration::from_secs_f64(config.time_limit_s);
    let outcome = tokio::select! {
        (status, out) = async { tokio::join!(child.wait(), read) } => match status {
            Ok(s) if s.success() => {
                let text = String::from_utf8_lossy(&out);
                let last_line = text.lines().rev().find(|l| !l.trim().is_empty()).map(str::to_owned);
                Exit::Done { last_line }
            }
            Ok(s) => Exit::Crashed(s.to_string()),
            Err(e) => Exit::Crashed(e.to_string()),
        },
        () = tokio::time::sleep(limit) => Exit::TimedOut,
        () = end.notified() => Exit::Ended,
    };
    kill_group(group);
    let _ = child.kill().await;
    outcome
}

/// Kills process group `group` (the agent and whatever it started in its group).
fn kill_group(group: Option<u32>) {
    if let Some(pgid) = group {
        // `kill` the program: the crate forbids the unsafe `libc::killpg`.
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{pgid}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
