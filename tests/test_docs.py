"""Every fenced block in README.md and docs/**/*.md is run, parsed, or says why it cannot be.

- ```python blocks run, each in a fresh temporary directory, all in one subprocess (one
  TensorFlow import for all of them); a SystemExit must carry 0.
- ```sh / ```bash blocks are syntax-checked with `bash -n`, and every `asupervisor
  SUBCOMMAND` in them is checked to exist (`asupervisor SUBCOMMAND --help` exits 0).
- ```yaml blocks are parsed (every document).
- ```text blocks are output and diagrams: not code.

The line before a block may say how to treat it:
`<!-- docs-test: skip (REASON) -->` (a reason is required), `<!-- docs-test: parse -->`
(a python block is compiled, not run), `<!-- docs-test: continue -->` (a python block is
run joined to the previous python block of the same page).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^( *)```(\S*)\s*$")
MARKER = re.compile(r"^\s*<!-- docs-test: (\w+)(?: \((.*)\))? -->\s*$")
SHELL = {"sh", "bash", "shell", "console"}
CODE = {"python", "yaml", *SHELL}


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None
    reason: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = len(opening.group(1)), opening.group(2)
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = textwrap.dedent("\n".join(line[indent:] for line in lines[i + 1 : end]))
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marked = MARKER.match(previous)
        found.append(
            Block(
                page,
                i + 1,
                lang,
                body + "\n",
                marked.group(1) if marked else None,
                marked.group(2) if marked else None,
            )
        )
        i = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]


def test_the_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_block_says_what_it_is_and_every_skip_says_why() -> None:
    assert len(ALL) > 10, "the block finder found almost nothing"
    for block in ALL:
        assert block.lang in CODE | {"text"}, f"{block.where}: a block without a known language"
        assert block.marker in (None, "skip", "parse", "continue"), block.where
        if block.marker == "skip":
            assert block.reason and block.reason.strip(), f"{block.where}: a skip with no reason"
        if block.marker in ("parse", "continue"):
            assert block.lang == "python", f"{block.where}: {block.marker} is for python blocks"


def test_yaml_blocks_parse() -> None:
    for block in ALL:
        if block.lang == "yaml" and block.marker != "skip":
            assert list(yaml.safe_load_all(block.text)), block.where


def test_shell_blocks_are_valid_bash() -> None:
    for block in ALL:
        if block.lang in SHELL and block.marker != "skip":
            done = subprocess.run(
                ["bash", "-n"], input=block.text, capture_output=True, text=True, check=False
            )
            assert done.returncode == 0, f"{block.where}: {done.stderr}"


def subcommands() -> set[str]:
    """Each `asupervisor SUBCOMMAND` the shell blocks use."""
    names = set()
    for block in ALL:
        if block.lang in SHELL and block.marker != "skip":
            for line in block.text.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True) if "'" not in line else line.split()
                for k, word in enumerate(words[:-1]):
                    if word.endswith("asupervisor") and not words[k + 1].startswith("-"):
                        names.add(words[k + 1])
    return names


def python_programs() -> list[tuple[str, str]]:
    programs: list[tuple[str, str]] = []
    for block in ALL:
        if block.lang != "python" or block.marker == "skip":
            continue
        if block.marker == "continue":
            assert programs and programs[-1][0].startswith(str(block.page.relative_to(ROOT))), (
                f"{block.where}: nothing to continue"
            )
            where, text = programs[-1]
            programs[-1] = (where, text + block.text)
        elif block.marker == "parse":
            compile(block.text, block.where, "exec")
        else:
            programs.append((block.where, block.text))
    return programs


DRIVER = """
import contextlib, json, os, sys, tempfile, traceback
from asupervisor.cli import main as cli

programs, commands = json.loads(sys.stdin.read())
failures = []
for where, text in programs:
    with tempfile.TemporaryDirectory() as cwd:
        os.chdir(cwd)
        try:
            exec(compile(text, where, "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            if exc.code not in (0, None):
                failures.append(f"{where}: exit status {exc.code}")
        except BaseException:
            failures.append(f"{where}: {traceback.format_exc()}")
        os.chdir("/")
for name in commands:
    with contextlib.redirect_stdout(sys.stderr):
        try:
            cli([name, "--help"])
            status = 0
        except SystemExit as exc:
            status = exc.code
    if status not in (0, None):
        failures.append(f"asupervisor {name} --help: exit status {status}")
print(json.dumps(failures))
"""


@pytest.mark.slow
def test_python_blocks_run_and_commands_exist() -> None:
    programs = python_programs()
    assert len(programs) >= 3
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps([programs, sorted(subcommands())]),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(failures)


def load_hook() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("measured", ROOT / "docs/_hooks/measured.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_measured_tables_come_from_the_results_files(tmp_path: Path) -> None:
    hook = load_hook()
    missing = hook.render("step_overhead", tmp_path)
    assert missing == "*Not measured yet: run `python benchmarks/step_overhead.py`.*"
    (tmp_path / "step_overhead.json").write_text(
        json.dumps(
            {"command": "python benchmarks/step_overhead.py --rounds 3", "rows": [{"a": 1.5}]}
        )
    )
    table = hook.render("step_overhead", tmp_path)
    assert table.startswith("Measured by `python benchmarks/step_overhead.py --rounds 3`")
    assert "| a |\n|---|\n| 1.50 |" in table


def test_every_benchmark_has_its_table_in_the_docs() -> None:
    text = "\n".join(page.read_text() for page in PAGES)
    shown = set(re.findall(r"<!-- measured: ([\w-]+) -->", text))
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    assert scripts - {"goodput_trainer"} <= shown, "a benchmark whose figures the docs do not show"
    assert shown <= set(load_hook().COMMANDS)
