"""asupervisor: an asyncio supervisor for long TensorFlow 2 training runs.

The public API is what this module exports; everything in ``_*`` modules is
private. Standard hooks live in ``asupervisor.hooks``, standard services in
``asupervisor.services``; both are imported with the package.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from ._checkpointing.checkpointer import RestoreReport
from ._checkpointing.tiers import LocalTier
from ._errors import (
    CheckpointMismatchError,
    CheckpointSaveError,
    DivergedError,
    GracePeriodExpired,
    LogdirLockedError,
    NanLossError,
    SessionClosed,
    SessionStopped,
    StepTimeout,
    StoreUnreachableError,
    SupervisorError,
    WaitTimeout,
)
from ._evaluate.evaluator import Evaluation, Evaluator
from ._exit import exit_status, run
from ._kinds import RestoreSource
from ._log import EventLogger
from ._log import log as logger
from ._logdir.retention import KeepBest
from ._outcome import Outcome, StopReason
from ._session.coordinator import Coordinator
from ._session.managed import ManagedSession
from ._session.services import Service
from ._supervisor import Supervisor
from ._training.divergence import Rollback
from ._training.hooks import Hook, RunContext

# One source of truth: the version in pyproject.toml, as installed.
try:
    __version__: str = _metadata.version("asupervisor")
except _metadata.PackageNotFoundError:  # pragma: no cover - a source tree never installed
    __version__ = "0+unknown"

__all__ = [
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "Coordinator",
    "DivergedError",
    "Evaluation",
    "Evaluator",
    "EventLogger",
    "GracePeriodExpired",
    "Hook",
    "KeepBest",
    "LocalTier",
    "LogdirLockedError",
    "ManagedSession",
    "NanLossError",
    "Outcome",
    "RestoreReport",
    "RestoreSource",
    "Rollback",
    "RunContext",
    "Service",
    "SessionClosed",
    "SessionStopped",
    "StepTimeout",
    "StopReason",
    "StoreUnreachableError",
    "Supervisor",
    "SupervisorError",
    "WaitTimeout",
    "__version__",
    "exit_status",
    "hooks",
    "logger",
    "run",
    "services",
]

# Public names say where users find them: `asupervisor.Supervisor`, not the private
# module it is defined in (tracebacks, reprs and docs show this name).
for _name in __all__:
    _obj = globals().get(_name)
    if isinstance(_obj, type) or callable(_obj):
        _obj.__module__ = __name__
del _name, _obj, _metadata, annotations  # not part of the API

from . import hooks, services  # noqa: E402  (they use the names above)
