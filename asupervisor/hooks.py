"""The standard hooks: stop at a step, stop on NaN, log every so often."""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import Hook, NanLossError, RunContext, logger

if TYPE_CHECKING:
    from . import ManagedSession

__all__ = ["Hook", "LoggingHook", "NanLossHook", "RunContext", "StopAtStepHook"]


class StopAtStepHook(Hook):
    """Stop once the global step reaches ``last_step`` (or ``num_steps`` past the start).

    ``num_steps`` counts from each session's start, so every resume or restart (by
    ``asupervisor run`` too) trains that many more; ``last_step`` is a limit of the run
    that a restarted process keeps: use it in a script that may be restarted."""

    def __init__(self, num_steps: int | None = None, last_step: int | None = None) -> None:
        _exactly_one(num_steps=num_steps, last_step=last_step)
        self._num_steps = _whole("num_steps", num_steps, minimum=1)
        self.last_step: int | None = _whole("last_step", last_step, minimum=0)

    def after_create_session(self, session: ManagedSession) -> None:
        if self._num_steps is not None:
            self.last_step = session.global_step + self._num_steps
        self._check(session)

    def after_run(self, ctx: RunContext, result: Any) -> None:
        self._check(ctx.session)

    def _check(self, session: ManagedSession) -> None:
        if self.last_step is not None and session.global_step >= self.last_step:
            session.request_stop(reason="step_limit")


def _exactly_one(**named: object) -> None:
    given = [name for name, value in named.items() if value is not None]
    if len(given) != 1:
        names = " or ".join(named)
        raise ValueError(f"give exactly one of {names}, not {' and '.join(given) or 'neither'}")


def _whole(name: str, value: Any, *, minimum: int) -> int | None:
    """An int (numpy's too) ``>= minimum``, or ``None``."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum
    ):
        raise ValueError(f"{name} must be an int >= {minimum} or None, not {value!r}")
    return None if value is None else int(value)


def _loss_of(result: Any) -> Any:
    if isinstance(result, Mapping):
        return result.get("loss")
    return result


class NanLossHook(Hook):
    """Fail (``NanLossError``) or stop (reason ``nan``) when a step's loss is NaN."""

    def __init__(self, fail_on_nan: bool = True) -> None:
        if not isinstance(fail_on_nan, bool):
            raise ValueError(f"fail_on_nan must be True or False, not {fail_on_nan!r}")
        self.fail_on_nan = fail_on_nan

    def after_run(self, ctx: RunContext, result: Any) -> None:
        loss = _loss_of(result)
        if loss is None or not math.isnan(float(loss)):
            return
        message = f"NaN loss at global step {ctx.session.global_step}"
        if self.fail_on_nan:
            raise NanLossError(message)
        logger.error("step.nan", step=ctx.session.global_step)
        ctx.session.request_stop(reason="nan")


class LoggingHook(Hook):
    """Log the step and its result (``step.logged``) every N steps or every N seconds."""

    def __init__(self, every_n_steps: int | None = None, every_n_secs: float | None = None) -> None:
        _exactly_one(every_n_steps=every_n_steps, every_n_secs=every_n_secs)
        self._every_steps = _whole("every_n_steps", every_n_steps, minimum=1)
        if every_n_secs is not None and (
            isinstance(every_n_secs, bool)
            or not isinstance(every_n_secs, numbers.Real)
            or not 0 < every_n_secs < math.inf
        ):
            raise ValueError(f"every_n_secs must be a number > 0, not {every_n_secs!r}")
        self._every_secs = None if every_n_secs is None else float(every_n_secs)
        self._last_time = -math.inf
        self._last_step: int | None = None

    def after_run(self, ctx: RunContext, result: Any) -> None:
        step, now = ctx.session.global_step, time.monotonic()
        if self._every_steps is not None:
            due = self._last_step is None or step - self._last_step >= self._every_steps
        else:
            due = now - self._last_time >= (self._every_secs or 0.0)
        if due:
            self._last_step, self._last_time = step, now
            logger.info("step.logged", step=step, **_loggable(result))


def _loggable(result: Any) -> dict[str, Any]:
    values = result if isinstance(result, Mapping) else {"result": result}
    out: dict[str, Any] = {}
    for key, value in values.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            out[str(key)] = repr(value)
    return out
