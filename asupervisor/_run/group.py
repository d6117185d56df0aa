"""Who restarts a failed worker, and the exit statuses an engine is told.

``asupervisor run`` restarts its children itself when it starts every worker of the job
(one process, or ``--workers N`` on one host). When its one child is a single worker of a
job whose other workers someone else started (one ``asupervisor run`` per host, per pod,
per SLURM task), a restart of this worker alone cannot help: the others are still in the
old collective group, and the restarted worker cannot join a group that no longer exists.
Then a failure or a hang ends the run at once, with a status that says why, and the engine
that started the job (SLURM, a JobSet, a TFJob) restarts it as a whole.

``membership`` is the one decision of which of the two a run is; ``StatusMap`` is how the
run's exit status is shown to an engine that retries only some statuses.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from .._outcome import Outcome
from .statuses import outcome_of


class Restarts(str, enum.Enum):
    """Who restarts a worker that failed or hung (``--restarts``)."""

    AUTO = "auto"
    """Decided from the environment (``membership``)."""
    HERE = "here"
    """This run: it starts every worker of the job."""
    ENGINE = "engine"
    """The engine that started the job, as a whole: this run exits at once."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Membership:
    """Who restarts this run's worker, and why (a phrase for the run's first line)."""

    restarts: Restarts  # HERE or ENGINE, never AUTO
    why: str


def _tasks_in(tf_config: str) -> int:
    """The number of tasks a TF_CONFIG's cluster names (0 if it names none or is not
    JSON: the session reports a bad TF_CONFIG, not the runner)."""
    try:
        cluster = json.loads(tf_config).get("cluster", {})
    except (ValueError, AttributeError):
        return 0
    if not isinstance(cluster, dict):
        return 0
    return sum(len(tasks) for tasks in cluster.values() if isinstance(tasks, list))


def membership(asked: Restarts, env: Mapping[str, str], workers: int) -> Membership:
    """Who restarts a failed worker of this run: the one decision.

    ``--restarts here|engine`` decides; with ``auto``, a run that starts its workers
    itself (``--workers N``) restarts them; a run whose one child is one task of a
    larger job (its ``TF_CONFIG`` names more than one task, or it is one task of a SLURM
    step of several) leaves the restart to the engine.
    """
    if asked is Restarts.HERE:
        return Membership(Restarts.HERE, "--restarts here")
    if asked is Restarts.ENGINE:
        return Membership(Restarts.ENGINE, "--restarts engine")
    if workers > 1:
        return Membership(Restarts.HERE, f"it starts all {workers} workers")
    step_tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if step_tasks.isdigit() and int(step_tasks) > 1:
        return Membership(Restarts.ENGINE, f"one task of a SLURM step of {step_tasks} tasks")
    tasks = _tasks_in(env.get("TF_CONFIG", ""))
    if tasks > 1:
        return Membership(Restarts.ENGINE, f"one task of {tasks} in its TF_CONFIG")
    return Membership(Restarts.HERE, "one process")


# The outcomes a status map may name, by the names the docs and --help use.
NAMES: dict[str, Outcome] = {
    "done": Outcome.DONE,
    "preempted": Outcome.PREEMPTED,
    "failed": Outcome.FAILED,
    "permanent": Outcome.FAILED_PERMANENTLY,
    "stuck": Outcome.STUCK,
    "interrupted": Outcome.INTERRUPTED,
    "unreachable": Outcome.UNREACHABLE,
    "lost-peer": Outcome.LOST_PEER,
}
# Kubeflow's TFJob (restartPolicy: ExitCode) retries only 130, 137, 143 and 138: a
# preemption and a hang become statuses it retries; a failure stays 1 (permanent there:
# a crash restarts in the pod only with --restarts here). A lost peer becomes 137: what
# the peer's own death most often shows (SIGKILL, the OOM killer, a lost node), retried,
# and not 130 (a person's Ctrl-C, which this runner passes on) nor the preempted or stuck
# numbers, so the two that are mapped stay apart. A store out of reach (69) becomes 137
# too: an outage of the store is most often transient, and a TFJob failed for good on it
# would need a person to submit the job again, where a replaced pod restores from the
# store once it answers. It shares 137 with a lost peer: both are retried failures that
# came from outside the worker; the ledger tells which.
PRESETS: dict[str, dict[Outcome, int]] = {
    "tfjob": {
        Outcome.PREEMPTED: 143,
        Outcome.STUCK: 138,
        Outcome.LOST_PEER: 137,
        Outcome.UNREACHABLE: 137,
    },
}


@dataclass(frozen=True)
class StatusMap:
    """The run's exit status as the engine is told it (``--exit-status-map``)."""

    mapped: Mapping[Outcome, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> StatusMap:
        """``tfjob``, or ``NAME=STATUS,...`` with NAME one of ``NAMES`` (``ValueError``
        naming what is wrong)."""
        mapped: dict[Outcome, int] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            if part in PRESETS:
                mapped.update(PRESETS[part])
                continue
            name, sep, value = part.partition("=")
            if not sep or name.strip() not in NAMES:
                known = ", ".join([*PRESETS, *(f"{n}=N" for n in NAMES)])
                raise ValueError(f"{part!r} is not one of {known}")
            if not value.strip().isdigit() or not 0 <= int(value) <= 255:
                raise ValueError(f"{part!r}: the status must be a number from 0 to 255")
            mapped[NAMES[name.strip()]] = int(value)
        return cls(mapped)

    def __call__(self, status: int) -> int:
        """The status the engine sees for the run's own ``status``."""
        return self.mapped.get(outcome_of(status), status)

    def __str__(self) -> str:
        by_outcome = {outcome: name for name, outcome in NAMES.items()}
        return ",".join(f"{by_outcome[o]}={s}" for o, s in self.mapped.items())
