"""Dead sessions' points past the restored step, taken out of their events files.

Each session starts its own events file with ``SessionLog.START`` at the step after the
restored checkpoint: TensorBoard's Python loader then drops what crashed sessions wrote
at or after it. Its default loader (the ``rustboard`` data server) ignores the marker:
a point of a tag the new session writes again is replaced when the new one comes, but
a sparse tag's point (an evaluation every few thousand steps) past the restored step
stays on the curve for good. So at a restore the chief rewrites the earlier files
without those points, and every loader draws the run the history kept.

A file is rewritten only when it holds such a point: its kept records are copied byte
for byte (their framing and checksums as they were) into a temporary file beside it,
whose name TensorBoard does not read, and that file is renamed over the original, so a
reader sees the old file or the new one, never half of one; the name stays, and with
it the order in which TensorBoard reads the files. Bytes that do not frame a record
(a tail a kill cut short) are kept as they are. Blocking I/O: the training thread's.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Callable, Iterator
from typing import IO

from .._log import log

HEADER = 12  # a record's length (8 bytes) and the length's checksum (4)
FOOTER = 4  # the data's checksum
TEMP_PREFIX = ".asv-rewrite."  # no "tfevents" in it: TensorBoard never reads one
CHECK_EVERY = 4096  # records between two looks at whether the start-up was given up on


def _records(file: IO[bytes]) -> Iterator[tuple[bytes, bytes | None]]:
    """``(raw bytes, the event's data)`` of each record in order; a last piece that does
    not frame a whole record comes with ``None``."""
    while True:
        header = file.read(HEADER)
        if not header:
            return
        if len(header) < HEADER:
            yield header, None
            return
        (length,) = struct.unpack("<Q", header[:8])
        body = file.read(length + FOOTER)
        if len(body) < length + FOOTER:
            yield header + body, None
            return
        yield header + body, body[:length]


def _past(data: bytes | None, last: int) -> int | None:
    """The step of a record that is a summary (a point) at a step after ``last``."""
    if data is None:
        return None
    from tensorflow.core.util import event_pb2

    try:
        event = event_pb2.Event.FromString(data)
    except Exception:  # not an event: kept as it is
        return None
    return int(event.step) if event.HasField("summary") and event.step > last else None


def _open(path: str, mode: str) -> IO[bytes]:
    import tensorflow as tf

    if "://" not in path:
        return open(path, mode)  # closed by the caller's with
    return tf.io.gfile.GFile(path, mode)  # type: ignore[no-any-return]


def has_points_past(
    path: str, last: int, deadline: float, check: Callable[[], None] = lambda: None
) -> bool | None:
    """Whether the file holds a point after step ``last`` (``None``: out of time);
    ``check()`` raises to give up."""
    with _open(path, "rb") as file:
        for count, (_, data) in enumerate(_records(file)):
            if _past(data, last) is not None:
                return True
            if time.monotonic() > deadline:
                return None
            if count % CHECK_EVERY == 0:
                check()
    return False


def drop_points_past(
    directory: str,
    name: str,
    last: int,
    deadline: float,
    check: Callable[[], None] = lambda: None,
) -> tuple[int, int | None] | None:
    """Rewrite ``directory/name`` without the points after step ``last``: how many were
    dropped, and the highest step among them (``(0, None)``: the file was left as it
    was; ``None``: out of time, left as it was)."""
    path = _join(directory, name)
    found = has_points_past(path, last, deadline, check)
    if not found:
        return None if found is None else (0, None)
    temp = _join(directory, f"{TEMP_PREFIX}{os.getpid()}.{name}")
    dropped, highest = 0, last
    try:
        with _open(path, "rb") as source, _open(temp, "wb") as target:
            for count, (raw, data) in enumerate(_records(source)):
                if count % CHECK_EVERY == 0:
                    check()
                step = _past(data, last)
                if step is not None:
                    dropped, highest = dropped + 1, max(highest, step)
                else:
                    target.write(raw)
                if time.monotonic() > deadline:
                    raise TimeoutError
            _sync(target)
        _replace(temp, path)
    except TimeoutError:
        _remove(temp)
        return None
    except BaseException:
        _remove(temp)
        raise
    return dropped, highest


def drop_past_in(
    directory: str,
    names: list[str],
    last: int,
    budget_secs: float,
    check: Callable[[], None] = lambda: None,
) -> int | None:
    """Every file of ``names`` in ``directory`` without its points after step ``last``,
    the newest first, in ``budget_secs`` at most; what could not be read or was not
    reached in time is left as it was (the ``SessionLog.START`` still holds for
    TensorBoard's Python loader), and said. The highest step of a point dropped
    (``None``: none was). ``check()`` raises when the start-up was given up on (a stop
    came): the rewrite ends there, the file in hand as it was."""
    deadline = time.monotonic() + budget_secs
    started = time.perf_counter()
    highest: int | None = None
    for name in sorted(names, reverse=True):
        check()
        try:
            done = drop_points_past(directory, name, last, deadline, check)
        except Exception as exc:
            check()  # given up on: that, not the file, is why
            log.warning(
                "summary.rewrite_failed",
                path=_join(directory, name),
                error=f"{type(exc).__name__}: {exc}",
            )
            continue
        if done is None:
            log.warning(
                "summary.rewrite_out_of_time",
                directory=directory,
                after_step=last,
                budget_secs=budget_secs,
            )
            return highest
        dropped, step = done
        if step is not None:
            highest = step if highest is None else max(highest, step)
        if dropped:
            log.info(
                "summary.points_dropped",
                path=_join(directory, name),
                after_step=last,
                points=dropped,
                seconds=round(time.perf_counter() - started, 4),
            )
    return highest


def _join(directory: str, name: str) -> str:
    return (
        f"{directory.rstrip('/')}/{name}" if "://" in directory else os.path.join(directory, name)
    )


def _sync(file: IO[bytes]) -> None:
    """A local file's bytes on disk before its rename: never an empty file in its place."""
    file.flush()
    with contextlib.suppress(AttributeError, OSError):
        os.fsync(file.fileno())


def _replace(temp: str, path: str) -> None:
    if "://" not in path:
        os.replace(temp, path)  # atomic: the old file or the new one
        return
    import tensorflow as tf

    tf.io.gfile.rename(temp, path, overwrite=True)  # an object is replaced whole


def _remove(path: str) -> None:
    with contextlib.suppress(Exception):
        if "://" not in path:
            os.unlink(path)
        else:
            import tensorflow as tf

            tf.io.gfile.remove(path)
