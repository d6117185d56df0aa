"""TensorBoard's own server on a logdir, read through the HTTP data API its pages read.

One server (a start takes seconds) serves a directory whose subdirectories are the
tests' logdirs: a logdir ``x`` is the run ``x``, its Keras runs ``x/train`` ... The
server runs in a subprocess on loopback with its fast loader (the ``rustboard`` data
server of ``tensorboard-data-server``: what ``tensorboard --logdir`` uses by default
where it is installed). It loads the files on its own schedule: a query is
repeated until its answer is the one expected, or the server's first minute is over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

LOAD_SECS = 90.0  # the whole wait for the loader, on a loaded machine
# TensorBoard's own switch to its stub of TensorFlow (``tensorboard.compat.notf``): the
# data server reads the files, and the server starts in a second instead of importing TF.
WITHOUT_TF = (
    "import sys, types; sys.modules['tensorboard.compat.notf'] = types.ModuleType('notf'); "
    "sys.argv[0] = 'tensorboard'; from tensorboard.main import run_main; run_main()"
)


@contextlib.contextmanager
def tensorboard(logdir: str) -> Iterator[str]:
    """A running ``tensorboard --logdir logdir`` (fast loader); its base URL."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-c", WITHOUT_TF, "--logdir", logdir]
    command += ["--host", "127.0.0.1", "--port", "0", "--load_fast", "true"]
    command += ["--reload_interval", "1"]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True
    )
    found: list[str] = []
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            match = re.search(r"(http://127\.0\.0\.1:\d+)/", line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        ready.wait(LOAD_SECS)
        assert found, f"TensorBoard did not start: {''.join(lines)[-2000:]}"
        yield found[0]
    finally:
        # Killed: nothing of it is kept. Its data server started with --die-after-stdin
        # and ends when the pipe from the killed server closes.
        proc.kill()
        proc.wait()
        reader.join(10)


@dataclasses.dataclass(frozen=True)
class Board:
    """A running TensorBoard over ``root``; each test's logdir is a directory in it."""

    root: str
    url: str

    def show(self, logdir: str, name: str) -> None:
        """Move a finished logdir in, as the run ``name``: the server reads it whole
        (files it had read before a rewrite it would keep as it read them)."""
        os.rename(logdir, os.path.join(self.root, name))

    def scalars(self, run: str, tag: str, expected: Any) -> Any:
        """The run's points of ``tag``, once the loader has them (see ``settled``)."""
        return settled(lambda: scalars(self.url, run, tag), expected)

    def texts(self, run: str, tag: str, expected: Any) -> Any:
        return settled(lambda: texts(self.url, run, tag), expected)


def get(url: str, path: str, **query: str) -> Any:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(query)}", timeout=30) as r:
        return json.loads(r.read())


def scalars(url: str, run: str, tag: str) -> list[tuple[int, float]]:
    """A tag's points as the scalars dashboard gets them: ``(step, value)``."""
    try:
        rows = get(url, "/data/plugin/scalars/scalars", run=run, tag=tag)
    except urllib.error.HTTPError:  # not loaded yet
        return []
    return [(int(step), float(value)) for _, step, value in rows]


def texts(url: str, run: str, tag: str) -> list[tuple[int, str]]:
    """A text tag's points as the text dashboard gets them: ``(step, markdown as HTML)``."""
    try:
        rows = get(url, "/data/plugin/text/text", run=run, tag=tag)
    except urllib.error.HTTPError:
        return []
    return [(int(row["step"]), str(row["text"])) for row in rows]


def settled(read: Callable[[], Any], expected: Any) -> Any:
    """``read()`` again until it gives ``expected`` (or one for which ``expected``, a
    function, says ``True``): the loader has read the files; or until the loader's time
    is over. The last answer."""
    done = expected if callable(expected) else lambda got: got == expected
    deadline = time.monotonic() + LOAD_SECS
    while True:
        got = read()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)
