"""Ed25519 node keys: one key file per node and per coordinator.

The 32-byte Ed25519 seed in the key file is at once
  * the iroh secret key (``EndpointOptions(secret_key=seed)``), so the node id the swarm sees on
    every connection *is* the public key, and
  * the PyNaCl signing key that signs this node's RepoCommit.
iroh's ``SecretKey.to_bytes()`` is that seed and ``EndpointId.to_bytes()`` the Ed25519 verify key
(tests/test_auth.py checks both), so a node id printed as 64 hex characters is a verify key.

Key files are created on first use with mode 0600 from the start (never chmod-ed afterwards),
written atomically and never overwritten; a key file that other users can read is refused.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

import nacl.exceptions
import nacl.signing

from . import AuthError

KEY_HEADER = "# drift key: an Ed25519 seed. Whoever holds this file can act as this node; keep it secret.\n"


class KeyFileError(AuthError):
    """A key file that cannot be used (missing, malformed, or readable by others)."""


def drift_home() -> Path:
    """Where drift keeps keys and caches: $DRIFT_HOME (made absolute), else ~/.drift."""
    env = os.environ.get("DRIFT_HOME")
    return Path(env).expanduser().resolve() if env else Path.home() / ".drift"


def default_key_path(kind: str = "node", device: str | None = None) -> Path:
    """~/.drift/node.key for `drift join`, ~/.drift/coord.key for `drift coord`.

    A node started with an explicit --device gets a key of its own for that device
    (~/.drift/node-cuda-1.key for cuda:1), so one machine can run a node per GPU with no key
    juggling: every node of a swarm needs its own identity."""
    if device and device != "auto":
        return drift_home() / f"{kind}-{re.sub(r'[^a-z0-9]+', '-', device.lower()).strip('-')}.key"
    return drift_home() / f"{kind}.key"


class KeyInUse(AuthError):
    """Another process on this machine runs with the same key file."""


class KeyLock:
    """Holds `<key>.lock` exclusively while this process runs with that key: two nodes with one
    identity would be one node to the swarm, so the second is refused at once with a way out."""

    def __init__(self, key_path: Path, what: str):
        self.path = key_path.with_name(key_path.name + ".lock")
        self._fh = None
        try:
            import fcntl
        except ImportError:  # no fcntl (Windows): the coordinator still refuses the duplicate
            return
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise KeyInUse(f"key file {key_path} is in use by {holder} on this machine; {what}") from None
        fh.truncate(0)
        fh.write(f"pid {os.getpid()}")
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def parse_node_id(text: str) -> str:
    """A node id as 64 lowercase hex characters, or AuthError saying what was given."""
    s = text.strip().lower()
    if len(s) != 64 or any(c not in "0123456789abcdef" for c in s):
        shown = s if len(s) <= 20 else s[:20] + "..."
        raise AuthError(f"{shown!r} is not a node id: expected the 64 hex characters `drift id` prints")
    return s


class NodeKey:
    """An Ed25519 key: node id (hex verify key), signing, and the seed iroh binds with."""

    def __init__(self, seed: bytes, path: Path | None = None):
        if len(seed) != 32:
            raise ValueError("an Ed25519 seed is 32 bytes")
        self.seed = bytes(seed)
        self.path = path
        self._sk = nacl.signing.SigningKey(self.seed)
        self.node_id = bytes(self._sk.verify_key).hex()

    @classmethod
    def generate(cls) -> NodeKey:
        return cls(secrets.token_bytes(32))

    def sign(self, data: bytes) -> str:
        """Detached Ed25519 signature of `data`, as 128 hex characters."""
        return self._sk.sign(data).signature.hex()

    def __repr__(self) -> str:  # never show the seed
        return f"NodeKey({self.node_id[:10]}..., {self.path})"


def verify_signature(node_id: str, data: bytes, signature: str) -> bool:
    """True when `signature` (hex) is node_id's Ed25519 signature of `data`."""
    try:
        vk = nacl.signing.VerifyKey(bytes.fromhex(node_id))
        vk.verify(data, bytes.fromhex(signature))
        return True
    except (ValueError, TypeError, nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError):
        return False


def _check_private(path: Path, st: os.stat_result) -> None:
    if os.name != "posix":
        return
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"key file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"key file {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"fix with: chmod 600 {path}"
        )
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise KeyFileError(
            f"key file {path} belongs to another user (uid {st.st_uid}); "
            f"fix with: chown {os.getuid()} {path} (or use your own --key)"
        )


def load_key(path: str | Path) -> NodeKey:
    """Read a key file, refusing one that other users can read."""
    p = Path(path).expanduser()
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise KeyFileError(f"key file {p} not found") from None
    except OSError as e:
        raise KeyFileError(f"cannot read key file {p}: {e.strerror}") from None
    try:
        _check_private(p, os.fstat(fd))
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    lines = [ln.strip() for ln in raw.decode("ascii", "replace").splitlines()]
    body = [ln for ln in lines if ln and not ln.startswith("#")]
    try:
        if len(body) != 1:
            raise ValueError
        return NodeKey(bytes.fromhex(body[0]), p)
    except ValueError:
        raise KeyFileError(
            f"{p} is not a drift key file (expected one line of 64 hex characters); "
            f"move it away and drift creates a new key there"
        ) from None


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def create_key(path: str | Path) -> NodeKey:
    """Write a fresh key to `path` (mode 0600 from the first byte; atomic; never overwrites).

    When another process creates the same file at the same moment, its key wins and is returned."""
    p = Path(path).expanduser()
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = NodeKey.generate()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (KEY_HEADER + key.seed.hex() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        try:
            os.link(tmp, p)  # atomic, and fails rather than replacing an existing key
        except FileExistsError:
            return load_key(p)
        except OSError:  # no hard links on this file system
            if p.exists():
                return load_key(p)
            os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(p.parent)
    return NodeKey(key.seed, p)


def load_or_create_key(path: str | Path) -> NodeKey:
    """The key in `path`, created there on first use."""
    p = Path(path).expanduser()
    if not p.exists() and not p.is_symlink():
        return create_key(p)
    return load_key(p)
