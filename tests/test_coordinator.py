"""Coordinator: stop flag, first error wins, clean stops, waiting across threads."""

from __future__ import annotations

import sys
import threading
import time

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv


def test_first_error_wins_and_is_raised_as_the_same_object() -> None:
    coord = asv.Coordinator()
    first, second = ValueError("first"), KeyError("second")
    coord.request_stop(first)
    coord.request_stop(second)
    assert coord.should_stop() and coord.reason == "exception"
    with pytest.raises(ValueError) as raised:
        coord.raise_requested_exception()
    assert raised.value is first


def test_error_after_a_plain_stop_still_counts() -> None:
    coord = asv.Coordinator()
    coord.request_stop()
    assert coord.reason == "requested"
    boom = RuntimeError("boom")
    coord.request_stop(boom)
    assert coord.error is boom and coord.reason == "exception"


@pytest.mark.parametrize(
    "clean",
    [
        tf.errors.OutOfRangeError(None, None, "End of sequence"),
        StopIteration(),
        StopAsyncIteration(),
    ],
)
def test_clean_stop_types_stop_without_an_error(clean: BaseException) -> None:
    coord = asv.Coordinator()
    coord.request_stop(clean)
    assert coord.should_stop() and coord.reason == "end_of_data"
    coord.raise_requested_exception()  # nothing to raise
    assert coord.error is None


def test_an_out_of_range_error_is_end_of_data_whatever_its_message() -> None:
    # As TF1's Coordinator: the type says it, not the text ("no more data" is a user's
    # own words). A full disk is told apart by where its error came from, in a session
    # (test_end_of_data.py), never by what the message says.
    coord = asv.Coordinator()
    coord.request_stop(tf.errors.OutOfRangeError(None, None, "no more data"))
    assert coord.error is None and coord.reason == "end_of_data"


def test_custom_clean_stop_types() -> None:
    coord = asv.Coordinator(clean_stop_exception_types=(KeyError,))
    coord.request_stop(KeyError("done"))
    assert coord.error is None
    coord.request_stop(StopIteration())  # no longer clean for this coordinator
    assert isinstance(coord.error, StopIteration)


def test_exc_info_tuple_is_accepted() -> None:
    coord = asv.Coordinator()
    try:
        raise OSError("disk")
    except OSError:
        coord.request_stop(sys.exc_info())  # type: ignore[arg-type]
    assert isinstance(coord.error, OSError)


def test_clear_stop_makes_it_reusable() -> None:
    coord = asv.Coordinator()
    coord.request_stop(ValueError("x"))
    coord.clear_stop()
    assert not coord.should_stop() and coord.error is None and coord.reason is None


def test_stop_on_exception_reports_and_suppresses() -> None:
    coord = asv.Coordinator()
    with coord.stop_on_exception():
        raise ZeroDivisionError("oops")
    assert isinstance(coord.error, ZeroDivisionError)
    with coord.stop_on_exception():
        raise tf.errors.OutOfRangeError(None, None, "end")
    assert isinstance(coord.error, ZeroDivisionError)


@pytest.mark.asyncio
async def test_wait_for_stop_times_out_then_wakes_from_another_thread() -> None:
    coord = asv.Coordinator()
    assert await coord.wait_for_stop(0.05) is False

    def stopper() -> None:
        time.sleep(0.1)
        coord.request_stop()

    thread = threading.Thread(target=stopper)
    thread.start()
    # Woken by the stop, not by the timeout (which would return False).
    assert await coord.wait_for_stop(600) is True
    thread.join()
    assert await coord.wait_for_stop(0) is True  # already stopped: at once


@pytest.mark.asyncio
async def test_many_waiters_all_wake() -> None:
    coord = asv.Coordinator()
    woke: list[bool] = []

    async def waiter() -> None:
        woke.append(await coord.wait_for_stop(5))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(waiter)
        await anyio.sleep(0.05)
        coord.request_stop()
    assert woke == [True] * 5


def test_bad_exc_argument() -> None:
    with pytest.raises(TypeError, match="exc"):
        asv.Coordinator().request_stop("boom")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_an_error_reported_after_the_session_ended_is_raised_in_the_reporter() -> None:
    """As TF1's ``testRequestStopRaisesIfJoined``: once the session that used the
    coordinator has ended, nothing will re-raise an error reported to it, so
    ``request_stop`` raises it in the caller (the same object) instead of losing it."""
    sv = asv.Supervisor(None, handle_signals=False)
    async with sv.session() as sess:
        pass
    late = RuntimeError("a thread that outlived the session failed")
    with pytest.raises(RuntimeError) as raised:
        sv.coord.request_stop(late)
    assert raised.value is late
    with pytest.raises(RuntimeError) as raised:
        sess.request_stop(late)  # the session's own face says the same
    assert raised.value is late
    sv.coord.request_stop()  # a clean stop has nothing to lose: no error
    sv.coord.request_stop(StopIteration())
    errors: list[BaseException] = []

    def outlives_the_session() -> None:
        try:
            with sv.coord.stop_on_exception():
                raise OSError("lost in a thread")
        except OSError as exc:
            errors.append(exc)

    thread = threading.Thread(target=outlives_the_session)
    thread.start()
    thread.join()
    assert [type(e) for e in errors] == [OSError]
    sv.coord.clear_stop()  # as TF1: the coordinator keeps errors again
    sv.coord.request_stop(late)
    assert sv.coord.error is late
