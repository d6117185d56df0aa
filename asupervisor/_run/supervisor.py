"""``asupervisor run``: a process supervisor for training commands, on anyio.

It starts the command (or N workers of a multi-worker job), forwards a graceful stop,
watches each child's liveness, and restarts the job after a failure, all children
together, with a restart budget that this run's progress refills. The parts:

- ``Attempt`` (``attempt.py``): one start of every child, monitored until all have
  exited; its ``AttemptResult`` holds the facts (who the runner stopped and why, who it
  killed, what each committed) and each child's status is decided once from them.
- ``RestartBudget`` (``budget.py``): after each attempt, restart (and when) or give up.
  Progress is a checkpoint an attempt committed, as the logdir's history records it with
  this run and attempt (``progress.py``, read once the attempt's processes ended) or as
  its session told first on its channel: what another process writes into the logdir
  never refills this run's budget.
- ``Standby`` (``standbys.py``): one interpreter that imported TensorFlow once and forks
  every start of the run (the runner adopts each: it is their subreaper).
- The channel (``_logdir/channel``): each process the runner starts gets a pipe; its
  session reports its beats, its commits and the writes it could not make there. A pipe
  cannot fill a disk: a child is judged not alive only when it says nothing.

``ProcessSupervisor._run`` is the one loop: start an attempt, monitor it, ask the budget.

- **What is restarted.** A child's exit status says how its training ended
  (``asv.Outcome``): done (0), preempted (42), a failure that cannot be fixed by
  retrying (78), interrupted (130) are passed on; a failure (1, or a death by a
  signal), a store out of reach (69), a worker that lost its peer (75) or a stuck run
  (124, or a heartbeat past its deadline) is restarted.
- **Bounded.** A stop (SIGTERM, SIGINT, SIGUSR1 to the supervisor) is sent to each child
  as ``stop_signal``; a child still running ``grace_secs`` later is killed. A second
  SIGINT kills at once. Every child runs in a process group of its own, killed whole
  when the child ends and when the supervisor exits however it exits; a child also
  dies with the supervisor (``PR_SET_PDEATHSIG``) if the supervisor is SIGKILLed.

- **Across hosts** (``group.py``, ``slurm.py``): a run whose one child is one worker of a
  job others started leaves the restart to the engine (``membership``); ``--slurm``'s
  outer run restarts a SLURM step whose status it reads from each task's recorded end.

This module never imports TensorFlow for a local logdir. It reads the logdir for the
history's commits of a failed attempt, a killed session's end (``ends.py``), a step's
task records and the crash-loop report, each bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import resource
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import anyio
import anyio.abc

from .._logdir import channel as _channel
from .._logdir import groups as _groups
from .._logdir import heartbeat as _heartbeat
from .._logdir import ledger as _ledger
from .._logdir.groups import GroupAttempt
from .._logdir.store import Store
from .._outcome import Outcome
from . import ends as _ends
from . import members as _members
from . import report as _report
from .attempt import Attempt, AttemptResult, Child, Control, Limits, StopCause
from .budget import GiveUp, RestartBudget, restartable
from .group import Restarts, StatusMap, membership
from .local_tier import local_tier_env, tier_dirs
from .process import Proc, adopt, spawn
from .progress import recorded
from .slurm import (
    MemberEnd,
    SlurmError,
    cause_rank,
    group_status,
    member_prefix,
    requeue,
    step_of,
    tf_config,
)
from .standbys import Standby, standby_plan
from .statuses import describe_status, outcome_of, shell_status

__all__ = [
    "DEFAULT_PRELOAD",
    "ProcessSupervisor",
    "RunConfig",
    "describe_status",
    "newest_step",
    "outcome_of",
    "run_command",
    "shell_status",
    "standby_plan",
]

DEFAULT_PRELOAD = ("tensorflow", "keras", "asupervisor")
DEFAULT_GRACE_SECS = 150.0  # more than a session's default stop_grace_secs (120) + an exit
REAP_SECS = 5.0  # how long the run's end waits for the processes it killed to be reaped
MEMBER_READ_TRIES = 5  # a --slurm step's task records, looked for this many times
MEMBER_READ_PAUSE_SECS = 0.5  # between two looks
# A job across hosts: the chief's member looks this many times (MEMBER_READ_PAUSE_SECS
# apart) for the other members' ends: a peer's worker takes a collective's timeout (seen:
# 10-15 s) to find the chief's gone, and an end folded later is an attempt's line apart.
MEMBER_FOLD_TRIES = 60
EXIT_SECS = 10.0  # what a process needs after its session's stop to exit (the grace rule)
LOGDIR_READ_SECS = 10.0  # the report waits no longer for an unreachable logdir
FILES_PER_WORKER = 4  # a child's stderr and channel (read ends; write ends while it starts), a port

# Run before the command, in the child: die with the supervisor, then become the command.
_TRAMPOLINE = """\
import ctypes, errno, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(137)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    sys.stderr.write("asupervisor run: cannot run %r: %s\\n" % (sys.argv[2], e.strerror))
    os._exit(127 if e.errno == errno.ENOENT else 126)
