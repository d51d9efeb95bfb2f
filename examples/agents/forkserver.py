"""Starts an unmodified Python agent without paying for its imports every episode.

Metronome's `agent` backend starts the agent's command once per prompt and sample.
An agent written with the official `openai` package spends most of a short episode
importing it (about 0.66 s of CPU per start on a 2-core machine, more than the
model's tokens cost), so a run of thousands of episodes is mostly imports. Run the
agent through this launcher instead, unchanged:

    command = ["python3", "-I", "-S", "examples/agents/forkserver.py", "examples/agents/calculator_agent.py"]

The launcher itself imports nothing heavy. It connects to a server for that agent (a
Unix socket in a directory of this user's alone in the temporary directory, one per
agent path, Python and preload list)
and starts the server the first time. The server has imported `--preload` (default:
`openai`) once; for each launch it forks, and the child takes the launcher's stdin,
stdout and stderr (passed over the socket), its environment, working directory and
arguments, and runs the agent script as `__main__` with `runpy`. The launcher exits
with the agent's exit status.

What Metronome relies on still holds: the agent's output reaches Metronome's pipes
directly, its environment (`OPENAI_BASE_URL`, `OPENAI_API_KEY`, the task) is the
episode's, and when Metronome kills the launcher's process group (time limit, or the
run ends) the server kills the agent's whole process group too, because it watches the
launcher's connection. The server exits after `--idle-s` seconds (default 120) with no
launch. Set `AGENT_FORKSERVER=0` to run the agent in this process instead (the same
behaviour, the imports paid every time).

What differs from a fresh interpreter: modules the agent imports are already imported
(module-level state is whatever importing left, as at a fresh start), and the agent
runs in a child of the server, not of Metronome.
"""

import array
import hashlib
import json
import os
import socket
import struct
import sys
import tempfile
import time

USAGE = "usage: forkserver.py [--preload MOD,...] [--idle-s N] AGENT.py [ARGS...]"
HEADER = struct.Struct("!I")


def send_message(sock, message, fds=()):
    data = json.dumps(message).encode()
    payload = HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(payload)


def receive_message(sock):
    """One message and the descriptors that came with it; None at end of stream."""
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(16 * fds.itemsize))
    if not data:
        return None, []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    while len(data) < HEADER.size:
        more = sock.recv(HEADER.size - len(data))
        if not more:
            return None, list(fds)
        data += more
    (length,) = HEADER.unpack(data[: HEADER.size])
    body = data[HEADER.size :]
    while len(body) < length:
        more = sock.recv(length - len(body))
        if not more:
            return None, list(fds)
        body += more
    return json.loads(body), list(fds)


def run_agent(argv):
    """Runs the agent script as `__main__` here; returns its exit status."""
    import runpy
    import traceback

    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def supervise(conn):
    """In a child of the server: start the agent of one launch and wait for it or for
    the launcher to go away, whichever comes first."""
    import select
    import signal

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, fds = receive_message(conn)
    if request is None or len(fds) != 3:
        os._exit(1)
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setpgid(0, 0)  # its own group, so that what the agent starts is killed with it
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", closefd=False, buffering=1 if os.isatty(1) else -1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        os._exit(run_agent(request["argv"]))
    for fd in fds:
        os.close(fd)
    child = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn, child], [], [])
        if child in ready:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            try:
                send_message(conn, {"exit": code})
            except OSError:
                pass
            os._exit(0)
        # The launcher closed its end: it was killed, so the agent goes too.
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        os._exit(0)


def serve(path, preload, idle_s):
    """The server: imports `preload`, then forks a supervisor per launch until idle."""
    import signal

    for module in preload:
        __import__(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(128)
    listener.settimeout(idle_s)
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                return
            if os.fork() == 0:
                listener.close()
                supervise(conn)
            conn.close()
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def private_dir():
    """This user's directory for servers' sockets: `metronome-forkserver-UID` in the
    temporary directory, made with mode 0700. Anyone who can connect to a server runs
    code as its user, and a launcher sends its environment (API keys) to whatever
    listens at the path, so a directory that is a link, is another user's, or is open to
    others is refused rather than used."""
    import stat

    path = os.path.join(tempfile.gettempdir(), f"metronome-forkserver-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(
            f"{path} is not a directory of this user's alone (mode {stat.filemode(st.st_mode)}, "
            f"owner {st.st_uid}): remove it, or set TMPDIR elsewhere"
        )
    return path


def connect(path, server_argv):
    """A connection to the server at `path`, starting it (once, under a lock) if need be."""
    import fcntl
    import subprocess

    def attempt():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            return None

    sock = attempt()
    if sock:
        return sock
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = attempt()
        if sock:
            return sock
        subprocess.Popen(
            server_argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the launcher's group: one launch's kill leaves it
            close_fds=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sock = attempt()
            if sock:
                return sock
            time.sleep(0.02)
    raise RuntimeError(f"forkserver: the server for {path} did not start")


def main():
    args = sys.argv[1:]
    preload, idle_s = ["openai"], 120.0
    while args and args[0].startswith("--"):
        if args[0] == "--preload" and len(args) > 1:
            preload = [m for m in args[1].split(",") if m]
        elif args[0] == "--idle-s" and len(args) > 1:
            idle_s = float(args[1])
        elif args[0] == "--serve" and len(args) > 1:
            serve(args[1], preload, idle_s)
            return 0
        else:
            print(USAGE, file=sys.stderr)
            return 2
        args = args[2:]
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    agent = [os.path.abspath(args[0])] + args[1:]
    if os.environ.get("AGENT_FORKSERVER") == "0":
        return run_agent(agent)
    key = hashlib.sha256(json.dumps([sys.executable, agent[0], preload]).encode()).hexdigest()[:16]
    try:
        path = os.path.join(private_dir(), f"{key}.sock")
    except RuntimeError as e:
        print(f"forkserver: {e}", file=sys.stderr)
        return 1
    server = [sys.executable, os.path.abspath(__file__), "--preload", ",".join(preload),
              "--idle-s", str(idle_s), "--serve", path]
    sock = connect(path, server)
    send_message(sock, {"argv": agent, "env": dict(os.environ), "cwd": os.getcwd()}, fds=(0, 1, 2))
    reply, _ = receive_message(sock)
    if reply is None:
        print("forkserver: the server went away before the agent finished", file=sys.stderr)
        return 1
    code = reply["exit"]
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
