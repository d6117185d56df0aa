"""Two tiers of checkpoints: a directory on the host the session saves to often, and the
logdir (``gs://...`` or any path) a background mirror copies those saves to.

- ``LocalTier`` is the user's setting (public); ``from_env`` reads the one
  ``asupervisor run --local-dir`` gives its children.
- The local tier of a logdir is a directory of its own under the one given
  (``<directory>/<logdir's last part>-<hash of the logdir>``): two runs on one host never
  mix, and a restart of the same run on the same host finds its saves again.
- It holds checkpoints and a history of its own (``.asupervisor.history``: the same
  format as a logdir's, written by the same code), with retention of its own (the newest
  ``keep``, and whatever the mirror is copying). The logdir's history stays the run's
  record: the mirror commits each copy there, so retention, ``KeepBest``, the evaluator
  and rollbacks see the commits they always saw (``mirror.py``).
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import Any

ENV_DIR = "ASUPERVISOR_LOCAL_DIR"  # set by `asupervisor run --local-dir DIR`
ENV_SAVE_SECS = "ASUPERVISOR_LOCAL_SAVE_SECS"  # and --local-save-secs S


@dataclass(frozen=True)
class LocalTier:
    """Checkpoints saved to a directory on the host (a local SSD, ``/dev/shm``) every
    ``save_secs`` seconds or ``save_steps`` steps, and mirrored to the logdir in the
    background: every ``mirror_every``-th local commit (and the final one). The local
    tier keeps its newest ``keep`` commits. See ``docs/checkpoints.md``."""

    directory: str | os.PathLike[str]
    save_secs: float | None = 10.0
    save_steps: int | None = None
    keep: int = 2
    mirror_every: int = 1

    def __post_init__(self) -> None:
        directory = self.directory
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ValueError(f"directory must be a local path, not {directory!r}")
        path = os.fspath(directory)
        if not isinstance(path, str) or "\x00" in path:
            raise ValueError(f"directory must be a text path without NUL, not {directory!r}")
        if "://" in path:
            raise ValueError(
                f"directory must be a path on the host (local SSD, /dev/shm), not {path!r}: "
                "the object store is the logdir, behind the local tier"
            )
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"directory {path!r} exists and is not a directory")
        object.__setattr__(self, "directory", path)
        secs = self.save_secs
        if secs is not None:
            if isinstance(secs, bool) or not isinstance(secs, numbers.Real):
                raise ValueError(f"save_secs must be a number > 0 or None, not {secs!r}")
            if not math.isfinite(float(secs)) or float(secs) <= 0:
                raise ValueError(f"save_secs must be a finite number > 0 or None, not {secs!r}")
            object.__setattr__(self, "save_secs", float(secs))
        object.__setattr__(self, "save_steps", _positive_int("save_steps", self.save_steps, True))
        if secs is None and self.save_steps is None:
            raise ValueError("save_secs and save_steps are both None: the local tier never saves")
        object.__setattr__(self, "keep", _positive_int("keep", self.keep, False))
        object.__setattr__(self, "mirror_every", _positive_int("mirror_every", self.mirror_every))

    @property
    def path(self) -> str:
        """The directory as a ``str``."""
        return os.fspath(self.directory)

    def tier_dir(self, logdir: str) -> str:
        """The local tier of ``logdir``: a directory of its own under ``directory``."""
        return os.path.join(self.path, tier_name(logdir))


def _positive_int(name: str, value: Any, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        what = "a positive int or None" if optional else "an int >= 1"
        raise ValueError(f"{name} must be {what}, not {value!r}")
    return int(value)


def tier_name(logdir: str) -> str:
    """``<the logdir's last part>-<12 hex digits of its hash>``: readable, and one per
    logdir (a relative local logdir is hashed as its absolute path)."""
    full = logdir if "://" in logdir else os.path.abspath(logdir)
    full = full.rstrip("/") or full
    last = re.sub(r"[^A-Za-z0-9._-]", "_", full.rsplit("/", 1)[-1])[:40] or "logdir"
    return f"{last}-{hashlib.sha256(full.encode()).hexdigest()[:12]}"


def from_env() -> LocalTier | None:
    """The local tier ``asupervisor run --local-dir`` asks of its children, if any."""
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return None
    secs = os.environ.get(ENV_SAVE_SECS)
    try:
        return LocalTier(directory, save_secs=float(secs) if secs else 10.0)
    except ValueError as exc:
        raise ValueError(f"{ENV_DIR}={directory!r} / {ENV_SAVE_SECS}={secs!r}: {exc}") from None
