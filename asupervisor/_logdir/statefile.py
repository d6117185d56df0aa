"""TensorFlow's ``checkpoint`` state file, read and written without TensorFlow.

``tf.train.latest_checkpoint`` and ``tf.train.CheckpointManager`` read this file: a
``CheckpointState`` message in protobuf's text format, four fields::

    model_checkpoint_path: "model.ckpt-12"
    all_model_checkpoint_paths: "model.ckpt-9"
    all_model_checkpoint_paths: "model.ckpt-12"
    all_model_checkpoint_timestamps: 1712345678.5
    all_model_checkpoint_timestamps: 1712345690.25
    last_preserved_timestamp: 1712345600.0

The supervisor writes it from its history (``_history``): it follows the history's head.
It is parsed here by a small strict reader (any other field, or anything that is not
this format, is damage: ``ValueError``), so that ``asupervisor run`` and ``asupervisor
inspect`` read a local logdir without importing TensorFlow, and the chief writes it the
way protobuf's text printer does (strings C-escaped, doubles as Python's ``repr``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from .._log import log
from .store import Store

STATE = "checkpoint"

_FIELDS = {
    "model_checkpoint_path": "string",
    "all_model_checkpoint_paths": "strings",
    "all_model_checkpoint_timestamps": "doubles",
    "last_preserved_timestamp": "double",
}
_TOKEN = re.compile(
    r"""\s*(?:
        (?P<comment>\#[^\n]*)
      | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
      | (?P<punct>[:\[\],;])
      | (?P<word>[A-Za-z_][A-Za-z0-9_]*|-inf(?:inity)?
          |[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)[fF]?)
    )""",
    re.VERBOSE,
)
_SIMPLE_ESCAPES = {
    "n": 10, "r": 13, "t": 9, '"': 34, "'": 39, "\\": 92, "a": 7, "b": 8, "f": 12,
    "v": 11, "?": 63,
}  # fmt: skip


@dataclass(frozen=True)
class StateFile:
    """The state file's fields: the latest checkpoint and the listed ones (oldest first,
    with the times they were committed), as written (paths, maybe relative)."""

    latest: str
    listed: tuple[str, ...] = ()
    timestamps: tuple[float, ...] = ()
    last_preserved: float = 0.0


def _tokens(text: str) -> list[tuple[str, str]]:
    found, at = [], 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None or match.end() == at:
            if text[at:].strip():
                raise ValueError(f"not a checkpoint state: unexpected {text[at : at + 20]!r}")
            break
        at = match.end()
        kind = match.lastgroup
        if kind is not None and kind != "comment":
            found.append((kind, match[kind]))
    return found


def _unquote(literal: str) -> str:
    """A C-escaped string literal of protobuf's text format, as text (UTF-8 bytes)."""
    body, out, i = literal[1:-1], bytearray(), 0
    while i < len(body):
        char = body[i]
        if char != "\\":
            out += char.encode("utf-8")
            i += 1
            continue
        code = body[i + 1]
        if code in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[code])
            i += 2
        elif code in "01234567":
            digits = re.match(r"[0-7]{1,3}", body[i + 1 :])
            assert digits is not None
            out.append(int(digits[0], 8) & 0xFF)
            i += 1 + len(digits[0])
        elif code == "x":
            digits = re.match(r"[0-9A-Fa-f]{1,2}", body[i + 2 :])
            if digits is None:
                raise ValueError(f"not a checkpoint state: a bad escape in {literal!r}")
            out.append(int(digits[0], 16))
            i += 2 + len(digits[0])
        else:
            raise ValueError(f"not a checkpoint state: a bad escape in {literal!r}")
    return out.decode("utf-8")


def _number(word: str) -> float:
    lowered = word.lower().rstrip("f") if not word.lower().startswith(("inf", "-inf")) else word
    try:
        return float(lowered)
    except ValueError:
        raise ValueError(f"not a checkpoint state: {word!r} is not a number") from None


