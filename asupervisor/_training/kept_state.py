"""State that lives outside the model, kept across restarts: callbacks, hooks, services,
and the random generators of Keras layers.

- **The protocol.** A hook, a service or a Keras callback with ``state() -> Mapping`` (of
  JSON values) and ``restore(state: Mapping) -> None`` has its state saved in every
  checkpoint and given back after a restore: hooks before ``after_create_session``,
  services before they start, ``fit``'s callbacks after Keras' ``on_train_begin`` (which
  resets them) at each ``fit`` call, or at the call when nothing is left to train.
- **Keras' own callbacks** have no such methods; the fields their ``on_train_begin``
  resets are kept for them: EarlyStopping's wait and best (not ``best_weights``: a
  checkpoint of the model is what ``asv.KeepBest`` keeps), ReduceLROnPlateau's wait,
  cooldown and best, ModelCheckpoint's best.
- **Keras' ``SeedGenerator``s** (Dropout, random layers) hold their state in a variable
  that a ``tf.train.Checkpoint`` of the model leaves out: a resumed run would draw the
  numbers of a fresh start again. Their variables are saved beside the model.

All of it is one JSON string in the checkpoint (``supervised_state``), plus the seed
generators' variables (``seed_generators``); a checkpoint without them (older, or another
tool's) restores with nothing to give back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from .._log import log

NAME = "supervised_state"
SEEDS = "seed_generators"

# The fields Keras' on_train_begin resets, by callback class name (keras.callbacks).
KERAS_FIELDS = {
    "EarlyStopping": ("wait", "stopped_epoch", "best", "best_epoch"),
    "ReduceLROnPlateau": ("wait", "cooldown_counter", "best"),
    "ModelCheckpoint": ("best",),
}


@runtime_checkable
class Stateful(Protocol):
    """What a hook, a service or a callback implements to keep its state across restarts."""

    def state(self) -> Mapping[str, Any]: ...

    def restore(self, state: Mapping[str, Any]) -> None: ...


def _keras_fields(obj: Any) -> tuple[str, ...]:
    for cls in type(obj).__mro__:
        if cls.__module__.startswith("keras") and cls.__name__ in KERAS_FIELDS:
            return KERAS_FIELDS[cls.__name__]
    return ()


def state_of(obj: Any) -> dict[str, Any] | None:
    """``obj``'s state to keep, or ``None`` if it has none the supervisor knows of."""
    if isinstance(obj, Stateful):
        return dict(obj.state())
    fields = _keras_fields(obj)
    if not fields:
        return None
    return {f: _plain(getattr(obj, f)) for f in fields if hasattr(obj, f)}


def give_back(obj: Any, state: Mapping[str, Any]) -> None:
    """Put ``state`` back into ``obj``: through its ``restore``; for Keras' callbacks, into
    the fields their ``on_train_begin`` reset (Keras has no API for it)."""
    if isinstance(obj, Stateful):
        obj.restore(state)
        return
    for field in _keras_fields(obj):
        if field in state:
            setattr(obj, field, state[field])


def _plain(value: Any) -> Any:
    """A JSON value (numpy numbers and 0-d tensors as Python numbers)."""
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def key_of(index: int, obj: Any) -> str:
    """A kept state's key: the object's place among its kind, and its class."""
    return f"{index}:{type(obj).__qualname__}"


class KeptState:
    """One session's kept state: collected at each save, given back after each restore."""

    def __init__(self) -> None:
        import tensorflow as tf

        module = tf.Module(name=NAME)
        module.json = tf.Variable("{}", dtype=tf.string, trainable=False, name="json")
        self.module = module
        self.saved: dict[str, dict[str, Any]] = {}  # by kind, as the checkpoint has it
        self._live: dict[str, dict[str, Any]] = {}  # kind → key → object, what saves read
        self._synced: str | None = None  # the text the last sync assigned (None: unknown)

    def track(self, kind: str, objects: Iterable[Any], keys: Iterable[str]) -> None:
        """These objects' states are kept under ``kind`` from now on."""
        self._live[kind] = dict(zip(keys, objects, strict=True))

    def track_one(self, kind: str, key: str, obj: Any) -> None:
        self._live.setdefault(kind, {})[key] = obj

    def sync(self) -> None:
        """Training thread, before a save: every tracked object's state into the checkpoint."""
        now = {kind: dict(self.saved.get(kind, {})) for kind in self.saved}
        for kind, objects in self._live.items():
            for key, obj in objects.items():
                state = state_of(obj)
                if state is not None:
                    now.setdefault(kind, {})[key] = state
        text = json.dumps(now)
        if text != self._synced:  # unchanged since the last save: no eager assign
            self.module.json.assign(text)
            self._synced = text

    def reload(self) -> None:
        """After a restore: what the checkpoint holds."""
        self._synced = None  # the restore wrote the variable
        try:
            loaded = json.loads(self.module.json.numpy().decode() or "{}")
        except ValueError:
            loaded = {}
        self.saved = loaded if isinstance(loaded, dict) else {}

    def give_back(self, kind: str, objects: Iterable[Any], keys: Iterable[str]) -> None:
        """Training thread: the saved states of ``kind`` back into these objects."""
        saved = self.saved.get(kind, {})
        for key, obj in zip(keys, objects, strict=True):
            if key in saved:
                give_back(obj, saved[key])
                log.debug("state.restored", kind=kind, key=key)


def seed_generators(roots: Iterable[Any]) -> list[Any]:
    """The state variables of the Keras ``SeedGenerator``s in ``roots`` (models, layers,
    generators), in a stable order: the same model gives the same list in every process."""
    try:
        import keras
    except ImportError:  # pragma: no cover - Keras comes with TensorFlow here
        return []
    found: list[Any] = []
    seen: set[int] = set()

    def add_state(state: Any) -> None:  # a generator's Keras variable
        if id(state) not in seen:
            seen.add(id(state))
            found.append(state.value)

    for root in roots:
        if isinstance(root, keras.random.SeedGenerator):
            add_state(root.state)
        elif isinstance(root, keras.layers.Layer):
            # Keras documents `variables` as `weights` plus the SeedGenerators' states,
            # of the layer and of every layer nested in it.
            weights = {id(w) for w in root.weights}
            for variable in root.variables:
                if id(variable) not in weights:
                    add_state(variable)
    return found
