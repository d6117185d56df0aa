"""The warm standbys of ``asupervisor run --standby``: one per worker slot, started beside
the attempt (its imports at the lowest CPU priority: ``standby.py``), counted on once its
channel said it is ready, and handed the next start of that slot.

A start that comes while a standby still imports is handed to it all the same (it is
further along than a cold start, and from then on imports at the command's priority);
the runner says so (``start='standby (still importing)'``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.abc

from .process import Proc

# Runs the standby's file as `__main__`, its own path taken out of sys.argv.
_LOADER = "import sys; p = sys.argv.pop(1); exec(compile(open(p).read(), p, 'exec'))"

Spawn = Callable[[list[str], dict[str, str], int | None], Awaitable[Proc]]


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


class Standby:
    """A warm interpreter for one worker slot, waiting for its command on stdin."""

    def __init__(self, proc: Proc, rank: int) -> None:
        self.proc, self.rank = proc, rank

    @property
    def ready(self) -> bool:
        """Its channel said its imports are done."""
        return self.proc.heard.ready_at is not None

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


class Standbys:
    """The pool: at most one standby per worker slot, each used once."""

    def __init__(
        self,
        command: Sequence[str],
        preload: Sequence[str],
        enabled: bool,
        spawn: Spawn,
        start_soon: Callable[..., Any],
        say: Callable[..., None],
    ) -> None:
        plan = standby_plan(command, os.environ.get("PATH"))
        self.plan = plan if isinstance(plan, tuple) else None
        self.problem = plan if enabled and isinstance(plan, str) else None
        self.enabled = enabled
        self._preload = tuple(preload)
        self._spawn = spawn
        self._start_soon = start_soon
        self._say = say
        self._held: dict[int, Standby] = {}
        self._starting: set[int] = set()

    @property
    def state(self) -> str:
        """For the run's first line: off, on, or why a standby cannot be used."""
        return "off" if not self.enabled else self.problem or "on"

    def fill(self, ranks: range) -> None:
        """Start a standby for each slot that has none (each in a task of its own)."""
        if not self.enabled or self.plan is None or self.problem is not None:
            return
        for rank in ranks:
            if rank not in self._held and rank not in self._starting:
                self._starting.add(rank)
                self._start_soon(self._start, rank)

    def take(self, rank: int) -> Standby | None:
        """The slot's standby, to hand a start to (one still starting is not waited for)."""
        return self._held.pop(rank, None)

    def rank_of(self, proc: Proc) -> int | None:
        return next((s.rank for s in self._held.values() if s.proc is proc), None)

    async def _start(self, rank: int) -> None:
        assert self.plan is not None
        interpreter, script = self.plan
        from . import standby as _standby

        # `python -c`, not `python FILE`: the package's directory must not come first on
        # sys.path; the file is read by a one-line loader (`ps` shows a short line).
        argv = [interpreter, "-c", _LOADER, _standby.__file__, str(os.getpid()), script]
        argv += self._preload
        try:
            proc = await self._spawn(argv, dict(os.environ), subprocess.PIPE)
        except OSError as exc:
            self.problem = f"cannot start: {exc}"
            self._say("standby.unusable", reason=self.problem)
            return
        finally:
            self._starting.discard(rank)
        standby = Standby(proc, rank)
        self._held[rank] = standby
        self._say("standby.started", worker=rank, pid=proc.pid)
        await proc.exited.wait()
        if self._held.get(rank) is standby:  # it died before it was used
            self.lost(standby)

    def lost(self, standby: Standby) -> None:
        """A standby exited before it was used: cold starts from now on."""
        if self._held.get(standby.rank) is standby:
            del self._held[standby.rank]
        code = standby.proc.returncode
        tail = " | ".join(list(standby.proc.tail)[-3:])
        self.problem = f"a standby exited ({code}) before it was used: {tail}"[:400]
        self._say("standby.unusable", reason=self.problem, action="cold starts from now")
