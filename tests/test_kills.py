"""SIGKILL at random moments, again and again on one logdir: every run resumes, nothing is torn."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import forked
from tests.faults.harness import kill_trials

SAVE_STEPS = 5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_repeated_sigkills_never_lose_more_than_a_save_interval(tmp_path: Path, mode: str) -> None:
    extra = ["--megabytes", "16"] + (["--async"] if mode == "async" else [])
    report = kill_trials(str(tmp_path / "run"), 3, 7, SAVE_STEPS, *extra)
    assert report.trials == report.resumed == 3
    assert report.went_back == 0, "a run restored an older step than the run before it"
    assert report.problems == [], report.problems
    assert report.checkpoints >= 1
    # sync: a kill mid-save loses at most one interval; async: the write in flight too
    limit = SAVE_STEPS if mode == "sync" else 2 * SAVE_STEPS
    assert max(report.lost_steps) <= limit, report.lost_steps
    assert not list((tmp_path / "run").glob("*_temp")), "unfinished saves were left behind"
    assert report.clean_exit == 0, report.clean_stderr
    # After a clean run, every checkpoint is named or swept.
    assert report.orphans == 0, (report.orphan_names, report.clean_stderr)
    assert report.checkpoints <= 3  # the trainer's max_to_keep


@pytest.mark.slow
def test_the_fault_report_prints_its_table() -> None:
    script = Path(__file__).parent / "faults" / "run_report.py"
    done = forked.run(
        [sys.executable, str(script), "--only", "SIGTERM"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("| SIGTERM")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:5] == ["1", "1", "0", "0"]  # trials, resumed, lost steps, corrupt
    assert cells[5].startswith("exit 42")  # preempted: saved, to be started again
