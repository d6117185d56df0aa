"""The README's twenty-line example runs as printed and leaves a resumable run."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests import forked

README = Path(__file__).resolve().parents[1] / "README.md"


def example_source() -> str:
    section = README.read_text().split("## In twenty lines", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "the README lost its example"
    assert len(match.group(1).splitlines()) <= 25, "twenty lines of code, and a few blank ones"
    return match.group(1)


@pytest.mark.slow
def test_the_readme_example_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(example_source())
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    for _ in range(2):
        done = forked.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert done.returncode == 0, done.stderr
    ckpt = tmp_path / "runs" / "quickstart"
    assert (ckpt / "model.ckpt-500.index").exists()
    assert "starting at step 500" in done.stdout  # the second run resumed
    assert "saved step 1000 loss" in done.stdout
    assert len(list(ckpt.glob("events.out.tfevents.*"))) == 2
