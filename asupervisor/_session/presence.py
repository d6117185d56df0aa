"""What a running session shows outside its process: its heartbeat and its ledger lines.

One task on the event loop writes the heartbeat every ``heartbeat_secs`` (see
``_heartbeat`` for the fields and why), and the ledger lines when they come; the file
I/O runs in a worker thread, never on the loop or the training thread. So a loop that
something blocks stops the beats, which is how it is seen from outside. With
``heartbeat_secs=0`` no heartbeat file is written; under ``asupervisor run`` the beats
still go down the channel, every ``CHANNEL_BEAT_SECS`` (the runner judges by them).

Only a chief that holds the logdir's lock writes into the logdir; any process also
writes the local file ``ASUPERVISOR_HEARTBEAT`` names, if set, and reports to
``asupervisor run`` on the channel it was given (``_logdir/channel``): the session's
start, each beat, and each checkpoint the session commits (not one it restored), which
is how the runner counts this run's progress. A failed write is logged once per file,
reported on the channel, and never stops training.

The ledger gets what ``asupervisor inspect`` needs to say what each restart cost: the
start line (with the run's id and when the restored checkpoint was committed), a line
when the first step has ended, and the end line (with the newest checkpoint the session
itself committed).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import anyio

from .._kinds import JobKind, Phase
from .._log import log
from .._logdir import channel as _channel
from .._logdir import heartbeat as _heartbeat
from .._logdir import ledger as _ledger
from .._logdir.heartbeat import Beat, wall
from .._logdir.history import read_history
from .._logdir.store import Store, is_object_store
from .._outcome import Ending
from .services import spawn

if TYPE_CHECKING:
    from .._checkpointing.checkpointer import RestoreReport
    from .runtime import SessionRuntime


CHANNEL_BEAT_SECS = 2.0  # the channel's beats when heartbeat_secs=0 (its default)


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _attempt() -> int | None:
    """The attempt ``asupervisor run`` numbered this process with, if it did."""
    try:
        return int(os.environ.get(_heartbeat.ENV_ATTEMPT, ""))
    except ValueError:
        return None


class Presence:
    """The heartbeat writer and the ledger of one session."""

    def __init__(self, rt: SessionRuntime) -> None:
        self._rt = rt
        sv = rt.sv
        self.session_id = uuid.uuid4().hex[:12]
        self.env_path = os.environ.get(_heartbeat.ENV_FILE) or None
        self.channel = _channel.sender()
        # heartbeat_secs=0 turns the heartbeat files off. The runner's channel is memory,
        # not a write, and the runner judges liveness by the beats on it: they go on.
        self.writes_beats = sv.heartbeat_secs > 0
        self.interval = sv.heartbeat_secs or (CHANNEL_BEAT_SECS if self.channel else 0.0)
        self._store = Store(sv.logdir) if sv.logdir is not None and sv.is_chief else None
        self._host = socket.gethostname()
        self._started_at = time.time()
        self._seen: tuple[int, float] | None = None  # (step, when it was first seen)
        self._pending: list[dict[str, Any]] = []  # ledger lines not written yet
        self._final: Ending | None = None
        self._lock = anyio.Lock()
        self._wake = anyio.Event()
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        self._running = False
        self._warned: set[str] = set()
        self._first_step_told = False
        self._seen_commit: tuple[int, float] | None = None  # (step, monotonic) told
        self._at_risk_told: int | None = None  # the last run/steps_at_risk written
        self._committed: tuple[int, float] | None = None  # the same, wall-clock time

    # -- the session's side ------------------------------------------------------------

    def start(self) -> None:
        """Begin beating (on the loop, at the session's entry); nothing to do for a session
        that writes no logdir and was given no heartbeat file."""
        if self._store is None and self.env_path is None and self.channel is None:
            return
        self._running = True
        sv = self._rt.sv
        self._tell(
            _channel.SessionBegan(
                self.session_id, os.getpid(), sv.is_chief, sv.stop_grace_secs, self._commits_to()
            )
        )
        spawn(self._beat_forever, "asupervisor-heartbeat")

    def _commits_to(self) -> str | None:
        """The logdir this session commits to (a chief's), as the runner finds it: the
        runner reads the attempt's commits from its history, whatever reached the channel
        before the process ended. Absolute: the process may change its directory."""
        logdir = self._rt.sv.logdir
        if self._store is None or logdir is None:
            return None
        return logdir if is_object_store(logdir) else os.path.abspath(logdir)

    def started(self, report: RestoreReport, changed: list[str]) -> None:
        """The session has restored (or begun fresh): its ledger line (``changed``: what
        differs from the commit it restored, ``run.changed``)."""
        role = self._rt.sv.role
        self._pending.append(
            {
                "event": "start",
                "session": self.session_id,
                "time": _now_iso(),
                "started": _now_iso(),
                "host": self._host,
                "pid": os.getpid(),
                "attempt": _attempt(),
                "run": os.environ.get(_heartbeat.ENV_RUN) or None,
                "worker": None if role is None else role.name,
                "restored_step": report.step,
                "source": report.source.value,
                "restored_from": report.path,
                "restored_tier": report.tier,
                "restored_commit_at": None,  # read from the history, off the loop
                "changed": changed or None,
            }
        )
        self._wake.set()

    async def close(self, ending: Ending, wait: float) -> None:
        """The session has ended so: its last beat and its ``end`` line (the same outcome
        and exit status), written before the logdir's lock is released, waiting at most
        ``wait`` seconds."""
        self._scope.cancel()
        if self._final is not ending:
            self._end_line(ending)
        if not self._running:
            return
        with anyio.move_on_after(wait):
            await self._done.wait()  # a write in flight finishes first
            await self._flush()

    def record_now(self, ending: Ending, wait: float) -> None:
        """From a thread beside an event loop that is held (the loop watch): the last beat
        and the end line, written by a thread of their own, waited for at most ``wait``
        seconds (a write of the beat task's, stuck with the loop, is not waited for)."""
        if self._final is not ending:  # one end line, whichever path wrote it first
            self._end_line(ending)
        if not self._running:
            return
        self._observe()
        beat = self._beat() if self.interval > 0 else None
        if beat is not None:
            self._tell(beat)
        owns_logdir = self._store is not None and self._rt.lock is not None
        lines, self._pending = (self._pending if owns_logdir else []), []
        raw = None if beat is None else beat.to_json()
        writer = threading.Thread(
            target=self._write, args=(lines, raw, owns_logdir), name="asupervisor-record"
        )
        writer.daemon = True
        writer.start()
        writer.join(wait)

    def _end_line(self, ending: Ending) -> None:
        """The session has ended so: its ``end`` line, pending."""
        self._final = ending
        error = ending.error
        self._observe()  # the final save's commit, in the end line and on the channel
        self._pending.append(
            {
                "event": "end",
                "session": self.session_id,
                "time": _now_iso(),
                "ended": _now_iso(),
                "host": self._host,
                "pid": os.getpid(),
                "outcome": ending.outcome.value,
                "exit_status": ending.exit_status,
                "step": ending.step if self._rt.ready else None,  # see _beat
                "reason": str(ending.reason),
                "error": None if error is None else f"{type(error).__name__}: {error}",
                "unsaved_steps": ending.unsaved_steps,
                "stuck_job": ending.stuck_job,
                "signal": ending.signal,
                "signal_phase": None if ending.signal_phase is None else ending.signal_phase.value,
                "abandoned_services": list(ending.abandoned),
                "committed_step": None if self._committed is None else self._committed[0],
                "committed_at": None if self._committed is None else self._committed[1],
            }
        )

    # -- the writer ----------------------------------------------------------------------

    async def _beat_forever(self) -> None:
        try:
            with self._scope:
                while True:
                    await self._flush()
                    with anyio.move_on_after(self.interval if self.interval > 0 else None):
                        await self._wake.wait()
                    self._wake = anyio.Event()
        except BaseException as exc:  # never out of a task nobody waits for
            if not isinstance(exc, anyio.get_cancelled_exc_class()):
                log.error("heartbeat.failed", path=self.env_path, error=repr(exc))
        finally:
            self._done.set()

    async def _flush(self) -> None:
        self._observe()
        beat = self._beat() if self.interval > 0 else None
        if beat is not None:
            self._tell(beat)  # first: the runner hears it even while a file write waits
        async with self._lock:
            owns_logdir = self._store is not None and self._rt.lock is not None
            lines, self._pending = (self._pending if owns_logdir else []), []
            raw = None if beat is None or not self.writes_beats else beat.to_json()
            points = self._at_risk_point()
            began = False

            def write() -> None:
                nonlocal began
                began = True
                self._write(lines, raw, owns_logdir)
                if points is not None:
                    self._write_point(*points)

            try:
                await anyio.to_thread.run_sync(write)
            finally:
                # Cancelled before a worker thread took it (the close cancels this writer
                # wherever it is): the lines go to the next write, the close's own.
                if not began:
                    self._pending[:0] = lines

    def _at_risk_point(self) -> tuple[dict[str, float], int] | None:
        """On the loop: ``run/steps_at_risk`` at the current step, when it changed (with
        a local tier only). Written beside the beat, off the training thread: the events
        file's writes may wait for the object store, and the training never does."""
        rt = self._rt
        checkpointer = rt.checkpointer
        at_risk = None if checkpointer is None else checkpointer.steps_at_risk()
        if at_risk is None or not rt.ready or self._final is not None:
            return None
        if at_risk == self._at_risk_told:
            return None
        self._at_risk_told = at_risk
        return {"run/steps_at_risk": float(at_risk)}, rt.step.value

    def _write_point(self, values: dict[str, float], step: int) -> None:
        """In a worker thread: a point of the session's events file (a figure: one that
        cannot be written, the file closing meanwhile, is let go)."""
        try:
            self._rt.events.write(values, step)
        except Exception as exc:
            log.debug("summary.not_written", tags=list(values), error=repr(exc))

    def _observe(self) -> None:
        """On the loop: the first step's end and this session's new commits, once each."""
        first = self._rt.stepper.first_done
        if first is not None and not self._first_step_told:
            self._first_step_told = True
            self._pending.append(
                {
                    "event": "first_step",
                    "session": self.session_id,
                    "time": _now_iso(),
                    "first_step_at": wall(first[1]),
                }
            )
        checkpointer = self._rt.checkpointer
        if self._store is None or checkpointer is None:
            return  # only a chief commits into a logdir
        step, at = checkpointer.last_saved_step, checkpointer.last_saved_at
        if step is None or at is None:
            return  # nothing saved, or what it shows was restored: not a commit
        if self._seen_commit != (step, at):
            self._seen_commit = (step, at)
            self._committed = (step, wall(at) or time.time())
            self._tell(_channel.Commit(self.session_id, *self._committed))

    def _tell(self, report: _channel.Report) -> None:
        """Report to ``asupervisor run`` (a nonblocking pipe: never waits)."""
        if self.channel is None:
            return
        try:
            self.channel.send(report)
        except (OSError, ValueError) as exc:
            self._failed("channel", exc, tell=False)

    def _beat(self) -> Beat:
        """On the loop: what the session is doing now."""
        rt = self._rt
        step = rt.step.value
        if self._seen is None or self._seen[0] != step:
            self._seen = (step, time.time())
        flight = rt.thread.in_flight()
        busy = flight if flight is not None and flight.job.kind is not JobKind.HOLD else None
        checkpointer = rt.checkpointer
        final = self._final
        return Beat(
            pid=os.getpid(),
            host=self._host,
            session=self.session_id,
            chief=rt.sv.is_chief,
            worker=None if rt.sv.role is None else rt.sv.role.name,
            phase=Phase.CLOSED if final is not None else rt.stop.phase,  # the last beat
            first_step_done=rt.stepper.first_done is not None,
            # A session that ended before its restore has no step of the run: its
            # variable's 0 is not where the run is.
            step=step if rt.ready or final is None else None,
            restored_step=rt.restore_report.step if rt.ready else None,
            interval_secs=self.interval,
            started_at=self._started_at,
            written_at=time.time(),
            busy_since=None if busy is None else wall(busy.step_started_at),
            job=None if busy is None else busy.job.name,
            training=busy is not None and busy.training,
            last_step_at=self._seen[1],
            last_commit_step=None if checkpointer is None else checkpointer.last_saved_step,
            last_commit_at=None if checkpointer is None else wall(checkpointer.last_saved_at),
            outcome=None if final is None else final.outcome,
            exit_status=None if final is None else final.exit_status,
            steps_at_risk=None if checkpointer is None else checkpointer.steps_at_risk(),
        )

    def _write(self, lines: list[dict[str, Any]], beat: bytes | None, owns_logdir: bool) -> None:
        """In a worker thread: the ledger lines, then the beat, each where it goes."""
        store = self._store
        if owns_logdir and store is not None:
            for line in lines:
                if line["event"] == "start" and line["restored_from"] is not None:
                    line["restored_commit_at"] = _commit_time(store, line["restored_from"])
                self._attempt_write(store.path(_ledger.NAME), _ledger.append, store, line)
            if beat is not None:
                self._attempt_write(store.path(_heartbeat.NAME), _write_beat, store, beat)
        if beat is not None and self.env_path is not None:
            self._attempt_write(self.env_path, _heartbeat.write_local, self.env_path, beat)

    def _attempt_write(self, where: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self._failed(where, exc, tell=True)

    def _failed(self, where: str, exc: Exception, *, tell: bool) -> None:
        """A write failed: logged once per place, and told to the runner (the process is
        alive; only its file is not up to date)."""
        if where in self._warned:
            return
        self._warned.add(where)
        error = f"{type(exc).__name__}: {exc}"
        log.warning("heartbeat.failed", path=where, error=error)
        if tell:
            self._tell(_channel.Unwritten(where, error))


def _commit_time(store: Store, path: str) -> float | None:
    """When the checkpoint at ``path`` was committed, as its commit recorded it."""
    try:
        commit = read_history(store).by_name(os.path.basename(path))
    except Exception:  # only a figure for inspect: never a reason to fail a session
        return None
    return None if commit is None else commit.time


def _write_beat(store: Store, beat: bytes) -> None:
    if store.local:
        _heartbeat.write_local(store.path(_heartbeat.NAME), beat)
    else:
        store.write(_heartbeat.NAME, beat)
