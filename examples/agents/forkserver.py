"""Starts an unmodified Python agent without paying for its imports every episode.

Metronome's `agent` backend starts the agent's command once per prompt and sample.
An agent written with the official `openai` package spends most of a short episode
importing it (about 0.66 s of CPU per start on a 2-core machine, more than the
model's tokens cost), so a run of thousands of episodes is mostly imports. Run the
agent through this launcher instead, unchanged:

    command = ["python3", "-I", "-S", "examples/agents/forkserver.py", "examples/agents/calculator_agent.py"]

The launcher starts in about 16 ms (a bare interpreter takes 11): it imports only
`_socket` and what the interpreter has built in, and speaks `marshal` (the server is
the same interpreter, and only this user can reach it). It connects to a server for
that agent (a Unix socket in a directory of this user's alone under `$TMPDIR`, one
per agent path, Python and preload list) and starts the server the first time. The
server has imported `--preload` (default: `openai`) once and run what its first use
runs (`WARM`); for each launch it forks once, and the child takes the launcher's
stdin, stdout and stderr (passed over the socket), its environment, working
directory and arguments, and runs the agent script as `__main__` with `runpy`. The
launcher exits with the agent's exit status.

What Metronome relies on still holds: the agent's output reaches Metronome's pipes
directly, its environment (`OPENAI_BASE_URL`, `OPENAI_API_KEY`, the task) is the
episode's, and when Metronome kills the launcher's process group (time limit, or the
run ends) the server kills the agent's whole process group too, because it watches the
launcher's connection (one loop watches every launch's connection and agent). The server exits after `--idle-s` seconds (default 120) with no
launch. Set `AGENT_FORKSERVER=0` to run the agent in this process instead (the same
behaviour, the imports paid every time).

What differs from a fresh interpreter: modules the agent imports are already imported
(module-level state is whatever importing left, as at a fresh start), and the agent
runs in a child of the server, not of Metronome.
"""

import _socket
import marshal
import os
import sys

USAGE = "usage: forkserver.py [--preload MOD,...] [--idle-s N] AGENT.py [ARGS...]"
SIGKILL = 9  # signal.SIGKILL, without importing `signal` in the launcher


