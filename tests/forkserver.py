"""A fork server for the suite's training processes (run by path, never imported).

It imports TensorFlow, Keras and asupervisor once, then forks a process for each request
that arrives on the socket it was given (file descriptor FD): the child takes the stdin,
stdout and stderr sent with the request (and any further file at the number the request's
``keep`` gives: an `asupervisor run` channel, tests/forkshim.py), the working directory,
the environment and ``sys.argv``, joins the UTS namespace (the host name) sent with it if
any (``uts``: a SLURM node of tests/slurm_cluster.py, where the shim runs), and runs the
script (a path, ``-c CODE`` or ``-m MODULE``) as ``__main__``, then ends as any
interpreter does (non-daemon threads joined, atexit run, an uncaught exception printed
with status 1, an uncaught KeyboardInterrupt a death by SIGINT). The server sends each
child's pid back, and its exit status (``subprocess``'s convention:
minus the signal) down a pipe sent with the request.

Why: each process of the suite otherwise pays ``import tensorflow`` again (seconds of one
core), and most of the suite's CPU went there. The children are real processes, killed
for real; what they skip is the import, which the library does not act in.

The server is single-threaded (a fork copies only the forking thread) and ends when the
socket it was given closes, killing the children it still has. Given a path too
(``--listen PATH``), it also takes connections there, one per test process of a
pytest-xdist run (which then share one server, and one import), and kills a connection's
children when that connection closes: at once, its loop waking on the close (a shim
SIGKILLed, tests/forkshim.py, takes its trainer with it before anything can start again
in its place).
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import gc
import json
import os
import selectors
import signal
import socket
import sys
import types
from dataclasses import dataclass

# stdin, stdout, stderr, the status pipe, up to two kept (``keep``) and a UTS namespace
MAX_FDS = 7
CLONE_NEWUTS = 0x04000000  # <sched.h>


@dataclass
class Request:
    argv: list[str]
    cwd: str
    env: dict[str, str]
    fds: list[int]
    keep: list[int]  # the numbers the child has fds[4:] at (an inherited channel's)
    uts: int | None = None  # the UTS namespace (a /proc/PID/ns/uts) the child joins

    def files(self) -> list[int]:
        """Every file descriptor the request came with."""
        return [*self.fds, *([] if self.uts is None else [self.uts])]


def receive(sock: socket.socket) -> Request | None:
    """One request: a JSON line and its file descriptors; None when the socket closed."""
    fds = array.array("i")
    try:
        data, ancdata, _, _ = sock.recvmsg(1 << 20, socket.CMSG_LEN(MAX_FDS * fds.itemsize))
    except ConnectionResetError:  # a test process that ended with a reply unread
        return None
    if not data:
        return None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    message = json.loads(data)
    keep = [int(n) for n in message.get("keep", [])]
    given = list(fds)
    uts = given.pop() if message.get("uts") else None  # sent last
    return Request(message["argv"], message["cwd"], message["env"], given, keep, uts)


def status_of(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return -os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def serve(lifeline: socket.socket, listener: socket.socket | None) -> Request | None:
    """Fork for each request; in a child, return its request; in the server, None once
    ``lifeline`` (itself a connection) has closed.

    Of what one wait found, the connections that closed are dealt with first (their
    children killed), then the requests forked: a shim that died before another asked
    (a SLURM step's, ended before the next attempt's starts) has its trainer killed
    before the other's is forked."""
    owners: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    children: dict[int, int] = {}  # pid -> the write end of its status pipe
    selector = selectors.DefaultSelector()
    selector.register(lifeline, selectors.EVENT_READ)
    if listener is not None:
        selector.register(listener, selectors.EVENT_READ)
    try:
        while True:
            asked: list[tuple[socket.socket, Request]] = []
            for key, _ in selector.select(timeout=0.02):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is listener:
                    selector.register(listener.accept()[0], selectors.EVENT_READ)
                    continue
                request = receive(sock)
                if request is None:  # that test process has ended: so have its children
                    if sock is lifeline:
                        return None
                    selector.unregister(sock)
                    sock.close()
                    kill([pid for pid, owner in owners.items() if owner is sock])
                    continue
                asked.append((sock, request))
            for i, (sock, request) in enumerate(asked):
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for registered in list(selector.get_map().values()):
                        registered.fileobj.close()  # type: ignore[union-attr]
                    selector.close()
                    for fd in children.values():
                        os.close(fd)
                    for _, later in asked[i + 1 :]:  # the others' files are not its own
                        for fd in later.files():
                            os.close(fd)
                    return request
                for fd in request.files():
                    if fd != request.fds[3]:  # the status pipe's, until the child ends
                        os.close(fd)
                children[pid], owners[pid] = request.fds[3], sock
                try:
                    sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except OSError:  # the asker has died (a shim SIGKILLed as it asked): the
                    pass  # next wait finds its connection closed and kills its child
            reap(children, owners)
    finally:
        if os.getpid() == SERVER_PID:
            kill(list(children))


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap(children: dict[int, int], owners: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        owners.pop(pid, None)
        fd = children.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, json.dumps({"status": status_of(wait_status)}).encode())
            except OSError:
                pass
            os.close(fd)


