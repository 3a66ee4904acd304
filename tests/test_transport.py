"""Transport over real iroh endpoints on loopback: the copy fix, frames, tickets, timeouts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import run_async
from iroh import iroh_ffi

from drift import transport
from drift.transport import CONTROL_ALPN, Endpoint, TransportError, parse_ticket


async def _pair() -> tuple[Endpoint, Endpoint]:
    return await Endpoint.bind("local"), await Endpoint.bind("local")


def test_copy_fix_is_installed() -> None:
    assert iroh_ffi._UniffiRustBufferBuilder.write is transport._fast_write
    assert iroh_ffi._UniffiFfiConverterBytes.lower is transport._fast_lower


@pytest.mark.parametrize("fixed", [True, False])
def test_bytes_round_trip_exactly(fixed: bool) -> None:
    """Every byte survives the memmove fix (and the original loop, as a reference)."""
    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, (3 << 20) + 13 if fixed else 70_001, dtype=np.uint8)
    floats = rng.standard_normal(100_003).astype(np.float32)
    payloads = [b"", b"\x00", bytes(big), memoryview(big)[5:9_999], floats, floats[1:77]]

    async def main() -> list[bytes]:
        if not fixed:
            transport.uninstall_copy_fix()
        a, b = await _pair()
        try:

            async def server() -> list[bytes]:
                _alpn, conn = await b.accept(timeout=10)
                ch = await Endpoint.accept_channel(conn)
                return [await ch.recv_frame(1 << 24) for _ in payloads]

            srv = asyncio.ensure_future(server())
            ch = await a.connect(b.ticket(), CONTROL_ALPN)
            for p in payloads:
                await ch.send_frame(p)
            got = await asyncio.wait_for(srv, 60)
            await ch.finish()
            return got
        finally:
            transport.install_copy_fix()
            await a.close()
            await b.close()

    got = run_async(main())
    want = [bytes(memoryview(p).cast("B")) if not isinstance(p, bytes) else p for p in payloads]
    assert got == want


def test_a_writer_that_never_waits_leaves_the_loop_to_the_others_in_its_process() -> None:
    """A write that fits the stream's buffer finishes inside its own call (no pass of the loop),
    but only INLINE_MAX in a row: a task that only writes lets the other tasks of its loop run,
    among them the reader of the same frames (lightweight nodes: many endpoints, one loop)."""
    n = 5000

    async def main() -> tuple[list[bytes], int]:
        a, b = await _pair()
        try:

            async def server() -> list[bytes]:
                _alpn, conn = await b.accept(timeout=10)
                ch = await Endpoint.accept_channel(conn)
                return [await ch.recv_frame(64) for _ in range(n)]

            srv = asyncio.ensure_future(server())
            ch = await a.connect(b.ticket(), CONTROL_ALPN)
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0)
                    ticks += 1

            t = asyncio.ensure_future(ticker())
            await asyncio.sleep(0)
            before = ticks
            for k in range(n):
                await ch.send_frame(b"frame %d" % k)
            during = ticks - before
            t.cancel()
            return await asyncio.wait_for(srv, 60), during
        finally:
            await a.close()
            await b.close()

    got, during = run_async(main())
    assert got == [b"frame %d" % k for k in range(n)]
    assert during >= n // transport.INLINE_MAX - 1


def test_oversized_frame_refused_before_body() -> None:
    async def main() -> str:
        a, b = await _pair()
        try:

            async def server() -> str:
                _alpn, conn = await b.accept(timeout=10)
                ch = await Endpoint.accept_channel(conn)
                with pytest.raises(TransportError) as e:
                    await ch.recv_frame(1000)
                return str(e.value)

            srv = asyncio.ensure_future(server())
            ch = await a.connect(b.ticket(), CONTROL_ALPN)
            await ch.send_frame(b"x" * 5000)
            return await asyncio.wait_for(srv, 20)
        finally:
            await a.close()
            await b.close()

    assert "exceeds the 1000-byte cap" in run_async(main())


def test_malformed_ticket_is_a_clear_error() -> None:
    with pytest.raises(TransportError, match="malformed ticket 'not-a-ticket'"):
        parse_ticket("not-a-ticket")


def test_unreachable_ticket_times_out_with_what_was_tried() -> None:
    async def main() -> str:
        dead = await Endpoint.bind("local")
        ticket = dead.ticket()
        await dead.close()
        a = await Endpoint.bind("local")
        try:
            with pytest.raises(TransportError) as e:
                await a.connect(ticket, CONTROL_ALPN, timeout=1)
            return str(e.value)
        finally:
            await a.close()

    msg = run_async(main(), timeout=60)
    # It ended by drift's own bound on the wait, not the test's, and says what was tried.
    assert "timed out after 1s connecting to" in msg and "127.0.0.1" in msg, msg


def test_mode_for_ticket_reads_loopback() -> None:
    async def main() -> str:
        ep = await Endpoint.bind("local")
        try:
            return transport.mode_for_ticket(ep.ticket())
        finally:
            await ep.close()

    assert run_async(main()) == "local"


def test_default_network_is_auto_and_a_local_ticket_is_loopback_only() -> None:
    """A recipe without `network:` is `auto` (bound across namespaces in tests/test_netns.py: this
    machine's traffic stays on loopback); a `local` endpoint's ticket is loopback-only."""
    from drift.recipe import Recipe

    mode = Recipe(name="x", task="t.py", rounds=1, inner_steps=1, batch_size=1).network
    assert mode == "auto"

    async def main() -> str:
        ep = await Endpoint.bind("local")
        try:
            return ep.ticket()
        finally:
            await ep.close()

    assert transport.loopback_only(parse_ticket(run_async(main())))


def test_a_peer_that_leaves_is_said_in_words_not_rust_debug_text() -> None:
    """A node leaving ends its peers' reads with one plain line: who closed it and why, not the
    Rust value (ReadError(ConnectionLost(ApplicationClosed(ApplicationClose { ... })))) that
    used to reach the warnings of every process at default verbosity."""

    async def main() -> list[str]:
        a, b = await _pair()
        try:
            errors = []
            for leave in ("close", "endpoint"):

                async def server() -> None:
                    _alpn, conn = await b.accept(timeout=10)
                    ch = await Endpoint.accept_channel(conn)
                    await ch.recv_frame(1 << 10)
                    try:
                        await ch.recv_frame(1 << 10)
                    except TransportError as e:
                        errors.append(str(e))

                srv = asyncio.ensure_future(server())
                ch = await a.connect(b.ticket(), CONTROL_ALPN)
                await ch.send_frame(b"hi")
                await asyncio.sleep(0.3)
                if leave == "close":
                    ch.close("node leaving")
                else:
                    await a.close()
                await asyncio.wait_for(srv, 30)
            return errors
        finally:
            await b.close()

    errors = run_async(main())
    assert errors == [
        "waiting for a frame failed: the peer closed the connection (node leaving)",
        "waiting for a frame failed: the peer closed the connection",
    ]


def test_a_channel_knows_how_long_it_has_been_quiet() -> None:
    # (the coordinator pings, and a node heartbeats, only over a channel quiet for half a beat)
    async def main() -> tuple[float, float]:
        a, b = await _pair()
        try:

            async def server() -> None:
                _alpn, conn = await b.accept(timeout=10)
                ch = await Endpoint.accept_channel(conn)
                for _ in range(2):
                    await ch.recv_frame(16)

            srv = asyncio.ensure_future(server())
            ch = await a.connect(b.ticket(), CONTROL_ALPN)
            await ch.send_frame(b"hello")
            await asyncio.sleep(0.3)
            quiet = ch.quiet_s()
            await ch.send_frame(b"again")
            after = ch.quiet_s()
            await asyncio.wait_for(srv, 30)
            return quiet, after
        finally:
            await a.close()
            await b.close()

    quiet, after = run_async(main(), timeout=60)
    assert quiet >= 0.3 > after
