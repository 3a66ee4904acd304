"""The run's web page in a real browser (headless Chromium, driven by playwright), on a real
2-node swarm; the server's limits against hostile and slow clients; the static page of
`drift report`; Weights & Biases in offline mode; the terminal's progress bar and ETA."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import drift_cmd, make_task_repo, run_async

from drift.dashboard import (
    CLIENT_QUEUE,
    FULL_ROUNDS,
    KEPT,
    MAX_CLIENTS,
    MAX_PENDING_PER_SOURCE,
    MAX_REQUEST,
    Dashboard,
    parse_addr,
    slim,
    write_static,
)
from drift.monitor import Eta, read_events
from harness.simulate import Swarm

HOSTILE = "<img src=x onerror=alert(1)>"
TEX = "$\\evil$ &amp; <b>x</b>"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium (`.ci/run` installs it), driven by playwright; no browser download. A test
    that uses it is marked `chromium` (tests/conftest.py: skipped without it, except under CI)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
        yield b
        b.close()


def _open(browser, url: str):
    """A page at `url` that records dialogs (an alert() would be script a peer injected) and errors."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.dialogs, page.errors = [], []
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.goto(url)
    return page


def _wait(page, expr: str, timeout: float) -> None:
    """Poll a JS expression until it is true (page.wait_for_function evaluates strings, which the
    page's Content-Security-Policy refuses, as it should)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expr):
        assert time.monotonic() < deadline, f"never true: {expr}"
        page.wait_for_timeout(100)


def _names(page) -> list[str]:
    return page.eval_on_selector_all("#nodes tbody td.name", "tds => tds.map(td => td.textContent)")


def _points(page, chart: str, series: str) -> int:
    return page.eval_on_selector_all(f"#{chart} circle[data-series={series}]", "cs => cs.length")


def _val_points(events: list[dict]) -> int:
    """The val-loss points the page draws: θ0's, each round's, each evaluator's."""
    rounds = [e for e in events if e["event"] == "round"]
    done = {e["round"] for e in rounds}
    return (
        sum(e["event"] == "initial" for e in events)
        + sum(e.get("val_loss") is not None for e in rounds)
        + sum(e["event"] == "val" and e["after_round"] in done for e in events)
    )


