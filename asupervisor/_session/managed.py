"""ManagedSession: what the body of ``async with sv.session()`` works with.

A thin, public face over the session's runtime, which owns all of its state.
The standard services and hooks use nothing but what is public here, so a user
can write their own the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import anyio

from .._checkpointing.checkpointer import RestoreReport
from .._kinds import JobKind
from .._outcome import Outcome, StopReason, reason_of
from .._training.position import is_one_shot
from .._training.summaries import scalars
from .._training.thread import Job
from .._validate import optional_positive_int
from .services import register

if TYPE_CHECKING:
    from .._supervisor import Supervisor
    from .runtime import SessionRuntime


class ManagedSession:
    """A running supervised session. Create it with ``Supervisor.session()``."""

    def __init__(self, runtime: SessionRuntime) -> None:
        self._rt = runtime

    @property
    def supervisor(self) -> Supervisor:
        return self._rt.sv

    @property
    def restore_report(self) -> RestoreReport:
        """How the session began: restored, initialized, fresh, or interrupted."""
        return self._rt.restore_report

    # -- steps --------------------------------------------------------------------

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """One training step on the training thread, with hooks around it.

        Raises ``asv.SessionStopped`` once a stop was requested (leaving the session
        with it is a clean exit). When the data runs out (``OutOfRangeError`` or
        ``StopIteration`` from the step), the session stops cleanly and this raises
        ``tf.errors.OutOfRangeError``, which the session also takes as a clean exit.
        """
        rt = self._rt
        rt.check_not_stopped("run")
        job = Job(rt.stepper.run_step, (fn, args, kwargs), label=fn, kind=JobKind.STEP)
        return await rt.thread.run_job(job)

    async def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the training thread, at a step boundary, counting no step. The
        end of the data raised by ``fn`` stops the session cleanly, as from a step."""
        rt = self._rt
        return await rt.thread.run_job(Job(rt.user_job, (fn, *args), kwargs, label=fn))

    async def train(
        self,
        step_fn: Callable[..., Any],
        data: Iterable[Any] | Callable[[int], Iterable[Any]],
        *,
        epochs: int | None = None,
        max_steps: int | None = None,
        steps_per_loop: int = 1,
    ) -> int:
        """The fast path: run ``step_fn`` over ``data`` on the training thread, no hop per step.

        Each element is passed as ``step_fn(*element)`` if it is a tuple, else
        ``step_fn(element)``; hooks and step counting are as for ``run``. Returns
        the number of steps run, when ``data`` is exhausted (the session goes on:
        call it again for the next epoch), when a stop is requested, or after
        ``max_steps``. End of data raised inside a step stops the session (reason
        ``end_of_data``). Raises ``asv.SessionStopped`` if called after a stop.

        With ``epochs``, the epoch and the batch inside it are saved with every
        checkpoint, and a resumed run goes on at the same batch of the same epoch until
        ``epochs`` epochs are done. ``data`` is then iterated once per epoch, or called
        as ``data(epoch)`` if it is a function: a shuffled dataset must be one (with the
        epoch in its seed), so that a restart sees the same order again. An iterator
        (which runs out once) is refused with ``epochs``.

        With ``steps_per_loop`` K > 1, up to K steps run inside one ``tf.function``
        over the ``tf.data`` iterator (``data`` a ``tf.data.Dataset``, or a function
        of the epoch returning one): saves, hooks, the stop check and the queued jobs
        come at the boundaries of those calls; each step is counted, summarized and
        looked at for divergence at its own number.
        """
        checked = optional_positive_int("max_steps", max_steps)
        epochs = optional_positive_int("epochs", epochs)
        per_loop = optional_positive_int("steps_per_loop", steps_per_loop)
        if per_loop is None:
            raise ValueError("steps_per_loop must be a positive int, not None")
        if per_loop > 1 and not callable(data) and not _is_dataset(data):
            raise ValueError(
                "steps_per_loop > 1 runs the steps inside one tf.function over the data's "
                f"iterator: data must be a tf.data.Dataset (or a function of the epoch "
                f"returning one), not {type(data).__name__}"
            )
        if epochs is not None and is_one_shot(data):
            raise ValueError(
                "data is an iterator, which runs out after one epoch: with epochs= pass "
                "something iterated anew each epoch (a tf.data.Dataset, a list) or a "
                "function of the epoch that returns the epoch's data"
            )
        rt = self._rt
        rt.check_not_stopped("train")
        args = (step_fn, data, checked, epochs, per_loop)
        job = Job(rt.stepper.train_loop, args, label=step_fn, kind=JobKind.STEP)
        steps: int = await rt.thread.run_job(job)
        return steps

    async def fit(
        self,
        model: Any,
        data: Any,
        *,
        epochs: int,
        callbacks: Sequence[Any] = (),
        **fit_kwargs: Any,
    ) -> Any:
        """Keras ``model.fit(data, epochs=..., callbacks=...)`` under supervision; the History.

        One ``fit`` call for the whole run, from the saved position: your callbacks
        work as with ``fit`` itself (Keras' own stops, ``on_train_begin`` once, the
        History). It runs on the training thread; each batch is a supervised step (hooks,
        the global step, step schedules, saves between batches), and a stop ends it
        after the batch in flight. The epoch and the batch inside it are saved with
        every checkpoint: a resumed run goes on at the same batch. ``data`` is a
        ``tf.data.Dataset`` of batches, or a function ``epoch -> Dataset`` (a shuffled
        dataset must be one, seeded with the epoch). Other keyword arguments go to
        ``fit`` (``verbose``, ``validation_data``, ``steps_per_epoch`` ...).
        """
        from .._training.fit import check_data, fit

        positive = optional_positive_int("epochs", epochs)
        if positive is None:
            raise ValueError("epochs must be a positive int, not None")
        steps = optional_positive_int("steps_per_epoch", fit_kwargs.get("steps_per_epoch"))
        check_data(data, steps)
        for name in ("initial_epoch", "x", "y", "sample_weight", "validation_split"):
            if name in fit_kwargs:
                raise ValueError(f"{name}= cannot be given to sess.fit (see its docstring)")
        rt = self._rt
        if rt.agreement is not None:
            raise ValueError(
                "sess.fit cannot run in a multi-worker job: Keras 3's model.fit fails under "
                "MultiWorkerMirroredStrategy with more than one worker, with or without "
                "asupervisor (it converts PerReplica values to tensors; keras-team/keras#20585)."
                " Train with sess.train and a custom step, as examples/multiworker.py does"
            )
        fit_kwargs.setdefault("shuffle", False)  # a dataset is shuffled by itself, if at all
        rt.check_not_stopped("fit")
        args = (fit, rt, model, data, positive, tuple(callbacks), fit_kwargs)
        return await rt.thread.run_job(Job(rt.user_job, args, label=model.fit, kind=JobKind.STEP))

    @property
    def data_position(self) -> tuple[int, int]:
        """``(epoch, batch)``: where ``train(epochs=)`` or ``fit`` is in the data; saved
        with every checkpoint."""
        position = self._rt.position
        return position.epoch, position.batch

    async def save_checkpoint(self, metrics: Mapping[str, Any] | None = None) -> str | None:
        """A checkpoint of the state at the next step boundary; its path once its files are
        on disk (a background write is waited for here, not on the training thread).

        Whatever ``save_model_secs`` says: an explicit save always writes. The path of the
        checkpoint already there when no step ran since it. ``None`` on a process that
        writes no checkpoints (a non-chief, ``logdir=None``), and in a multi-worker job,
        where every worker saves after the next step (the request is agreed first).
        ``metrics`` are recorded with it (``asv.KeepBest`` keeps the best by one).
        """
        rt = self._rt
        job = Job(rt.checkpoints.explicit_save, (dict(metrics or {}),), kind=JobKind.SAVE)
        path: str | None = await rt.thread.run_job(job)
        checkpointer = rt.checkpointer
        if path is not None and checkpointer is not None and checkpointer.async_write:
            # Waited for here, in a worker thread: training goes on meanwhile.
            await anyio.to_thread.run_sync(checkpointer.wait_for_write)
            if checkpointer.fatal is not None or checkpointer.latest_committed() != path:
                return None  # the write failed (logged as checkpoint.failed)
        return path

    # -- what extensions read -------------------------------------------------

    @property
    def global_step(self) -> int:
        """The last known global step."""
        return self._rt.step.value

    @property
    def last_result(self) -> Any:
        """What the last step returned (``None`` before the first)."""
        return self._rt.stepper.last_result

    @property
    def last_scalars(self) -> dict[str, float]:
        """The last step's numeric results by name (``fit``: Keras' logs); a bare number
        is ``loss``. Reading it waits for the step's tensors."""
        return scalars(self._rt.stepper.last_result)

    def mean_scalars(self) -> dict[str, float]:
        """Training thread (``sess.call``): the steps' numeric results averaged since the
        last call, when the supervisor writes summaries from results (no ``summary_fn``);
        otherwise, and for ``fit`` (Keras' logs are already the epoch's running means),
        the last step's. Each call starts a new interval."""
        rt = self._rt
        return rt.summaries.step_means(rt.stepper.last_result)

    @property
    def first_step_done(self) -> tuple[int, float] | None:
        """``(global step, time.monotonic())`` when this session's first step ended, or
        ``None`` before it: rates measured from here leave out start-up and tracing."""
        return self._rt.stepper.first_done

    @property
    def last_save(self) -> tuple[int, float | None] | None:
        """The last checkpoint this session wrote or restored whole: ``(step,
        time.monotonic() when written)``; the time is ``None`` for a restored one.
        ``None`` if there is none. A failed save changes nothing here."""
        checkpointer = self._rt.checkpointer
        if checkpointer is None or checkpointer.last_saved_step is None:
            return None
        return checkpointer.last_saved_step, checkpointer.last_saved_at

    def job_in_flight(self) -> tuple[str, float] | None:
        """The work running on the training thread now, as ``(name, time.monotonic()
        when it began)``, or ``None`` when the thread is idle or held by
        ``between_steps``. A job of many steps (``train``, ``fit``) counts from the start
        of its current step; saves and calls count too."""
        flight = self._rt.thread.in_flight()
        if flight is None or flight.job.kind is JobKind.HOLD:
            return None
        return flight.job.name, flight.step_started_at

    def steps_in_call(self) -> int:
        """How many training steps the call running now makes (``train``'s
        ``steps_per_loop``; 1 for any other work): the step deadline scales by it."""
        return self._rt.thread.steps_in_call

    def step_in_flight(self) -> float | None:
        """``time.monotonic()`` when the training step running now began (a step of
        ``run``, ``train`` or ``fit``, fetching its batch included), or ``None`` when no
        training step runs: the thread idle or held, starting, saving, running a call,
        or in ``fit``'s validation or an epoch's end."""
        flight = self._rt.thread.in_flight()
        if flight is None or not flight.training:
            return None
        return flight.step_started_at

    def between_steps(self) -> AbstractAsyncContextManager[None]:
        """``async with``: the training thread is held at a step boundary meanwhile.

        Inside the block, run TensorFlow work with ``anyio.to_thread.run_sync``,
        not ``sess.call`` (the training thread is the one being held).
        """
        return self._rt.thread.hold()

    # -- stopping -----------------------------------------------------------

    def should_stop(self) -> bool:
        return self._rt.flag.stopped

    def request_stop(
        self, exc: BaseException | None = None, *, reason: StopReason | str = "requested"
    ) -> None:
        """Ask for a stop, from any thread; ``exc`` is re-raised at the end unless it
        says the data ran out. ``reason`` names a clean stop (``stop_reason``): one of
        ``asv.StopReason`` or a string of your own.

        In a multi-worker job a stop without an error is proposed to every worker:
        all stop together after the next step (each must keep stepping until then).
        """
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason must be a non-empty string, not {reason!r}")
        self._rt.report_stop(exc, reason_of(reason))

    async def sleep_until_stop(self, seconds: float) -> bool:
        """Sleep; ``True`` as soon as a stop is requested, ``False`` when the time is up."""
        return await self._rt.flag.wait(seconds)

    @property
    def stop_reason(self) -> StopReason | str | None:
        """Why the session was asked to stop: an ``asv.StopReason`` (a ``str``), or the
        string a ``request_stop(reason=...)`` gave; ``None`` while running."""
        return self._rt.flag.reason

    @property
    def outcome(self) -> Outcome | None:
        """How the session ended, once it has (after the ``async with`` block; ``None``
        before): ``asv.Outcome``, with the process exit status it calls for."""
        return self._rt.outcome

    # -- summaries ----------------------------------------------------------

    def summary_computed(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Write ``values`` into this run's events file at ``step`` (default: the global step).

        It writes where it is called: from async code, prefer
        ``await sess.call(sess.summary_computed, values)`` (file I/O, off the loop).
        On a process that writes no summaries (a non-chief, ``summary_writer=None``)
        it writes nothing and logs ``summary.disabled`` once.
        """
        self._rt.summaries.write(dict(values), step)

    # -- services -----------------------------------------------------------

    def loop(
        self, interval_secs: float, target: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> None:
        """Call ``target(*args, **kwargs)`` now, then every ``interval_secs``, until stop."""
        from .._supervisor import loop_service

        self.start_service(loop_service(interval_secs, target, args, kwargs))

    def start_service(self, service: Any, *, on_error: str = "stop", max_restarts: int = 3) -> None:
        """Start a service now, for this session only."""
        self._rt.start_service(register(service, on_error=on_error, max_restarts=max_restarts))


def _is_dataset(data: Any) -> bool:
    import tensorflow as tf

    return isinstance(data, tf.data.Dataset)
