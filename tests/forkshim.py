"""``python -I tests/forkshim.py SCRIPT ARGS...``: a command for `asupervisor run` whose
trainer is forked from the suite's shared fork server (``tests/forkserver.py``), not
started cold, in the tests that do not pin a cold start (run by path, never imported;
the standard library only: ``-I`` keeps the tree off its path and its start cheap).

The runner starts this process as it starts any command (its trampoline, a session of
its own, its channel named in ``ASUPERVISOR_CHANNEL``); this process asks the server for
``python SCRIPT ARGS...`` with its standard streams, its environment and its channel at
the same number, so the trainer talks to the runner as a cold start would, and with its
UTS namespace, which the trainer joins: on a node of the suite's SLURM cluster
(tests/slurm_cluster.py, each node a UTS namespace of its own) the trainer has the
node's host name and is one of the node's processes, as if started there. Then it
stands in for the trainer: every signal the runner sends is passed on, and it ends as
the trainer ended (its status, or death by the same signal). When it is killed
(SIGKILL: the runner's kill of its group; SLURM's of a step's processes, which are its
run and it, not the trainer, no descendant of theirs), its connection closes and the
server kills the trainer at once (before it forks anything asked after the close). The
pids differ: the trainer's own pid is the one it prints and the ledger holds (a test's
SIGKILL goes to it, and this process dies of it too).

Without a shared server (pytest without ``-n``), it becomes ``python SCRIPT ARGS...``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time

RELAYED = (
    signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
    signal.SIGALRM, signal.SIGTERM, signal.SIGCONT,
)  # fmt: skip


def connect(path: str) -> socket.socket:
    """A connection to the shared server, once it takes them (it imports first). The twin
    of ``tests/forked.py``'s: this script runs under ``-I`` and imports nothing of the tree.
    Its directory gone, the test run that started it has ended (and killed what it
    forked): a job it left behind on a SLURM cluster that outlives the run fails at once
    instead of waiting."""
    deadline = time.monotonic() + 300
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if time.monotonic() > deadline or not os.path.isdir(os.path.dirname(path)):
                raise type(exc)(exc.errno, f"no fork server at {path}: {exc.strerror}") from None
            time.sleep(0.1)


def main() -> None:
    argv = sys.argv[1:]
    server = os.environ.get("ASV_FORKSERVER")
    if not server:
        os.execv(sys.executable, [sys.executable, *argv])
    pending: list[int] = []
    trainer: list[int] = []

    def relay(sig: int, _frame: object) -> None:
        if trainer:
            try:
                os.kill(trainer[0], sig)
            except ProcessLookupError:
                pass
        else:
            pending.append(sig)

    for sig in RELAYED:
        signal.signal(sig, relay)
    channel = os.environ.get("ASUPERVISOR_CHANNEL")
    keep = [int(channel)] if channel else []
    sock = connect(server)
    status_r, status_w = os.pipe()
    # This process's UTS namespace, for the trainer to join: on a node of the suite's
    # SLURM cluster, the node's (its host name, what the trainer would see started here).
    try:
        uts = [os.open("/proc/self/ns/uts", os.O_RDONLY | os.O_CLOEXEC)]
    except OSError:  # no namespaces to see (not Linux, a /proc without them): the server's
        uts = []
    request = {
        "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "keep": keep,
        "uts": bool(uts),
    }  # fmt: skip
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2, status_w, *keep, *uts])
    os.close(status_w)
    for fd in uts:
        os.close(fd)
    trainer.append(int(json.loads(sock.recv(1 << 16))["pid"]))
    for fd in keep:
        os.close(fd)  # the trainer's alone: the runner sees its channel close when it ends
    for sig in pending:
        relay(sig, None)
    answer = b""
    while chunk := os.read(status_r, 4096):
        answer += chunk
    status = int(json.loads(answer)["status"]) if answer else 1
    if status < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set
            signal.signal(-status, signal.SIG_DFL)  # (Python ignores SIGPIPE, relays some)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-status])
        os.kill(os.getpid(), -status)
        status = 128 - status
    os._exit(status)


if __name__ == "__main__":
    main()
