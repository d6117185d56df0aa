"""The README's demo: real training, checkpoints, events; a second run resumes."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asupervisor.cli import main
from tests import forked

DEMO = Path(__file__).resolve().parents[1] / "examples" / "digits.py"


def run_demo(logdir: Path, steps: int, cold: bool = True) -> str:
    """The demo in a process of its own; ``cold``: a new interpreter, which imports
    TensorFlow (its start-up noise must stay out of the terminal), else forked from the
    suite's fork server (TensorFlow imported already: seconds of CPU fewer)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = (subprocess.run if cold else forked.run)(
        [
            sys.executable,
            str(DEMO),
            "--logdir",
            str(logdir),
            "--steps",
            str(steps),
            "--save-secs",
            "0.3",
            "--eval-secs",
            "0.2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "", "TensorFlow's start-up noise reached the terminal"
    return done.stdout


@pytest.mark.slow
def test_the_demo_trains_checkpoints_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logdir = tmp_path / "digits"
    first = run_demo(logdir, 400)
    assert "fresh start" in first
    assert "stopped at step 400 (step_limit)" in first
    final = re.search(r"stopped at step 400 \(step_limit\); test accuracy (\d\.\d+)", first)
    assert final, first
    accuracy = float(final.group(1))
    assert accuracy > 0.7, "the model did not learn"
    assert os.path.exists(logdir / "model.ckpt-400.index")

    # --steps is the step to train to. The first run's cold start was checked above.
    second = run_demo(logdir, 500, cold=False)
    assert f"resumed from {logdir / 'model.ckpt-400'} at step 400" in second
    assert "stopped at step 500 (step_limit)" in second
    assert len(glob.glob(str(logdir / "events.out.tfevents.*"))) == 2
    assert "Traceback" not in first + second
    check_inspect(logdir, capsys)


def check_inspect(logdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`asupervisor inspect` on the demo's logdir: the table, and JSON that parses. Both
    in this process: the command's cold start (TensorFlow imported, none of its start-up
    noise in the terminal) is checked where the docs' recipe runs it from a shell
    (tests/test_docs.py, the nohup recipe)."""
    capsys.readouterr()
    assert main(["inspect", str(logdir)]) == 0
    table = capsys.readouterr().out
    assert "model.ckpt-500  (step 500)" in table
    assert " NO " not in table
    for tag in ("loss", "accuracy", "test_accuracy", "iteration/sec"):
        assert f"  {tag} " in table, tag
    assert main(["inspect", str(logdir), "--json"]) == 0
    as_json = capsys.readouterr()
    report = json.loads(as_json.out)
    assert report["latest_step"] == 500
    assert all(c["readable"] for c in report["checkpoints"])
    assert report["tags"]["loss"]["last_step"] == 500
    assert len(report["events_files"]) == 2


@pytest.mark.slow
def test_the_demo_help_explains_itself() -> None:
    done = subprocess.run(
        [sys.executable, str(DEMO), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0
    assert "--logdir" in done.stdout and "resumes" in done.stdout


# The demo under `asupervisor run`, its first process killed by a hook this wrapper adds
# after the first save past step 0 (so the kill falls mid-run, whatever the machine's speed).
KILLED_ONCE = """
import os, runpy, signal, sys

DEMO = sys.argv[1]
runpy.run_path(DEMO)["import_tensorflow_quietly"]()  # the demo's own quiet import first

import asupervisor as asv


class KillAfterFirstSave(asv.Hook):
    def after_save(self, session, step, path):
        if step > 0:
            os.kill(os.getpid(), signal.SIGKILL)


if os.environ["ASUPERVISOR_ATTEMPT"] == "1":
    init = asv.Supervisor.__init__

    def with_the_kill(self, *args, hooks=(), **kwargs):
        init(self, *args, hooks=[*hooks, KillAfterFirstSave()], **kwargs)

    asv.Supervisor.__init__ = with_the_kill
else:  # only the kill needs a save at every step; the run's end saves anyway
    sys.argv[sys.argv.index("--save-secs") + 1] = "600"
sys.argv = sys.argv[1:]
runpy.run_path(DEMO, run_name="__main__")
"""


@pytest.mark.slow
def test_the_demo_killed_once_under_asupervisor_run_ends_at_its_step_limit(
    tmp_path: Path,
) -> None:
    from asupervisor._logdir import ledger
    from asupervisor._logdir.store import Store
    from tests.test_run_sessions import Supervised

    logdir = tmp_path / "digits"
    wrapper = tmp_path / "killed_once.py"
    wrapper.write_text(KILLED_ONCE)
    # Both attempts forked from the suite's fork server (tests/forkshim.py): no import of
    # TensorFlow (the demo's cold start: test_the_demo_trains_...; --standby: test_run).
    run = Supervised(
        "--logdir", str(logdir), "--",
        *forked.runner_child(wrapper, str(DEMO), "--logdir", str(logdir), "--steps", "200",
                             "--save-secs", "0.01", "--eval-secs", "600"),
    )  # fmt: skip
    try:
        code = run.finish(timeout=300)
    finally:
        run.proc.kill()
    assert code == 0, run.output
    sessions = ledger.sessions(ledger.read(Store(str(logdir))))
    assert [s.outcome for s in sessions] == [None, "done"], run.output  # killed, then done
    assert 0 < sessions[1].restored_step < 200  # the kill fell mid-run
    stopped = [line.split(";")[0] for line in run.lines if "stopped at step" in line]
    assert tf_latest_step(logdir) == 200, stopped
    assert stopped == ["stopped at step 200 (step_limit)"], stopped


def tf_latest_step(logdir: Path) -> int:
    """The newest checkpoint's step, from the ``checkpoint`` state file on disk."""
    text = (logdir / "checkpoint").read_text()
    found = re.search(r'^model_checkpoint_path: "model\.ckpt-(\d+)"', text, re.M)
    assert found, text
    return int(found[1])
