"""Readers' leases: a checkpoint someone is reading is never deleted under them.

A reader that is not the chief (a non-chief restoring, the sidecar evaluator) writes a
lease into the logdir before it reads a checkpoint: ``.asupervisor.reading.<reader>``,
JSON ``{"checkpoint": <name>, "owner": <host:pid>, "expires": <time.time()>}``, one file
per reader, written whole. The chief's retention reads the unexpired leases at each sweep
and keeps what they name; a lease left by a reader that died expires by itself. A reader
renews its lease while it reads (``LEASE_SECS`` is long enough for a slow read, short
enough that a dead reader's lease does not keep a checkpoint for long).
"""

from __future__ import annotations

import json
import os
import socket
import time

from .store import Store

PREFIX = ".asupervisor.reading."
LEASE_SECS = 600.0


def _name(reader: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in reader)
    return PREFIX + safe


def hold(store: Store, reader: str, checkpoint: str, seconds: float = LEASE_SECS) -> None:
    """``reader`` reads the checkpoint named ``checkpoint`` (a name inside the logdir)
    for up to ``seconds`` from now: the chief's retention keeps it meanwhile."""
    lease = {
        "checkpoint": checkpoint,
        "owner": f"{socket.gethostname()}:{os.getpid()}",
        "expires": time.time() + seconds,
    }
    store.write(_name(reader), json.dumps(lease).encode())


def let_go(store: Store, reader: str) -> None:
    """``reader`` reads nothing any more."""
    store.remove(_name(reader))


def leased(store: Store) -> set[str]:
    """The checkpoint names that unexpired leases hold (damaged leases name nothing)."""
    now, names = time.time(), set()
    for name in store.names():
        if not name.startswith(PREFIX):
            continue
        try:
            lease = json.loads(store.read(name))
            if float(lease["expires"]) > now:
                names.add(str(lease["checkpoint"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return names
