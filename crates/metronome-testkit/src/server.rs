//! A local `nats-server` child process for tests, examples and benchmarks: JetStream on,
//! storage in a fresh temporary directory, a free loopback port, killed on drop.
//!
//! It is not a way to run NATS in production (see `deploy/README.md` for that); it
//! exists so that everything exercising the NATS transport talks to a real server
//! rather than a mock, and starts it one way. The binary is `$NATS_SERVER_BIN`, else
//! `nats-server` on `PATH` or in the Debian locations (`apt-get install nats-server`).

use std::io::{self, BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long a starting server may take to report "Server is ready".
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `nats-server` owned by its creator; killed (SIGKILL) on drop.
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    extra: Vec<String>,
    dir: tempfile::TempDir,
}

/// The server binary: `$NATS_SERVER_BIN`, else `nats-server` on `PATH` or in the
/// Debian locations.
pub fn binary() -> io::Result<PathBuf> {
    if let Some(p) = std::env::var_os("NATS_SERVER_BIN") {
        return Ok(PathBuf::from(p));
    }
    let mut candidates: Vec<PathBuf> = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("nats-server"))
        .collect();
    candidates.extend(
        ["/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"].map(PathBuf::from),
    );
    candidates.into_iter().find(|p| p.is_file()).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "nats-server not found on PATH or in /usr/sbin: install it (`apt-get install -y nats-server`; \
             .ci/run does) or set NATS_SERVER_BIN",
        )
    })
}

/// How many ports [`NatsServer::start`] tries when another process takes the one it
/// chose first.
pub const PORT_ATTEMPTS: u32 = 5;

/// A loopback port that was free a moment ago.
pub fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl NatsServer {
    /// Starts a server with JetStream on a free loopback port, storing into a fresh
    /// temporary directory, with `extra` arguments (e.g. `--user`, `--pass`); returns
    /// once the server reports that it is ready.
    ///
    /// The port is free when chosen, but another test may bind it before the server
    /// does (CI failed once so: "bind: address already in use"); the server is then
    /// started again on another port, up to [`PORT_ATTEMPTS`] times.
    pub fn start(extra: &[&str]) -> io::Result<Self> {
        Self::start_on(extra, free_port)
    }

    /// [`NatsServer::start`] on the ports `next_port` gives.
    fn start_on(extra: &[&str], mut next_port: impl FnMut() -> io::Result<u16>) -> io::Result<Self> {
        let dir = tempfile::tempdir()?;
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        let mut attempt = 1;
        loop {
            let port = next_port()?;
            match spawn(port, &dir, &extra) {
                Ok(child) => return Ok(Self { child: Some(child), port, extra, dir }),
                Err(e) if attempt < PORT_ATTEMPTS && e.to_string().contains("address already in use") => {
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The client URL.
    #[must_use]
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's process id (for measuring its CPU time, say); `None` while it is
    /// not running.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server (SIGKILL: no graceful shutdown) and starts it again on the same
    /// port and storage directory.
    pub fn restart(&mut self) -> io::Result<()> {
        self.kill();
        self.child = Some(spawn(self.port, &self.dir, &self.extra)?);
        Ok(())
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
/// up before anyone connects.
fn spawn(port: u16, dir: &tempfile::TempDir, extra: &[String]) -> io::Result<Child> {
    let bin = binary()?;
    let mut child = Command::new(&bin)
        .args(["-js", "-sd"])
        .arg(dir.path())
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot start {}: {e}", bin.display())))?;
    let stderr = child.stderr.take().expect("stderr is piped");
    let (ready_tx, ready_rx) = mpsc::channel();
    // The reader keeps draining the server's log after it is ready, so the server never
    // blocks on a full pipe.
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
    let failed = match ready_rx.recv_timeout(READY_TIMEOUT) {
        Ok(Ok(())) => return Ok(child),
        Ok(Err(log)) => format!("nats-server exited before it was ready:\n{log}"),
        Err(_) => format!("nats-server on port {port} was not ready within {} s", READY_TIMEOUT.as_secs()),
    };
    let _ = child.kill();
    let _ = child.wait();
    Err(io::Error::other(failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port taken between its choice and the server's bind is replaced by another;
    /// one taken on every attempt is an error that says so.
    #[test]
    fn a_port_taken_before_the_server_binds_it_is_replaced() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let taken_port = taken.local_addr().unwrap().port();
        let mut first = true;
        let server =
            NatsServer::start_on(
                &[],
                || {
                    if std::mem::take(&mut first) { Ok(taken_port) } else { free_port() }
                },
            )
            .expect("the second port is free");
        assert_ne!(server.port, taken_port);
        let Err(e) = NatsServer::start_on(&[], || Ok(taken_port)) else { panic!("every attempt collides") };
        assert!(e.to_string().contains("address already in use"), "{e}");
    }
}
