"""iroh endpoints, tickets and length-prefixed frames: everything drift sends goes through here.

Four ALPNs share one endpoint per process:
  * ``drift/0``        control plane (coordinator <-> node), small typed messages;
  * ``drift-ring/0``   data plane (node <-> ring neighbour), raw tensor chunks;
  * ``drift-gather/0`` data plane (node -> every member), a sync rule's payload (drift/gather.py);
  * ``drift-state/1``  θ and the outer state for whoever lacks it, in pieces (drift/state.py).
Between two nodes, each connection opens with their signed RepoCommits (drift/peers.py).

Every connect, accept and read takes a timeout: iroh does not fail fast on a dead address or an
ALPN the peer does not serve, it hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import ipaddress
import logging
import re
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import iroh
import numpy as np
from iroh import iroh_ffi

from drift.auth import drift_home
from drift.protocol import ProtocolError, printable

CONTROL_ALPN = b"drift/0"
RING_ALPN = b"drift-ring/0"
STATE_ALPN = b"drift-state/1"  # θ + outer state for a node that lacks it (drift/state.py)
GATHER_ALPN = b"drift-gather/0"  # a sync rule's payload, to every member of the round (drift/gather.py)
DATA_ALPN = b"drift-data/0"  # the task's samples for a node that lacks the data (drift/data.py)
BASE_ALPN = b"drift-base/0"  # recipe init_weights: θ₀ and the frozen base, from the coordinator (drift/base.py)
READ_AHEAD = 64 << 10  # frames up to this size are written in one call and read several at a time
MAX_CONTROL_FRAME = 1 << 20  # control messages are small; anything bigger is an attack or a bug
HANDSHAKE_TIMEOUT = 15.0  # a QUIC handshake still unfinished after this is stalled, or hostile
MAX_HANDSHAKES = 64  # QUIC handshakes in progress at once (Endpoint.serve); more are refused
REFUSED = "refused to accept a new connection"  # iroh's words when a peer refused our connection (that limit)
HANDSHAKES_FULL = "QUIC handshakes already in progress"  # how serve() reports such a refusal
_LEN = struct.Struct(">I")

log = logging.getLogger("drift.transport")

NetworkMode = Literal["auto", "local", "lan", "relay"]
RELAY_WAIT_S = 4.0  # network auto: how long to wait for a relay before going on without one
Handler = Callable[[iroh.Connection], Awaitable[None]]
DropFn = Callable[[str, str], None]  # (peer, reason): one line per dropped connection


LOOPBACK_HINT = (
    "this ticket has loopback addresses only (127.0.0.1), which reach the coordinator's own machine: "
    "for other machines, start the coordinator without --local and without `network: local` in its "
    "recipe (or with --network lan)"
)


class TransportError(Exception):
    """A network operation failed or timed out; the message says what was tried."""


class TransportTimeout(TransportError):
    """The peer said nothing within the time allowed."""


# --- the copy fix -----------------------------------------------------------------------------
# iroh's generated binding lowers every outgoing bytes object into a Rust buffer one byte at a
# time in a Python loop (~3 MiB/s), after its 4-byte length, also written a byte at a time, into a
# buffer it then grows: two allocations in Rust. We lower bytes in one allocation of the exact
# size and two memmoves; the buffer's layout (big-endian i32 length, then the bytes) is the
# binding's own. Pinned to iroh==1.2.0 in pyproject; install_copy_fix() checks the shape first.

_original_write = iroh_ffi._UniffiRustBufferBuilder.write
_original_continuation = iroh_ffi._uniffi_continuation_callback
_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+
_I32 = struct.Struct(">i")


def _copy_into(dst: int, value) -> None:
    n = len(value)
    if isinstance(value, bytes):
        ctypes.memmove(dst, value, n)
    else:  # memoryview / bytearray / numpy: any contiguous 1-byte-item buffer, no extra copy
        src = np.frombuffer(value, dtype=np.uint8)
        if src.size != n:
            raise ValueError("drift transport writes need a flat byte buffer")
        ctypes.memmove(dst, src.ctypes.data, n)


def _fast_write(self, value) -> None:
    with self._reserve(len(value)):
        _copy_into(ctypes.cast(self.rbuf.data, ctypes.c_void_p).value + self.rbuf.len, value)


def _fast_lower(value) -> iroh_ffi._UniffiRustBuffer:
    n = len(value)
    rbuf = iroh_ffi._UniffiRustBuffer.alloc(_I32.size + n)
    try:
        dst = ctypes.cast(rbuf.data, ctypes.c_void_p).value
        ctypes.memmove(dst, _I32.pack(n), _I32.size)
        _copy_into(dst + _I32.size, value)
    except BaseException:
        rbuf.free()
        raise
    rbuf.len = _I32.size + n
    return rbuf


# --- the wake-up fix ---------------------------------------------------------------------------
# Every async call into the binding resumes through a continuation callback, which hands the
# result to the event loop with call_soon_threadsafe: a write to the loop's self-pipe and one more
# pass of the loop. Most come synchronously, on the loop's own thread, from the poll the call itself
# made (a write that fits the stream's buffer, a read of bytes already there): the result is set at
# once and the await that follows does not suspend. Up to INLINE_MAX calls a pass of the loop: a
# task that only writes would otherwise keep the loop, and iroh's callbacks that need the GIL,
# waiting (one process holding both ends of 3,000 frames written back to back lost the connection:
# "too many gaps in stream buffer").

INLINE_MAX = 64


class _Inline(threading.local):
    n = 0  # calls finished inside their own poll since this thread's loop last passed


_inline = _Inline()


def _loop_passed() -> None:
    _inline.n = 0


@iroh_ffi._UNIFFI_RUST_FUTURE_CONTINUATION_CALLBACK
def _continuation(future_ptr, poll_code) -> None:
    loop, future = iroh_ffi._UniffiContinuationHandleMap.remove(future_ptr)
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:  # one of iroh's threads
        here = False
    if not here:
        loop.call_soon_threadsafe(iroh_ffi._uniffi_set_future_result, future, poll_code)
    elif _inline.n >= INLINE_MAX:
        loop.call_soon(iroh_ffi._uniffi_set_future_result, future, poll_code)
    else:
        if _inline.n == 0:
            loop.call_soon(_loop_passed)
        _inline.n += 1
        iroh_ffi._uniffi_set_future_result(future, poll_code)


def install_copy_fix() -> None:
    """Swap the per-byte copy in iroh's binding for one memmove, and its wake-up of the event loop
    for a plain call_soon where it runs on the loop's own thread (idempotent)."""
    builder = iroh_ffi._UniffiRustBufferBuilder
    bytes_conv = getattr(iroh_ffi, "_UniffiFfiConverterBytes", None)
    if not hasattr(builder, "_reserve") or not hasattr(iroh_ffi, "_uniffi_set_future_result") or bytes_conv is None:
        raise RuntimeError("iroh binding changed shape; drift's copy fix does not apply")
    builder.write = _fast_write
    bytes_conv.lower = staticmethod(_fast_lower)
    iroh_ffi._uniffi_continuation_callback = _continuation


