"""auth/ and drift/repo.py with real keys, real iroh endpoints and real git repos in temp dirs."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import iroh
import nacl.signing
import pytest
from conftest import drift_cmd, git, run_async

from drift.auth import (
    Admission,
    AuthError,
    KeyFileError,
    NodeKey,
    load_key,
    load_or_create_key,
    parse_allowlist,
    sign_message,
    verify_message,
)
from drift.auth.keys import create_key
from drift.repo import RepoCache, RepoError, is_commit_id, resolve_commit
from drift.transport import Endpoint

COMMIT, TREE = "c" * 40, "7" * 40


# --- keys ----------------------------------------------------------------------------------------


def test_iroh_secret_key_is_the_ed25519_seed_and_node_id_the_verify_key() -> None:
    key = NodeKey.generate()
    sk = iroh.SecretKey.from_bytes(key.seed)
    assert sk.to_bytes() == key.seed
    vk = nacl.signing.SigningKey(key.seed).verify_key
    assert sk.public().to_bytes() == bytes(vk)
    assert str(sk.public()) == key.node_id == bytes(vk).hex()
    # iroh's own signature verifies with PyNaCl under the node id, and ours with iroh.
    vk.verify(b"hello", sk.sign(b"hello").to_bytes())
    sig = bytes.fromhex(key.sign(b"hello"))
    sk.public().verify(b"hello", iroh.Signature.from_bytes(sig))

    async def bound_id() -> str:
        ep = await Endpoint.bind("local", secret_key=key.seed)
        try:
            return ep.node_id
        finally:
            await ep.close()

    assert run_async(bound_id()) == key.node_id  # the id peers see on every connection


def test_key_file_created_private_atomically_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "home" / "node.key"
    old = os.umask(0)  # even with a permissive umask the file is 0600 from the start
    try:
        key = load_or_create_key(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_or_create_key(path).node_id == key.node_id == load_key(path).node_id
    assert create_key(path).node_id == key.node_id  # an existing key is never replaced
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temp file left behind
    assert key.seed.hex() not in repr(key)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_key_readable_by_others_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "node.key"
    load_or_create_key(path)
    path.chmod(mode)
    with pytest.raises(KeyFileError) as e:
        load_or_create_key(path)
    assert f"mode {mode:04o}" in str(e.value) and f"chmod 600 {path}" in str(e.value)


def test_malformed_key_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"not a key\n")
    os.close(fd)
    with pytest.raises(KeyFileError, match="not a drift key file"):
        load_key(path)
    with pytest.raises(KeyFileError, match="not found"):
        load_key(tmp_path / "missing.key")


@pytest.mark.swarm
def test_cli_id_prints_the_node_id_and_refuses_loose_keys(tmp_path: Path) -> None:
    path = tmp_path / "k" / "node.key"
    out = subprocess.run(drift_cmd("id", "--key", str(path)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == load_key(path).node_id
    env = {**os.environ, "DRIFT_HOME": str(tmp_path / "home")}
    out = subprocess.run(drift_cmd("id", "--coord"), capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == load_key(tmp_path / "home" / "coord.key").node_id
    path.chmod(0o644)
    out = subprocess.run(drift_cmd("id", "--key", str(path)), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"drift: error: key file {path} is readable by other users (mode 0644); fix with: chmod 600 {path}"
    ]


# --- signatures and admission --------------------------------------------------------------------


def _rc(key: NodeKey, **over) -> dict:
    body = dict(
        type="RepoCommit",
        repo="r",
        commit=COMMIT,
        tree=TREE,
        node_id=key.node_id,
        timestamp=time.time(),
        nonce=os.urandom(16).hex(),
        signature="",
        param_checksum="p",
        n_train=10,
        run_id="run1",
    )
    body.update(over)
    return sign_message(key, body)


def _admission(**kw) -> Admission:
    return Admission(**{"commit": COMMIT, "run_id": "run1", "tree": TREE, **kw})


def test_signature_covers_every_field() -> None:
    key = NodeKey.generate()
    msg = _rc(key)
    verify_message(msg)
    for field, value in [("commit", "d" * 40), ("param_checksum", "q"), ("timestamp", 1.0), ("type", "X")]:
        with pytest.raises(AuthError, match="bad signature"):
            verify_message({**msg, field: value})
    with pytest.raises(AuthError, match="not signed"):
        verify_message({**msg, "signature": ""})
    with pytest.raises(AuthError, match="refusing to sign"):
        sign_message(key, {**msg, "node_id": NodeKey.generate().node_id})


def test_admission_accepts_a_good_repo_commit() -> None:
    key, adm = NodeKey.generate(), _admission()
    msg = _rc(key)
    assert adm.verify(msg, key.node_id) == msg
    assert adm.signatures([key.node_id], 1) == [msg]


def test_training_ready_s_signatures_skip_a_member_refused_since() -> None:
    # A member that reconnected with a bad RepoCommit before its drop was handled has no verified
    # one: TrainingReady carries the next member's (it raised KeyError and ended the run).
    a, b, c = (NodeKey.generate() for _ in range(3))
    adm = _admission()
    for k in (a, b, c):
        adm.verify(_rc(k), k.node_id)
    adm.refuse(a.node_id, "a bad RepoCommit")
    assert [s["node_id"] for s in adm.signatures([a.node_id, b.node_id, c.node_id], 1)] == [b.node_id]


def test_admission_refusals_say_why() -> None:
    key, other = NodeKey.generate(), NodeKey.generate()
    adm = _admission()
    now = time.time()
    forged = {**_rc(key), "commit": COMMIT, "n_train": 11}
    cases = [
        (forged, key, "bad signature"),
        ({**_rc(key), "signature": "00" * 64}, key, "bad signature"),
        (_rc(other), key, "wrong signer"),  # another node's message
        (_rc(key, timestamp=now - 3600), key, "stale RepoCommit"),
        (_rc(key, timestamp=now + 3600), key, "in the future"),
        (_rc(key, commit="d" * 40), key, "wrong commit"),
        (_rc(key, tree="8" * 40), key, "wrong tree"),
        (_rc(key, run_id="run0"), key, "not this run"),
        ({**_rc(key), "signature": ""}, key, "not signed"),
        ({k: v for k, v in _rc(key).items() if k != "nonce"}, key, "lacks nonce"),
    ]
    for msg, peer, needle in cases:
        with pytest.raises(AuthError, match=needle):
            adm.verify(msg, peer.node_id, now=now)
    assert adm.verified == {}


def test_replayed_repo_commit_is_refused() -> None:
    key, adm = NodeKey.generate(), _admission()
    msg = _rc(key)
    adm.verify(msg, key.node_id)
    with pytest.raises(AuthError, match="replayed RepoCommit"):
        adm.verify(dict(msg), key.node_id)
    # A refused (wrong-commit) message cannot be replayed into another error either.
    bad = _rc(key, commit="d" * 40)
    with pytest.raises(AuthError, match="wrong commit"):
        adm.verify(bad, key.node_id)
    with pytest.raises(AuthError, match="replayed"):
        adm.verify(bad, key.node_id)


def test_allowlist_and_threshold() -> None:
    a, b, c = (NodeKey.generate() for _ in range(3))
    ids = parse_allowlist(f"# the lab\n{a.node_id}  alice's laptop\n\n{b.node_id} # bob\n{c.node_id.upper()}\n")
    assert ids == {a.node_id, b.node_id, c.node_id}
    with pytest.raises(AuthError, match="entry 2: 'nope' is not a node id"):
        parse_allowlist([a.node_id, "nope"])
    adm = _admission(allowlist=ids, threshold=2)
    stranger = NodeKey.generate()
    with pytest.raises(AuthError, match=f"node {stranger.node_id} is not on this swarm's allowlist"):
        adm.check_allowed(stranger.node_id)
    adm.check_allowed(a.node_id)
    adm.refuse(a.node_id, "wrong commit")
    assert adm.unreachable() is None  # b and c can still make 2
    adm.refuse(b.node_id, "stale")
    why = adm.unreachable()
    assert why and "auth_threshold 2 can no longer be met: 2 of the 3 allowlisted nodes were refused" in why
    assert _admission(threshold=5).unreachable() is None  # an open swarm can always gain nodes
    adm.refuse(stranger.node_id, "unknown")  # strangers are not remembered
    assert stranger.node_id not in adm.refused
    assert (
        "can never be met: the allowlist names only 3 node(s)" in _admission(allowlist=ids, threshold=4).unreachable()
    )


# --- the repo cache ------------------------------------------------------------------------------


def _repo(path: Path) -> tuple[Path, str]:
    path.mkdir(parents=True)
    (path / "task.py").write_text("X = 1\n")
    (path / "sub").mkdir()
    (path / "sub" / "other.py").write_text("Y = 2\n")
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "one")
    return path, git(path, "rev-parse", "HEAD")


def test_checkout_of_a_pinned_commit_fetches_what_is_new(tmp_path: Path) -> None:
    src, first = _repo(tmp_path / "src")
    cache = RepoCache(str(src), tmp_path / "cache")
    work = cache.checkout(first)
    assert (work / "task.py").read_text() == "X = 1\n" and work.name == first
    assert cache.task_path(work, "sub/other.py") == (work / "sub" / "other.py").resolve()
    (src / "task.py").write_text("X = 2\n")
    git(src, "commit", "-qam", "two")
    second = git(src, "rev-parse", "HEAD")
    work2 = cache.checkout(second)  # not in the mirror yet: fetched
    assert (work2 / "task.py").read_text() == "X = 2\n"
    assert (work / "task.py").read_text() == "X = 1\n"  # each commit keeps its own checkout
    assert cache.tree(work2) == git(src, "rev-parse", "HEAD^{tree}")
    assert resolve_commit(src, "main") == second and resolve_commit(src, second[:8]) == second
    # A file:// URL goes through the same path as any remote.
    assert RepoCache(f"file://{src}", tmp_path / "cache2").checkout(first).is_dir()


def test_unreachable_commit_is_refused(tmp_path: Path) -> None:
    src, first = _repo(tmp_path / "src")
    (src / "task.py").write_text("EVIL = 1\n")
    git(src, "commit", "-qam", "dangling")
    dangling = git(src, "rev-parse", "HEAD")
    git(src, "reset", "-q", "--hard", first)  # the object exists, no branch or tag holds it
    cache = RepoCache(str(src), tmp_path / "cache")
    for commit in (dangling, "0" * 40):
        with pytest.raises(RepoError, match=f"commit {commit[:12]} is not reachable from any branch or tag"):
            cache.checkout(commit)
    with pytest.raises(RepoError, match="not a full commit id"):
        cache.checkout("main")
    assert is_commit_id(first) and not is_commit_id(first[:12])


def test_dirty_checkout_is_refused(tmp_path: Path) -> None:
    src, first = _repo(tmp_path / "src")
    cache = RepoCache(str(src), tmp_path / "cache")
    work = cache.checkout(first)
    (work / "__pycache__").mkdir()
    (work / "__pycache__" / "task.cpython-312.pyc").write_bytes(b"\0")  # importing the task does this
    assert cache.checkout(first) == work
    (work / "task.py").write_text("X = 'patched'\n")
    with pytest.raises(RepoError, match=r"has uncommitted changes \(task.py\).*delete that directory"):
        cache.checkout(first)
    git(work, "checkout", "--", "task.py")
    (work / "sneaky.py").write_text("import os\n")
    with pytest.raises(RepoError, match=r"sneaky\.py"):
        cache.checkout(first)


def test_repo_must_be_git_and_task_must_stay_inside(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(RepoError, match="not a git repository"):
        RepoCache(str(tmp_path / "plain"), tmp_path / "cache")
    with pytest.raises(RepoError, match="no such directory"):
        RepoCache(str(tmp_path / "nope"), tmp_path / "cache")
    with pytest.raises(RepoError, match="cannot clone"):
        RepoCache(f"file://{tmp_path}/nope", tmp_path / "cache").fetch()
    src, _first = _repo(tmp_path / "src")
    os.symlink("/etc/passwd", src / "link.py")
    git(src, "add", "link.py")
    git(src, "commit", "-qm", "link")
    cache = RepoCache(str(src), tmp_path / "cache")
    work = cache.checkout(git(src, "rev-parse", "HEAD"))
    for task in ("../../x.py", "link.py"):
        with pytest.raises(RepoError, match="outside the checkout"):
            cache.task_path(work, task)


# --- the coordinator's side of the CLI -----------------------------------------------------------


def _coord_error(recipe: Path, tmp_path: Path) -> str:
    env = {**os.environ, "DRIFT_HOME": str(tmp_path / "home")}
    out = subprocess.run(
        drift_cmd("coord", str(recipe), "--run-dir", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drift: error: "), out.stderr
    return lines[0]


@pytest.mark.swarm
def test_coord_refuses_unpinnable_code_and_bad_allowlists(tmp_path: Path) -> None:
    import shutil

    import yaml
    from conftest import ROOT, make_task_repo

    recipe = make_task_repo(tmp_path / "repo")
    data = yaml.safe_load(recipe.read_text())

    def write(**over) -> Path:
        recipe.write_text(yaml.safe_dump({**data, **over}))
        return recipe

    assert "commit: commit 'no-such-branch' is not in the repository" in _coord_error(
        write(commit="no-such-branch"), tmp_path
    )
    (recipe.parent / "allow.txt").write_text(f"{NodeKey.generate().node_id} ok\nbogus line\n")
    line = _coord_error(write(allowlist="allow.txt"), tmp_path)
    assert "allow.txt, entry 2: 'bogus' is not a node id" in line
    line = _coord_error(write(allowlist=[NodeKey.generate().node_id], auth_threshold=2), tmp_path)
    assert "auth_threshold 2 can never be met: the allowlist names only 1 node(s)" in line
    plain = tmp_path / "plain"
    (plain / "recipes").mkdir(parents=True)
    shutil.copy(ROOT / "recipes" / "shakespeare_char.py", plain / "recipes")
    (plain / "tiny.yaml").write_text(yaml.safe_dump(data))  # outside git, the root is the recipe's dir
    assert "is not a git repository and the recipe pins no commit" in _coord_error(plain / "tiny.yaml", tmp_path)
