"""Let go of objects whose destruction can block, on a thread nobody waits for.

A ``tf.data`` iterator's destructor waits for the iterator's background threads
(its autotuning model thread among them), which can take seconds; on the training
thread it came between the agreed stop and the final save, so in a multi-worker job
every other worker waited for it. The training thread hands the iterators it is done
with to this module and goes on; their destructors run here.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
from typing import Any

HANDOVER_SECS = 1.0  # how long the releasing frame may keep its own reference
EXIT_WAIT_SECS = 5.0  # at exit, how long destructors still running are waited for

_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_idle = threading.Condition()
_pending = 0  # objects handed over and not yet destroyed (under _idle)


def release(obj: Any) -> None:
    """Destroy ``obj`` on the releaser thread once the caller has dropped it."""
    global _thread, _pending
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="asupervisor-releaser", daemon=True)
            _thread.start()
    with _idle:
        _pending += 1
    _queue.put(obj)


def _run() -> None:
    while True:
        obj = _queue.get()
        # The caller's frame still holds it until that frame returns: wait for ours
        # to be the last reference (the queue's, this name's and getrefcount's
        # argument), so that the destructor runs here and not there.
        deadline = time.monotonic() + HANDOVER_SECS
        while sys.getrefcount(obj) > 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        del obj
        _done()


def _done() -> None:
    global _pending
    with _idle:
        _pending -= 1
        _idle.notify_all()


@atexit.register
def _wait_at_exit() -> None:
    """Before the interpreter finalizes, the destructors handed over are waited for (at
    most ``EXIT_WAIT_SECS``): this daemon thread, back from a TensorFlow destructor into
    a finalizing interpreter, would be ended by an unwind through C++ frames, which
    aborts the process (SIGABRT)."""
    with _idle:
        _idle.wait_for(lambda: _pending <= 0, EXIT_WAIT_SECS)
