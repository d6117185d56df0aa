"""A run interrupted any number of times ends where the same run left alone ends.

A search across real processes (tests/faults/deterministic.py, forked, really killed):
a deterministic run of ``sess.train(step, data, epochs=)`` or of ``sess.fit`` with
validation, EarlyStopping, ReduceLROnPlateau and ModelCheckpoint is started, interrupted
with SIGKILL or SIGTERM after a random number of steps, saves, epoch ends or validations,
started again, and so on; then it runs to its end, and its final state (weights, the
optimizer's iterations, the learning rate, Dropout's random state, a hook's and the
callbacks' kept state) and the batches it trained, in order, must be bitwise those of the
run left alone.

The suite runs a short search from the suite's random seed, printed (``ASV_SEED=<seed>``
replays it, as for the other searches: tests/search.py); ``ASV_FUZZ=1`` (``make fuzz``) a
long one. Each sequence a search finds is
kept below as a plain regression test.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.conftest import RUN_DIR_ENV
from tests.faults.deterministic import batch_differences, compare, trained
from tests.faults.harness import Trainer
from tests.gcs_fixture import FakeGcs
from tests.search import replay_line, search_seed

FUZZ = os.environ.get("ASV_FUZZ") == "1"
SEED = search_seed()
PROGRAM = Path(__file__).parent / "faults" / "deterministic.py"
MARKERS = {  # what a run prints, by the moment an interruption follows
    "step": "step ",
    "save": "saved ",
    "epoch end": "epoch ",
    "validation": "validating",
}
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}

pytestmark = pytest.mark.slow


class Run:
    """One logdir, and the processes that train in it one after the other."""

    def __init__(
        self,
        directory: str,
        mode: str,
        logdir: str | None = None,
        local: str | None = None,
        per_call: int = 1,
    ) -> None:
        self.directory, self.mode, self.per_call = directory, mode, per_call
        self.logdir = logdir or os.path.join(directory, "run")
        self.local = local  # a local tier, in front of the logdir
        self.tiers: list[str] = []  # where each start restored from (a local tier's)
        self.record = os.path.join(directory, "trained")
        self.final = os.path.join(directory, "final.npz")
        self.process: Trainer | None = None
        self.finished = False
        self.story: list[str] = []  # what was done, for a failure's message
        self.restored: list[int | None] = []  # the step each start restored

    def start(
        self, backend: str = "asyncio", background: bool = False, save_steps: int = 7
    ) -> None:
        args = ["--mode", self.mode, "--record", self.record, "--final", self.final]
        args += ["--backend", backend, "--save-steps", str(save_steps)]
        args += ["--per-call", str(self.per_call)]
        args += ["--async"] if background else []
        args += ["--local-dir", self.local] if self.local else []
        self.process = Trainer(self.logdir, *args, script=PROGRAM)
        self.story.append(f"start({backend}, async={background}, save_steps={save_steps})")
        process = self.process
        # The tier's line comes after the restore's: both are known once it is out.
        process.wait_for(lambda: any(line.startswith("tier ") for line in process.lines))
        self.tiers.append(next(ln.split()[1] for ln in process.lines if ln.startswith("tier ")))
        self.restored.append(process.restored)

    def interrupt(self, after: str, count: int, how: str) -> None:
        """``how`` once ``count`` more ``after`` markers are out (or the run has ended)."""
        process = self.process
        assert process is not None
        marker = MARKERS[after if self.mode == "fit" or after in ("step", "save") else "save"]
        seen = sum(line.startswith(marker) for line in list(process.lines))

        def reached() -> bool:
            now = sum(line.startswith(marker) for line in list(process.lines))
            return now >= seen + count or process.proc.poll() is not None

        process.wait_for(reached, timeout=300)
        process.proc.send_signal(SIGNALS[how])
        code = process.proc.wait(300)
        self.process = None
        if how == "SIGKILL" and "://" in self.logdir:  # the killed chief's lease (30 s)
            with contextlib.suppress(Exception):
                import tensorflow as tf

                tf.io.gfile.remove(f"{self.logdir}/.asupervisor.lease")
        self.story.append(f"interrupt(after={count} {after}, {how}) -> exit {code}")
        # -SIGTERM: it came after the session had ended, before the process did (the
        # session's handler is gone then): the run is over, its final state maybe not.
        assert code in (0, 42, -signal.SIGKILL, -signal.SIGTERM), self._failed(process, code)
        self.finished = code == 0  # it had trained to its end before the signal

    def to_the_end(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process = None
        if not self.finished:
            self.start()
            process = self.process
            assert process is not None
            code = process.proc.wait(600)
            self.process = None
            assert code == 0, self._failed(process, code)
        self.story.append("to the end")

    def once_more(self) -> None:
        """Started again after its end (as after a kill between its final save and its
        exit): it has nothing left to train."""
        self.finished = False
        self.to_the_end()

    def _failed(self, process: Trainer, code: int) -> str:
        return f"exit {code} after {self.story}:\n{process.stderr_text()[-3000:]}"

    def outcome(self) -> tuple[dict[str, Any], list[tuple[int, tuple[int, ...]]]]:
        return dict(np.load(self.final)), trained(self.record)


_alone: dict[tuple[str, int], tuple[dict[str, Any], list[tuple[int, tuple[int, ...]]]]] = {}


def left_alone(
    mode: str, per_call: int = 1
) -> tuple[dict[str, Any], list[tuple[int, tuple[int, ...]]]]:
    """The run left alone: once per test run where its processes share a directory
    (pytest-xdist's workers: tests/conftest.py), else once per test process. The tests of
    one mode are dealt to different workers, and each trained it again."""
    if (mode, per_call) not in _alone:
        shared = os.environ.get(RUN_DIR_ENV)
        if shared:
            _alone[mode, per_call] = _left_alone_in(Path(shared), mode, per_call)
        else:
            directory = tempfile.mkdtemp(prefix="asv-alone-")
            run = Run(directory, mode, per_call=per_call)
            run.to_the_end()
            _alone[mode, per_call] = run.outcome()
            shutil.rmtree(directory, ignore_errors=True)
    return _alone[mode, per_call]


def _left_alone_in(
    shared: Path, mode: str, per_call: int
) -> tuple[dict[str, Any], list[tuple[int, tuple[int, ...]]]]:
    """The run left alone in ``shared``: trained by the first process that asks, while
    the others wait for its lock; a run cut short (its process failed) is trained again."""
    directory = shared / f"left-alone-{mode}-{per_call}"
    with open(f"{directory}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = directory / "done"
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            Run(str(directory), mode, per_call=per_call).to_the_end()
            done.touch()
        return Run(str(directory), mode, per_call=per_call).outcome()


def assert_same_as_left_alone(run: Run) -> None:
    final, batches = run.outcome()
    reference, reference_batches = left_alone(run.mode, run.per_call)
    differences = compare(final, reference)
    moved = batch_differences(batches, reference_batches)
    assert differences["weights_bitwise"] and not differences["unequal"], (run.story, differences)
    assert moved == {"batches_moved": 0, "examples_repeated": 0, "examples_skipped": 0}, (
        run.story,
        moved,
    )


def machine(mode: str) -> Callable[[], RuleBasedStateMachine]:
    class Interruptions(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.run = Run(tempfile.mkdtemp(prefix="asv-resume-"), mode)

        @precondition(lambda self: self.run.process is None and not self.run.finished)
        @rule(
            backend=st.sampled_from(["asyncio", "trio"]),
            background=st.booleans(),
            save_steps=st.sampled_from([3, 7, 11]),
        )
        def start(self, backend: str, background: bool, save_steps: int) -> None:
            self.run.start(backend, background, save_steps)

        @precondition(lambda self: self.run.process is not None)
        @rule(
            after=st.sampled_from(list(MARKERS)),
            count=st.integers(1, 25),
            how=st.sampled_from(list(SIGNALS)),
        )
        def interrupt(self, after: str, count: int, how: str) -> None:
            self.run.interrupt(after, count if after == "step" else 1 + count % 2, how)

        @precondition(lambda self: self.run.finished)
        @rule()
        def over(self) -> None:
            """The run trained to its end before a signal reached it: nothing left to do."""

        def teardown(self) -> None:
            try:
                self.run.to_the_end()
                assert_same_as_left_alone(self.run)
            finally:
                if self.run.process is not None:
                    self.run.process.kill()
                shutil.rmtree(self.run.directory, ignore_errors=True)

    return seed(SEED)(Interruptions)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["train", "fit"])
def test_a_run_interrupted_at_random_ends_as_the_run_left_alone(mode: str) -> None:
    print(f"resume equivalence search: {replay_line()}")
    run_state_machine_as_test(
        machine(mode),
        settings=settings(
            max_examples=25 if FUZZ else 1,
            stateful_step_count=12 if FUZZ else 5,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        ),
    )


# -- sequences found, kept -----------------------------------------------------------


def test_fit_stopped_mid_epoch_by_sigterm_reads_the_rest_of_the_epoch_as_left_alone(
    tmp_path: Path,
) -> None:
    """Keras opened each epoch's data twice (at the end of the epoch before, and at its
    start): the run left alone read the reshuffled second iteration, a resumed one the
    first. And the resumed epoch's logs (the loss's running mean) covered only the batches
    after the resume."""
    run = Run(str(tmp_path), "fit")
    run.start()
    run.interrupt("step", 27, "SIGTERM")
    run.start("trio")
    run.interrupt("validation", 1, "SIGKILL")
    run.to_the_end()
    assert_same_as_left_alone(run)


def test_train_killed_after_async_saves_then_stopped_by_sigterm_ends_as_left_alone(
    tmp_path: Path,
) -> None:
    run = Run(str(tmp_path), "train")
    run.start(background=True, save_steps=3)
    run.interrupt("save", 2, "SIGKILL")
    run.start(save_steps=11)
    run.interrupt("step", 14, "SIGTERM")
    run.to_the_end()
    assert_same_as_left_alone(run)


def test_fit_started_again_after_its_end_ends_as_left_alone(tmp_path: Path) -> None:
    """Found by the search: a run killed after its final save, started again, had nothing
    left to train, and its callbacks stayed as made (EarlyStopping's best was None)."""
    run = Run(str(tmp_path), "fit")
    run.to_the_end()
    run.once_more()
    assert_same_as_left_alone(run)


def test_train_killed_with_two_tiers_in_front_of_a_store_ends_as_left_alone(
    tmp_path: Path, gcs: FakeGcs
) -> None:
    """Saves into a local tier, mirrored to the store: killed after local saves (it
    resumes from the local tier), killed again, then started on a new host (the local
    tier gone: from the store)."""
    local = str(tmp_path / "local")
    run = Run(str(tmp_path), "train", logdir=gcs.new_path(), local=local)
    # Early kills: a loaded machine lets a run go on well past the marker it is killed at,
    # and a run that reached its end before the second kill leaves no start for the new host.
    run.start(save_steps=3)
    run.interrupt("save", 1, "SIGKILL")
    run.start(background=True, save_steps=5)
    run.interrupt("step", 3, "SIGKILL")
    assert not run.finished, run.story
    shutil.rmtree(local)  # a new host
    run.to_the_end()
    assert run.tiers == ["None", "local", "store"], run.story
    assert_same_as_left_alone(run)


# -- many steps per call --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["train", "fit"])
def test_ten_steps_per_call_killed_three_times_and_stopped_three_times_ends_as_left_alone(
    tmp_path: Path, mode: str
) -> None:
    """``sess.train(steps_per_loop=10)`` / fit's ``steps_per_execution=10``: SIGKILLed
    right after a commit and right after a call's end (before its save), SIGTERMed during
    a call (the stop waits for its end and saves there), on both loops, with synchronous
    and background saves; the run then ends bitwise as the same run left alone, having
    trained the same batches in the same order."""
    run = Run(str(tmp_path), mode, per_call=10)
    run.start("asyncio", save_steps=15)
    run.interrupt("save", 1, "SIGKILL")  # just after a commit
    run.start("trio", background=True)
    run.interrupt("step", 2, "SIGTERM")
    run.start("asyncio")
    run.interrupt("step", 1, "SIGKILL")  # a call ended, its save maybe in flight
    run.start("trio", save_steps=15)
    run.interrupt("save", 1, "SIGTERM")
    run.start("asyncio", background=True, save_steps=15)
    run.interrupt("step", 1, "SIGKILL")
    run.start("trio")
    run.interrupt("step", 1, "SIGTERM")
    assert not run.finished, run.story  # every interruption came before the run's end
    # Each start restored a call's boundary: saves and stops are made only there.
    assert [step % 10 for step in run.restored if step is not None] == [0] * 6, run.restored
    run.to_the_end()
    assert_same_as_left_alone(run)