def send_message(sock, message, fds=()):
    """`message` (marshal) after its length, with `fds` passed alongside."""
    data = marshal.dumps(message)
    payload = len(data).to_bytes(4, "big") + data
    if fds:
        rights = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds)
        sock.sendmsg([payload], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
    else:
        sock.sendall(payload)


def receive_message(sock):
    """One message and the descriptors that came with it; None at end of stream."""
    header, ancillary, _, _ = sock.recvmsg(4, _socket.CMSG_SPACE(16 * 4))
    fds = [
        int.from_bytes(payload[i : i + 4], sys.byteorder, signed=True)
        for level, kind, payload in ancillary
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS
        for i in range(0, len(payload) - 3, 4)
    ]
    header = read_exactly(sock, header, 4)
    body = header and read_exactly(sock, b"", int.from_bytes(header, "big"))
    if body is None:
        return None, fds
    return marshal.loads(body), fds


def read_exactly(sock, data, size):
    """`data` completed to `size` bytes from `sock`; None if the stream ends first."""
    if not data and size:
        data = sock.recv(size)
    while data and len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return None
        data += more
    return data if len(data) == size else None


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


def start_agent(request, fds, inherited):
    """Forks the agent of one launch: in its own process group, on the launcher's
    descriptors, environment and working directory. Returns its pid."""
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    try:
        # The server's descriptors: the listener, every launch's connection (this one's
        # too, or the launcher would not see the server die) and agent.
        for fd in inherited:
            os.close(fd)
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
        code = run_agent(request["argv"])
    except BaseException as e:  # noqa: BLE001 - the child must never return into the server
        print(f"forkserver: could not start the agent: {e}", file=sys.stderr)
        code = 1
    os._exit(code)


def warm_openai():
    """Runs once in the server what every agent's first use of `openai` would run in
    its child: a client (httpx's transport), `client.chat.completions` (imported on
    first access), a request (built, sent to a closed loopback port, refused) and a
    response parsed into its models (pydantic builds validators on first use). About
    0.18 s of CPU per episode otherwise, the import excluded; what stays per child is
    the client's TLS context (about 0.03 s), which each client builds anew."""
    import socket

    import openai
    from openai.types.chat import ChatCompletion

    with socket.socket() as probe:  # a port nothing listens on: bound, never listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="warm-up", max_retries=0)
        try:
            client.chat.completions.create(model="warm-up", messages=[{"role": "user", "content": ""}])
        except openai.APIConnectionError:
            pass
        client.close()
    ChatCompletion.model_validate({
        "id": "warm-up", "object": "chat.completion", "created": 0, "model": "warm-up",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
            "role": "assistant", "content": "",
            "tool_calls": [{"id": "0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })


# What to run after importing a preloaded module, so its children start warm.
WARM = {"openai": warm_openai}



def serve(path, identity, preload, idle_s):
    """The server: imports `preload` (and warms what `WARM` knows), then runs one loop
    over its listener, every launch's connection and every running agent until it has
    been idle for `idle_s` seconds. A launch's connection closing first (its launcher
    was killed) kills the agent's process group; an agent ending first sends its exit
    status back."""
    import gc
    import select
    import socket

    for module in preload:
        __import__(module)  # a module that does not import stops the server, named in its log
        if module in WARM:
            try:
                WARM[module]()
            except Exception as e:  # noqa: BLE001 - a warm-up only saves time; agents run without it
                print(f"forkserver: warming {module} failed, agents will pay for its first use: {e!r}",
                      file=sys.stderr, flush=True)
    # What exists now is shared by every fork; the collector would write to each
    # object it visits and so copy the pages of a module set it never frees.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(128)
    poll = select.poll()
    poll.register(listener, select.POLLIN)
    launches = {}  # connection fd -> (connection, agent pid, pidfd)
    agents = {}  # pidfd -> connection fd

    def accept():
        conn, _ = listener.accept()
        conn.settimeout(10)  # a launcher sends its request as soon as it connects
        try:
            request, fds = receive_message(conn)
        except (OSError, ValueError, EOFError, TypeError):
            request, fds = None, []
        valid = isinstance(request, dict) and len(fds) == 3
        if not valid or request.get("identity") != identity:
            for passed in fds:
                os.close(passed)
            if valid:  # another agent's launcher, whose socket name collided with ours
                try:
                    send_message(conn, {"error": f"the server at {path} runs {identity}"})
                except OSError:
                    pass
            conn.close()
            return
        pid = start_agent(request, fds, [listener.fileno(), conn.fileno(), *launches, *agents])
        try:  # the launcher kills the agent's group itself if this server dies first
            send_message(conn, {"pid": pid})
        except OSError:
            pass
        pidfd = os.pidfd_open(pid)
        launches[conn.fileno()] = (conn, pid, pidfd)
        agents[pidfd] = conn.fileno()
        poll.register(conn, select.POLLIN)
        poll.register(pidfd, select.POLLIN)

    def finish(conn_fd, agent_ended):
        """Ends a launch: its agent exited (its status goes back), or its launcher
        went away (the agent's process group is killed)."""
        conn, pid, pidfd = launches.pop(conn_fd)
        del agents[pidfd]
        if not agent_ended:
            try:
                os.killpg(pid, SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
        if agent_ended:
            try:
                send_message(conn, {"exit": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass
        for fd in (conn_fd, pidfd):
            poll.unregister(fd)
        conn.close()
        os.close(pidfd)

    try:
        while True:
            events = poll.poll(None if launches else idle_s * 1000)
            if not events:
                return
            ready = [fd for fd, _ in events]
            # Ended launches first, new ones after: a descriptor closed here and
            # reused by a new launch in the same round must not meet a stale event.
            for fd in ready:
                if fd in agents:
                    finish(agents[fd], agent_ended=True)
                elif fd in launches:
                    finish(fd, agent_ended=False)
            if listener.fileno() in ready:
                accept()
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def private_dir():
    """This user's directory for servers' sockets: `metronome-forkserver-UID` in
    `$TMPDIR` (`/tmp` when unset), made with mode 0700. Anyone who can connect to a
    server runs code as its user, and a launcher sends its environment (API keys) to
    whatever listens at the path, so a directory that is a link, is another user's, or
    is open to others is refused rather than used."""
    path = os.path.join(os.environ.get("TMPDIR") or "/tmp", f"metronome-forkserver-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    is_dir = st.st_mode & 0o170000 == 0o040000
    if not is_dir or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(
            f"{path} is not a directory of this user's alone (mode {st.st_mode & 0o7777:o}, "
            f"{'a directory' if is_dir else 'not a directory'}, owner {st.st_uid}): "
            "remove it, or set TMPDIR elsewhere"
        )
    return path


def fnv1a64(data):
    """A 64-bit FNV-1a hash: names a server's socket without importing hashlib (a
    collision is caught by the server, which checks each launch's identity)."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def identity_of(agent, preload):
    """What a server runs: this interpreter, the agent script's path, the preloads."""
    return repr((sys.executable, agent, preload))


def socket_path(identity):
    """Where the server of `identity` listens."""
    return os.path.join(private_dir(), fnv1a64(identity.encode()) + ".sock")


def connect(path, server_argv):
    """A connection to the server at `path`, starting it (once, under a lock) if need be."""
    import time

    def attempt():
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            return None

    sock = attempt()
    if sock:
        return sock
    import fcntl
    import subprocess

    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = attempt()
        if sock:
            return sock
        # The server's own errors (a preload that does not import) go to a log beside
        # its socket, which a launch that saw it exit quotes.
        with open(path + ".log", "w") as log:
            server = subprocess.Popen(
                server_argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,  # not in the launcher's group: one launch's kill leaves it
                close_fds=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sock = attempt()
            if sock:
                return sock
            if server.poll() is not None:
                with open(path + ".log", errors="replace") as log:
                    said = log.read()[-2000:].strip()
                raise RuntimeError(f"the server for {path} exited ({server.returncode}) before listening: {said}")
            time.sleep(0.02)
    raise RuntimeError(f"the server for {path} did not start within 60 s")


def main():
    args = sys.argv[1:]
    preload, idle_s, serve_at = ["openai"], 120.0, None
    while args and args[0].startswith("--"):
        if args[0] == "--preload" and len(args) > 1:
            preload = [m for m in args[1].split(",") if m]
        elif args[0] == "--idle-s" and len(args) > 1:
            idle_s = float(args[1])
        elif args[0] == "--serve" and len(args) > 1:
            serve_at = args[1]
        else:
            print(USAGE, file=sys.stderr)
            return 2
        args = args[2:]
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    agent = [os.path.abspath(args[0])] + args[1:]
    identity = identity_of(agent[0], preload)
    if serve_at:
        serve(serve_at, identity, preload, idle_s)
        return 0
    if os.environ.get("AGENT_FORKSERVER") == "0":
        return run_agent(agent)
    try:
        path = socket_path(identity)
        server = [sys.executable, os.path.abspath(__file__), "--preload", ",".join(preload),
                  "--idle-s", str(idle_s), "--serve", path, agent[0]]
        sock = connect(path, server)
    except (RuntimeError, OSError) as e:
        print(f"forkserver: {e}", file=sys.stderr)
        return 1
    send_message(sock, {"identity": identity, "argv": agent, "env": dict(os.environ), "cwd": os.getcwd()},
                 fds=(0, 1, 2))
    started, _ = receive_message(sock)
    if started is not None and "error" in started:
        print(f"forkserver: {started['error']}", file=sys.stderr)
        return 1
    reply = started and receive_message(sock)[0]
    if reply is None:
        # The server is gone (killed, or it failed to start the agent): the agent it
        # forked is not the server's to kill any more, so it is this launcher's.
        if started is not None:
            try:
                os.killpg(started["pid"], SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        print("forkserver: the server went away before the agent finished", file=sys.stderr)
        return 1
    code = reply["exit"]
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
