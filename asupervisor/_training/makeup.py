"""What a run is made of, kept with every checkpoint: a resume into something that
changed says what changed.

Each save records the model's variables (names and shapes), the hyperparameters of each
Keras optimizer, the command line and the fingerprint of the data pipeline read
(``fingerprint``), as one of the kept states (``kept_state``: it travels in the
checkpoint's ``supervised_state``). At a restore the record of the commit restored is
compared with the run as it is now, and what differs is logged once (``run.changed``).

An optimizer's hyperparameters are compared with the values the command gave, taken
before the restore: TensorFlow restores a Keras optimizer's learning rate with the
checkpoint, so a rate changed on the command line of a resumed run would otherwise be
replaced by the old one, silently.

Walking the objects under the checkpoint costs milliseconds per hundred variables, at
every save: the walk is done once and again only when the variables a save writes
changed (``changed``: the saved root's own check of them, made at every save anyway);
the optimizers' hyperparameters are read at each save (their values may be assigned).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from .._log import log

KIND, KEY = "run", "makeup"  # its place among the kept states
SHOWN = 5  # names listed per kind of change
HINT = (
    "the checkpoint's values are used; to change a hyperparameter of a resumed run, assign "
    "it after the session has begun (model.optimizer.learning_rate.assign(...)); to start "
    "over, use a new logdir"
)


class Makeup:
    """The run's makeup (``state``: as the kept-state protocol asks), and the check of a
    restored one against it (``restore``)."""

    def __init__(
        self,
        root: Any,
        pipeline: Callable[[], str],
        variables_key: Callable[[], Hashable | None] = lambda: None,
    ) -> None:
        self._root = root  # the user's checkpoint: what a save writes
        self._pipeline = pipeline  # the fingerprint of the pipeline read now ("": none)
        # The variables a save writes, as last checked (None: not known, walk again).
        self._variables_key = variables_key
        self._walked: tuple[Hashable, Walked] | None = None  # (key, the walk under it)
        self._given: dict[str, dict[str, Any]] = {}  # the command's values (``before_restore``)
        self.changed: list[str] = []  # what differed from the commit restored (``restore``)

    def before_restore(self) -> None:
        """Training thread, before the restore: the optimizers' values the command gave."""
        self._given = optimizers(self._root)

    def state(self) -> dict[str, Any]:
        """The record a save keeps: the walk of the objects reused while the variables
        a save writes are the same ones."""
        key = self._variables_key()
        if key is None or self._walked is None or self._walked[0] != key:
            walked = Walked(self._root)
            if key is None:
                return walked.record(self._pipeline())
            self._walked = (key, walked)
        return self._walked[1].record(self._pipeline())

    def restore(self, state: Mapping[str, Any]) -> None:
        """The record of the commit restored: what differs from the run now is logged."""
        now = Walked(self._root).record(self._pipeline())  # after the restore: walked anew
        changed = self.changed = differences(state, now, self._given)
        if changed:
            hint = HINT if any(line.startswith("optimizer") for line in changed) else None
            log.warning("run.changed", changed=changed, hint=hint)


def differences(
    saved: Mapping[str, Any], now: Mapping[str, Any], given: Mapping[str, Any]
) -> list[str]:
    """What differs, one line each (``given``: the optimizers' values before the restore)."""
    out: list[str] = []
    before, after = saved.get("variables") or {}, now.get("variables") or {}
    if before and after and before != after:  # none now: a model not built yet
        added = sorted(set(after) - set(before))
        gone = sorted(set(before) - set(after))
        shaped = sorted(n for n in set(before) & set(after) if before[n] != after[n])
        for what, names in (("added", added), ("removed", gone), ("reshaped", shaped)):
            if names:
                out.append(f"variables {what}: {_names(names)}")
    restored = saved.get("optimizers") or {}
    for where, config in given.items():
        old = restored.get(where)
        if not isinstance(old, dict):
            continue
        for key in sorted(set(config) | set(old)):
            if config.get(key) != old.get(key):
                out.append(
                    f"optimizer {where}.{key}: restored {old.get(key)!r}, "
                    f"the command gives {config.get(key)!r}"
                )
    if saved.get("command") and saved.get("command") != now.get("command"):
        out.append(f"command: {_command(saved['command'])} -> {_command(now['command'])}")
    return out


def _names(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _command(argv: Any) -> str:
    return " ".join(str(a) for a in argv)[:300] if isinstance(argv, list) else repr(argv)


def _children(obj: Any) -> dict[str, Any]:
    import tensorflow as tf

    try:
        return dict(tf.train.TrackableView(obj).children(obj))
    except Exception:  # not a trackable: nothing under it
        return {}


def _walk(root: Any) -> list[tuple[str, Any]]:
    """Every object under ``root`` once, by its first path (breadth first, as TF names
    the values of a checkpoint); an optimizer's own variables are left out (they are
    made at its first step)."""
    found, seen = [], {id(root)}
    queue = list(_children(root).items())
    while queue:
        where, obj = queue.pop(0)
        if id(obj) in seen or where.endswith("save_counter"):
            continue
        seen.add(id(obj))
        found.append((where, obj))
        if _is_optimizer(obj):
            continue
        queue.extend((f"{where}/{name}", child) for name, child in _children(obj).items())
    return found


class Walked:
    """One walk of the objects under a root: its variables' shapes, its optimizers."""

    def __init__(self, root: Any) -> None:
        found = _walk(root)
        self.variables = _variables(found)
        self.optimizers = [(where, obj) for where, obj in found if _is_optimizer(obj)]

    def record(self, pipeline: str) -> dict[str, Any]:
        return {
            "variables": self.variables,
            "optimizers": _configs(self.optimizers),
            "command": list(sys.argv),
            "pipeline": pipeline,
        }


def variables(root: Any) -> dict[str, list[int | None]]:
    """The variables under ``root``: their path in the checkpoint (not a Keras path,
    which Keras numbers per process) to their shape."""
    return _variables(_walk(root))


def _variables(found: list[tuple[str, Any]]) -> dict[str, list[int | None]]:
    out: dict[str, list[int | None]] = {}
    for where, obj in found:
        shape = getattr(obj, "shape", None)
        if hasattr(obj, "assign") and shape is not None:
            try:
                out[where] = list(shape)
            except TypeError:  # an unknown rank
                out[where] = []
    return out


def optimizers(root: Any) -> dict[str, dict[str, Any]]:
    """Each Keras optimizer under ``root`` (by its path) with its hyperparameters as JSON
    values (its name left out: Keras numbers it per process)."""
    return _configs([(where, obj) for where, obj in _walk(root) if _is_optimizer(obj)])


def _configs(found: list[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for where, obj in found:
        try:
            config = dict(obj.get_config())
        except Exception:  # an optimizer that cannot say: nothing to compare
            continue
        config.pop("name", None)
        out[where] = _plain(json.loads(json.dumps(config, default=repr)))
    return out


def _plain(value: Any) -> Any:
    """Floats as a user writes them: a rate kept in float32 reads 0.009999999776482582."""
    if isinstance(value, float):
        return float(f"{value:.7g}")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _is_optimizer(obj: Any) -> bool:
    for cls in type(obj).__mro__:
        if cls.__module__.startswith("keras") and cls.__name__ in ("Optimizer", "BaseOptimizer"):
            return True
    return False
