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
run joined to the previous python block of the same page), `<!-- docs-test: run (HOW) -->`
(a shell block that a test of its own below runs for real, as HOW says),
`<!-- docs-test: file (PATH) -->` (the block is the repository's file PATH, byte for byte:
the tests run that file).

The pages speak to a user: no issue numbers, no "this machine" (and for the guide pages,
no "the contract" nor where the project once was), and their measured tables are current
with the results files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import forked

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
        assert block.marker in (None, "skip", "parse", "continue", "run", "file"), block.where
        if block.marker == "skip":
            assert block.reason and block.reason.strip(), f"{block.where}: a skip with no reason"
        if block.marker in ("parse", "continue"):
            assert block.lang == "python", f"{block.where}: {block.marker} is for python blocks"
        if block.marker == "run":
            assert block.lang in SHELL, f"{block.where}: run is for shell blocks"
            assert block.where in RUN_BLOCKS, f"{block.where}: no test runs this block"


def test_a_block_that_shows_a_file_shows_it_as_it_is() -> None:
    """The SLURM batch script the docs show is the one tests/test_slurm_faults.py submits;
    the Kubernetes manifests are the ones tests/test_kubernetes_recipes.py checks."""
    shown = [block for block in ALL if block.marker == "file"]
    assert any(b.reason == "examples/slurm/train.sbatch" for b in shown)
    assert any((b.reason or "").startswith("examples/kubernetes/") for b in shown)
    for block in shown:
        assert block.reason, f"{block.where}: which file?"
        assert block.text == (ROOT / block.reason).read_text(), (
            f"{block.where}: not {block.reason} as it is: copy the file into the block"
        )


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
    # Forked from the suite's fork server (TensorFlow imported already, one import fewer):
    # the blocks still run in a process of their own, and what is read of it is their
    # failures, nothing of a cold start.
    done = forked.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps([programs, sorted(subcommands())]),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
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
    page = "Intro:\n\n<!-- measured: step_overhead -->\n\nMore.\n"
    filled = hook.fill(page, tmp_path)
    assert filled == (
        "Intro:\n\n<!-- measured: step_overhead -->\n\n"
        "*Not measured yet: run `python benchmarks/step_overhead.py`.*\n\n"
        "<!-- /measured -->\n\nMore.\n"
    )
    (tmp_path / "step_overhead.json").write_text(
        json.dumps(
            {
                "command": "python benchmarks/step_overhead.py --rounds 3",
                "date": "2030-01-02 03:04 UTC",
                "commit": "0123456789",
                "rows": [{"a": 1.5, "ok": True}],
            }
        )
    )
    table = hook.render("step_overhead", tmp_path)
    assert table.startswith(
        "Measured by `python benchmarks/step_overhead.py --rounds 3` on 2030-01-02 03:04 UTC "
        "at commit 0123456789:"
    )
    assert "| a | ok |\n|---|---|\n| 1.50 | yes |" in table
    again = hook.fill(filled, tmp_path)  # the old table between the markers is replaced
    assert again == hook.fill(page, tmp_path) and table in again
    assert hook.fill(again, tmp_path) == again


def test_a_measured_tables_header_names_no_folder_the_benchmark_kept_its_output_in(
    tmp_path: Path,
) -> None:
    hook = load_hook()
    for command in (
        "python benchmarks/goodput.py --logs /tmp/gp50k2 --seed 3",
        "python benchmarks/goodput.py --logs=/tmp/gp50k2 --seed 3",
    ):
        (tmp_path / "goodput.json").write_text(json.dumps({"command": command, "rows": []}))
        shown = hook.render("goodput", tmp_path)
        assert shown.startswith("Measured by `python benchmarks/goodput.py --seed 3`:"), shown


def test_the_measured_tables_in_the_pages_are_current() -> None:
    """The tables are written into the markdown (so that GitHub shows them too):
    `python docs/_hooks/measured.py` rewrites them after a benchmark ran."""
    hook = load_hook()
    stale = [str(p.relative_to(ROOT)) for p in PAGES if hook.fill(p.read_text()) != p.read_text()]
    assert stale == [], f"not current (run `python docs/_hooks/measured.py`): {stale}"


def make_target(name: str) -> list[str]:
    """The commands of a Makefile target, ``$(PY)`` written ``python``."""
    lines = (ROOT / "Makefile").read_text().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{name}:"))
    commands = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        commands.append(line.strip().replace("$(PY)", "python"))
    return commands


