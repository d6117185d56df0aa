"""SIGTERM and SIGINT: graceful stop, final checkpoint, a second SIGINT, handlers restored."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor._checkpoints import verify_checkpoint
from tests.conftest import Pair, named
from tests.faults.harness import Trainer


@pytest.mark.asyncio
async def test_sigterm_in_process_stops_gracefully_and_restores_the_users_handler(
    logdir: str, pair: Pair, events: list[dict[str, Any]]
) -> None:
    received: list[int] = []

    def users_handler(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, users_handler)
    try:
        sv = asv.Supervisor(
            logdir, checkpoint={"p": pair}, save_model_secs=60, save_summaries_secs=0
        )
        async with sv.session() as sess:
            assert signal.getsignal(signal.SIGTERM) is not users_handler
            while not sess.should_stop():
                await sess.run(pair.step)
                if sess.global_step == 7:
                    os.kill(os.getpid(), signal.SIGTERM)
                await anyio.sleep(0)
        assert sess.stop_reason == "signal"
        assert sess.global_step >= 7
        assert tf.train.latest_checkpoint(logdir).endswith(f"model.ckpt-{sess.global_step}")
        assert signal.getsignal(signal.SIGTERM) is users_handler
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM]  # the user's handler works again
        got = named(events, "signal.received")
        assert got and got[0]["signal"] == "SIGTERM"
        assert named(events, "stop.requested")[0]["reason"] == "signal"
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.asyncio
async def test_handle_signals_false_leaves_handlers_alone(pair: Pair) -> None:
    before = signal.getsignal(signal.SIGINT)
    sv = asv.Supervisor(None, checkpoint={"p": pair}, handle_signals=False)
    async with sv.session():
        assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
def test_sigterm_to_a_training_process_loses_no_step(tmp_path: Path) -> None:
    logdir = str(tmp_path / "run")
    run = Trainer(logdir)
    run.wait_for(lambda: run.last_step >= 20)
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(60) == 0, run.stderr_text()
    assert run.stopped == (run.last_step, "signal")
    assert run.last_saved == run.last_step  # the final checkpoint is the last completed step
    latest = tf.train.latest_checkpoint(logdir)
    assert latest.endswith(f"model.ckpt-{run.last_step}")

    again = Trainer(logdir, "--max-steps", str(run.last_step + 3))
    assert again.wait_restored() == run.last_step  # zero lost steps
    assert again.proc.wait(60) == 0


@pytest.mark.slow
def test_a_second_sigint_stops_at_once_without_a_final_save(tmp_path: Path) -> None:
    logdir = str(tmp_path / "run")
    run = Trainer(logdir, "--save-steps", "1", "--pause", "3")
    run.wait_for(lambda: run.last_step >= 1)
    time.sleep(0.3)
    run.proc.send_signal(signal.SIGINT)  # step 2 is in flight for ~3 s: a graceful stop waits
    time.sleep(0.3)
    second = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    code = run.proc.wait(30)
    assert time.monotonic() - second < 2.0, "the second SIGINT did not stop at once"
    assert code != 0 and "KeyboardInterrupt" in run.stderr_text()
    assert run.stopped is None and run.last_saved == 1
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-1")
    assert verify_checkpoint(os.path.join(logdir, "model.ckpt-1")) is None
