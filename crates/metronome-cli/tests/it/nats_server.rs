//! Starts a real `nats-server` with JetStream on a free loopback port, and kills it
//! on drop.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A running `nats-server` owned by a test.
pub(crate) struct NatsServer {
    child: Option<Child>,
    port: u16,
    _dir: tempfile::TempDir,
}

/// The server binary: `$NATS_SERVER_BIN`, else `nats-server` on `PATH` or in the
/// Debian location. A missing server fails the test with instructions: these tests
/// never skip silently.
fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("NATS_SERVER_BIN") {
        return PathBuf::from(p);
    }
    let mut candidates: Vec<PathBuf> = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("nats-server"))
        .collect();
    candidates.extend(
        ["/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"].map(PathBuf::from),
    );
    candidates.into_iter().find(|p| p.is_file()).unwrap_or_else(|| {
        panic!(
            "nats-server not found on PATH or in /usr/sbin: the NATS transport tests need a real server. \
             Install it (`apt-get install -y nats-server`; CI installs it in .ci/run) or set NATS_SERVER_BIN"
        )
    })
}

pub(crate) fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("local address").port()
}

impl NatsServer {
    /// Starts a server with JetStream storing into a fresh temporary directory, with
    /// `extra` arguments (e.g. `--user`, `--pass`).
    pub(crate) fn start(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory for JetStream");
        let port = free_port();
        let child = spawn(port, &dir, extra);
        Self { child: Some(child), port, _dir: dir }
    }

    /// The client URL.
    pub(crate) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Spawns the server and waits for its "Server is ready" line, so that JetStream is
/// up before the test connects.
fn spawn(port: u16, dir: &tempfile::TempDir, extra: &[&str]) -> Child {
    let bin = binary();
    let mut child = Command::new(&bin)
        .args(["-js", "-sd"])
        .arg(dir.path())
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let stderr = child.stderr.take().expect("piped stderr");
    let (ready_tx, ready_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut log = Vec::new();
        let mut ready = Some(ready_tx);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("Server is ready")
                && let Some(tx) = ready.take()
            {
                let _ = tx.send(Ok(()));
            }
            if ready.is_some() {
                log.push(line);
            }
        }
        if let Some(tx) = ready {
            let _ = tx.send(Err(log.join("\n")));
        }
    });
    match ready_rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Ok(())) => child,
        Ok(Err(log)) => panic!("nats-server exited before it was ready:\n{log}"),
        Err(_) => {
            let _ = child.kill();
            panic!("nats-server on port {port} was not ready within 30 s")
        }
    }
}
