"""drift/data.py in process: the manifest, the disk cache (limit, LRU, files checked on read and
on restart) and the holder over real iroh on loopback (members only, lying holders caught)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, run_async

from drift import protocol as P
from drift.data import (
    MAX_CLIENTS,
    MAX_CLIENTS_PER_PEER,
    DataClient,
    DataError,
    DataServer,
    DataUnavailable,
    DiskCache,
    Manifest,
    ServedDataset,
    build_manifest,
)
from drift.transport import DATA_ALPN, Endpoint, Throttle, parse_ticket
from drift.workers import load_task


class Tokens:
    """Dict batches of uint16 windows plus a float label: two columns of different dtypes."""

    def __init__(self, n_train: int = 300, n_val: int = 40, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.integers(0, 1000, (n_train + n_val, 9)).astype(np.uint16)
        self.n_train, self.n_val, self.vocab_size = n_train, n_val, 1000

    def batch(self, split: str, indices: np.ndarray) -> dict[str, np.ndarray]:
        rows = self.x[(0 if split == "train" else self.n_train) + np.asarray(indices)]
        return {"tokens": rows, "mean": rows.mean(axis=1).astype(np.float32)}


def test_the_manifest_round_trips_and_pins_every_sample() -> None:
    ds = Tokens()
    m = build_manifest(ds, block=64)
    again = Manifest.decode(m.encode())
    assert again.root == m.root and again.n == {"train": 300, "val": 40} and again.vocab_size == 1000
    assert build_manifest(Tokens(seed=1)).root != m.root  # other samples, another manifest
    rows = m.layout.rows(ds.batch("train", np.array([5, 7])), 2)
    out = m.layout.batch(rows)
    assert (out["tokens"] == ds.x[[5, 7]]).all() and out["mean"].dtype == np.float32
    with pytest.raises(DataError, match=r"malformed|wrong number"):
        Manifest.decode(m.encode()[:-1])


def test_the_cache_keeps_within_its_limit_and_checks_what_it_reads(tmp_path: Path) -> None:
    ds = Tokens()
    m = build_manifest(ds)
    rows = lambda idx: m.layout.rows(ds.batch("train", idx), len(idx))  # noqa: E731
    one_file = 17 + 8 * 10 + 10 * m.layout.record
    cache = DiskCache(tmp_path, m, limit=3 * one_file)
    for k in range(5):
        idx = np.arange(10 * k, 10 * k + 10)
        cache.put("train", idx, rows(idx))
        assert cache.read("train", np.arange(0, 10)) is not None or k >= 3  # read: most recently used
    files = list(tmp_path.glob("*.rows"))
    assert sum(f.stat().st_size for f in files) <= 3 * one_file and cache.evicted == 2
    assert cache.read("train", np.arange(0, 10)) is not None  # kept: it was read after every write
    assert cache.read("train", np.arange(10, 20)) is None  # evicted (least recently used)
    assert (cache.read("train", np.arange(40, 50)) == rows(np.arange(40, 50))).all()
    # A restart finds the files again (a temporary file of a write that died is deleted) ...
    (tmp_path / "dead.tmp").write_bytes(b"half")
    again = DiskCache(tmp_path, m, limit=3 * one_file)
    assert (again.read("train", np.arange(40, 50)) == rows(np.arange(40, 50))).all()
    assert not (tmp_path / "dead.tmp").exists()
    # ... and a byte changed on disk is caught at the first read after a restart (a file is
    # checked whole once, then trusted): that file is dropped, to be fetched again.
    victim = next(f for f in tmp_path.glob("*.rows") if again._files[int(f.stem, 16)][1][0] == 40)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    third = DiskCache(tmp_path, m, limit=3 * one_file)
    assert third.read("train", np.arange(40, 45)) is None and not victim.exists()
    assert third.missing("train", np.arange(40, 50)).size == 10
    assert (third.read("train", np.arange(30, 40)) == rows(np.arange(30, 40))).all()  # the others still serve


async def _holders(*datasets, allowed=lambda peer: True):
    """One endpoint serving each dataset, all under the last one's manifest."""
    m = build_manifest(datasets[-1])
    out = []
    for ds in datasets:
        server = DataServer(ds, m, allowed)
        ep = await Endpoint.bind("local", alpns=(DATA_ALPN,))
        out.append((ep, server, asyncio.ensure_future(ep.serve({DATA_ALPN: server.handle}))))
    return m, out


def test_a_member_fetches_verified_samples_and_a_lying_holder_is_passed_over(tmp_path: Path) -> None:
    async def main() -> None:
        honest = Tokens()
        m, holders = await _holders(Tokens(seed=9), honest)  # the first serves other samples
        client_ep = await Endpoint.bind("local")
        try:
            src = P.DataSource(root=m.root, size=len(holders[0][1].blob), tickets=[ep.ticket() for ep, _, _ in holders])
            client = await DataClient.open(client_ep, src, tmp_path, 1 << 20)
            reports: list[P.DataReport] = []
            client.attach(reports.append)
            idx = np.array([3, 1, 4, 159, 26])
            await client.fetch("train", idx)
            assert [r.kind for r in reports] == ["bad_chunk", "bad_chunk"]  # the liar, twice; then the next
            assert reports[0].holder == holders[0][0].node_id and client.stats.bad == 10
            got = ServedDataset(client)
            assert got.n_train == 300 and got.vocab_size == 1000
            rows = await asyncio.to_thread(got.batch, "train", idx)  # from the cache: no fetch
            assert (rows["tokens"] == honest.batch("train", idx)["tokens"]).all()
            assert client.stats.samples == 5
            client.close()
        finally:
            for ep, server, serving in holders:
                serving.cancel()
                server.close()
                await ep.close()
            await client_ep.close()

    run_async(main())


