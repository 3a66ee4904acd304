"""Trust in a live swarm: real keys, a real git repo, real iroh on loopback, real `drift join`.

Bad peers (forged signature, wrong signer, replay, stale timestamp, wrong commit, unknown node, a
node whose checkout is dirty, a key file with loose permissions) are each refused with a clear
message on both sides, while the honest nodes train the run to its end.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import WRAPPERS, drift_cmd, dropped, git, make_task_repo, run_async

from drift import protocol as P
from drift.auth import NodeKey, load_or_create_key, sign_message, verify_message
from drift.coordinator import Coordinator, CoordinatorError
from drift.peers import MAX_HELLO
from drift.recipe import load_recipe
from drift.repo import RepoCache
from drift.transport import CONTROL_ALPN, MAX_CONTROL_FRAME, STATE_ALPN, Endpoint, TransportError

FAST = dict(min_nodes=2, rounds=2, inner_steps=2, batch_size=8, unit_steps=1, eval_batches=1)


class RawNode:
    """A hand-driven control connection: says whatever the test wants, with a real key."""

    def __init__(self, key: NodeKey):
        self.key = key
        self.ep: Endpoint | None = None
        self.ch = None

    async def hello(self, ticket: str) -> P.Message:
        self.ep = await Endpoint.bind("local", secret_key=self.key.seed)
        self.ch = await self.ep.connect(ticket, CONTROL_ALPN, timeout=60)
        await self.ch.send_frame(
            P.encode(
                P.NodeInfo(
                    node_id=self.key.node_id, name="raw", backend="torch", device="cpu", ring_ticket=self.ep.ticket()
                )
            )
        )
        return await self.reply()

    async def reply(self) -> P.Message:
        return P.decode(await self.ch.recv_frame(MAX_CONTROL_FRAME, timeout=120))

    async def send(self, frame: bytes) -> None:
        await self.ch.send_frame(frame)

    async def close(self) -> None:
        ep, self.ep = self.ep, None
        if ep:
            await ep.close()


def _repo_commit(signer: NodeKey, cfg: P.TrainConfig, **over) -> bytes:
    body = P.RepoCommit(
        repo="x",
        commit=cfg.commit,
        tree=None,
        node_id=signer.node_id,
        timestamp=time.time(),
        nonce=os.urandom(16).hex(),
        param_checksum="p",
        n_train=100,
        run_id=cfg.run_id,
    )
    signed = sign_message(signer, {**body.model_dump(mode="json"), **over})
    return P.encode(P.RepoCommit.model_validate(signed))


async def _refused(node: RawNode, ticket: str, make_frame, replay: bytes | None = None) -> tuple[str, bytes]:
    """Connect, answer TrainConfig with make_frame(cfg) (or `replay`), return the cancel reason."""
    try:
        first = await node.hello(ticket)
        if isinstance(first, P.TrainingCancel):
            return first.reason, b""
        assert isinstance(first, P.TrainConfig), first
        frame = replay if replay is not None else make_frame(first)
        await node.send(frame)
        cancel = await node.reply()
        assert isinstance(cancel, P.TrainingCancel), cancel
        return cancel.reason, frame
    finally:
        await node.close()


def _join(repo: Path, ticket: str, key: Path, cache: Path, name: str) -> subprocess.Popen:
    err = open(cache.parent / f"{name}.err", "w+")  # a file, not a pipe: nobody has to drain it
    proc = subprocess.Popen(
        drift_cmd(
            "join",
            "--repo",
            str(repo),
            "--ticket",
            ticket,
            "--key",
            str(key),
            "--cache-dir",
            str(cache),
            "--name",
            name,
            "--threads",
            "1",
        ),
        stdout=subprocess.DEVNULL,
        stderr=err,
        text=True,
    )
    proc.err_file = err  # type: ignore[attr-defined]
    return proc


def _err(proc: subprocess.Popen) -> str:
    proc.err_file.seek(0)  # type: ignore[attr-defined]
    return proc.err_file.read()  # type: ignore[attr-defined]


def _wait(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    proc.wait(timeout=timeout)
    return proc.returncode, _err(proc)


@pytest.mark.swarm
def test_bad_peers_are_refused_while_the_swarm_trains(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    recipe_path = make_task_repo(tmp_path / "repo", **FAST)
    repo = recipe_path.parents[1]
    head = git(repo, "rev-parse", "HEAD")
    keys = {
        n: load_or_create_key(tmp_path / "keys" / f"{n}.key")
        for n in ("good0", "good1", "dirty", "forger", "impostor", "victim", "stale", "wrong", "loose")
    }
    stranger = NodeKey.generate()
    recipe = load_recipe(recipe_path)
    recipe.allowlist = sorted(k.node_id for k in keys.values())
    # A node whose cached checkout of the run's commit was edited by hand.
    dirty_cache = tmp_path / "dirty-cache"
    work = RepoCache(str(repo), dirty_cache).checkout(head)
    (work / "recipes" / "shakespeare_char.py").write_text("raise SystemExit('patched')\n")
    keys["loose"].path.chmod(0o644)

    async def main():
        coord = Coordinator(recipe, tmp_path / "run", commit=head, tree=git(repo, "rev-parse", "HEAD^{tree}"))
        ticket = await coord.start()
        procs: list[subprocess.Popen] = []
        try:
            dirty = _join(repo, ticket, keys["dirty"].path, dirty_cache, "dirty")
            loose = _join(repo, ticket, keys["loose"].path, tmp_path / "c-loose", "loose")
            procs += [dirty, loose]
            k = keys
            reasons = {}
            reasons["forged"], _ = await _refused(
                RawNode(k["forger"]),
                ticket,
                lambda cfg: _repo_commit(k["forger"], cfg).replace(b'"n_train":100', b'"n_train":101'),
            )
            reasons["impostor"], _ = await _refused(
                RawNode(k["impostor"]), ticket, lambda cfg: _repo_commit(k["victim"], cfg)
            )
            reasons["stale"], _ = await _refused(
                RawNode(k["stale"]), ticket, lambda cfg: _repo_commit(k["stale"], cfg, timestamp=time.time() - 3600)
            )
            reasons["wrong"], frame = await _refused(
                RawNode(k["wrong"]), ticket, lambda cfg: _repo_commit(k["wrong"], cfg, commit="0" * 40)
            )
            reasons["replay"], _ = await _refused(RawNode(k["wrong"]), ticket, None, replay=frame)
            reasons["stranger"], _ = await _refused(RawNode(stranger), ticket, None)
            dirty_rc, dirty_err = await asyncio.to_thread(_wait, dirty)
            loose_rc, loose_err = await asyncio.to_thread(_wait, loose)

            # The honest nodes join now and train the whole run.
            cache = tmp_path / "cache"
            good = [_join(repo, ticket, k[f"good{i}"].path, cache, f"good{i}") for i in range(2)]
            procs += good
            run = asyncio.ensure_future(coord.run())
            while len(coord.ready) < 2 and not run.done():
                await asyncio.sleep(0.2)
            # An unknown node knocking during the run is refused at connect; the run goes on.
            reasons["stranger_late"], _ = await _refused(RawNode(stranger), ticket, None)
            while not run.done():  # a good node that fails ends the test with its error, not a hang
                for p in good:
                    assert p.poll() in (None, 0), _err(p)
                await asyncio.sleep(0.2)
            results = run.result()
            good_out = [await asyncio.to_thread(_wait, p) for p in good]
            return reasons, (dirty_rc, dirty_err), (loose_rc, loose_err), results, good_out, dropped(caplog)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            await coord.close()

    reasons, (dirty_rc, dirty_err), (loose_rc, loose_err), results, good_out, rejected = run_async(main(), 600)
    k = keys
    assert "bad signature (forged" in reasons["forged"]
    assert (
        f"wrong signer: RepoCommit is signed as node {k['victim'].node_id[:10]} but the connection is from "
        f"node {k['impostor'].node_id[:10]}"
    ) in reasons["impostor"]
    assert "stale RepoCommit" in reasons["stale"] and "signed 3600 s ago" in reasons["stale"]
    assert (
        f"wrong commit: node {k['wrong'].node_id[:10]} runs 0000000000, this run needs {head[:10]}" in reasons["wrong"]
    )
    assert "replayed RepoCommit" in reasons["replay"]
    for r in ("stranger", "stranger_late"):
        assert f"node {stranger.node_id} is not on this swarm's allowlist" in reasons[r]
    # Each refusal is logged on the coordinator's side with the same reason.
    log = "\n".join(rejected)
    for r in reasons.values():
        assert r in log
    # The node with the dirty checkout refused to run it, said why on both sides, and exited non-zero.
    assert dirty_rc != 0 and "Traceback" not in dirty_err
    assert dirty_err.strip().splitlines()[-1].startswith("drift: error: checkout ")
    assert "has uncommitted changes (recipes/shakespeare_char.py)" in dirty_err
    assert "refused to run: checkout" in log and "has uncommitted changes" in log
    # A key file others can read stops the node before it connects.
    assert loose_rc != 0 and loose_err.strip().splitlines() == [
        f"drift: error: key file {k['loose'].path} is readable by other users (mode 0644); "
        f"fix with: chmod 600 {k['loose'].path}"
    ]
    # ...and the honest nodes trained the whole run.
    assert [r.round for r in results] == [0, 1]
    for rc, err in good_out:
        assert rc == 0, err


@pytest.mark.swarm
def test_a_member_that_presents_a_bad_repo_commit_to_a_node_is_refused(tmp_path: Path) -> None:
    """A node checks each peer's own signed RepoCommit as the peer first talks to it (drift/peers.py;
    TrainingReady carries only auth_threshold's few). A member the coordinator admitted, dialing a
    real `drift join` node's drift-state/1, is refused with the reason when it presents a RepoCommit
    of another commit, another node's, a forged one or none (a state request straight away): no state;
    the RepoCommit it gave the coordinator is accepted, and the node answers with its own."""
    recipe_path = make_task_repo(tmp_path / "repo", **FAST)
    repo = recipe_path.parents[1]
    head = git(repo, "rev-parse", "HEAD")
    node_key = load_or_create_key(tmp_path / "keys" / "node.key")
    member, victim = NodeKey.generate(), NodeKey.generate()
    me = member.node_id[:10]

    async def main():
        coord = Coordinator(
            load_recipe(recipe_path), tmp_path / "run", commit=head, tree=git(repo, "rev-parse", "HEAD^{tree}")
        )
        ticket = await coord.start()
        node = _join(repo, ticket, node_key.path, tmp_path / "cache", "node")
        raw = RawNode(member)
        run = asyncio.ensure_future(coord.run())
        try:
            while node_key.node_id not in coord.admission.verified:
                assert node.poll() is None, _err(node)
                await asyncio.sleep(0.2)
            # The raw member claims the task the node loaded (the coordinator admits only the same task).
            theirs = coord.admission.verified[node_key.node_id]
            task = {
                k: theirs[k] for k in ("tree", "param_checksum", "frozen_checksum", "n_train", "n_params", "layout")
            }
            cfg = await raw.hello(ticket)
            assert isinstance(cfg, P.TrainConfig), cfg
            good = _repo_commit(member, cfg, **task)
            await raw.send(good)
            while not isinstance(msg := await raw.reply(), P.TrainingReady):
                assert not isinstance(msg, P.TrainingCancel), msg
            assert len(msg.signatures) == 1  # auth_threshold's few, not one per member
            state_ticket = coord.ready[node_key.node_id].info.ring_ticket

            async def present(frame: bytes) -> P.Message | str:
                """The node's answer to `frame` on a new drift-state/1 connection from the member."""
                while True:
                    ch = await raw.ep.connect(state_ticket, STATE_ALPN, timeout=30)
                    try:
                        await ch.send_frame(frame)
                        answer = P.decode(await ch.recv_frame(MAX_HELLO, timeout=30))
                    except TransportError as e:
                        answer = ch.close_reason() or str(e)
                    finally:
                        ch.close("done")
                    if "not a member of this run" not in str(answer):
                        return answer
                    await asyncio.sleep(0.2)  # the node has not read its TrainingReady yet

            welcome = await present(good)  # first: the node knows the member from then on
            refused = {
                "commit": await present(_repo_commit(member, cfg, **{**task, "commit": "0" * 40})),
                "signer": await present(_repo_commit(victim, cfg, **task)),
                "forged": await present(good.replace(b'"n_train":', b'"n_train":1')),
                "none": await present(b'{"round": -1}'),  # straight to a state request
                "other": await present(P.encode(P.Ping())),
            }
            return welcome, refused
        finally:
            run.cancel()
            await raw.close()
            if node.poll() is None:
                node.kill()
            await coord.close()

    welcome, refused = run_async(main(), 300)
    assert isinstance(welcome, P.RepoCommit) and welcome.node_id == node_key.node_id
    verify_message(welcome.model_dump(mode="json"))  # the node's own, signed by its key
    why = {k: v.reason if isinstance(v, P.TrainingCancel) else v for k, v in refused.items()}
    assert f"peer {me} runs commit 0000000000, not {head[:10]}" in why["commit"]
    assert (
        f"wrong signer: the RepoCommit is signed as node {victim.node_id[:10]} but comes from node {me}"
        in why["signer"]
    )
    assert "bad signature (forged" in why["forged"]
    assert "schema version None" in why["none"]
    assert "sent Ping where its signed RepoCommit belongs" in why["other"]


