"""``asupervisor run --local-dir``: the local tier of checkpoints for every child it starts.

The children's sessions read it from their environment (a ``Supervisor`` given no
``local_tier`` of its own turns one on from ``ASUPERVISOR_LOCAL_DIR``, with
``ASUPERVISOR_LOCAL_SAVE_SECS`` for its interval); the runner only checks it, early, and
passes it on. It is checked here, not by the first child that would fail on it: a
directory that cannot be one is a command-line error (one line, exit 2), not a crash
loop of children.
"""

from __future__ import annotations

import math
import os

from .._checkpointing.tiers import ENV_DIR as ENV_LOCAL_DIR
from .._checkpointing.tiers import ENV_SAVE_SECS as ENV_LOCAL_SAVE_SECS
from .._checkpointing.tiers import tier_name
from .._logdir.store import is_object_store

__all__ = ["ENV_LOCAL_DIR", "ENV_LOCAL_SAVE_SECS", "checked_local_dir", "checked_save_secs",
           "local_tier_env", "tier_dirs"]  # fmt: skip


def checked_local_dir(path: str, logdir: str | None) -> str:
    """``path`` as an absolute directory on this host where the children can save (it
    exists and is writable, or can be made under a writable directory), apart from the
    logdir; else ``ValueError`` saying why. Absolute: a child may start elsewhere (a
    task of a SLURM step, a process that changes its directory)."""
    if not path:
        raise ValueError("is empty: give a directory on this host (local SSD, /dev/shm)")
    if "\0" in path:
        raise ValueError("holds a NUL character")
    if is_object_store(path):
        raise ValueError(
            f"{path!r} is an object store: the local tier is a directory on this host "
            "(local SSD, /dev/shm); the object store is the logdir, which the mirror copies to"
        )
    absolute = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    existing = absolute
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is" if existing == absolute else f"would be under {existing!r}, which is"
        raise ValueError(f"{path!r} {where} not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "" if existing == absolute else f" (it would be made in {existing!r})"
        raise ValueError(f"{path!r} is not writable by this user{what}")
    if logdir and not is_object_store(logdir):
        mine, theirs = os.path.realpath(absolute), os.path.realpath(logdir)
        if mine == theirs or _inside(mine, theirs) or _inside(theirs, mine):
            raise ValueError(
                f"{path!r} overlaps the logdir {logdir!r}: the local tier must be a "
                "directory of its own (a restart on a new host has the logdir, not it)"
            )
    return absolute


def _inside(path: str, directory: str) -> bool:
    return path.startswith(directory.rstrip(os.sep) + os.sep)


def checked_save_secs(text: str) -> float:
    """``--local-save-secs``: a number of seconds > 0; else ``ValueError``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"must be a number of seconds > 0, not {text!r}")
    return value


def local_tier_env(local_dir: str | None, save_secs: float | None) -> dict[str, str]:
    """What a child's environment gets for the local tier (nothing when it is off: an
    environment the runner was given passes on as it is)."""
    env: dict[str, str] = {}
    if local_dir is not None:
        env[ENV_LOCAL_DIR] = local_dir
        if save_secs is not None:
            env[ENV_LOCAL_SAVE_SECS] = repr(save_secs)
    return env


def tier_dirs(local_dir: str | None, logdirs: list[str]) -> list[str]:
    """The local tier's directory of each logdir (the sessions save under ``local_dir``
    in a directory per logdir): where an attempt's commits are on this host before the
    mirror has copied them to the logdir."""
    if local_dir is None:
        return []
    found = [os.path.join(local_dir, tier_name(logdir)) for logdir in logdirs]
    return [directory for directory in found if os.path.isdir(directory)]  # none: no save
