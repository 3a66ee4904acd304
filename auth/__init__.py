"""Identity and trust: Ed25519 keys, signed RepoCommit, admission (allowlist, replay protection).

Nothing here imports ``drift`` (nor ``workers``): messages are handled as plain dicts, so the
swarm's protocol can change without this package knowing about it.
"""

from __future__ import annotations


class AuthError(Exception):
    """Something failed a trust check; str() is the one line shown on both sides."""


from .admission import Admission, PeerCheck, ReplayGuard, parse_allowlist, verify_peers  # noqa: E402
from .keys import (  # noqa: E402
    KeyFileError,
    KeyInUse,
    KeyLock,
    NodeKey,
    default_key_path,
    drift_home,
    load_key,
    load_or_create_key,
    parse_node_id,
)
from .repo_commit import sign_message, verify_message, verify_signature  # noqa: E402

__all__ = [
    "Admission",
    "AuthError",
    "KeyFileError",
    "KeyInUse",
    "KeyLock",
    "NodeKey",
    "PeerCheck",
    "ReplayGuard",
    "default_key_path",
    "drift_home",
    "load_key",
    "load_or_create_key",
    "parse_allowlist",
    "parse_node_id",
    "sign_message",
    "verify_message",
    "verify_peers",
    "verify_signature",
]
