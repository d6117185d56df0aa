"""step_timeout_secs: a step that runs too long is reported with every thread's stack."""

from __future__ import annotations

import threading
import time
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
