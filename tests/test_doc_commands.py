"""Every command the docs quote parses: `drift ...` by drift's own click parser, `benchmarks/X.py ...`
by the script's own argparse parser (the script runs up to its parse_args and stops there), so a
renamed flag, a missing argument, a subcommand or a script that is gone fails here. Commands are
read from the docs, not a copy: inline code, indented code lines and the lines of fenced blocks,
with or without arguments (a bare `drift join` in a sentence names a subcommand that must exist).
Nothing is run beyond argument parsing. Also: CI runs README's test command as written, and the
suite's time is stated in one place only."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import click
import pytest
from conftest import ROOT

from drift.cli import main as drift_main

DOCS = ("README.md", "BENCHMARKS.md", "CONTRIBUTING.md", "SECURITY.md")
_SPAN = re.compile(r"`([^`]+)`")  # inline code (it may wrap over a line break)
_BLOCK = re.compile(r"^    (\S.*)$", re.M)  # indented code lines
_FENCED = re.compile(r"^ *```(\w*)[^\n]*\n(.*?)^ *```", re.S | re.M)
_SHELL = {"", "sh", "bash", "shell", "console"}  # a fenced block of another language: only its comments
_DRIFT = re.compile(r"(?:^|\s)(drift [a-z]\w*\b.*)")
_SCRIPT = re.compile(r"(?:^|\s)((?:benchmarks/)?\w+\.py\b.*)")
USER_SCRIPTS = {"train.py"}  # README's own-loop script: tests/test_own_loop.py runs it as written


def _commands(text: str) -> tuple[list[str], list[str]]:
    """`drift ...` and `benchmarks/X.py ...` commands: those to run (code lines, indented or fenced,
    and inline code with arguments), and those only named (inline code without arguments)."""
    fenced = [
        line
        for m in _FENCED.finditer(text)
        for line in m.group(2).splitlines()
        if m.group(1) in _SHELL or line.lstrip().startswith("#")
    ]
    text = _FENCED.sub("", text)  # so a fenced block's indented lines are not read twice
    lines = [m.group(1) for m in _BLOCK.finditer(text)] + [line.strip().removeprefix("$ ") for line in fenced]
    run: list[str] = []
    named: list[str] = []
    for span, is_line in [(m.group(1), False) for m in _SPAN.finditer(text)] + [(line, True) for line in lines]:
        for piece in re.split(r"&&|\||;", span.split(" #")[0].replace("\n", " ")):
            piece = piece.strip()
            if piece.startswith("#"):  # a code comment: its command is prose
                piece = piece.split(":", 1)[-1].strip()
            for pattern in (_DRIFT, _SCRIPT):
                m = pattern.search(piece)
                if not m:
                    continue
                cmd = " ".join(m.group(1).split())
                for q in "'\"":  # the end of a quoted command line: bash -c 'drift ...'
                    if cmd.count(q) % 2:
                        cmd = cmd.removesuffix(q)
                bare = len(cmd.split()) == (2 if cmd.startswith("drift ") else 1)
                if cmd.startswith("benchmarks/X.py"):  # CONTRIBUTING's placeholder
                    continue
                if bare and not is_line:
                    if cmd.startswith(("drift ", "benchmarks/")):  # `dense.py` in a sentence is a file, not a script
                        named.append(cmd)
                else:
                    run.append(cmd)
    return run, named


def _argv(cmd: str) -> list[str]:
    """Placeholders as a user fills them in; `[--flag X]` optional parts taken."""
    cmd = (
        cmd.replace("drift join ...", "drift join --repo R --ticket T")
        .replace("<your repo URL>", "https://example.org/repo.git")
        .replace("--ticket ...", "--ticket T")
        .replace("--local N", "--local 2")
    )
    return shlex.split(re.sub(r"[\[\]]", "", cmd))


ALL = {cmd: doc for doc in DOCS for cmd in _commands((ROOT / doc).read_text())[0]}
NAMED = {cmd: doc for doc in DOCS for cmd in _commands((ROOT / doc).read_text())[1]}


def test_the_docs_quote_commands() -> None:
    """The extraction itself: the README's main commands and BENCHMARKS' scripts are found, and so
    are `drift sample`, bare subcommands and commands in fenced blocks."""
    assert "drift coord recipes/shakespeare.yaml --local 3" in ALL
    assert any(c.startswith("drift join --repo") for c in ALL)
    assert any(c.startswith("drift sample RUN_DIR") for c in ALL)
    assert "drift id" in ALL  # an indented line without arguments: parsed
    assert "drift join" in NAMED and "benchmarks/bench_vs_ddp.py" in NAMED  # named in a sentence
    assert sum(1 for c in ALL if ".py" in c.split()[0]) >= 10, sorted(ALL)
    doc = "```sh\n$ drift report runs/a\npython3 benchmarks/bench_ring.py\n```\n`drift sample` and `dense.py`\n"
    assert _commands(doc) == (["drift report runs/a", "benchmarks/bench_ring.py"], ["drift sample"])


@pytest.mark.parametrize("cmd", sorted(NAMED))
def test_a_named_command_exists(cmd: str) -> None:
    """`drift join` or `benchmarks/bench_ring.py` in a sentence: the subcommand or script exists."""
    if cmd.startswith("drift "):
        assert cmd.split()[1] in drift_main.commands, f"{NAMED[cmd]}: `{cmd}`: drift has no such command"
    else:
        assert (ROOT / cmd).is_file(), f"{NAMED[cmd]}: `{cmd}`: no such script"


@pytest.mark.parametrize("cmd", sorted(c for c in ALL if c.startswith("drift ")))
def test_drift_command_parses(cmd: str) -> None:
    argv = _argv(cmd)[1:]
    sub = drift_main.commands.get(argv[0])
    if sub is None:
        pytest.fail(f"{ALL[cmd]}: `{cmd}`: drift has no command {argv[0]!r} (it has {', '.join(drift_main.commands)})")
    try:
        sub.make_context(argv[0], argv[1:])
    except click.ClickException as e:
        pytest.fail(f"{ALL[cmd]}: `{cmd}`: {e.format_message()}")


# Runs each script as __main__ up to its ArgumentParser.parse_args, then stops (one process for
# all of them: the imports are paid once). Prints one JSON line per command: its exit code.
_RUNNER = r"""
import argparse, json, os, runpy, sys
class Parsed(BaseException): pass
real = argparse.ArgumentParser.parse_args
def parse_and_stop(self, *a, **k):
    real(self, *a, **k)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_and_stop
