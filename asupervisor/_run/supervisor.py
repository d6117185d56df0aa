"""``asupervisor run``: a process supervisor for training commands, on anyio.

It starts the command (or N workers of a multi-worker job), forwards a graceful stop,
watches each child's heartbeat, and restarts the job after a failure, all children
together, with a restart budget that progress refills:

- **What is restarted.** A child's exit status says how its training ended
  (``asv.Outcome``): done (0), preempted (42), a failure that cannot be fixed by
  retrying (78), interrupted (130) are passed on; a failure (1, or a death by a
  signal) or a stuck run (124, or a heartbeat past its deadline) is restarted.
- **The budget.** A failure after which a newer checkpoint is committed than when its
  attempt began costs nothing, and the job restarts at once. ``max_failures`` failures
  in a row without one is a crash loop: it gives up with a report (each failure's exit
  status, the step it reached, the checkpoint, the last lines of stderr). Failures
  without progress wait ``backoff_secs``, doubling up to ``max_backoff_secs``.
- **Bounded.** A stop (SIGTERM, SIGINT, SIGUSR1 to the supervisor) is sent to each child
  as ``stop_signal``; a child still running ``grace_secs`` later is killed. A second
  SIGINT kills at once. Every child runs in a process group of its own, killed whole
  when the child ends and when the supervisor exits however it exits; a child also
  dies with the supervisor (``PR_SET_PDEATHSIG``) if the supervisor is SIGKILLed.
- **Liveness.** Each child writes the heartbeat file named by ``ASUPERVISOR_HEARTBEAT``
  (any asupervisor session does); a child whose beat is past ``stuck_after`` (or
  ``startup_timeout`` before its first step) gets ``stop_signal``, then SIGKILL after
  ``STUCK_KILL_SECS``, and counts as stuck.
- **Warm standby.** With ``standby``, an interpreter with TensorFlow imported waits
  (``_standby``) and takes the next start of a ``python SCRIPT ...`` command.

This module never imports TensorFlow: progress is read from the logdir's state file.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import anyio
import anyio.abc

from .._kinds import Phase
from .._logdir import heartbeat as _heartbeat
from .._logdir.heartbeat import Beat, judge
from .._outcome import Outcome

STUCK_KILL_SECS = 10.0  # a stuck child's time between the stop signal and SIGKILL
POLL_SECS = 0.2  # how often heartbeats are read and deadlines checked
TAIL_LINES = 20  # lines of a child's stderr kept for the report
RELAY_DRAIN_SECS = 2.0  # after a child exits, how long its stderr may still flow
STANDBY_AFTER_SECS = 10.0  # without heartbeats, a standby starts this long after a child
DEFAULT_PRELOAD = ("tensorflow", "keras", "asupervisor")

# The exit statuses of the contract, and what each means for a restart.
_BY_STATUS = {outcome.exit_status: outcome for outcome in Outcome}
_RESTARTED = {Outcome.FAILED, Outcome.STUCK}
# Worse first: what a job's outcome is when its workers ended differently.
_SEVERITY = [
    Outcome.FAILED_PERMANENTLY,
    Outcome.STUCK,
    Outcome.FAILED,
    Outcome.INTERRUPTED,
    Outcome.PREEMPTED,
    Outcome.DONE,
]
_CANNOT_RUN = (126, 127)  # the shell's "not executable" and "not found"

# Runs the standby's file as `__main__`, its own path taken out of sys.argv.
_LOADER = "import sys; p = sys.argv.pop(1); exec(compile(open(p).read(), p, 'exec'))"

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
    grace_secs: float = 120.0
    stop_signal: signal.Signals = signal.SIGTERM
    stuck_after: float | None = 300.0  # None: heartbeats are not watched
    startup_timeout: float = 900.0
    standby: bool = False
    preload: tuple[str, ...] = DEFAULT_PRELOAD


def outcome_of(status: int) -> Outcome:
    """What a child's exit status (the shell's: 128+N for a signal) says."""
    if status in _CANNOT_RUN:
        return Outcome.FAILED_PERMANENTLY  # a command that is not there will not appear
    return _BY_STATUS.get(status, Outcome.FAILED)


def shell_status(returncode: int) -> int:
    """A ``Popen.returncode`` as a shell shows it: a death by signal N is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_status(status: int) -> str:
    if status > 128 and status - 128 in signal.Signals._value2member_map_:
        return f"{status} ({signal.Signals(status - 128).name})"
    return f"{status} ({outcome_of(status).value})"


