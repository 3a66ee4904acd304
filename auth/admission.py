"""Admission: who may join (allowlist), and whose RepoCommit the coordinator accepts.

The coordinator keeps one ``Admission`` per run. For each connecting node it checks, in order:
the allowlist (at connect, before anything else is read), then the node's signed RepoCommit:
  1. it is signed, by the very peer on the other end of this connection (signer == peer);
  2. the signature verifies;
  3. it is for this run (``run_id``), fresh (``|now - timestamp| <= window``), and its nonce was
     never seen before (replays refused);
  4. its commit is the run's commit (and its tree, when the coordinator knows it).
Each failure raises AuthError with the one line both sides show. ``PeerCheck`` is the node's side:
each peer's RepoCommit, from that peer itself, before they exchange a byte of training
(``verify_peers``: TrainingReady's member list and the few RepoCommits it carries).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from . import AuthError
from .keys import parse_node_id
from .repo_commit import verify_message

REPO_COMMIT_FIELDS = ("repo", "commit", "tree", "node_id", "timestamp", "nonce")
DEFAULT_WINDOW = 300.0  # seconds of clock skew + load time a RepoCommit may be off by


def _short(x: Any) -> str:
    return str(x)[:10] if x else str(x)


def parse_allowlist(entries: str | Iterable[str], source: str = "allowlist") -> frozenset[str]:
    """Node ids from an allowlist file's text (one id per line, ``#`` comments, anything after the
    id on a line is a free-form name) or from a list of ids. AuthError names the bad line."""
    lines = entries.splitlines() if isinstance(entries, str) else list(entries)
    ids = set()
    for i, line in enumerate(lines, 1):
        text = str(line).split("#", 1)[0].strip()
        if not text:
            continue
        try:
            ids.add(parse_node_id(text.split()[0]))
        except AuthError as e:
            raise AuthError(f"{source}, entry {i}: {e}") from None
    return frozenset(ids)


class ReplayGuard:
    """Nonces seen within the freshness window; older ones are refused as stale anyway."""

    def __init__(self, window: float = DEFAULT_WINDOW):
        self.window = window
        self._seen: dict[tuple[str, str], float] = {}

    def check(self, node_id: str, nonce: str, timestamp: float, now: float) -> None:
        """Record (node_id, nonce); AuthError when it was already used."""
        for k in [k for k, ts in self._seen.items() if ts < now - self.window]:
            del self._seen[k]
        if (node_id, nonce) in self._seen:
            raise AuthError(f"replayed RepoCommit from {node_id[:10]}: nonce {nonce[:12]} was already used")
        self._seen[(node_id, nonce)] = timestamp


@dataclass
class Admission:
    """The coordinator's trust policy for one run, and what it has verified so far."""

    commit: str | None
    run_id: str | None = None
    allowlist: frozenset[str] | None = None
    threshold: int = 1
    window: float = DEFAULT_WINDOW
    tree: str | None = None
    verified: dict[str, dict[str, Any]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.replay = ReplayGuard(self.window)

    # --- at connect ------------------------------------------------------------------------------

    def check_allowed(self, node_id: str) -> None:
        if self.allowlist is not None and node_id not in self.allowlist:
            raise AuthError(
                f"node {node_id} is not on this swarm's allowlist "
                f"(its operator can add the id `drift id` prints on that machine)"
            )

    # --- RepoCommit ------------------------------------------------------------------------------

    def verify(self, msg: dict[str, Any], peer_id: str, now: float | None = None) -> dict[str, Any]:
        """Check one signed RepoCommit received on a connection from `peer_id`; AuthError if bad."""
        now = time.time() if now is None else now
        missing = [f for f in REPO_COMMIT_FIELDS if f not in msg]
        if missing:
            raise AuthError(f"RepoCommit lacks {', '.join(missing)}")
        node_id = msg["node_id"]
        if node_id != peer_id:
            raise AuthError(
                f"wrong signer: RepoCommit is signed as node {_short(node_id)} but the "
                f"connection is from node {_short(peer_id)}; a node can only speak for itself"
            )
        verify_message(msg)
        if self.run_id is not None and msg.get("run_id") != self.run_id:
            raise AuthError(
                f"RepoCommit from {_short(node_id)} is for run {msg.get('run_id')!r}, "
                f"not this run {self.run_id!r} (replayed from another run?)"
            )
        ts = msg["timestamp"]
        if not isinstance(ts, (int, float)):
            raise AuthError("RepoCommit timestamp is not a number")
        age = now - ts
        if age > self.window:
            raise AuthError(
                f"stale RepoCommit from {_short(node_id)}: signed {age:.0f} s ago, the limit is "
                f"{self.window:.0f} s (a replay, or that machine's clock is wrong)"
            )
        if -age > self.window:
            raise AuthError(
                f"RepoCommit from {_short(node_id)} is dated {-age:.0f} s in the future, the limit "
                f"is {self.window:.0f} s (that machine's clock is wrong)"
            )
        nonce = msg["nonce"]
        if not isinstance(nonce, str) or len(nonce) < 16:
            raise AuthError("RepoCommit nonce must be a string of at least 16 characters")
        self.replay.check(node_id, nonce, float(ts), now)
        if msg["commit"] != self.commit:
            raise AuthError(
                f"wrong commit: node {_short(node_id)} runs {_short(msg['commit'])}, "
                f"this run needs {_short(self.commit)}"
            )
        if self.tree is not None and msg["tree"] != self.tree:
            raise AuthError(
                f"wrong tree: node {_short(node_id)} checked out tree {_short(msg['tree'])} of "
                f"commit {_short(self.commit)}, which has tree {_short(self.tree)}"
            )
        self.verified[node_id] = dict(msg)
        self.refused.pop(node_id, None)
        return msg

    def refuse(self, node_id: str, reason: str) -> None:
        """Record a refusal (of allowlisted nodes only: strangers could fill memory with new ids)."""
        self.verified.pop(node_id, None)
        if self.allowlist is not None and node_id in self.allowlist:
            self.refused[node_id] = reason

    def forget(self, node_id: str) -> None:
        """A verified node left before the run used it."""
        self.verified.pop(node_id, None)

    def unreachable(self) -> str | None:
        """Why auth_threshold can no longer be met, or None while it still can.

        Without an allowlist anyone may still join, so only a closed swarm can run out of nodes:
        when the allowlisted nodes not refused are fewer than the threshold."""
        if self.allowlist is None:
            return None
        left = [n for n in self.allowlist if n not in self.refused]
        if len(left) >= self.threshold:
            return None
        if not self.refused:
            return (
                f"auth_threshold {self.threshold} can never be met: the allowlist names only "
                f"{len(self.allowlist)} node(s)"
            )
        last = next(reversed(self.refused.values()))
        return (
            f"auth_threshold {self.threshold} can no longer be met: {len(self.allowlist) - len(left)} of "
            f"the {len(self.allowlist)} allowlisted nodes were refused (last: {last})"
        )

    def signatures(self, node_ids: Iterable[str], most: int) -> list[dict[str, Any]]:
        """The signed RepoCommits of the first `most` of these nodes still verified, for
        TrainingReady (auth_threshold's few; a member refused since, on a reconnect, has none)."""
        return list(itertools.islice((self.verified[n] for n in node_ids if n in self.verified), most))


@dataclass
class PeerCheck:
    """A node's check of the peers it talks to, each by its own signed RepoCommit: signed by the
    peer's key, for this run's commit and run id, on the allowlist if there is one. The node checks
    it itself, from the peer (on the first stream of each connection, drift/peers.py) or from
    TrainingReady's few; what verified is kept by node id, so each peer costs one check."""

    commit: str | None
    run_id: str | None = None
    allowlist: frozenset[str] | None = None
    verified: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> its RepoCommit

    def check(self, msg: dict[str, Any], peer_id: str) -> None:
        """Accept `msg` as the RepoCommit of `peer_id` (the node on the other end of a connection,
        or the id it names, from TrainingReady); AuthError says why not."""
        if self.verified.get(peer_id) == msg:
            return
        if not isinstance(msg, dict):
            raise AuthError("a peer RepoCommit that is not one")
        node_id = msg.get("node_id")
        if node_id != peer_id:
            raise AuthError(
                f"wrong signer: the RepoCommit is signed as node {_short(node_id)} but comes from "
                f"node {_short(peer_id)}; a node can only speak for itself"
            )
        verify_message(msg, "peer RepoCommit")
        if msg.get("commit") != self.commit:
            raise AuthError(
                f"peer {_short(node_id)} runs commit {_short(msg.get('commit'))}, not {_short(self.commit)}"
            )
        if self.run_id is not None and msg.get("run_id") != self.run_id:
            raise AuthError(f"peer {_short(node_id)}'s RepoCommit is for another run ({msg.get('run_id')!r})")
        if self.allowlist is not None and node_id not in self.allowlist:
            raise AuthError(f"peer {_short(node_id)} is not on the allowlist")
        self.verified[peer_id] = dict(msg)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.verified

    def retain(self, node_ids: Iterable[str]) -> None:
        """Forget every peer but these (the members: one who comes back presents itself again)."""
        keep = set(node_ids)
        for n in [n for n in self.verified if n not in keep]:
            del self.verified[n]


def verify_peers(
    signatures: list[dict[str, Any]],
    nodes: list[str],
    *,
    check: PeerCheck,
    me: str,
    threshold: int = 1,
) -> None:
    """A node's check of TrainingReady: the RepoCommits it carries pass `check` (and are kept
    there), every listed node is allowlisted (if there is an allowlist), and at least `threshold`
    listed nodes are verified: this node itself, those RepoCommits, and peers verified before.
    Every other member is verified when this node first talks to it (drift/peers.py)."""
    listed = set(nodes)
    for s in signatures:
        nid = s.get("node_id") if isinstance(s, dict) else None
        if nid not in listed:
            raise AuthError(f"TrainingReady carries the RepoCommit of node {_short(nid)}, which it does not list")
        check.check(s, nid)
    if check.allowlist is not None:
        outside = [n for n in nodes if n not in check.allowlist]
        if outside:
            raise AuthError(f"TrainingReady lists node {_short(outside[0])}, which is not on the allowlist")
    verified = len({n for n in listed if n == me or n in check})
    if verified < threshold:
        raise AuthError(f"only {verified} verified node(s), auth_threshold is {threshold}")
