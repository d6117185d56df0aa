"""The public API is exactly what the contract names, and nothing else leaks."""

from __future__ import annotations

import asupervisor
import asupervisor.hooks
import asupervisor.services


def test_top_level_names_are_pinned() -> None:
    assert asupervisor.__all__ == [
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
    for name in asupervisor.__all__:
        member = getattr(asupervisor, name)
        if name != "__version__":
            assert member.__module__.startswith("asupervisor."), name


def test_all_is_sorted_everywhere() -> None:
    for module in (asupervisor, asupervisor.hooks, asupervisor.services):
        assert module.__all__ == sorted(module.__all__), module.__name__


def test_hooks_and_services_modules() -> None:
    assert asupervisor.hooks.__all__ == [
        "Hook",
        "LoggingHook",
        "NanLossHook",
        "RunContext",
        "StopAtStepHook",
    ]
    assert asupervisor.services.__all__ == [
        "CheckpointService",
        "LoopService",
        "ProgressService",
        "StepCounterService",
        "SummaryService",
        "WatchdogService",
    ]


def test_every_error_is_a_supervisor_error() -> None:
    errors = [
        asupervisor.GracePeriodExpired,
        asupervisor.CheckpointMismatchError,
        asupervisor.CheckpointSaveError,
        asupervisor.LogdirLockedError,
        asupervisor.WaitTimeout,
        asupervisor.NanLossError,
        asupervisor.StepTimeout,
    ]
    for error in errors:
        assert issubclass(error, asupervisor.SupervisorError)
    assert issubclass(asupervisor.GracePeriodExpired, RuntimeError)
    assert issubclass(asupervisor.WaitTimeout, TimeoutError)
