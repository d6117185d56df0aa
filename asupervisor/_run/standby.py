"""A warm standby: an interpreter with TensorFlow imported, waiting for its command.

``asupervisor run --standby`` runs this file with the command's own interpreter, through
``python -c LOADER THIS_FILE PARENT_PID SCRIPT MODULE...`` (not ``python THIS_FILE``: the
package's directory must not come first on ``sys.path``); it needs nothing else. It
imports the modules (TensorFlow, Keras, asupervisor: a cold start spends most of its
seconds there), builds nothing, says on its channel (``ASUPERVISOR_CHANNEL``, a pipe to
the runner) that it is ready, and waits on its stdin for one JSON line
``{"argv": [script, *args], "env": {...}, "cwd": "..."}``. Then it
becomes that command: the environment, the working directory, ``sys.argv`` and
``sys.path[0]`` as ``python SCRIPT ARGS`` would have them, and the script runs as
``__main__`` (``runpy.run_path``); its exit status is the process's.

**It does not slow the trainer beside it.** The imports run in a thread of their own at
the lowest CPU priority (nice 19; on Linux the nice value is a thread's), while the main
thread, at the priority the standby was started with, waits for the command. When the
command comes, the priority of every thread is put back where the process may (an
unprivileged process cannot lower a nice value: threads the imports started keep theirs),
and the command runs in the main thread at its own priority. A command that comes before
the imports are done waits for them (they are further along than a cold start's).

What it cannot be: ``python -m``, interpreter options, a command that is not a Python
script; environment variables read while the modules were imported keep the value the
standby started with (the supervisor's own environment, as a cold start would see it:
only the variables ``asupervisor run`` sets per attempt differ, and none is read at
import). A module that must be imported in the main thread (one that sets a signal
handler as it is imported) is not preloaded: the script imports it as usual. The standby
dies with its supervisor (``PR_SET_PDEATHSIG``), and exits when its stdin closes without
a command.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

CHANNEL = "ASUPERVISOR_CHANNEL"  # _logdir.channel.ENV (nothing of the package is imported yet)
LOWEST = 19  # nice: runs only when nothing else wants the CPU


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass  # not Linux: the supervisor's own exit paths still kill it
    if os.getppid() != parent:  # the supervisor died before the line above
        os._exit(137)


def _import(modules: list[str]) -> None:
    """In a thread of its own, at the lowest priority: the modules, then ``ready``."""
    begun = time.monotonic()
    try:
        os.setpriority(os.PRIO_PROCESS, 0, LOWEST)  # 0: this thread (Linux)
    except (OSError, AttributeError):
        pass  # imported at the usual priority
    for name in modules:
        try:
            __import__(name)
        except Exception:
            pass  # a module the script does not have: it is imported (or not) as usual
    line = json.dumps({"kind": "ready", "seconds": round(time.monotonic() - begun, 3)})
    try:
        os.write(int(os.environ[CHANNEL]), (line + "\n").encode())
    except (KeyError, ValueError, OSError):
        pass  # no channel: the runner counts on it as soon as it starts


def _restore_priority(nice: int) -> None:
    """Every thread back to ``nice`` where the process may (raising its own priority
    back needs CAP_SYS_NICE or RLIMIT_NICE; the main thread never left it)."""
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except (OSError, ValueError, AttributeError):
            pass


def main() -> None:
    parent, script = int(sys.argv[1]), sys.argv[2]
    _die_with_parent(parent)
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # as `python SCRIPT` sets it
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    importer = threading.Thread(
        target=_import, args=(sys.argv[3:],), name="asupervisor-standby-imports", daemon=True
    )
    importer.start()
    line = sys.stdin.buffer.readline()
    if not line:
        os._exit(0)  # the supervisor no longer needs this standby
    _restore_priority(nice)  # imports still under way go on at the command's priority
    importer.join()
    _restore_priority(nice)
    order = json.loads(line)
    devnull = os.open(os.devnull, os.O_RDONLY)  # a cold child's stdin is /dev/null too
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    sys.argv[:] = order["argv"]
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":  # run with `python -c`; never imported
    main()