def standby_plan(command: Sequence[str], path: str | None) -> tuple[str, str] | str:
    """``(interpreter, script)`` when ``command`` can start in a warm standby (``python
    SCRIPT ARGS...``), else why it cannot (it starts cold)."""
    if len(command) < 2:
        return "the command is not `python SCRIPT ...`"
    if not re.fullmatch(r"python[0-9.]*", os.path.basename(command[0])):
        return f"{command[0]!r} is not a Python interpreter (the command must be python SCRIPT)"
    if command[1].startswith("-"):
        return f"interpreter options ({command[1]}: -m, -u, -X...) need a cold start"
    interpreter = shutil.which(command[0], path=path)
    if interpreter is None:
        return f"{command[0]!r} is not found"
    if not os.path.isfile(command[1]):
        return f"{command[1]!r} is not a file"
    return interpreter, command[1]


def newest_step(logdir: str) -> int | None:
    """The step of the newest checkpoint the logdir's state file names (without
    TensorFlow for a local logdir); ``None`` when there is none."""
    from .._logdir.history import head_step

    return head_step(logdir)


def local_tf_configs(count: int) -> list[str]:
    """One TF_CONFIG per worker of a job on free loopback ports of this machine."""
    import socket

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


class Proc:
    """One process the supervisor started: its stderr relayed (and its last lines kept),
    its end awaited, its process group killed when it ends."""

    def __init__(
        self, process: anyio.abc.Process, tg: anyio.abc.TaskGroup, write: Callable[[bytes], None]
    ) -> None:
        self.process = process
        self.pid = process.pid
        self.returncode: int | None = None  # set once its stderr has been read to the end
        self.reaped = False
        self.exited = anyio.Event()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._write = write
        self._partial = b""
        self._relayed = anyio.Event()
        tg.start_soon(self._relay)
        tg.start_soon(self._wait)

    def signal(self, sig: int) -> None:
        if not self.reaped:  # a reaped pid may be another process's by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the process group (the child and whatever it started)."""
        if self.returncode is not None:
            return  # killed at its end already; the group id may be reused since
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    async def _relay(self) -> None:
        stream = self.process.stderr
        try:
            if stream is not None:
                async for chunk in stream:
                    self._keep(chunk)
                    await anyio.to_thread.run_sync(self._write, chunk)
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        finally:
            if self._partial:
                self.tail.append(self._partial.decode(errors="replace"))
            self._relayed.set()

    def _keep(self, chunk: bytes) -> None:
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self.tail.extend(line.decode(errors="replace") for line in lines)
        if len(self._partial) > 4096:
            self.tail.append(self._partial.decode(errors="replace"))
            self._partial = b""

    async def _wait(self) -> None:
        returncode = await self.process.wait()
        self.reaped = True
        self.kill_group()  # anything the child started and left behind
        with anyio.move_on_after(RELAY_DRAIN_SECS):  # a grandchild may hold the pipe
            await self._relayed.wait()
        self.returncode = returncode
        self.exited.set()


