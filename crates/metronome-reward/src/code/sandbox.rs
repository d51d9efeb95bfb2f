//! One program run in a bubblewrap sandbox, with limits, its output read up to a cap
//! and every process it started gone when the run returns.
//!
//! The command line, outside in:
//!
//! ```text
//! [setpriv --reuid=65534 --regid=65534 --clear-groups --nnp]   only when started as root
//! bwrap --unshare-all --die-with-parent --new-session --clearenv
//!       --ro-bind /usr /usr …  --proc /proc --dev /dev
//!       --size N --tmpfs /work --size N --tmpfs /tmp --chdir /work --remount-ro /
//! prlimit --as --cpu --nproc --nofile --fsize --core=0
//! python3 …
//! ```
//!
//! - `--unshare-all` gives the program its own user, PID, network (loopback only,
//!   down), IPC, UTS and cgroup namespaces. The root is a fresh, read-only tmpfs that
//!   holds only the read-only binds (the interpreter and its libraries), a private
//!   `/proc` and a minimal `/dev`; `/work` (the working directory) and `/tmp` are
//!   fresh tmpfs mounts of at most `disk_bytes`. No host path other than the binds is
//!   visible: not the run directory, not `/home`, not `/root`.
//! - The environment is cleared; the program sees `PATH`, `HOME=/work` and `LANG` only.
//! - The limits are rlimits set by util-linux's `prlimit` just before the interpreter
//!   starts, inside the sandbox: address space, CPU seconds (SIGXCPU, then SIGKILL a
//!   second later), processes, open files, file size, no core dumps. `RLIMIT_NPROC`
//!   is not enforced for the real root user, so a supervisor running as root drops to
//!   an unprivileged uid (`user`) with util-linux's `setpriv` before bwrap starts: the
//!   count is then kept per user namespace, so each sandbox has its own.
//! - Wall time and output size are enforced here: standard output and error are read
//!   as they come (never more than `output_bytes` in all); past either limit the
//!   sandbox's PID-namespace init is killed, which makes the kernel kill every process
//!   of the namespace (a daemon that left the process group and the session included)
//!   before bwrap itself exits. The process group of bwrap is killed as well before
//!   it is reaped.
//!
//! Nothing here needs `unsafe`: process ids and signals go through `rustix`'s safe
//! `pidfd` API (no pid reuse races), and rlimits through `prlimit` rather than a
//! `pre_exec` hook.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::process::{
    Pid, PidfdFlags, Signal, kill_process, kill_process_group, pidfd_open, pidfd_send_signal,
};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How long bwrap gets to follow its killed child before it is killed too, and how
/// long pipes are drained after the sandbox is gone: the most a run can outlast its
/// wall-time limit is about twice this.
pub(crate) const KILL_GRACE: Duration = Duration::from_millis(500);

/// The limits and the view of the file system of the code sandbox.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    /// The bubblewrap binary (a name is looked up on `PATH`).
    pub bwrap: PathBuf,
    /// util-linux's `prlimit`, run inside the sandbox: it must lie under a `read_only` path.
    pub prlimit: PathBuf,
    /// util-linux's `setpriv`, used only when the supervisor runs as root.
    pub setpriv: PathBuf,
    /// The interpreter, inside the sandbox (an absolute path under a `read_only` path;
    /// not a pyenv shim, which lives in a home directory the sandbox does not show).
    pub interpreter: PathBuf,
    /// Arguments before the program's (`-I`: isolated mode, no user site, no
    /// environment variables read).
    pub interpreter_args: Vec<String>,
    /// Host paths bound read-only at the same place (missing ones are skipped).
    pub read_only: Vec<PathBuf>,
    /// Wall time of one run, in milliseconds.
    pub wall_ms: u64,
    /// CPU seconds of each process.
    pub cpu_s: u64,
    /// Address space of each process, in MiB.
    pub memory_mb: u64,
    /// Processes (and threads) of the sandbox's user at once, its init included.
    pub processes: u64,
    /// Open files of each process.
    pub open_files: u64,
    /// Standard output and error read in all; past it the run is killed.
    pub output_bytes: usize,
    /// Largest file a process may write, and the size of `/work` and `/tmp` each.
    pub disk_bytes: u64,
    /// The unprivileged uid and gid a supervisor running as root switches to.
    pub user: u32,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            bwrap: "bwrap".into(),
            prlimit: "/usr/bin/prlimit".into(),
            setpriv: "setpriv".into(),
            interpreter: "/usr/bin/python3".into(),
            interpreter_args: vec!["-I".into()],
            read_only: ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin"].map(PathBuf::from).to_vec(),
            wall_ms: 4_000,
            cpu_s: 2,
            memory_mb: 512,
            processes: 16,
            open_files: 64,
            output_bytes: 1 << 20,
            disk_bytes: 16 << 20,
            user: 65_534,
        }
    }
}

