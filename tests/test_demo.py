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

DEMO = Path(__file__).resolve().parents[1] / "examples" / "digits.py"


def run_demo(logdir: Path, steps: int) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
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

    second = run_demo(logdir, 100)
    assert f"resumed from {logdir / 'model.ckpt-400'} at step 400" in second
    assert "stopped at step 500 (step_limit)" in second
    assert len(glob.glob(str(logdir / "events.out.tfevents.*"))) == 2
    assert "Traceback" not in first + second
    check_inspect(logdir, capsys)


def check_inspect(logdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`asupervisor inspect` on the demo's logdir: the table, and JSON that parses."""
    table = subprocess.run(
        [sys.executable, "-m", "asupervisor", "inspect", str(logdir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 0, table.stderr
    assert table.stderr == "", "TensorFlow's start-up noise reached the terminal"
    assert "model.ckpt-500  (step 500)" in table.stdout
    assert " NO " not in table.stdout
    for tag in ("loss", "accuracy", "test_accuracy", "iteration/sec"):
        assert f"  {tag} " in table.stdout, tag
    # The JSON in this process: the command's start-up is checked above.
    capsys.readouterr()
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
