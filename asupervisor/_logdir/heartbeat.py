"""A running session seen from outside its process: the heartbeat, and how to judge it.

The watchdog runs inside the process, so a process stuck in a collective, in a
driver call or with a blocked event loop looks alive to every orchestrator. While a
session runs, a small JSON file says what it does; another process (``asupervisor
run``, ``asupervisor health``, a Kubernetes liveness probe) reads it and decides.

The fields are chosen so that both kinds of hang show from outside:

- ``written_at``: the file is written by a task on the event loop (the I/O itself in a
  worker thread). A blocked loop, a frozen or dead process writes no more: the beat
  ages.
- ``busy_since``: when the work now on the training thread (one step, a save, a
  ``sess.call``) began, and ``training``: whether it is a training step. A step that
  never ends leaves the beats coming, with this time falling behind.

**The one rule** (``judge``): the step deadline (``--stuck-after``, ``--max-age``) bounds
the age of the beat and one training step; every other work on the training thread (a
save, a ``sess.call``, an epoch's end, a rollback's restore), like start-up (before the
first step has ended) and the stop (the final checkpoint), is bounded by the longer
deadline (``--startup-timeout``, ``--startup-max-age``): a long save is not a step that
does not end.

Times are wall-clock seconds (``time.time()``): the reader is another process, maybe
on another host (an object-store logdir); hosts' clocks must agree to well within the
deadlines. Where it is written: ``<logdir>/.asupervisor.heartbeat`` by the chief (only
the chief writes into the logdir), by any process, the local file named by the
environment variable ``ASUPERVISOR_HEARTBEAT`` if set, and under ``asupervisor run`` down
each process's channel to the runner (``channel``: no file system between them).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import stat
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from .._kinds import Phase
from .._outcome import Outcome
from .store import Store, is_object_store, write_all

NAME = ".asupervisor.heartbeat"  # in the logdir, written by the chief
ENV_FILE = "ASUPERVISOR_HEARTBEAT"  # a local file any session process also writes
HOST_FIELD = "{host}"  # in ENV_FILE's path: this host's name (one file per host)
ENV_ATTEMPT = "ASUPERVISOR_ATTEMPT"  # set by `asupervisor run`: 1 for the first start
ENV_RUN = "ASUPERVISOR_RUN"  # set by asupervisor run: one id per run, in every attempt
# Set by `asupervisor run` when it watches liveness: how long one step may run before the
# runner judges it stuck (its --stuck-after); a session does not wait for such a step again.
ENV_STUCK_AFTER = "ASUPERVISOR_STUCK_AFTER"
VERSION = 1
MAX_BYTES = 64 * 1024  # a beat is a few hundred bytes

# Phases in which the work on the training thread is start-up (restore, the first
# step's tracing) or the stop (the final checkpoint): judged by the longer deadline.
_LONG_PHASES = {Phase.STARTING, Phase.DRAINING, Phase.FINISHING, Phase.CLOSING}


def local_path(template: str, host: str | None = None) -> str:
    """The local heartbeat file ``template`` names on this host: ``{host}`` in it is the
    host's name, so that the workers of a job across hosts, given one path on a file
    system they share, each write (and ``asupervisor health`` on each host reads) a file
    of its own."""
    return template.replace(HOST_FIELD, host if host is not None else socket.gethostname())


@dataclass(frozen=True)
class Beat:
    """One heartbeat: what the session was doing when it was written."""

    pid: int
    host: str
    session: str  # the session's id, also in its ledger lines
    chief: bool
    worker: str | None  # the task in a multi-worker job ("worker:1"), else None
    phase: Phase
    first_step_done: bool
    step: int | None  # None: the session ended before its restore (no step of the run)
    restored_step: int | None
    interval_secs: float  # how often it is written
    started_at: float  # when the session began
    written_at: float
    busy_since: float | None  # when the work on the training thread began; None: idle
    job: str | None  # that work's name
    last_step_at: float | None  # when the step was first seen at its current value
    last_commit_step: int | None  # the newest checkpoint written (or restored) whole
    last_commit_at: float | None  # when it was written (None: restored)
    outcome: Outcome | None = None  # the last beat of a session says how it ended
    exit_status: int | None = None
    version: int = VERSION
    # The busy work is a training step (not a save, a call, an epoch's end, a restore):
    # the step deadline bounds it, the longer one other work. An older writer's beat
    # does not say: judged as a step.
    training: bool = True
    # With a local tier: the steps committed locally that the logdir does not hold yet
    # (lost if the host never comes back); None without one.
    steps_at_risk: int | None = None

    @property
    def at_step(self) -> str:
        """Where it is, in words: "at step 12", or before its restore."""
        return "before its restore" if self.step is None else f"at step {self.step}"

    @property
    def ended(self) -> bool:
        """The session that wrote it has ended (its last beat)."""
        return self.outcome is not None or self.phase is Phase.CLOSED

    def to_json(self) -> bytes:
        data = asdict(self)
        data["phase"] = self.phase.value
        data["outcome"] = None if self.outcome is None else self.outcome.value
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Beat:
        """Parse a beat; ``ValueError`` for anything that is not one."""
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a heartbeat: {exc}") from None
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError("not a heartbeat of this version")
        known = {f.name for f in fields(cls)}
        try:
            data["phase"] = Phase(data["phase"])
            data["outcome"] = None if data.get("outcome") is None else Outcome(data["outcome"])
            beat = cls(**{k: v for k, v in data.items() if k in known})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a heartbeat: {exc}") from None
        for name in ("written_at", "started_at", "interval_secs"):
            value = getattr(beat, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"not a heartbeat: {name}={value!r}")
        return beat

    def as_dict(self) -> dict[str, Any]:
        return dict(json.loads(self.to_json()))


@dataclass(frozen=True)
class Verdict:
    """Whether a run looks alive from outside, and why."""

    stale: bool
    why: str
    limit_secs: float  # the deadline that applied


def stuck_after_from_env() -> float | None:
    """The runner's step deadline (``ENV_STUCK_AFTER``), or ``None`` (not set, not a
    positive number)."""
    try:
        secs = float(os.environ.get(ENV_STUCK_AFTER, ""))
    except ValueError:
        return None
    return secs if secs > 0 else None


def judge(
    beat: Beat | None,
    now: float,
    max_age: float,
    startup_max_age: float,
    *,
    still_running: bool = False,
) -> Verdict:
    """Judge a beat at wall-clock time ``now``.

    ``max_age`` bounds the age of the beat (the event loop answers within it in every
    phase) and the time one training step may take; ``startup_max_age`` bounds any other
    work on the training thread (a save, a call, an epoch's end, a restore), and every
    work before the first step has ended (restore, tracing) and while the session stops
    (the final save). A session that has
    ended is healthy, unless the reader knows its process ``still_running``: a process
    whose session ended must end too, and its last beat may be ``max_age`` old, no more
    (a new session in it beats again).
    """
    if beat is None:
        return Verdict(False, "no heartbeat", startup_max_age)
    age_limit = max(max_age, 3 * beat.interval_secs)
    age = now - beat.written_at
    if beat.ended:
        ended = beat.outcome.value if beat.outcome is not None else "ended"
        said = f"the session has ended ({ended}) {beat.at_step}"
        if still_running and age > age_limit:
            why = f"{said} {age:.1f} s ago and its process still runs (limit {age_limit:g} s)"
            return Verdict(True, why, age_limit)
        return Verdict(False, said, age_limit if still_running else 0.0)
    # The loop is never busy for long in any phase (start-up and the stop run on the
    # training thread): a beat older than max_age is a blocked loop or a lost process.
    long = beat.phase in _LONG_PHASES or not beat.first_step_done or not beat.training
    busy_limit = max(startup_max_age if long else max_age, 3 * beat.interval_secs)
    where = f"{beat.phase.value}, step {beat.step}"
    if age > age_limit:
        return Verdict(
            True,
            f"no heartbeat for {age:.1f} s (limit {age_limit:g} s; {where}): the event loop is "
            "blocked, or the process is frozen or gone",
            age_limit,
        )
    if beat.busy_since is not None and beat.written_at - beat.busy_since > busy_limit:
        busy = now - beat.busy_since
        what = "a training step" if beat.training else "work on the training thread"
        return Verdict(
            True,
            f"{beat.job or 'work on the training thread'} has run for {busy:.1f} s "
            f"(limit {busy_limit:g} s; {where}): {what} that does not end",
            busy_limit,
        )
    limit = busy_limit
    return Verdict(False, f"alive: {where}, beat {max(age, 0.0):.1f} s ago", limit)


def read(path: str) -> Beat | None:
    """The beat in the file at ``path`` (a local path or an object-store URL); ``None``
    if there is none. ``ValueError`` for a file that is not a beat, ``OSError`` for
    one that cannot be read (a FIFO in its place is not opened)."""
    if is_object_store(path):
        directory, _, name = path.rpartition("/")
        store = Store(directory)
        data = store.read_if_there(name, MAX_BYTES)
        return None if data is None else Beat.from_json(data)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        raw = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        raise ValueError(f"{path} is larger than a heartbeat")
    return Beat.from_json(raw)


def write_local(path: str, data: bytes) -> None:
    """Replace the file at ``path`` whole (a reader sees the old beat or the new one).

    Not fsynced: a beat lost in a machine crash is worth nothing, and an fsync at every
    beat would wait behind a checkpoint's writes and make a healthy run look stale."""
    temp = f"{path}.tmp{os.getpid()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        try:
            write_all(fd, data)  # a cut beat would not parse: none is better
        finally:
            os.close(fd)
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise


def wall(monotonic: float | None) -> float | None:
    """A ``time.monotonic()`` reading as wall-clock time."""
    if monotonic is None:
        return None
    return time.time() - (time.monotonic() - monotonic)
