"""``Popen`` and ``run`` for ``python SCRIPT|-c CODE|-m MODULE ARGS``, forked from a
server that has TensorFlow imported already (``tests/forkserver.py``).

Drop-in for the ``subprocess`` calls of tests whose child trains: the same arguments
(``stdin``/``stdout``/``stderr`` as PIPE, STDOUT, DEVNULL, a file or None; ``text``,
``env``, ``cwd``, ``capture_output``, ``timeout``), the same object back (``pid``,
``wait``, ``poll``, ``returncode``, ``send_signal``, ``kill``, ``terminate``,
``communicate``). The child is a real process, killed for real; it does not import
TensorFlow again. Tests of a cold start (the demo, the README, installs, logging set-up,
the command line) keep ``subprocess``.
"""

from __future__ import annotations

import array
import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

SERVER = Path(__file__).with_name("forkserver.py")
SHIM = Path(__file__).with_name("forkshim.py")
ROOT = SERVER.parents[1]
PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
CompletedProcess = subprocess.CompletedProcess


ENV_SHARED = "ASV_FORKSERVER"  # the path of a server the test processes share


class _Server:
    """The fork server of this test process: its own, started at first use and ended with
    the process; or, in a pytest-xdist run, the one its workers share (``share``)."""

    _lock = threading.Lock()
    _instance: _Server | None = None

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.requests = threading.Lock()
        shared = os.environ.get(ENV_SHARED)
        if shared:
            self.sock = _connect(shared, timeout=300)
        else:
            self.proc, self.sock = _start()
            reply = self._reply(timeout=300)
            assert reply.get("ready"), reply
        atexit.register(self.close)

    def close(self) -> None:
        """End the connection (the server kills the children it made for it); a server
        of this process's own ends with it, and is waited for."""
        _hang_up(self.sock, self.proc)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if not self.requests.acquire(blocking=False):
            return True  # a request is under way
        try:  # a shared server only speaks when asked: else it has closed
            return not select.select([self.sock], [], [], 0)[0]
        finally:
            self.requests.release()

    @classmethod
    def get(cls) -> _Server:
        with cls._lock:
            if cls._instance is None or not cls._instance.alive():
                cls._instance = cls()
            return cls._instance

    def _reply(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            raise TimeoutError("the fork server did not answer")
        data = self.sock.recv(1 << 16)
        if not data:
            status = None if self.proc is None else self.proc.poll()
            raise RuntimeError(f"the fork server ended (status {status})")
        return json.loads(data)

    def fork(self, argv: list[str], cwd: str, env: dict[str, str], fds: list[int]) -> int:
        message = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        with self.requests:
            self.sock.sendmsg([message], rights)
            return int(self._reply(timeout=60)["pid"])


def _start(*args: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    env.pop(ENV_SHARED, None)
    # TensorFlow's plain kernels, not oneDNN's, in the server and all it forks (decided at
    # the import): for the suite's tiny models they cost about a tenth less CPU, and the
    # library does not act in kernels. The runs the suite compares bitwise are both forked
    # from it (the SLURM fault tests' jobs too) or both cold. Cold starts (subprocess: the
    # demo, installs, the command line, `asupervisor run`'s cold children) keep
    # TensorFlow's defaults, and so its start-up noise, which their tests check stays out
    # of the terminal.
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), str(theirs.fileno()), *args],
        pass_fds=[theirs.fileno()],
        stdin=subprocess.DEVNULL,
        env=env,
    )
    theirs.close()
    return proc, ours


