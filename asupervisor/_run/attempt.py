"""One attempt of ``asupervisor run``: its children started together, watched until every
one has exited, and what happened, as facts (``AttemptResult``).

The monitor forwards a stop, judges liveness from what each child's channel says, stops
every child when one fails or is stuck (one for all), stops a process that outlives its
session, and kills what outlives its deadline. Who sent a child the stop signal and why,
and whether the runner killed it, are fields of its ``ChildEnd``; its status is decided
once from them (``passed_on``).
"""

from __future__ import annotations

import enum
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from .._logdir.heartbeat import judge
from .._outcome import Outcome
from .process import Proc
from .progress import Recorded
from .statuses import describe_status, outcome_of, shell_status, worst_outcome

STUCK_KILL_SECS = 10.0  # a stuck child's time between the stop signal and SIGKILL
POLL_SECS = 0.2  # how often deadlines are checked when nothing else happens


def judged_kill_secs(grace_secs: float) -> float:
    """How long a child the runner judged (stuck, or outliving its session) has between
    the stop signal and SIGKILL: 10 s, or the run's grace if that is shorter."""
    return min(grace_secs, STUCK_KILL_SECS)


class AttemptState(enum.Enum):
    """Where an attempt is. It moves forward only, and the result keeps the state the
    attempt was in when its last child exited: how it ended."""

    RUNNING = "running"
    """Every child runs, or has ended well (done, preempted)."""
    FAILING = "failing"
    """A child failed or is stuck: every child has the stop signal (one for all)."""
    STOPPING = "stopping"
    """The run was asked to stop: every child has the stop signal."""


class StopCause(enum.Enum):
    """Why the runner sent a child the stop signal."""

    REQUESTED = "the run was asked to stop"
    PEER = "another worker failed"
    STUCK = "judged stuck"
    LINGERING = "its session had ended and its process did not exit"


class Kill(enum.Enum):
    """Why the runner SIGKILLed a child."""

    PAST_DEADLINE = "past the deadline of its stop"
    AT_ONCE = "at once: a second SIGINT"


class Control:
    """What the run asks of its attempts (a stop; a hard stop, after which everything is
    killed), and the wake-up of the monitor when anything happened."""

    def __init__(self) -> None:
        self.stop_requested = anyio.Event()
        self.hard_stop = anyio.Event()
        self._changed = anyio.Event()
        self.stop_asked_at: float | None = None  # monotonic: when the stop was asked

    def changed(self) -> None:
        self._changed.set()

    def ask_stop(self) -> None:
        """The run is asked to stop (the first stop signal): its attempts stop within the
        grace from now."""
        if self.stop_asked_at is None:
            self.stop_asked_at = time.monotonic()
        self.stop_requested.set()
        self.changed()

    async def wait(self, secs: float) -> None:
        """Until something changed, or ``secs`` passed."""
        with anyio.move_on_after(secs):
            await self._changed.wait()
        self._changed = anyio.Event()


@dataclass(frozen=True)
class Limits:
    """The deadlines of an attempt (``RunConfig``'s)."""

    grace_secs: float
    stop_signal: signal.Signals
    stuck_after: float | None  # None: liveness is not watched
    startup_timeout: float


