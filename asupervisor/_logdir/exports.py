"""Exports of the best checkpoint's model (``KeepBest(export=...)``): ``<logdir>/best/<step>``.

After a commit that is the best so far (the one commit ``KeepBest``'s own rule ranks
first), the user's ``export`` writes the model, in the state that commit holds, into a
new empty directory under a temporary name; it is renamed to ``best/<step>`` once
``export`` returned, so a reader finds an export whole or not at all (a rename is atomic
on a local file system; an object store has none for a directory, so ``Supervisor``
refuses an export there). Afterwards the exports of commits no longer among the
``count`` best are removed, as their checkpoints are: the exports rotate with the best.
A temporary directory a kill left is removed at the next export.
"""

from __future__ import annotations

import os

from .history import History
from .retention import KeepBest, Retention

DIRECTORY = "best"
TEMPORARY = ".tmp-"  # prefix of an export being written


def export_if_best(
    keep_best: KeepBest, retention: Retention, history: History, name: str, step: int
) -> str | None:
    """Training thread, after commit ``name`` (at ``step``): its export if it is the best
    so far, the path written; ``None`` if it is not (or nothing exports). An error of
    ``export`` is raised as it is, and leaves no export behind."""
    commit = history.by_name(name)
    if keep_best.export is None or commit is None:
        return None
    facts = retention.facts(history)
    first = KeepBest(keep_best.metric, keep_best.mode, count=1)  # the same rule, its top
    if commit.seq not in first.keeps(facts):
        return None
    import tensorflow as tf

    root = os.path.join(retention.store.root, DIRECTORY)
    tf.io.gfile.makedirs(root)
    _remove_temporaries(root)
    temporary = os.path.join(root, f"{TEMPORARY}{step}-{os.getpid()}")
    final = os.path.join(root, str(step))
    tf.io.gfile.makedirs(temporary)
    try:
        keep_best.export(temporary)
        if tf.io.gfile.exists(final):  # a forced save at the same step: the newer state
            tf.io.gfile.rmtree(final)
        tf.io.gfile.rename(temporary, final)
    except BaseException:
        if tf.io.gfile.exists(temporary):
            tf.io.gfile.rmtree(temporary)
        raise
    kept = {c.step for c in history.committed() if c.seq in keep_best.keeps(facts)}
    for entry in tf.io.gfile.listdir(root):
        entry = entry.rstrip("/")
        if entry.isdigit() and int(entry) not in kept:
            tf.io.gfile.rmtree(os.path.join(root, entry))
    return final


def _remove_temporaries(root: str) -> None:
    import tensorflow as tf

    for entry in tf.io.gfile.listdir(root):
        if entry.startswith(TEMPORARY):
            tf.io.gfile.rmtree(os.path.join(root, entry.rstrip("/")))
