"""What is in a logdir, by name: the supervisor's checkpoints and others', the state file.

A checkpoint of the supervisor's own is ``<basename>-<step>``, or ``<basename>-<step>_<n>``
for the n-th that a later save at the same step wrote beside it (a save never rewrites
a checkpoint in place: a crash between TF's two renames would tear it); any other
checkpoint the state file names (``ckpt-1`` from ``tf.train.CheckpointManager``) is foreign:
it may be restored from, but it is never swept or deleted. Only checkpoints directly
inside the logdir count: a state file naming ``../victim/model.ckpt-5`` names nothing.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .._log import log
from .store import Store
from .verify import verify_checkpoint

STATE = "checkpoint"  # TF's state file: which checkpoints exist, the latest last
# The TensorBoard runs beside the session's events file: fit's epoch logs, one run per
# split, in the directories Keras' TensorBoard callback uses.
TRAIN_RUN, VALIDATION_RUN = "train", "validation"
RUNS = (TRAIN_RUN, VALIDATION_RUN)


def own_pattern(basename: str, suffix: str = "") -> re.Pattern[str]:
    """``<basename>-<step>`` or ``<basename>-<step>_<n>``, then ``suffix``."""
    return re.compile(re.escape(basename) + r"-(\d+)(?:_(\d+))?" + suffix + "$")


def own_order(name: str, basename: str) -> tuple[int, int] | None:
    """``(step, n)`` of a checkpoint name of the supervisor's own (newer sorts later),
    else ``None``."""
    found = own_pattern(basename).match(os.path.basename(name))
    return None if found is None else (int(found[1]), int(found[2] or 0))


def is_own(path: str, basename: str) -> bool:
    """Whether ``path`` names a checkpoint the supervisor writes (``<basename>-<step>``)."""
    return own_order(path, basename) is not None


def remove_unfinished(store: Store, basename: str) -> list[str]:
    """Remove what saves that never finished left (a kill mid-save): their temp
    directories, and data files of the supervisor's own whose index never came (TF
    renames a checkpoint's data into place before it writes the index).

    Only a chief holding the logdir lock calls this, so no save of its own is
    under way; the finished checkpoints are never touched, nor any file of a
    checkpoint the state file names (one whose index is lost is damaged: reported).
    """
    temp = own_pattern(basename, "_temp")
    data = own_pattern(basename, r"\.data-\d+-of-\d+")
    names = store.names()
    try:
        state = read_state(store)
        listed = [state.model_checkpoint_path, *state.all_model_checkpoint_paths] if state else []
    except Exception:  # damaged (any parse error): it names nothing we can read
        listed = []
    named = {store.name_of(p) for p in listed if p}
    removed = []
    for name in names:
        if temp.match(name) and store.kind(name) == "dir":
            store.remove_tree(name)
            removed.append(name)
        elif data.match(name):
            prefix = name.rsplit(".data-", 1)[0]
            if (
                prefix + ".index" not in names
                and prefix not in named
                and store.kind(name) == "file"
            ):
                store.remove(name)
                removed.append(name)
    return removed


def read_state(store: Store) -> Any:
    """The state file as TF's ``CheckpointState`` (``None`` if there is none). Read here,
    bounded and without blocking, before TF reads it: a FIFO in its place would hang
    TF's reader. Raises ``ValueError`` or ``OSError`` for a damaged one."""
    from google.protobuf import text_format
    from tensorflow.python.checkpoint import checkpoint_management

    kind = store.kind(STATE)
    if kind is None:
        return None
    text = store.read(STATE).decode("utf-8")  # not a regular file: OSError
    state = checkpoint_management.CheckpointState()
    text_format.Merge(text, state)
    if not state.model_checkpoint_path:
        raise ValueError(f"Invalid checkpoint state loaded from {store.path(STATE)}")
    return state


def list_checkpoints(store: Store, basename: str, committed_only: bool = False) -> list[str]:
    """Checkpoint prefixes in the logdir: the supervisor's own, newest step first (from
    the state file and the disk), then the foreign ones the state file names, newest first.

    ``committed_only``: only those the state file names, as ``tf.train.latest_checkpoint``
    sees them (unless the state file is missing or damaged). A reader beside a live chief
    needs this: files the state file does not name yet may be half written."""
    names: set[str] = set()
    foreign: list[str] = []  # named by the state file, not ours: newest first, after ours
    on_disk = {n[: -len(".index")] for n in store.names() if n.endswith(".index")}
    try:
        state = read_state(store)
    except (OSError, ValueError, UnicodeDecodeError):  # damaged: the disk still lists
        state = None
    if state is not None:
        listed = [state.model_checkpoint_path, *reversed(state.all_model_checkpoint_paths)]
        for name in (store.name_of(p) for p in listed if p):
            if name is None:
                continue  # outside the logdir: never read, restored or deleted
            names.add(name)
            if not is_own(name, basename) and name not in foreign and name in on_disk:
                foreign.append(name)
    if committed_only and state is not None:
        on_disk &= names
    # Named by the state file but without files: nothing to restore, not a candidate.
    steps = {n: order for n in on_disk if (order := own_order(n, basename)) is not None}
    own = sorted(steps, key=steps.__getitem__, reverse=True)
    return [store.path(n) for n in [*own, *(f for f in foreign if f not in steps)]]


def listed_without_files(store: Store) -> list[str]:
    """Checkpoints the state file names whose ``.index`` is gone, newest first: skipped
    by a restore, and said so (``restore_report.skipped``)."""
    try:
        state = read_state(store)
    except (OSError, ValueError, UnicodeDecodeError):
        return []
    if state is None:
        return []
    listed = [state.model_checkpoint_path, *reversed(state.all_model_checkpoint_paths)]
    gone: list[str] = []
    for name in (store.name_of(p) for p in listed if p):
        if name is not None and name not in gone and store.kind(name + ".index") is None:
            gone.append(name)
    return [store.path(n) for n in gone]


def files_problem(store: Store, prefix: str) -> str | None:
    """Why the files of the checkpoint at ``prefix`` cannot be read safely, or ``None``:
    an index must exist, and every file must be a regular one (a FIFO would block the
    reader forever; a symlink out of the logdir is not the logdir's)."""
    name = os.path.basename(prefix)
    if store.kind(name + ".index") is None:
        return "NotFoundError: its .index file is gone"
    for file in store.files_of(name):
        if store.kind(file) != "file":
            return f"{file} is not a regular file inside the logdir"
    return None


def checkpoint_problem(store: Store, prefix: str) -> str | None:
    """Why the checkpoint at ``prefix`` cannot be restored, or ``None``: its files are
    checked first (TF's reader would block on a FIFO), then every tensor is read back."""
    return files_problem(store, prefix) or verify_checkpoint(prefix)


def checkpoint_bytes(store: Store, prefix: str) -> int:
    """The size of the files of the checkpoint at ``prefix``."""
    total = 0
    for name in store.files_of(os.path.basename(prefix)):
        if store.kind(name) == "file":
            total += store.size(name)
    return total


def skip_state_file(store: Store, exc: BaseException, *, move: bool) -> tuple[str, str]:
    """The ``checkpoint`` state file cannot be read: the checkpoints beside it are still
    found on disk. The chief (``move``) puts it aside as ``checkpoint.damaged`` so that its
    next save writes a good one; a non-chief only reads, and leaves it."""
    reason = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    if move:
        store.remove(STATE + ".damaged")
        store.replace(STATE, STATE + ".damaged")
    log.warning("checkpoint.state_damaged", path=store.path(STATE), reason=reason, moved=move)
    return store.path(STATE), reason
