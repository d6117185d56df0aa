"""step_timeout_secs: a step that runs too long is reported with every thread's stack."""

from __future__ import annotations

import importlib.util
import linecache
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import asupervisor as asv
from tests.conftest import named

pytestmark = pytest.mark.asyncio


HUNG = threading.Event()  # set when the hung step finally returns


def hung_step() -> None:
    time.sleep(10)
    HUNG.set()


async def test_the_watchdog_fires_on_a_step_that_runs_too_long(
    events: list[dict[str, Any]],
) -> None:
    sv = asv.Supervisor(None, step_timeout_secs=0.2, stop_grace_secs=0.2, handle_signals=False)
    HUNG.clear()
    with pytest.raises(asv.StepTimeout, match="hung_step") as raised:
        async with sv.session() as sess:
            await sess.run(lambda: None)
            await sess.run(hung_step)
    assert not HUNG.is_set(), "waited for the 10 s step to end"
    assert sess.stop_reason == "timeout"
    assert "step_timeout_secs=0.2" in str(raised.value)
    (report,) = named(events, "step.timeout")
    assert report["job"].endswith("hung_step") and report["step"] == 1
    stacks = "\n".join(report["stacks"].values())
    assert "hung_step" in stacks and "time.sleep(10)" in stacks
    assert any(name.startswith("asupervisor-training") for name in report["stacks"])


async def test_steps_within_the_timeout_are_left_alone(events: list[dict[str, Any]]) -> None:
    sv = asv.Supervisor(None, step_timeout_secs=0.5, handle_signals=False)
    async with sv.session() as sess:
        for _ in range(5):
            await sess.run(time.sleep, 0.1)
    assert sess.stop_reason == "requested"
    assert not named(events, "step.timeout")


async def test_the_watchdog_times_each_step_of_a_train_loop_not_the_whole_loop(
    events: list[dict[str, Any]],
) -> None:
    # 150 steps of 20 ms: 3 s in all, each step far within 1 s.
    sv = asv.Supervisor(None, step_timeout_secs=1, handle_signals=False)
    async with sv.session() as sess:
        ran = await sess.train(lambda _: time.sleep(0.02), range(150))
    assert ran == 150 and sess.stop_reason == "requested"
    assert not named(events, "step.timeout")


async def test_the_watchdog_catches_one_hung_step_inside_a_train_loop(
    events: list[dict[str, Any]],
) -> None:
    def step(i: int) -> None:
        time.sleep(0.01 if i < 20 else 10)

    sv = asv.Supervisor(None, step_timeout_secs=0.5, stop_grace_secs=0.2, handle_signals=False)
    with pytest.raises(asv.StepTimeout):
        async with sv.session() as sess:
            await sess.train(step, range(100))
    (report,) = named(events, "step.timeout")
    assert report["step"] == 20  # the 21st step hung; the 20 before it did not count
    assert sess.outcome is asv.Outcome.STUCK


async def test_the_watchdog_times_each_batch_of_fit() -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            time.sleep(0.05)

    x = np.zeros((64, 4), "float32")
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(1)  # 64 batches
    model.fit(data.take(1), epochs=1, verbose=0)  # traced before: tracing is not a step
    # The epoch (64 batches of 50 ms: 3.2 s) outlasts the deadline; no batch comes near it,
    # even on a loaded machine.
    sv = asv.Supervisor(None, step_timeout_secs=2.5, handle_signals=False)
    async with sv.session() as sess:
        await sess.fit(model, data, epochs=1, callbacks=[Slow()], verbose=0)
    assert sess.global_step == 64 and sess.stop_reason == "requested"


BLOCKS = """
import threading

def block(release: threading.Event) -> None:
    release.wait()  # the line a hung step's report shows
"""


async def test_the_stacks_read_source_lines_within_their_budget_the_training_thread_first(
    tmp_path: Path,
) -> None:
    # The report is made on the event loop: reading every frame's file there held the loop
    # (and the stop) for seconds on a loaded machine. Past the budget, frames keep their
    # file, line and function; a file not read yet is not read.
    from asupervisor.services.watchdog import thread_stacks

    path = tmp_path / "blocks.py"
    path.write_text(BLOCKS)
    spec = importlib.util.spec_from_file_location("blocks", path)
    assert spec is not None and spec.loader is not None
    blocks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(blocks)
    release = threading.Event()
    thread = threading.Thread(
        target=blocks.block, args=(release,), name="asupervisor-training-test"
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not thread_stacks(60)[training_of(thread)].endswith("waiter.acquire()\n"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        linecache.clearcache()  # no file read yet
        no_time = thread_stacks(budget_secs=0)
        in_time = thread_stacks(budget_secs=60)
    finally:
        release.set()
        thread.join()
    training = training_of(thread)
    # The first line read: where the training thread is (its innermost frame).
    assert no_time[training].endswith("in wait\n    waiter.acquire()\n")
    assert f'File "{path}", line 5, in block\n  File ' in no_time[training]
    assert 'File "' in no_time[training].splitlines()[0]
    assert f'File "{path}", line 5, in block\n    release.wait()' in in_time[training]


def training_of(thread: threading.Thread) -> str:
    return f"{thread.name} ({thread.ident})"
