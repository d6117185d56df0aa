"""The run ledger: one line per session event in ``<logdir>/asupervisor-ledger.jsonl``.

Each session of the chief appends a ``start`` line once it has restored (or begun
fresh), a ``first_step`` line once its first step has ended, and an ``end`` line as it
closes, each with the session's id: a ``start`` without its ``end`` is a session that
was killed (SIGKILL, a lost machine) before it could say how it ended, or stopped at
once (a second SIGINT waits for nothing). Under ``asupervisor run``, the runner writes
the end of a session killed so, with the step of its last beat (``_run/ends``: its line
says ``recorded_by: runner``). ``asupervisor inspect`` shows the sessions,
and from their times what each restart cost (``_logdir/costs``).

Locally a line is appended with ``O_APPEND`` (a kill cannot tear an earlier line) and
fsynced; an object store has no append, so there the file is read and written whole,
keeping the last ``KEEP_ON_OBJECT_STORE`` lines. Only the chief holding the logdir's
lock writes, so there is one writer at a time.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from dataclasses import dataclass, fields
from typing import Any

from .store import Store, write_all

NAME = "asupervisor-ledger.jsonl"
READ_BYTES = 1 << 20  # inspect reads the last MiB: thousands of sessions
KEEP_ON_OBJECT_STORE = 2000


def append(store: Store, record: dict[str, Any]) -> None:
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    if not store.local:
        try:
            old = store.read(NAME, READ_BYTES).decode("utf-8", errors="replace")
        except OSError:
            old = ""
        kept = old.splitlines(keepends=True)[-(KEEP_ON_OBJECT_STORE - 1) :]
        store.write(NAME, "".join(kept).encode() + line)
        return
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(store.path(NAME), flags, 0o644)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(errno.EINVAL, f"{store.path(NAME)} is not a regular file")
        try:
            write_all(fd, line)
            os.fsync(fd)
        except OSError:
            # A full disk writes part of a line: cut it off, or the next line would be
            # glued to it and both lost to every reader.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, status.st_size)
            raise
    finally:
        os.close(fd)


def read(store: Store) -> list[dict[str, Any]]:
    """The ledger's records, oldest first (the last ``READ_BYTES`` of it); lines that do
    not parse (a line cut by a full disk) are skipped."""
    if store.kind(NAME) != "file":
        return []
    if store.local:
        fd = os.open(store.path(NAME), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return []
            size = os.fstat(fd).st_size
            raw = os.pread(fd, READ_BYTES, max(0, size - READ_BYTES))
        finally:
            os.close(fd)
        if size > READ_BYTES:
            raw = raw.split(b"\n", 1)[-1]  # the first line read may be cut
    else:
        raw = store.read(NAME, READ_BYTES * 4)
    records = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("session"), str):
            records.append(record)
    return records


@dataclass
class SessionRecord:
    """One session as the ledger tells it: its start and end lines, merged."""

    session: str
    host: str | None = None
    pid: int | None = None
    attempt: int | None = None
    run: str | None = None  # the `asupervisor run` it was started by (ASUPERVISOR_RUN)
    started: str | None = None
    restored_step: int | None = None
    source: str | None = None
    restored_tier: str | None = None  # with a local tier: "local" or "store"
    restored_commit_at: float | None = None  # when what it restored was committed
    first_step_at: float | None = None  # when its first step ended
    ended: str | None = None
    committed_step: int | None = None  # the newest checkpoint it committed itself
    committed_at: float | None = None
    step: int | None = None
    reason: str | None = None
    outcome: str | None = None
    exit_status: int | None = None
    unsaved_steps: int | None = None
    error: str | None = None
    changed: list[str] | None = None  # what differed from the commit it restored
    recorded_by: str | None = None  # "runner": its end seen by `asupervisor run` (killed)
    last_beat_at: float | None = None  # the runner's: when its last beat was written


_FIELDS = {f.name for f in fields(SessionRecord)}


def sessions(records: list[dict[str, Any]]) -> list[SessionRecord]:
    """Sessions in the order they started; one without an ``end`` line was killed."""
    merged: dict[str, dict[str, Any]] = {}
    for record in records:
        known = {k: v for k, v in record.items() if k in _FIELDS and v is not None}
        merged.setdefault(record["session"], {}).update(known)
    return [SessionRecord(**entry) for entry in merged.values()]