class Child:
    """One worker of one attempt, as the runner sees it."""

    def __init__(self, rank: int, proc: Proc, how: str) -> None:
        self.rank = rank
        self.proc = proc
        self.how = how  # "cold", "standby", "standby (still importing)"
        self.started = time.monotonic()
        self.stuck: str | None = None  # why the runner judged it stuck
        self.stuck_at: float | None = None
        self.lingering: str | None = None  # why the runner stopped it after its session ended
        self.stop: StopCause | None = None  # why the runner sent it the stop signal
        self.kill_at: float | None = None
        self.killed: Kill | None = None  # the runner SIGKILLed it, and why

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    def judged_stuck(self, why: str) -> None:
        self.stuck, self.stuck_at = why, time.monotonic()

    def outlived_session(self, why: str) -> None:
        self.lingering = why

    @property
    def session_status(self) -> int | None:
        """The exit status its newest session ended with, if that session has ended (a
        session that began later and did not end has none)."""
        beat = self.proc.heard.beat
        return beat.exit_status if beat is not None and beat.ended else None

    def stop_within(self, cause: StopCause, sig: int, within: float) -> None:
        """The stop signal (once), and SIGKILL ``within`` seconds from now if still running."""
        if not self.running:
            return
        if self.stop is None:
            self.stop = cause
            self.proc.signal(sig)
        deadline = time.monotonic() + within
        self.kill_at = deadline if self.kill_at is None else min(self.kill_at, deadline)

    def kill_if_overdue(self, now: float) -> None:
        if self.running and self.kill_at is not None and now >= self.kill_at:
            self.kill(Kill.PAST_DEADLINE)

    def kill(self, why: Kill) -> None:
        if self.running:
            self.killed = self.killed or why
            self.proc.kill_group()

    def status(self, limits: Limits) -> int | None:
        """The status its end is passed on with (``None`` while it runs)."""
        if self.proc.returncode is None:
            return None
        # Nothing trained in it: its command runs a session (the runner watches for one)
        # and none began.
        untrained = limits.stuck_after is not None and self.proc.heard.session is None
        returned = shell_status(self.proc.returncode)
        return passed_on(
            returned,
            self.stop,
            self.killed,
            self.stuck,
            untrained,
            limits.stop_signal,
            session_status=self.session_status,
        )

    def failed(self, limits: Limits) -> bool:
        """Stuck, or exited with a status that is not done or preempted."""
        status = self.status(limits)
        if self.stuck is not None:
            return True
        return status is not None and outcome_of(status) not in (Outcome.DONE, Outcome.PREEMPTED)

    def end(self, limits: Limits) -> ChildEnd:
        status = self.status(limits)
        assert status is not None and self.proc.returncode is not None
        heard = self.proc.heard
        return ChildEnd(
            rank=self.rank,
            pid=self.proc.pid,
            returned=shell_status(self.proc.returncode),
            status=status,
            stop=self.stop,
            killed=self.killed,
            stuck=self.stuck,
            lingering=self.lingering,
            session_started=heard.session is not None,
            reached_step=None if heard.beat is None else heard.beat.step,
            commits=heard.commits,
            committed=heard.committed,
            at=self.stuck_at or self.proc.exited_at or time.monotonic(),
            grace_secs=limits.grace_secs,
            tail=tuple(self.proc.tail),
            logdirs=tuple(heard.logdirs),
            session=None if heard.beat is None else heard.beat.session,
            chief=heard.beat is not None and heard.beat.chief,
        )


def passed_on(
    returned: int,
    stop: StopCause | None,
    killed: Kill | None,
    stuck: str | None,
    untrained: bool,
    stop_signal: int,
    *,
    session_status: int | None = None,
) -> int:
    """The status a child's end is passed on with, from the facts: judged stuck by the
    runner, 124; stopped because its process outlived its session, the status that
    session ended with (``session_status``: the session's end is the fact, whatever then
    ended the process); dead of a signal after its session ended preempted, preempted
    (its final checkpoint is committed); dead of the stop signal the runner forwarded for
    a stop of the run while nothing had trained in it (``untrained``: no session began in
    a command that runs one), or of a signal after its session ended done, preempted (42:
    nothing lost); anything else, its own status (a SIGKILL past the grace of a stop is
    137)."""
    if stuck is not None:
        return Outcome.STUCK.exit_status
    if stop is StopCause.LINGERING and session_status is not None:
        return session_status
    if session_status == Outcome.PREEMPTED.exit_status and returned > 128:
        # Its session ended preempted, its final checkpoint committed; the process then
        # died of a signal on its way out (SLURM ending the step when another task ended,
        # a runtime's thread torn down at exit): nothing is lost, and the job resumes.
        return session_status
    requested = stop is StopCause.REQUESTED and killed is None
    if requested and untrained and returned == 128 + stop_signal:
        return Outcome.PREEMPTED.exit_status
    if requested and session_status == Outcome.DONE.exit_status and returned > 128:
        # The run's stop came as it left after its session ended done (a time limit's
        # warning at the end): nothing is lost, but what came after the session may not
        # have run; preempted, so a requeue runs it again (a resume that ends at once).
        return Outcome.PREEMPTED.exit_status
    return returned


