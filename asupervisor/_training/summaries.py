"""The run's events file, and writing values into it."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._log import log
from .._logdir.store import Store
from .past_points import TEMP_PREFIX, drop_past_in

if TYPE_CHECKING:
    import tensorflow as tf

EVENTS_FILE = "events.out.tfevents."  # how TF names every events file
# At a restore, the time the earlier events files may take to lose their points past it:
# a start-up is not held for long by a long run's files; what is left keeps its points
# for the default loader (the SessionLog.START still drops them for the Python one).
REWRITE_BUDGET_SECS = 30.0


def write_values(writer: tf.summary.SummaryWriter, values: Mapping[str, Any], step: int) -> None:
    """Scalars (numbers, 0-d tensors) become scalar summaries; rank >= 1, histograms;
    text (markdown), text summaries."""
    import tensorflow as tf

    with writer.as_default(step=step):
        for tag, value in values.items():
            tensor = tf.convert_to_tensor(value)
            if tensor.dtype == tf.string:
                tf.summary.text(tag, tensor)
            elif tensor.shape.rank == 0:
                tf.summary.scalar(tag, tensor)
            else:
                tf.summary.histogram(tag, tensor)


def scalars(result: Any) -> dict[str, float]:
    """A step's numeric results by name (a bare number is ``loss``); the rest is left out.
    Converting a tensor waits for it: call this at summary time, not every step."""
    if result is None:
        return {}
    items = result.items() if isinstance(result, Mapping) else [("loss", result)]
    found: dict[str, float] = {}
    for key, value in items:
        try:
            found[str(key)] = float(value)
        except (TypeError, ValueError):
            continue
    return found


def writer_options(store: Store) -> dict[str, int]:
    """How often the events file is flushed. TF's writer flushes every ``max_queue`` (10)
    events and every ``flush_millis`` (2 min); a local flush appends what is new. An
    object cannot be appended to: each flush there uploads the whole file again, and
    ``tf.summary.*`` inside steps would upload it every few steps. There it is flushed
    on TF's time (and at each point the summary services write, and at the close);
    the queue's bound keeps memory bounded when steps write many summaries."""
    return {} if store.local else {"max_queue": 10_000}


# The events files this process's sessions made and closed, by full path. Another file
# this process made may be open still (a writer of the user's): it is never rewritten,
# or what its writer writes next would go to a file no longer in the directory.
_CLOSED_HERE: set[str] = set()
_CLOSED_LOCK = threading.Lock()


def _closed_here(store: Store | None, name: str | None) -> None:
    if store is not None and name is not None:
        with _CLOSED_LOCK:
            _CLOSED_HERE.add(store.path(name))


def _not_open_here(store: Store, name: str) -> bool:
    """Whether no writer of this process can have ``name`` open: another process made
    it (TF names a file ``<second>.<host>.<pid>.<counter>.v2``), or one of this
    process's sessions did and closed it."""
    parts = name[len(EVENTS_FILE) :].split(".")
    made_here = (
        len(parts) >= 5
        and parts[-1] == "v2"
        and parts[-3] == str(os.getpid())
        and ".".join(parts[1:-3]) == socket.gethostname()
    )
    if not made_here:
        return True
    with _CLOSED_LOCK:
        return store.path(name) in _CLOSED_HERE


def _second(name: str) -> int | None:
    """The second an events file was made, from its name (``None``: not TF's naming)."""
    try:
        return int(name[len(EVENTS_FILE) :].split(".", 1)[0])
    except ValueError:
        return None


def wait_to_sort_last(names: set[str]) -> None:
    """Wait, if need be, until a file made now sorts after every events file in ``names``.
    TensorBoard reads a directory's events files in the order of their names: the second
    each was made, then host, pid and a counter compared as text. A file made in the same
    second as one already there may be read before it, and the newer session's points are
    then dropped as a crashed session's. So a new file waits for the next second: at most
    a second, and only when a session started in the same second (a quick restart). A
    file from the future (another host's clock) is not waited for."""
    newest = max((s for s in map(_second, names) if s is not None), default=None)
    if newest is None or int(time.time()) != newest:
        return
    until = time.monotonic() + 1.5  # the wall clock may be slewed: bounded all the same
    while int(time.time()) == newest and time.monotonic() < until:
        time.sleep(max(0.001, newest + 1 - time.time()))