def test_swarm_is_cancelled_when_auth_threshold_cannot_be_met(tmp_path: Path) -> None:
    recipe_path = make_task_repo(tmp_path / "repo", **FAST)
    head = git(recipe_path.parents[1], "rev-parse", "HEAD")
    keys = [NodeKey.generate() for _ in range(3)]
    recipe = load_recipe(recipe_path)
    recipe.allowlist = [k.node_id for k in keys]
    recipe.auth_threshold = 2

    async def main():
        coord = Coordinator(recipe, tmp_path / "run", commit=head)
        ticket = await coord.start()
        run = asyncio.ensure_future(coord.run())
        good = RawNode(keys[0])
        try:
            cfg = await good.hello(ticket)
            await good.send(_repo_commit(keys[0], cfg))  # verified: waits for TrainingReady
            while keys[0].node_id not in coord.ready:
                await asyncio.sleep(0.05)
            first, _ = await _refused(RawNode(keys[1]), ticket, lambda c: _repo_commit(keys[1], c, commit="1" * 40))
            assert not run.done()  # 2 of 3 can still verify
            await _refused(RawNode(keys[2]), ticket, lambda c: _repo_commit(keys[2], c, commit="2" * 40))
            cancel = await good.reply()  # now only 1 can: everyone is told
            await good.close()  # (and leaves, as drift join does: the coordinator waits for that)
            try:
                await run
            except CoordinatorError as e:
                return first, cancel, str(e)
            raise AssertionError("the run should have been cancelled")
        finally:
            await good.close()
            await coord.close()

    first, cancel, err = run_async(main(), 120)
    assert "wrong commit" in first
    assert isinstance(cancel, P.TrainingCancel)
    assert "auth_threshold 2 can no longer be met: 2 of the 3 allowlisted nodes were refused" in cancel.reason
    assert err == cancel.reason


