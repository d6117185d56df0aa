"""The README's demo: real training, checkpoints, events; a second run resumes."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "digits.py"


def run_demo(logdir: Path, steps: int) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
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
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_demo_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    logdir = tmp_path / "digits"
    first = run_demo(logdir, 400)
    assert "fresh start" in first
    assert "stopped at step 400 (step_limit)" in first
    accuracy = float(re.search(r"test accuracy (\d\.\d+)\n", first).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.7, "the model did not learn"
    assert os.path.exists(logdir / "model.ckpt-400.index")

    second = run_demo(logdir, 300)
    assert f"resumed from {logdir / 'model.ckpt-400'} at step 400" in second
    assert "stopped at step 700 (step_limit)" in second
    assert len(glob.glob(str(logdir / "events.out.tfevents.*"))) == 2
    assert "Traceback" not in first + second


@pytest.mark.slow
def test_the_demo_help_explains_itself() -> None:
    done = subprocess.run(
        [sys.executable, str(DEMO), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0
    assert "--logdir" in done.stdout and "resumes" in done.stdout
