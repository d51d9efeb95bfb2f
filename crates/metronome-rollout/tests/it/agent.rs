//! The `agent` backend with a scripted agent (`agents/scripted.py`, whose task text
//! says what it does): re-sent histories join one trajectory, rewritten ones split,
//! and a crashing, hanging, silent or trespassing agent ends only its own episode,
//! with its processes killed.

use std::collections::HashMap;
use std::path::PathBuf;

use metronome_core::{Group, PeriodId, Prompt, PromptId, RolloutEngine, RolloutRequest, Tokenizer};
use metronome_model::CharTokenizer;
use metronome_rollout::agent::AgentEngine;
use metronome_rollout::http::Chat;
use metronome_rollout::{AgentConfig, AgentReward, CollectSink, ModelEngine, TaskInput};

use crate::common::{EverythingCalls, engine, sampling};

/// A template for the character tokenizer: each message on a line after its role.
const TEMPLATE: &str = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
                        {% if add_generation_prompt %}assistant: {% endif %}";

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/it/agents/scripted.py")
}

/// Whether python3 runs here; under CI it must.
fn python() -> bool {
    let ok =
        std::process::Command::new("python3").arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(ok || std::env::var_os("CI").is_none(), "python3 is missing under CI");
    ok
}

fn agents(config: AgentConfig) -> AgentEngine<metronome_model::Model> {
    agents_with(config, Chat::default())
}

fn agents_with(config: AgentConfig, chat: Chat) -> AgentEngine<metronome_model::Model> {
    let inner: ModelEngine = engine(1, 8, sampling(16));
    AgentEngine::new(inner, config, chat).unwrap()
}

/// The tiny engine with room for a few turns of a real agent's conversation.
fn long_context_agents(config: AgentConfig, chat: Chat) -> AgentEngine<metronome_model::Model> {
    let engine_config = metronome_rollout::EngineConfig {
        threads_per_worker: Some(1),
        max_num_seqs: 8,
        max_seq_len: 1024,
        sampling: sampling(16),
        ..metronome_rollout::EngineConfig::default()
    };
    let model = crate::common::tiny_model(7);
    let inner = metronome_rollout::model_engine(
        model,
        metronome_core::PolicyVersion(0),
        crate::common::tokenizer(),
        engine_config,
        metronome_core::RunSeed(42),
    )
    .unwrap();
    AgentEngine::new(inner, config, chat).unwrap()
}

fn config(time_limit_s: f64, env: &[(&str, String)]) -> AgentConfig {
    AgentConfig {
        command: vec!["python3".into(), script().display().to_string()],
        time_limit_s,
        concurrency: 3,
        task_input: TaskInput::Stdin,
        reward: AgentReward::Agent,
        model_name: "tiny".into(),
        chat_template: Some(TEMPLATE.into()),
        env: env.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect(),
        ..AgentConfig::default()
    }
}

fn prompt(id: u64, text: &str) -> Prompt {
    Prompt {
        id: PromptId(id),
        text: text.into(),
        tokens: CharTokenizer.encode(text).unwrap(),
        ..Prompt::default()
    }
}

