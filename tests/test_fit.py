"""`sess.fit` on real processes: SIGKILL mid-epoch resumes at the exact batch, SIGTERM saves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tensorflow as tf

from asupervisor._logdir.verify import verify_checkpoint
from tests import forked

EXAMPLE = Path(__file__).parents[1] / "examples" / "fit.py"
STARTING = re.compile(r"(\d+) batches per epoch; starting at epoch (\d+) batch (\d+) \(step (\d+)")
STOPPED = re.compile(r"stopped at step (\d+) \((\w+)\), epoch (\d+) batch (\d+)")
SAVED = re.compile(r"checkpoint\.saved .*step=(\d+)")

pytestmark = pytest.mark.slow


def newest_complete(logdir: Path) -> int:
    """The step of the newest checkpoint whose files read back whole, as the library
    finds it at a start (the state file is written after the files: it may not name it)."""
    found = (re.fullmatch(r"model\.ckpt-(\d+)\.index", name) for name in os.listdir(logdir))
    for step in sorted((int(m[1]) for m in found if m), reverse=True):
        if verify_checkpoint(str(logdir / f"model.ckpt-{step}")) is None:
            return step
    raise AssertionError(f"no complete checkpoint in {logdir}: {sorted(os.listdir(logdir))}")


class Run:
    def __init__(self, logdir: Path, *args: str) -> None:
        self.proc = forked.Popen(
            [sys.executable, str(EXAMPLE), "--logdir", str(logdir), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def find(self, pattern: re.Pattern[str]) -> list[re.Match[str]]:
        return [m for line in list(self.lines) if (m := pattern.search(line))]

    def wait_for(self, pattern: re.Pattern[str], count: int = 1, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.find(pattern)) < count:
            assert self.proc.poll() is None or len(self.find(pattern)) >= count, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.05)

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def finish(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout)
        time.sleep(0.2)  # the reader takes the last lines
        return code


def test_sigkill_mid_epoch_resumes_fit_at_the_batch_of_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    logdir = tmp_path / "run"
    run = Run(logdir, "--epochs", "1000", "--save-secs", "0", "--save-steps", "10")
    run.wait_for(SAVED, count=5)  # step 40 or more: inside the first epoch or beyond
    run.proc.kill()
    run.finish()
    logged = int(run.find(SAVED)[-1][1])
    # The kill may land between a save's files and its state file, or its log line: the
    # newest complete checkpoint on disk is what a start restores.
    last_saved = newest_complete(logdir)
    assert last_saved in (logged, logged + 10), (logged, last_saved)
    batches = int(run.find(STARTING)[0][1])

    again = Run(logdir, "--epochs", str(last_saved // batches + 2))
    again.wait_for(STARTING)
    _, epoch, batch, step = (int(g) for g in again.find(STARTING)[0].groups())
    assert step == last_saved  # the optimizer's iterations: the global step
    assert epoch * batches + batch == last_saved  # the exact batch (after an epoch's last
    assert batch <= batches  # batch, (e, 47) and (e + 1, 0) are the same place)
    assert again.finish() == 0, again.output()
    final, reason, epoch, batch = again.find(STOPPED)[0].groups()
    assert reason == "requested" and (int(epoch), int(batch)) == (last_saved // batches + 2, 0)
    # Nothing trained twice, nothing skipped: the run ends exactly at the epochs' end.
    assert int(final) == (last_saved // batches + 2) * batches


def test_sigterm_during_fit_exits_preempted_with_a_checkpoint_at_the_last_batch(
    tmp_path: Path,
) -> None:
    logdir = tmp_path / "run"
    run = Run(logdir, "--epochs", "1000", "--save-secs", "30")
    run.wait_for(re.compile(r"^epoch 1 "))  # past the first epoch
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 42, run.output()  # preempted: saved, to be started again
    step, reason, epoch, batch = run.find(STOPPED)[0].groups()
    assert reason == "signal"
    assert tf.train.latest_checkpoint(str(logdir)).endswith(f"model.ckpt-{step}")
    batches = int(run.find(STARTING)[0][1])
    assert int(epoch) * batches + int(batch) == int(step)
