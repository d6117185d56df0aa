"""A checkpoint's files in a logdir: whether they can be read, their size, and what
saves a kill cut short left behind.

Which checkpoints the logdir has, in which order, is its history's (``_history``); only
checkpoints directly inside the logdir count: a state file naming
``../victim/model.ckpt-5`` names nothing.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from .._log import log
from .history import NameFormat, read_history
from .store import Store
from .verify import verify_checkpoint

# The TensorBoard runs beside the session's events file: fit's epoch logs, one run per
# split, in the directories Keras' TensorBoard callback uses.
TRAIN_RUN, VALIDATION_RUN = "train", "validation"
RUNS = (TRAIN_RUN, VALIDATION_RUN)


def remove_unfinished(store: Store, basename: str) -> list[str]:
    """Remove what saves that never finished left (a kill mid-save): their temp
    directories, and data files of the supervisor's own whose index never came (TF
    renames a checkpoint's data into place before it writes the index).

    Only a chief holding the logdir lock calls this, so no save of its own is
    under way; the finished checkpoints are never touched, nor any file of a
    checkpoint the history commits (one whose index is lost is damaged: reported).
    """
    own = NameFormat(basename)
    temp = own.pattern("_temp")
    data = own.pattern(r"\.data-\d+-of-\d+")
    names = store.names()
    named: set[str] | None = None  # read only if a data file has no index: rare
    removed = []
    for name in names:
        if temp.match(name) and store.kind(name) == "dir":
            store.remove_tree(name)
            removed.append(name)
        elif data.match(name):
            prefix = name.rsplit(".data-", 1)[0]
            if prefix + ".index" in names:
                continue
            if named is None:
                named = {c.name for c in read_history(store, basename).committed()}
            if prefix not in named and store.kind(name) == "file":
                store.remove(name)
                removed.append(name)
    return removed


def files_problem(store: Store, prefix: str, names: Collection[str] | None = None) -> str | None:
    """Why the files of the checkpoint at ``prefix`` cannot be read safely, or ``None``:
    an index must exist, and every file must be a regular one (a FIFO would block the
    reader forever; a symlink out of the logdir is not the logdir's). ``names``: the
    logdir's listing, when the caller has one (a look at many checkpoints lists once)."""
    name = os.path.basename(prefix)
    if store.kind(name + ".index") is None:
        return "NotFoundError: its .index file is gone"
    for file in store.files_of(name, names):
        if store.kind(file) != "file":
            return f"{file} is not a regular file inside the logdir"
    return None


def checkpoint_problem(
    store: Store, prefix: str, names: Collection[str] | None = None
) -> str | None:
    """Why the checkpoint at ``prefix`` cannot be restored, or ``None``: its files are
    checked first (TF's reader would block on a FIFO), then every tensor is read back."""
    return files_problem(store, prefix, names) or verify_checkpoint(prefix)


# TF's .index is a table ending in a fixed 48-byte footer (two block handles and a magic
# number): one shorter than that was cut short as it was written.
INDEX_FOOTER_BYTES = 48


def index_torn(store: Store, name: str) -> bool:
    """Whether the checkpoint ``name``'s ``.index`` is evidence of a torn write: empty, or
    shorter than TF's table footer. A read error (EIO, EACCES, a store whose writes are
    not visible yet) is not: the files may be whole."""
    try:
        return store.kind(name + ".index") == "file" and store.size(name + ".index") < (
            INDEX_FOOTER_BYTES
        )
    except OSError:
        return False


def checkpoint_bytes(store: Store, prefix: str, names: Collection[str] | None = None) -> int:
    """The size of the files of the checkpoint at ``prefix`` (``names``: the logdir's
    listing, when the caller has one)."""
    total = 0
    for name in store.files_of(os.path.basename(prefix), names):
        if store.kind(name) == "file":
            total += store.size(name)
    return total


def delete_checkpoint(store: Store, name: str, names: Collection[str] | None = None) -> bool:
    """Remove the files of the checkpoint ``name``; whether all of them went (one that
    cannot be removed is logged, and the others are still tried).

    The index first: a kill in between leaves a data file no index names (removed at the
    chief's next start), never an index whose data is gone. ``names``: the logdir's
    listing, when the caller has one."""
    removed = True
    for file in sorted(store.files_of(name, names), key=lambda n: not n.endswith(".index")):
        try:
            store.remove(file)
        except OSError as exc:
            log.warning("checkpoint.not_deleted", path=store.path(file), error=repr(exc))
            removed = False
    return removed