def _hang_up(sock: socket.socket, proc: subprocess.Popen[bytes] | None) -> None:
    """Close a connection to a server; a server started here (which ends when its socket
    closes, killing the children it still has) is waited for, killed if it does not end."""
    sock.close()
    if proc is None:
        return
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _connect(path: str, timeout: float) -> socket.socket:
    """A connection to the shared server, once it takes them (it imports first)."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no fork server at {path}") from None
            time.sleep(0.1)


def share(path: str) -> Callable[[], None]:
    """Start a server that takes connections at ``path`` (for pytest-xdist's workers,
    which inherit ``ASV_FORKSERVER``); the function returned ends it."""
    proc, lifeline = _start("--listen", path)
    os.environ[ENV_SHARED] = path

    def end() -> None:
        os.environ.pop(ENV_SHARED, None)
        _hang_up(lifeline, proc)

    return end


def start_server() -> None:
    """Start the fork server now (else at first use): a test whose search is bounded by
    time starts it first, so that the budget is spent on the search (the server is the
    test process's, shared with every later test in it)."""
    _Server.get()


def runner_child(script: str | os.PathLike[str], *args: str) -> list[str]:
    """The command ``python SCRIPT ARGS...`` for `asupervisor run` to start, its trainer
    forked from the shared server (``tests/forkshim.py`` stands in for it; cold without a
    shared server: pytest without ``-n``): for the tests that pin what the runner does
    with its children, not their cold start (the docs' recipes, the demo and the install
    test start theirs cold; a test of ``--standby`` forks them from the runner's own).
    Under SLURM too (tests/test_slurm_faults.py: the shim runs on a node, and its trainer
    joins the node's UTS namespace, so it has the node's host name; ``ASV_FORKSERVER``
    reaches it through the job's environment); tests/test_slurm_jobs.py's workers start
    cold."""
    return [sys.executable, "-I", str(SHIM), str(script), *args]


def _script_argv(args: list[str]) -> list[str]:
    if not args or args[0] != sys.executable:
        raise ValueError(
            f"forked.Popen runs `{sys.executable} SCRIPT|-c CODE|-m MODULE ...`, not {args}"
        )
    return [str(a) for a in args[1:]]


def _end(spec: Any, inherited: int) -> tuple[int, int | None]:
    """The child's end of one standard stream, and ours (a pipe's other end) if any."""
    for_reading = inherited == 0
    if spec is None:
        return os.dup(inherited), None
    if spec == DEVNULL:
        return os.open(os.devnull, os.O_RDONLY if for_reading else os.O_WRONLY), None
    if spec == PIPE:
        r, w = os.pipe()
        return (r, w) if for_reading else (w, r)
    fileno = spec if isinstance(spec, int) else spec.fileno()
    return os.dup(fileno), None


class Popen:
    def __init__(
        self,
        args: list[str],
        *,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        text: bool = False,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.args = args
        self.returncode: int | None = None
        ends: list[int] = []
        ours: list[Any] = []
        for spec, inherited in ((stdin, 0), (stdout, 1), (stderr, 2)):
            if spec == STDOUT:
                child_end, our_end = os.dup(ends[1]), None
            else:
                child_end, our_end = _end(spec, inherited)
            ends.append(child_end)
            ours.append(our_end)
        self._status_r, status_w = os.pipe()
        ends.append(status_w)
        environment = dict(os.environ if env is None else env)
        environment.setdefault("PYTHONPATH", str(ROOT))
        try:
            self.pid = _Server.get().fork(
                _script_argv(list(args)), str(cwd or os.getcwd()), environment, ends
            )
        finally:
            for fd in ends:
                os.close(fd)
        self.stdin = self._wrap(ours[0], "w", text)
        self.stdout = self._wrap(ours[1], "r", text)
        self.stderr = self._wrap(ours[2], "r", text)

    @staticmethod
    def _wrap(fd: Any, mode: str, text: bool) -> IO[Any] | None:
        if fd is None:
            return None
        if text:
            return open(fd, mode, buffering=1 if mode == "w" else -1, encoding="utf-8")
        return open(fd, mode + "b")

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._status_r], [], [], 0)
            if ready:
                self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        data = os.read(self._status_r, 256)
        os.close(self._status_r)
        self.returncode = int(json.loads(data)["status"]) if data else -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _, _ = select.select([self._status_r], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        results: dict[str, Any] = {}
        threads = [
            threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, f.read()))
            for n, f in (("out", self.stdout), ("err", self.stderr))
            if f is not None
        ]
        for t in threads:
            t.daemon = True
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results.get("out"), results.get("err")

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


def run(
    args: list[str],
    *,
    capture_output: bool = False,
    timeout: float | None = None,
    input: Any = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    if capture_output:
        kwargs.setdefault("stdout", PIPE)
        kwargs.setdefault("stderr", PIPE)
    if input is not None:
        kwargs.setdefault("stdin", PIPE)
    proc = Popen(args, **kwargs)
    try:
        out, err = proc.communicate(input, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def run_script(
    path: Path, source: str, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Write ``source`` to ``path`` and run ``python path args...``, its output captured
    as text; one that does not end within ``timeout`` fails the test."""
    path.write_text(source)
    return run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )


__all__ = ["DEVNULL", "PIPE", "STDOUT", "CompletedProcess", "Popen", "run", "run_script"]
