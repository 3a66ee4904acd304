"""Each node verifies the peers it talks to itself (drift/peers.py, issue 40): real Ed25519 keys,
real iroh endpoints on loopback, a real state server behind the gate. The coordinator's
TrainingReady names the members and carries auth_threshold's few RepoCommits, so it grows by a
node id per member, not by every member's signature to every member."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
from conftest import run_async

from drift import protocol as P
from drift.auth import Admission, AuthError, NodeKey, PeerCheck, sign_message, verify_peers
from drift.coordinator import members_changed, ready_message
from drift.diloco import ParamLayout, checksum
from drift.peers import MAX_HELLO, MAX_PRESENTING, Peers
from drift.state import StateError, StateServer, fetch_state, into_arrays
from drift.transport import STATE_ALPN, Endpoint, TransportError

COMMIT, RUN = "c" * 40, "run1"


def _rc(key: NodeKey, **over) -> P.RepoCommit:
    """`key`'s signed RepoCommit for this run (fields overridden before signing)."""
    body = P.RepoCommit(
        repo="r",
        commit=COMMIT,
        tree=None,
        node_id=key.node_id,
        timestamp=time.time(),
        nonce=os.urandom(16).hex(),
        param_checksum="p",
        n_train=10,
        run_id=RUN,
    ).model_dump(mode="json")
    return P.RepoCommit.model_validate(sign_message(key, {**body, **over}))


def _d(rc: P.RepoCommit) -> dict:
    return rc.model_dump(mode="json")


# --- the check of one peer's RepoCommit -----------------------------------------------------------


def test_a_peer_is_accepted_only_with_its_own_repo_commit_for_this_run_and_kept() -> None:
    a, b, stranger = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    check = PeerCheck(COMMIT, RUN, allowlist=frozenset({a.node_id, b.node_id}))
    refused = {
        "wrong commit": (_d(_rc(a, commit="d" * 40)), a.node_id),
        "wrong run": (_d(_rc(a, run_id="run2")), a.node_id),
        "wrong signer": (_d(_rc(b)), a.node_id),  # b's RepoCommit, from the connection of a
        "forged": ({**_d(_rc(a)), "n_train": 11}, a.node_id),
        "unsigned": ({**_d(_rc(a)), "signature": ""}, a.node_id),
        "not allowlisted": (_d(_rc(stranger)), stranger.node_id),
        "not a dict": ([1, 2], a.node_id),
    }
    why = {}
    for name, (msg, peer) in refused.items():
        with pytest.raises(AuthError) as e:
            check.check(msg, peer)
        why[name] = str(e.value)
    assert f"runs commit dddddddddd, not {COMMIT[:10]}" in why["wrong commit"]
    assert "for another run ('run2')" in why["wrong run"]
    assert (
        f"wrong signer: the RepoCommit is signed as node {b.node_id[:10]} but comes from node {a.node_id[:10]}"
        in why["wrong signer"]
    )
    assert "bad signature" in why["forged"] and "is not signed" in why["unsigned"]
    assert f"peer {stranger.node_id[:10]} is not on the allowlist" in why["not allowlisted"]
    assert all(len(w) < 300 for w in why.values())
    assert check.verified == {}  # nothing refused is kept

    good = _d(_rc(a))
    check.check(good, a.node_id)
    assert a.node_id in check and b.node_id not in check
    check.check(good, a.node_id)  # the same RepoCommit again: known
    with pytest.raises(AuthError, match="bad signature"):  # a peer already verified still cannot send a bad one
        check.check({**good, "n_train": 11}, a.node_id)
    assert check.verified[a.node_id] == good
    check.retain([b.node_id])  # a left the run: it presents itself again if it comes back
    assert a.node_id not in check


def test_training_ready_carries_a_few_repo_commits_and_the_threshold_counts_the_verified() -> None:
    me, a, b, c = (NodeKey.generate() for _ in range(4))
    ids = [me.node_id, a.node_id, b.node_id, c.node_id]
    check = PeerCheck(COMMIT, RUN)
    verify_peers([_d(_rc(a))], ids, check=check, me=me.node_id, threshold=2)  # this node and a
    assert a.node_id in check and b.node_id not in check  # b and c: verified when this node talks to them
    with pytest.raises(AuthError, match="only 2 verified node"):
        verify_peers([], ids, check=check, me=me.node_id, threshold=3)
    verify_peers([_d(_rc(b))], ids, check=check, me=me.node_id, threshold=3)  # a was verified before
    with pytest.raises(AuthError, match="runs commit"):
        verify_peers([_d(_rc(c, commit="d" * 40))], ids, check=check, me=me.node_id)
    outsider = NodeKey.generate()
    with pytest.raises(AuthError, match=f"RepoCommit of node {outsider.node_id[:10]}, which it does not list"):
        verify_peers([_d(_rc(outsider))], ids, check=check, me=me.node_id)
    closed = PeerCheck(COMMIT, RUN, allowlist=frozenset(ids[:3]))
    with pytest.raises(AuthError, match=f"lists node {c.node_id[:10]}, which is not on the allowlist"):
        verify_peers([], ids, check=closed, me=me.node_id)