"""


@dataclass(frozen=True)
class RunConfig:
    """``asupervisor run``'s options, checked by the command line."""

    command: tuple[str, ...]
    logdir: str | None = None
    workers: int = 1
    max_failures: int = 3
    backoff_secs: float = 1.0
    max_backoff_secs: float = 60.0
    grace_secs: float = DEFAULT_GRACE_SECS
    stop_signal: signal.Signals = signal.SIGTERM
    stuck_after: float | None = 300.0  # None: heartbeats are not watched
    startup_timeout: float = 900.0
    standby: bool = False
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    restarts: Restarts = Restarts.AUTO  # who restarts a failed worker (group.membership)
    status_map: StatusMap = field(default_factory=StatusMap)  # the status the engine sees
    # --slurm's outer run: its child is a step of this many tasks, each an asupervisor run
    # that records its end in the logdir (group_status decides the step's status from them).
    step_tasks: int = 0
    # --slurm --requeue: a run that ends preempted asks SLURM to requeue its batch job
    # (a cluster whose slurm.conf has no RequeueExit=42 would not).
    requeue_job: str | None = None
    # --local-dir: every child's sessions save to this directory of the host first (the
    # local tier; checked by the command line), every local_save_secs (None: their own).
    local_dir: str | None = None
    local_save_secs: float | None = None


class CannotStart(Exception):
    """A child could not be started at all (no process, not a failed command)."""


def newest_step(logdir: str) -> int | None:
    """The step of the history's head in ``logdir`` (without TensorFlow for a local
    logdir); ``None`` when nothing is committed."""
    from .._logdir.history import head_step

    return head_step(logdir)


def local_tf_configs(count: int) -> list[str]:
    """One TF_CONFIG per worker of a job on free loopback ports of this machine."""

    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    cluster = {"worker": [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]}
    for s in sockets:
        s.close()
    return [
        json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        for index in range(count)
    ]


def files_needed(workers: int, standby: bool) -> int:
    """Open files ``asupervisor run`` may need at once (pipes, ports, its own; a standby's
    socket, stderr, channel and pidfds)."""
    return 64 + workers * (FILES_PER_WORKER + (1 if standby else 0)) + (3 if standby else 0)


