"""Drive tests/faults/trainer.py in subprocesses: follow its output, kill it, check the logdir."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests import forked

TRAINER = Path(__file__).with_name("trainer.py")
ROOT = TRAINER.parents[2]


class Trainer:
    """One trainer process, with its output lines collected as they come."""

    def __init__(self, logdir: str, *args: str, script: Path = TRAINER) -> None:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
        self.proc = forked.Popen(
            [sys.executable, str(script), logdir, *args],
            stdin=subprocess.PIPE,  # --wait-for-go reads "go" there
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        self.restored: int | None = None
        self.last_step = -1
        self.last_saved = -1
        self.stopped: tuple[int, str] | None = None
        self.diverged: int | None = None  # the step that was to have a NaN loss
        self.after_nan: int | None = None  # the first step reported after it
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_errors, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word, *rest = line.split()
            with self._changed:
                self.lines.append(line.rstrip())
                if word == "restored":
                    self.restored = int(rest[0])
                elif word == "step":
                    self.last_step = int(rest[0])
                elif word == "saved":
                    self.last_saved = max(self.last_saved, int(rest[0]))
                elif word == "stopped":
                    self.stopped = (int(rest[0]), rest[1])
                elif word == "nan":
                    self.diverged, self.after_nan = int(rest[0]), None
                if word == "step" and self.diverged is not None and self.after_nan is None:
                    self.after_nan = int(rest[0])
                self._changed.notify_all()

    def _read_errors(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.errors.append(line)

    def stderr_text(self) -> str:
        return "".join(self.errors)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not condition():
                if self.proc.poll() is not None and not condition():
                    time.sleep(0.2)  # let the reader catch the last lines
                    if condition():
                        return
                    raise AssertionError(
                        f"trainer exited ({self.proc.returncode}):\n"
                        + "\n".join(self.lines[-5:])
                        + self.stderr_text()[-3000:]
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("trainer timed out:\n" + "\n".join(self.lines[-5:]))
                self._changed.wait(min(left, 0.2))

    def wait_restored(self) -> int:
        self.wait_for(lambda: self.restored is not None)
        assert self.restored is not None
        return self.restored

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def send(self, command: str) -> None:
        """A line on the trainer's stdin (``--commands``: ``nan``, ``stop``)."""
        if command == "nan":
            with self._changed:  # what the next "nan" line says, not an earlier one's
                self.diverged = self.after_nan = None
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()


def checkpoint_problems(logdir: str) -> tuple[int, list[str]]:
    """How many of the history's commits are on disk, and what is wrong with any of
    them: each must read back whole and hold one step boundary (a == b == its step).
    What is on disk is what the run's history says (the library's own reader), never a
    parse of file names."""
    import tensorflow as tf

    from asupervisor._logdir.history import read_history
    from asupervisor._logdir.store import Store
    from asupervisor._logdir.verify import verify_checkpoint

    store = Store(logdir)
    problems, count = [], 0
    for commit in read_history(store).committed():
        count += 1
        prefix, name = store.path(commit.name), commit.name
        problem = verify_checkpoint(prefix)
        if problem:
            problems.append(f"{name}: {problem}")
            continue
        reader = tf.train.load_checkpoint(prefix)
        values = {
            k.split("/")[1]: float(reader.get_tensor(k))
            for k in reader.get_variable_to_shape_map()
            if k.startswith("pair/") and k.split("/")[1] in ("a", "b")
        }
        if not values["a"] == values["b"] == commit.step:
            problems.append(f"{name}: a={values['a']} b={values['b']}, not step {commit.step}")
    return count, problems


@dataclass
class KillReport:
    trials: int = 0
    resumed: int = 0
    went_back: int = 0  # runs that restored a step below the previous run's restore
    lost_steps: list[int] = field(default_factory=list)
    checkpoints: int = 0
    problems: list[str] = field(default_factory=list)
    orphans: int = -1  # checkpoints on disk the state file does not name, after a clean run
    orphan_names: list[str] = field(default_factory=list)
    clean_exit: int | None = None  # the clean run's exit status, and the end of its stderr
    clean_stderr: str = ""
    seconds: float = 0.0


def kill_trials(logdir: str, trials: int, seed: int, save_steps: int, *extra: str) -> KillReport:
    """Start, let it train a random while, SIGKILL it; again and again on one logdir."""
    rng = random.Random(seed)
    report = KillReport()
    started = time.monotonic()
    previous_restore, previous_last_step = 0, None
    for _ in range(trials):
        run = Trainer(logdir, "--save-steps", str(save_steps), *extra)
        restored = run.wait_restored()
        report.trials += 1
        report.resumed += restored >= previous_restore
        report.went_back += restored < previous_restore
        if previous_last_step is not None:
            report.lost_steps.append(previous_last_step - restored)
        run.wait_for(lambda r=run: r.last_step >= 0)
        time.sleep(rng.uniform(0.05, 1.5))
        run.kill()
        previous_restore, previous_last_step = restored, max(run.last_step, restored)
    # The runs after the kills are not about the grace: a final save on a loaded machine
    # may take longer than the trials' second, and the clean run must end clean.
    final = Trainer(logdir, "--max-steps", "0", "--grace", "120", *extra)  # to restore
    restored = final.wait_restored()
    final.proc.wait(180)
    report.went_back += restored < previous_restore
    if previous_last_step is not None:
        report.lost_steps.append(previous_last_step - restored)
    # A clean run that saves twice: what the kills left must be committed or swept by now.
    clean = Trainer(logdir, "--max-steps", str(restored + 2 * save_steps), "--save-steps",
                    str(save_steps), "--grace", "120", *extra)  # fmt: skip
    report.clean_exit = clean.proc.wait(300)
    time.sleep(0.2)  # the reader takes the last lines
    report.clean_stderr = clean.stderr_text()[-3000:]
    report.orphan_names = orphans(logdir)
    report.orphans = len(report.orphan_names)
    report.checkpoints, report.problems = checkpoint_problems(logdir)
    report.seconds = time.monotonic() - started
    return report


def orphans(logdir: str) -> list[str]:
    """The supervisor's checkpoints on disk that the run's history does not name."""
    from asupervisor._logdir.history import index_names, read_history
    from asupervisor._logdir.store import Store

    store = Store(logdir)
    named = {c.name for c in read_history(store).committed()}
    return sorted(n for n in index_names(store) - named if n.startswith("model.ckpt-"))
