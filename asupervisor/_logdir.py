"""What is in a logdir, by name: the supervisor's checkpoints and others', fsync, cleanup.

A checkpoint of the supervisor's own is ``<basename>-<step>``; any other checkpoint
the state file names (``ckpt-1`` from ``tf.train.CheckpointManager``) is foreign:
it may be restored from, but it is never swept or deleted.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil

from ._log import log


def is_own(path: str, basename: str) -> bool:
    """Whether ``path`` names a checkpoint the supervisor writes (``<basename>-<step>``)."""
    return re.fullmatch(re.escape(basename) + r"-\d+", os.path.basename(path)) is not None


def remove_unfinished(directory: str, basename: str) -> list[str]:
    """Remove the temp directories of saves that never finished (a kill mid-save).

    Only a chief holding the logdir lock calls this, so no save of its own is
    under way; the finished checkpoints are never touched.
    """
    pattern = re.compile(re.escape(basename) + r"-\d+_temp$")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if pattern.match(name) and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(name)
    return removed


def sync_paths(paths: list[str]) -> None:
    """fsync files and directories (a directory's fsync makes renames in it durable)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def list_checkpoints(directory: str, basename: str) -> list[str]:
    """Checkpoint prefixes in ``directory``: the supervisor's own, newest step first (from
    the state file and the disk), then the foreign ones the state file names, newest first."""
    import tensorflow as tf

    pattern = re.compile(re.escape(basename) + r"-(\d+)$")
    names: set[str] = set()
    foreign: list[str] = []  # named by the state file, not ours: newest first, after ours
    with contextlib.suppress(Exception):  # a corrupt or missing state file lists nothing
        state = tf.train.get_checkpoint_state(directory)
        if state is not None:
            listed = [state.model_checkpoint_path, *reversed(state.all_model_checkpoint_paths)]
            for name in (os.path.basename(p) for p in listed if p):
                names.add(name)
                inside = os.path.join(directory, name)
                if not pattern.match(name) and inside not in foreign:
                    if os.path.isfile(inside + ".index"):
                        foreign.append(inside)
    with contextlib.suppress(FileNotFoundError):
        names.update(n[: -len(".index")] for n in os.listdir(directory) if n.endswith(".index"))
    steps = {n: int(m[1]) for n in names if (m := pattern.match(n))}
    own = [os.path.join(directory, n) for n in sorted(steps, key=steps.__getitem__, reverse=True)]
    return own + [p for p in foreign if p not in own]


def checkpoint_bytes(prefix: str) -> int:
    """The size on disk of the files of the checkpoint at ``prefix``."""
    return sum(os.path.getsize(p) for p in glob.glob(glob.escape(prefix) + ".*"))


def skip_state_file(directory: str, exc: BaseException, *, move: bool) -> tuple[str, str]:
    """The ``checkpoint`` state file cannot be read: the checkpoints beside it are still
    found on disk. The chief (``move``) puts it aside as ``checkpoint.damaged`` so that its
    next save writes a good one; a non-chief only reads, and leaves it."""
    state = os.path.join(directory, "checkpoint")
    reason = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    if move:
        os.replace(state, state + ".damaged")
    log.warning("checkpoint.state_damaged", path=state, reason=reason, moved=move)
    return state, reason