def test_only_members_are_served_and_no_holder_means_unavailable(tmp_path: Path) -> None:
    # The holder serves nanoGPT token files (recipes/token_file.py, a fresh map per batch); then
    # the disk under them goes away (here: the file is deleted), as a real holder's data can.
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 300), ("val", 40)):
        np.random.default_rng(0).integers(0, 1000, n * 8 + 1).astype(np.uint16).tofile(data / f"{split}.bin")
    tokens = load_task(ROOT / "recipes" / "token_file.py").make_dataset({"data_dir": str(data), "block_size": 8})

    async def main() -> None:
        m, holders = await _holders(tokens, allowed=lambda peer: False)
        (ep, server, serving) = holders[0]
        client_ep = await Endpoint.bind("local")
        try:
            src = P.DataSource(root=m.root, size=len(server.blob), tickets=[ep.ticket()])
            with pytest.raises(DataError, match="no data holder could hand over the manifest"):
                await DataClient.open(client_ep, src, tmp_path, 1 << 20)
            server.allowed = lambda peer: True
            client = await DataClient.open(client_ep, src, tmp_path, 1 << 20)
            await client.fetch("val", np.arange(2))  # served while the files are there
            (data / "val.bin").unlink()
            with pytest.raises(DataUnavailable) as e:
                await client.fetch("val", np.arange(2, 6))
            assert "no data holder could serve 4 val samples" in str(e.value)
            assert f"unavailable: FileNotFoundError: [Errno 2] No such file or directory: '{data / 'val.bin'}'" in str(
                e.value
            )
            client.close()
        finally:
            serving.cancel()
            server.close()
            await ep.close()
            await client_ep.close()

    run_async(main())


def test_a_stranger_knocking_again_and_again_is_one_line(tmp_path: Path) -> None:
    """Refusals of a peer that is not a member go to on_stranger (a Throttle, as drift-state/0's):
    three knocks, one line."""

    async def main() -> None:
        ds = Tokens()
        m = build_manifest(ds)
        lines: list[str] = []
        server = DataServer(ds, m, allowed=lambda peer: False)
        strangers = Throttle(lambda peer, why: lines.append(why))
        ep = await Endpoint.bind("local", alpns=(DATA_ALPN,))
        serving = asyncio.ensure_future(
            ep.serve({DATA_ALPN: lambda conn: server.handle(conn, on_drop=lines.append, on_stranger=strangers)})
        )
        client_ep = await Endpoint.bind("local")
        try:
            src = P.DataSource(root=m.root, size=len(server.blob), tickets=[ep.ticket()])
            for _ in range(3):
                with pytest.raises(DataError, match="no data holder could hand over the manifest"):
                    await DataClient.open(client_ep, src, tmp_path, 1 << 20)
            assert lines == ["data request refused: not a member of this run"]
        finally:
            serving.cancel()
            server.close()
            await ep.close()
            await client_ep.close()

    run_async(main())


def test_one_member_cannot_hold_every_data_slot(tmp_path: Path) -> None:
    """A member opens as many drift-data/0 connections as the holder serves at once and idles on
    them: it gets MAX_CLIENTS_PER_PEER, the rest are refused with a line, and another member is
    served."""

    async def main() -> None:
        ds = Tokens()
        m = build_manifest(ds)
        lines: list[str] = []
        hog, member = await Endpoint.bind("local"), await Endpoint.bind("local")
        server = DataServer(ds, m, allowed=lambda peer: peer in (hog.node_id, member.node_id))
        ep = await Endpoint.bind("local", alpns=(DATA_ALPN,))
        serving = asyncio.ensure_future(
            ep.serve({DATA_ALPN: lambda conn: server.handle(conn, on_drop=lambda peer, why: lines.append(why))})
        )
        try:
            addr = parse_ticket(ep.ticket())
            held = [await asyncio.wait_for(hog.ep.connect(addr, DATA_ALPN), 10) for _ in range(MAX_CLIENTS)]
            while server._clients + len(lines) < len(held):  # the holder has seen each of them
                await asyncio.sleep(0.02)
            assert server._clients == MAX_CLIENTS_PER_PEER
            src = P.DataSource(root=m.root, size=len(server.blob), tickets=[ep.ticket()])
            client = await DataClient.open(member, src, tmp_path, 1 << 20)
            await client.fetch("train", np.arange(4))
            client.close()
            assert lines == [f"refused: {MAX_CLIENTS_PER_PEER} data connections from this peer already"] * (
                MAX_CLIENTS - MAX_CLIENTS_PER_PEER
            )
        finally:
            serving.cancel()
            server.close()
            for e in (ep, hog, member):
                await e.close()

    run_async(main())