impl SandboxConfig {
    pub(crate) fn check(&self) -> Result<()> {
        let positive = [
            ("sandbox.wall_ms", self.wall_ms),
            ("sandbox.cpu_s", self.cpu_s),
            ("sandbox.memory_mb", self.memory_mb),
            ("sandbox.open_files", self.open_files),
            ("sandbox.disk_bytes", self.disk_bytes),
            ("sandbox.output_bytes", self.output_bytes as u64),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(Error::config(*field, "must be positive"));
        }
        // bwrap's init and the interpreter are two processes already.
        if self.processes < 3 {
            return Err(Error::config(
                "sandbox.processes",
                "must be at least 3 (bwrap's init and the interpreter)",
            ));
        }
        if self.user == 0 {
            return Err(Error::config("sandbox.user", "must not be root (0)"));
        }
        for (field, path) in [("sandbox.interpreter", &self.interpreter), ("sandbox.prlimit", &self.prlimit)]
        {
            if !path.is_absolute() {
                return Err(Error::config(
                    field,
                    format!("must be an absolute path, got `{}`", path.display()),
                ));
            }
            if !self.read_only.iter().any(|root| path.starts_with(root)) {
                return Err(Error::config(
                    field,
                    format!(
                        "`{}` is not under any `sandbox.read_only` path, so the sandbox would not see it",
                        path.display()
                    ),
                ));
            }
        }
        if let Some(bad) = self.read_only.iter().find(|p| !p.is_absolute()) {
            return Err(Error::config(
                "sandbox.read_only",
                format!("`{}` is not an absolute path", bad.display()),
            ));
        }
        Ok(())
    }
}

/// Why a run was stopped from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// It ran past its wall-time limit.
    WallTime,
    /// It wrote more than `output_bytes` to standard output and error.
    Output,
}

/// What one sandboxed run did.
#[derive(Clone, Debug)]
pub struct Run {
    /// bwrap's exit status: the program's exit code, or 128 + the signal that killed it.
    pub status: ExitStatus,
    /// Set when the run was killed from outside.
    pub stopped: Option<Stopped>,
    /// Standard output (at most `output_bytes` with `stderr`).
    pub stdout: Vec<u8>,
    /// Standard error.
    pub stderr: Vec<u8>,
    /// Wall time from start to the sandbox being gone.
    pub elapsed: Duration,
}

impl Run {
    /// The signal that ended the program, read from bwrap's `128 + signal` status.
    #[must_use]
    pub fn signal(&self) -> Option<i32> {
        match self.status.code() {
            Some(code) if code > 128 && code < 128 + 65 => Some(code - 128),
            _ => None,
        }
    }
}

/// The sandbox, its binaries resolved and checked by a probe run ([`Sandbox::new`]).
#[derive(Clone, Debug)]
pub struct Sandbox {
    config: SandboxConfig,
    bwrap: PathBuf,
    /// `setpriv`, when the supervisor is root and must drop to `config.user`.
    setpriv: Option<PathBuf>,
}

/// The `SIGXCPU` signal number on Linux: the soft CPU-time limit was reached.
pub(crate) const SIGXCPU: i32 = 24;

