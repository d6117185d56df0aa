"""The session works on both of anyio's backends (asyncio and trio)."""

from __future__ import annotations

import time

import anyio
import pytest

import asupervisor as asv
from tests.conftest import Pair


@pytest.mark.anyio
async def test_steps_services_errors_and_grace_on_each_backend(logdir: str) -> None:
    pair = Pair()
    sv = asv.Supervisor(
        logdir,
        checkpoint={"p": pair},
        save_model_secs=0.05,
        stop_grace_secs=2,  # the final save's time on a loaded machine; the step hangs 10 s
        save_summaries_secs=0,
        handle_signals=False,
    )
    ticks: list[int] = []
    sv.loop(0.02, lambda: ticks.append(1))
    async with sv.session() as sess:
        for _ in range(10):
            await sess.run(pair.step)
        await sess.run(time.sleep, 0.2)
    assert sess.global_step == 11 and len(ticks) >= 3
    boom = ValueError("same object on every backend")

    def fail() -> None:
        raise boom

    with pytest.raises(ValueError) as raised:
        async with sv.session() as sess:
            assert sess.restore_report.step == 11
            await sess.run(fail)
    assert raised.value is boom

    finished: list[bool] = []

    def long_step() -> None:
        time.sleep(10)
        finished.append(True)

    with pytest.raises(asv.GracePeriodExpired):
        async with sv.session() as sess:
            sess.loop(0.05, sess.request_stop)
            await sess.run(long_step)
    assert not finished, "the session waited for the 10 s step instead of the grace"
    await anyio.sleep(0)