def become(request: Request) -> None:
    """Turn this forked child into ``python ARGV...``: its files, place, environment, argv."""
    # Above any number a file is wanted at first, so that no dup2 below closes another.
    fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for fd in request.fds]
    for fd in request.fds:
        os.close(fd)
    uts = None if request.uts is None else fcntl.fcntl(request.uts, fcntl.F_DUPFD_CLOEXEC, 256)
    if request.uts is not None:
        os.close(request.uts)
    for target, fd in [*enumerate(fds[:3]), *zip(request.keep, fds[4:], strict=True)]:
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    if uts is not None:  # once its stderr is the request's: a failure is seen there
        join_uts(uts)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    # What the imports cached from the server's environment, read again from the child's.
    import tempfile

    tempfile.tempdir = None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def join_uts(fd: int) -> None:
    """Join the UTS namespace ``fd`` names unless it is this process's already: the child
    of a shim on a SLURM node (tests/slurm_cluster.py: each node a UTS namespace of its
    own) then has the node's host name, as a cold start there would, and is one of the
    node's processes (a lost node's SIGKILL reaches it too). It needs root, as the nodes
    do; a shim in the server's own namespace (every test but SLURM's) needs nothing. The
    child is single-threaded here (a fork copies one thread): every thread it starts
    later is in the namespace too."""
    try:
        theirs, ours = os.fstat(fd), os.stat("/proc/self/ns/uts")
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWUTS) != 0:  # Python 3.11 has no os.setns
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns(CLONE_NEWUTS): {os.strerror(errno)}")
    finally:
        os.close(fd)


def run_main(argv: list[str]) -> None:
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        import runpy

        sys.argv = [argv[1], *argv[2:]]  # argv[0] becomes the module's file, as with -m
        sys.path[0] = ""
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        import runpy

        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


SERVER_PID = os.getpid()


def end_as_an_interpreter_does(argv: list[str]) -> None:
    """Run the script, then end as Python's exit does (an uncaught exception printed by
    sys.excepthook with status 1, SystemExit's code, non-daemon threads joined, atexit
    run, the standard streams and the child's own open files flushed), but with
    ``os._exit``: the interpreter's teardown (every module's objects let go, which writes
    to every page the server shared: about 0.3 s of CPU a child) is skipped."""
    import atexit
    import io
    import threading

    status, interrupted = 0, False
    try:
        run_main(argv)
    except SystemExit as exc:
        code = exc.code
        if code is None:
            status = 0
        elif isinstance(code, int):
            status = code & 0xFF
        else:
            print(code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
        status = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        pass
    atexit._run_exitfuncs()
    # The child's files (the server's are frozen: gc.get_objects sees only the child's).
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except BaseException:
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def import_quietly() -> None:
    """TensorFlow, Keras and asupervisor imported with the server's stderr held aside:
    TensorFlow's native start-up lines (absl's "before InitializeLog", cudart's "Could not
    find cuda drivers", which TF_CPP_MIN_LOG_LEVEL does not reach) would land in the
    suite's output. Shown after all if an import fails. The children never see this: each
    gets the stderr its request sent."""
    import tempfile

    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            import keras  # noqa: F401
            import numpy  # noqa: F401
            import tensorflow  # noqa: F401

            import asupervisor  # noqa: F401
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            os.write(2, held.read())
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


if __name__ == "__main__":
    channel = socket.socket(fileno=int(sys.argv[1]))
    import_quietly()

    # What was imported is never collected: out of the cyclic collector's sight, so that a
    # child's collections, its last one at exit included, do not walk every object the
    # imports made (a child's exit fell from about 1 s of CPU to 0.2).
    gc.collect()
    gc.freeze()
    listening = None
    if sys.argv[2:3] == ["--listen"]:
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listening.bind(sys.argv[3] + ".binding")
        listening.listen(64)
        os.rename(sys.argv[3] + ".binding", sys.argv[3])  # there once it takes connections
    channel.sendall(b'{"ready": true}\n')
    child = serve(channel, listening)
    if child is None:
        sys.exit(0)
    become(child)
    end_as_an_interpreter_does(child.argv)
