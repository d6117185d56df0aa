"""asupervisor: an asyncio supervisor for long TensorFlow 2 training runs.

The public API is what this module exports; everything in ``_*`` modules is
private. Standard hooks live in :mod:`asupervisor.hooks`, standard services in
:mod:`asupervisor.services`.
"""

from __future__ import annotations

from ._checkpoints import RestoreReport
from ._coordinator import Coordinator
from ._errors import (
    CheckpointMismatchError,
    CheckpointSaveError,
    GracePeriodExpired,
    LogdirLockedError,
    NanLossError,
    StepTimeout,
    SupervisorError,
    WaitTimeout,
)
from ._hooks import Hook, RunContext
from ._services import Service
from ._session import ManagedSession
from ._supervisor import Supervisor

__version__ = "0.1.0"

__all__ = [
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "Coordinator",
    "GracePeriodExpired",
    "Hook",
    "LogdirLockedError",
    "ManagedSession",
    "NanLossError",
    "RestoreReport",
    "RunContext",
    "Service",
    "StepTimeout",
    "Supervisor",
    "SupervisorError",
    "WaitTimeout",
    "__version__",
]
