"""Services cannot hold a session past its grace period, and one that blocks the loop is named."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

import asupervisor as asv
from tests.conftest import named

pytestmark = pytest.mark.anyio


async def test_a_service_that_swallows_its_cancellation_cannot_hold_the_session(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    sv = asv.Supervisor(
        logdir, save_model_secs=0, save_summaries_secs=0, stop_grace_secs=0.5,
        handle_signals=False,
    )  # fmt: skip
    session_over = threading.Event()

    @sv.service
    async def stubborn(sess: asv.ManagedSession) -> None:
        while not session_over.is_set():  # (let go after the test: the loop must end)
            try:
                await sess.sleep_until_stop(1)
            except anyio.get_cancelled_exc_class():
                pass  # swallowed: it goes on

    started = time.monotonic()
    async with sv.session():
        await anyio.sleep(0.1)
    took = time.monotonic() - started
    session_over.set()
    assert took < 30  # bounded by the grace period, not by the service (it never ends)
    (abandoned,) = named(events, "service.abandoned")
    assert abandoned["running"] == ["stubborn"]


async def test_a_service_that_blocks_the_loop_is_named(
    events: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from asupervisor._session import loopwatch as _loopwatch

    monkeypatch.setattr(_loopwatch, "STALL_SECS", 0.3)
    sv = asv.Supervisor(None, handle_signals=False)

    @sv.service
    async def blocker(sess: asv.ManagedSession) -> None:
        await anyio.sleep(0.1)
        time.sleep(1.5)  # blocking call on the event loop

    async with sv.session() as sess:
        await sess.sleep_until_stop(2.0)
    (stalled,) = named(events, "loop.stalled")
    assert stalled["held_by"] == "service:blocker" and "time.sleep" not in stalled["held_by"]
    assert stalled["where"].endswith("in blocker")  # the service's own line
    (resumed,) = named(events, "loop.resumed")
    assert resumed["seconds"] >= 0.3
