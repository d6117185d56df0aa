"""The sidecar evaluator: evaluation in a process of its own, beside the chief.

Evaluating on the training thread holds training for as long as the evaluation runs. The
``Evaluator`` runs instead in a process of its own (``asupervisor evaluate``) and follows
the chief's checkpoints:

- **Only committed checkpoints**: those the logdir's history names (files it does not
  name yet may be half written), in commit order (``_history``).
- **Every commit once, evaluated or recorded skipped.** What it evaluated, and what it
  skipped and why, is in its results file, ``<logdir>/eval/.asupervisor.evaluated``
  (``_records``), written whole after each; a restarted evaluator goes on with the first
  commit it has no result for (``_choice``). It *registers* in the logdir
  (``_leases.register``): while the registration is unexpired (renewed while it runs,
  left to expire when it stops, so that a restart finds it), the chief's retention keeps
  the newest ``backlog`` commits it has not seen. One swept past that backlog is recorded
  as skipped (``eval.skipped``); ``latest_only`` takes only the newest at each look and
  records the older ones as skipped.
- **A lease on the checkpoint it evaluates** (``_leases``): written before the restore,
  renewed while the evaluation runs, removed after. The commit is looked up again in the
  history once the lease is on disk: one the chief swept before then is recorded as
  skipped (``eval.vanished``), and one it sweeps after then stays for the lease's length.
- **The checkpoint is verified as the trainer verifies it** (every tensor read back), and
  only the user's objects are restored into; the global step comes from the checkpoint.
- **Events** ``eval/<metric>`` at the checkpoint's step, in an events file in
  ``<logdir>/eval`` (TensorBoard shows them as the run ``eval`` beside training's). Each
  run of the evaluator opens its file with ``SessionLog.START`` at the first step it
  evaluates, so a point written by an evaluator killed before it recorded that
  evaluation is dropped by TensorBoard, not drawn twice.
- **One evaluator per logdir**: it holds the lock of ``<logdir>/eval`` (a flock, or a
  lease on an object store) for as long as it runs.

TensorFlow work (restore, ``eval_fn``) runs in worker threads, one evaluation at a time;
the event loop only waits. A cancellation leaves the evaluation in flight to finish in its
thread, unrecorded (the next evaluation waits for it).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from .._checkpointing.root import children_of, user_checkpoint
from .._errors import CheckpointMismatchError, LogdirLockedError
from .._log import log
from .._logdir.files import checkpoint_problem, files_problem
from .._logdir.history import Commit, History, read_history
from .._logdir.leases import LEASE_SECS, hold, let_go, register, registration
from .._logdir.lock import LeaseLock, LogdirLock, make_lock
from .._logdir.records import evaluated_store, finite_numbers, read_results, write_evaluated
from .._logdir.store import Store, is_object_store
from .._logdir.verify import reader_of, shape_differences, top_level_differences
from .._training.summaries import EventsFile
from .._validate import boolean, non_negative_int, optional_positive, positive
from . import choice as _choice

if TYPE_CHECKING:
    import tensorflow as tf

TAG_PREFIX = "eval/"
# Results of checkpoints whose files are gone are kept up to this many (the newest): the
# file stays small enough for the chief's bounded read over a run of any length, and a
# swept checkpoint cannot come back to be evaluated twice.
KEEP_GONE_RESULTS = 1000


@dataclass(frozen=True)
class Evaluation:
    """One checkpoint evaluated: its name in the logdir, its global step, what
    ``eval_fn`` returned (as floats) and how long restoring and evaluating took."""

    checkpoint: str
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(frozen=True)
class _Vanished:
    reason: str


@dataclass(frozen=True)
class _Damaged:
    reason: str


class Evaluator:
    """Evaluates every committed checkpoint of ``logdir`` once, in its own process.

    ``checkpoint`` is what the trainer gives its Supervisor (a ``tf.train.Checkpoint`` or a
    mapping of name to trackable), or a part of it: only these objects are restored into
    (an evaluator needs the model, not the optimizer). Build the model before the first
    restore. ``eval_fn()`` runs after each restore, in a worker thread, and returns a
    mapping of metric name to number. ``poll_secs``: how often the state file is read for
    new checkpoints. ``latest_only``: at each look take only the newest checkpoint not yet
    evaluated, skipping older ones. ``name`` names the evaluator's lease
    (``.asupervisor.reading.<name>``), renewed every third of ``lease_secs``, and its
    registration (``.asupervisor.evaluator.<name>``). ``backlog``: how many commits it
    has not seen yet the chief's retention keeps for it (each one a checkpoint on disk
    beyond ``max_to_keep``); past that, the ones swept are recorded as skipped.
    """

    def __init__(
        self,
        logdir: str,
        *,
        checkpoint: Any,
        eval_fn: Callable[[], Mapping[str, Any]],
        poll_secs: float = 10.0,
        latest_only: bool = False,
        name: str = "evaluator",
        lease_secs: float = LEASE_SECS,
        backlog: int = _choice.BACKLOG,
    ) -> None:
        if checkpoint is None:
            raise ValueError("checkpoint must be a tf.train.Checkpoint or a mapping, not None")
        if not callable(eval_fn):
            raise ValueError(f"eval_fn must be callable, not {eval_fn!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, not {name!r}")
        self._logdir = _check_logdir(logdir)
        self._store = Store(self._logdir)
        self._user = user_checkpoint(checkpoint, None)
        self._eval_fn = eval_fn
        self._poll_secs = positive("poll_secs", poll_secs)
        self._latest_only = boolean("latest_only", latest_only)
        self._name = name
        self._lease_secs = positive("lease_secs", lease_secs)
        self._backlog = non_negative_int("backlog", backlog)
        self._results: dict[str, dict[str, Any]] = {}
        self._since = 1  # the first commit to see (its seq): set when it opens
        self._registered_at = 0.0  # time.monotonic() of the last registration written
        self._stop = threading.Event()
        self._wake: Callable[[], None] | None = None
        self._running = False
        # One evaluation at a time, also when a cancelled one still runs in its thread.
        self._busy = threading.Lock()

    @property
    def logdir(self) -> str:
        return self._logdir

    def results(self) -> dict[str, dict[str, Any]]:
        """The results file as last read or written: checkpoint name -> ``{"step",
        "time", "metrics", "written", "seq", "skipped"}`` (``skipped``: why it was not
        evaluated, or ``None``)."""
        return {name: dict(entry) for name, entry in self._results.items()}

    def stop(self) -> None:
        """End ``run()`` after the evaluation in flight (recorded); from any thread."""
        self._stop.set()
        wake = self._wake
        if wake is not None:
            wake()

    async def run(
        self, *, until_step: int | None = None, idle_secs: float | None = None
    ) -> list[Evaluation]:
        """Evaluate committed checkpoints as they come, oldest first; returns this run's
        evaluations. It ends when ``stop()`` is called, when a checkpoint at or past
        ``until_step`` has been evaluated and none is left to evaluate, or when none is left
        and no new checkpoint has been committed for ``idle_secs``; without either it
        follows the logdir until stopped or cancelled."""
        until = None if until_step is None else non_negative_int("until_step", until_step)
        idle = optional_positive("idle_secs", idle_secs)
        if self._running:
            raise RuntimeError("this Evaluator is running already")
        self._running = True
        self._stop.clear()
        done: list[Evaluation] = []
        reason = "cancelled"
        lock: LogdirLock | LeaseLock | None = None
        events: EventsFile | None = None
        try:
            lock = await anyio.to_thread.run_sync(self._open)
            wake = anyio.Event()
            self._wake = _waker(wake)
            if self._stop.is_set():
                wake.set()
            log.info(
                "eval.started",
                logdir=self._logdir,
                evaluated=len(self._results),
                latest_only=self._latest_only,
                until_step=until,
                idle_secs=idle,
            )
            last_new, known = anyio.current_time(), 0
            while True:
                if self._stop.is_set():
                    reason = "requested"
                    break
                history, todo = await anyio.to_thread.run_sync(self._pending)
                if history.next_seq > known:
                    last_new, known = anyio.current_time(), history.next_seq
                chosen = _choice.choose(todo, history, self._latest_only, self._backlog)
                if chosen.skip:
                    await anyio.to_thread.run_sync(self._record_skipped, chosen.skip)
                if chosen.evaluate is not None:
                    if events is None:
                        events = EventsFile(evaluated_store(self._logdir).root, None)
                    result = await self._one(chosen.evaluate, events)
                    if result is not None:
                        done.append(result)
                    continue
                if until is not None and self._reached(until):
                    reason = "until_step"
                    break
                if idle is not None and anyio.current_time() - last_new >= idle:
                    reason = "idle"
                    break
                with anyio.move_on_after(self._poll_secs):
                    await wake.wait()
        finally:
            self._wake = None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_close, events, lock)
            self._running = False
            log.info("eval.stopped", reason=reason, evaluated=len(done))
        return done

    # -- one checkpoint ------------------------------------------------------------------

    async def _one(self, commit: Commit, events: EventsFile) -> Evaluation | None:
        """Lease, look it up again, restore and evaluate, record; the lease goes after."""
        store, name = self._store, commit.name
        written = await anyio.to_thread.run_sync(self._written, name)
        await anyio.to_thread.run_sync(hold, store, self._name, name, self._lease_secs)
        try:
            if not await anyio.to_thread.run_sync(self._still_committed, commit):
                reason = "swept before its lease was written"
                log.info("eval.vanished", path=store.path(name), reason=reason)
                await anyio.to_thread.run_sync(self._record_skipped, [(commit, reason)], False)
                return None
            failure: Exception | None = None
            async with anyio.create_task_group() as renewals:
                renewals.start_soon(self._renew, name)
                try:
                    outcome = await anyio.to_thread.run_sync(
                        self._evaluate, commit, abandon_on_cancel=True
                    )
                except Exception as exc:  # raised as itself, not in the group's wrapping
                    failure = exc
                renewals.cancel_scope.cancel()
            if failure is not None:
                raise failure
            if not isinstance(outcome, Evaluation):
                # Not tried again: a damaged one fails again; a swept one that the history
                # still names (files deleted by hand) would be chosen again at once.
                if isinstance(outcome, _Vanished):
                    log.info("eval.vanished", path=store.path(name), reason=outcome.reason)
                else:
                    log.warning("eval.damaged", path=store.path(name), reason=outcome.reason)
                skipped = [(commit, f"{type(outcome).__name__[1:].lower()}: {outcome.reason}")]
                await anyio.to_thread.run_sync(self._record_skipped, skipped, False)
                return None
            with anyio.CancelScope(shield=True):  # evaluated: recorded, even when cancelled now
                await anyio.to_thread.run_sync(self._record, outcome, events, written, commit)
            return outcome
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._let_go, name)

    async def _renew(self, name: str) -> None:
        while True:
            await anyio.sleep(self._lease_secs / 3)
            try:
                await anyio.to_thread.run_sync(
                    hold, self._store, self._name, name, self._lease_secs
                )
            except OSError as exc:  # the next renewal tries again; the lease still runs
                log.warning(
                    "eval.lease_failed",
                    path=self._store.path(name),
                    action="renew",
                    error=repr(exc),
                )

    # -- in worker threads ---------------------------------------------------------------

    def _open(self) -> LogdirLock | LeaseLock:
        """Take the evaluator's lock and read its results."""
        store = evaluated_store(self._logdir)
        store.make()
        lock = make_lock(store)
        try:
            lock.acquire()
        except LogdirLockedError as exc:
            raise LogdirLockedError(
                f"another evaluator is evaluating {self._logdir!r} (it holds the lock of "
                f"{store.root!r}): one evaluator per logdir ({exc})"
            ) from None
        try:
            self._results = read_results(self._logdir)
            history = read_history(self._store)
            mine = registration(self._store, self._name)
            self._since = _choice.since_of(
                history, self._results, None if mine is None else mine.since
            )
            self._register()
        except BaseException:
            lock.release()
            raise
        return lock

    def _register(self) -> None:
        """The registration that asks the chief's retention to keep the backlog; renewed
        every third of ``lease_secs`` while it runs (a failed write: the next one)."""
        backlog = 0 if self._latest_only else self._backlog
        try:
            register(self._store, self._name, self._since, backlog, self._lease_secs)
        except OSError as exc:
            log.warning(
                "eval.lease_failed",
                path=self._store.path(self._name),
                action="register",
                error=repr(exc),
            )
            return
        self._registered_at = time.monotonic()

    def _pending(self) -> tuple[History, list[Commit]]:
        """The history now, and the commits in it not yet evaluated nor skipped."""
        if time.monotonic() - self._registered_at >= self._lease_secs / 3:
            self._register()
        history = read_history(self._store)
        legacy = [n for n, e in self._results.items() if e.get("seq") is None or history.derived]
        written = {n: self._written(n) for n in legacy}
        return history, _choice.unseen(history, self._results, self._since, written)

    def _written(self, name: str) -> float | None:
        try:
            stamp = self._store.mtime(name + ".index")
        except OSError:
            return None
        return stamp if stamp > 0 else None

    def _still_committed(self, commit: Commit) -> bool:
        now = read_history(self._store).by_name(commit.name)
        return now is not None and now.on_disk and now.seq == commit.seq

    def _evaluate(self, commit: Commit) -> Evaluation | _Vanished | _Damaged:
        """Verify, restore into the user's objects, run ``eval_fn``."""
        import tensorflow as tf

        with self._busy:
            started = time.perf_counter()
            name = commit.name
            store, path = self._store, self._store.path(name)
            problem = checkpoint_problem(store, path)
            if problem is not None:
                if _gone(store, name, problem):
                    return _Vanished(problem)
                return _Damaged(problem)
            try:
                step = global_step_of(path, commit.step or 0)
                restore(self._user, path)
            except Exception as exc:
                if isinstance(exc, (tf.errors.NotFoundError, FileNotFoundError)) or _gone(
                    store, name, str(exc)
                ):
                    return _Vanished(f"{type(exc).__name__}: {str(exc).strip()[:200]}")
                raise
            metrics = _numbers(self._eval_fn())
            return Evaluation(name, step, metrics, time.perf_counter() - started)

    def _record(
        self, evaluation: Evaluation, events: EventsFile, written: float | None, commit: Commit
    ) -> None:
        """Events first, then the results file: a kill between the two leaves the
        evaluation unrecorded, done again by the next run (whose ``SessionLog.START``
        makes TensorBoard drop the first point)."""
        if events.writer is None:
            evaluated_store(self._logdir).make()
            events.open(lambda: True)
            events.mark_start(evaluation.step)
        values = {TAG_PREFIX + key: value for key, value in evaluation.metrics.items()}
        events.write(values, evaluation.step)
        if events.writer is not None:
            events.writer.flush()
        self._write_results(
            {
                evaluation.checkpoint: {
                    "step": evaluation.step,
                    "time": time.time(),
                    "metrics": finite_numbers(evaluation.metrics),
                    "written": written,
                    "seq": commit.seq,
                    "skipped": None,
                }
            }
        )
        log.info(
            "eval.evaluated",
            path=self._store.path(evaluation.checkpoint),
            step=evaluation.step,
            seconds=round(evaluation.seconds, 3),
            metrics=evaluation.metrics,
        )

    def _record_skipped(self, skipped: list[tuple[Commit, str]], logged: bool = True) -> None:
        """Commits it will never evaluate, in its results with why (``eval.skipped``)."""
        now = time.time()
        self._write_results(
            {
                c.name: {
                    "step": c.step,
                    "time": now,
                    "metrics": {},
                    "written": None,
                    "seq": c.seq,
                    "skipped": why,
                }
                for c, why in skipped
            }
        )
        if logged:
            for why in dict.fromkeys(why for _, why in skipped):
                log.info(
                    "eval.skipped",
                    paths=[self._store.path(c.name) for c, w in skipped if w == why],
                    reason=why,
                )

    def _write_results(self, new: dict[str, dict[str, Any]]) -> None:
        results = self._pruned({**self._results, **new})
        write_evaluated(self._logdir, results)
        self._results = results

    def _pruned(self, results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Every result of a checkpoint on disk, and the newest ``KEEP_GONE_RESULTS`` of
        those whose files are gone."""
        on_disk = {n[: -len(".index")] for n in self._store.names() if n.endswith(".index")}
        gone = [n for n in results if n not in on_disk]
        if len(gone) <= KEEP_GONE_RESULTS:
            return results
        gone.sort(key=lambda n: (results[n].get("step", 0), results[n].get("time", 0)))
        dropped = set(gone[: len(gone) - KEEP_GONE_RESULTS])
        return {n: entry for n, entry in results.items() if n not in dropped}

    def _let_go(self, name: str) -> None:
        try:
            let_go(self._store, self._name)
        except OSError as exc:  # it expires by itself
            log.warning(
                "eval.lease_failed", path=self._store.path(name), action="let_go", error=repr(exc)
            )

    def _reached(self, until: int) -> bool:
        steps = (entry.get("step") for entry in self._results.values())
        return any(step is not None and step >= until for step in steps)


# -- helpers, each one file system or TensorFlow call ------------------------------------


def global_step_of(path: str, otherwise: int = 0) -> int:
    """The global step saved in the checkpoint at ``path`` (the supervisor's top-level
    ``global_step``, whatever variable it is); another tool's checkpoint without one:
    ``otherwise`` (the step its commit recorded)."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    reader = reader_of(path)
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
        reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    )
    for child in graph.nodes[0].children:
        if child.local_name == "global_step":
            for attribute in graph.nodes[child.node_id].attributes:
                if attribute.name == "VARIABLE_VALUE":
                    return int(reader.get_tensor(attribute.checkpoint_key))
    return otherwise