def uninstall_copy_fix() -> None:
    """Restore the binding's own copy loop and wake-up (benchmarks compare both)."""
    iroh_ffi._UniffiRustBufferBuilder.write = _original_write
    if "lower" in vars(iroh_ffi._UniffiFfiConverterBytes):  # (the binding's own is inherited)
        del iroh_ffi._UniffiFfiConverterBytes.lower
    iroh_ffi._uniffi_continuation_callback = _original_continuation


install_copy_fix()


# --- tickets ----------------------------------------------------------------------------------


_RUN = re.compile(r"[0-9a-f]{1,32}")


def join_ticket(ticket: str, run_id: str) -> str:
    """The ticket `drift coord` prints: its endpoint's ticket, then `.RUN_ID`. A node names that run
    when it joins, so a later run under the same key (--keep-key) refuses it: the run has finished."""
    return f"{ticket}.{run_id}"


def ticket_run(ticket: str) -> str | None:
    """The run a join ticket names (None for a bare endpoint ticket); TransportError if garbled."""
    _, dot, run = ticket.strip().partition(".")
    if dot and not _RUN.fullmatch(run):
        raise TransportError(f"malformed ticket: {printable(run[:40])!r} after the '.' is no run id")
    return run if dot else None


def _finished_marker(run_id: str) -> Path:
    return drift_home() / "finished" / run_id


