"""Who a node talks to: the run's members (the coordinator's word, TrainingReady), each verified by
the node itself before a byte of ring, gather, state or data passes between them.

Every connection a node opens to a peer (not to the coordinator) starts with one stream on which
the dialer presents its signed RepoCommit and the acceptor answers with its own, or with a
TrainingCancel saying why it refuses. Each side checks the other's (auth.PeerCheck: signed by the
key of the node on the other end, this run's commit and run id, allowlisted if there is a list)
and keeps what verified, so the signature of a peer is checked once per session; only then does
the connection carry its ALPN's protocol. So the coordinator's TrainingReady carries the member
ids and auth_threshold's few RepoCommits, not every member's to every member (N² signatures from
its uplink: 770 MB at 1,000 nodes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import iroh

from drift import protocol as P
from drift.auth import AuthError, PeerCheck
from drift.protocol import ProtocolError, printable
from drift.transport import DropFn, Endpoint, Handler, TransportError, close_conn, peer_of

log = logging.getLogger("drift.peers")

HELLO_TIMEOUT = 15.0  # each step of the exchange: open or accept its stream, one frame each way
TOLD_TIMEOUT = 5.0  # how long a refused peer has to read why before the connection closes
MAX_HELLO = 64 << 10  # a RepoCommit is ~770 bytes; its repo may be a path of MAX_PATH characters
MAX_PRESENTING = 8  # a member's connections presenting themselves at once (a node opens ~4); more are refused
NOT_MEMBER = "not a member of this run"


class Peers:
    """This node's members and the peers among them it verified; `present` (dialing) and `gate`
    (accepting) hold every connection to a peer until both sides have checked each other."""

    def __init__(self) -> None:
        self.members: set[str] = set()  # the run's members but this node (TrainingReady)
        self.coordinator = ""  # trusted by its ticket: no RepoCommit either way
        self.check: PeerCheck | None = None  # None until this node has its own RepoCommit
        self._own = b""  # this session's signed RepoCommit, encoded
        self._presenting: dict[str, int] = {}  # member -> its connections in _welcome now

    def arm(self, check: PeerCheck, own: P.RepoCommit) -> None:
        """Present `own` from now on; keep what `check` already verified if it is for the same run."""
        old = self.check
        if old is not None and (old.commit, old.run_id, old.allowlist) == (check.commit, check.run_id, check.allowlist):
            check.verified = old.verified
        self.check, self._own = check, P.encode(own)

    def set_members(self, ids: Iterable[str]) -> None:
        """The run's members are now `ids` (this node's own id excluded); the others are forgotten."""
        self.members = set(ids)
        if self.check is not None:
            self.check.retain(self.members)

    def _verify(self, frame: bytes, peer: str) -> None:
        """Check a frame that should be `peer`'s signed RepoCommit; AuthError or ProtocolError."""
        msg = P.decode(frame)
        if not isinstance(msg, P.RepoCommit):
            raise ProtocolError(f"sent {msg.type} where its signed RepoCommit belongs")
        if self.check is None:
            raise AuthError("this node has not loaded the run yet")
        self.check.check(msg.model_dump(mode="json"), peer)

    # --- dialing ---------------------------------------------------------------------------------

    async def present(self, conn: iroh.Connection) -> None:
        """Endpoint.vet for a node: on a connection it opened, present our RepoCommit and check the
        peer's answer. TransportError if the peer is not a member, refuses us, or fails our check."""
        peer = peer_of(conn)
        if peer == self.coordinator:
            return
        if peer not in self.members:
            raise TransportError(f"{peer[:10]} is {NOT_MEMBER}")
        if self.check is None:
            raise TransportError("this node has no signed RepoCommit to present yet")
        ch = await Endpoint.open_channel(conn, HELLO_TIMEOUT)
        try:
            await ch.send_frame(self._own, HELLO_TIMEOUT)
            frame = await ch.recv_frame(MAX_HELLO, HELLO_TIMEOUT)
        except TransportError:
            if why := ch.close_reason():  # it hung up before our RepoCommit was read: it said why
                raise TransportError(f"{peer[:10]} refused this node: {why}") from None
            raise
        try:
            answer = P.decode(frame)
            if isinstance(answer, P.TrainingCancel):
                raise TransportError(f"{peer[:10]} refused this node: {answer.reason}")
            self._verify(frame, peer)
        except (AuthError, ProtocolError) as e:
            raise TransportError(f"refusing {peer[:10]}: {printable(e, 300)}") from None
        await ch.finish()

    # --- accepting -------------------------------------------------------------------------------

    def gate(self, handler: Handler, on_refused: DropFn) -> Handler:
        """`handler` for connections from the coordinator, and from members once they presented a
        RepoCommit that verifies (answered with ours); anyone else is refused with a reason, before
        the handler reads a byte (`on_refused(peer, why)`: a throttled log line)."""

        async def gated(conn: iroh.Connection) -> None:
            peer = peer_of(conn)
            if peer != self.coordinator:
                why = await self._welcome(conn, peer)
                if why is not None:
                    on_refused(peer, why)
                    close_conn(conn, why)
                    return
            await handler(conn)

        return gated

    async def _welcome(self, conn: iroh.Connection, peer: str) -> str | None:
        """Take the RepoCommit `peer` presents and answer ours, or say why not (after telling it)."""
        if peer not in self.members:
            return NOT_MEMBER
        if self._presenting.get(peer, 0) >= MAX_PRESENTING:  # (each waits HELLO_TIMEOUT at most)
            return f"{MAX_PRESENTING} of its connections are presenting themselves already"
        self._presenting[peer] = self._presenting.get(peer, 0) + 1
        try:
            return await self._exchange(conn, peer)
        finally:
            if (left := self._presenting.pop(peer) - 1) > 0:
                self._presenting[peer] = left

    async def _exchange(self, conn: iroh.Connection, peer: str) -> str | None:
        try:
            ch = await Endpoint.accept_channel(conn, HELLO_TIMEOUT)
            frame = await ch.recv_frame(MAX_HELLO, HELLO_TIMEOUT)
        except TransportError as e:
            return f"no RepoCommit presented ({printable(e, 200)})"
        try:
            self._verify(frame, peer)
        except (AuthError, ProtocolError) as e:
            why = printable(e, 300)
            try:  # tell it why; its hang-up (or the timeout) says it read it
                await ch.send_frame(P.encode(P.TrainingCancel(reason=why)), HELLO_TIMEOUT)
                await ch.finish()
                await asyncio.wait_for(conn.closed(), TOLD_TIMEOUT)
            except Exception:
                pass
            return why
        try:
            await ch.send_frame(self._own, HELLO_TIMEOUT)
            await ch.finish()
        except TransportError as e:
            return f"gone before our RepoCommit reached it ({printable(e, 200)})"
        return None