def create_events_file(store: Store) -> tuple[tf.summary.SummaryWriter, str | None]:
    """A new writer in the logdir and the name of the events file it writes (``None`` if
    unknown). The file is found by what appeared in the directory: only the chief,
    which holds the logdir lock, creates events files there. Blocking (up to a second
    to sort last, and I/O): not on the event loop."""
    import tensorflow as tf

    def events() -> set[str]:
        return {n for n in store.names() if n.startswith(EVENTS_FILE)}

    before = events()
    wait_to_sort_last(before)
    # Trackable: its resource handle is public, and a lost file is renewed under it.
    writer = tf.summary.create_file_writer(
        store.root, experimental_trackable=True, **writer_options(store)
    )
    writer.flush()
    new = events() - before
    return writer, (new.pop() if len(new) == 1 else None)


class EventsFile:
    """One session's summary writer: made, written, renewed and closed here only; and
    the writers of the runs beside it (``run``), closed with it.

    ``given`` is a writer the user passed in: it is flushed at the end, never
    closed, and never replaced.
    """

    def __init__(self, logdir: str | None, given: tf.summary.SummaryWriter | None) -> None:
        self._store = Store(logdir) if logdir is not None else None
        self._given = given
        self._lock = threading.Lock()
        self.writer: tf.summary.SummaryWriter | None = given
        self.path: str | None = None  # the name of the file, inside the logdir
        self._renew_on: Callable[[], bool] = lambda: True  # where a lost file may be renewed

        self._failure: BaseException | None = None  # the last error of a write of ours
        self._runs: dict[str, EventsFile] = {}  # the runs beside this one, by name

    def open(self, on_training_thread: Callable[[], bool]) -> None:
        """Create the session's file (blocking I/O: not on the event loop). A lost file is
        renewed only where ``on_training_thread()``: no step writes into it meanwhile."""
        self._renew_on = on_training_thread
        if self._given is None and self._store is not None:
            self.writer, self.path = create_events_file(self._store)

    def run(self, name: str) -> EventsFile | None:
        """The events file of the run ``name`` beside this one (in ``<logdir>/<name>``,
        made at the first call, on the training thread; closed with this one), or
        ``None`` where the session has no logdir of its own (a writer the user gave)."""
        with self._lock:
            if self._store is None or self._given is not None or self.writer is None:
                return None
            run = self._runs.get(name)
            if run is None:
                run = self._runs[name] = EventsFile(self._store.path(name), None)
                run.open(self._renew_on)
            return run

    def set_default(self, step: Any) -> None:
        """On the training thread: ``tf.summary.*`` inside steps writes here."""
        if self.writer is not None:
            self.writer.set_as_default(step=step)

    def mark_start(self, step: int) -> None:
        """A ``SessionLog.START`` at ``step`` first in the session's own file: TensorBoard
        drops the points a crashed session wrote at or after it (those past the
        restored checkpoint), as it did for TF1's Supervisor."""
        if self.path is None or self.writer is None:
            return  # a writer the user gave: its contents are the user's
        import tensorflow as tf
        from tensorflow.core.util import event_pb2
        from tensorflow.python.ops import summary_ops_v2

        event = event_pb2.Event(step=step, wall_time=time.time())
        event.session_log.status = event_pb2.SessionLog.START
        with self._lock, self.writer.as_default():
            summary_ops_v2.import_event(tf.constant(event.SerializeToString()))

    def drop_past(
        self, step: int, runs: Mapping[str, int], check: Callable[[], None] = lambda: None
    ) -> int | None:
        """Training thread, at a restore: the earlier events files of the logdir's run
        without their points after ``step``, and those of each run in ``runs`` (a
        subdirectory) without theirs after its own step, so that TensorBoard's default
        loader, which ignores ``SessionLog.START``, draws the history kept too (see
        ``past_points``). Within ``REWRITE_BUDGET_SECS`` in all. The highest step of a
        point dropped from the logdir's run (``None``: none was): where a dead session
        had drawn to. ``check()`` raises when the start-up was given up on. What a
        rewrite that was given up on left (its temporary file) goes first."""
        store = self._store
        if store is None or self._given is not None or self.path is None:
            return None  # a writer the user gave: its contents are the user's
        deadline = time.monotonic() + REWRITE_BUDGET_SECS
        own = {self.path}
        here = store.names()  # each directory listed once: on an object store a request
        places: list[tuple[Store, int, set[str], list[str] | None]] = [(store, step, own, here)]
        places += [
            (Store(store.path(run)), last, set(), None)
            for run, last in runs.items()
            if run in here  # a run never written has no directory to look into
        ]
        reached = None
        for place, last, skip, listing in places:
            listed = place.names() if listing is None else listing
            for leftover in [n for n in listed if n.startswith(TEMP_PREFIX)]:
                with contextlib.suppress(Exception):  # an object store's error too
                    place.remove(leftover)
            names = [
                n
                for n in listed
                if n.startswith(EVENTS_FILE) and n not in skip and _not_open_here(place, n)
            ]
            budget = deadline - time.monotonic()
            if names and budget > 0:
                highest = drop_past_in(place.root, names, last, budget, check)
                reached = highest if place is store else reached
        return reached

    def write(self, values: Mapping[str, Any], step: int) -> None:
        with self._lock:
            self._renew_if_lost()
            if self.writer is not None:
                try:
                    write_values(self.writer, values, step)
                except Exception as exc:
                    self._failure = exc
                    raise

    def failed(self, exc: BaseException) -> bool:
        """Whether ``exc`` says that events could not be written (a full disk), which TF
        reports as ``OutOfRangeError`` too (EFBIG): a write of ours that raised it, or a
        ``tf.summary`` op in a step, whose writer flushes inside the op. TF's error
        names the events file it could not write; nothing else does, since a flush
        after the failure succeeds (the events it held are gone). A flush that fails
        now says it too."""
        if exc is self._failure or EVENTS_FILE in str(exc):
            return True
        if self.writer is None:
            return False
        try:
            self.writer.flush()
        except Exception:
            return True
        return False

    def _renew_if_lost(self) -> None:
        """A new file in place of a deleted one: TF would go on writing into the deleted
        file's inode, and every summary would be lost without a word. The writer stays
        the same object with the same resource, which steps traced earlier hold: only
        the file under it changes."""
        store = self._store
        if self.path is None or store is None or not self._renew_on() or store.exists(self.path):
            return
        import tensorflow as tf

        lost = self.path
        writer: Any = self.writer
        handle = writer.resource_handle  # what traced steps hold (a trackable writer's)
        before = set(store.names())
        with contextlib.suppress(tf.errors.OpError):  # the old file is gone: flush may fail
            tf.raw_ops.CloseSummaryWriter(writer=handle)
        tf.raw_ops.CreateSummaryFileWriter(
            writer=handle,
            logdir=store.root,
            max_queue=10,
            flush_millis=120000,
            filename_suffix=".v2",
        )
        writer.flush()
        new = {n for n in store.names() if n.startswith("events.out.tfevents.")} - before
        self.path = new.pop() if len(new) == 1 else None
        new_path = store.path(self.path) if self.path is not None else None
        log.warning("summary.file_lost", path=store.path(lost), new_path=new_path)

    def close(self) -> BaseException | None:
        """Flush and close (a writer the user gave is flushed, and stays theirs), the
        runs beside it too; the first error if the last events could not be written:
        the session fails with it."""
        with self._lock:
            runs, self._runs = list(self._runs.values()), {}
        lost = [run.close() for run in runs]
        with self._lock:
            if self.writer is not None:
                try:
                    if self._given is None:
                        self.writer.close()  # flushes
                        _closed_here(self._store, self.path)
                    else:
                        self.writer.flush()
                except Exception as exc:
                    lost.insert(0, exc)
        return next((exc for exc in lost if exc is not None), None)