@dataclass(frozen=True)
class ChildEnd:
    """How one child ended, as facts."""

    rank: int
    pid: int
    returned: int  # its own exit status, as a shell shows it (128+N: signal N)
    status: int  # what the runner passes on (``passed_on``)
    stop: StopCause | None  # the runner sent it the stop signal, and why
    killed: Kill | None  # the runner SIGKILLed it, and why
    stuck: str | None  # why the runner judged it stuck
    lingering: str | None  # why the runner stopped it after its session had ended
    session_started: bool  # a session began in it (its channel said so)
    reached_step: int | None  # the step its last beat showed
    commits: int  # checkpoints it committed (its own saves), as its channel told
    committed: int | None  # the newest of them
    at: float  # time.monotonic() when it failed (judged stuck) or exited
    grace_secs: float
    tail: tuple[str, ...] = ()
    logdirs: tuple[str, ...] = ()  # where its chief sessions commit, as they said
    session: str | None = None  # the session of its last beat
    chief: bool = False  # that session was the chief's (it writes the logdir's ledger)

    @property
    def ended_at(self) -> float:
        """``at`` as a time of the wall clock (``time.time()``)."""
        return time.time() - (time.monotonic() - self.at)

    @property
    def how(self) -> str:
        """What happened, in words."""
        if self.killed is Kill.AT_ONCE:
            return "killed at once: a second SIGINT"
        kill_secs = judged_kill_secs(self.grace_secs)
        if self.stuck is not None:
            kill = f", killed {kill_secs:g} s after the stop signal" if self.killed else ""
            return f"stuck: {self.stuck}{kill}"
        if self.lingering is not None:
            kill = f", killed {kill_secs:g} s after the stop signal" if self.killed else ""
            return f"stopped: {self.lingering}{kill}"
        if self.killed is not None:
            why = "" if self.stop is None else f" ({self.stop.value})"
            return (
                f"killed after the grace period of the stop{why}: it did not exit within "
                f"{self.grace_secs:g} s (--grace); no final checkpoint from it"
            )
        if self.status != self.returned:
            return f"exited {describe_status(self.returned)} before its session began: nothing lost"
        return "exited"

    def describe(self) -> str:
        return f"worker {self.rank}: {describe_status(self.status)}"


@dataclass(frozen=True)
class AttemptResult:
    """An attempt's end: the state it was in, each child's end, and what it made."""

    number: int
    state: AttemptState
    ends: tuple[ChildEnd, ...]
    seconds: float
    stop_requested: bool
    interrupted: bool  # a hard stop (a second SIGINT) killed every child at once
    first_failure: ChildEnd | None  # the first child that failed: the cause of the rest
    # Its commits as the history on disk records them, read once every child had ended
    # (``progress``); None: not read (no logdir known, or nothing turns on it).
    recorded: Recorded | None = None
    # The cause in words when the runner's own children do not tell it: --slurm's step,
    # whose cause is the task its tasks' records name (``_run.slurm.group_status``).
    cause: str | None = None

    @property
    def statuses(self) -> list[int]:
        return [end.status for end in self.ends]

    @property
    def outcome(self) -> Outcome:
        return worst_outcome(self.statuses)

    @property
    def worst(self) -> ChildEnd:
        """The child whose ending was the worst (the first of them to fail)."""
        worst = self.outcome
        return min((e for e in self.ends if outcome_of(e.status) is worst), key=_when)

    @property
    def status(self) -> int:
        """The attempt's status: the worst child's."""
        return self.worst.status

    @property
    def progressed(self) -> bool:
        """This attempt committed a checkpoint: the run went forward. Its sessions told so
        on their channels (the fast path), or the history records it (the fact: a kill
        may come between a commit and its report)."""
        told = any(end.commits for end in self.ends)
        return told or (self.recorded is not None and self.recorded.commits > 0)

    @property
    def committed(self) -> int | None:
        """The newest step this attempt committed, told or recorded."""
        told = [e.committed for e in self.ends if e.committed is not None]
        if self.recorded is not None and self.recorded.newest is not None:
            told.append(self.recorded.newest)
        return max(told, default=None)

    @property
    def logdirs(self) -> list[str]:
        """Where its sessions commit, as they said (each once)."""
        return list(dict.fromkeys(logdir for end in self.ends for logdir in end.logdirs))

    @property
    def reached_step(self) -> int | None:
        return self.ends[0].reached_step

    @property
    def why(self) -> str:
        """The cause: the first worker that failed (the others were stopped with it); the
        worst ending too, when another worker's was worse."""
        if self.cause is not None:
            return self.cause
        cause, worst = self.first_failure or self.worst, self.worst
        text = cause.describe()
        if cause.stuck is not None:
            text += f", stuck: {cause.stuck}"
        elif cause.lingering is not None:
            text += f", stopped: {cause.lingering}"
        if outcome_of(cause.status) is not outcome_of(worst.status):
            text += f"; then {worst.describe()}"
        return text

    @property
    def tail(self) -> tuple[str, ...]:
        return (self.first_failure or self.ends[0]).tail