@pytest.mark.swarm
@pytest.mark.chromium
@pytest.mark.swarm
def test_live_page_of_a_real_swarm(browser, tmp_path: Path) -> None:
    """A 2-node run, one node named to inject markup: the page shows both nodes (names as
    typed, no element or script of theirs), a loss curve point per finished round, updated live
    and complete at the end; the coordinator logs the same run to W&B (offline mode) once."""
    rounds = 4
    recipe = make_task_repo(
        tmp_path / "repo", min_nodes=2, rounds=rounds, wandb={"project": "drift-test", "tags": ["ci"]}
    )
    sw = Swarm(recipe, tmp_path, wrap=["env", "WANDB_MODE=offline", "WANDB_SILENT=true"])
    try:
        url = sw._wait_for(r"dashboard:\s+(\S+)", 30)
        assert url.startswith("http://127.0.0.1:") and "token=" in url
        sw.join(name=HOSTILE, sim_step="0.1")
        sw.join(name="alice", sim_step="0.1")  # (TeX in names: the static page test below)
        page = _open(browser, url)
        _wait(page, "Number(document.body.dataset.round) >= 2", 120)
        # mid-run: both nodes, names as typed, nothing of theirs became markup
        assert sorted(_names(page)) == sorted([HOSTILE, "alice"])
        assert page.eval_on_selector_all("main img, main b", "xs => xs.length") == 0
        assert sw.ticket.split(".")[0] not in page.content()  # the ticket admits: the owner's terminal only
        states = page.eval_on_selector_all("#nodes .state", "xs => xs.map(x => x.textContent)")
        assert set(states) <= {"training", "evaluating"}, states
        assert sw.finish() == 0, sw.log()
        _wait(page, "document.getElementById('eta').textContent === 'done'", 30)
        events = read_events(sw.run_dir)
        n_rounds = sum(e["event"] == "round" for e in events)
        assert n_rounds == rounds
        assert page.text_content("#round") == f"{rounds} of {rounds}"
        for chart in ("loss-samples", "loss-time"):
            assert _points(page, chart, "train") == n_rounds
            assert _points(page, chart, "val") == _val_points(events)
        assert page.eval_on_selector_all("#times svg", "xs => xs.length") == 2  # time per round, per node
        assert page.eval_on_selector_all("#times svg rect", "xs => xs.length") >= 2 * n_rounds
        assert page.dialogs == [] and page.errors == []
        page.close()

        # `drift report` writes the same page, static, with the events inside
        rep = subprocess.run(
            drift_cmd("report", str(sw.run_dir), "--out", str(tmp_path / "report")),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert rep.returncode == 0, rep.stdout + rep.stderr
        static = _open(browser, (tmp_path / "report" / "dashboard.html").as_uri())
        _wait(static, "document.getElementById('eta').textContent === 'done'", 30)
        assert sorted(_names(static)) == sorted([HOSTILE, "alice"])
        assert _points(static, "loss-samples", "train") == n_rounds
        assert static.dialogs == [] and static.errors == []
        static.close()
    finally:
        sw.finish(timeout=10)

    # W&B: one offline run (the coordinator's, beside metrics.jsonl), with TensorBoard's scalars
    runs = list((sw.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    records = _wandb_records(runs[0])
    run_event = next(e for e in events if e["event"] == "run")
    assert [r.run.run_id for r in records if r.WhichOneof("record_type") == "run"] == [run_event["run_id"]]
    rows = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    per_round = {row["round"]: row for row in rows if "loss/train" in row}
    for e in (e for e in events if e["event"] == "round"):
        row = per_round[e["round"]]
        assert row["loss/train"] == pytest.approx(e["train_loss"]) and row["loss/val"] == pytest.approx(e["val_loss"])
        assert row["sync/MiB_sent"] == pytest.approx(e["bytes_sent"] / 2**20) and "round/samples_per_s" in row
    initial = next(e for e in events if e["event"] == "initial")
    assert any(row["round"] == -1 and row["loss/val"] == pytest.approx(initial["val_loss"]) for row in rows)


def _wandb_records(path: Path) -> list:
    """The records of a W&B run file (its LevelDB-style log of protobuf Records: 32 KiB blocks,
    7-byte headers of crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or the LAST piece of a record
            rec = pb.Record()
            rec.ParseFromString(part)
            out.append(rec)
            part = b""
    return out


@pytest.mark.chromium
def test_static_page_shows_hostile_text_as_typed(browser, tmp_path: Path) -> None:
    """Names, devices and reasons made to break out of the page (a </script>, markup, TeX) are
    shown as typed in the node table and the event log."""
    evil = "</script><script>alert(2)</script>"
    events = [
        {"t": 0.0, "event": "run", "recipe": evil, "rounds": 2, "round_samples": 64, "join": f"drift join {HOSTILE}"},
        {"t": 1.0, "event": "node_joined", "node_id": "a" * 64, "name": HOSTILE, "device": evil, "backend": TEX},
        {"t": 1.1, "event": "node_joined", "node_id": "b" * 64, "name": TEX, "device": "cpu", "backend": "torch"},
        {"t": 1.2, "event": "training_started", "nodes": 2},
        {"t": 2.0, "event": "node_left", "node_id": "b" * 64, "name": TEX, "reason": HOSTILE, "round": 0},
    ]
    write_static(events, tmp_path / "page.html")
    page = _open(browser, (tmp_path / "page.html").as_uri())
    page.wait_for_selector("#nodes tbody tr")
    assert _names(page) == [HOSTILE, TEX]
    assert page.text_content("#subtitle") == evil
    assert "drift join" not in page.content()  # an older run recorded its ticket: the page leaves it out
    row = page.eval_on_selector_all("#nodes tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    assert row[0][2:4] == [evil, TEX] and row[1][8] == "excluded"
    assert page.get_attribute("#nodes tbody tr:nth-child(2) .state", "title") == HOSTILE
    log = page.eval_on_selector_all("#log tr", "rs => rs.map(r => r.textContent)")
    assert any(f"reason={HOSTILE}" in line for line in log)
    assert page.eval_on_selector_all("img, main b, main script", "xs => xs.length") == 0
    assert page.eval_on_selector_all("script", "xs => xs.length") == 2  # the page's data and its own code
    assert page.dialogs == [] and page.errors == []
    page.close()


# --- the server's limits (real sockets, in process) -------------------------------------------


def _run_in_thread(coro, timeout: float) -> None:
    """run_async, on a thread of its own: playwright's sync API keeps an event loop running here."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(run_async, coro, timeout).result()


async def _request(port: int, raw: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(raw)
    await w.drain()
    out = await asyncio.wait_for(r.read(), 10)
    w.close()
    return out


def test_only_fixed_routes_with_the_token() -> None:
    async def main() -> None:
        d = Dashboard()
        await d.start("127.0.0.1", 0)
        port = int(d.url.split(":")[2].split("/")[0])
        tok = d.token
        d.event({"t": 0.0, "event": "run", "recipe": "x"})
        d.event({"t": 1.0, "event": "val", "val_loss": float("nan")})  # a diverged loss: JSON has no NaN

        async def status(raw: bytes) -> int:
            return int((await _request(port, raw)).split(b" ", 2)[1])

        page = await _request(port, f"GET /?token={tok} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert page.startswith(b"HTTP/1.1 200") and b"Content-Security-Policy: default-src 'none'" in page
        snap = await _request(port, f"GET /snapshot.json?token={tok} HTTP/1.1\r\n\r\n".encode())
        assert json.loads(snap.split(b"\r\n\r\n", 1)[1])["events"] == [
            {"t": 0.0, "event": "run", "recipe": "x"},
            {"t": 1.0, "event": "val", "val_loss": None},
        ]
        assert await status(b"GET / HTTP/1.1\r\n\r\n") == 403  # no token
        assert await status(b"GET /?token=guess HTTP/1.1\r\n\r\n") == 403
        for path in ("/metrics.jsonl", "/../../etc/passwd", "/dashboard.html", "/%2e%2e/pyproject.toml", "//etc"):
            assert await status(f"GET {path}?token={tok} HTTP/1.1\r\n\r\n".encode()) == 404, path
        for method in ("POST", "PUT", "DELETE"):
            assert await status(f"{method} /?token={tok} HTTP/1.1\r\n\r\n".encode()) == 405
        assert await status(b"GARBAGE\r\n\r\n") == 400
        big = f"GET /?token={tok} HTTP/1.1\r\nX: {'a' * MAX_REQUEST}\r\n\r\n".encode()
        assert await status(big) == 431
        await d.close()

    _run_in_thread(main(), timeout=60)


def test_slow_and_surplus_clients_cannot_hold_the_coordinator() -> None:
    """A client that never reads is dropped once CLIENT_QUEUE events wait for it, while a reading
    client gets every event in order; connections beyond MAX_CLIENTS are refused."""

    async def main() -> None:
        d = Dashboard()
        await d.start("127.0.0.1", 0)
        port = int(d.url.split(":")[2].split("/")[0])
        get = f"GET /events?token={d.token} HTTP/1.1\r\n\r\n".encode()
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
        slow_w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow_w.write(get)
        fast_r, fast_w = await asyncio.open_connection("127.0.0.1", port)
        fast_w.write(get)
        while len(d._clients) < 2:
            await asyncio.sleep(0.01)
        got: list[int] = []
        n = 4 * CLIENT_QUEUE

        async def read_fast() -> None:
            buf = b""
            while len(got) < n:
                chunk = await fast_r.read(1 << 16)
                assert chunk, f"the reading client was dropped after {len(got)} events"
                buf += chunk
                *msgs, buf = buf.split(b"\n\n")
                got.extend(json.loads(m.split(b"data: ", 1)[1])["i"] for m in msgs if b"data: " in m)

        reader = asyncio.ensure_future(read_fast())
        pad = "x" * 20_000
        for i in range(n):
            d.event({"t": float(i), "event": "note", "i": i, "pad": pad})  # returns at once, whoever lags
            await asyncio.sleep(0.001)  # (the coordinator's loop goes on with other work meanwhile)
        await asyncio.wait_for(reader, 60)
        assert got == list(range(n))
        assert len(d._clients) == 1  # the one that never read is gone
        with pytest.raises(ConnectionResetError):  # reset: neither side keeps what it never read
            while await slow_r.read(1 << 16):
                pass
        # surplus connections: the first MAX_CLIENTS are served, the next is refused at once
        conns = []
        for _ in range(MAX_CLIENTS):  # (each sends its request at once, as a browser does)
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(get)
            conns.append((r, w))
        while len(d._clients) < MAX_CLIENTS:
            await asyncio.sleep(0.01)
        refused = await _request(port, get)
        assert refused.startswith(b"HTTP/1.1 503")
        for _, w in [*conns, (fast_r, fast_w), (slow_r, slow_w)]:
            w.close()
        await d.close()

    _run_in_thread(main(), timeout=120)


def test_trickling_requests_cannot_lock_the_owner_out() -> None:
    """More connections than there are client slots, each sending its request line a byte at a
    time (never its headers' end), from one address and from another: the owner's request (sent
    at once, with the token) is still served; trickling connections are pushed out, oldest first."""

    async def main() -> None:
        d = Dashboard()
        await d.start("0.0.0.0", 0)
        port = int(d.url.split(":")[2].split("/")[0])
        slow = []
        for host in ("127.0.0.1", "127.0.0.2"):  # (127.0.0.2: another machine's address)
            for _ in range(MAX_CLIENTS + MAX_PENDING_PER_SOURCE):
                r, w = await asyncio.open_connection(host, port, local_addr=(host, 0))
                w.write(b"G")
                slow.append((r, w))
        await asyncio.sleep(0.5)  # (the server has taken them all)
        owner = await _request(port, f"GET /snapshot.json?token={d.token} HTTP/1.1\r\n\r\n".encode())
        assert owner.startswith(b"HTTP/1.1 200"), owner[:100]
        pushed = [await asyncio.wait_for(r.read(), 10) for r, _ in slow[:MAX_PENDING_PER_SOURCE]]
        assert pushed == [b""] * MAX_PENDING_PER_SOURCE  # the oldest were closed without a word
        for _, w in slow:
            w.close()
        await d.close()

    _run_in_thread(main(), timeout=60)


def test_dashboard_addresses() -> None:
    assert parse_addr("127.0.0.1") == ("127.0.0.1", 0)
    assert parse_addr("0.0.0.0:8470") == ("0.0.0.0", 8470)
    assert parse_addr(":8470") == ("127.0.0.1", 8470)
    assert parse_addr("[::1]:8470") == ("::1", 8470)
    assert parse_addr("off") is None


@pytest.mark.swarm
def test_bad_dashboard_address_is_one_line(tiny_recipe: Path) -> None:
    out = subprocess.run(
        drift_cmd("coord", str(tiny_recipe), "--dashboard", "host:port"), capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "drift: error: --dashboard 'host:port': expected HOST:PORT, :PORT, HOST or off"
    ]


def test_terminal_progress_bar_and_eta() -> None:
    """The live table's title: the round's samples so far as a bar, and the rounds left at the
    pace of those done."""
    eta = Eta()
    assert eta.bar(100, 4, 0.0) == f"[{'.' * 20}] 0%  ETA -"
    for rec in (
        {"t": 10.0, "event": "training_started"},
        {"t": 12.0, "event": "progress", "round": 0, "unit": [0, 0, 0, 50]},
        {"t": 14.0, "event": "round", "round": 0},  # 4 s a round
        {"t": 15.0, "event": "progress", "round": 1, "unit": [0, 1, 0, 25]},
        {"t": 15.5, "event": "progress", "round": 1, "unit": [0, 1, 0, 25]},  # the same unit reported again
    ):
        eta.event(rec)
    assert eta.bar(100, 4, 15.0) == f"[{'#' * 5}{'.' * 15}] 25%  ETA 11s"  # 3 rounds x 4 s, 1 s of them gone


def test_closing_with_an_open_tab_ends_its_stream_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A browser tab holds an event stream and a connection it opened ahead (no request yet)
    when the run ends: the stream gets the last event and ends; nothing is logged as an error."""
    got: list[bytes] = []

    async def main() -> None:
        d = Dashboard()
        await d.start("127.0.0.1", 0)
        port = int(d.url.split(":")[2].split("/")[0])
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"GET /events?token={d.token} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await w.drain()
        await r.readuntil(b"retry: 2000\n\n")
        _, ahead = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.2)  # (the server has taken both connections)
        d.event({"t": 2.0, "event": "complete", "rounds": 2})
        await d.close()
        got.append(await asyncio.wait_for(r.read(), 10))  # ends: the server closed the stream
        w.close()
        ahead.close()

    # A loop of its own, on a thread (playwright's keeps one running here): its end cancels
    # what is left, which is where the tracebacks came from.
    with caplog.at_level("DEBUG"), ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, main()).result(timeout=60)
    assert b'"event": "complete"' in got[0]
    problems = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
    assert not problems, [r.getMessage() for r in problems]


FINISHED_RUN = [
    {"t": 0.0, "event": "run", "recipe": "tiny", "rounds": 2, "round_samples": 64},
    {"t": 1.0, "event": "node_joined", "node_id": "a" * 64, "name": "one", "device": "cpu", "backend": "torch"},
    {"t": 1.1, "event": "node_joined", "node_id": "b" * 64, "name": "two", "device": "cpu", "backend": "torch"},
    {"t": 1.2, "event": "training_started", "nodes": 2},
    {"t": 2.0, "event": "progress", "node_id": "a" * 64, "round": 1, "unit": [0, 1, 0, 32], "samples_per_s": 9.0},
    {"t": 3.0, "event": "round", "round": 0, "samples": 64, "nodes": {"one": {"node_id": "a" * 64, "weight": 1.0}}},
    {"t": 4.0, "event": "round", "round": 1, "samples": 64, "nodes": {"two": {"node_id": "b" * 64, "weight": 1.0}}},
    {"t": 4.1, "event": "complete", "rounds": 2, "final_val_loss": 1.5},
    {"t": 4.2, "event": "progress", "node_id": "b" * 64, "round": 2, "unit": [0, 1, 0, 32], "samples_per_s": 9.0},
]


def _a_thousand_nodes() -> list[dict]:
    """A round of 1,000 nodes, n999 the slowest and n0 the fastest, each 1 MiB sent."""
    ids = [f"{k:064x}" for k in range(1000)]
    events = [{"t": 0.0, "event": "run", "recipe": "big", "rounds": 1, "round_samples": 16000}]
    events += [
        {"t": 1.0, "event": "node_joined", "node_id": i, "name": f"n{k}", "device": "cpu", "backend": "numpy"}
        for k, i in enumerate(ids)
    ]
    events.append({"t": 1.5, "event": "training_started", "nodes": 1000})
    events += [
        {"t": 2.0, "event": "progress", "node_id": i, "round": 0, "unit": [0, k, 0, 16], "samples_per_s": 1000.0 - k}
        for k, i in enumerate(ids)
    ]
    row = {"weight": 0.001, "samples": 16, "bytes_sent": 2**20, "busy_s": 0.5, "idle_s": 0.1, "sync_s": 1.0}
    nodes = {f"n{k}": {"node_id": i, **row} for k, i in enumerate(ids)}
    events.append({"t": 3.0, "event": "round", "round": 0, "samples": 16000, "nodes": nodes})
    return events


@pytest.mark.chromium
def test_a_thousand_nodes_page_shows_the_slowest_and_sums_up_the_rest(browser, tmp_path: Path) -> None:
    """At a thousand nodes the page stays readable (issue 40): its table and per-node charts show
    the slowest 16, and one row sums up the rest, as the terminal's table does."""
    write_static(_a_thousand_nodes(), tmp_path / "page.html")
    page = _open(browser, (tmp_path / "page.html").as_uri())
    page.wait_for_selector("#nodes tbody tr")
    assert _names(page) == [f"n{999 - k}" for k in range(16)]  # the slowest first
    rest = " ".join(page.text_content("#nodes tbody tr.rest").split())
    assert rest.startswith("984 faster nodes") and "98.4 %" in rest and "984.0" in rest  # their share, MiB sent
    assert page.eval_on_selector_all("#times > div", "ds => ds.length") == 16
    assert page.errors == []
    page.close()


def test_a_finished_runs_snapshot_says_finished(tmp_path: Path) -> None:
    """The monitor's `complete` event, as the coordinator emits it, makes the served page's state finished."""
    from drift.monitor import Monitor

    board = Dashboard()
    monitor = Monitor(tmp_path, live=False)
    monitor.subscribers.append(board.event)
    try:
        for e in FINISHED_RUN[:4]:
            monitor.event(e["event"], **{k: v for k, v in e.items() if k not in ("t", "event")})
        assert board.snapshot()["state"] == "running"
        monitor.event("complete", rounds=2, final_val_loss=1.5)
        assert board.snapshot()["state"] == "finished"
    finally:
        monitor.close()


@pytest.mark.chromium
def test_a_finished_runs_page_shows_it_finished_and_its_nodes_done(browser, tmp_path: Path) -> None:
    """`drift report`'s page of a finished run: every round done, the bar full, each node done
    (a progress event that came after the end does not make it `training` again)."""
    write_static(FINISHED_RUN, tmp_path / "page.html")
    page = _open(browser, (tmp_path / "page.html").as_uri())
    page.wait_for_selector("#nodes tbody tr")
    states = page.eval_on_selector_all("#nodes .state", "xs => xs.map(x => x.textContent)")
    assert states == ["done", "done"]
    assert page.text_content("#round") == "2 of 2"
    assert page.text_content("#status") == "finished run (static page)"
    assert page.evaluate("document.getElementById('progress').style.width") == "100%"
    assert page.errors == []
    page.close()


# --- many rounds of many nodes: a bounded history -----------------------------------------------


def _many_rounds(nodes: int, rounds: int, silent: int = 0) -> list[dict]:
    """`rounds` rounds of `nodes` nodes, n0 the fastest and n{nodes - 1} the slowest, the last
    `silent` of them with no speed yet (slowest of all); each row's samples and bytes differ by node
    and round; one row (`coordinator`) has no node id."""
    ids = [f"{k:064x}" for k in range(nodes)]
    events = [{"t": 0.0, "event": "run", "recipe": "many", "rounds": rounds, "round_samples": 1000}]
    events += [{"t": 0.5, "event": "node_joined", "node_id": i, "name": f"n{k}"} for k, i in enumerate(ids)]
    events.append({"t": 0.9, "event": "training_started", "nodes": nodes})
    for r in range(rounds):
        t = 1.0 + r
        events += [
            {"t": t, "event": "progress", "node_id": i, "round": r, "unit": [0, k, 0, 8], "samples_per_s": 1000.0 - k}
            for k, i in enumerate(ids[: nodes - silent])
        ]
        rows = {
            f"n{k}": {"node_id": i, "weight": 0.01, "samples": 10 + (k + r) % 7, "bytes_sent": 100_003 * (k + 1) + r}
            | {"step_s": 0.25 * (1 + k % 4), "busy_s": 0.4, "idle_s": 0.05, "sync_s": 0.05, "role": "train"}
            for k, i in enumerate(ids)
        }
        rows["coordinator"] = {"samples": 0, "bytes_sent": 7}
        events.append({"t": t + 0.5, "event": "round", "round": r, "samples": 1000, "bytes_sent": 0, "nodes": rows})
    return events


def _totals(events: list[dict]) -> dict[str, list[float]]:
    """Each node's samples, bytes sent and step seconds, summed as the page sums them (step
    seconds are quarters: their sums are exact in any order)."""
    out: dict[str, list[float]] = {}
    for e in events:
        rows = e["nodes"].items() if e["event"] == "round" else []
        if e["event"] == "earlier":
            rows = [(i, {"node_id": i, **sums}) for i, sums in e["nodes"].items()]
        for _, row in rows:
            if row.get("node_id"):
                n = out.setdefault(row["node_id"], [0, 0, 0.0])
                n[0], n[1], n[2] = n[0] + row["samples"], n[1] + row["bytes_sent"], n[2] + row["step_s"]
    return out


def test_a_long_run_of_many_nodes_keeps_a_bounded_history() -> None:
    """200 nodes over 40 rounds: a client that connects late is sent every row of the newest
    FULL_ROUNDS rounds, the KEPT slowest nodes' rows of every older one, and the rest summed per
    node, so each node's totals are exact while the history holds a third of the rows."""
    nodes, rounds = 200, 40
    events = _many_rounds(nodes, rounds, silent=4)
    board = Dashboard()
    for e in events:
        board.event(e)
    sent = board.snapshot()["events"]
    assert sent[0]["event"] == "earlier"
    assert _totals(sent) == _totals(events)
    got = [e for e in sent if e["event"] == "round"]
    assert [e["round"] for e in got] == list(range(rounds))
    slowest = {f"n{k}" for k in range(nodes - KEPT, nodes)}  # (the 4 silent ones among them)
    for e in got[:-FULL_ROUNDS]:
        assert set(e["nodes"]) == slowest | {"coordinator"}
    assert [len(e["nodes"]) for e in got[-FULL_ROUNDS:]] == [nodes + 1] * FULL_ROUNDS
    # what the history holds: in proportion to its rows
    whole = sum(len(json.dumps(slim(e))) for e in events if e["event"] == "round")
    held = sum(len(json.dumps(e)) for e in got)
    rows = FULL_ROUNDS * (nodes + 1) + (rounds - FULL_ROUNDS) * (KEPT + 1)
    assert held < 1.1 * whole * rows / (rounds * (nodes + 1)) < 0.4 * whole
    # a swarm of KEPT nodes loses nothing
    small = Dashboard()
    events = _many_rounds(KEPT, 12)
    for e in events:
        small.event(e)
    assert small.snapshot()["events"] == [e for e in events if e["event"] != "progress"]


async def _backlog(port: int, token: str, last_id: str | None, until: int) -> list[dict]:
    """The events an event-stream client is sent (with `Last-Event-ID: last_id`) up to event `until`."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    header = "" if last_id is None else f"Last-Event-ID: {last_id}\r\n"
    w.write(f"GET /events?token={token} HTTP/1.1\r\n{header}\r\n".encode())
    buf = b""
    while not (b"id: %d\n" % until in buf and buf.endswith(b"\n\n")):
        chunk = await asyncio.wait_for(r.read(1 << 16), 10)
        assert chunk, "the stream ended"
        buf += chunk
    w.close()
    return [json.loads(m.split(b"data: ", 1)[1]) for m in buf.split(b"\n\n") if b"data: " in m]


def test_a_reconnecting_page_resumes_or_starts_again() -> None:
    """A page that reconnects having seen every round event that was cut since gets exactly the
    events after its last one; one that missed a cut gets `reset`, then what a new page gets."""
    events = [e for e in _many_rounds(KEPT + 8, FULL_ROUNDS + 4) if e["event"] != "progress"]
    cut = events.index(next(e for e in events if e.get("round") == 3))  # the newest round cut (its id)

    async def main() -> None:
        d = Dashboard()
        await d.start("127.0.0.1", 0)
        port = int(d.url.split(":")[2].split("/")[0])
        for e in events:
            d.event(e)
        history, last = d.snapshot()["events"], len(events) - 1  # (the earlier sums, then the history)
        assert await _backlog(port, d.token, None, last) == history
        assert await _backlog(port, d.token, str(cut), last) == events[cut + 1 :]  # whole rounds, as they came
        assert await _backlog(port, d.token, str(cut - 1), last) == [{"event": "reset"}, *history]
        await d.close()

    _run_in_thread(main(), timeout=60)


def _cells(page) -> list[list[str]]:
    return page.eval_on_selector_all("#nodes tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.textContent))")


def _bars(page, node_id: str) -> int:
    """The rounds drawn in a node's time-per-round chart."""
    xs = page.eval_on_selector_all(f"#times div[data-node='{node_id}'] rect", "rs => rs.map(r => r.dataset.round)")
    return len(set(xs))


@pytest.mark.chromium
def test_a_long_run_of_many_nodes_page_is_exact_and_bounded(browser, tmp_path: Path) -> None:
    """100 nodes over 20 rounds, the fastest (n0) turning slowest after the last: the page's table
    shows every node's exact share and MiB sent (the shown ones, and the rest row). Older rounds
    keep the rows of the KEPT slowest nodes only: a slow node's chart has every round, n0's the
    newest FULL_ROUNDS. A page that reconnected late (`reset`, the server's `earlier` sums and
    its cut history) shows the same."""
    nodes, rounds = 100, 20
    events = _many_rounds(nodes, rounds, silent=4)
    late = {"t": 99.0, "event": "progress", "node_id": f"{0:064x}", "round": rounds, "unit": [0, 0, 0, 8]}
    events.append(late | {"samples_per_s": 0.5})
    totals, ids = _totals(events), {f"n{k}": f"{k:064x}" for k in range(nodes)}
    samples = sum(n[0] for n in totals.values())
    shown = [f"n{k}" for k in range(nodes - 4, nodes)] + ["n0"] + [f"n{k}" for k in range(nodes - 5, nodes - 16, -1)]
    rest = [n for n in ids if n not in shown]
    expected_rest = [
        f"{len(rest)} faster nodes",
        f"{100 * sum(totals[ids[n]][0] for n in rest) / samples:.1f} %",
        f"{sum(totals[ids[n]][1] for n in rest) / 2**20:.1f}",
    ]
    board = Dashboard()
    for e in events:
        board.event(e)
    snap = board.snapshot()
    reconnected = [*events[:500], {"event": "reset"}, *snap["events"], *snap["progress"]]
    for name, run in (("page.html", events), ("reconnected.html", reconnected)):
        write_static(run, tmp_path / name)
        page = _open(browser, (tmp_path / name).as_uri())
        page.wait_for_selector("#nodes tbody tr.rest")
        rows = _cells(page)
        assert sorted(r[0] for r in rows[:-1]) == sorted(shown)
        for r in rows[:-1]:
            assert r[5] == f"{100 * totals[ids[r[0]]][0] / samples:.1f} %", r  # share
            assert r[7] == f"{totals[ids[r[0]]][1] / 2**20:.1f}", r  # MiB sent
        assert [rows[-1][k] for k in (0, 5, 7)] == expected_rest
        assert _bars(page, ids[f"n{nodes - 5}"]) == rounds
        assert _bars(page, ids["n0"]) == FULL_ROUNDS
        assert page.errors == []
        page.close()
