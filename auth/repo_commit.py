"""Signing and verifying control messages as plain dicts (RepoCommit, in practice).

The signature covers every field of the message except ``signature`` itself, including its
``type``, serialised canonically (sorted keys, no spaces, ASCII, no NaN) after a domain prefix.
Signer and node are the same thing: the ``node_id`` field names the Ed25519 verify key, so a
message that verifies was signed by the holder of that node's key file.
"""

from __future__ import annotations

import json
from typing import Any

from . import AuthError
from .keys import NodeKey, verify_signature

DOMAIN = b"drift signed message v1\n"


def canonical(msg: dict[str, Any]) -> bytes:
    """The exact bytes a signature covers: every field but ``signature``, canonically encoded."""
    body = {k: v for k, v in msg.items() if k != "signature"}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise AuthError(f"message cannot be signed: {e}") from None
    return DOMAIN + text.encode()


def sign_message(key: NodeKey, msg: dict[str, Any]) -> dict[str, Any]:
    """`msg` (whose node_id must be this key's) with its ``signature`` filled in."""
    if msg.get("node_id") != key.node_id:
        raise AuthError(f"refusing to sign for node {str(msg.get('node_id'))[:10]}: this key is {key.node_id[:10]}")
    return {**msg, "signature": key.sign(canonical(msg))}


def verify_message(msg: dict[str, Any], what: str = "RepoCommit") -> None:
    """Raise AuthError unless ``msg`` carries a valid signature by its own ``node_id``."""
    node_id, sig = msg.get("node_id"), msg.get("signature")
    if not isinstance(node_id, str) or not node_id:
        raise AuthError(f"{what} names no node_id")
    if not isinstance(sig, str) or not sig:
        raise AuthError(f"{what} from {node_id[:10]} is not signed")
    if not verify_signature(node_id, canonical(msg), sig):
        raise AuthError(f"{what} from {node_id[:10]} has a bad signature (forged, or altered in transit)")