@dataclass
class Child:
    """One worker of one attempt."""

    rank: int
    proc: Proc
    heartbeat: str
    started: float  # time.monotonic()
    how: str  # "cold" or "standby"
    beat: Beat | None = None
    stuck: str | None = None  # why the supervisor judged it stuck
    stop_sent: bool = False
    kill_at: float | None = None
    killed: bool = False

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    @property
    def status(self) -> int:
        """Its exit status as passed on: a child the supervisor killed is stuck (124)."""
        assert self.proc.returncode is not None
        if self.stuck is not None or self.killed:
            return Outcome.STUCK.exit_status
        return shell_status(self.proc.returncode)

    def saw(self, beat: Beat | None) -> None:
        self.beat = beat

    def judged_stuck(self, why: str) -> None:
        self.stuck = why

    def kill(self) -> None:
        """Past its deadline: SIGKILL to its whole process group."""
        self.killed = True
        self.proc.kill_group()

    def stop(self, sig: int, within: float) -> None:
        """Ask for a graceful stop; SIGKILL ``within`` seconds from now if still running."""
        if not self.running:
            return
        if not self.stop_sent:
            self.stop_sent = True
            self.proc.signal(sig)
        deadline = time.monotonic() + within
        self.kill_at = deadline if self.kill_at is None else min(self.kill_at, deadline)


@dataclass
class AttemptRecord:
    number: int
    seconds: float
    base_step: int | None  # the newest checkpoint when it began
    statuses: list[int]
    outcome: Outcome
    reached_step: int | None  # the step the chief's heartbeat last showed
    checkpoint_step: int | None  # the newest committed checkpoint after it
    progressed: bool  # a newer checkpoint than when it began
    why: str  # the worst ending: which worker, and how
    tail: list[str] = field(default_factory=list)


class Standby:
    """A warm interpreter for one worker slot, waiting for its command on stdin."""

    def __init__(self, proc: Proc, interpreter: str, script: str) -> None:
        self.proc, self.interpreter, self.script = proc, interpreter, script

    async def hand_over(self, argv: Sequence[str], env: dict[str, str]) -> bool:
        """Give it the command; ``False`` if it is gone (the caller starts cold)."""
        stdin = self.proc.process.stdin
        if self.proc.returncode is not None or stdin is None:
            return False
        order = {"argv": list(argv), "env": env, "cwd": os.getcwd()}
        try:
            await stdin.send((json.dumps(order) + "\n").encode())
            await stdin.aclose()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        return True


