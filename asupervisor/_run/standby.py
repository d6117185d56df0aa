"""A warm standby: an interpreter with TensorFlow imported, waiting for its command.

``asupervisor run --standby`` runs this file with the command's own interpreter, through
``python -c LOADER THIS_FILE PARENT_PID SCRIPT MODULE...`` (not ``python THIS_FILE``: the
package's directory must not come first on ``sys.path``); it needs nothing else. It
imports the modules (TensorFlow, Keras, asupervisor: a cold start spends most of its
seconds there), builds nothing, and waits on its stdin for one JSON line
``{"argv": [script, *args], "env": {...}, "cwd": "..."}``. Then it
becomes that command: the environment, the working directory, ``sys.argv`` and
``sys.path[0]`` as ``python SCRIPT ARGS`` would have them, and the script runs as
``__main__`` (``runpy.run_path``); its exit status is the process's.

What it cannot be: ``python -m``, interpreter options, a command that is not a Python
script; environment variables read while the modules were imported keep the value the
standby started with (the supervisor's own environment, as a cold start would see it:
only the variables ``asupervisor run`` sets per attempt differ, and none is read at
import). The standby dies with its supervisor (``PR_SET_PDEATHSIG``), and exits when
its stdin closes without a command.
"""

from __future__ import annotations

import json
import os
import sys


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass  # not Linux: the supervisor's own exit paths still kill it
    if os.getppid() != parent:  # the supervisor died before the line above
        os._exit(137)


def main() -> None:
    parent, script = int(sys.argv[1]), sys.argv[2]
    _die_with_parent(parent)
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # as `python SCRIPT` sets it
    for name in sys.argv[3:]:
        try:
            __import__(name)
        except Exception:
            pass  # a module the script does not have: it is imported (or not) as usual
    line = sys.stdin.buffer.readline()
    if not line:
        os._exit(0)  # the supervisor no longer needs this standby
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