def _when(end: ChildEnd) -> float:
    return end.at


class Attempt:
    """Children started together, watched together, ended together."""

    def __init__(
        self,
        number: int,
        children: list[Child],
        limits: Limits,
        control: Control,
        say: Callable[..., None],
    ) -> None:
        self.number = number
        self.children = children
        self.limits = limits
        self.state = AttemptState.RUNNING
        self._control = control
        self._say = say
        self._first_failure: Child | None = None
        self._started = time.monotonic()

    async def monitor(self) -> AttemptResult:
        """Until every child has exited: stops, liveness, one for all, deadlines."""
        while any(child.running for child in self.children):
            now = time.monotonic()
            if self._control.hard_stop.is_set():
                for child in self.children:
                    child.kill(Kill.AT_ONCE)
            if self._control.stop_requested.is_set() and self.state is not AttemptState.STOPPING:
                self._enter(AttemptState.STOPPING, StopCause.REQUESTED)
            if self.state is AttemptState.RUNNING:
                for child in self.children:
                    self._check_liveness(child, now)
                failed = [child for child in self.children if child.failed(self.limits)]
                if failed:
                    self._first_failure = min(failed, key=_failed_at)
                    self._enter(AttemptState.FAILING, StopCause.PEER)
            for child in self.children:
                child.kill_if_overdue(now)
            await self._control.wait(POLL_SECS)
        return self._result()

    def _enter(self, state: AttemptState, cause: StopCause) -> None:
        """Every child gets the stop signal, and SIGKILL after the grace period."""
        self.state = state
        limits = self.limits
        for child in self.children:
            child.stop_within(cause, limits.stop_signal, limits.grace_secs)

    def _check_liveness(self, child: Child, now: float) -> None:
        limits = self.limits
        if not child.running or limits.stuck_after is None:
            return
        if child.stuck is not None or child.lingering is not None:
            return  # judged already
        heard = child.proc.heard
        beat = heard.beat
        if beat is None:
            if now - child.started > limits.startup_timeout:
                child.judged_stuck(
                    f"no heartbeat {limits.startup_timeout:g} s after its start (does the "
                    "command run an asupervisor session? --no-heartbeat turns this off)"
                )
        elif heard.session is not None and heard.session.session != beat.session:
            # A new session began in it and has not beaten yet: the beat is the ended one
            # before's, and the new one is judged as a start until its first beat.
            if time.time() - beat.written_at > limits.startup_timeout:
                child.judged_stuck(
                    f"a new session began and has not beaten {limits.startup_timeout:g} s "
                    "after the one before ended"
                )
        else:
            verdict = judge(
                beat, time.time(), limits.stuck_after, limits.startup_timeout, still_running=True
            )
            if verdict.stale and beat.ended:
                # The session's end is on record, its status with it: the process is
                # stopped, not judged stuck, and its end is passed on with that status (a
                # done run stays done; a failed one is restarted as any failure).
                child.outlived_session(verdict.why)
                self._stop_judged(child, StopCause.LINGERING, "child.lingering", verdict.why)
            elif verdict.stale:
                child.judged_stuck(verdict.why)
        if child.stuck is not None:
            self._stop_judged(child, StopCause.STUCK, "child.stuck", child.stuck)

    def _stop_judged(self, child: Child, cause: StopCause, event: str, why: str) -> None:
        self._say(event, worker=child.rank, pid=child.proc.pid, why=why)
        limits = self.limits
        child.stop_within(cause, limits.stop_signal, judged_kill_secs(limits.grace_secs))

    def _result(self) -> AttemptResult:
        limits = self.limits
        ends = tuple(child.end(limits) for child in self.children)
        first = self._first_failure
        return AttemptResult(
            number=self.number,
            state=self.state,
            ends=ends,
            seconds=time.monotonic() - self._started,
            stop_requested=self._control.stop_requested.is_set(),
            interrupted=self._control.hard_stop.is_set(),
            first_failure=None if first is None else ends[self.children.index(first)],
        )


def _failed_at(child: Child) -> float:
    return child.stuck_at or child.proc.exited_at or time.monotonic()