impl Sandbox {
    /// Checks the config, finds the binaries and runs a probe program in the sandbox:
    /// a machine where the sandbox cannot be created is an error here, at start-up,
    /// never a silent fallback to running programs unsandboxed.
    pub fn new(config: SandboxConfig) -> Result<Self> {
        config.check()?;
        let missing = |what: &str, path: &Path, hint: &str| Error::Sandbox {
            reason: format!("`{}` ({what}) was not found; {hint}", path.display()),
        };
        let bwrap = which(&config.bwrap).ok_or_else(|| {
            missing("sandbox.bwrap", &config.bwrap, "install bubblewrap (Debian: apt-get install bubblewrap)")
        })?;
        if !config.prlimit.is_file() {
            return Err(missing("sandbox.prlimit", &config.prlimit, "install util-linux"));
        }
        if !config.interpreter.is_file() {
            return Err(missing(
                "sandbox.interpreter",
                &config.interpreter,
                "install python3 or point the key at it",
            ));
        }
        let setpriv = if rustix::process::getuid().is_root() {
            Some(which(&config.setpriv).ok_or_else(|| {
                missing(
                    "sandbox.setpriv",
                    &config.setpriv,
                    "install util-linux; it drops root before bwrap starts",
                )
            })?)
        } else {
            None
        };
        let sandbox = Self { config, bwrap, setpriv };
        sandbox.probe()?;
        Ok(sandbox)
    }

    /// The config it runs with.
    #[must_use]
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    fn probe(&self) -> Result<()> {
        let args = ["-c".to_owned(), "import os; print(6 * 7, os.getcwd())".to_owned()];
        // A cold start of the interpreter can be slow: the probe gets ten seconds.
        let run = self
            .run_for(&args, b"", Duration::from_secs(10))
            .map_err(|e| Error::Sandbox { reason: format!("bwrap did not start: {e}") })?;
        let out = String::from_utf8_lossy(&run.stdout);
        if run.status.success() && out.trim() == "42 /work" {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&run.stderr);
        Err(Error::Sandbox {
            reason: format!(
                "a probe program failed ({}, stopped: {:?}); stderr: {}; bwrap needs unprivileged user \
                 namespaces (sysctl kernel.unprivileged_userns_clone=1, and on Ubuntu \
                 kernel.apparmor_restrict_unprivileged_userns=0)",
                run.status,
                run.stopped,
                stderr.trim()
            ),
        })
    }