class ProcessSupervisor:
    def __init__(self, config: RunConfig, out: TextIO, scratch: str) -> None:
        self.config = config
        self.out = out
        self.scratch = scratch
        self.stop_requested = anyio.Event()
        self.hard_stop = anyio.Event()
        self.stop_signal_name: str | None = None
        self.changed = anyio.Event()
        self.procs: list[Proc] = []  # everything started: killed when the supervisor exits
        self.standbys: dict[int, Standby] = {}
        self.starting_standby: set[int] = set()
        self.standby_problem: str | None = None
        self.history: list[AttemptRecord] = []
        self._tg: anyio.abc.TaskGroup | None = None
        plan = standby_plan(config.command, os.environ.get("PATH"))
        self.plan: tuple[str, str] | None = plan if isinstance(plan, tuple) else None
        if config.standby and isinstance(plan, str):
            self.standby_problem = plan

    # -- output --------------------------------------------------------------------

    def say(self, event: str, **fields: Any) -> None:
        """One line on the supervisor's stderr: ``asupervisor run: event key=value ...``."""
        parts = [f"asupervisor run: {event}"]
        for key, value in fields.items():
            text = str(value)
            parts.append(f"{key}={text if text and ' ' not in text else repr(text)}")
        with contextlib.suppress(OSError, ValueError):
            print(" ".join(parts), file=self.out, flush=True)

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
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._watch_signals)
                try:
                    status = await self._run()
                finally:
                    self.kill_everything()
                tg.cancel_scope.cancel()
        finally:
            self.kill_everything()
        self.say("run.ended", status=describe_status(status))
        return status

    def kill_everything(self) -> None:
        for proc in self.procs:
            proc.kill_group()

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if self.stop_requested.is_set():
                    if signum == signal.SIGINT:
                        self.say("run.stopping", signal=name, action="kill at once")
                        self.hard_stop.set()
                        self.kill_everything()
                        self.changed.set()
                    continue
                self.stop_signal_name = name
                self.stop_requested.set()
                self.changed.set()
                self.say(
                    "run.stopping",
                    signal=name,
                    action=f"{self.config.stop_signal.name} to each child",
                    grace_secs=self.config.grace_secs,
                )

    async def _run(self) -> int:
        config = self.config
        self.say(
            "run.started",
            command=" ".join(config.command),
            workers=config.workers,
            logdir=config.logdir,
            standby=("off" if not config.standby else self.standby_problem or "on"),
        )
        streak, number = 0, 0
        while True:
            number += 1
            base = await self._newest_step()
            started = time.monotonic()
            children = await self._start(number)
            await self._watch(children)
            record = await self._record(number, children, started, base)
            self.history.append(record)
            if self.hard_stop.is_set():
                return Outcome.INTERRUPTED.exit_status
            if record.outcome not in _RESTARTED or self.stop_requested.is_set():
                return self._worst(record)
            if record.progressed:
                streak, delay = 0, 0.0
            else:
                streak += 1
                if streak >= config.max_failures:
                    self._report_crash_loop(streak, base)
                    return self._worst(record)
                delay = min(config.backoff_secs * 2 ** (streak - 1), config.max_backoff_secs)
            self.say(
                "run.restarting",
                attempt=number + 1,
                after=record.why,
                checkpoint_step=record.checkpoint_step,
                progress="yes (costs nothing)" if record.progressed else "no",
                failures_without_progress=f"{streak}/{config.max_failures}",
                in_secs=round(delay, 2),
            )
            with anyio.move_on_after(delay):
                await self.stop_requested.wait()
            if self.hard_stop.is_set():
                return Outcome.INTERRUPTED.exit_status
            if self.stop_requested.is_set():
                # Nothing is running; the newest checkpoint is the run's state.
                return Outcome.PREEMPTED.exit_status

    def _worst(self, record: AttemptRecord) -> int:
        """The status of the worker whose ending was the worst (the first of them)."""
        order = {o: i for i, o in enumerate(_SEVERITY)}
        return min(record.statuses, key=lambda s: order[outcome_of(s)])

    async def _newest_step(self) -> int | None:
        """The newest committed checkpoint in the logdir, if one was given."""
        if self.config.logdir is None:
            return None
        try:
            return await anyio.to_thread.run_sync(newest_step, self.config.logdir)
        except (OSError, ValueError):
            return None

    # -- one attempt ---------------------------------------------------------------

    async def _start(self, number: int) -> list[Child]:
        config = self.config
        configs = local_tf_configs(config.workers) if config.workers > 1 else None
        children = []
        for rank in range(config.workers):
            heartbeat = os.path.join(self.scratch, f"attempt{number}-worker{rank}.json")
            env = dict(os.environ)
            env[_heartbeat.ENV_FILE] = heartbeat
            env[_heartbeat.ENV_ATTEMPT] = str(number)
            if configs is not None:
                env["TF_CONFIG"] = configs[rank]
            proc, how = await self._launch(rank, env)
            children.append(Child(rank, proc, heartbeat, time.monotonic(), how))
            self.say("child.started", attempt=number, worker=rank, pid=proc.pid, start=how)
        return children

    async def _launch(self, rank: int, env: dict[str, str]) -> tuple[Proc, str]:
        standby = self.standbys.pop(rank, None)  # one being started is not waited for
        if standby is not None:
            if await standby.hand_over(self.config.command[1:], env):
                return standby.proc, "standby"
            self._standby_lost(standby)
        command = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid())]
        return await self._spawn([*command, *self.config.command], env), "cold"

    async def _spawn(self, argv: list[str], env: dict[str, str], stdin: int | None = None) -> Proc:
        process = await anyio.open_process(
            argv,
            stdin=subprocess.DEVNULL if stdin is None else stdin,
            stdout=None,  # the supervisor's own: a progress bar works as without it
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a group of its own: signals and kills reach it whole
        )
        assert self._tg is not None
        proc = Proc(process, self._tg, self._write_stderr)
        self.procs.append(proc)
        return proc

    async def _watch(self, children: list[Child]) -> None:
        """Until every child has exited: stops, liveness, one-for-all, deadlines."""
        config = self.config
        assert self._tg is not None
        for child in children:
            self._tg.start_soon(self._notify_exit, child)
        failing = False
        while any(child.running for child in children):
            now = time.monotonic()
            if self.stop_requested.is_set():
                for child in children:
                    child.stop(config.stop_signal, config.grace_secs)
            if not failing:
                for child in children:
                    if child.running and child.stuck is None:
                        await self._check_liveness(child, now)
                failing = any(c.stuck is not None for c in children) or any(
                    outcome_of(c.status) not in (Outcome.DONE, Outcome.PREEMPTED)
                    for c in children
                    if not c.running
                )
                if failing:  # one for all: every worker stops, and all start again
                    for child in children:
                        child.stop(config.stop_signal, config.grace_secs)
            for child in children:
                if child.running and child.kill_at is not None and now >= child.kill_at:
                    child.kill()
            self._maybe_standby(children)
            self.changed = anyio.Event()
            with anyio.move_on_after(POLL_SECS):
                await self.changed.wait()

    async def _notify_exit(self, child: Child) -> None:
        await child.proc.exited.wait()
        self.changed.set()

    async def _check_liveness(self, child: Child, now: float) -> None:
        config = self.config
        if config.stuck_after is None:
            return
        with contextlib.suppress(OSError, ValueError):
            child.saw(await anyio.to_thread.run_sync(_heartbeat.read, child.heartbeat))
        if child.beat is None:
            if now - child.started > config.startup_timeout:
                child.judged_stuck(
                    f"no heartbeat {config.startup_timeout:g} s after its start (does the "
                    "command run an asupervisor session? --no-heartbeat turns this off)"
                )
        else:
            verdict = judge(child.beat, time.time(), config.stuck_after, config.startup_timeout)
            if verdict.stale:
                child.judged_stuck(verdict.why)
        if child.stuck is not None:
            self.say("child.stuck", worker=child.rank, pid=child.proc.pid, why=child.stuck)
            child.stop(config.stop_signal, min(config.grace_secs, STUCK_KILL_SECS))

    async def _record(
        self, number: int, children: list[Child], started: float, base: int | None
    ) -> AttemptRecord:
        statuses = [child.status for child in children]
        for child in children:
            self.say(
                "child.exited",
                attempt=number,
                worker=child.rank,
                status=describe_status(child.status),
                how=child.stuck or ("killed after the grace period" if child.killed else "exited"),
            )
        worst = min(children, key=lambda c: _SEVERITY.index(outcome_of(c.status)))
        why = f"worker {worst.rank}: {describe_status(worst.status)}"
        if worst.stuck is not None:
            why += f", stuck: {worst.stuck}"
        chief = children[0].beat
        if self.config.logdir is not None:
            checkpoint = await self._newest_step()
            progressed = checkpoint is not None and (base is None or checkpoint > base)
        else:  # the chief's heartbeat: what it committed since it restored
            checkpoint = None if chief is None else chief.last_commit_step
            restored = None if chief is None else chief.restored_step
            progressed = checkpoint is not None and (restored is None or checkpoint > restored)
        return AttemptRecord(
            number=number,
            seconds=time.monotonic() - started,
            base_step=base,
            statuses=statuses,
            outcome=outcome_of(worst.status),
            reached_step=None if chief is None else chief.step,
            checkpoint_step=checkpoint,
            progressed=progressed,
            why=why,
            tail=list(worst.proc.tail),
        )

    # -- standbys ------------------------------------------------------------------

    def _maybe_standby(self, children: list[Child]) -> None:
        """Start a standby for each worker slot once its child has restored (not before:
        its imports would slow the child's own start-up)."""
        if not self.config.standby or self.plan is None or self.standby_problem is not None:
            return
        if self.stop_requested.is_set():
            return
        for child in children:
            rank = child.rank
            if rank in self.standbys or rank in self.starting_standby or not child.running:
                continue
            beat = child.beat
            trains = beat is not None and (beat.first_step_done or beat.phase is Phase.RUNNING)
            untold = self.config.stuck_after is None or beat is None
            if trains or (untold and time.monotonic() - child.started > STANDBY_AFTER_SECS):
                assert self._tg is not None
                self.starting_standby.add(rank)
                self._tg.start_soon(self._start_standby, rank)

    async def _start_standby(self, rank: int) -> None:
        assert self.plan is not None
        interpreter, script = self.plan
        from . import standby as _standby

        # `python -c`, not `python FILE`: the package's directory must not come first on
        # sys.path; the file is read by a one-line loader (`ps` shows a short line).
        argv = [interpreter, "-c", _LOADER, _standby.__file__, str(os.getpid()), script]
        argv += self.config.preload
        try:
            proc = await self._spawn(argv, dict(os.environ), stdin=subprocess.PIPE)
        except OSError as exc:
            self.standby_problem = f"cannot start: {exc}"
            self.say("standby.unusable", reason=self.standby_problem)
            return
        finally:
            self.starting_standby.discard(rank)
        standby = Standby(proc, interpreter, script)
        self.standbys[rank] = standby
        self.say("standby.started", worker=rank, pid=proc.pid)
        await proc.exited.wait()
        if self.standbys.get(rank) is standby:  # it died before it was used
            self._standby_lost(standby)

    def _standby_lost(self, standby: Standby) -> None:
        for rank, held in list(self.standbys.items()):
            if held is standby:
                del self.standbys[rank]
        code = standby.proc.returncode
        tail = " | ".join(list(standby.proc.tail)[-3:])
        self.standby_problem = f"a standby exited ({code}) before it was used: {tail}"[:400]
        self.say("standby.unusable", reason=self.standby_problem, action="cold starts from now")

    # -- the report ----------------------------------------------------------------

    def _report_crash_loop(self, streak: int, base: int | None) -> None:
        where = f"logdir {self.config.logdir}" if self.config.logdir else "the chief's heartbeat"
        lines = [
            f"asupervisor run: crash loop: {streak} failures in a row without a checkpoint "
            f"newer than step {base} ({where}); not restarting",
            f"  {'attempt':>7}  {'exit status':<22}  {'reached step':>12}  "
            f"{'checkpoint':>10}  {'newer':>5}  {'ran for':>8}",
        ]
        for r in self.history[-20:]:
            statuses = ", ".join(describe_status(s) for s in r.statuses)
            reached = "?" if r.reached_step is None else str(r.reached_step)
            checkpoint = "none" if r.checkpoint_step is None else str(r.checkpoint_step)
            newer = "yes" if r.progressed else "no"
            lines.append(
                f"  {r.number:>7}  {statuses:<22}  {reached:>12}  {checkpoint:>10}  "
                f"{newer:>5}  {r.seconds:>7.1f}s"
            )
        last = self.history[-1]
        lines.append(f"  the last failure: {last.why}")
        lines.append(f"  the last lines of its stderr (attempt {last.number}):")
        from .._cli.text import shown

        lines += [f"    | {shown(line)}" for line in last.tail] or ["    (none)"]
        with contextlib.suppress(OSError, ValueError):
            print("\n".join(lines), file=self.out, flush=True)


def run_command(config: RunConfig, out: TextIO | None = None) -> int:
    """Supervise ``config.command``; the exit status to end with."""
    scratch = tempfile.mkdtemp(prefix="asupervisor-run-")
    try:
        supervisor = ProcessSupervisor(config, out or sys.stderr, scratch)
        return anyio.run(supervisor.main, backend="asyncio")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
