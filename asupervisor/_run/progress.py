"""What an attempt of ``asupervisor run`` committed, as the history on disk records it.

A session tells the runner of each commit on its channel with its next beat: a process
killed between a commit and that beat takes the report with it, and the commit is on
disk all the same (a false crash loop, if the runner believed only its channel). So the
runner's judgement of a failed attempt reads the history of each logdir the attempt's
sessions commit to (each chief's session says where on its channel as it begins;
``--logdir`` too) once every process of the attempt has ended: the commits the history
records with this run and this attempt (``History.saved_by``: saves, never a restore).
The channel is the fast path: what it told counts too (a history that cannot be read).

Bounded: the reads run in a worker thread, given up on after ``READ_SECS`` (an object
store out of reach); a logdir that cannot be read is said, never a reason to fail. No
TensorFlow for a local logdir.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import anyio

from .._logdir.history import read_history
from .._logdir.store import Store, is_object_store

READ_SECS = 10.0


@dataclass(frozen=True)
class Recorded:
    """The commits the history records for one attempt, over the logdirs read."""

    commits: int = 0
    newest: int | None = None  # the highest step among them
    unread: tuple[str, ...] = ()  # a logdir that could not be read, and why, each

    def plus(self, other: Recorded) -> Recorded:
        """Both reads' commits together (the local tier's and the logdir's)."""
        steps = [s for s in (self.newest, other.newest) if s is not None]
        return Recorded(
            self.commits + other.commits, max(steps, default=None), self.unread + other.unread
        )


def places(logdirs: Iterable[str]) -> list[str]:
    """Each logdir once (a local one as an absolute path: ``--logdir`` and a session may
    name the same directory two ways)."""
    seen: list[str] = []
    for logdir in logdirs:
        place = logdir if is_object_store(logdir) else os.path.abspath(logdir)
        if place not in seen:
            seen.append(place)
    return seen


def read_recorded(logdirs: Iterable[str], run: str, attempt: int) -> Recorded:
    """The commits of ``run``'s ``attempt`` in the histories of ``logdirs`` (blocking)."""
    commits, steps, unread = 0, [], []
    for place in places(logdirs):
        try:
            saved = read_history(Store(place)).saved_by(run, attempt)
        except Exception as exc:  # an object store's TF error too: only a phrase here
            unread.append(f"{place}: {type(exc).__name__}: {exc}"[:300])
            continue
        commits += len(saved)
        steps += [c.step for c in saved if c.step is not None]
    return Recorded(commits, max(steps, default=None), tuple(unread))


async def recorded(
    logdirs: Iterable[str], run: str, attempt: int, within: float = READ_SECS
) -> Recorded:
    """``read_recorded`` off the event loop, given up on after ``within`` seconds."""
    wanted = places(logdirs)
    with anyio.move_on_after(within):
        return await anyio.to_thread.run_sync(
            read_recorded, wanted, run, attempt, abandon_on_cancel=True
        )
    return Recorded(unread=tuple(f"{p}: no answer within {within:g} s" for p in wanted))
