"""Node processes forked from one warm process, for `drift coord --local N` (and the test harness).

Every fresh Python that trains with torch spends ~3 s of CPU importing torch, and torch._dynamo,
which its optimizers load on first use; N local nodes on a two-core machine paid that N times
before the first step. On Linux `start()` hands the command to a server (`python -m drift.launch`,
started once per process that launches: torch and drift imported, nothing else: no thread, no
device), which forks a child that takes the command's environment, working directory, log file
and session, runs `drift ARGV` (or `python SCRIPT ARGV`) as a fresh interpreter would, and ends as
one (threads joined, atexit run). The child is a process of its own, signalled and killed by pid;
the server reports its exit, so `Child` has the parts of subprocess.Popen drift uses. The server
leaves when the process that started it is gone; its children stay until they end. Elsewhere
`start()` runs a plain subprocess.

The protocol, one JSON object a line: a request {argv, script, env, cwd, log, session, pgid} is
answered {"pid": P}; a child's end is {"exit": P, "code": C} (C negative: the signal).
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "numpy", "drift.cli", "drift.node", "drift.loop", "drift.workers.torch_worker"]
WARM = sys.platform.startswith("linux")


# --- the child ------------------------------------------------------------------------------------


def _become(req: dict) -> None:
    """In the forked child: take the command's session, environment, directory and output, run it,
    and end as its interpreter would. Its name in `ps -e`/`top` is "drift NAME" (join's --name)."""
    argv, script = req["argv"], req["script"]
    if req["session"]:
        os.setsid()
    elif req["pgid"] is not None:
        os.setpgid(0, req["pgid"])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (the server ignores Ctrl-C; a command does not)
    if "--name" in argv[:-1]:
        with open("/proc/self/comm", "w") as f:  # (its command line stays the server's)
            f.write(f"drift {argv[argv.index('--name') + 1]}"[:15])
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    import numpy as np

    np.random.seed()  # a fresh process seeds numpy's global generator from the OS; a fork inherits it
    code: int | str | None = 0
    try:
        if script is None:
            from drift.cli import main

            sys.argv = ["drift", *argv]
            main(argv, prog_name="drift")
        else:
            sys.argv = [script, *argv]
            sys.path[0] = str(Path(script).parent)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    threading._shutdown()  # the interpreter's own exit: wait for non-daemon threads, then atexit
    import atexit

    atexit._run_exitfuncs()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0)


# --- the server -----------------------------------------------------------------------------------


def serve() -> None:
    """`python -m drift.launch`: fork a child per request line on stdin; report pids and exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the commands, not for us
    for name in PRELOAD:
        __import__(name)
    children: set[int] = set()
    buf = b""

    def say(msg: dict) -> None:
        os.write(1, (json.dumps(msg) + "\n").encode())

    while True:
        if select.select([0], [], [], 0.05)[0]:
            data = os.read(0, 1 << 20)
            if not data:  # the launching process is gone: what we started runs on
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _become(json.loads(line))
                children.add(pid)
                say({"pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


# --- the launching side ---------------------------------------------------------------------------


class Child:
    """A forked command: subprocess.Popen's pid, returncode, poll, wait, send_signal, kill, terminate."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _Server:
    """This process's fork server: requests go one at a time; a reader thread takes the replies."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "drift.launch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.lock = threading.Lock()
        self.pids: list[int] = []
        self.got = threading.Condition()
        self.children: dict[int, Child] = {}
        self.early: dict[int, int] = {}  # exits read before their pid was claimed
        threading.Thread(target=self._read, daemon=True, name="drift-launch").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.got:
                if "pid" in msg:
                    self.pids.append(msg["pid"])
                elif msg["exit"] in self.children:
                    self.children.pop(msg["exit"])._exited(msg["code"])
                else:
                    self.early[msg["exit"]] = msg["code"]
                self.got.notify_all()
        with self.got:  # the server died: nothing more will be reported
            for child in self.children.values():
                child._exited(-signal.SIGKILL)
            self.children.clear()
            self.got.notify_all()

    def start(self, req: dict) -> Child:
        with self.lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            with self.got:
                if not self.got.wait_for(lambda: self.pids or self.proc.poll() is not None, timeout=120):
                    raise OSError("drift.launch: the fork server did not answer within 120 s")
                if not self.pids:
                    raise OSError(f"drift.launch: the fork server exited with code {self.proc.returncode}")
                child = Child(self.pids.pop(0))
                if child.pid in self.early:
                    child._exited(self.early.pop(child.pid))
                else:
                    self.children[child.pid] = child
            return child


_server: _Server | None = None
_server_lock = threading.Lock()


def start(
    argv: list[str],
    log: Path,
    env: dict[str, str],
    *,
    script: Path | None = None,
    cwd: Path | None = None,
    session: bool = False,
    pgid: int | None = None,
) -> Child | subprocess.Popen:
    """`drift ARGV` (or `python SCRIPT ARGV`) with its output appended to `log`; `session`: a
    session of its own (setsid), else process group `pgid` (None: this one's)."""
    global _server
    if not WARM:
        with open(log, "a") as fh:
            launcher = [sys.executable, str(script)] if script else [sys.executable, "-m", "drift"]
            return subprocess.Popen(
                [*launcher, *argv],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=session,
                preexec_fn=None if pgid is None else (lambda: os.setpgid(0, pgid)),
            )
    Path(log).touch()  # there when start() returns, as with a file Popen writes to
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        server = _server
    req = {
        "argv": list(argv),
        "script": str(script) if script else None,
        "env": dict(env),
        "cwd": str(cwd or os.getcwd()),
        "log": str(log),
        "session": session,
        "pgid": pgid,
    }
    return server.start(req)


if __name__ == "__main__":
    serve()
