"""The protocol's vocabulary, below every part: the stop path's phases, the kinds of work
on the training thread, where a session's state came from. Each is defined once, here,
and compared only as an enum (``tests/test_ownership.py``)."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    FINISHING = "finishing"
    CLOSING = "closing"
    CLOSED = "closed"


class JobKind(enum.Enum):
    """What a job on the training thread is, for the grace period, the watchdog and logs."""

    STEP = "step"  # run, train, fit: steps with their hooks
    CALL = "call"  # sess.call: the user's function, no step counted
    SAVE = "save"  # a checkpoint asked for by a service or the user
    HOLD = "hold"  # between_steps: the thread waits for the loop, doing nothing
    INTERNAL = "internal"  # the session's own work: start-up, the final save, a drain


class RestoreSource(str, enum.Enum):
    """Where a session's state came from. A ``str``: ``source == "checkpoint"`` holds."""

    CHECKPOINT = "checkpoint"
    INIT_FN = "init_fn"
    FRESH = "fresh"
    INTERRUPTED = "interrupted"
    """A stop came before anything was restored; nothing trains or is saved."""

    def __str__(self) -> str:
        return self.value
