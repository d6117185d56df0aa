"""A multi-worker job: who this process is, and how every worker agrees on a step.

The workers of a ``MultiWorkerMirroredStrategy`` job run their steps in lockstep:
each step all-reduces the gradients, so no worker finishes step ``s + 1`` before
every worker has started it. That is what makes agreement cheap, as in TF's
``PreemptionCheckpointHandler``:

1. A worker that wants something done by everyone (a save when the chief's timer
   fires, a stop when a worker gets SIGTERM) proposes it, on its training thread
   at a step boundary where its global step is ``c``, for global step ``c + 1``.
2. The proposal goes into the job's coordination service (TF's key-value store,
   which MWMS starts on the chief) as the next free *decision slot*. Inserting a
   key fails if it exists, so two proposals never take the same slot.
3. Each worker's watcher thread reads the slots in order, records the decision
   and acknowledges it. The proposer waits for every acknowledgement before it
   runs its next step, so every worker knows the decision before any worker can
   finish that step; each acts on it right after the first step that takes its
   global step to ``c + 1`` or past it (a step may advance it by more than one).
   Decisions travel as JSON: any reason a user gives survives the trip.

No collective runs per step for this: a boundary costs one attribute check until
a decision arrives.
"""

from __future__ import annotations

import atexit
import enum
import itertools
import json
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._log import log

POLL_MS = 500  # how long one blocking read of the store waits before checking for close
ACK_TIMEOUT_SECS = 60.0  # a worker that does not acknowledge in this time is taken as lost
_sessions = itertools.count()  # key namespace: one per session in this process
EXIT_JOIN_SECS = POLL_MS / 1000 + 1.0  # at exit: one read of the store, and a margin
_started: weakref.WeakSet[Agreement] = weakref.WeakSet()  # whose watchers may still run


@atexit.register
def _close_watchers_at_exit() -> None:
    """Before the interpreter finalizes: a watcher thread that comes back from a read of
    the store into a finalizing interpreter is ended by an unwind through TensorFlow's
    C++ frames, which aborts the process (SIGABRT, "FATAL: exception not rethrown"; seen
    on a worker that had stopped cleanly, after its final save). Each watcher is closed
    and waited for, at most one read."""
    agreements = list(_started)
    for agreement in agreements:
        agreement.close()
    deadline = time.monotonic() + EXIT_JOIN_SECS
    for agreement in agreements:
        agreement.join_watcher(max(0.0, deadline - time.monotonic()))


class DecisionKind(enum.Enum):
    SAVE = "save"
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    """What every worker does once its global step reaches ``step``."""

    step: int
    kind: DecisionKind
    reason: str  # a stop's reason (any string a user gave survives), or the save's cause
    proposer: int

    def encode(self) -> str:
        fields = {"step": self.step, "kind": self.kind.value, "reason": self.reason}
        return json.dumps({**fields, "proposer": self.proposer})

    @classmethod
    def decode(cls, text: str) -> Decision:
        fields = json.loads(text)
        return cls(
            int(fields["step"]),
            DecisionKind(fields["kind"]),
            str(fields["reason"]),
            int(fields["proposer"]),
        )


@dataclass(frozen=True)
class Role:
    """This process's place in a multi-worker job, from the strategy's cluster resolver."""

    task_type: str
    task_id: int
    rank: int  # 0 for the chief, then the workers in order
    num_workers: int
    tasks: tuple[tuple[str, int], ...] = ()  # (job name, task id) of every rank, in rank order
    jobs: tuple[tuple[str, int], ...] = ()  # (job name, number of tasks), as the service asks

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def name(self) -> str:
        return f"{self.task_type}:{self.task_id}"


