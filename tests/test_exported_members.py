"""The public API is exactly what the contract names, and nothing else leaks."""

from __future__ import annotations

import enum
import traceback
import types

import asupervisor
import asupervisor.hooks
import asupervisor.services


def test_all_is_exactly_the_public_namespace() -> None:
    """Derived from the namespace, not a literal list: a name that leaks out of
    ``__init__`` (an import, a helper) fails here as surely as a missing one."""
    public = {
        name
        for name, value in vars(asupervisor).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    modules = {
        name
        for name, value in vars(asupervisor).items()
        if isinstance(value, types.ModuleType) and not name.startswith("_")
    }
    # The subpackages users reach as asv.hooks and asv.services; `cli` appears only
    # once something imported it (the command line's own module).
    assert {"hooks", "services"} <= modules <= {"hooks", "services", "cli"}
    assert set(asupervisor.__all__) == public | {"hooks", "services", "__version__"}


def test_public_names_say_asupervisor_not_their_private_module() -> None:
    for name in asupervisor.__all__:
        member = getattr(asupervisor, name)
        if isinstance(member, enum.EnumMeta):
            assert member.__module__ == "asupervisor", name
        elif isinstance(member, type):
            assert member.__module__ == "asupervisor", name
            assert repr(member) == f"<class 'asupervisor.{name}'>"
    error = asupervisor.CheckpointSaveError("disk full")
    line = traceback.format_exception_only(type(error), error)[-1]
    assert line.startswith("asupervisor.CheckpointSaveError: disk full")


def test_hooks_and_services_come_with_the_package() -> None:
    import subprocess
    import sys

    code = (
        "import asupervisor as asv; "
        "print(asv.hooks.StopAtStepHook.__name__, asv.services.CheckpointService.__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        timeout=120,
    )
    assert done.stdout.split() == ["StopAtStepHook", "CheckpointService"], done.stderr


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
        asupervisor.SessionStopped,
    ]
    for error in errors:
        assert issubclass(error, asupervisor.SupervisorError)
    assert issubclass(asupervisor.GracePeriodExpired, RuntimeError)
    assert issubclass(asupervisor.WaitTimeout, TimeoutError)
    assert issubclass(asupervisor.SessionStopped, RuntimeError)