def test_make_bench_and_make_faults_run_what_the_pages_show() -> None:
    hook = load_hook()
    ran = make_target("bench") + make_target("faults")
    assert sorted(c for c in ran if "docs/_hooks" not in c) == sorted(hook.COMMANDS.values())
    for target in ("bench", "faults"):  # and then write the tables into the pages
        assert make_target(target)[-1] == "python docs/_hooks/measured.py", target


# What a user page must not say: issue numbers, and where the project was written.
EVERYWHERE = [
    r"\bissues? #?\d+",  # issue 12
    r"(?<![&\w])#\d+\b(?!.*\bmodel\.ckpt)",  # #12 (not a commit of inspect's history table)
    r"(?<=\w)#\d+\b",  # keras#12 (a link to the issue says what it is instead)
    r"\bthis (?:machine|VM|vm|host|box)\b",
    r"\b(?:measured|report|found|tested|run) here\b",
    r"\bhere\)",  # (within a second here)
    r"\bno cloud account\b",
]
# ... and, in the guide (every page but the API reference and the architecture, which are
# for contributors), the project's own vocabulary and history.
GUIDE_ONLY = [
    r"\bthe (?:API )?contract\b",
    r"\bwere found and removed\b",
    r"\bpy-spy\b",
    r"\bon the roadmap\b",
    r"\bthis release\b",
]
CONTRIBUTORS = {"docs/API.md", "docs/ARCHITECTURE.md"}
USER_PAGES = [*PAGES, ROOT / "CHANGELOG.md"]


def wording_problems(text: str, guide: bool) -> list[str]:
    found = []
    for pattern in EVERYWHERE + (GUIDE_ONLY if guide else []):
        for match in re.finditer(pattern, text, re.IGNORECASE):
            found.append((match.start(), match.group(0)))
    return [f"line {text.count(chr(10), 0, at) + 1}: {words!r}" for at, words in sorted(found)]


def test_the_pages_speak_to_a_user() -> None:
    problems = []
    for page in USER_PAGES:
        where = page.relative_to(ROOT).as_posix()
        for problem in wording_problems(page.read_text(), guide=where not in CONTRIBUTORS):
            problems.append(f"{where}: {problem}")
    assert problems == []


def test_the_wording_check_finds_what_it_looks_for() -> None:
    text = (
        "Fixed in issue 12 (#13, keras-team/keras#20585), measured here\n"
        "on this machine (within a second here). See the contract.\n"
        "[Measured](measured.md#checkpoint-stall), &#124; and step #x stay.\n"
    )
    found = wording_problems(text, guide=True)
    assert [f.split(": ", 1)[1] for f in found] == [
        "'issue 12'",
        "'#13'",
        "'#20585'",
        "'measured here'",
        "'this machine'",
        "'here)'",
        "'the contract'",
    ]
    assert len(wording_problems(text, guide=False)) == 6


def test_every_benchmark_has_its_table_in_the_docs() -> None:
    text = "\n".join(page.read_text() for page in PAGES)
    shown = set(re.findall(r"<!-- measured: ([\w-]+) -->", text))
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    assert scripts - {"goodput_trainer"} <= shown, "a benchmark whose figures the docs do not show"
    assert shown <= set(load_hook().COMMANDS)
    assert set(load_hook().COMMANDS) <= shown, "a results file the docs do not show"


# The recipe's blocks, run in order: the first starts a run in the background.
RUN_BLOCKS = ["docs/shutdowns.md:" + str(b.line) for b in blocks(ROOT / "docs/shutdowns.md")
              if b.marker == "run"]  # fmt: skip


def docs_train_script() -> str:
    """The page's own ``train.py``, the script its commands run."""
    (script,) = [
        b
        for b in blocks(ROOT / "docs/shutdowns.md")
        if b.lang == "python" and (b.reason or "").startswith("train.py")
    ]
    return script.text


def test_every_command_that_runs_train_py_gives_it_options_the_pages_train_py_takes() -> None:
    takes = set(re.findall(r"add_argument\(\"(--[\w-]+)\"", docs_train_script()))
    assert "--logdir" in takes
    used = 0
    for block in ALL:
        if block.lang in SHELL:
            text = block.text.replace("\\\n", " ")
            for args in re.findall(r"train\.py((?: +--?[\w-]+(?: +[^-\s&>|;]\S*)?)*)", text):
                used += 1
                given = set(re.findall(r"(--[\w-]+)", args))
                assert given <= takes, f"{block.where}: train.py {args.strip()}"
    assert used >= 3


def _wait(what: str, done: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.5)


