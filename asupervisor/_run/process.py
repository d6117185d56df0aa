"""One process ``asupervisor run`` started: its stderr relayed (its last lines kept), its
channel read (what its session reports: ``_logdir/channel``), its end awaited, its process
group killed when it ends.

A process is either spawned (``spawn``: the runner's own child) or adopted (``adopt``: a
start the warm standby forked, which the runner, its subreaper, inherits: waited on
through a pidfd, its stderr and channel pipes the runner's as for a spawned one)."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc

from .._logdir import channel as _channel
from .._logdir.heartbeat import Beat

TAIL_LINES = 20  # lines of a child's stderr kept for the report
RELAY_DRAIN_SECS = 2.0  # after a child exits, how long its stderr and channel may still flow
READ_BYTES = 64 * 1024


@dataclass
class Heard:
    """What a process has said on its channel: the newest of each kind, and its commits."""

    ready_at: float | None = None  # time.monotonic() when a standby said its imports are done
    import_secs: float | None = None
    session: _channel.SessionBegan | None = None  # the newest session that began in it
    beat: Beat | None = None  # the newest beat
    commits: int = 0  # checkpoints its sessions committed (their own saves, never a restore)
    committed: int | None = None  # the newest of them
    unwritten: list[_channel.Unwritten] = field(default_factory=list)  # one per file
    logdirs: list[str] = field(default_factory=list)  # where its chief sessions commit

    def take(self, report: _channel.Report) -> None:
        if isinstance(report, _channel.Ready):
            self.ready_at, self.import_secs = time.monotonic(), report.seconds
        elif isinstance(report, _channel.SessionBegan):
            self.session = report
            if report.logdir is not None and report.logdir not in self.logdirs:
                self.logdirs.append(report.logdir)
        elif isinstance(report, Beat):
            self.beat = report
        elif isinstance(report, _channel.Commit):
            self.commits += 1
            self.committed = max(report.step, self.committed or report.step)
        else:
            self.unwritten.append(report)


OnReport = Callable[["Proc", _channel.Report], None]


class Proc:
    """One process the supervisor started, with the channel it was given."""

    def __init__(
        self,
        pid: int,
        stderr: AsyncIterator[bytes] | None,
        wait: Callable[[], Awaitable[int]],
        channel: int,
        channel_number: int,
        tg: anyio.abc.TaskGroup,
        write: Callable[[bytes], None],
        on_report: OnReport,
        on_exit: Callable[[Proc], None],
    ) -> None:
        self.pid = pid
        self.channel_number = channel_number  # the write end's number in the process
        self.returncode: int | None = None  # set once its stderr and channel were drained
        self.exited_at: float | None = None  # time.monotonic() when it was reaped
        self.reaped = False
        self.gone = anyio.Event()  # reaped (its pipes may still be drained)
        self.exited = anyio.Event()
        self.heard = Heard()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._stderr = stderr
        self._reap = wait
        self._channel = channel
        self._write = write
        self._on_report = on_report
        self._on_exit = on_exit
        self._partial = b""
        self._relayed = anyio.Event()
        self._drained = anyio.Event()
        self._readers = (anyio.CancelScope(), anyio.CancelScope())  # stderr, channel
        tg.start_soon(self._relay)
        tg.start_soon(self._listen)
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
        stream = self._stderr
        try:
            with self._readers[0]:
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

    async def _listen(self) -> None:
        """Read the channel until every writer has closed it (or the reads are cut)."""
        receiver = _channel.Receiver()
        try:
            with self._readers[1]:
                async for chunk in _read(self._channel):  # closes it at the end
                    for report in receiver.feed(chunk):
                        self.heard.take(report)
                        self._on_report(self, report)
        finally:
            self._drained.set()

    async def _wait(self) -> None:
        returncode = await self._reap()
        self.reaped = True
        self.gone.set()
        self.exited_at = time.monotonic()
        self.kill_group()  # anything the child started and left behind
        with anyio.move_on_after(RELAY_DRAIN_SECS):  # a grandchild may hold the pipes
            await self._relayed.wait()
            await self._drained.wait()
        _reap_group(self.pid)  # as the subreaper, what it left behind is the runner's
        for readers in self._readers:
            readers.cancel()
        self.returncode = returncode
        self.exited.set()
        self._on_exit(self)


async def spawn(
    argv: Sequence[str],
    env: dict[str, str],
    tg: anyio.abc.TaskGroup,
    write: Callable[[bytes], None],
    on_report: OnReport,
    on_exit: Callable[[Proc], None],
    stdin: int | None = None,
) -> Proc:
    """Start ``argv`` in a process group of its own, with a channel (``ASUPERVISOR_CHANNEL``
    in its environment names the write end)."""
    read_end, write_end = pipe()
    try:
        process = await anyio.open_process(
            list(argv),
            stdin=subprocess.DEVNULL if stdin is None else stdin,
            stdout=None,  # the supervisor's own: a progress bar works as without it
            stderr=subprocess.PIPE,
            env={**env, _channel.ENV: str(write_end)},
            start_new_session=True,  # a group of its own: signals and kills reach it whole
            pass_fds=(write_end,),
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)  # the child's now: the read end sees the end when it exits
    stderr = process.stderr
    return Proc(
        process.pid, None if stderr is None else _chunks(stderr), process.wait,
        read_end, write_end, tg, write, on_report, on_exit,
    )  # fmt: skip


async def _chunks(stream: anyio.abc.ByteReceiveStream) -> AsyncIterator[bytes]:
    async for chunk in stream:
        yield chunk


def pipe() -> tuple[int, int]:
    """A pipe whose read end the runner reads without blocking the loop."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    return read_end, write_end


def adopt(
    pid: int,
    stderr: int,
    channel: int,
    channel_number: int,
    tg: anyio.abc.TaskGroup,
    write: Callable[[bytes], None],
    on_report: OnReport,
    on_exit: Callable[[Proc], None],
) -> Proc:
    """A process the standby forked and the runner inherited as its subreaper: ``stderr``
    and ``channel`` are the read ends of its pipes (``pipe()``), now the Proc's."""
    waiter = os.pidfd_open(pid)  # before anything can reap it: the pid stays this process

    async def wait() -> int:
        try:
            while True:
                await anyio.wait_readable(waiter)
                reaped, status = os.waitpid(pid, os.WNOHANG)
                if reaped == pid:
                    return os.waitstatus_to_exitcode(status)
        finally:
            os.close(waiter)

    return Proc(pid, _read(stderr), wait, channel, channel_number, tg, write, on_report, on_exit)


async def _read(fd: int) -> AsyncIterator[bytes]:
    """What a pipe's read end gives until every writer has closed it."""
    try:
        while True:
            await anyio.wait_readable(fd)
            try:
                chunk = os.read(fd, READ_BYTES)
            except BlockingIOError:
                continue
            if not chunk:
                return
            yield chunk
    finally:
        os.close(fd)


def _reap_group(pgid: int) -> None:
    """Reap the dead of a process group that was reparented to the runner (a subreaper
    inherits what an adopted start left behind); never waits."""
    with contextlib.suppress(ChildProcessError, OSError):
        while os.waitpid(-pgid, os.WNOHANG)[0] > 0:
            pass
