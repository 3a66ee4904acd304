"""Every command README.md and BENCHMARKS.md quote parses: `drift ...` by drift's own click
parser, `benchmarks/X.py ...` by the script's own argparse parser (the script runs up to its
parse_args and stops there), so a renamed flag, a missing argument or a script that is gone fails
here. Read from the docs, not a copy; nothing is run beyond argument parsing."""

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

DOCS = ("README.md", "BENCHMARKS.md")
_SPAN = re.compile(r"`([^`]+)`")  # inline code (it may wrap over a line break)
_BLOCK = re.compile(r"^    (\S.*)$", re.M)  # indented code lines
_DRIFT = re.compile(r"(?:^|\s)(drift (?:coord|join|report|id|status)\b.*)")
_SCRIPT = re.compile(r"(?:^|\s)((?:benchmarks/)?\w+\.py\b.*)")
USER_SCRIPTS = {"train.py"}  # README's own-loop script: tests/test_own_loop.py runs it as written


def _commands(text: str) -> list[str]:
    """`drift ...` and `benchmarks/X.py ...` commands with at least one argument (a bare
    `drift join` in a sentence names the command; it is not one to run)."""
    found: list[str] = []
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # fenced blocks are code, not commands
    spans = [m.group(1) for m in _SPAN.finditer(text)] + [m.group(1) for m in _BLOCK.finditer(text)]
    for span in spans:
        for piece in re.split(r"&&|\|", span.split(" #")[0].replace("\n", " ")):
            for pattern in (_DRIFT, _SCRIPT):
                m = pattern.search(piece.strip())
                if m:
                    cmd = " ".join(m.group(1).split())
                    if len(cmd.split()) > (2 if cmd.startswith("drift ") else 1):
                        found.append(cmd)
    return found


def _argv(cmd: str) -> list[str]:
    """Placeholders as a user fills them in; `[--flag X]` optional parts taken."""
    cmd = (
        cmd.replace("drift join ...", "drift join --repo R --ticket T")
        .replace("<your repo URL>", "https://example.org/repo.git")
        .replace("--ticket ...", "--ticket T")
        .replace("--local N", "--local 2")
    )
    return shlex.split(re.sub(r"[\[\]]", "", cmd))


ALL = {cmd: doc for doc in DOCS for cmd in _commands((ROOT / doc).read_text())}


def test_the_docs_quote_commands() -> None:
    """The extraction itself: the README's main commands and BENCHMARKS' scripts are found."""
    assert "drift coord recipes/shakespeare.yaml --local 3" in ALL
    assert any(c.startswith("drift join --repo") for c in ALL)
    assert sum(1 for c in ALL if ".py" in c.split()[0]) >= 10, sorted(ALL)


@pytest.mark.parametrize("cmd", sorted(c for c in ALL if c.startswith("drift ")))
def test_drift_command_parses(cmd: str) -> None:
    argv = _argv(cmd)[1:]
    sub = drift_main.commands[argv[0]]
    try:
        sub.make_context(argv[0], argv[1:])
    except click.ClickException as e:
        pytest.fail(f"{ALL[cmd]}: `{cmd}`: {e.format_message()}")


# Runs each script as __main__ up to its ArgumentParser.parse_args, then stops (one process for
# all of them: the imports are paid once). Prints one JSON line per command: its exit code.
_RUNNER = r"""
import argparse, json, runpy, sys
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
    argvs = []
    for cmd in cmds:
        script, *args = _argv(cmd)
        path = ROOT / (script if script.startswith("benchmarks/") else f"benchmarks/{script}")
        assert path.exists(), f"{ALL[cmd]}: `{cmd}`: no {path.relative_to(ROOT)}"
        argvs.append([str(path), *args])
    out = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(argvs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(results) == len(cmds), out.stderr[-3000:]
    bad = [f"{ALL[c]}: `{c}`: {r[-1]}" for c, r in zip(cmds, results) if r[-1] != 0]
    assert not bad, "\n".join(bad) + "\n" + out.stderr[-3000:]