@contextlib.contextmanager
def yielding(pid: int) -> Iterator[None]:
    """A process (every thread of its group, and its session's scheduling group where the
    kernel groups by session: autogroup) at the lowest priority while the body runs, then
    its own again; only where that can be undone (root). The page's train.py trains flat
    out, on more than one core, in a session of its own: beside the commands the test runs
    meanwhile (inspect imports TensorFlow) it took as much CPU as the rest of the suite.
    Its final save, after the body's kill, runs at its own priority."""
    if os.geteuid() != 0:
        yield
        return
    group, autogroup = os.getpgid(pid), Path(f"/proc/{pid}/autogroup")

    def nice(value: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PGRP, group, value)
        with contextlib.suppress(OSError):  # no autogroup, or the process has ended
            autogroup.write_text(str(value))

    nice(19)
    try:
        yield
    finally:
        nice(0)


@pytest.mark.slow
def test_the_nohup_recipe_runs_in_an_empty_directory(tmp_path: Path) -> None:
    first, then = [b for b in blocks(ROOT / "docs/shutdowns.md") if b.marker == "run"]
    (tmp_path / "train.py").write_text(docs_train_script())
    bin_dir = Path(sys.executable).parent  # asupervisor and python, as a venv's PATH has them
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("PYTHONPATH", None)

    def bash(block: Block, **options: Any) -> subprocess.CompletedProcess[str]:
        options.setdefault("env", env)
        return subprocess.run(
            ["bash", "-c", block.text], cwd=tmp_path, capture_output=True, text=True,
            timeout=300, check=False, **options,
        )  # fmt: skip

    # Its own process group: nothing the recipe starts outlives the test.
    shell = bash(first, start_new_session=True)
    assert shell.returncode == 0 and shell.stderr == "", shell.stderr
    pid = int((tmp_path / "runs" / "x.pid").read_text())
    group = os.getpgid(pid)
    beat = tmp_path / "runs" / "x" / ".asupervisor.heartbeat"
    try:

        def training() -> bool:
            try:
                return bool(json.loads(beat.read_text()).get("first_step_done"))
            except (OSError, ValueError):
                return False

        _wait("the first step", training, timeout=300)
        # In a user's shell (TensorFlow's log level not set): inspect imports TensorFlow
        # (it reads the checkpoints), and none of its start-up noise reaches the terminal.
        shell_env = {k: v for k, v in env.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        with yielding(int(json.loads(beat.read_text())["pid"])):
            done = bash(then, env=shell_env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "heartbeat:" in done.stdout, done.stdout  # inspect saw the running session
        assert done.stderr == "", "TensorFlow's start-up noise reached the terminal"

        def ended() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        _wait("the supervisor's exit", ended, timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, 9)
    log = (tmp_path / "runs" / "x.log").read_text()
    assert "run.ended status='42 (preempted)'" in log, log[-3000:]
    assert list((tmp_path / "runs" / "x").glob("model.ckpt-*.index")), log[-3000:]


def test_the_reference_pages_docstrings_have_no_sphinx_roles() -> None:
    """The reference pages render docstrings as Markdown, where ``:mod:`x``` stays raw text."""
    import inspect

    import asupervisor
    import asupervisor.hooks
    import asupervisor.services

    role = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):`")
    found = []
    for module in (asupervisor, asupervisor.hooks, asupervisor.services):
        members = [module, *(getattr(module, name) for name in getattr(module, "__all__", []))]
        for obj in members:
            inner = [m for _, m in inspect.getmembers(obj)] if inspect.isclass(obj) else []
            for each in (obj, *inner):
                doc = inspect.getdoc(each) if callable(each) or each is obj else None
                if doc and role.search(doc):
                    found.append(f"{module.__name__}: {getattr(each, '__qualname__', each)}")
    assert not found, found


def test_the_sites_wide_tables_and_code_blocks_scroll_instead_of_being_cut_off() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    sheets = [ROOT / "docs" / name for name in config.get("extra_css", [])]
    assert sheets and all(sheet.exists() for sheet in sheets), sheets
    css = re.sub(r"/\*.*?\*/", "", "".join(s.read_text() for s in sheets), flags=re.S)
    rules = dict(re.findall(r"([^{}]+)\{([^}]*)\}", css))

    def style(selector: str) -> str:
        return "".join(body for head, body in rules.items() if selector in head)

    assert "overflow-x: auto" in style(".md-typeset table:not([class])")
    assert "overflow-x: auto" in style(".md-typeset pre > code")
    assert "overflow-wrap: anywhere" in style("td")