def test_ring_accepts_only_the_peers_of_the_current_ring() -> None:
    import numpy as np

    from drift.ring import Ring
    from drift.transport import RING_ALPN, TransportError

    async def main():
        eps = [await Endpoint.bind("local") for _ in range(3)]
        rings = [Ring(ep, timeout=3) for ep in eps[:2]]  # a stranger waits min(timeout, 30 s) to be named
        tasks = [asyncio.ensure_future(ep.serve({RING_ALPN: ring.handle_incoming})) for ep, ring in zip(eps, rings)]
        try:
            members = [P.RingMember(node_id=ep.node_id, ticket=ep.ticket(), weight=0.5) for ep in eps[:2]]
            xs = [np.ones(8, np.float32), np.full(8, 2, np.float32)]
            await asyncio.gather(*(r.allreduce_sum(x, members, 0) for r, x in zip(rings, xs)))
            # A third endpoint, not in the ring, dials node 0's ring ALPN: it is hung up on.
            ch = await eps[2].connect(eps[0].ticket(), RING_ALPN, timeout=60)
            await ch.send_frame(b'{"node_id": "stranger", "generation": 0}')
            try:
                await ch.recv_frame(4096, timeout=60)
                closed = ""
            except TransportError as e:
                closed = str(e)
            return xs, closed, set(rings[0]._incoming), eps[1].node_id
        finally:
            for t in tasks:
                t.cancel()
            for r in rings:
                r.close()
            for ep in eps:
                await ep.close()

    xs, closed, incoming, left_neighbour = run_async(main(), 180)
    assert all((x == 3).all() for x in xs)
    assert "not in the current ring" in closed
    assert incoming == {left_neighbour}


