"""A ``tf.data`` pipeline's identity: a hash of its graph and its sources.

An iterator's saved state is TF's state of one pipeline: its sources' positions, its
buffers. Restored into another one (a batch size, a shuffle's buffer, a range edited
between two sessions) it reads on at the wrong place, reads the old data, or fails
inside ``IteratorGetNext`` at every restart. The element spec cannot tell (``(None,)``
for any batch size); the pipeline's graph can: TF serializes it
(``Dataset._as_serialized_graph``), sources and constants included.

The hash is of what makes the data, and the same for the same pipeline in any process
and however often it is built:

- names TF makes up per build are left out: the datasets' ``metadata`` names, the
  numbered suffixes of traced functions (each ``map`` traces its own), the shared names
  and handles of resources (a variable a ``map`` captures, a shuffle's seed generator);
- the values of the variables it captures are left out (state, not what it is made of);
- a random op's seeds are left out: where no seed was given TF draws one per process, and
  a state taken under one seed reads on in that seed's order (each element of the epoch
  once), so a seed alone is no reason to drop it.

``""`` when TF cannot serialize the pipeline (then nothing is checked but its spec).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

FORMAT = "p1"  # changes when the hash of a pipeline would
SEEDS = ("seed", "seed2")  # inputs of TF's random ops that are their seeds
_NAMES = ("metadata", "shared_name", "container", "debug_name")  # attrs made up per build
BIG = 4096  # bytes of a constant hashed apart
_TRACED = re.compile(r"_\d+$")  # the counter TF appends to a traced function's name


def of_dataset(dataset: Any) -> str:
    """The pipeline's fingerprint, or ``""`` when it cannot be taken."""
    import tensorflow as tf
    from google.protobuf import json_format

    serialize = getattr(dataset, "_as_serialized_graph", None)
    if serialize is None or not isinstance(dataset, tf.data.Dataset):
        return ""
    try:
        policy = tf.data.experimental.ExternalStatePolicy.IGNORE
        serialized = serialize(external_state_policy=policy, strip_device_assignment=True)
        graph = tf.compat.v1.GraphDef.FromString(serialized.numpy())
    except Exception:  # a pipeline TF cannot serialize: its state cannot be saved either
        return ""
    # A large constant (an in-memory dataset's data) is hashed as it is, not as base64.
    contents = {}
    for node in graph.node:
        tensor = node.attr["value"].tensor if node.op == "Const" else None
        if tensor is not None and len(tensor.tensor_content) > BIG:
            contents[node.name] = hashlib.sha256(tensor.tensor_content).hexdigest()
            tensor.ClearField("tensor_content")
    # As plain data (bytes as base64): made canonical, then hashed.
    plain = json_format.MessageToDict(graph, preserving_proto_field_name=True)
    for node in plain.get("node", []):
        if node["name"] in contents:
            node["attr"]["value"]["content_sha256"] = contents[node["name"]]
    text = json.dumps(_canonical(plain), sort_keys=True, separators=(",", ":"))
    return f"{FORMAT}:{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def _canonical(graph: dict[str, Any]) -> dict[str, Any]:
    """``graph`` without what differs between two builds of the same pipeline."""
    nodes = graph.get("node", [])
    library = graph.get("library", {})
    bodies = {f["signature"]["name"]: f for f in library.get("function", [])}
    renamed = _function_names(nodes, bodies)
    values = _seed_inputs(nodes) | _variable_values(nodes)
    for node in nodes:
        _clean(node, renamed)
        if node["name"] in values:
            node["attr"]["value"] = {}
    functions = []
    for name, function in sorted(bodies.items(), key=lambda item: renamed[item[0]]):
        for node in function.get("node_def", []):
            _clean(node, renamed)
        functions.append({
            "signature": {**function["signature"], "name": renamed[name]},
            "node_def": function.get("node_def", []),
            "ret": function.get("ret", {}),
            "control_ret": function.get("control_ret", {}),
        })  # fmt: skip
    return {"node": nodes, "function": functions}


def _function_names(nodes: list[Any], bodies: dict[str, Any]) -> dict[str, str]:
    """A name for each traced function by the order the graph first uses it (TF names
    them with a counter of every trace in the process, and lists them by that name)."""
    order: dict[str, str] = {}

    def visit(nodes: list[Any]) -> None:
        for node in nodes:
            attrs = node.get("attr", {})
            for key in sorted(attrs):
                for name in _functions_in(attrs[key]):
                    if name in bodies and name not in order:
                        order[name] = f"{len(order):04d}:{_TRACED.sub('', name)}"
                        visit(bodies[name].get("node_def", []))

    visit(nodes)
    for name in sorted(bodies, key=lambda n: _TRACED.sub("", n)):  # none unused, but if so
        order.setdefault(name, f"{len(order):04d}:{_TRACED.sub('', name)}")
    return order


def _functions_in(value: dict[str, Any]) -> list[str]:
    """The functions an attr value names (``f`` of a ``map``, lists of them)."""
    if "func" in value:
        attrs = value["func"].get("attr", {})
        inner = [n for key in sorted(attrs) for n in _functions_in(attrs[key])]
        return [value["func"].get("name", ""), *inner]
    return [f.get("name", "") for f in value.get("list", {}).get("func", [])]


def _clean(node: dict[str, Any], renamed: dict[str, str]) -> None:
    attrs = node.get("attr", {})
    for key in (*_NAMES, *SEEDS):  # a random op in a map holds its seeds as attrs
        attrs.pop(key, None)
    for value in attrs.values():
        _rename(value, renamed)
        value.get("tensor", {}).pop("resource_handle_val", None)  # this process's own


def _rename(value: dict[str, Any], renamed: dict[str, str]) -> None:
    if "func" in value:
        func = value["func"]
        func["name"] = renamed.get(func.get("name", ""), func.get("name", ""))
        for inner in func.get("attr", {}).values():
            _rename(inner, renamed)
    for func in value.get("list", {}).get("func", []):
        func["name"] = renamed.get(func.get("name", ""), func.get("name", ""))


def _variable_values(nodes: list[Any]) -> set[str]:
    """The nodes that give a captured variable its value: the value it has when the graph
    is taken (a counter a ``map`` adds to), not what the pipeline is."""
    return {
        node["input"][1].split(":")[0]
        for node in nodes
        if node.get("op") == "AssignVariableOp" and len(node.get("input", [])) > 1
    }


def _seed_inputs(nodes: list[Any]) -> set[str]:
    """The nodes that feed a seed input of a random op (``shuffle``'s ``seed``, ``seed2``)."""
    from tensorflow.python.framework import op_def_registry

    found: set[str] = set()
    for node in nodes:
        op_def = op_def_registry.get(node.get("op", ""))
        if op_def is None:
            continue
        inputs = [i for i in node.get("input", []) if not i.startswith("^")]
        for arg, source in zip(op_def.input_arg, inputs, strict=False):
            if arg.number_attr or arg.type_list_attr:
                break  # a list input: the places of the ones after it are not known here
            if arg.name in SEEDS:
                found.add(source.split(":")[0])
    return found