def multi_worker_role(strategy: Any) -> Role | None:
    """The role of this process if ``strategy`` spans more than one worker, else ``None``.

    Raises ``ValueError`` for strategies whose shape does not fit (see the docs).
    """
    import tensorflow as tf
    from tensorflow.python.distribute import multi_worker_util

    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise ValueError(
            "strategy: ParameterServerStrategy is not supported: its steps are closures "
            "the coordinator schedules onto workers asynchronously, so no process has a "
            "step boundary where the whole state is consistent to checkpoint; use "
            "MultiWorkerMirroredStrategy"
        )
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    spec = resolver.cluster_spec()
    if not spec.jobs:
        return None  # MWMS without TF_CONFIG: one local worker
    task_type, task_id = resolver.task_type, int(resolver.task_id)
    count = multi_worker_util.worker_count(spec, task_type)
    if count < 2:
        return None
    rank = multi_worker_util.id_in_cluster(spec, task_type, task_id)
    jobs = tuple((job, spec.num_tasks(job)) for job in ("chief", "worker") if job in spec.jobs)
    tasks = sorted(
        ((job, index) for job, _ in jobs for index in spec.task_indices(job)),
        key=lambda task: multi_worker_util.id_in_cluster(spec, *task),
    )
    return Role(task_type, task_id, rank, count, tuple(tasks), jobs)


