"""The standard services, installed as ``asupervisor.services``.

Each is a plain object with ``name`` and ``async def run(self, sess)``: the
Supervisor wires them into every session; users may start their own copies
with ``sess.start_service(...)``.
"""

from __future__ import annotations

from .checkpoint import CheckpointService
from .loop import LoopService
from .progress import ProgressService
from .step_counter import StepCounterService
from .summary import SummaryService
from .watchdog import WatchdogService

__all__ = [
    "CheckpointService",
    "LoopService",
    "ProgressService",
    "StepCounterService",
    "SummaryService",
    "WatchdogService",
]