for script, *args in json.loads(sys.argv[1]):
    sys.argv = [script, *args]
    sys.path[0] = script.rpartition("/")[0]  # as `python3 benchmarks/X.py` has it: the harness, sibling scripts
    try:
        runpy.run_path(script, run_name="__main__")
        code = "never parsed its arguments"
    except Parsed:
        code = 0
    except SystemExit as e:
        code = e.code
    print(json.dumps([script, *args, code]), flush=True)
"""


def test_benchmark_commands_parse() -> None:
    cmds = sorted(c for c in ALL if not c.startswith("drift ") and c.split()[0] not in USER_SCRIPTS)
    argvs, parsed = [], []
    for cmd in cmds:
        script, *args = _argv(cmd)
        path = ROOT / (script if script.startswith("benchmarks/") else f"benchmarks/{script}")
        assert path.exists(), f"{ALL[cmd]}: `{cmd}`: no {path.relative_to(ROOT)}"
        if "parse_args" not in path.read_text():  # takes no arguments: run, it would benchmark
            assert not args, f"{ALL[cmd]}: `{cmd}`: {path.name} takes no arguments"
            continue
        argvs.append([str(path), *args])
        parsed.append(cmd)
    out = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(argvs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(results) == len(parsed), out.stderr[-3000:]
    bad = [f"{ALL[c]}: `{c}`: {r[-1]}" for c, r in zip(parsed, results) if r[-1] != 0]
    assert not bad, "\n".join(bad) + "\n" + out.stderr[-3000:]


def test_ci_runs_the_readme_test_command() -> None:
    """`.ci/run` runs README's second line, the test command, exactly as README writes it (its
    failure ends CI with its exit status); the first line, the main command, is
    tests/test_readme.py's."""
    main, tests = [m.group(1) for m in _BLOCK.finditer((ROOT / "README.md").read_text())][:2]
    # the whole suite, a tier at a time (CI prints each tier's time), each on both cores (pytest-xdist)
    assert "drift coord" in main and tests.endswith(
        'python3 -m pytest -q -n 2 -m "not swarm" && python3 -m pytest -q -n 2 -m swarm'
    )
    assert main.split(" && pip install")[0] == tests.split(" && pip install")[0]  # one virtualenv
    assert f"{tests} || exit" in (ROOT / ".ci" / "run").read_text().splitlines()


# The suite's time is stated in one place, CONTRIBUTING.md's "Suite time" paragraph; anywhere
# else a duration near "suite" or "tier" (or an "N-minute budget") is a second figure to go stale.
_DURATION = r"(?:~\s?)?\d+(?:\.\d+)?\s?(?:s|sec|seconds?|min|minutes?|h|hours?)\b|\d+-minute|\ban? (?:minute|hour)\b"
_SUITE_TIME = re.compile(
    rf"\b(?:suites?|tiers?)\b(?:[^.]|\.\d){{0,100}}?(?:{_DURATION})|(?:{_DURATION})[^.]{{0,40}}\b(?:suite|tier|budget)\b",
    re.I,
)
_SUITE_TIME_HOME = re.compile(r"^\*\*Suite time\*\*.*?(?=\n\n)", re.S | re.M)
SUITE_TIME_FILES = (*DOCS, ".ci/run", "pyproject.toml", "tests/conftest.py")


def test_the_suites_time_is_stated_in_one_place() -> None:
    home = _SUITE_TIME_HOME.findall((ROOT / "CONTRIBUTING.md").read_text())
    assert len(home) == 1 and _SUITE_TIME.search(home[0]), home
    elsewhere = []
    for name in SUITE_TIME_FILES:
        text = _SUITE_TIME_HOME.sub("", (ROOT / name).read_text())
        elsewhere += [f"{name}: {' '.join(m.group(0).split())!r}" for m in _SUITE_TIME.finditer(text)]
    assert not elsewhere, "the suite's time, again (it lives in CONTRIBUTING.md, Suite time):\n" + "\n".join(elsewhere)


def test_readme_trainer_scripts_are_the_tested_files() -> None:
    """Each script README shows under "Bring your own trainer" is, byte for byte, the file in
    recipes/trainers/ that tests/test_trainers.py runs."""
    blocks = re.findall(r"```python\n(# (\w+\.py) .*?)\n```", (ROOT / "README.md").read_text(), re.S)
    shown = {name: text for text, name in blocks if (ROOT / "recipes" / "trainers" / name).is_file()}
    assert sorted(shown) == sorted(p.name for p in (ROOT / "recipes" / "trainers").glob("*.py"))
    for name, text in shown.items():
        assert text == (ROOT / "recipes" / "trainers" / name).read_text().rstrip(), name
