"""What one session writes into TensorBoard from the training thread.

- **Step summaries** (``save_summaries_steps``, and the summary service's points):
  ``summary_fn``'s values, or the steps' numeric results averaged since the last point,
  at the global step, with the steps per second under the rate tag: in the session's
  own events file, the logdir's run, with plain tags (``loss``, ``global_step/sec``), as
  TF1's Supervisor, ``MonitoredTrainingSession`` and Estimator wrote them.
- **``fit``'s epoch logs**, as Keras' own ``TensorBoard`` callback writes them: one run
  per split, ``train/`` and ``validation/`` beside the session's file, each with
  ``epoch_<metric>`` at the epoch's index (``val_loss`` is ``epoch_loss`` of the
  validation run; the learning rate is ``epoch_learning_rate`` of the train run), so
  that the curves overlay a plain Keras run's. Keras also writes the validation metrics
  at the global step (``evaluation_<metric>_vs_iterations``); they are left out, as every
  point of these runs is at an epoch's index: a resumed session's ``SessionLog.START``
  at its first epoch drops what a crashed one wrote past it, and nothing else. Into a
  writer the user gave, which has no runs beside it, the logs go with the split in the
  name (``epoch_val_loss``), at the epoch's index.
- **Values written by hand** (``sess.summary_computed``), or a warning, once, that this
  session writes none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._log import log
from .._logdir.files import TRAIN_RUN, VALIDATION_RUN
from .means import ResultMeans
from .steps import GlobalStep
from .summaries import EventsFile, scalars

VALIDATION_PREFIX = "val_"  # what Keras calls a validation metric in its logs


def epoch_splits(logs: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """An epoch's logs by run, as Keras' TensorBoard callback splits them:
    ``{"train": {"loss": ...}, "validation": {"loss": ...}}`` (``val_`` taken off)."""
    splits: dict[str, dict[str, float]] = {TRAIN_RUN: {}, VALIDATION_RUN: {}}
    for name, value in scalars(logs).items():
        if name.startswith(VALIDATION_PREFIX):
            splits[VALIDATION_RUN][name[len(VALIDATION_PREFIX) :]] = value
        else:
            splits[TRAIN_RUN][name] = value
    return {run: values for run, values in splits.items() if values}


class SessionSummaries:
    """The session's summaries (see the module's docstring); training thread only."""

    def __init__(
        self,
        events: EventsFile,
        step: GlobalStep,
        summary_fn: Callable[[], Mapping[str, Any]] | None,
        rate_tag: str,
        averaging: bool,
    ) -> None:
        self.events = events
        self.step = step
        self.summary_fn = summary_fn
        self.rate_tag = rate_tag
        self.averaging = averaging  # results kept for their means (no summary_fn)
        self.means = ResultMeans()
        self._rate_mark: tuple[int, float] | None = None  # (step, monotonic) of the last rate
        self._no_writer_warned = False
        self._epoch_marks: dict[str, int] = {}  # run -> the last epoch written this session

    # -- what steps hand over --------------------------------------------------------

    def add(self, result: Any) -> None:
        """A step's result, for the means (not ``fit``'s logs: already running means)."""
        if self.averaging:
            self.means.add(result)

    def add_many(self, columns: Mapping[str, Sequence[float]]) -> None:
        """Many steps' numbers by name, in step order (a call of ``steps_per_loop`` steps)."""
        if self.averaging:
            self.means.add_many(columns)

    def discard(self) -> None:
        """An earlier checkpoint was restored: the failed steps' results do not count."""
        self.means.clear()

    # -- what is written -------------------------------------------------------------

    def step_means(self, last_result: Any) -> dict[str, float]:
        """The steps' numeric results averaged since the last call; without any (a
        ``summary_fn`` is given, or ``fit``, whose logs are already the epoch's running
        means), the last step's."""
        return self.means.take() or scalars(last_result)

    def step_summaries(self, last_result: Any) -> None:
        """Every ``save_summaries_steps``: ``summary_fn``'s values (or the steps' means)
        and the steps per second since the last time (from the first point, the
        session's first step: tracing is not speed)."""
        fn = self.summary_fn
        values = dict(fn()) if fn is not None else self.step_means(last_result)
        step = self.step.value
        rate = self._take_rate(step, time.monotonic())
        if rate is not None:
            values[self.rate_tag] = rate
        if values:
            self.events.write(values, step)

    def _take_rate(self, step: int, now: float) -> float | None:
        """Steps per second since the last call, or ``None`` at the first and if no step
        ran meanwhile."""
        mark, self._rate_mark = self._rate_mark, (step, now)
        if mark is None or step <= mark[0] or now <= mark[1]:
            return None
        return (step - mark[0]) / (now - mark[1])

    def epoch_summaries(self, epoch: int, logs: Mapping[str, Any]) -> None:
        """At the end of ``fit``'s epoch ``epoch``: its logs in Keras' runs. Each run
        starts this session's points with a ``SessionLog.START`` at the first epoch it
        writes (and again where a rollback took the epochs back), so that TensorBoard
        drops the points a crashed session wrote for the epochs done again."""
        for run_name, values in epoch_splits(logs).items():
            run = self.events.run(run_name)
            if run is None:  # a writer of the user's: one file, the split in the names
                self.events.write({_tag(run_name, k): v for k, v in values.items()}, epoch)
                continue
            last = self._epoch_marks.get(run_name)
            if last is None or epoch <= last:
                run.mark_start(epoch)
            self._epoch_marks[run_name] = epoch
            run.write({f"epoch_{k}": v for k, v in values.items()}, epoch)

    def write(self, values: Mapping[str, Any], step: int | None) -> None:
        """``sess.summary_computed``: into the events file, or a warning (once) that this
        session writes none."""
        if self.events.writer is None:
            if not self._no_writer_warned:
                self._no_writer_warned = True
                log.warning("summary.disabled", tags=sorted(values))
            return
        self.events.write(values, self.step.value if step is None else step)


def _tag(run: str, name: str) -> str:
    """A metric's tag in the one file of a writer the user gave."""
    return f"epoch_{VALIDATION_PREFIX if run == VALIDATION_RUN else ''}{name}"