@pytest.mark.swarm
def test_task_code_imports_from_its_checkout_only(tmp_path: Path) -> None:
    """A task's `import helpers` finds the helpers.py committed next to it, never one in the
    directory `drift coord --local` (and so its nodes) was started from."""
    recipe = make_task_repo(
        tmp_path / "repo",
        name="helped",
        min_nodes=2,
        rounds=2,
        inner_steps=4,
        batch_size=8,
        unit_steps=2,
        eval_batches=1,
        task_config={"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
    )
    repo = recipe.parents[1]
    task = repo / "recipes" / "shakespeare_char.py"
    task.write_text(task.read_text() + "\nimport helpers  # noqa: E402\nassert helpers.ORIGIN == 'checkout'\n")
    (repo / "recipes" / "helpers.py").write_text("ORIGIN = 'checkout'\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "helpers")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "helpers.py").write_text("raise SystemExit('imported helpers.py from the working directory')\n")
    out = subprocess.run(
        drift_cmd("coord", str(recipe), "--local", "2", "--run-dir", str(tmp_path / "run")),
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.swarm
def test_a_new_node_tries_again_when_the_coordinator_hangs_up_mid_handshake(tmp_path: Path) -> None:
    """Seen once in CI: an honest node's first frame reached the coordinator garbled, the
    coordinator hung up (a refusal always says why, with TrainingCancel; this said nothing), and
    the node gave up, leaving the swarm waiting for it forever. Now it tries the handshake again.
    The coordinator is a real `drift coord` that cuts the first handshake (tests/wrappers)."""
    recipe_path = make_task_repo(tmp_path / "repo", **FAST)
    repo = recipe_path.parents[1]
    keys = [load_or_create_key(tmp_path / "keys" / f"n{i}.key") for i in range(2)]
    cut, log = tmp_path / "cut", tmp_path / "coord.log"
    with open(log, "w") as fh:
        coord = subprocess.Popen(
            [
                sys.executable,
                str(WRAPPERS / "fault_coord.py"),
                "coord",
                str(recipe_path),
                "--run-dir",
                str(tmp_path / "run"),
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "DRIFT_TEST_CUT": str(cut), "PYTHONUNBUFFERED": "1"},
        )
    procs: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"--ticket (\S+)", log.read_text())):
            assert coord.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        procs = [_join(repo, m.group(1), k.path, tmp_path / "cache", f"n{i}") for i, k in enumerate(keys)]
        assert coord.wait(timeout=300) == 0, log.read_text()
        out = [_wait(p) for p in procs]
    finally:
        for p in (coord, *procs):
            if p.poll() is None:
                p.kill()
    assert [rc for rc, _ in out] == [0, 0], out
    assert cut.read_text() in ("n0", "n1"), cut.read_text()
    cut_node = out[int(cut.read_text()[1])][1]
    assert "the coordinator hung up during the handshake" in cut_node and "trying again" in cut_node
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["round"] for e in events if e["event"] == "round"] == [0, 1]