class Agreement:
    """Decisions taken together by every worker of one job, for one session."""

    def __init__(
        self,
        role: Role,
        on_lost: Callable[[BaseException], None],
        stopped: Callable[[], bool] = lambda: False,
    ) -> None:
        from tensorflow.python.eager import context

        self.role = role
        self._stopped = stopped  # a wait for another worker gives way to a stop
        self._store = context.context()
        self._prefix = f"asupervisor/{next(_sessions)}"
        self._on_lost = on_lost  # the store failed: a worker (or the chief) is gone
        self._lock = threading.Lock()
        self._decisions: dict[int, list[Decision]] = {}
        self.pending = False  # read at every step boundary: keep it a plain attribute
        self.stopping = False  # this worker is past its last step: losing the store is no error
        self._slot = 0  # the next slot the watcher reads
        self._closed = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, name="asupervisor-cluster-watcher", daemon=True
        )

    def _key(self, *parts: object) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    def start(self) -> None:
        self._watcher.start()
        _started.add(self)

    def join_watcher(self, timeout_secs: float) -> None:
        """Wait up to ``timeout_secs`` for the watcher thread to end (after ``close``)."""
        if self._watcher.is_alive():
            self._watcher.join(timeout_secs)

    def close(self) -> None:
        """Not waited for: the watcher may sit in a read of the store for up to
        ``POLL_MS``, and a stopping job should not pay that. After this it calls back
        no more (it checks ``_closed`` first), and an acknowledgement it may still
        write helps whoever waits for it."""
        self._closed.set()

    def finishing(self) -> None:
        """This worker is past its last step: the store going away is no error now."""
        self.stopping = True

    def finish_together(self, timeout_secs: float) -> None:
        """After a clean stop: wait until every worker is done with its final save.

        The chief hosts the coordination service; a chief that exited at once would
        pull the store from under the others while they finish.
        """
        started = time.monotonic()
        try:
            self._store.wait_at_barrier(self._key("finished"), int(timeout_secs * 1000))
        except Exception as exc:  # a worker already gone: nothing left to wait for
            log.warning("cluster.finish_unsynchronized", error=f"{type(exc).__name__}: {exc}"[:300])
            return
        log.info("cluster.finished", seconds=round(time.monotonic() - started, 4))

    # -- one value everyone reads (the chief's restore choice) ------------------

    def publish(self, name: str, value: str) -> None:
        self._store.set_config_key_value(self._key(name), value)

    def read(self, name: str, timeout_secs: float) -> str:
        """Wait for the value the chief published under ``name``."""
        return self._get(self._key(name), timeout_secs, f"the chief's {name!r}")

    # -- decisions ---------------------------------------------------------------

    def propose(self, kind: DecisionKind, reason: str, current_step: int) -> Decision:
        """Training thread, at a step boundary: everyone does ``kind`` after the next step."""
        import tensorflow as tf

        decision = Decision(current_step + 1, kind, reason, self.role.rank)
        slot = self._slot
        while True:
            try:
                self._store.set_config_key_value(self._key("decision", slot), decision.encode())
                break
            except tf.errors.AlreadyExistsError:
                slot += 1  # taken by another worker's proposal: ours goes after it
        started = time.monotonic()
        for rank in range(self.role.num_workers):
            key = self._key("decision", slot, "ack", rank)
            self._get(key, ACK_TIMEOUT_SECS, f"worker {rank}", rank)
        log.info(
            "cluster.proposed",
            step=decision.step,
            kind=kind.value,
            reason=reason,
            slot=slot,
            ack_seconds=round(time.monotonic() - started, 4),
        )
        return decision

    def due(self, step: int) -> list[Decision]:
        """Training thread, after a step that left the global step at ``step``: the
        decisions for it or before it (a step may advance the global step by more than
        one; every worker takes the same steps, so every worker acts after the same one).
        Taken off the plan, in the order they were agreed."""
        with self._lock:
            ready = sorted(s for s in self._decisions if s <= step)
            due = [d for s in ready for d in self._decisions.pop(s)]
            self.pending = bool(self._decisions)
        return due

    def _get(self, key: str, timeout_secs: float, what: str, rank: int | None = None) -> str:
        """Wait for ``key``; when it is ``rank``'s to write, give up as soon as the
        coordination service has seen that worker die (its heartbeats stopped), not
        only after ``timeout_secs``: a worker killed while a proposal waits for it
        must not hold the survivors for the whole timeout."""
        import tensorflow as tf

        deadline = time.monotonic() + timeout_secs
        while True:
            try:
                value: str = self._store.get_config_key_value(key, timeout_in_ms=POLL_MS)
                return value
            except tf.errors.DeadlineExceededError:
                lost = self._lost(rank)
                if lost is not None:
                    raise tf.errors.UnavailableError(
                        None, None, f"{what} was lost while the job waited for it: {lost}"
                    ) from None
                if time.monotonic() > deadline:
                    raise tf.errors.UnavailableError(
                        None,
                        None,
                        f"{what} did not answer within {timeout_secs} s in the job's "
                        f"coordination service (key {key}); is every worker alive?",
                    ) from None
                if self._closed.is_set() or self._stopped():
                    raise

    def _lost(self, rank: int | None) -> str | None:
        """The coordination service's word on ``rank``'s health: ``None`` while alive."""
        if rank is None or rank >= len(self.role.tasks) or rank == self.role.rank:
            return None
        job, index = self.role.tasks[rank]
        first = {
            name: sum(n for _, n in self.role.jobs[:i])
            for i, (name, _) in enumerate(self.role.jobs)
        }
        try:
            states = self._store.get_task_states(list(self.role.jobs))
        except Exception as exc:  # the service itself is gone: the chief died
            return f"{type(exc).__name__}: {exc}"
        state = states[first[job] + index]
        return None if state is None else str(state)[:300]

    def _watch(self) -> None:
        """Watcher thread: read the decision slots in order, record and acknowledge each."""
        import tensorflow as tf

        while not self._closed.is_set():
            slot = self._slot
            try:
                text = self._store.get_config_key_value(
                    self._key("decision", slot), timeout_in_ms=POLL_MS
                )
                decision = Decision.decode(text)
                with self._lock:
                    self._decisions.setdefault(decision.step, []).append(decision)
                    self.pending = True
                self._store.set_config_key_value(
                    self._key("decision", slot, "ack", self.role.rank), "1"
                )
            except tf.errors.DeadlineExceededError:
                continue
            except Exception as exc:  # the store is gone: the chief (or the network) is
                if not self._closed.is_set() and not self.stopping:
                    log.error(
                        "cluster.lost", worker=self.role.name, error=f"{type(exc).__name__}: {exc}"
                    )
                    self._on_lost(exc)
                return
            self._slot = slot + 1
