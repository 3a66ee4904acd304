"""`drift join --repo URL_OR_PATH`: the only place a node's task code comes from.

A node keeps, per repo, a bare clone (fetched with GitPython) and one checkout per commit:

    CACHE/<repo-key>/mirror.git          branches and tags of the repo, nothing else
    CACHE/<repo-key>/<commit>/           a detached worktree at exactly that commit

``RepoCache.checkout(commit)`` refuses a commit that is not reachable from one of the repo's
branches or tags (so nobody can make a node run a dangling object or a stranger's pull-request
ref), and a checkout with uncommitted changes. The task is imported from that checkout only.
Several nodes on one machine may share a cache: a file lock serialises fetch and checkout.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import git

from drift.auth import drift_home
from drift.protocol import printable

FETCH_TIMEOUT = 600  # seconds a clone or fetch may take before it is killed
_COMMIT_RE = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
SAFE_SCHEMES = ("https", "http", "ssh", "git", "file")  # ext:: and fd:: (remote helpers) run commands
_GIT_ENV = {
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_ASKPASS": "",
    "SSH_ASKPASS": "",
    "GIT_LFS_SKIP_SMUDGE": "1",
    "GIT_ALLOW_PROTOCOL": ":".join(SAFE_SCHEMES),  # git itself refuses the others, submodules too
}
_TRANSPORT = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)(::|://)")


class RepoError(Exception):
    """The repo, commit or checkout cannot be used; str() is the one line shown to the operator."""


def is_commit_id(s: str | None) -> bool:
    return bool(s) and bool(_COMMIT_RE.match(s))  # type: ignore[arg-type]


def default_cache_dir() -> Path:
    return drift_home() / "repos"


def _git_error(e: git.GitCommandError) -> str:
    lines = [ln.strip() for ln in str(e.stderr or "").splitlines() if ln.strip()]
    lines = [ln.removeprefix("stderr: ") for ln in lines]
    return (lines[-1].strip("'") if lines else str(e)).strip()


def _bytecode(path: str) -> bool:
    return "__pycache__/" in path or path.endswith((".pyc", ".pyo"))


def dirty_files(work_tree: Path) -> list[str]:
    """Tracked files changed (staged or not) and untracked files, Python bytecode excepted
    (importing the task writes __pycache__ next to it)."""
    repo = git.Repo(work_tree)
    out = repo.git.status("--porcelain", "--untracked-files=all", "--ignored=no")
    paths = [ln[3:] for ln in out.splitlines() if len(ln) > 3]
    return [p for p in paths if not _bytecode(p.strip('"'))]


def resolve_commit(root: Path, rev: str) -> str:
    """The full commit id `rev` names in the repo at `root` (a branch, tag, short or full id)."""
    try:
        return git.Repo(root, search_parent_directories=True).commit(rev).hexsha
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise RepoError(f"{root} is not in a git repository, so commit {rev!r} cannot be resolved") from None
    except (git.BadName, ValueError, git.GitCommandError):
        raise RepoError(f"commit {rev!r} is not in the repository at {root}") from None


def tree_of(root: Path, commit: str) -> str | None:
    """The tree id of `commit` in the repo at `root`, or None when that repo lacks it."""
    try:
        return git.Repo(root, search_parent_directories=True).commit(commit).tree.hexsha
    except Exception:
        return None


def check_source(src: str) -> None:
    """RepoError unless `src` is a path or a URL git fetches without running anything: no
    `transport::address` remote helper (``ext::sh -c ...`` runs a command), no scheme but
    SAFE_SCHEMES, nothing git could read as an option."""
    shown = printable(src, 60)
    if src.startswith("-"):
        raise RepoError(f"--repo {shown}: a repo cannot start with '-' (git would read it as an option)")
    m = _TRANSPORT.match(src)
    if m and (m.group(2) == "::" or m.group(1).lower() not in SAFE_SCHEMES):
        raise RepoError(
            f"--repo {shown}: the {m.group(1)}{m.group(2)} transport is refused "
            f"(drift fetches only over {', '.join(SAFE_SCHEMES)}, or from a local path)"
        )


class RepoCache:
    """Bare clone + per-commit checkouts of one repo, under `cache_dir`."""

    def __init__(self, source: str | Path, cache_dir: str | Path | None = None):
        src = str(source)
        check_source(src)
        local = Path(src).expanduser()
        if "://" not in src and not re.match(r"^[\w.-]+@[\w.-]+:", src):  # a path, not a URL
            if not local.is_dir():
                raise RepoError(f"--repo {src}: no such directory (give a path to a git repo, or its URL)")
            try:
                git.Repo(local)
            except (git.InvalidGitRepositoryError, git.NoSuchPathError):
                raise RepoError(
                    f"--repo {src}: not a git repository (drift runs only committed code; "
                    f"`git init && git commit` it, or give the repo's URL)"
                ) from None
            src = str(local.resolve())
        self.source = src
        # Absolute: git runs the worktree commands inside the mirror, where a relative path would land.
        base = Path(cache_dir).expanduser().resolve() if cache_dir else default_cache_dir()
        name = re.sub(r"[^\w.-]", "_", src.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git"))[:40] or "repo"
        self.root = base / f"{name}-{hashlib.sha256(src.encode()).hexdigest()[:12]}"
        self.mirror_dir = self.root / "mirror.git"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # checkouts are private
        self.root.mkdir(mode=0o700, exist_ok=True)
        with open(self.root.parent / f"{self.root.name}.lock", "a") as fh:
            try:
                import fcntl

                fcntl.flock(fh, fcntl.LOCK_EX)
            except ImportError:  # no fcntl (Windows): one node per cache
                pass
            yield

    def _mirror(self) -> git.Repo:
        if (self.mirror_dir / "HEAD").exists():
            repo = git.Repo(self.mirror_dir)
        else:
            tmp = self.root / f"mirror.{os.getpid()}.tmp"
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
            try:
                git.Repo.clone_from(self.source, tmp, bare=True, env=_GIT_ENV, kill_after_timeout=FETCH_TIMEOUT)
            except git.GitCommandError as e:
                raise RepoError(f"cannot clone --repo {self.source}: {_git_error(e)}") from None
            os.replace(tmp, self.mirror_dir)
            repo = git.Repo(self.mirror_dir)
        repo.git.update_environment(**_GIT_ENV)
        return repo

    def fetch(self) -> git.Repo:
        """Clone on first use, else fetch every branch and tag; returns the bare repo."""
        with self._locked():
            return self._fetch()

    def _fetch(self) -> git.Repo:
        fresh = not (self.mirror_dir / "HEAD").exists()
        repo = self._mirror()
        if not fresh:
            try:
                repo.git.fetch(
                    "--prune",
                    "--force",
                    self.source,
                    "+refs/heads/*:refs/heads/*",
                    "+refs/tags/*:refs/tags/*",
                    kill_after_timeout=FETCH_TIMEOUT,
                )
            except git.GitCommandError as e:
                raise RepoError(f"cannot fetch --repo {self.source}: {_git_error(e)}") from None
        return repo

    def _reachable(self, repo: git.Repo, commit: str) -> bool:
        try:
            if repo.git.cat_file("-t", commit) != "commit":
                return False
            return bool(repo.git.for_each_ref("--contains", commit, "--count=1", "refs/heads", "refs/tags"))
        except git.GitCommandError:
            return False

    def checkout(self, commit: str) -> Path:
        """A clean checkout of `commit` (full id), fetched if needed; RepoError if impossible."""
        if not is_commit_id(commit):
            named = f"{commit!r}, not a full commit id" if commit else "no commit"
            raise RepoError(f"the coordinator named {named}; drift runs only code pinned to one commit")
        with self._locked():
            repo = self._mirror()
            if not self._reachable(repo, commit):
                repo = self._fetch()
                if not self._reachable(repo, commit):
                    raise RepoError(
                        f"commit {commit[:12]} is not reachable from any branch or tag of "
                        f"--repo {self.source}: push it there, or check that --repo names "
                        f"the coordinator's repo"
                    )
            work = self.root / commit
            if not work.exists():
                repo.git.worktree("prune")
                try:
                    repo.git.worktree("add", "--detach", str(work), commit)
                except git.GitCommandError as e:
                    raise RepoError(f"cannot check out {commit[:12]} into {work}: {_git_error(e)}") from None
            return self.verify_checkout(work, commit)

    @staticmethod
    def verify_checkout(work: Path, commit: str) -> Path:
        """`work` must be a checkout of exactly `commit` with no uncommitted changes."""
        try:
            head = git.Repo(work).head.commit.hexsha
        except Exception:
            raise RepoError(f"checkout {work} is broken; delete it and join again") from None
        if head != commit:
            raise RepoError(f"checkout {work} is at {head[:12]}, not {commit[:12]}; delete it and join again")
        dirty = dirty_files(work)
        if dirty:
            more = f" (and {len(dirty) - 1} more)" if len(dirty) > 1 else ""
            raise RepoError(
                f"checkout {work} has uncommitted changes ({dirty[0]}{more}); drift runs only "
                f"clean commits: delete that directory and join again"
            )
        return work

    def tree(self, work: Path) -> str:
        return git.Repo(work).head.commit.tree.hexsha

    def task_path(self, work: Path, task: str) -> Path:
        """The task file inside the checkout; refuses paths that leave it (.., symlinks)."""
        p = (work / task).resolve()
        if not p.is_relative_to(work.resolve()):
            raise RepoError(f"task {task!r} points outside the checkout {work}")
        if not p.is_file():
            raise RepoError(f"task file {task} not found in {self.source} at commit {work.name[:12]}")
        return p
