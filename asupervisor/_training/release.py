"""Let go of objects whose destruction can block, on a thread nobody waits for.

A ``tf.data`` iterator's destructor waits for the iterator's background threads
(its autotuning model thread among them), which can take seconds; on the training
thread it came between the agreed stop and the final save, so in a multi-worker job
every other worker waited for it. The training thread hands the iterators it is done
with to this module and goes on; their destructors run here.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any

HANDOVER_SECS = 1.0  # how long the releasing frame may keep its own reference

_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def release(obj: Any) -> None:
    """Destroy ``obj`` on the releaser thread once the caller has dropped it."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="asupervisor-releaser", daemon=True)
            _thread.start()
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
