"""``python tests/warm_worker.py -u -c CODE``: a pytest-xdist worker forked from the suite's
fork server, where TensorFlow is imported already (``tests/forkserver.py``), instead of a
new interpreter that imports it again: each worker's start-up costs a fork, not seconds of
CPU (``tests/conftest.py`` gives this file to xdist as the workers' interpreter).

This process stays the worker's stand-in for xdist: the worker gets its standard streams,
this process passes on a stop signal and ends with the worker's status; if this process
is killed, the server kills the worker (its connection closed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import forked  # (needs the project on sys.path; imports no TensorFlow)


def main() -> None:
    argv = [arg for arg in sys.argv[1:] if arg not in ("-u", "-B")]  # xdist's own flags
    # This process's streams and environment, as xdist's own worker would have them.
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    worker = forked.Popen([sys.executable, *argv], env=env)

    def pass_on(signum: int, frame: FrameType | None) -> None:
        # Not worker.send_signal: its poll would read (and close) what wait() selects on.
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, pass_on)
    status = worker.wait()
    os._exit(status if status >= 0 else 128 - status)


if __name__ == "__main__":
    main()