def restore(user: tf.train.Checkpoint, path: str) -> None:
    """Restore the checkpoint at ``path`` into the user's objects only, or raise
    ``CheckpointMismatchError`` naming what does not fit (the supervisor's own entries,
    and parts of the training state the evaluator was not given, are left in the file)."""
    import tensorflow as tf

    children = children_of(user)
    missing, _ = top_level_differences(children, path)
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match the objects being evaluated: the evaluator "
            f"has {missing} that the checkpoint lacks"
        )
    unbuilt = _unbuilt(children, path)
    if unbuilt:
        raise CheckpointMismatchError(
            f"checkpoint {path} holds values for {unbuilt}, but the evaluator's objects of "
            "that name hold no variables yet: build the model before the evaluator "
            "restores into it (keras.Input, or call it on a batch)"
        )
    shapes = shape_differences(children, path)
    if shapes:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match the objects being evaluated: " + "; ".join(shapes)
        )
    status = tf.train.Checkpoint(root=user).read(path)
    try:
        status.assert_existing_objects_matched()
    except AssertionError as exc:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match the objects being evaluated: {exc}"
        ) from exc
    status.expect_partial()  # the optimizer, the position, the step: the trainer's


def _unbuilt(children: Mapping[str, Any], path: str) -> list[str]:
    """The user's top-level objects that hold no variable while the checkpoint holds
    values under their name: Keras 3 would make new variables at the first call instead
    of taking the saved ones, and evaluate untrained weights."""
    import tensorflow as tf
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
        reader_of(path).get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    )
    saved = {c.local_name: c.node_id for c in graph.nodes[0].children if c.node_id != 0}
    found = []
    for name, obj in children.items():
        if name not in saved or not _has_values(graph, saved[name]):
            continue
        # Keras 3's variables are not tf.Variables: anything that can be assigned counts.
        nodes = tf.train.TrackableView(obj).descendants()
        if not any(isinstance(n, tf.Variable) or hasattr(n, "assign") for n in nodes):
            found.append(name)
    return found


