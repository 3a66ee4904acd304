"""Task code and drift share one process, and may use the same top-level names.

drift's own packages are `drift.workers` and `drift.auth`, so they never clash with a user's
`workers/` or `auth/`. A task's checkout can still clash with a module the process already holds
from elsewhere (another checkout of the same repo, a `recipes` or `tests` of the running script).
Python keeps one module per name in sys.modules, so both cannot be `recipes` there. The rule here:

* For code whose file lies in a task's checkout, a top-level name the checkout defines *and* the
  process already holds from elsewhere (a clash) resolves to the checkout: `import recipes` there
  gets the checkout's `recipes`, loaded under a private name (`drift_task_<id>.recipes`), at load
  time and later (an import inside a function), with relative imports and submodules working.
  Everything else imports as usual (the checkout is first on sys.path), so names that do not
  clash keep their real module names (pickle, multiprocessing).

This is one `builtins.__import__` wrapper, installed once, that looks at the importing module's
file; drift's own code (and every library) imports exactly as before. Known edge:
`importlib.import_module("recipes")` called from task code bypasses `__import__` and gets the
process's.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field

_real_import = builtins.__import__


@dataclass
class _Area:
    root: str  # the checkout (resolved), with a trailing separator
    dirs: list[str]  # where its top-level names live: the task's directory, then the checkout
    prefix: str  # the private package its clashing names live under
    names: frozenset[str] = field(default_factory=frozenset)


_areas: dict[str, _Area] = {}  # prefix -> area
_file_area: dict[str, _Area | None] = {}  # importing file -> its area (a cache)


def top_level_names(d: str) -> set[str]:
    """The module and package names a directory defines at its top level."""
    names = set()
    try:
        entries = list(os.scandir(d))
    except OSError:
        return names
    for e in entries:
        if e.is_file() and e.name.endswith(".py"):
            names.add(e.name[:-3])
        elif e.is_dir() and e.name.isidentifier():
            try:
                if any(f.endswith(".py") for f in os.listdir(e.path)):
                    names.add(e.name)
            except OSError:
                pass
    return {n for n in names if n.isidentifier()}


def _from_elsewhere(name: str, root: str) -> bool:
    """The process already holds a module `name` that is not the checkout's."""
    m = sys.modules.get(name)
    if m is None:
        return False
    f = getattr(m, "__file__", None)
    paths = [f] if f else list(getattr(m, "__path__", []) or [])
    return not any(os.path.realpath(p).startswith(root) for p in paths)


def isolate(root: str | os.PathLike, *dirs: str | os.PathLike) -> frozenset[str]:
    """Make code under `root` (a task's checkout) import its own top-level names where they clash
    with modules this process already holds; `dirs` (default: root) are where those names live,
    first wins. Returns the clashing names. Idempotent per root."""
    real = os.path.realpath(root)
    look = [os.path.realpath(d) for d in (dirs or (root,))]
    prefix = "drift_task_" + hashlib.sha256(real.encode()).hexdigest()[:12]
    area = _Area(real.rstrip(os.sep) + os.sep, look, prefix)
    defined = set().union(*(top_level_names(d) for d in look))
    area.names = frozenset(n for n in defined if _from_elsewhere(n, area.root))
    if area.names:
        if prefix not in sys.modules:
            pkg = types.ModuleType(prefix, "The clashing top-level packages of one task checkout.")
            pkg.__path__ = []
            sys.modules[prefix] = pkg
        _areas[prefix] = area
        _file_area.clear()
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
        if builtins.__import__ is not _import:
            builtins.__import__ = _import
    return area.names


def _area_of(globals_: dict) -> _Area | None:
    f = globals_.get("__file__")
    if not f or not _areas:
        return None
    try:
        return _file_area[f]
    except KeyError:
        pass
    real = os.path.realpath(f)
    area = next((a for a in _areas.values() if real.startswith(a.root)), None)
    _file_area[f] = area
    return area


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and globals is not None and _areas:
        area = _area_of(globals)
        top = name.partition(".")[0]
        if area is not None and top in area.names:
            module = _real_import(f"{area.prefix}.{name}", globals, locals, fromlist, 0)
            return module if fromlist else sys.modules[f"{area.prefix}.{top}"]
    return _real_import(name, globals, locals, fromlist, level)


class _Finder:
    """Finds `drift_task_<id>.NAME...`: the checkout's NAME, under that private name."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        prefix, _, rest = fullname.partition(".")
        area = _areas.get(prefix)
        if area is None or not rest:
            return None
        search = area.dirs if "." not in rest else list(path or [])
        spec = importlib.machinery.PathFinder.find_spec(rest, search)
        if spec is None:
            return None
        if spec.origin is None or not spec.has_location:  # a namespace package (a folder without __init__)
            ns = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            ns.submodule_search_locations = list(spec.submodule_search_locations or [])
            return ns
        return importlib.util.spec_from_file_location(
            fullname, spec.origin, submodule_search_locations=spec.submodule_search_locations
        )

    @staticmethod
    def invalidate_caches() -> None:
        pass
