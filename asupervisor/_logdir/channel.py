"""A child's reports to ``asupervisor run``: JSON lines on a pipe the runner gave it.

A heartbeat file needs a file system the child can write and the runner can read; when
that fills up or goes away, a healthy child looks dead. So ``asupervisor run`` gives each
process it starts the write end of a pipe (its number in ``ASUPERVISOR_CHANNEL``) and
reads the other end: a pipe is memory, it cannot fill a disk, and while the runner
reads it, a write never waits. What a child cannot write elsewhere (its logdir's
heartbeat, its ledger) it reports here; only silence on the channel is "not alive".

One JSON object per line, each with its ``kind``:

- ``ready``: a warm standby has imported its modules (``_run/standby.py`` writes it by
  hand: it imports nothing of this package before it is ready);
- ``session``: a session began in the process (its id, its ``stop_grace_secs``, and a
  chief's logdir: the runner reads the commits of the attempt from its history);
- ``beat``: the session's heartbeat (``heartbeat.Beat``), every ``heartbeat_secs``;
- ``commit``: the session committed a checkpoint (its own save; a restore is not one);
- ``unwritten``: a heartbeat or ledger write of the session failed (reported once per
  file).

A line is at most ``PIPE_BUF`` bytes, so that writes from two threads never mix, and
every report fits one: each text in it (a job's name, a host, an error) takes at most
``FIELD_BYTES``, cut with a mark past that (a path that would be cut is left out: a cut
path names another place). A report too long to send would silence a healthy process.
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
import select
from dataclasses import dataclass
from typing import Any

from .heartbeat import Beat

ENV = "ASUPERVISOR_CHANNEL"  # set by `asupervisor run`: the pipe's write end, a number
MAX_LINE = select.PIPE_BUF  # one write, never interleaved with another


class Kind(str, enum.Enum):
    READY = "ready"
    SESSION = "session"
    BEAT = "beat"
    COMMIT = "commit"
    UNWRITTEN = "unwritten"


@dataclass(frozen=True)
class Ready:
    """A standby's imports are done."""

    seconds: float


@dataclass(frozen=True)
class SessionBegan:
    session: str
    pid: int
    chief: bool
    stop_grace_secs: float
    # Where a chief's session commits (its history records each commit with the run and
    # attempt): what the runner reads after the attempt, whatever reached the channel.
    logdir: str | None = None


@dataclass(frozen=True)
class Commit:
    """A checkpoint the session wrote and committed (never one it restored)."""

    session: str
    step: int
    at: float  # wall-clock time of the commit


@dataclass(frozen=True)
class Unwritten:
    """A write that failed: the process is alive, the file is not up to date."""

    path: str
    error: str


Report = Ready | SessionBegan | Beat | Commit | Unwritten

_KINDS: dict[type[Any], Kind] = {
    Ready: Kind.READY,
    SessionBegan: Kind.SESSION,
    Beat: Kind.BEAT,
    Commit: Kind.COMMIT,
    Unwritten: Kind.UNWRITTEN,
}


FIELD_BYTES = 512  # a text's JSON in a report: a beat's four texts and its numbers fit
CUT = "..."
PATHS = frozenset({"logdir"})  # left out, not cut, when too long


def encode(report: Report) -> bytes:
    """One line for ``report``, at most ``MAX_LINE`` bytes whatever its texts hold."""
    if isinstance(report, Beat):
        body: dict[str, Any] = {"beat": _bounded(report.as_dict())}
    else:
        body = _bounded(dict(report.__dict__))
    return (json.dumps({"kind": _KINDS[type(report)].value, **body}) + "\n").encode()


def _bounded(fields: dict[str, Any]) -> dict[str, Any]:
    """Each text cut to ``FIELD_BYTES`` of JSON (a path too long: ``None``)."""
    out = dict(fields)
    for key, value in fields.items():
        if isinstance(value, str) and len(json.dumps(value)) > FIELD_BYTES:
            out[key] = None if key in PATHS else cut(value, FIELD_BYTES)
    return out


def cut(text: str, limit: int) -> str:
    """``text`` with its end cut off and marked, so that its JSON takes at most ``limit``
    bytes (a character takes one to six)."""
    keep = len(text)
    while keep > 0 and (excess := len(json.dumps(text[:keep] + CUT)) - limit) > 0:
        keep = max(0, keep - excess)  # each character left out takes a byte at least
    return text[:keep] + CUT


def decode(line: bytes) -> Report | None:
    """The report in one line; ``None`` for a line that is not one (a child may write
    anything into a file descriptor it was given)."""
    try:
        data = json.loads(line)
        kind = Kind(data.pop("kind"))
        if kind is Kind.BEAT:
            return Beat.from_json(json.dumps(data["beat"]).encode())
        cls = next(c for c, k in _KINDS.items() if k is kind)
        return cls(**data)  # type: ignore[no-any-return]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class Receiver:
    """The runner's end: bytes in, reports out (a partial line waits for its end)."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, chunk: bytes) -> list[Report]:
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        if len(self._partial) > MAX_LINE:
            self._partial = b""  # not a report: no line is that long
        return [r for r in map(decode, lines) if r is not None]


class Sender:
    """A process's end: nonblocking, so that a send never waits (a runner that does not
    read loses reports, and the sender goes on)."""

    def __init__(self, fd: int) -> None:
        os.set_inheritable(fd, False)  # not for the processes the child starts
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        self.fd = fd

    def send(self, report: Report) -> None:
        """``OSError`` when the line could not be written whole (the pipe is full, or the
        runner is gone)."""
        line = encode(report)
        if len(line) > MAX_LINE:
            raise ValueError(f"a report of {len(line)} bytes does not fit one pipe write")
        os.write(self.fd, line)


def sender() -> Sender | None:
    """This process's channel to ``asupervisor run``, if it was given one (each session of
    the process opens it anew: the number is the process's, the flags are set again)."""
    try:
        return Sender(int(os.environ.get(ENV, "")))
    except (ValueError, OSError):  # no number, or not an open file descriptor
        return None
