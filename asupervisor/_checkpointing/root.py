"""The object the supervisor saves: the user's checkpoint as it is *now*, with the global
step and the data position beside its children.

TF's checkpoints follow attribute assignment: ``ckpt.data = iter(dataset)`` changes what
the next ``ckpt.save()`` writes. So the supervisor's root is a ``tf.train.Checkpoint``
whose root *is* the user's checkpoint (``root=``): TF reads the user's children at each
save, and a restore into a child that does not exist yet is deferred on the user's
object, by TF's own rules, until the attribute is assigned. The global step and the
position are attached beside them without being set on the user's object, which stays
as it was: a second Supervisor over it (a retry loop, a notebook cell run twice) sees
it unchanged. The files are the same as if they were children of the user's object.

One thing of the user's object is made up front: TF's counter of saves
(``save_counter``), which TF creates on its first read. Made later, after the root took
a counter of its own, the user's would be a second ``save_counter`` beside it, and
every save after would fail. So the root's counter is the user's, and each save counts
on it, as ``Checkpoint.save`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .._training.kept_state import NAME as STATE
from .._training.kept_state import SEEDS, KeptState, seed_generators
from .._training.position import LEGACY_FIT_STATE, LEGACY_POSITION
from .._training.position import NAME as POSITION
from .._training.reader import NAME as ITERATOR

if TYPE_CHECKING:
    import tensorflow as tf

    from .._training.position import Position

GLOBAL_STEP = "global_step"
# The supervisor's own parts of the state beside the global step: an older checkpoint, or
# another tool's, may lack any of them, and is restored without it.
OWN_PARTS = (POSITION, ITERATOR, STATE, SEEDS, LEGACY_POSITION, LEGACY_FIT_STATE)
# Names the supervisor's root gives its own children (and TF's counter of saves).
RESERVED = (GLOBAL_STEP, *OWN_PARTS, "save_counter")


def user_checkpoint(checkpoint: Any, global_step: Any) -> tf.train.Checkpoint:
    """The user's ``tf.train.Checkpoint`` (``checkpoint=``), or one made from a mapping of
    name to trackable; a ``ValueError`` naming ``checkpoint`` for anything else."""
    import tensorflow as tf

    if checkpoint is None:
        return tf.train.Checkpoint()
    if isinstance(checkpoint, tf.train.Checkpoint):
        _check_names(children_of(checkpoint), global_step)
        return checkpoint
    if not isinstance(checkpoint, Mapping):
        raise ValueError(
            "checkpoint must be a tf.train.Checkpoint or a mapping of name to trackable, "
            f"not {checkpoint!r}"
        )
    _check_names(dict(checkpoint), global_step)
    for name in checkpoint:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"checkpoint: {name!r} is not a name a checkpoint can hold")
    try:
        return tf.train.Checkpoint(**{k: v for k, v in checkpoint.items() if k != GLOBAL_STEP})
    except (TypeError, ValueError) as exc:  # TF's own words on what it cannot track
        raise ValueError(f"checkpoint: {exc}") from None


def _check_names(children: Mapping[str, Any], global_step: Any) -> None:
    for name in RESERVED:
        if name not in children:
            continue
        if name == GLOBAL_STEP and children[name] is global_step:
            continue  # the same variable as global_step=: it is saved once, as ours
        raise ValueError(
            f"checkpoint has an entry {name!r}, a name the supervisor's checkpoint uses "
            "for its own state"
            + (
                "; pass the step variable as global_step= instead"
                if name == GLOBAL_STEP
                else "; rename it"
            )
        )


def children_of(checkpoint: Any) -> dict[str, Any]:
    """The objects a checkpoint holds now, by name (TF's counter of saves left out)."""
    import tensorflow as tf

    children = dict(tf.train.TrackableView(checkpoint).children(checkpoint))
    children.pop("save_counter", None)
    return children


class SavedRoot:
    """What one session saves and restores (see the module's docstring)."""

    def __init__(
        self, user: tf.train.Checkpoint, global_step: Any, position: Position, kept: KeptState
    ) -> None:
        import tensorflow as tf

        self.user = user
        self.ours: dict[str, Any] = {GLOBAL_STEP: global_step, **position.objects()}
        self.ours[STATE] = kept.module
        generators = seed_generators(children_of(user).values())
        if generators:  # Keras leaves their state out of a checkpoint of the model
            seeds = tf.Module(name=SEEDS)
            seeds.states = generators
            self.ours[SEEDS] = seeds
        self.checkpoint = self._root(self.ours)
        # Where older checkpoints held the position: restored from (``without``), never
        # written.
        self.legacy: dict[str, Any] = position.legacy()
        self._finite: tuple[tuple[int, ...], Any] | None = None  # (variables' ids, check)
        # The supervisor's own objects never change: their floating-point variables (a
        # float global step, say) are found once, and each save walks the user's alone.
        own = [o for obj in self.ours.values() for o in tf.train.TrackableView(obj).descendants()]
        self._own_floats = _floats(own)

    def _root(self, ours: Mapping[str, Any]) -> tf.train.Checkpoint:
        import tensorflow as tf

        # TF's counter of saves, made on the user's object now (see the module's
        # docstring); every checkpoint so far holds one, and the root takes the user's.
        _ = self.user.save_counter
        return tf.train.Checkpoint(root=self.user, **ours)

    def to_save(self) -> tf.train.Checkpoint:
        """The root to write, its counter of saves advanced first (as ``Checkpoint.save``
        advances it, and ``tf.train.CheckpointManager.save``)."""
        self.checkpoint.save_counter.assign_add(1)
        return self.checkpoint

    def children(self) -> dict[str, Any]:
        """The top-level objects, as a save would write them now."""
        user = children_of(self.user)
        own = {**self.ours, **self.legacy}
        clash = [n for n in own if n in user and user[n] is not own[n]]
        if clash:
            raise ValueError(
                f"the checkpoint object was given an attribute {clash[0]!r} after the "
                "Supervisor was made: that name is the supervisor's own; rename it"
            )
        return {**user, **own}

    def without(self, names: list[str]) -> tf.train.Checkpoint:
        """A root without ``names`` (of the supervisor's own objects, the older layout's
        too): to restore a checkpoint that lacks them (this layout lacks the older one's;
        an older or another tool's lacks some of this one's), checking that it fills the
        rest."""
        if set(self.legacy) <= set(names) and not set(self.ours) & set(names):
            return self.checkpoint  # this layout, whole: the root every save writes
        own = {**self.ours, **self.legacy}
        return self._root({k: v for k, v in own.items() if k not in names})

    def finite(self) -> bool:
        """Whether every floating-point variable a save writes now is finite: one
        ``tf.function`` over all of them (made again when the set of variables changes),
        on the training thread, at a step boundary. A state a finite loss left NaN (the
        gradient of ``sqrt(0)``) is caught here, before it is committed as healthy."""
        variables = self.float_variables()
        if not variables:
            return True
        key = tuple(id(v) for v in variables)
        if self._finite is None or self._finite[0] != key:
            self._finite = (key, _all_finite(variables))
        return bool(self._finite[1]())

    def variables_key(self) -> tuple[int, ...] | None:
        """The ids of the floating-point variables the last ``finite`` check found (``None``
        before the first): what a save writes, for a reader that needs to know whether it
        changed without walking the objects again."""
        return None if self._finite is None else self._finite[0]

    def float_variables(self) -> list[Any]:
        """The floating-point variables a save writes now (each once): the user's, walked
        again (an attribute set, an optimizer built, changes them), then the supervisor's."""
        import tensorflow as tf

        found = _floats(tf.train.TrackableView(self.user).descendants())
        seen = {id(v) for v in found}
        return found + [v for v in self._own_floats if id(v) not in seen]


def _floats(objects: Iterable[Any]) -> list[Any]:
    """The floating-point ``tf.Variable``s among ``objects``, each once, in order."""
    import tensorflow as tf

    found, seen = [], set()
    for obj in objects:
        # A Keras 3 variable holds its tf.Variable in `.value`.
        variable = obj if isinstance(obj, tf.Variable) else _value_of(obj)
        if isinstance(variable, tf.Variable) and variable.dtype.is_floating:
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
    return found


def _all_finite(variables: list[Any]) -> Any:
    import tensorflow as tf

    def all_finite() -> Any:
        return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in variables]))

    # Its concrete function, called directly: a save pays no look-up of the trace.
    return tf.function(all_finite, autograph=False).get_concrete_function()


def _value_of(obj: Any) -> Any:
    try:
        return obj.value
    except Exception:  # any object may have a `value` that is not a variable's
        return None