def mark_finished(run_id: str) -> None:
    """Note on this machine that a run is over: a node here that joins it later is told so (its
    coordinator, gone with a fresh key, answers nothing)."""
    path = _finished_marker(run_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.touch()


def run_finished(run_id: str) -> bool:
    """A run this machine's coordinator finished (mark_finished)."""
    return bool(_RUN.fullmatch(run_id)) and _finished_marker(run_id).exists()


def parse_ticket(ticket: str) -> iroh.EndpointAddr:
    """Parse a join ticket (with or without its run), raising TransportError that quotes what was given."""
    try:
        return iroh.EndpointTicket.from_string(ticket.strip().partition(".")[0]).endpoint_addr()
    except Exception as e:  # IrohError, plus anything odd the binding raises on garbage
        shown = ticket if len(ticket) <= 24 else ticket[:24] + "..."
        raise TransportError(
            f"malformed ticket {shown!r}: expected the 'endpoint...' string that `drift coord` prints ({e})"
        ) from None


def ticket_of(addr: iroh.EndpointAddr) -> str:
    return str(iroh.EndpointTicket.from_addr(addr))


def loopback_only(addr: iroh.EndpointAddr) -> bool:
    """The address reaches its own machine only (an endpoint bound to 127.0.0.1)."""
    hosts = [a.rsplit(":", 1)[0].strip("[]") for a in addr.direct_addresses()]
    return not addr.relay_url() and bool(hosts) and all(ipaddress.ip_address(h).is_loopback for h in hosts)


def mode_for_ticket(ticket: str) -> NetworkMode:
    """Pick how a joining node should bind, from what the coordinator's ticket advertises: a
    relay in it means iroh's relays (a node that cannot reach one still uses the direct addresses)."""
    addr = parse_ticket(ticket)
    if addr.relay_url():
        return "auto"
    return "local" if loopback_only(addr) else "lan"


def describe_addr(addr: iroh.EndpointAddr) -> str:
    parts = list(addr.direct_addresses())
    if addr.relay_url():
        parts.append(f"relay {addr.relay_url()}")
    return f"{addr.id().fmt_short()} at {', '.join(parts) or 'no known address'}"


# --- endpoints and channels -------------------------------------------------------------------

_RUST_LOCATION = re.compile(r"\s*\((?:at )?[^()]*\.rs:\d+(?::\d+)?\)")
# A lost connection comes as a Rust value's debug text, e.g. ReadError(ConnectionLost(
# ApplicationClosed(ApplicationClose { error_code: 0, reason: b"node leaving" }))): said in words.
_CLOSED = re.compile(
    r'(?:Application|Connection)Closed\((?:Application|Connection)Close \{[^{}]*?reason: b"(.*?)" \}\)'
)
_LOST = (
    ("TimedOut", "the connection timed out"),
    ("Reset", "the peer reset the connection"),
    ("LocallyClosed", "the connection was closed here"),
    ("VersionMismatch", "the peer speaks another QUIC version"),
    ("TransportError", "the peer broke the QUIC protocol"),
)


def _plain(text: str) -> str:
    """Rust debug text of a lost connection, in words; any other text as it is."""
    if (m := _CLOSED.search(text)) is not None:
        why = printable(m.group(1).replace('\\"', '"'), 100)
        return "the peer closed the connection" + (f" ({why})" if why else "")
    if "ConnectionLost(" in text or "ConnectionError(" in text:
        return next((plain for word, plain in _LOST if word in text), "the connection was lost")
    return text


def _iroh_reason(e: Exception) -> str:
    """One line for the user from an IrohError (whose str() is empty; message() holds a Rust error
    chain over several lines, with source locations): the chain's parts joined, no locations."""
    try:
        text = e.message()  # type: ignore[attr-defined]
    except Exception:
        text = str(e).strip() or repr(e)
    parts = []
    for line in _RUST_LOCATION.sub("", str(text)).splitlines():
        line = re.sub(r"^\s*(\d+:\s*)?", "", line).strip()
        if line and line != "Caused by:" and line not in parts:
            parts.append(line)
    reason = _plain(": ".join(parts)) or type(e).__name__
    return reason if len(reason) <= 300 else reason[:297] + "..."


async def within(aw, timeout: float | None):
    """Await aw for at most `timeout` seconds (asyncio.TimeoutError after): asyncio.wait_for
    without the task of its own that wait_for makes for each call before Python 3.12 (a frame, a
    round's next message: thousands a round at the coordinator)."""
    if _timeout is None:  # Python 3.10
        return await asyncio.wait_for(aw, timeout)
    async with _timeout(timeout):
        return await aw


async def _timed(aw, timeout: float, what: str):
    try:
        return await within(aw, timeout)
    except asyncio.TimeoutError:
        raise TransportTimeout(f"timed out after {timeout:g}s {what}") from None
    except iroh.IrohError as e:
        raise TransportError(f"{what} failed: {_iroh_reason(e)}") from None


class Channel:
    """One bidirectional QUIC stream carrying length-prefixed frames."""

    def __init__(self, conn: iroh.Connection, bi: iroh.BiStream):
        self.conn = conn
        self._send = bi.send()
        self._recv = bi.recv()
        self.peer_id: str = str(conn.remote_id())
        self.bytes_sent = 0
        self.bytes_received = 0
        self._send_lock = asyncio.Lock()  # a frame's header and body must not interleave with another's
        self._buf = bytearray()  # bytes read ahead of the frame being read
        self._sent_at = time.monotonic()  # when the last frame went out

    async def send_frame(self, payload, timeout: float = 30.0) -> None:
        """Send one frame: 4-byte big-endian length, then the payload (bytes or a flat buffer)."""
        await self.send_parts([payload], timeout)

    async def send_parts(self, parts: list, timeout: float = 30.0) -> None:
        """Send one frame made of several buffers (header + tensor chunk) without joining them;
        a small frame goes in one write (each write is a round trip into iroh's runtime)."""
        views = [p if isinstance(p, bytes) else memoryview(p).cast("B") for p in parts]
        total = sum(len(v) for v in views)
        head = _LEN.pack(total)
        if total <= READ_AHEAD:
            views, head = [], b"".join([head, *views])
        async with self._send_lock:
            await _timed(self._send.write_all(head), timeout, "sending a frame header")
            for v in views:
                if len(v):
                    await _timed(self._send.write_all(v), timeout, f"sending {len(v)} bytes")
        self.bytes_sent += total + _LEN.size
        self._sent_at = time.monotonic()

    def quiet_s(self) -> float:
        """Seconds since this side last sent a frame (any frame tells the other end we are here)."""
        return time.monotonic() - self._sent_at

    async def recv_frame(self, max_size: int, timeout: float = 30.0) -> bytes:
        """Receive one frame; a frame over max_size is refused before its body is read. Every
        frame has a deadline: iroh never gives up on a silent peer by itself."""
        deadline = time.monotonic() + timeout
        (n,) = _LEN.unpack(await self._take(_LEN.size, deadline, "waiting for a frame"))
        if n > max_size:
            raise TransportError(f"frame of {n} bytes exceeds the {max_size}-byte cap")
        body = await self._take(n, deadline, f"reading a {n}-byte frame") if n else b""
        self.bytes_received += n + _LEN.size
        return body

    async def _take(self, n: int, deadline: float, what: str) -> bytes:
        """The next n bytes of the stream: what an earlier read brought first. Small reads take
        whatever has arrived (several small frames in one call into iroh); a large body is read
        whole."""
        buf = self._buf
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout(f"timed out {what}")
            if n - len(buf) > READ_AHEAD:
                rest = await _timed(self._recv.read_exact(n - len(buf)), left, what)
                out = b"".join((buf, rest)) if buf else rest
                buf.clear()
                return out
            chunk = await _timed(self._recv.read(READ_AHEAD), left, what)
            if not chunk:
                raise TransportError(f"{what} failed: the stream ended")
            buf += chunk
        out = bytes(buf[:n])
        del buf[:n]
        return out

    async def finish(self) -> None:
        try:
            await asyncio.wait_for(self._send.finish(), 2.0)
        except Exception:
            pass

    def close(self, reason: str = "") -> None:
        """Close the whole connection (every stream on it)."""
        try:
            self.conn.close(0, reason.encode()[:100])
        except Exception:
            pass

    def close_reason(self) -> str:
        """Why the connection closed (as the peer put it when it closed it), as plain text; ''
        while it is open."""
        try:
            why = self.conn.close_reason()
        except Exception:
            return ""
        return "" if why is None else printable(str(why), 300)

    async def abort(self) -> None:
        """Abandon this stream only (its connection stays): reset our side, stop reading theirs."""
        for end in (self._send.reset(1), self._recv.stop(1)):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(end, 2.0)


class Throttle:
    """Refusals of strangers (who may knock thousands of times a second, from as many ids as they
    care to make), reported within bounds: per peer at most one line every `window` s, and at
    most `burst` lines per `window` s overall. A line shown after some were held back says how
    many (``(+N more ...)``), so the count is never lost and the log and metrics.jsonl stay small."""

    def __init__(self, report: DropFn, window: float = 60.0, burst: int = 20, max_peers: int = 4096):
        self.report, self.window, self.burst, self.max_peers = report, window, burst, max_peers
        self._last: dict[str, float] = {}  # peer -> when its last line was shown
        self._held: dict[str, int] = {}  # peer -> refusals not shown since
        self._window_start = -1e18
        self._shown = 0  # lines shown in the current window (all peers)
        self._held_all = 0  # refusals held back by the overall limit since the last line shown
        self.count = 0  # refusals in all, shown or not

    def __call__(self, peer: str, why: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._window_start >= self.window:
            self._window_start, self._shown = now, 0
        if now - self._last.get(peer, -1e18) < self.window or self._shown >= self.burst:
            self._held[peer] = self._held.get(peer, 0) + 1
            if len(self._held) > self.max_peers:  # ids are free to make: forget the oldest, count it
                self._held_all += self._held.pop(next(iter(self._held)))
            return
        if len(self._last) >= self.max_peers:
            self._last = {k: t for k, t in self._last.items() if now - t < self.window}
            if len(self._last) >= self.max_peers:
                self._held_all += 1
                return
        more = self._held.pop(peer, 0)
        others, self._held_all = self._held_all, 0
        self._last[peer] = now
        self._shown += 1
        if more or others:
            why += f" (+{more} more from this peer" + (f", {others} from others" if others else "") + " not shown)"
        _safe(self.report, peer, why)


def _reason(e: BaseException) -> str:
    """Why a connection failed, for its one log line (plain text, bounded)."""
    if isinstance(e, (TransportError, ProtocolError)):
        return printable(e, 300)
    if isinstance(e, iroh.IrohError):
        return printable(_iroh_reason(e), 300)
    return printable(f"{e.__class__.__name__}: {e}", 300)


def _log_drop(peer: str, why: str) -> None:
    log.warning("dropping connection from %s: %s", peer[:16], why)


def _safe(drop: DropFn, peer: str, why: str) -> None:
    try:
        drop(peer, why)
    except Exception:  # reporting a drop must never be what stops serving
        log.exception("could not report a dropped connection")


def peer_of(conn: iroh.Connection) -> str:
    """The node id at the other end of a connection ("unknown peer" if it is already gone)."""
    try:
        return str(conn.remote_id())
    except Exception:
        return "unknown peer"


def source_of(conn: iroh.Connection) -> str:
    """Where a connection comes from, as a cost can be charged to it: the remote IP address of
    its path (node ids are free to make; addresses are not), or "relay" for one that came through
    a relay, which hides the sender's address ("unknown" if it is already gone)."""
    try:
        paths = conn.paths()
    except Exception:
        return "unknown"
    path = next((p for p in paths if p.is_selected), paths[0] if paths else None)
    if path is None:
        return "unknown"
    if not path.is_ip:
        return "relay"
    return path.remote_addr.rsplit(":", 1)[0].strip("[]")


def close_conn(conn: iroh.Connection, why: str, code: int = 1) -> None:
    """Close a connection with a reason (its first 100 bytes); one already gone is no error."""
    try:
        conn.close(code, why.encode()[:100])
    except Exception:
        pass


async def _why_closed(conn: iroh.Connection, wait: float = 1.0) -> str:
    """Why the peer closed `conn`, as plain text, waiting up to `wait` seconds for the close to
    arrive after a failed stream; '' if it has not (a busy coordinator's reason may follow the reset)."""
    try:
        why = conn.close_reason()
        if why is None:
            why = await asyncio.wait_for(conn.closed(), wait)
    except Exception:
        return ""
    return "" if why is None else printable(str(why), 300)


async def _incoming_addr(inc: iroh.Incoming) -> str:
    """The address a connection attempt came from, for a log line (its node id is not known yet)."""
    try:
        a = await asyncio.wait_for(inc.remote_addr(), 1.0)
        return str(getattr(a, "addr", None) or getattr(a, "url", None) or "unknown peer")
    except Exception:
        return "unknown peer"


@dataclass
class Endpoint:
    """A bound iroh endpoint serving drift's ALPNs."""

    ep: iroh.Endpoint
    mode: NetworkMode
    # Awaited on each connection this endpoint opens, before it is used: a node presents itself to
    # the peer and checks the peer in turn (drift/peers.py). TransportError refuses the connection.
    vet: Callable[[iroh.Connection], Awaitable[None]] | None = None

    @classmethod
    async def bind(
        cls,
        mode: NetworkMode = "local",
        secret_key: bytes | None = None,
        alpns: tuple[bytes, ...] = (CONTROL_ALPN, RING_ALPN, STATE_ALPN, GATHER_ALPN, DATA_ALPN),
    ) -> Endpoint:
        """Bind an endpoint. local: loopback only; lan: all interfaces, no relay;
        relay: iroh's public relays and hole-punching (needs internet); auto: all interfaces, and
        iroh's relays too when one answers within RELAY_WAIT_S (else the direct addresses alone)."""
        preset = iroh.preset_n0() if mode in ("relay", "auto") else iroh.preset_minimal()
        bind_addr = "127.0.0.1:0" if mode == "local" else "0.0.0.0:0"
        opts = iroh.EndpointOptions(preset=preset, bind_addr=bind_addr, alpns=list(alpns), secret_key=secret_key)
        try:
            ep = await iroh.Endpoint.bind(opts)
        except iroh.IrohError as e:
            raise TransportError(f"could not bind an iroh endpoint ({mode}): {e}") from None
        if mode == "relay":
            await _timed(ep.online(), 30.0, "reaching an iroh relay (is this machine online?)")
        elif mode == "auto":
            try:
                await asyncio.wait_for(ep.online(), RELAY_WAIT_S)
            except (asyncio.TimeoutError, iroh.IrohError):
                pass  # no relay: the ticket carries this machine's addresses, for its networks
        return cls(ep, mode)

    @property
    def has_relay(self) -> bool:
        return bool(self.ep.addr().relay_url())

    def addresses(self) -> list[str]:
        return list(self.ep.addr().direct_addresses())

    @functools.cached_property
    def node_id(self) -> str:
        """This endpoint's id (its key's: asked of iroh once, not at every look-up of a ring's members)."""
        return str(self.ep.id())

    def ticket(self) -> str:
        return ticket_of(self.ep.addr())

    async def connect(self, ticket: str, alpn: bytes, timeout: float = 15.0) -> Channel:
        """Connect to the endpoint in `ticket` and open one bidirectional stream."""
        return await self.open_channel(await self.dial(ticket, alpn, timeout), timeout)

    async def dial(self, ticket: str, alpn: bytes, timeout: float = 15.0) -> iroh.Connection:
        """A new connection to the endpoint in `ticket` (streams on it: open_channel)."""
        addr = parse_ticket(ticket)
        what = f"connecting to {describe_addr(addr)} ({alpn.decode()})"
        try:
            conn = await _timed(self.ep.connect(addr, alpn), timeout, what)
        except TransportError as e:
            if loopback_only(addr):  # the one mistake worth naming: a --local/`network: local` ticket
                raise TransportError(f"{e}: {LOOPBACK_HINT}") from None
            raise
        if self.vet is not None:
            try:
                await self.vet(conn)
            except BaseException as e:
                close_conn(conn, str(e) if isinstance(e, TransportError) else "connection not vetted")
                raise
        return conn

    @staticmethod
    async def open_channel(conn: iroh.Connection, timeout: float = 15.0) -> Channel:
        """Open one more bidirectional stream on a connection of ours."""
        try:
            bi = await _timed(conn.open_bi(), timeout, "opening a stream")
        except TransportTimeout:
            raise
        except TransportError as e:  # the peer may have closed the connection, and said why
            why = await _why_closed(conn)
            raise TransportError(f"{e} ({why})" if why and why not in str(e) else str(e)) from None
        return Channel(conn, bi)

    async def accept(self, timeout: float | None = None) -> tuple[bytes, iroh.Connection]:
        """Accept the next incoming connection: (alpn, connection)."""

        async def _one():
            inc = await self.ep.accept_next()
            if inc is None:
                raise TransportError("endpoint closed")
            accepting = await inc.accept()
            alpn = await accepting.alpn()
            return alpn, await accepting.connect()

        return await _timed(_one(), timeout or 1e9, "accepting a connection")

    async def serve(
        self,
        handlers: Mapping[bytes, Handler],
        on_drop: DropFn | None = None,
        max_handshakes: int = MAX_HANDSHAKES,
        timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        """Accept connections until the endpoint closes, each in its own task: the QUIC handshake
        (at most `timeout` s; at most `max_handshakes` at once, more are refused), then
        ``handlers[alpn](conn)``. A failed handshake, an ALPN without a handler, or an exception a
        handler lets out ends that one connection, with one ``on_drop(peer, reason)`` (default: a
        log line); the loop only ends with the endpoint. Cancelling serve() cancels its tasks."""
        drop = on_drop or _log_drop
        tasks: set[asyncio.Task] = set()
        handshaking = 0

        async def one(inc: iroh.Incoming) -> None:
            nonlocal handshaking
            peer, conn = "unknown peer", None
            try:
                try:
                    what = "completing the QUIC handshake"
                    accepting = await _timed(inc.accept(), timeout, what)
                    alpn = bytes(await _timed(accepting.alpn(), timeout, what))
                    conn = await _timed(accepting.connect(), timeout, what)
                finally:
                    handshaking -= 1
                peer = peer_of(conn)
                handler = handlers.get(alpn)
                if handler is None:
                    raise TransportError(f"no service for ALPN {alpn[:32]!r} here")
                await handler(conn)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # one peer's failure, whatever it is, ends only its connection
                if peer == "unknown peer":
                    peer = await _incoming_addr(inc)
                log.debug("connection from %s failed", peer, exc_info=True)
                _safe(drop, peer, _reason(e))
                if conn is not None:
                    close_conn(conn, _reason(e))

        try:
            while True:
                inc = await self.ep.accept_next()
                if inc is None:
                    return
                if handshaking >= max_handshakes:
                    _safe(
                        drop,
                        await _incoming_addr(inc),
                        f"refused: {max_handshakes} {HANDSHAKES_FULL}",
                    )
                    try:
                        await asyncio.wait_for(inc.refuse(), 1.0)
                    except Exception:
                        pass
                    continue
                handshaking += 1
                t = asyncio.ensure_future(one(inc))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        finally:
            for t in list(tasks):
                t.cancel()

    @staticmethod
    async def accept_channel(conn: iroh.Connection, timeout: float = 15.0) -> Channel:
        """Wait for the peer to open its stream on an accepted connection.

        QUIC only announces a stream once data flows on it, so the opener must send first."""
        bi = await _timed(conn.accept_bi(), timeout, "waiting for the peer to open a stream")
        return Channel(conn, bi)

    async def close(self) -> None:
        """Close every connection (each peer is told at once) and wait up to a second for iroh to
        drain them. After a dial that was given up in its handshake the drain can take 3 s (on
        loopback, after a 1 s connect timeout), a wait that serves nobody."""
        try:
            await asyncio.wait_for(self.ep.close(), 1.0)
        except Exception:
            pass