    fn command(&self, args: &[String]) -> Command {
        let c = &self.config;
        let mut cmd = match &self.setpriv {
            Some(setpriv) => {
                let mut cmd = Command::new(setpriv);
                let id = c.user.to_string();
                cmd.args(["--reuid", &id, "--regid", &id, "--clear-groups", "--nnp"]).arg(&self.bwrap);
                cmd
            }
            None => Command::new(&self.bwrap),
        };
        cmd.args(["--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]);
        cmd.args([
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/work",
            "--setenv",
            "LANG",
            "C.UTF-8",
        ]);
        for path in &c.read_only {
            cmd.arg("--ro-bind-try").arg(path).arg(path);
        }
        let size = c.disk_bytes.to_string();
        cmd.args(["--proc", "/proc", "--dev", "/dev"]);
        cmd.args(["--size", &size, "--tmpfs", "/work", "--size", &size, "--tmpfs", "/tmp"]);
        cmd.args(["--chdir", "/work", "--remount-ro", "/", "--"]);
        cmd.arg(&c.prlimit);
        cmd.arg(format!("--as={}", c.memory_mb << 20));
        // SIGXCPU at the soft limit says why; SIGKILL a second later if it is ignored.
        cmd.arg(format!("--cpu={}:{}", c.cpu_s, c.cpu_s + 1));
        cmd.arg(format!("--nproc={}", c.processes));
        cmd.arg(format!("--nofile={}", c.open_files));
        cmd.arg(format!("--fsize={}", c.disk_bytes));
        cmd.args(["--core=0", "--"]);
        cmd.arg(&c.interpreter).args(&c.interpreter_args).args(args);
        cmd.env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so that no terminal signal reaches it and the group
            // can be killed as one.
            .process_group(0);
        cmd
    }

    /// Runs the interpreter with `args` (e.g. `-c`, a program) in a fresh sandbox,
    /// `stdin` on its standard input, for at most `wall` (capped at the config's
    /// `wall_ms`). An `Err` is a failure to start or watch it, never the program's.
    pub fn run(&self, args: &[String], stdin: &[u8], wall: Duration) -> std::io::Result<Run> {
        self.run_for(args, stdin, wall.min(Duration::from_millis(self.config.wall_ms)))
    }

    fn run_for(&self, args: &[String], stdin: &[u8], wall: Duration) -> std::io::Result<Run> {
        let start = Instant::now();
        let mut child = self.command(args).spawn()?;
        let watched =
            Watch::new(&mut child, self.config.output_bytes).and_then(|w| w.run(stdin, start + wall));
        match watched {
            Ok((stdout, stderr, stopped)) => {
                let status = child.wait()?;
                Ok(Run { status, stopped, stdout, stderr, elapsed: start.elapsed() })
            }
            Err(e) => {
                // Never leave a sandbox behind, whatever went wrong watching it.
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }
}

/// A started bwrap, watched through a pidfd.
struct Watch<'a> {
    child: &'a mut Child,
    pid: Pid,
    pidfd: std::os::fd::OwnedFd,
    cap: usize,
}

impl<'a> Watch<'a> {
    fn new(child: &'a mut Child, cap: usize) -> std::io::Result<Self> {
        let pid = Pid::from_child(child);
        let pidfd = pidfd_open(pid, PidfdFlags::empty())?;
        Ok(Self { child, pid, pidfd, cap })
    }

    /// Feeds `input`, reads both outputs and waits for bwrap to exit (without reaping
    /// it), killing the sandbox at `deadline` or past the output cap.
    fn run(self, input: &[u8], deadline: Instant) -> std::io::Result<(Vec<u8>, Vec<u8>, Option<Stopped>)> {
        // As files, so that both outputs are one type.
        let mut stdin = self.child.stdin.take().map(|s| File::from(OwnedFd::from(s)));
        let mut stdout = self.child.stdout.take().map(|s| File::from(OwnedFd::from(s)));
        let mut stderr = self.child.stderr.take().map(|s| File::from(OwnedFd::from(s)));
        for fd in [
            stdin.as_ref().map(AsFd::as_fd),
            stdout.as_ref().map(AsFd::as_fd),
            stderr.as_ref().map(AsFd::as_fd),
        ]
        .into_iter()
        .flatten()
        {
            rustix::io::ioctl_fionbio(fd, true)?;
        }
        if input.is_empty() {
            stdin = None;
        }
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut written = 0;
        let mut held = 0usize;
        let mut stopped = None;
        let mut kill_outer_at: Option<Instant> = None;
        let mut exited_at: Option<Instant> = None;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let now = Instant::now();
            if exited_at.is_none() && stopped.is_none() && now >= deadline {
                stopped = Some(Stopped::WallTime);
                kill_outer_at = Some(self.kill_sandbox());
            }
            if let (Some(at), None) = (kill_outer_at, exited_at)
                && now >= at
            {
                let _ = pidfd_send_signal(&self.pidfd, Signal::KILL);
                kill_outer_at = None;
            }
            if let Some(at) = exited_at
                && (stdout.is_none() && stderr.is_none() || now >= at + KILL_GRACE)
            {
                break;
            }
            let mut fds = Vec::with_capacity(4);
            let mut which = Vec::with_capacity(4);
            if let Some(s) = &stdout {
                fds.push(PollFd::new(s, PollFlags::IN));
                which.push(0);
            }
            if let Some(s) = &stderr {
                fds.push(PollFd::new(s, PollFlags::IN));
                which.push(1);
            }
            if let Some(s) = &stdin {
                fds.push(PollFd::new(s, PollFlags::OUT));
                which.push(2);
            }
            if exited_at.is_none() {
                fds.push(PollFd::new(&self.pidfd, PollFlags::IN));
                which.push(3);
            }
            let until = match (exited_at, kill_outer_at, stopped) {
                (Some(at), _, _) => at + KILL_GRACE,
                (None, Some(at), _) => at,
                (None, None, Some(_)) => now + KILL_GRACE,
                (None, None, None) => deadline,
            };
            let timeout = Timespec::try_from(until.saturating_duration_since(now))
                .unwrap_or(Timespec { tv_sec: 1, tv_nsec: 0 });
            match poll(&mut fds, Some(&timeout)) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let ready: Vec<(usize, PollFlags)> =
                fds.iter().zip(&which).map(|(fd, &w)| (w, fd.revents())).collect();
            drop(fds);
            for (w, revents) in ready {
                if revents.is_empty() {
                    continue;
                }
                match w {
                    0 | 1 => {
                        let (pipe, sink) =
                            if w == 0 { (&mut stdout, &mut out) } else { (&mut stderr, &mut err) };
                        let Some(reader) = pipe.as_mut() else { continue };
                        let closed = loop {
                            match reader.read(&mut buf) {
                                Ok(0) => break true,
                                Ok(n) => {
                                    let keep = n.min(self.cap.saturating_sub(held));
                                    sink.extend_from_slice(&buf[..keep]);
                                    held += keep;
                                    if keep < n && stopped.is_none() && exited_at.is_none() {
                                        stopped = Some(Stopped::Output);
                                        kill_outer_at = Some(self.kill_sandbox());
                                    }
                                }
                                Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
                                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                                Err(_) => break true,
                            }
                        };
                        if closed {
                            *pipe = None;
                        }
                    }
                    2 => {
                        let Some(writer) = stdin.as_mut() else { continue };
                        match writer.write(&input[written..]) {
                            Ok(n) => {
                                written += n;
                                if written >= input.len() {
                                    stdin = None;
                                }
                            }
                            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                            // The program closed its standard input (or died): stop feeding it.
                            Err(_) => stdin = None,
                        }
                    }
                    _ => {
                        // bwrap exited; the namespace's processes are gone with its init.
                        // Sweep its process group while bwrap, unreaped, still holds the id.
                        let _ = kill_process_group(self.pid, Signal::KILL);
                        exited_at = Some(Instant::now());
                        stdin = None;
                    }
                }
            }
        }
        Ok((out, err, stopped))
    }

    /// Kills the sandbox's init (bwrap's child, PID 1 of the namespace): the kernel
    /// then kills every process of the namespace, and bwrap exits once it has reaped
    /// it. Returns when bwrap itself is to be killed if it has not exited by then.
    fn kill_sandbox(&self) -> Instant {
        let children = children_of(self.pid);
        if children.is_empty() {
            // Not started yet (or already gone): bwrap's own death takes its child
            // with it (`--die-with-parent`).
            let _ = pidfd_send_signal(&self.pidfd, Signal::KILL);
        }
        for child in children {
            let _ = kill_process(child, Signal::KILL);
        }
        Instant::now() + KILL_GRACE
    }
}

/// The children of `pid`, from `/proc` (bwrap is single-threaded, so its main task's
/// list is complete).
fn children_of(pid: Pid) -> Vec<Pid> {
    let raw = pid.as_raw_nonzero().get();
    let listed = std::fs::read_to_string(format!("/proc/{raw}/task/{raw}/children"));
    let pids: Vec<i32> = match listed {
        Ok(text) => text.split_whitespace().filter_map(|p| p.parse().ok()).collect(),
        // Kernels without CONFIG_PROC_CHILDREN: scan every process's parent.
        Err(_) => std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|p| parent_of(*p) == Some(raw))
            .collect(),
    };
    pids.into_iter().filter_map(Pid::from_raw).collect()
}

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

/// `name` itself when it has a slash, else the first match on `PATH`.
fn which(name: &Path) -> Option<PathBuf> {
    if name.components().count() > 1 || name.is_absolute() {
        return name.is_file().then(|| name.to_owned());
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}
