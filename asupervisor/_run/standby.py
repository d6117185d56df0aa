"""The warm standby: one interpreter with TensorFlow imported, forking each start of a run.

``asupervisor run --standby`` runs this file with the command's own interpreter, through
``python -c LOADER THIS_FILE RUNNER_PID SCRIPT MODULE...`` (not ``python THIS_FILE``: the
package's directory must not come first on ``sys.path``); it needs nothing else. It
imports the modules once (TensorFlow, Keras, asupervisor: a cold start spends most of its
seconds there), builds nothing, and says on its channel (``ASUPERVISOR_CHANNEL``, a pipe
to the runner) that it is ready. Its stdin is a Unix socket to the runner, which sends
one order per start: ``{"argv": [script, *args], "env": {...}, "cwd": "..."}`` with the
write ends of the start's stderr and channel pipes and the read end of a "go" pipe. For
each order it forks a process that becomes that command (the environment, the working
directory, ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` would have them; the
script runs as ``__main__``, its exit status is the process's) and answers with its pid.

**The start is the runner's process, not the standby's.** The fork goes through a
middle process that exits at once, so that the start is reparented to the runner (its
subreaper, ``PR_SET_CHILD_SUBREAPER``): the runner waits for it, reads its exit status
and signals its process group (its own: ``setsid``) as for a start it spawned; the
standby answers only once the middle process is gone. The start dies with the runner
(``PR_SET_PDEATHSIG``, set once it is the runner's), and runs the command only when the
runner says go, once it watches the start: a start the runner gave up on never runs.

**Imported once per run.** Every start of every worker forks from the same imports: a
restart, or a second worker, imports nothing, and nothing imports beside the training.

What it cannot be: ``python -m``, interpreter options, a command that is not a Python
script; environment variables read while the modules were imported keep the value the
standby started with (the supervisor's own environment, as a cold start would see it:
only the variables ``asupervisor run`` sets per start differ, and none is read at
import). A module that fails to import is skipped: the script imports it (or fails to)
as usual. What the standby imported is frozen out of the cyclic garbage collector's sight
(``gc.freeze``): ``gc.get_objects()`` in a start does not list it, and a reference cycle
among those objects that becomes garbage later is never freed (at most the imports' own
size). The standby dies with its runner and exits when its socket closes.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import time

CHANNEL = "ASUPERVISOR_CHANNEL"  # _logdir.channel.ENV (nothing of the package is imported yet)
ADOPTION_SECS = 10.0  # the middle process exits at once; past this, something is wrong


def _die_with(parent: int) -> None:
    """SIGKILL when ``parent`` dies (now this process's parent), or exit now if it has."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass  # not Linux: the supervisor's own exit paths still kill it
    if os.getppid() != parent:  # it died before the line above
        os._exit(137)


def _import(modules: list[str]) -> None:
    begun = time.monotonic()
    for name in modules:
        try:
            __import__(name)
        except Exception:
            pass  # a module the script does not have: it is imported (or not) as usual
    # The imports are kept out of the cyclic collector's sight (as Python's docs advise
    # before forking): a start's collections, its last one at exit included, no longer
    # walk every object they made (a start's exit took about 1 s of CPU; now a fifth).
    gc.collect()
    gc.freeze()
    line = json.dumps({"kind": "ready", "seconds": round(time.monotonic() - begun, 3)})
    try:
        channel = int(os.environ.pop(CHANNEL))
        os.write(channel, (line + "\n").encode())
        os.close(channel)  # a start gets a channel of its own
    except (KeyError, ValueError, OSError):
        pass  # no channel: the runner counts on it once it answers


def _fork(runner: int, go: int) -> int | None:
    """Fork a start the runner adopts: its pid here (-1 if it died at once), ``None`` in the
    start itself (once the runner said go)."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(read_end)
        if os.fork() == 0:
            # A group of its own before the runner hears of it: its signals reach it whole.
            os.setsid()
            os.write(write_end, str(os.getpid()).encode())
            os.close(write_end)
            _adopted_by(runner, go)
            return None
        os._exit(0)  # the start is orphaned: the runner, its subreaper, inherits it
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        pid = answer.read()  # until the start and the middle closed it
    os.waitpid(middle, 0)  # gone: the start is the runner's by now
    return int(pid) if pid else -1  # -1: the start died before it said its pid


def _adopted_by(runner: int, go: int) -> None:
    deadline = time.monotonic() + ADOPTION_SECS
    while os.getppid() != runner:
        if time.monotonic() > deadline:
            os._exit(137)
        time.sleep(0.001)
    _die_with(runner)
    # The runner writes one byte once it watches this process (it closes its end if it
    # cannot): a start it does not watch never runs the command.
    if os.read(go, 1) != b"g":
        os._exit(137)
    os.close(go)


def _become(order: dict[str, object], stderr: int, channel: int) -> None:
    """Turn this forked start into ``python SCRIPT ARGS...``."""
    devnull = os.open(os.devnull, os.O_RDONLY)  # a cold start's stdin is /dev/null too
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(stderr, 2)
    os.close(stderr)
    os.set_inheritable(channel, True)  # as a spawned start's (a command it runs may report)
    env = dict(order["env"])  # type: ignore[call-overload]
    env[CHANNEL] = str(channel)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(str(order["cwd"]))
    sys.argv[:] = list(order["argv"])  # type: ignore[call-overload]
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")


def main() -> None:
    runner, script = int(sys.argv[1]), sys.argv[2]
    _die_with(runner)
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # as `python SCRIPT` sets it
    orders = socket.socket(fileno=os.dup(0))  # stdin: a Unix socket to the runner
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _import(sys.argv[3:])
    while True:
        message, fds, _, _ = socket.recv_fds(orders, 1 << 20, 3)
        if not message:
            os._exit(0)  # the runner no longer needs this standby
        sys.stdout.flush()
        sys.stderr.flush()
        stderr, channel, go = fds
        pid = _fork(runner, go)
        if pid is None:
            orders.close()
            _become(json.loads(message), stderr, channel)
            return
        for fd in fds:
            os.close(fd)
        orders.sendall(json.dumps({"pid": pid} if pid > 0 else {"error": "no start"}).encode())


if __name__ == "__main__":  # run with `python -c`; never imported
    main()