async fn run(engine: &dyn RolloutEngine, prompts: Vec<Prompt>, group_size: u32) -> HashMap<String, Group> {
    let sink = CollectSink::default();
    let request = RolloutRequest { period: PeriodId(3), prompts: prompts.clone(), group_size };
    engine.generate(request, &sink).await.unwrap();
    let groups = sink.into_groups();
    assert_eq!(groups.len(), prompts.len());
    let text_of: HashMap<_, _> = prompts.iter().map(|p| (p.id, p.text.clone())).collect();
    groups.into_iter().map(|g| (text_of[&g.prompt.id].clone(), g)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_histories_join_and_rewritten_ones_split() {
    if !python() {
        return eprintln!("skipped: no python3");
    }
    let engine = agents(config(60.0, &[]));
    let groups = run(&engine, vec![prompt(1, "join"), prompt(2, "split")], 2).await;

    let join = &groups["join"];
    join.validate().unwrap();
    assert_eq!(join.period, PeriodId(3));
    // The shared prompt is the rendered first call's, which the task's text is in.
    assert_eq!(CharTokenizer.decode(&join.prompt.tokens).unwrap(), "user: join\nassistant: ");
    assert_eq!(join.completions.len(), 2, "each episode is one trajectory");
    for c in &join.completions {
        let trace = c.episode.as_ref().unwrap();
        assert_eq!(trace.turns, 2);
        assert_eq!(trace.reward, Some(0.5));
        assert_eq!(trace.failure, None);
        // The tool's answer is context between the two sampled turns.
        assert_eq!(trace.observations.len(), 1);
        let span = trace.observations[0];
        let context = CharTokenizer.decode(&c.tokens[span.start as usize..span.end() as usize]).unwrap();
        assert!(context.starts_with('\n') && context.ends_with("\ntool: 6\nassistant: "), "{context:?}");
        assert!(c.logprobs[span.start as usize..span.end() as usize].iter().all(|&l| l == 0.0));
        assert!(c.num_policy_tokens() >= 2);
    }

    let split = &groups["split"];
    split.validate().unwrap();
    assert_eq!(split.completions.len(), 4, "each episode is two trajectories");
    // The shared prompt is the longest prefix of both first prompts (`split`, `summary: split`).
    assert_eq!(CharTokenizer.decode(&split.prompt.tokens).unwrap(), "user: s");
    for c in &split.completions {
        let trace = c.episode.as_ref().unwrap();
        assert_eq!(trace.turns, 1);
        assert_eq!(trace.reward, Some(0.5), "the trajectories share their episode's reward");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_agent_ends_only_its_own_episode_and_its_processes() {
    if !python() {
        return eprintln!("skipped: no python3");
    }
    failing_agents_end_alone(vec!["python3".into(), script().display().to_string()]).await;
}

/// The same through `examples/agents/forkserver.py`, which runs each episode's agent in
/// a fork of a long-lived server: the agent is not Metronome's child, yet the hanging
/// one and the child it started die with the episode, and each failure reads as when
/// the agent ran directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_agent_ends_alone_through_the_fork_server() {
    if !python() {
        return eprintln!("skipped: no python3");
    }
    let command = ["python3", "-S", &launcher().display().to_string(), "--preload", "", "--idle-s", "20"]
        .into_iter()
        .map(String::from)
        .chain([script().display().to_string()])
        .collect();
    failing_agents_end_alone(command).await;
}

/// The fork server's socket lives in a directory of this user's alone: one that others
/// may write to (where another user could listen in the server's place and receive the
/// episode's environment, its API key included) is refused, naming it, and no agent runs.
#[test]
fn the_fork_server_refuses_a_socket_directory_open_to_others() {
    use std::os::unix::fs::PermissionsExt;
    if !python() {
        return eprintln!("skipped: no python3");
    }
    let tmp = tempfile::tempdir().unwrap();
    let uid = String::from_utf8(std::process::Command::new("id").arg("-u").output().unwrap().stdout).unwrap();
    let open = tmp.path().join(format!("metronome-forkserver-{}", uid.trim()));
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = launch_once(tmp.path(), &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&open.display().to_string()) && stderr.contains("alone"), "{stderr}");
    assert!(out.stdout.is_empty(), "no agent ran");
}

/// The test agent run once through the fork server's launcher with `options`, its
/// sockets under `tmp`, no input.
fn launch_once(tmp: &std::path::Path, options: &[&str]) -> std::process::Output {
    std::process::Command::new("python3")
        .arg("-S")
        .arg(launcher())
        .args(options)
        .arg(script())
        .env("TMPDIR", tmp)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

fn launcher() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/agents/forkserver.py")
}

/// Waits up to 30 s for process `pid` to be gone (or a zombie its parent has not
/// reaped yet: a signal's delivery is the kernel's); whether it is.
fn gone(pid: &str) -> bool {
    let dead = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.is_empty() || stat.contains(") Z ") || stat.contains(") X ")
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !dead() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    dead()
}

/// A fork server killed mid-episode takes the episode's agent and what it started
/// with it: the launcher, which the server told the agent's pid, kills its process
/// group and fails the episode, naming why.
#[test]
fn an_agent_dies_with_its_fork_server() {
    if !python() {
        return eprintln!("skipped: no python3");
    }
    let tmp = tempfile::tempdir().unwrap();
    let agent = tmp.path().join("sleeper.py");
    let pids = tmp.path().join("pids");
    std::fs::write(
        &agent,
        format!(
            "import os, subprocess, time\n\
             child = subprocess.Popen(['sleep', '1000'])\n\
             open({pids:?} + '.tmp', 'w').write(f'{{os.getpid()}} {{child.pid}}')\n\
             os.rename({pids:?} + '.tmp', {pids:?})\n\
             time.sleep(1000)\n"
        ),
    )
    .unwrap();
    let mut run = std::process::Command::new("python3")
        .args(["-S".as_ref(), launcher().as_os_str(), "--preload".as_ref(), "".as_ref(), agent.as_os_str()])
        .env("TMPDIR", tmp.path())
        .stdin(std::process::Stdio::null())
        // A file, not a pipe: the agent holds the launcher's stderr, and a test that
        // read it to its end would wait for a failure to end on its own.
        .stderr(std::fs::File::create(tmp.path().join("stderr")).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !pids.exists() {
        assert!(std::time::Instant::now() < deadline, "the agent did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // The server is the one process whose arguments name this test's directory.
    let server = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
        .find(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            cmdline.contains("--serve") && cmdline.contains(&*tmp.path().to_string_lossy())
        })
        .expect("the fork server runs");
    assert!(std::process::Command::new("kill").args(["-KILL", &server]).status().unwrap().success());

    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(status) = run.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            run.kill().unwrap();
            panic!("the launcher outlived its server by 30 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(tmp.path().join("stderr")).unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the server went away"), "{stderr}");
    for pid in std::fs::read_to_string(&pids).unwrap().split_whitespace() {
        assert!(gone(pid), "process {pid} outlived its fork server and launcher");
    }
}

/// A fork server that cannot start (a preload that does not import) fails the launch
/// at once, quoting the server's error, instead of leaving it to wait for a socket
/// that never comes; no agent runs.
#[test]
fn a_fork_server_that_cannot_start_fails_the_launch_naming_why() {
    if !python() {
        return eprintln!("skipped: no python3");
    }
    let tmp = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let out = launch_once(tmp.path(), &["--preload", "metronome_no_such_module"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("before listening") && stderr.contains("metronome_no_such_module"), "{stderr}");
    assert!(out.stdout.is_empty(), "no agent ran");
    // Well inside the 60 s a launch waits for a server that is still starting.
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "took {:?}", started.elapsed());
}

/// Two agents whose servers' sockets would share a name (a hash collision, made here
/// by starting one agent's server at the other's path) never run each other: the
/// server refuses a launch of another agent, naming what it runs, and nothing runs.
#[test]
fn a_fork_server_runs_only_its_own_agent() {
    if !python() {
        return eprintln!("skipped: no python3");
    }
    let tmp = tempfile::tempdir().unwrap();
    let (ours, theirs) = (tmp.path().join("ours.py"), tmp.path().join("theirs.py"));
    std::fs::write(&ours, "print('ours ran')\n").unwrap();
    std::fs::write(&theirs, "print('theirs ran')\n").unwrap();
    let python = |args: &[&std::ffi::OsStr]| {
        let mut command = std::process::Command::new("python3");
        command.arg("-S").args(args).env("TMPDIR", tmp.path()).stdin(std::process::Stdio::null());
        command
    };
    let find_path = "import sys; sys.path.insert(0, sys.argv[1]); import forkserver as f; \
                     print(f.socket_path(f.identity_of(sys.argv[2], [])))";
    let dir = launcher().parent().unwrap().to_owned();
    let path =
        python(&["-c".as_ref(), find_path.as_ref(), dir.as_os_str(), ours.as_os_str()]).output().unwrap();
    assert!(path.status.success(), "{}", String::from_utf8_lossy(&path.stderr));
    let path = String::from_utf8(path.stdout).unwrap().trim().to_owned();
    let launch = [launcher().into_os_string(), "--preload".into(), "".into(), "--idle-s".into(), "20".into()];
    let launch: Vec<&std::ffi::OsStr> = launch.iter().map(|a| a.as_os_str()).collect();
    let mut server =
        python(&[&launch[..], &["--serve".as_ref(), path.as_ref(), theirs.as_os_str()]].concat())
            .spawn()
            .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !std::path::Path::new(&path).exists() {
        assert!(std::time::Instant::now() < deadline, "the server did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    let out = python(&[&launch[..], &[ours.as_os_str()]].concat()).output().unwrap();
    server.kill().unwrap();
    server.wait().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&*theirs.to_string_lossy()) && stderr.contains(&path), "{stderr}");
    assert!(out.stdout.is_empty(), "an agent ran: {}", String::from_utf8_lossy(&out.stdout));
}

/// Agents that crash, hang, never call and trespass, beside one that succeeds, started
/// by `command`: each failure ends its own episode with its reason, and the hanging
/// agent's processes are gone afterwards.
async fn failing_agents_end_alone(command: Vec<String>) {
    let pids = tempfile::tempdir().unwrap();
    // The hanging agent is killed at this limit; every other ends on its own first.
    let engine =
        agents(AgentConfig { command, ..config(5.0, &[("PIDS_DIR", pids.path().display().to_string())]) });
    let tasks = ["crash", "hang", "silent", "wrong_key", "join"];
    let prompts = tasks.iter().enumerate().map(|(i, t)| prompt(i as u64, t)).collect();
    let groups = run(&engine, prompts, 1).await;

    let failure = |task: &str| {
        let g = &groups[task];
        g.validate().unwrap();
        let trace = g.completions[0].episode.clone().unwrap();
        (trace.failure, trace.reward)
    };
    assert_eq!(failure("crash"), (Some("crash: exit status: 3".into()), Some(0.0)));
    assert_eq!(failure("hang"), (Some("timeout".into()), Some(0.0)));
    assert_eq!(failure("wrong_key"), (Some("wrong_key".into()), Some(0.0)));
    assert_eq!(failure("join"), (None, Some(0.5)), "the others' failures do not touch it");
    assert!(groups["silent"].is_rejected(), "an agent that never called left nothing to train");

    // The hanging agent and the child it started are gone.
    let written = std::fs::read_to_string(pids.path().join("pids")).unwrap();
    for pid in written.split_whitespace() {
        // SIGKILL is sent before `generate` returns; its delivery is the kernel's.
        let stat = || std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(tokio::task::block_in_place(|| gone(pid)), "process {pid} lives on: {}", stat());
    }

    // The engine goes on: the next request is served.
    let again = run(&engine, vec![prompt(9, "join")], 1).await;
    assert_eq!(again["join"].completions[0].episode.as_ref().unwrap().failure, None);
}

/// The committed example agent (`examples/agents/calculator_agent.py`, the official
/// `openai` client and its own calculator) runs unchanged through the proxy, started
/// directly and through the fork server (which preloads and warms `openai`): every
/// turn of its tool loop is recorded (the syntax here reads each response as a call,
/// so it takes all its turns). Skipped without `openai`, except under CI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_agent_runs_unchanged_through_the_proxy() {
    let has_openai = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_openai {
        assert!(std::env::var_os("CI").is_none(), "python3 with openai is missing under CI");
        return eprintln!("skipped: no python3 with the openai package");
    }
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/agents/calculator_agent.py");
    let example = example.display().to_string();
    let launcher = launcher().display().to_string();
    let direct = vec!["python3".to_owned(), example.clone()];
    let forked = ["python3", "-S", &launcher, "--idle-s", "20", &example].map(String::from).to_vec();
    for command in [direct, forked] {
        let config = AgentConfig {
            command: command.clone(),
            reward: AgentReward::Stage,
            env: [
                ("AGENT_MAX_TURNS".to_owned(), "3".to_owned()),
                ("AGENT_MAX_TOKENS".to_owned(), "6".to_owned()),
            ]
            .into(),
            ..config(60.0, &[])
        };
        let chat = Chat { template: None, tools: Some(std::sync::Arc::new(EverythingCalls)) };
        let engine = long_context_agents(config, chat);
        let groups = run(&engine, vec![prompt(4, "3*4=")], 2).await;
        let group = &groups["3*4="];
        group.validate().unwrap();
        let mut turns = 0;
        for c in &group.completions {
            let trace = c.episode.as_ref().unwrap();
            assert_eq!(trace.failure, None, "{command:?}");
            assert_eq!(trace.reward, None, "the reward stage scores it");
            turns += trace.turns;
        }
        assert_eq!(turns, 2 * 3, "every call of both episodes is in a trajectory: {command:?}");
    }
}