def _has_values(graph: Any, node_id: int) -> bool:
    seen, queue = {node_id}, [node_id]
    while queue:
        node = graph.nodes[queue.pop()]
        if node.attributes:
            return True
        for child in node.children:
            if child.node_id not in seen:
                seen.add(child.node_id)
                queue.append(child.node_id)
    return False


def _gone(store: Store, name: str, problem: str) -> bool:
    """Whether a failure means the checkpoint was swept (not damaged)."""
    return (
        problem.startswith("NotFoundError")
        or "not find any matching files" in problem
        or files_problem(store, store.path(name)) is not None
    )


def _numbers(values: Any) -> dict[str, float]:
    """``eval_fn``'s result as floats; anything but a mapping of name to number (a
    Python or numpy number, a 0-d tensor) is a ``ValueError`` naming ``eval_fn``."""
    if not isinstance(values, Mapping):
        raise ValueError(f"eval_fn must return a mapping of name to number, not {values!r}")
    out: dict[str, float] = {}
    for key, value in values.items():
        try:
            if isinstance(value, (bool, str, bytes)):
                raise TypeError(type(value).__name__)
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"eval_fn returned {value!r} for {key!r}: a number was expected"
            ) from None
    return out


def _waker(event: anyio.Event) -> Callable[[], None]:
    """A function that sets ``event`` from any thread (``stop()`` may come from one)."""
    token, loop_thread = anyio.lowlevel.current_token(), threading.get_ident()

    def wake() -> None:
        if threading.get_ident() == loop_thread:
            event.set()
            return
        try:
            anyio.from_thread.run_sync(event.set, token=token)
        except RuntimeError:  # the loop has ended: nothing waits any more
            pass

    return wake


def _close(events: EventsFile | None, lock: LogdirLock | LeaseLock | None) -> None:
    try:
        lost = None if events is None else events.close()
        if lost is not None:
            raise lost
    finally:
        if lock is not None:
            lock.release()


def _check_logdir(logdir: Any) -> str:
    """A local path, or a URL of a file system TensorFlow has (as the Supervisor's)."""
    if not isinstance(logdir, (str, os.PathLike)) or not os.fspath(logdir):
        raise ValueError(f"logdir must be a path or a URL, not {logdir!r}")
    path = os.fspath(logdir)
    if not isinstance(path, str):
        raise ValueError(f"logdir must be a text path, not {logdir!r}")
    if not is_object_store(path):
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"logdir {path!r} exists and is not a directory")
        return path
    import tensorflow as tf

    try:
        tf.io.gfile.exists(path)
    except tf.errors.UnimplementedError as exc:
        raise ValueError(
            f"logdir {path!r}: TensorFlow has no file system for {path.split('://')[0]!r}://"
        ) from exc
    return path.rstrip("/")
