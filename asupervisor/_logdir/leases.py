"""Readers' leases: a checkpoint someone is reading is never deleted under them, and an
evaluator's backlog is kept until it has seen it.

A reader that is not the chief (a non-chief restoring, the sidecar evaluator) writes a
lease into the logdir before it reads a checkpoint: ``.asupervisor.reading.<reader>``,
JSON ``{"checkpoint": <name>, "owner": <host:pid>, "expires": <time.time()>}``, one file
per reader, written whole. The chief's retention reads the unexpired leases at each sweep
and keeps what they name; a lease left by a reader that died expires by itself. A reader
renews its lease while it reads (``LEASE_SECS`` is long enough for a slow read, short
enough that a dead reader's lease does not keep a checkpoint for long).

An evaluator also *registers*: ``.asupervisor.evaluator.<reader>``, JSON ``{"since":
<seq>, "backlog": <n>, "owner", "expires"}``, renewed while it runs and left in place when
it stops (it expires by itself), so that a restart of the evaluator finds its backlog
still there. While a registration is unexpired, retention keeps the newest ``backlog``
commits from ``since`` on that the evaluator has not evaluated yet (``_retention``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from .store import Store

PREFIX = ".asupervisor.reading."
REGISTRATION = ".asupervisor.evaluator."
LEASE_SECS = 600.0


def _name(prefix: str, reader: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in reader)
    return prefix + safe


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def hold(store: Store, reader: str, checkpoint: str, seconds: float = LEASE_SECS) -> None:
    """``reader`` reads the checkpoint named ``checkpoint`` (a name inside the logdir)
    for up to ``seconds`` from now: the chief's retention keeps it meanwhile."""
    lease = {"checkpoint": checkpoint, "owner": _owner(), "expires": time.time() + seconds}
    store.write(_name(PREFIX, reader), json.dumps(lease).encode())


def let_go(store: Store, reader: str) -> None:
    """``reader`` reads nothing any more."""
    store.remove(_name(PREFIX, reader))


def _read(store: Store, name: str) -> dict[str, object] | None:
    try:
        data = json.loads(store.read(name))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def leased(store: Store, listing: list[str] | None = None) -> set[str]:
    """The checkpoint names that unexpired leases hold (damaged leases name nothing);
    ``listing``: the logdir's, when the caller has just made one."""
    now, names = time.time(), set()
    for name in store.names() if listing is None else listing:
        if not name.startswith(PREFIX) or "." in name[len(PREFIX) :]:  # a write's temp file
            continue
        lease = _read(store, name)
        try:
            if lease is not None and float(lease["expires"]) > now:  # type: ignore[arg-type]
                names.add(str(lease["checkpoint"]))
        except (KeyError, TypeError, ValueError):
            continue
    return names


@dataclass(frozen=True)
class Registration:
    """An evaluator's claim on the commits it has not seen yet."""

    reader: str
    since: int  # the first commit (seq) it is to see
    backlog: int  # how many unseen commits retention keeps for it, at most
    expires: float


def register(
    store: Store, reader: str, since: int, backlog: int, seconds: float = LEASE_SECS
) -> None:
    entry = {
        "since": since,
        "backlog": backlog,
        "owner": _owner(),
        "expires": time.time() + seconds,
    }
    store.write(_name(REGISTRATION, reader), json.dumps(entry).encode())


def registration(store: Store, reader: str) -> Registration | None:
    """``reader``'s registration, expired or not (a restarted evaluator goes on from its
    ``since``), or ``None``."""
    return _registration(store, _name(REGISTRATION, reader), reader)


def _registration(store: Store, name: str, reader: str) -> Registration | None:
    entry = _read(store, name)
    try:
        if entry is None:
            return None
        return Registration(
            reader,
            int(entry["since"]),  # type: ignore[call-overload]
            max(0, int(entry["backlog"])),  # type: ignore[call-overload]
            float(entry["expires"]),  # type: ignore[arg-type]
        )
    except (KeyError, TypeError, ValueError):
        return None


def registrations(store: Store, listing: list[str] | None = None) -> list[Registration]:
    """The unexpired registrations of evaluators (``listing``: as ``leased``)."""
    now, found = time.time(), []
    for name in store.names() if listing is None else listing:
        reader = name[len(REGISTRATION) :]
        if name.startswith(REGISTRATION) and "." not in reader and store.kind(name) == "file":
            entry = _registration(store, name, reader)
            if entry is not None and entry.expires > now:
                found.append(entry)
    return found
