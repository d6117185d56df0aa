"""Is a checkpoint whole, and does it fit the objects it would be restored into?

Verification reads every tensor back, so a truncated or corrupt data file is
caught before a restore trusts it; the shape and top-level checks name what does
not match a model, instead of restoring part of it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any


def reader_of(prefix: str) -> Any:
    """TF's reader of the checkpoint at ``prefix``. Not ``tf.train.load_checkpoint``,
    which first asks whether the prefix is a directory: on an object store every
    prefix of a name is one, and it then looks for a state file inside it."""
    import tensorflow as tf

    return tf.compat.v1.train.NewCheckpointReader(prefix)


def verify_checkpoint(prefix: str) -> str | None:
    """``None`` if the checkpoint at ``prefix`` reads back whole, else why it does not.

    Every tensor is read, so a truncated or corrupt data file is caught, not only
    a missing index. Variant tensors (a tf.data iterator's state) have no numpy
    form: they are read as the restore reads them (``RestoreV2``), which checks
    their checksums too.
    """
    import tensorflow as tf

    try:
        reader = reader_of(prefix)
        variants = []
        for name, dtype in reader.get_variable_to_dtype_map().items():
            if dtype == tf.variant:
                variants.append(name)
            elif dtype != tf.resource:
                reader.get_tensor(name)
        if variants:
            with tf.device("/cpu:0"):
                tf.raw_ops.RestoreV2(
                    prefix=prefix,
                    tensor_names=variants,
                    shape_and_slices=[""] * len(variants),
                    dtypes=[tf.variant] * len(variants),
                )
    except Exception as exc:  # TF reports damage with several error types
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first_line}"[:300]
    return None


def _holds_state(obj: Any) -> bool:
    """Whether ``obj`` or anything it tracks has a value a checkpoint would save."""
    import tensorflow as tf

    for node in tf.train.TrackableView(obj).descendants():
        if (
            isinstance(node, tf.Variable)
            or hasattr(node, "assign")
            or "Iterator" in type(node).__name__
        ):
            return True
    return False


def shape_differences(children: Mapping[str, Any], path: str) -> list[str]:
    """``"name: checkpoint (3,), model (5,)"`` for every variable whose shape differs.

    ``children`` are the root's objects by name. Variables are named by their first
    path from the root, breadth first, as TF names them when it saves.
    """
    import tensorflow as tf

    saved = reader_of(path).get_variable_to_shape_map()
    seen = {id(child) for child in children.values()}
    queue, found = list(children.items()), []
    while queue:
        child_path, child = queue.pop(0)
        key = f"{child_path}/.ATTRIBUTES/VARIABLE_VALUE"
        shape = getattr(child, "shape", None)
        if key in saved and shape is not None and list(shape) != saved[key]:
            found.append(f"{child_path}: checkpoint {tuple(saved[key])}, model {tuple(shape)}")
        for name, grandchild in tf.train.TrackableView(child).children(child).items():
            if id(grandchild) not in seen:
                seen.add(id(grandchild))
                queue.append((f"{child_path}/{name}", grandchild))
    return found


def top_level_differences(children: Mapping[str, Any], path: str) -> tuple[list[str], list[str]]:
    """The top-level names only the model has (with state), and only the checkpoint has.

    The names come from the object graph saved in the checkpoint, not from the
    tensors' keys: TF names a value by its first path in the graph, so a model's
    variables may be saved under the optimizer that also tracks them.
    """
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
        reader_of(path).get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    )
    # A root given as `root=` is its own child "root" (node 0): not an object of its own.
    saved = {child.local_name for child in graph.nodes[0].children if child.node_id != 0}
    saved.discard("save_counter")  # a Checkpoint's own counter, in older checkpoints
    missing = sorted(n for n, obj in children.items() if n not in saved and _holds_state(obj))
    unexpected = sorted(n for n in saved if n not in children)
    return missing, unexpected


def unrestored(status: Any) -> str | None:
    """The first value of a restored checkpoint that no object has taken yet, or ``None``.

    Keras 3 restores into objects that are not built yet *deferred*: an optimizer takes
    its slots when it builds, but an unbuilt subclassed model can make new variables and
    never take the saved ones. Asked again after the first step, it tells the two apart.
    """
    if status is None:
        return None
    try:
        status.assert_consumed()
    except AssertionError as exc:
        # TF checks the checkpoint's side first; "Python objects that were not bound" is
        # the other side (the global step, when migrating from another tool's checkpoint).
        text = str(exc).strip()
        if "Python objects that were not bound" in text.split("\n", 1)[0]:
            return None
        key = re.search(r'checkpoint_key: "([^"]+)"', text)
        return key[1] if key else (text.splitlines() or [repr(exc)])[0][:200]
    return None


def variable_differences(children: Mapping[str, Any], path: str) -> list[str]:
    """Every variable that differs between the checkpoint and the objects now, one line
    each: ``"model/dense/kernel: checkpoint (3, 4), model (3, 8)"``, ``"the model has
    model/dense_1/kernel (4, 4) that the checkpoint lacks"``, ``"the checkpoint has ...
    that the model lacks"``.

    The checkpoint's object graph is walked beside the objects' own, by the names TF
    matches them by (as a restore does), so a variable is found on any of its paths
    (a Keras model's variables are saved under the optimizer that tracks them, which is
    not built before the first step). A list or dict left empty (an optimizer not built
    yet) is not counted as lacking what the checkpoint has under it.
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    reader = reader_of(path)
    shapes = reader.get_variable_to_shape_map()
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
        reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    )

    def children_of(obj: Any) -> dict[str, Any]:
        try:
            return dict(tf.train.TrackableView(obj).children(obj))
        except Exception:  # not a trackable: nothing under it
            return {}

    matched: dict[int, tuple[Any, str]] = {}  # saved node → the object, its path
    lacking: dict[int, str] = {}  # saved node → a path the objects lack
    top = [(c.node_id, children.get(c.local_name), c.local_name) for c in graph.nodes[0].children]
    queue = [(node, obj, name) for node, obj, name in top if node != 0 and name not in _TF_OWN]
    while queue:
        node_id, obj, where = queue.pop(0)
        if node_id in matched or (obj is None and node_id in lacking):
            continue
        if obj is None:
            lacking[node_id] = where
            queue.extend(
                (c.node_id, None, f"{where}/{c.local_name}") for c in graph.nodes[node_id].children
            )
            continue
        matched[node_id] = (obj, where)
        live = children_of(obj)
        unbuilt = not live and type(obj).__name__ in ("ListWrapper", "_DictWrapper")
        for child in graph.nodes[node_id].children:
            if child.local_name in live or not unbuilt:
                found_child = live.get(child.local_name)
                queue.append((child.node_id, found_child, f"{where}/{child.local_name}"))
    found = []
    for node_id, node in enumerate(graph.nodes):
        keys = [a.checkpoint_key for a in node.attributes if a.name == "VARIABLE_VALUE"]
        if not keys or keys[0] not in shapes:
            continue
        saved = tuple(shapes[keys[0]])
        if node_id in matched:
            obj, where = matched[node_id]
            shape = getattr(obj, "shape", None)
            if shape is not None and tuple(shape) != saved:
                found.append(f"{_named(obj, where)}: checkpoint {saved}, model {tuple(shape)}")
        elif node_id in lacking:
            found.append(f"the checkpoint has {lacking[node_id]} {saved} that the model lacks")
    taken = {id(obj) for obj, _ in matched.values()}
    seen = {id(obj) for obj in children.values()}
    walk = list(children.items())
    while walk:
        where, obj = walk.pop(0)
        if id(obj) not in taken and hasattr(obj, "assign") and hasattr(obj, "shape"):
            shape = tuple(obj.shape)
            found.append(f"the model has {_named(obj, where)} {shape} that the checkpoint lacks")
        for name, child in children_of(obj).items():
            if id(child) not in seen:
                seen.add(id(child))
                walk.append((f"{where}/{name}", child))
    return found


_TF_OWN = ("save_counter",)  # a Checkpoint's own counter: not the model's


def _named(obj: Any, where: str) -> str:
    """A variable's name as its user knows it (a Keras variable's ``path``), else where it
    is in the checkpoint."""
    path = getattr(obj, "path", None)
    return path if isinstance(path, str) and path else where
