"""The warm standby of ``asupervisor run --standby``, from the runner's side: one process
per run that imports TensorFlow once (``standby.py``) and forks every start of every
worker, which the runner adopts (its subreaper) and owns as it owns a cold start.

A start asked for while the standby still imports waits for its imports (they are
further along than a cold start's); the runner says so (``start='standby (still
importing)'``). A standby that cannot be used (Linux only: a subreaper and pidfds; the
command must be ``python SCRIPT``) or that dies says why once, and the run starts cold.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import socket
from collections.abc import Awaitable, Callable, Sequence

import anyio

from .process import Proc, pipe

# Runs the standby's file as `__main__`, its own path taken out of sys.argv.
_LOADER = "import sys; p = sys.argv.pop(1); exec(compile(open(p).read(), p, 'exec'))"
_PR_SET_CHILD_SUBREAPER = 36

Spawn = Callable[[list[str], dict[str, str], int], Awaitable[Proc]]
Adopt = Callable[[int, int, int, int], Proc]  # pid, stderr, channel, channel number


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


def become_subreaper() -> str | None:
    """Make this process inherit its descendants' orphans; else why it cannot."""
    if not hasattr(os, "pidfd_open"):
        return "needs Linux 5.3 or newer (pidfds)"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return f"cannot become a subreaper: {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as exc:
        return f"cannot become a subreaper: {exc}"
    return None


class Standby:
    """The run's one standby process; ``start`` forks a start from it."""

    def __init__(
        self, command: Sequence[str], preload: Sequence[str], enabled: bool,
        say: Callable[..., None],
    ) -> None:  # fmt: skip
        plan = standby_plan(command, os.environ.get("PATH"))
        self.plan = plan if isinstance(plan, tuple) else None
        self.problem = plan if enabled and isinstance(plan, str) else None
        self.enabled = enabled
        self.proc: Proc | None = None
        self._preload = tuple(preload)
        self._say = say
        self._orders: socket.socket | None = None
        self._lock = anyio.Lock()

    @property
    def state(self) -> str:
        """For the run's first line: off, on, or why the standby cannot be used."""
        return "off" if not self.enabled else self.problem or "on"

    @property
    def usable(self) -> bool:
        return self.enabled and self.problem is None and self.plan is not None

    @property
    def ready(self) -> bool:
        """Its channel said its imports are done."""
        return self.proc is not None and self.proc.heard.ready_at is not None

    async def open(self, spawn: Spawn) -> None:
        """Start the standby process (its imports begin at once)."""
        if not self.usable:
            return
        if (problem := become_subreaper()) is not None:
            self._unusable(problem)
            return
        assert self.plan is not None
        interpreter, script = self.plan
        from . import standby as _standby

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        # `python -c`, not `python FILE`: the package's directory must not come first on
        # sys.path; the file is read by a one-line loader (`ps` shows a short line).
        argv = [interpreter, "-c", _LOADER, _standby.__file__, str(os.getpid()), script]
        try:
            self.proc = await spawn([*argv, *self._preload], dict(os.environ), theirs.fileno())
        except OSError as exc:
            ours.close()
            self._unusable(f"cannot start: {exc}")
            return
        finally:
            theirs.close()
        self._orders = ours
        self._say("standby.started", pid=self.proc.pid)

    async def start(
        self, argv: Sequence[str], env: dict[str, str], adopt: Adopt, timeout: float
    ) -> Proc | None:
        """Fork ``argv`` (the script and its arguments) from the standby; ``None`` if it
        cannot, or has not answered within ``timeout`` (the caller starts cold)."""
        if self._orders is None or not self.usable:
            return None
        order = json.dumps({"argv": list(argv), "env": env, "cwd": os.getcwd()}).encode()
        ours: list[int] = []  # the read ends of its stderr and channel, the write end of go
        theirs: list[int] = []  # the ends the start gets
        proc = None
        try:
            for end in (pipe(), pipe(), os.pipe()[::-1]):  # go: the start reads, blocking
                ours.append(end[0])
                theirs.append(end[1])
            pid = None
            async with self._lock:
                with anyio.move_on_after(timeout) as waited:
                    pid = await self._ask(order, theirs)
            if pid is None:
                if waited.cancelled_caught:
                    self._unusable(f"no start forked within {timeout:g} s (--startup-timeout)")
                else:
                    self._lost()
                return None
            proc = adopt(pid, ours[0], ours[1], theirs[1])  # the read ends: the Proc's
            os.write(ours[2], b"g")  # watched now: it may run the command
            return proc
        except OSError as exc:  # out of files: cold starts (a start not told go exits)
            self._unusable(f"cannot start from the standby: {exc}")
            return None
        except BaseException:  # cancelled while it forked: the start is never told go
            self._unusable("a start was abandoned while the standby forked it")
            raise
        finally:
            for fd in theirs + ours[2:]:
                os.close(fd)
            if proc is None:
                for fd in ours[:2]:
                    os.close(fd)

    async def _ask(self, order: bytes, fds: list[int]) -> int | None:
        orders = self._orders
        assert orders is not None
        try:
            socket.send_fds(orders, [order], fds)
            await anyio.wait_readable(orders)
            answer = orders.recv(4096)
        except OSError:
            return None
        if not answer:
            return None  # it exited: its lines are on the run's stderr
        return int(json.loads(answer)["pid"]) if b"pid" in answer else None

    def _lost(self) -> None:
        proc = self.proc
        tail = "" if proc is None else " | ".join(list(proc.tail)[-3:])
        code = None if proc is None else proc.returncode
        self._unusable(f"the standby exited ({code}): {tail}"[:400])

    def _unusable(self, why: str) -> None:
        self.problem = why
        self._say("standby.unusable", reason=why, action="cold starts from now")
        if self._orders is not None:
            with contextlib.suppress(OSError):
                self._orders.close()
            self._orders = None
        if self.proc is not None:
            self.proc.kill_group()

    def close(self) -> None:
        """No more starts: the standby exits (its socket closes)."""
        if self._orders is not None:
            with contextlib.suppress(OSError):
                self._orders.close()
            self._orders = None

    def owns(self, proc: Proc) -> bool:
        return proc is self.proc
