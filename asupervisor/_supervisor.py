"""Supervisor: the validated, fixed configuration of a supervised run, and its sessions.

The Supervisor is the composition root: the one place that turns its arguments
into the standard services and wires them into a session. It holds settings
only; everything that lives for one session belongs to that session's runtime.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from . import _validate as check
from ._checkpointing import tiers as _tiers
from ._checkpointing.root import user_checkpoint
from ._checkpointing.tiers import LocalTier
from ._cluster import Role, multi_worker_role
from ._logdir.retention import KeepBest
from ._logdir.store import is_object_store, no_file_system, unreachable
from ._session.coordinator import Coordinator, SessionCoordinator
from ._session.managed import ManagedSession
from ._session.services import Registration, register
from ._session.signals import check_stop_signals
from ._training.divergence import Rollback
from ._training.hooks import Hook

if TYPE_CHECKING:
    import tensorflow as tf

    from ._session.runtime import SessionRuntime

ServiceFn = Callable[[ManagedSession], Any]


class Supervisor:
    """Supervises long TensorFlow training: checkpoints, summaries, services, stops.

    See the README and the API contract for every argument. Settings are checked
    here, once, and a bad one raises ``ValueError`` naming it; afterwards they are
    fixed (assigning one raises ``AttributeError``): make a new Supervisor instead.
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str] | None,
        *,
        checkpoint: tf.train.Checkpoint | Mapping[str, Any] | None = None,
        global_step: Any = None,
        is_chief: bool | None = True,
        strategy: tf.distribute.Strategy | None = None,
        init_fn: Callable[[], Any] | None = None,
        save_model_secs: float = 600,
        save_model_steps: int | None = None,
        checkpoint_basename: str = "model.ckpt",
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        async_checkpoint: bool = False,
        save_summaries_secs: float = 120,
        save_summaries_steps: int | None = None,
        summary_fn: Callable[[], Mapping[str, Any]] | None = None,
        stop_grace_secs: float = 120,
        recovery_wait_secs: float = 30,
        recoverable_errors: tuple[type[BaseException], ...] | None = None,
        max_recoveries: int = 3,
        handle_signals: bool = True,
        stop_signals: Iterable[signal.Signals | int | str] = (signal.SIGTERM, signal.SIGINT),
        hooks: Iterable[Hook] = (),
        summary_writer: Any = "auto",
        step_timeout_secs: float | None = None,
        keep_best: KeepBest | None = None,
        on_divergence: Rollback | str | None = None,
        heartbeat_secs: float = 2.0,
        local_tier: LocalTier | None = None,
    ) -> None:
        self.logdir = _check_logdir(logdir)
        self.strategy, self.role = _find_strategy(strategy)
        self.is_chief = _check_is_chief(is_chief, self.strategy, self.role)
        self.init_fn = check.optional_callable("init_fn", init_fn)
        self.save_model_secs = check.non_negative("save_model_secs", save_model_secs)
        self.save_model_steps = check.optional_positive_int("save_model_steps", save_model_steps)
        self.checkpoint_basename = _check_basename(checkpoint_basename)
        self.max_to_keep = check.optional_positive_int("max_to_keep", max_to_keep)
        self.keep_checkpoint_every_n_hours = check.optional_positive(
            "keep_checkpoint_every_n_hours", keep_checkpoint_every_n_hours
        )
        self.async_checkpoint = check.boolean("async_checkpoint", async_checkpoint)
        self.save_summaries_secs = check.non_negative("save_summaries_secs", save_summaries_secs)
        self.save_summaries_steps = check.optional_positive_int(
            "save_summaries_steps", save_summaries_steps
        )
        self.summary_fn = check.optional_callable("summary_fn", summary_fn)
        self.stop_grace_secs = check.non_negative("stop_grace_secs", stop_grace_secs)
        self.recovery_wait_secs = check.positive("recovery_wait_secs", recovery_wait_secs)
        self.recoverable_errors = _check_error_types(recoverable_errors)
        self.max_recoveries = check.non_negative_int("max_recoveries", max_recoveries)
        self.handle_signals = check.boolean("handle_signals", handle_signals)
        self.stop_signals = check_stop_signals(stop_signals)
        self.hooks = _check_hooks(hooks)
        self._summary_writer_arg = _check_summary_writer(summary_writer, summary_fn, self.logdir)
        self.step_timeout_secs = check.optional_positive("step_timeout_secs", step_timeout_secs)
        self.keep_best = _check_keep_best(keep_best, self.async_checkpoint, self.logdir)
        self.on_divergence = _check_divergence(on_divergence)
        self.heartbeat_secs = check.non_negative("heartbeat_secs", heartbeat_secs)
        self.local_tier = _check_local_tier(local_tier, self.logdir, self.keep_best)
        self.global_step, self.owns_global_step = _make_global_step(global_step)
        # The user's checkpoint object, read at each save (what it holds *then* is saved).
        self.checkpoint = user_checkpoint(checkpoint, self.global_step)
        self._services: list[Registration] = []
        self._coord = SessionCoordinator()  # one for the Supervisor's life, as TF1's sv.coord
        self._runtime: SessionRuntime | None = None  # the open session's, else the last one's
        self._open = False
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and getattr(self, "_frozen", False):
            raise AttributeError(
                f"Supervisor.{name} is fixed at construction (it was validated then); "
                "make a new Supervisor with the setting you want"
            )
        object.__setattr__(self, name, value)

    # -- what a session is made of -----------------------------------------

    @property
    def coord(self) -> Coordinator:
        """The Supervisor's one coordinator: taken before a session, it is that session's
        (each session starts with its stop cleared)."""
        return self._coord

    @property
    def checkpointing(self) -> bool:
        """Whether this process saves checkpoints: a chief with somewhere to write,
        or any worker of a multi-worker job (the non-chiefs into a scratch directory,
        because the strategy's collectives need every worker in every save)."""
        return (
            (self.is_chief or self.role is not None)
            and self.logdir is not None
            and (
                self.save_model_secs > 0
                or self.save_model_steps is not None
                or self.local_tier is not None
            )
        )

    @property
    def save_steps(self) -> int | None:
        """Save every this many steps: the local tier's interval when there is one."""
        tier = self.local_tier
        return self.save_model_steps if tier is None else tier.save_steps

    @property
    def save_secs(self) -> float:
        """Save every this many seconds (0: never): the local tier's when there is one."""
        tier = self.local_tier
        return self.save_model_secs if tier is None else (tier.save_secs or 0.0)

    @property
    def given_summary_writer(self) -> tf.summary.SummaryWriter | None:
        """The writer passed as ``summary_writer=``, if one was."""
        arg = self._summary_writer_arg
        return None if arg in ("auto", None) else arg

    @property
    def writes_summaries(self) -> bool:
        arg = self._summary_writer_arg
        return arg not in ("auto", None) or (
            arg == "auto" and self.logdir is not None and self.is_chief
        )

    @property
    def summary_writer(self) -> tf.summary.SummaryWriter | None:
        """The writer of the open session's events file (or the one given), else ``None``."""
        rt = self._runtime
        if self._open and rt is not None and rt.events.writer is not None:
            return rt.events.writer
        return self.given_summary_writer

    def _registrations(self, standard: bool) -> list[Registration]:
        from .services import StepCounterService, SummaryService, WatchdogService

        # Timed saves are no service: TF's rule is a save at the end of the first step
        # past the deadline, which only the training thread sees (_training/steps.py).
        regs = []
        if standard and self.writes_summaries and self.save_summaries_secs > 0:
            summary = SummaryService(self.save_summaries_secs, self.summary_fn)
            regs.append(register(summary, on_error="restart"))
            counter = StepCounterService(self.save_summaries_secs, tag=self.rate_tag)
            regs.append(register(counter, on_error="restart"))
        if standard and self.step_timeout_secs is not None:
            regs.append(register(WatchdogService(self.step_timeout_secs)))
        return [*regs, *self._services]

    @property
    def rate_tag(self) -> str:
        """The step counter's tag: ``global_step/sec``, or named after the user's step
        variable, as TF does."""
        if self.owns_global_step:
            return "global_step/sec"
        name = str(getattr(self.global_step, "name", "global_step")).split(":")[0]
        return f"{name}/sec"

    # -- services -----------------------------------------------------------

    def service(
        self, fn: ServiceFn | None = None, /, *, on_error: str = "stop", max_restarts: int = 3
    ) -> Any:
        """Decorator: run ``async def fn(sess)`` as a service in every session; returns ``fn``.

        Bare (``@sv.service``) or with a policy (``@sv.service(on_error="restart")``).
        """

        def decorate(fn: ServiceFn) -> ServiceFn:
            self.add_service(fn, on_error=on_error, max_restarts=max_restarts)
            return fn

        return decorate if fn is None else decorate(fn)

    def add_service(self, service: Any, *, on_error: str = "stop", max_restarts: int = 3) -> None:
        """Run ``service`` (a Service or a coroutine function) in every session."""
        self._services.append(register(service, on_error=on_error, max_restarts=max_restarts))

    def loop(
        self, interval_secs: float, target: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> None:
        """In every session, call ``target`` at once and then every ``interval_secs``."""
        self.add_service(loop_service(interval_secs, target, args, kwargs))

    # -- stopping -----------------------------------------------------------

    def should_stop(self) -> bool:
        return self._coord.should_stop()

    def request_stop(self, exc: BaseException | None = None) -> None:
        self._coord.request_stop(exc)

    # -- the session ----------------------------------------------------------

    @asynccontextmanager
    async def session(
        self,
        *,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = 7200,
        start_standard_services: bool = True,
    ) -> AsyncIterator[ManagedSession]:
        """Restore or initialize, start the services, and yield the running session.

        Leaving the block stops everything gracefully: see the README.
        """
        from ._session.runtime import SessionRuntime

        check.boolean("wait_for_checkpoint", wait_for_checkpoint)
        check.non_negative("max_wait_secs", max_wait_secs)
        check.boolean("start_standard_services", start_standard_services)
        if self._open:
            raise RuntimeError("this Supervisor already has an open session")
        # Timed saves are a standard service of TF1's, though they run on the training thread.
        runtime = SessionRuntime(self, self._coord, timed_saves=start_standard_services)
        self._runtime, self._open = runtime, True
        regs = self._registrations(start_standard_services)
        try:
            async with runtime.running(wait_for_checkpoint, max_wait_secs, regs) as sess:
                yield sess
        finally:
            self._open = False


def loop_service(
    interval_secs: float, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    from .services import LoopService

    return LoopService(interval_secs, target, args, kwargs)


def _check_logdir(logdir: Any) -> str | None:
    if logdir is None:
        return None
    if not isinstance(logdir, (str, os.PathLike)) or not os.fspath(logdir):
        raise ValueError(f"logdir must be a path or None, not {logdir!r}")
    path = os.fspath(logdir)
    if not isinstance(path, str):
        raise ValueError(f"logdir must be a text path, not {logdir!r}")
    if "\x00" in path:  # no file system takes it: refused here, not at the first write
        raise ValueError(f"logdir {path!r} contains a NUL character")
    if is_object_store(path):
        return _check_object_store(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"logdir {path!r} exists and is not a directory")
    _check_parents(path)
    return path


def _check_parents(path: str) -> None:
    """A local logdir is made at the session's start: the nearest of its parents that
    exists must be a directory, or it never can be (checked on disk, never on a store)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        above = os.path.dirname(parent)
        if above == parent:
            return
        parent = above
    if not os.path.isdir(parent):
        raise ValueError(f"logdir {path!r} cannot be made: {parent!r} is a file")


def _check_object_store(path: str) -> str:
    """A ``gs://``, ``s3://``... logdir: its scheme must be a file system TF has."""
    import tensorflow as tf

    try:
        if tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path):
            raise ValueError(f"logdir {path!r} exists and is not a directory")
    except tf.errors.UnimplementedError as exc:
        raise ValueError(no_file_system(path)) from exc
    except tf.errors.OpError as exc:
        if (instead := unreachable(path, exc)) is None:
            raise
        raise instead from None  # TF's text is in the line; its traceback is TF's
    return path.rstrip("/")


def _find_strategy(strategy: Any) -> tuple[Any, Role | None]:
    """The strategy given, else the one in scope; and this process's role in its job."""
    import tensorflow as tf

    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        raise ValueError(f"strategy must be a tf.distribute.Strategy or None, not {strategy!r}")
    return strategy, (multi_worker_role(strategy) if strategy is not None else None)


def _check_is_chief(is_chief: Any, strategy: Any, role: Role | None) -> bool:
    if is_chief is None:
        if strategy is None:
            raise ValueError(
                "is_chief=None takes the role from a MultiWorkerMirroredStrategy (TF_CONFIG), "
                "but none was given (strategy=) or is in scope; pass True or False"
            )
        return role is None or role.is_chief
    chief = check.boolean("is_chief", is_chief)
    if role is not None and chief != role.is_chief:
        raise ValueError(
            f"is_chief={chief} contradicts TF_CONFIG, which makes this process "
            f"{role.name}, {'the chief' if role.is_chief else 'not the chief'} of "
            f"{role.num_workers} workers; pass is_chief=None"
        )
    return chief


def _check_basename(basename: Any) -> str:
    if not isinstance(basename, str) or not basename:
        raise ValueError(f"checkpoint_basename must be a non-empty file name, not {basename!r}")
    if basename in (".", "..") or "/" in basename or os.sep in basename:
        raise ValueError(
            f"checkpoint_basename must be a file name inside the logdir, not a path: {basename!r}"
        )
    if not basename.isprintable():
        # A NUL ends the name where the file system reads it: the files would be
        # written under another name than the one looked for at the next start.
        raise ValueError(f"checkpoint_basename must be printable characters only, not {basename!r}")
    if any(c in basename for c in "*?[]"):
        # tf.train.latest_checkpoint globs `<prefix>.index`: `m[1]` would never be found.
        raise ValueError(
            f"checkpoint_basename {basename!r} has a glob character (* ? [ ]); "
            "TensorFlow looks checkpoints up by pattern, and would not find it"
        )
    return basename


def _check_keep_best(keep_best: Any, async_checkpoint: bool, logdir: str | None) -> KeepBest | None:
    if keep_best is None:
        return None
    if not isinstance(keep_best, KeepBest):
        raise ValueError(
            f"keep_best must be an asupervisor.KeepBest or None, not {keep_best!r} "
            "(e.g. asv.KeepBest('val_loss', mode='min'))"
        )
    if keep_best.export is not None and async_checkpoint:
        # A background write commits steps later, when the model has moved on.
        raise ValueError(
            "keep_best=KeepBest(export=...) needs async_checkpoint=False: an export is "
            "written when its checkpoint is committed, with the model in that state"
        )
    if keep_best.export is not None and logdir is not None and is_object_store(logdir):
        # Its directory is renamed into place whole; an object store has no such rename.
        raise ValueError(
            f"keep_best=KeepBest(export=...) needs a local or mounted logdir, not "
            f"{logdir!r}: an object store cannot rename a directory, so an export "
            "there could be read half-written"
        )
    return keep_best


def _check_local_tier(
    tier: Any, logdir: str | None, keep_best: KeepBest | None
) -> LocalTier | None:
    """The local tier given, else the one ``asupervisor run --local-dir`` asks of its
    children (``ASUPERVISOR_LOCAL_DIR``); ``None`` where it cannot serve."""
    given = tier is not None
    if given and not isinstance(tier, LocalTier):
        raise ValueError(
            f"local_tier must be an asupervisor.LocalTier or None, not {tier!r} "
            "(e.g. asv.LocalTier('/dev/shm/ckpt'))"
        )
    chosen: LocalTier | None = tier if given else _tiers.from_env()
    if chosen is None:
        return None
    if logdir is None:
        if given:
            raise ValueError("local_tier needs a logdir: the mirror copies the local saves there")
        return None
    if keep_best is not None and keep_best.export is not None:
        if given:
            raise ValueError(
                "local_tier with keep_best=KeepBest(export=...): an export is written when "
                "its checkpoint is committed, with the model in that state; local saves "
                "are written in the background, committed steps later"
            )
        return None
    # In a multi-worker job every worker keeps the tier: its intervals are the job's (the
    # saves are taken together), and a non-chief looks for the chief's local commit in its
    # own tier when the job agrees on its restore (_session/startup.py).
    return chosen


def _check_divergence(policy: Any) -> Rollback | None:
    if policy == "rollback":
        return Rollback()
    if policy is not None and not isinstance(policy, Rollback):
        raise ValueError(
            f"on_divergence must be 'rollback', an asupervisor.Rollback or None, not {policy!r}"
        )
    return policy


def _check_error_types(types: Any) -> tuple[type[BaseException], ...]:
    if types is None:
        import tensorflow as tf

        return (tf.errors.AbortedError, tf.errors.UnavailableError)
    types = tuple(types) if isinstance(types, (tuple, list)) else types
    if not isinstance(types, tuple) or not all(
        isinstance(t, type) and issubclass(t, BaseException) for t in types
    ):
        raise ValueError(f"recoverable_errors must be a tuple of exception classes, not {types!r}")
    return types


def _check_hooks(hooks: Any) -> tuple[Hook, ...]:
    if isinstance(hooks, Hook) or not isinstance(hooks, Iterable) or isinstance(hooks, str):
        raise ValueError(
            f"hooks must be a list (or tuple) of asupervisor.Hook instances, not {hooks!r}"
        )
    checked: tuple[Hook, ...] = tuple(hooks)
    for hook in checked:
        if not isinstance(hook, Hook):
            raise ValueError(f"hooks must hold asupervisor.Hook instances, not {hook!r}")
    return checked


def _check_summary_writer(writer: Any, summary_fn: Any, logdir: str | None) -> Any:
    if writer not in ("auto", None):
        import tensorflow as tf

        if not isinstance(writer, tf.summary.SummaryWriter):
            raise ValueError(
                f"summary_writer must be 'auto', None or a tf.summary.SummaryWriter, not {writer!r}"
            )
    if summary_fn is not None and (writer is None or (writer == "auto" and logdir is None)):
        raise ValueError(
            "summary_fn is given but summaries are disabled "
            "(summary_writer=None, or logdir=None with summary_writer='auto')"
        )
    return writer


def _make_global_step(variable: Any) -> tuple[Any, bool]:
    import tensorflow as tf

    if variable is None:
        return tf.Variable(0, dtype=tf.int64, name="global_step", trainable=False), True
    try:
        dtype = tf.as_dtype(variable.dtype)
        is_scalar = tuple(variable.shape) == ()
        is_variable = hasattr(variable, "assign_add")
    except (AttributeError, TypeError):
        dtype, is_scalar, is_variable = None, False, False
    if not (dtype is not None and dtype.is_integer and is_scalar and is_variable):
        raise ValueError(f"global_step must be a scalar integer tf.Variable, not {variable!r}")
    if dtype not in (tf.int32, tf.int64):
        # A narrow step wraps around (int8: after 127 comes -128) and numbers the
        # checkpoints backwards: a restart resumes from the wrong one.
        raise ValueError(f"global_step must be an int32 or int64 variable, not {dtype.name}")
    return variable, False