def make_room_for_files(needed: int) -> str | None:
    """Raise the open-file limit to ``needed`` if the hard limit allows; else why not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    if hard != resource.RLIM_INFINITY and hard < needed:
        return f"needs about {needed} open files, and this process may open {hard} (ulimit -n)"
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return None


class ProcessSupervisor:
    def __init__(self, config: RunConfig, out: TextIO) -> None:
        self.config = config
        self.out = out
        self.run_id = uuid.uuid4().hex[:12]  # ASUPERVISOR_RUN: one per invocation
        self.history: list[AttemptResult] = []
        self.procs: list[Proc] = []  # everything started: killed when the supervisor exits
        self._grace_told = False
        self._control: Control | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._standby: Standby | None = None
        self._attempt: Attempt | None = None  # the newest attempt
        self._member_ended = False  # a member: its end's record is being written
        self._member_lock = anyio.Lock()  # one write of its record at a time
        self._member = membership(config.restarts, os.environ, config.workers)
        # One task of a job an outer `asupervisor run` restarts (its --slurm step): the outer
        # run's identity, which this run's children record their commits with.
        outer = os.environ.get(_heartbeat.ENV_RUN), os.environ.get(_heartbeat.ENV_ATTEMPT)
        self._outer = (
            (outer[0], outer[1])
            if self._member.restarts is Restarts.ENGINE and outer[0] and outer[1]
            else None
        )
        # One member of a job across hosts that no outer run started (a JobSet's or a
        # TFJob's pod): its rank and the job's worker count; its end is recorded for the
        # chief's member to fold into the ledger (``members.py``).
        self._host = (
            _members.host_member(os.environ)
            if self._member.restarts is Restarts.ENGINE and self._outer is None
            else None
        )

    # -- output --------------------------------------------------------------------

    def say(self, event: str, **fields: Any) -> None:
        """One line on the supervisor's stderr: ``asupervisor run: event key=value ...``."""
        parts = [f"asupervisor run: {event}"]
        for key, value in fields.items():
            text = str(value)
            parts.append(f"{key}={text if text and ' ' not in text else repr(text)}")
        self._print(" ".join(parts))

    def _print(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(text, file=self.out, flush=True)

    def _write_stderr(self, chunk: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            buffer = getattr(self.out, "buffer", None)
            if buffer is not None:
                buffer.write(chunk)
                buffer.flush()
            else:
                self.out.write(chunk.decode(errors="replace"))
                self.out.flush()

    # -- the whole run -------------------------------------------------------------

    async def main(self) -> int:
        self._control = Control()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._watch_signals)
                try:
                    await self._fold_members(1)  # what an earlier attempt's chief left
                    await self._fold_lost_steps()  # what an earlier --slurm run left
                    status = await self._run()
                except CannotStart as exc:
                    self._print(f"asupervisor run: error: {exc}")
                    status = Outcome.FAILED.exit_status
                finally:
                    self.kill_everything()
                    await self._reaped()
                await self._record_member_end(status)
                await self._fold_members(self._fold_tries())
                tg.cancel_scope.cancel()
        finally:
            self.kill_everything()
        shown = self.config.status_map(status)
        if shown != status:
            self.say("run.ended", status=describe_status(status), exit_status=shown)
        else:
            self.say("run.ended", status=describe_status(status))
        if self.config.requeue_job is not None and outcome_of(status) is Outcome.PREEMPTED:
            await self._requeue(self.config.requeue_job)
        return shown

    async def _requeue(self, job: str) -> None:
        """--slurm --requeue, the run's last act once it ended preempted (everything on
        record): SLURM requeues the job, ending this batch script as it does; the job
        then waits in the queue and resumes from the final save. A job SLURM no longer
        shows running (cancelled by a person) is left ended; a refusal (a job not
        requeueable) is said; either way the run ends with its status as it is."""
        self.say("run.requeueing", slurm_job=job)
        try:
            why_not = await anyio.to_thread.run_sync(requeue, job)
        except SlurmError as exc:
            self.say("run.requeue_failed", slurm_job=job, error=str(exc))
            return
        if why_not is not None:
            self.say("run.requeue_skipped", slurm_job=job, why=why_not)

    async def _record_member_end(self, status: int) -> None:
        """One task of an outer run's step: its end, as a fact in the logdir for the
        outer run to read (the step's own status hides which task was the cause)."""
        last = self.history[-1] if self.history else None
        worker = last.ends[0] if last and last.ends else None
        self._member_ended = True  # a record of its stop, still to come, is not written
        await self._put_member(
            self._member_record(
                status,
                stopped=bool(last and last.stop_requested),
                why=last.worst.how if last and last.ends else "it could not start its worker",
                session=None if worker is None else worker.session,
                step=None if worker is None else worker.reached_step,
                pid=None if worker is None else worker.pid,
                chief=worker is not None and worker.chief,
            )
        )

    async def _record_member_stopping(self) -> None:
        """One task of an outer run's step, as the step's stop reaches it: a record of
        its end already, which its real end replaces. SLURM kills a task that has not
        ended ``KillWait`` seconds after the step's stop, its run too: then this record
        is what the outer run reads (its node, its worker's last session and step)."""
        children = [] if self._attempt is None else self._attempt.children
        beat = children[0].proc.heard.beat if children else None
        stop = "step" if self._outer is not None else "run"
        stopping = self._member_record(
            128 + signal.SIGKILL,  # what SLURM's kill leaves
            stopped=True,
            why=f"killed before its end was recorded (after the {stop}'s stop)",
            session=None if beat is None else beat.session,
            step=None if beat is None else beat.step,
            pid=children[0].proc.pid if children else None,
            chief=beat is not None and beat.chief,
        )
        await self._put_member(stopping, stopping=True)

    def _member_record(
        self,
        status: int,
        *,
        stopped: bool,
        why: str,
        session: str | None,
        step: int | None,
        pid: int | None,
        chief: bool,
    ) -> MemberEnd:
        procid = os.environ.get("SLURM_PROCID", "0")
        rank = int(procid) if procid.isdigit() else 0
        return MemberEnd(
            rank=self._host[0] if self._host is not None else rank,
            host=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            status=status,
            stopped=stopped,
            why=why,
            at=time.time(),
            session=session,
            step=step,
            pid=pid,
            chief=chief,
        )

    async def _put_member(self, end: MemberEnd, stopping: bool = False) -> None:
        """Write (or replace) this task's record, one write at a time: the record of its
        stop (``stopping``) never replaces its end's."""
        logdir = self.config.logdir
        if self._outer is not None:
            name = member_prefix(*self._outer) + str(end.rank)
        elif self._host is not None:
            name = _members.record_name(end.rank, self.run_id, stopping)
        else:
            return
        if not logdir:
            return
        async with self._member_lock:
            if stopping and self._member_ended:
                return
            # Shielded from the run's own end, bounded by its deadline (the shield inside
            # would hold the deadline off too).
            with anyio.move_on_after(LOGDIR_READ_SECS, shield=True):
                try:
                    await anyio.to_thread.run_sync(
                        _write_member_end, logdir, name, end, abandon_on_cancel=True
                    )
                except Exception as exc:  # said, never a reason to fail the end
                    self.say("run.member_end_unwritten", logdir=logdir, error=repr(exc)[:200])

    def _fold_tries(self) -> int:
        """How many looks the chief's end waits for the others' ends: once a stop was
        asked, until the grace from the stop has passed (the others were stopped too, each
        within the same grace; a loaded host's member may take seconds past its child's
        end to record its own), at least one; one after a second SIGINT."""
        control = self._control
        if control is not None and control.hard_stop.is_set():
            return 1
        if control is not None and control.stop_asked_at is not None:
            left = control.stop_asked_at + self.config.grace_secs - time.monotonic()
            return max(1, math.ceil(left / MEMBER_READ_PAUSE_SECS))
        return MEMBER_FOLD_TRIES

    async def _fold_members(self, tries: int) -> None:
        """The chief's member of a job across hosts: the members' recorded ends into the
        ledger as the group's attempt (``members.py``), looked for ``tries`` times; bounded,
        a failure said."""
        logdir = self.config.logdir
        if self._host is None or self._host[0] != 0 or not logdir:
            return
        args = (logdir, self.run_id, self._host[1], tries, MEMBER_READ_PAUSE_SECS)
        facts = _groups.engine_facts(os.environ)

        def fold() -> list[GroupAttempt]:
            group = _members.fold(*args, facts)
            return [] if group is None else [group]

        await self._folded(fold, LOGDIR_READ_SECS + tries * MEMBER_READ_PAUSE_SECS)

    async def _fold_lost_steps(self) -> None:
        """--slurm's outer run, at its start: the group lines of the steps an earlier outer
        run of this logdir could not write (SLURM ended it with a lost node). Bounded; a
        failure is said, never a reason to fail the run."""
        tasks, logdir = self.config.step_tasks, self.config.logdir
        if not tasks or not logdir:
            return
        facts = _groups.engine_facts(os.environ)
        await self._folded(lambda: _members.fold_lost_steps(logdir, tasks, facts), LOGDIR_READ_SECS)

    async def _folded(self, fold: Callable[[], list[GroupAttempt]], secs: float) -> None:
        """Run a fold of recorded ends into the ledger's group lines (blocking I/O, a worker
        thread), shielded and bounded by ``secs``; each line written is said, a failure
        too, never a reason to fail the run (the lines are facts for inspect)."""
        with anyio.move_on_after(secs, shield=True):
            try:
                groups = await anyio.to_thread.run_sync(fold, abandon_on_cancel=True)
            except Exception as exc:
                self.say("run.ledger_unwritten", error=f"{type(exc).__name__}: {exc}"[:300])
                return
            for group in groups:
                self.say("group.recorded", attempt=group.attempt, cause=group.cause)

    async def _group_result(self, result: AttemptResult) -> AttemptResult:
        """--slurm's outer run: the step's status decided from its tasks' recorded ends."""
        tasks, logdir = self.config.step_tasks, self.config.logdir
        if not tasks or not logdir or not result.ends:
            return result
        prefix = member_prefix(self.run_id, str(result.number))

        def read() -> list[MemberEnd]:
            # Each task's record by its exact name (a listing of a shared file system may
            # lag behind files made on other hosts), looked for again briefly if missing.
            # Removed only once the step's line is written: if SLURM ends this run first
            # (a node lost), the next outer run folds them (members.fold_lost_steps).
            store, ends = Store(logdir), dict[int, MemberEnd]()
            for _ in range(MEMBER_READ_TRIES):
                for rank in set(range(tasks)) - set(ends):
                    with contextlib.suppress(Exception):
                        ends[rank] = MemberEnd.from_json(store.read(prefix + str(rank)))
                if len(ends) == tasks:
                    break
                time.sleep(MEMBER_READ_PAUSE_SECS)
            return list(ends.values())

        ends: list[MemberEnd] = []
        with anyio.move_on_after(LOGDIR_READ_SECS):
            try:
                ends = await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
            except Exception as exc:  # said; the step's own status is what is left
                self.say("step.ends_unread", logdir=logdir, error=repr(exc)[:200])
        step = result.ends[0]
        status, cause = group_status(ends, tasks, step.status, result.stop_requested)
        for end in sorted(ends, key=lambda e: e.rank):
            self.say(
                "step.worker_ended", attempt=result.number, worker=end.rank, host=end.host,
                status=describe_status(end.status), stopped=end.stopped, how=end.why,
            )  # fmt: skip
        self.say("step.ended", attempt=result.number, status=describe_status(status), cause=cause)
        await self._record_group(self._step_group(result.number, ends, tasks, status, cause))
        await self._remove_records(logdir, [prefix + str(end.rank) for end in ends])
        await self._record_killed_chief(ends)
        decided = dataclasses.replace(step, status=status)
        first = decided if result.first_failure is not None else None
        return dataclasses.replace(
            result, ends=(decided,), first_failure=first, cause=f"{cause} {describe_status(status)}"
        )

    async def _remove_records(self, logdir: str, names: list[str]) -> None:
        """--slurm's outer run: its step's records, once its line is written. Bounded; one
        left behind is removed by the next outer run's start, which finds the line."""

        def remove() -> None:
            store = Store(logdir)
            for name in names:
                store.remove(name)

        with anyio.move_on_after(LOGDIR_READ_SECS):
            try:
                await anyio.to_thread.run_sync(remove, abandon_on_cancel=True)
            except Exception as exc:  # the line is written: a leftover is only untidy
                self.say("step.records_left", logdir=logdir, error=repr(exc)[:200])

    def _step_group(
        self, number: int, ends: list[MemberEnd], tasks: int, status: int, cause: str
    ) -> GroupAttempt:
        """--slurm's outer run: the step's attempt as the ledger's group line, from its
        tasks' recorded ends (a task that left none: its node or its run was lost)."""
        first = cause_rank(ends, tasks, status)
        by_rank = {e.rank: e for e in ends}
        workers = _members.worker_ends(by_rank, tasks, first, _LEFT_NO_END)
        return self._group(number, status, cause, workers)

    async def _append_ends(self, logdir: str, lines: list[dict[str, Any]]) -> None:
        """Session ends the runner writes for sessions that could not (``_run/ends``), into
        the ledger, bounded like every read of the logdir."""
        with anyio.move_on_after(LOGDIR_READ_SECS):
            try:
                await anyio.to_thread.run_sync(_ends.record, logdir, lines, abandon_on_cancel=True)
            except Exception as exc:  # a figure for inspect: never a reason to stop the run
                self.say("run.ledger_unwritten", error=f"{type(exc).__name__}: {exc}"[:300])

    async def _record_killed_chief(self, ends: list[MemberEnd]) -> None:
        """--slurm's outer run: the end of a chief session whose task was killed before it
        could record it (``_record_member_stopping``), into the ledger as the runner's
        (``_run/ends``); a session's own end, when there is one, is kept."""
        logdir = self.config.logdir
        lines = [_ends.member_line(e) for e in ends if e.chief and e.session]
        if not lines or logdir is None:
            return
        await self._append_ends(logdir, lines)

    def _host_group(self, result: AttemptResult) -> GroupAttempt:
        """--workers N on this host: the attempt as the ledger's group line."""
        first = result.first_failure
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        workers = [
            _groups.WorkerEnd(
                rank=end.rank,
                host=host,
                status=end.status,
                how=end.how,
                stopped=end.stop in (StopCause.PEER, StopCause.REQUESTED),
                first=first is not None and end.rank == first.rank,
                ended=_groups.iso_time(end.ended_at),
                pid=end.pid,
                session=end.session,
                step=end.reached_step,
            )
            for end in result.ends
        ]
        return self._group(result.number, result.status, result.why, workers)

    def _group(
        self, number: int, status: int, cause: str, workers: list[_groups.WorkerEnd]
    ) -> GroupAttempt:
        facts = _groups.engine_facts(os.environ)
        return GroupAttempt(
            run=self.run_id,
            attempt=number,
            time=_groups.iso_time(time.time()),
            status=status,
            cause=cause,
            workers=tuple(workers),
            slurm_job=facts.get("slurm_job"),
            slurm_restart=facts.get("slurm_restart"),
        )

    async def _record_group(self, group: GroupAttempt, logdir: str | None = None) -> None:
        """The group's attempt into the ledger (``_logdir/groups``): this run started every
        worker, so it is the one that knows how each ended. Bounded; a failure is said."""
        logdir = logdir or self.config.logdir
        if logdir is None:
            return
        with anyio.move_on_after(LOGDIR_READ_SECS):
            try:
                await anyio.to_thread.run_sync(
                    _append_ledger, logdir, group.to_record(), abandon_on_cancel=True
                )
            except Exception as exc:  # a fact for inspect: never a reason to stop the run
                self.say("run.ledger_unwritten", error=f"{type(exc).__name__}: {exc}"[:300])

    async def _reaped(self) -> None:
        """Wait (bounded) until every killed process was reaped: a process left to the
        closed event loop would be a zombie and a warning at exit."""
        with anyio.move_on_after(REAP_SECS, shield=True):
            for proc in self.procs:
                await proc.gone.wait()

    def kill_everything(self) -> None:
        for proc in self.procs:
            proc.kill_group()

    async def _watch_signals(self) -> None:
        control = self._control
        assert control is not None
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if control.stop_requested.is_set():
                    if signum == signal.SIGINT:
                        self.say("run.stopping", signal=name, action="kill at once")
                        control.hard_stop.set()
                        self.kill_everything()
                        control.changed()
                    continue
                control.ask_stop()
                if (self._outer or self._host) is not None and self._tg is not None:
                    self._tg.start_soon(self._record_member_stopping)
                self.say(
                    "run.stopping",
                    signal=name,
                    action=f"{self.config.stop_signal.name} to each child",
                    grace_secs=self.config.grace_secs,
                )

    async def _run(self) -> int:
        """The one loop: start an attempt, monitor it, ask the budget."""
        config, control = self.config, self._control
        assert control is not None and self._tg is not None
        self._standby = Standby(config.command, config.preload, config.standby, self.say)
        member = self._member
        self.say(
            "run.started",
            command=" ".join(config.command),
            workers=config.workers,
            logdir=config.logdir,
            standby=self._standby.state,
            restarts=f"{member.restarts} ({member.why})",
        )
        await self._standby.open(self._spawn)
        budget = RestartBudget(config.max_failures, config.backoff_secs, config.max_backoff_secs)
        number = 0
        while not control.stop_requested.is_set():
            number += 1
            attempt = Attempt(number, await self._start(number), self._limits(), control, self.say)
            self._attempt = attempt
            result = await attempt.monitor()
            await self._record_ends(attempt.children, result.logdirs)
            if member.restarts is not Restarts.ENGINE:
                # A --slurm step's status is its tasks' recorded cause; progress, the
                # history's (an engine's member leaves both to the engine's own run).
                result = await self._with_history(await self._group_result(result))
            if config.workers > 1:
                logdir = config.logdir or next(iter(result.logdirs), None)
                await self._record_group(self._host_group(result), logdir)
            self.history.append(result)
            self._said_exits(result)
            if member.restarts is Restarts.ENGINE and restartable(result):
                # One worker of a job others started: restarted alone, it could not join
                # its old group. The engine restarts the job as a whole.
                self.say(
                    "run.restart_left_to_engine",
                    after=result.why,
                    status=describe_status(result.status),
                    why=member.why,
                )
                return result.status
            decision = budget.after(result)
            if isinstance(decision, GiveUp):
                if decision.crash_loop:
                    self._print(await self._crash_loop_report(budget.failures))
                return decision.status
            self.say(
                "run.restarting",
                attempt=number + 1,
                after=result.why,
                committed=result.committed,
                progress="yes (costs nothing)" if decision.progressed else "no",
                failures_without_progress=f"{decision.failures}/{config.max_failures}",
                in_secs=round(decision.delay, 2),
            )
            with anyio.move_on_after(decision.delay):
                await control.stop_requested.wait()
        # Stopped between two attempts: nothing runs; the newest checkpoint is the state.
        if control.hard_stop.is_set():
            return Outcome.INTERRUPTED.exit_status
        return Outcome.PREEMPTED.exit_status

    async def _with_history(self, result: AttemptResult) -> AttemptResult:
        """A failed attempt (one the budget judges): its commits as the history on disk
        records them (a kill may have come between a commit and its report; the newest
        commit too). A local history is one small file: read even when the channel told
        a commit already."""
        logdirs = [*([self.config.logdir] if self.config.logdir else []), *result.logdirs]
        if not restartable(result) or not logdirs:
            return result
        # With --local-dir, the local tier's history first, apart (no TensorFlow, a few
        # ms): a commit the mirror had not copied yet is progress for a restart on this
        # host, and an object store that does not answer in time must not hide it.
        local = await recorded(
            tier_dirs(self.config.local_dir, logdirs), self.run_id, result.number
        )
        found = local.plus(await recorded(logdirs, self.run_id, result.number))
        for unread in found.unread:
            self.say("run.history_unread", attempt=result.number, why=unread)
        return dataclasses.replace(result, recorded=found)

    async def _record_ends(self, children: list[Child], told: Sequence[str]) -> None:
        """The ends of sessions killed before they could record them, into the ledger
        (``_run/ends``) of the logdir their sessions named (or ``--logdir``), bounded like
        every read of the logdir."""
        lines = _ends.unrecorded(children)
        logdir = self.config.logdir or next(iter(told), None)
        if logdir is None or not lines:
            return
        await self._append_ends(logdir, lines)

    def _limits(self) -> Limits:
        config = self.config
        return Limits(
            config.grace_secs, config.stop_signal, config.stuck_after, config.startup_timeout
        )

    def _said_exits(self, result: AttemptResult) -> None:
        if self.config.step_tasks:
            return  # the step's own lines said how each worker ended (_group_result)
        for end in result.ends:
            self.say(
                "child.exited",
                attempt=result.number,
                worker=end.rank,
                status=describe_status(end.status),
                how=end.how,
            )

    async def _crash_loop_report(self, failures: int) -> str:
        committed = max(
            (r.committed for r in self.history if r.committed is not None), default=None
        )
        return _report.crash_loop(self.history, failures, committed, await self._logdir_newest())

    async def _logdir_newest(self) -> str | None:
        """The logdir's newest checkpoint, as a phrase for the report (bounded: an object
        store out of reach makes it say so, never wait or fail)."""
        logdir = self.config.logdir
        if logdir is None:
            return None
        with anyio.move_on_after(LOGDIR_READ_SECS):
            try:
                step = await anyio.to_thread.run_sync(newest_step, logdir, abandon_on_cancel=True)
            except Exception as exc:  # a TF error for an object store: only a phrase here
                return f"the logdir cannot be read: {type(exc).__name__}: {exc}"[:300]
            return f"the logdir's newest: {'none' if step is None else f'step {step}'}"
        return f"the logdir did not answer within {LOGDIR_READ_SECS:g} s"

    # -- one attempt's start -------------------------------------------------------

    def _identity(self, number: int) -> tuple[str, str]:
        """The run and attempt a child's sessions record their commits with: this run's;
        or, for one task of a job that an outer ``asupervisor run`` restarts (its
        ``--slurm`` step), the outer run's, whose judgement of progress reads them."""
        return self._outer or (self.run_id, str(number))

    async def _tf_configs(self, number: int) -> list[str] | None:
        """Each worker's TF_CONFIG: on loopback ports for --workers N; from SLURM's
        environment for one task of a SLURM step that has none; else as it is."""
        config = self.config
        if config.workers > 1:
            return local_tf_configs(config.workers)
        if self._member.restarts is not Restarts.ENGINE or "TF_CONFIG" in os.environ:
            return None
        try:  # scontrol, bounded: off the event loop
            step = await anyio.to_thread.run_sync(step_of, dict(os.environ))
            if step is None:
                return None
            attempt = int(self._identity(number)[1])
            return [await anyio.to_thread.run_sync(tf_config, step, attempt)]
        except SlurmError as exc:
            raise CannotStart(f"cannot build TF_CONFIG from SLURM: {exc}") from None

    async def _start(self, number: int) -> list[Child]:
        config = self.config
        configs = await self._tf_configs(number)
        run, attempt = self._identity(number)
        children = []
        for rank in range(config.workers):
            env = dict(os.environ)
            env[_heartbeat.ENV_ATTEMPT] = attempt
            env[_heartbeat.ENV_RUN] = run
            env.pop(_heartbeat.ENV_STUCK_AFTER, None)
            if config.stuck_after is not None:
                env[_heartbeat.ENV_STUCK_AFTER] = repr(config.stuck_after)
            env.pop(_channel.ENV, None)  # each process gets its own
            env.update(local_tier_env(config.local_dir, config.local_save_secs))
            if configs is not None:
                env["TF_CONFIG"] = configs[rank]
            proc, how = await self._launch(rank, env)
            children.append(Child(rank, proc, how))
            self.say("child.started", attempt=number, worker=rank, pid=proc.pid, start=how)
        return children

    async def _launch(self, rank: int, env: dict[str, str]) -> tuple[Proc, str]:
        standby = self._standby
        if standby is not None and standby.usable:
            ready = standby.ready
            proc = await standby.start(
                self.config.command[1:], env, self._adopt, self.config.startup_timeout
            )
            if proc is not None:
                return proc, "standby" if ready else "standby (still importing)"
        command = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid())]
        try:
            return await self._spawn([*command, *self.config.command], env, None), "cold"
        except OSError as exc:
            raise CannotStart(f"cannot start worker {rank}: {exc}") from None

    async def _spawn(self, argv: list[str], env: dict[str, str], stdin: int | None) -> Proc:
        assert self._tg is not None
        proc = await spawn(
            argv, env, self._tg, self._write_stderr, self._heard, self._exited, stdin=stdin
        )
        self.procs.append(proc)
        return proc

    def _adopt(self, pid: int, stderr: int, channel: int, channel_number: int) -> Proc:
        assert self._tg is not None
        proc = adopt(
            pid, stderr, channel, channel_number,
            self._tg, self._write_stderr, self._heard, self._exited,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def _exited(self, proc: Proc) -> None:
        if self._control is not None:
            self._control.changed()

    def _heard(self, proc: Proc, report: _channel.Report) -> None:
        """What a process's channel said that the run's lines show."""
        if isinstance(report, _channel.Ready):
            self.say("standby.ready", pid=proc.pid, imports_secs=report.seconds)
        elif isinstance(report, _channel.SessionBegan):
            self._check_grace(report)
        elif isinstance(report, _channel.Unwritten):
            self.say("child.unwritten", pid=proc.pid, path=report.path, error=report.error)
        if self._control is not None:
            self._control.changed()  # a beat, a commit: the monitor looks again

    def _check_grace(self, began: _channel.SessionBegan) -> None:
        """--grace must leave the child's own bounded stop time to end: say so once."""
        grace = self.config.grace_secs
        if self._grace_told or grace >= began.stop_grace_secs + EXIT_SECS:
            return
        self._grace_told = True
        self.say(
            "run.grace_too_short",
            grace_secs=grace,
            child_stop_grace_secs=began.stop_grace_secs,
            why=f"a stop may kill the child before its final checkpoint: give --grace at least "
            f"stop_grace_secs + {EXIT_SECS:g}",
        )


_LEFT_NO_END = "left no end (its node or its run was lost)"


def _append_ledger(logdir: str, record: dict[str, Any]) -> None:
    _ledger.append(Store(logdir), record)


def _write_member_end(logdir: str, name: str, end: MemberEnd) -> None:
    store = Store(logdir)
    store.make()  # a worker that failed before its session made the logdir
    store.write(name, end.to_json())


def run_command(config: RunConfig, out: TextIO | None = None) -> int:
    """Supervise ``config.command``; the exit status to end with."""
    supervisor = ProcessSupervisor(config, out or sys.stderr)
    return anyio.run(supervisor.main, backend="asyncio")