def test_training_ready_grows_by_a_node_id_per_member_not_by_every_signature() -> None:
    keys = [NodeKey.generate() for _ in range(256)]
    admission = Admission(commit=COMMIT, run_id=RUN)
    for k in keys:
        admission.verify(_d(_rc(k)), k.node_id)
    one_rc = len(P.encode(_rc(keys[0])))

    def size(n: int, threshold: int | None = None) -> int:
        ready = ready_message(admission, [k.node_id for k in keys[:n]], threshold)
        assert [s["node_id"] for s in ready.signatures] == [k.node_id for k in keys[: threshold or 1]]
        return len(P.encode(ready))

    per_id = len('"",') + 64
    assert size(256) - size(16) == 240 * per_id  # linear in N: the ids, and nothing per member beyond
    assert size(256, threshold=3) - size(256) < 3 * one_rc  # auth_threshold's RepoCommits, a constant
    ids_only = len(P.encode(P.TrainingReady(nodes=[k.node_id for k in keys])))
    assert ids_only < size(256) < ids_only + one_rc  # the ids and one RepoCommit (N of them before: 256)


def test_a_join_tells_the_members_who_joined_and_left_not_every_member_again() -> None:
    ids = [NodeKey.generate().node_id for _ in range(4)]
    a, b, c, d = ids
    changed = members_changed({a, b, c}, [a, c, d])
    assert (changed.joined, changed.left) == ([d], [b])
    many = [f"{k:064x}" for k in range(1000)]
    one_more = members_changed(set(many), [*many, d])
    assert one_more.joined == [d] and len(P.encode(one_more)) < 200  # a few ids, whatever N


# --- the exchange on a connection, in front of a real state server --------------------------------

LAYOUT = ParamLayout(("w",), ((64,),), n_buffers=0)


async def _node(key: NodeKey) -> tuple[Endpoint, Peers]:
    ep = await Endpoint.bind("local", secret_key=key.seed, alpns=(STATE_ALPN,))
    peers = Peers()
    ep.vet = peers.present
    return ep, peers


