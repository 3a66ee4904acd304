"""`drift coord --local N`'s nodes, forked on Linux from one process that imported torch once.

Every node process imports torch and drift before it can join: about 2.5 s of one core each, 80 s
of CPU for `--local 32`, which on two cores kept its nodes from joining for 34-48 s (now 7-9 s).
On Linux the coordinator starts a fork server (`python -m drift.forks`, in a session of its own)
that imports them once (`PRELOAD`) while the coordinator starts, and forks each node from it: the
same `drift join` command line (or a user's own-loop `python SCRIPT TICKET`), in a process and a
session of its own, writing to its own log. Elsewhere (macOS, whose system libraries are not safe
to fork, and Windows) each node is a fresh process.

The server reads one request a line on stdin (JSON: args, env, log, title, threads, cwd and, for a
script, its path: a user's own loop, or a test's wrapper of drift.cli.main) and answers on
stdout, `started PID` at once and `exited PID CODE` when the node ends (it reaps them; CODE as
`subprocess.Popen.returncode`: -N for signal N). It leaves when its stdin ends, that is when the
coordinator is gone, whatever ended it; a node whose parent is gone leaves too (drift.node's
heartbeat). A node's command line in `ps` is its title, `drift join --name local-I` or `python
SCRIPT (drift --local node I)`: no ticket.
The test suite's swarms (benchmarks/harness/simulate.py) fork their nodes the same way.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PRELOAD = ["torch", "drift.cli"]  # (drift.cli imports drift.node)


def available() -> bool:
    return sys.platform == "linux"


class Server:
    """The coordinator's end of the fork server."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "drift.forks"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
        )
        self._lock = threading.Lock()  # one request at a time: its `started` line is the next one
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._heard = threading.Condition()
        threading.Thread(target=self._read, name="drift-forks", daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            kind, *nums = line.split()
            with self._heard:
                if kind == b"started":
                    self._started.append(int(nums[0]))
                elif kind == b"exited":
                    self._exits[int(nums[0])] = int(nums[1])
                self._heard.notify_all()
        with self._heard:
            self._heard.notify_all()

    def fork(
        self,
        args: list[str],
        env: dict[str, str],
        log: Path,
        title: str,
        threads: int | None,
        script: Path | None = None,
        cwd: Path | None = None,
    ) -> Forked:
        """A node running `drift ARGS` (or `python SCRIPT ARGS`: a user's own loop, a test's
        wrapper) with `env` in `cwd` (default: this process's), its output in `log`, `title` in ps,
        `threads` torch threads (None: torch's default, as in a fresh process); waits until it is
        started (the server's imports, the first time)."""
        log.write_text("")  # (there for whoever reads it, whatever the node gets to)
        req = {
            "args": args,
            "env": env,
            "log": str(log),
            "title": title,
            "threads": threads,
            "cwd": str(cwd or os.getcwd()),
        }
        if script is not None:
            req["script"] = str(script)
        with self._lock:
            self._proc.stdin.write(json.dumps(req).encode() + b"\n")
            self._proc.stdin.flush()
            with self._heard:
                if not self._heard.wait_for(lambda: self._started or self._proc.poll() is not None, 300):
                    raise OSError("the fork server did not start a node within 300 s")
                if not self._started:
                    raise OSError(f"the fork server exited with code {self._proc.poll()}")
                return Forked(self, self._started.pop(0))

    def alive(self) -> bool:
        return self._proc.poll() is None

    def exit_code(self, pid: int) -> int | None:
        with self._heard:
            if pid in self._exits:
                return self._exits[pid]
        if self._proc.poll() is None:
            return None
        try:  # the server is gone, and with it who reaps the node: is it still there?
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return 255
        except PermissionError:
            return None


class Forked:
    """A forked node, with the methods of `subprocess.Popen` that `drift coord` uses (poll,
    returncode, wait, terminate, kill, pid)."""

    def __init__(self, server: Server, pid: int):
        self._server, self.pid = server, pid

    @property
    def returncode(self) -> int | None:
        return self._server.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"drift (pid {self.pid})", timeout)
            time.sleep(0.05)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (an exited node's pid may be another process's by now)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def serve() -> None:
    """The fork server: import PRELOAD, then fork a node for each request until stdin ends."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # (a node that needs it says what is missing, as a fresh one would)
    out, buf, children = sys.stdout.buffer, b"", set()

    def say(line: str) -> None:
        out.write(line.encode() + b"\n")
        out.flush()

    while True:
        ready, _, _ = select.select([0], [], [], 0.1)
        if ready:
            data = os.read(0, 1 << 16)
            if not data:
                return  # the coordinator is gone
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _node(json.loads(line))  # raises SystemExit: this process ends as a node does
                children.add(pid)
                say(f"started {pid}")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            say(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def _node(req: dict) -> None:
    """In the forked node: its own session, its log on stdout and stderr (the server's pipes
    closed), its title, environment and torch threads, then `drift ARGS`."""
    os.setsid()  # a terminal's Ctrl-C is the coordinator's to handle, as for a fresh process
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    try:  # (before the environment changes: setproctitle finds the room for the title beside it)
        import setproctitle

        setproctitle.setproctitle(req["title"])
    except ImportError:
        pass
    os.environ.clear()
    os.environ.update(req["env"], DRIFT_PARENT_PID=str(os.getppid()))  # (the server: it leaves with the coordinator)
    # torch keeps its thread count per thread, and the server's main thread, this one, set its own
    # (all the cores) when it imported torch: the node's torch.set_num_threads, on another thread,
    # would not reach it (three nodes on two cores, each given one thread, trained on two: 3-7x slower).
    if "torch" in sys.modules and req["threads"] is not None:
        sys.modules["torch"].set_num_threads(req["threads"])
    os.chdir(req["cwd"])
    if "script" in req:  # as `python SCRIPT ARGS` runs it: its own directory first on sys.path
        sys.argv = [req["script"], *req["args"]]
        sys.path[0] = os.path.dirname(req["script"])
        runpy.run_path(req["script"], run_name="__main__")
        sys.exit(0)
    from drift.cli import main

    main(req["args"], prog_name="drift")


if __name__ == "__main__":
    serve()