def parse(text: str) -> StateFile:
    """The state file's text as a ``StateFile``; ``ValueError`` for anything else (a
    field it does not have, a value of the wrong kind, no ``model_checkpoint_path``)."""
    tokens = _tokens(text)
    values: dict[str, list[Any]] = {name: [] for name in _FIELDS}
    i = 0
    while i < len(tokens):
        kind, name = tokens[i]
        if kind != "word" or name not in _FIELDS:
            raise ValueError(f"not a checkpoint state: unexpected {name!r}")
        if i + 1 >= len(tokens) or tokens[i + 1] != ("punct", ":"):
            raise ValueError(f"not a checkpoint state: {name} without ':'")
        i += 2
        items: list[tuple[str, str]] = []
        if i < len(tokens) and tokens[i] == ("punct", "["):
            i += 1
            while i < len(tokens) and tokens[i] != ("punct", "]"):
                if tokens[i] != ("punct", ","):
                    items.append(tokens[i])
                i += 1
            i += 1
        elif i < len(tokens):
            items.append(tokens[i])
            i += 1
            while (
                _FIELDS[name].startswith("string") and i < len(tokens) and tokens[i][0] == "string"
            ):
                items[-1] = ("string", items[-1][1][:-1] + tokens[i][1][1:])  # "a" "b" is "ab"
                i += 1
        for item_kind, item in items:
            if _FIELDS[name].startswith("string"):
                if item_kind != "string":
                    raise ValueError(f"not a checkpoint state: {name} is not a string")
                values[name].append(_unquote(item))
            else:
                if item_kind != "word":
                    raise ValueError(f"not a checkpoint state: {name} is not a number")
                values[name].append(_number(item))
        if i < len(tokens) and tokens[i] in (("punct", ","), ("punct", ";")):
            i += 1
    latest = values["model_checkpoint_path"]
    if not latest or not latest[-1]:
        raise ValueError("not a checkpoint state: it has no model_checkpoint_path")
    preserved = values["last_preserved_timestamp"]
    return StateFile(
        latest=latest[-1],
        listed=tuple(values["all_model_checkpoint_paths"]),
        timestamps=tuple(values["all_model_checkpoint_timestamps"]),
        last_preserved=preserved[-1] if preserved else 0.0,
    )


def _quote(text: str) -> str:
    """As protobuf's text printer writes a string: printable ASCII as it is, the rest
    C-escaped byte by byte."""
    out = []
    for byte in text.encode("utf-8"):
        char = chr(byte)
        if char in "\"'\\":
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\r":
            out.append("\\r")
        elif char == "\t":
            out.append("\\t")
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _double(value: float) -> str:
    return repr(float(value)) if math.isfinite(value) else ("nan" if value != value else str(value))


def format_state(state: StateFile) -> str:
    lines = [f"model_checkpoint_path: {_quote(state.latest)}"]
    lines += [f"all_model_checkpoint_paths: {_quote(p)}" for p in state.listed]
    lines += [f"all_model_checkpoint_timestamps: {_double(t)}" for t in state.timestamps]
    lines.append(f"last_preserved_timestamp: {_double(state.last_preserved)}")
    return "\n".join(lines) + "\n"


def read(store: Store) -> StateFile | None:
    """The logdir's state file (``None`` if there is none), read bounded and never from
    anything but a regular file (a FIFO there would hang TF's reader); ``OSError`` or
    ``ValueError`` for a damaged one."""
    data = store.read_if_there(STATE)
    return None if data is None else parse(data.decode("utf-8"))


def write(store: Store, state: StateFile) -> None:
    """Replace the state file whole (written aside, renamed, the directory synced: the
    renames made before it in the logdir too). Its bytes are not fsynced: it follows the
    history (fsynced, written first), and a state file a power cut damaged is put aside
    and written again from the history (``put_aside``)."""
    store.write(STATE, format_state(state).encode(), durable=False)
    store.sync([])


def put_aside(store: Store, exc: BaseException, *, move: bool) -> tuple[str, str]:
    """The state file cannot be read: the checkpoints beside it are still known (from the
    history, or found on disk). The chief (``move``) puts it aside as
    ``checkpoint.damaged`` and writes a good one; a non-chief only reads, and leaves it."""
    reason = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    if move:
        store.remove(STATE + ".damaged")
        store.replace(STATE, STATE + ".damaged")
    log.warning("checkpoint.state_damaged", path=store.path(STATE), reason=reason, moved=move)
    return store.path(STATE), reason