def test_members_exchange_repo_commits_before_state_and_a_bad_one_is_refused_with_why() -> None:
    keys = {n: NodeKey.generate() for n in ("donor", "good", "wrong", "impostor", "silent", "stranger", "liar")}
    theta = np.arange(LAYOUT.size, dtype=np.float32)
    want = checksum(theta)

    async def main():
        donor_ep, donor = await _node(keys["donor"])
        donor.arm(PeerCheck(COMMIT, RUN), _rc(keys["donor"]))
        server = StateServer(allowed=lambda peer: peer in donor.members)
        server.publish(0, (theta,), want, LAYOUT)
        served: list[str] = []  # peers the state server itself saw
        refusals: list[tuple[str, str]] = []

        async def handle(conn) -> None:
            served.append(str(conn.remote_id()))
            await server.handle(conn)

        serving = asyncio.ensure_future(
            donor_ep.serve({STATE_ALPN: donor.gate(handle, lambda p, why: refusals.append((p, why)))})
        )
        clients = {n: await _node(keys[n]) for n in ("good", "wrong", "impostor", "stranger", "liar")}
        for n, (_, peers) in clients.items():
            own = {"wrong": _rc(keys["wrong"], commit="d" * 40), "impostor": _rc(keys["silent"])}.get(n, _rc(keys[n]))
            peers.arm(PeerCheck(COMMIT, "run2" if n == "liar" else RUN), own)  # liar: checks for another run
            peers.set_members({keys["donor"].node_id})
        donor.set_members({keys[n].node_id for n in ("good", "wrong", "impostor", "silent", "liar")})

        async def fetch(n: str) -> str:
            got = np.zeros(LAYOUT.size, np.float32)
            try:
                await fetch_state(
                    clients[n][0],
                    [donor_ep.ticket()],
                    0,
                    want,
                    into_arrays(got),
                    size=LAYOUT.size,
                    arrays=1,
                    timeout=10,
                )
            except StateError as e:
                return str(e)
            assert (got == theta).all()
            return "ok"

        async def silent() -> str:
            """A member that skips the exchange: straight to a state request, on an endpoint without vet."""
            ep = await Endpoint.bind("local", secret_key=keys["silent"].seed, alpns=(STATE_ALPN,))
            try:
                ch = await ep.connect(donor_ep.ticket(), STATE_ALPN)
                await ch.send_frame(b'{"round": 0}')
                answer = P.decode(await ch.recv_frame(MAX_HELLO, timeout=10))
                return answer.reason if isinstance(answer, P.TrainingCancel) else answer.type
            except TransportError as e:
                return str(e)
            finally:
                await ep.close()

        try:
            out = {n: await fetch(n) for n in ("good", "wrong", "impostor", "stranger", "liar")}
            out["silent"] = await silent()
            return out, served, refusals, donor, clients
        finally:
            serving.cancel()
            for ep, _ in clients.values():
                await ep.close()
            await donor_ep.close()

    out, served, refusals, donor, clients = run_async(main(), 120)
    k = {n: key.node_id for n, key in keys.items()}
    assert out["good"] == "ok"
    assert k["good"] in donor.check and k["donor"] in clients["good"][1].check  # each verified the other
    # Nobody else reached the state server; the liar passed the donor's check, but refused the
    # donor's RepoCommit, hung up and asked for nothing.
    assert served == [k["good"], k["liar"]]
    assert f"refused this node: peer {k['wrong'][:10]} runs commit dddddddddd" in out["wrong"]
    assert f"wrong signer: the RepoCommit is signed as node {k['silent'][:10]}" in out["impostor"]
    assert "not a member of this run" in out["stranger"]
    assert f"refusing {k['donor'][:10]}: peer {k['donor'][:10]}'s RepoCommit is for another run" in out["liar"]
    assert "schema version None" in out["silent"]  # not a RepoCommit: told why
    why = dict(refusals)
    assert why[k["wrong"]] == f"peer {k['wrong'][:10]} runs commit dddddddddd, not {COMMIT[:10]}"
    assert "wrong signer" in why[k["impostor"]]
    assert why[k["stranger"]] == "not a member of this run"
    assert why[k["silent"]] == out["silent"]
    for n in ("wrong", "impostor", "silent", "stranger"):
        assert k[n] not in donor.check
    assert k["liar"] in donor.check  # its RepoCommit was good; it refused us, and asked nothing


def test_a_member_cannot_hold_more_than_a_few_connections_presenting_themselves() -> None:
    """Connections that never present a RepoCommit each wait HELLO_TIMEOUT at most, and a member
    holds at most MAX_PRESENTING of them at once: its next one is refused, not queued."""
    donor_key, member_key = NodeKey.generate(), NodeKey.generate()
    theta = np.arange(LAYOUT.size, dtype=np.float32)

    async def until(cond) -> None:
        for _ in range(500):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    async def main():
        donor_ep, donor = await _node(donor_key)
        donor.arm(PeerCheck(COMMIT, RUN), _rc(donor_key))
        donor.set_members({member_key.node_id})
        server = StateServer(allowed=lambda peer: peer in donor.members)
        server.publish(0, (theta,), checksum(theta), LAYOUT)
        serving = asyncio.ensure_future(donor_ep.serve({STATE_ALPN: donor.gate(server.handle, lambda p, why: None)}))
        member_ep, member = await _node(member_key)
        member.arm(PeerCheck(COMMIT, RUN), _rc(member_key))
        member.set_members({donor_key.node_id})
        idle = Endpoint(member_ep.ep, member_ep.mode)  # the same node, dialing without presenting itself

        async def fetch() -> str:
            got = np.zeros(LAYOUT.size, np.float32)
            try:
                await fetch_state(
                    member_ep, [donor_ep.ticket()], 0, checksum(theta), into_arrays(got), arrays=1, timeout=10
                )
            except StateError as e:
                return str(e)
            return "ok"

        try:
            held = [await idle.dial(donor_ep.ticket(), STATE_ALPN) for _ in range(MAX_PRESENTING)]
            await until(lambda: donor._presenting.get(member_key.node_id) == MAX_PRESENTING)
            refused = await fetch()
            for conn in held:
                conn.close(0, b"done")
            await until(lambda: not donor._presenting)
            return refused, await fetch()
        finally:
            serving.cancel()
            await member_ep.close()
            await donor_ep.close()

    refused, served = run_async(main(), 60)
    assert f"{MAX_PRESENTING} of its connections are presenting themselves already" in refused
    assert served == "ok"
