"""The object the supervisor saves: the user's objects, the global step, the data position."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._position import NAME as POSITION

if TYPE_CHECKING:
    import tensorflow as tf


def without(root: Any, names: list[str]) -> Any:
    """A root over the same objects as ``root`` but ``names``: to restore a checkpoint
    that lacks them, checking that it fills everything else."""
    import tensorflow as tf

    children = dict(tf.train.TrackableView(root).children(root))
    kept = {k: v for k, v in children.items() if k not in names and k != "save_counter"}
    return tf.train.Checkpoint(**kept)


def checkpoint_root(user: Any, global_step: Any, position: Any) -> tf.train.Checkpoint:
    """The object the supervisor saves: the objects of the user's checkpoint (or
    mapping), the global step and the data position, in a root of the supervisor's own.

    The user's ``tf.train.Checkpoint`` is left as it was: a second Supervisor over
    it (a retry loop, a notebook cell run twice) sees it unchanged. The files are
    the same as if ``global_step`` had been attached to it.
    """
    import tensorflow as tf

    if user is None:
        children: dict[str, Any] = {}
    elif isinstance(user, tf.train.Checkpoint):
        children = dict(tf.train.TrackableView(user).children(user))
        children.pop("save_counter", None)  # the root's own, made anew
    else:
        children = dict(user)
    existing = children.get("global_step")
    if existing is not None and existing is not global_step:
        raise ValueError(
            "checkpoint already has a `global_step` that is not the supervisor's global_step; "
            "pass it as global_step= instead"
        )
    children["global_step"] = global_step
    children[POSITION] = position
    return tf.train.Checkpoint(**children)
