"""The run's live web page: `drift coord` serves it (127.0.0.1 by default, `--dashboard ADDR`),
`drift report RUN_DIR` writes it as one static file.

The page (drift/dashboard.html: inline JS and CSS, SVG charts drawn by its own code, nothing
fetched from elsewhere) is a pure function of the run's events, the same dicts that become the
lines of metrics.jsonl: the server hands it the history, then each event as it happens
(server-sent events). Read-only: three fixed routes, GET only, nothing a request names reaches
the filesystem, and every route wants the URL's random token.

Whatever a peer sent (names, devices, reasons) is data: the page puts it in the DOM with
textContent only, and the Content-Security-Policy runs no script but the page's own.

The coordinator never waits for a browser: each client has a bounded queue, a client that falls
behind is disconnected (its EventSource reconnects and resumes from the last event it got), and
requests and clients are capped in number, size and time.

The history a client is sent is bounded: a round event has a row per node (~290 bytes), so a
thousand nodes over a thousand rounds would hold ~290 MB for the page and parse it all again for
each snapshot. Only the newest FULL_ROUNDS round events keep every row; an older one keeps the
rows of its KEPT slowest nodes (those the page shows one by one, with room for speeds to change),
and the rows cut are summed per node into one `earlier` event that new clients get first. The
page bounds its own copy the same way.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import math
import re
import secrets
import socket
import struct
import threading
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("drift.dashboard")

PAGE = Path(__file__).with_name("dashboard.html")
MAX_CLIENTS = 32  # requests with the page's token served at once; more get 503 and are closed
MAX_REQUEST = 8192  # bytes of request line and headers
REQUEST_TIMEOUT = 5.0  # to send the request line and headers (a client that trickles is closed)
# Connections still sending their request (no token seen yet) hold no client slot. At most this
# many wait at once, and this many from one address; a newer one pushes out the oldest, so
# trickling connections cannot keep the owner's browser (which sends its request at once) out.
MAX_PENDING = 32
MAX_PENDING_PER_SOURCE = 8
CLIENT_QUEUE = 512  # events waiting for one event-stream client; one that falls further behind is dropped
WRITE_TIMEOUT = 10.0  # a client that does not read for this long is dropped
KEEPALIVE_S = 15.0  # an event-stream comment this often: dead connections are noticed
MAX_HISTORY = 50_000  # events kept for clients that connect later (progress: the newest per node)
FULL_ROUNDS = 8  # the newest round events kept with every node's row
KEPT = 32  # rows an older round event keeps: its slowest nodes' (twice the 16 the page shows)
ROUTES = ("/", "/events", "/snapshot.json")


class DashboardError(ValueError):
    """A --dashboard address that cannot be used; str() is the one line shown to the user."""


def parse_addr(addr: str) -> tuple[str, int] | None:
    """`--dashboard` values: off (None), HOST:PORT, :PORT (on 127.0.0.1), HOST (any free port)."""
    addr = addr.strip()
    if addr.lower() in ("off", "none", "no", "false"):
        return None
    if addr.startswith("["):  # [IPv6]:PORT
        host, _, port = addr[1:].partition("]")
        port = port.removeprefix(":")
    elif addr.count(":") == 1:
        host, _, port = addr.partition(":")
    else:  # a host without a port (a bare IPv6 address too)
        host, port = addr, ""
    if port and (not port.isdigit() or int(port) > 65535):
        raise DashboardError(f"--dashboard {addr!r}: expected HOST:PORT, :PORT, HOST or off")
    return host or "127.0.0.1", int(port or 0)


def slim(rec: dict[str, Any]) -> dict[str, Any]:
    """An event as the page needs it: a round's per-node unit lists (exactly-once bookkeeping,
    the bulk of a round event) left out, and the join command older runs recorded (its ticket
    admits to the run: a page is shown to people who are not to join)."""
    if rec.get("event") == "run" and ("join" in rec or "coordinator" in rec):
        rec = {k: v for k, v in rec.items() if k not in ("join", "coordinator")}
    nodes = rec.get("nodes")
    if rec.get("event") != "round" or not isinstance(nodes, dict):
        return rec
    return {**rec, "nodes": {k: {f: v for f, v in n.items() if f != "trained"} for k, n in nodes.items()}}


def page(events: list[dict] | None = None) -> str:
    """The page's HTML. With `events`, a static page of those events (a finished run); without,
    the live page, which asks its server for them."""
    html = PAGE.read_text()
    data = "null" if events is None else _script_json({"events": [slim(e) for e in events]})
    return html.replace("/*DRIFT_DATA*/null", data, 1).replace("DRIFT_CSP", _csp(html, static=events is not None), 1)


def write_static(events: list[dict], path: Path) -> Path:
    """The page of a finished (or running) run with its events inside, written atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(page(events))
    tmp.replace(path)
    return path


def _json(obj: Any) -> str:
    """Strict JSON (what a browser's JSON.parse takes): NaN and infinities become null."""
    try:
        return json.dumps(obj, allow_nan=False, default=str)
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, default=str)


def _sse(rec: dict[str, Any], event_id: int | None = None) -> bytes:
    """One server-sent event: the record as JSON, with its id (one the browser resumes from) or without."""
    return (f"id: {event_id}\n" if event_id is not None else "").encode() + f"data: {_json(rec)}\n\n".encode()


def _num(v: Any, default: float = 0) -> float:
    """A figure as the page reads it (its num()): a finite number, else `default`."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return v if ok else default


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _script_json(obj: Any) -> str:
    """JSON that is safe inside a <script> element: no `</script>`, no `<!--` can end it."""
    return _json(obj).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _csp(html: str, static: bool) -> str:
    """Only the page's own script runs (by its hash); it may talk to its own server only."""
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts)
    connect = "'none'" if static else "'self'"
    return (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; img-src data:; "
        f"connect-src {connect}; base-uri 'none'; form-action 'none'"
    )


class _Client:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(CLIENT_QUEUE)
        self.dropped = False


class Dashboard:
    """One run's page, served live. `event` is a Monitor subscriber: call it with each event."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token or secrets.token_urlsafe(16)
        self._history: deque[tuple[int, bytes]] = deque(maxlen=MAX_HISTORY)  # (id, SSE message)
        self._progress: dict[str, bytes] = {}  # node id -> its newest progress event (SSE message)
        self._speed: dict[str, float] = {}  # node id -> its newest samples/s (-1: none), to pick the slowest
        self._full: deque[tuple[int, dict[str, Any]]] = deque()  # (id, event) of the newest round events, whole
        self._earlier: dict[str, dict[str, float]] = {}  # node id -> sums of its rows cut from older rounds
        self._cut_id = -1  # the newest round event cut: a client that has not seen it gets everything again
        self._next_id = 0
        self.finished = False  # the run's `complete` event came: the page shows it finished, its nodes done
        self._clients: set[_Client] = set()
        self._open = 0  # requests with the token being served (MAX_CLIENTS)
        self._pending: dict[asyncio.StreamWriter, str] = {}  # connections still sending their request, oldest first
        self._serving: set[asyncio.Task] = set()  # one task a connection
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._page = page().encode()
        self._csp = _csp(PAGE.read_text(), static=False)
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen; returns the page's URL (with its token)."""
        self._loop, self._thread = asyncio.get_running_loop(), threading.get_ident()
        try:
            self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST)
        except OSError as e:
            raise DashboardError(f"--dashboard {host}:{port}: cannot listen there: {e.strerror or e}") from None
        bound = self._server.sockets[0].getsockname()
        shown = host if host not in ("0.0.0.0", "::", "") else socket.gethostname()  # (listening on every address)
        shown = f"[{shown}]" if ":" in shown else shown
        self.url = f"http://{shown}:{bound[1]}/?token={self.token}"
        return self.url

    async def close(self, flush_s: float = 2.0) -> None:
        """Stop listening; clients get what is queued for them (the run's last events) first."""
        if self._server is None:
            return
        self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + flush_s
        while any(not c.queue.empty() for c in self._clients) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for c in list(self._clients):
            c.dropped = True
            self._clients.discard(c)
            c.writer.close()
            with contextlib.suppress(asyncio.QueueFull):
                c.queue.put_nowait(b"")
        # A connection that never sent its request (a browser opens one ahead, or its event
        # stream reconnects) is closed too: a handler left waiting would be cancelled when the
        # loop ends, and asyncio logs a traceback for each.
        for w in list(self._pending):
            self._push_out(w)
        if self._serving:
            await asyncio.wait(self._serving, timeout=flush_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), flush_s)

    # --- events --------------------------------------------------------------------------------

    def event(self, rec: dict[str, Any]) -> None:
        """Take one event (Monitor subscriber). Never blocks: slow clients are dropped instead."""
        if self._loop is not None and threading.get_ident() != self._thread:
            self._loop.call_soon_threadsafe(self.event, rec)
            return
        rec = slim(rec)
        if rec.get("event") in ("run", "complete"):  # (a resumed run starts with a `run` event)
            self.finished = rec.get("event") == "complete"
        if rec.get("event") == "progress":
            msg = _sse(rec)
            self._progress[str(rec.get("node_id"))] = msg
            self._speed[str(rec.get("node_id"))] = _num(rec.get("samples_per_s"), -1.0)
        else:
            msg = _sse(rec, self._next_id)
            self._history.append((self._next_id, msg))
            if rec.get("event") == "round" and isinstance(rec.get("nodes"), dict):
                self._full.append((self._next_id, rec))
                if len(self._full) > FULL_ROUNDS:
                    self._cut(*self._full.popleft())
            self._next_id += 1
        for c in list(self._clients):
            try:
                c.queue.put_nowait(msg)
            except asyncio.QueueFull:
                log.info("dashboard: dropping a client that fell %d events behind", CLIENT_QUEUE)
                self._drop(c)

    def _cut(self, rid: int, rec: dict[str, Any]) -> None:
        """Round event `rid` is no longer among the newest FULL_ROUNDS: its stored message keeps the
        rows of the KEPT slowest nodes (by the newest speeds, none yet first, as the page picks its
        nodes) and rows without a node id; the others are added into `earlier`."""
        nodes = rec["nodes"]
        ids = [str(r["node_id"]) for r in nodes.values() if isinstance(r, dict) and r.get("node_id")]
        first = self._history[0][0]
        if len(ids) <= KEPT or rid < first:  # (a small swarm loses nothing; rid < first: gone already)
            return
        slow = set(sorted(ids, key=lambda i: self._speed.get(i, -1.0))[:KEPT])
        kept: dict[str, Any] = {}
        for name, r in nodes.items():
            if not (isinstance(r, dict) and r.get("node_id")) or str(r["node_id"]) in slow:
                kept[name] = r
                continue
            sums = self._earlier.setdefault(str(r["node_id"]), {"samples": 0, "bytes_sent": 0, "step_s": 0})
            for f in sums:
                sums[f] += _num(r.get(f))
        # (each event kept takes the next id, so the history's ids have no gaps: `rid` is at rid - first)
        self._history[rid - first] = (rid, _sse({**rec, "nodes": kept}, rid))
        self._cut_id = rid

    def _backlog(self, last_id: str) -> list[bytes]:
        """The events a client is sent before those to come. One that reconnects (`last_id`: the
        last event it got) and has seen every cut round event whole gets the history after it. Any
        other gets the `earlier` sums and the whole history, after a `reset` if it reconnects (the
        rows it missed are summed up with others it has: it starts again). Each, the newest
        progress per node."""
        after = int(last_id) if last_id.isdigit() else None
        if after is not None and after >= self._cut_id:
            return [m for i, m in self._history if i > after] + list(self._progress.values())
        first = [{"event": "reset"}] if after is not None else []
        return (
            [_sse(e) for e in first + self._earlier_event()]
            + [m for _, m in self._history]
            + list(self._progress.values())
        )

    def _earlier_event(self) -> list[dict[str, Any]]:
        """The sums of the rows cut from older rounds, as the one event a new client gets first ([]: none cut)."""
        return [{"event": "earlier", "nodes": self._earlier}] if self._earlier else []

    def snapshot(self) -> dict[str, Any]:
        """What a client that connects now is sent: the events so far (the `earlier` sums first, if
        any), the newest progress per node, and whether the run has finished."""
        events = self._earlier_event() + [json.loads(m.split(b"data: ", 1)[1]) for _, m in self._history]
        progress = [json.loads(m.split(b"data: ", 1)[1]) for m in self._progress.values()]
        return {"events": events, "progress": progress, "state": "finished" if self.finished else "running"}

    # --- HTTP ----------------------------------------------------------------------------------

    def _wait_for_request(self, writer: asyncio.StreamWriter) -> None:
        """Count a new connection as pending, pushing out the oldest one of its address (or of
        all) when there are too many."""
        source = str((writer.get_extra_info("peername") or ("?",))[0])
        mine = [w for w, src in self._pending.items() if src == source]
        if len(mine) >= MAX_PENDING_PER_SOURCE:
            self._push_out(mine[0])
        elif len(self._pending) >= MAX_PENDING:
            self._push_out(next(iter(self._pending)))
        self._pending[writer] = source

    def _push_out(self, writer: asyncio.StreamWriter) -> None:
        self._pending.pop(writer, None)
        writer.transport.abort()  # its readuntil ends; its task returns

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = False
        if (task := asyncio.current_task()) is not None:
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)
        try:
            self._wait_for_request(writer)
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            except (asyncio.LimitOverrunError, ValueError):
                await self._respond(writer, 431, "text/plain", b"request too large\n")
                return
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return
            finally:
                self._pending.pop(writer, None)
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                await self._respond(writer, 400, "text/plain", b"bad request\n")
                return
            method, target = parts[0], urlsplit(parts[1])
            if method not in ("GET", "HEAD"):
                await self._respond(writer, 405, "text/plain", b"read-only\n", extra={"Allow": "GET, HEAD"})
                return
            if target.path not in ROUTES:
                await self._respond(writer, 404, "text/plain", b"not found\n")
                return
            token = parse_qs(target.query).get("token", [""])[0]
            if not hmac.compare_digest(token.encode(), self.token.encode()):
                await self._respond(writer, 403, "text/plain", b"this page needs the token in the URL drift printed\n")
                return
            if self._open >= MAX_CLIENTS:
                await self._respond(writer, 503, "text/plain", b"too many clients\n")
                return
            self._open += 1
            served = True
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            body = method == "GET"
            if target.path == "/":
                await self._respond(writer, 200, "text/html; charset=utf-8", self._page, body, csp=True)
            elif target.path == "/snapshot.json":
                await self._respond(writer, 200, "application/json", json.dumps(self.snapshot()).encode(), body)
            elif body:
                await self._stream(writer, headers.get("last-event-id", ""))
            else:
                await self._respond(writer, 200, "text/event-stream", b"", False)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            self._open -= served
            writer.close()

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        ctype: str,
        data: bytes,
        body: bool = True,
        csp: bool = False,
        extra: dict[str, str] | None = None,
    ) -> None:
        reason = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed"}
        reason |= {431: "Request Header Fields Too Large", 503: "Service Unavailable"}
        head = {
            "Content-Type": ctype,
            "Content-Length": str(len(data)),
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY",
            "Connection": "close",
            **({"Content-Security-Policy": self._csp} if csp else {}),
            **(extra or {}),
        }
        text = f"HTTP/1.1 {status} {reason[status]}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
        writer.write(text.encode() + b"\r\n" + (data if body else b""))
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)

    async def _stream(self, writer: asyncio.StreamWriter, last_id: str) -> None:
        """The event stream: the backlog (`_backlog`), then every event as it comes."""
        client = _Client(writer)
        self._clients.add(client)  # from here on no event is missed: they queue while the history goes out
        try:
            backlog = self._backlog(last_id)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
                b"X-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\nretry: 2000\n\n"
            )
            for k in range(0, len(backlog), 256):
                writer.write(b"".join(backlog[k : k + 256]))
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
            while not client.dropped:
                try:
                    msg = await asyncio.wait_for(client.queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    msg = b": keepalive\n\n"
                writer.write(msg)
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
        finally:
            self._clients.discard(client)

    def _drop(self, c: _Client) -> None:
        c.dropped = True
        self._clients.discard(c)
        sock = c.writer.transport.get_extra_info("socket")
        if sock is not None:  # reset, not close: the kernel would keep what it never reads, and try to send it
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.writer.transport.abort()
        with contextlib.suppress(asyncio.QueueFull):
            c.queue.put_nowait(b"")  # wakes its task, which sees `dropped`
