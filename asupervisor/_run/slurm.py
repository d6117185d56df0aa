"""A multi-worker job in a SLURM allocation: the group restarted inside the allocation.

``asupervisor run --slurm -- COMMAND`` (in a batch script) runs the job as one step of
N tasks, ``srun --kill-on-bad-exit=1 ... asupervisor run --restarts engine -- COMMAND``:
each task is an ``asupervisor run`` of its own that watches its one worker (its liveness,
its stuck steps, its stack when it hangs) and, when the worker fails, ends at once; SLURM
then ends the whole step. The outer run starts the step again, in the same allocation
(no queue wait), with the budget, back-off and crash-loop report of one host, its
progress read from the history (each task passes the outer run's identity on to its
worker, so the history records the commits with the outer run's attempt).

Each task's worker gets its ``TF_CONFIG`` from SLURM's environment (``tf_config``): the
step's nodes in order, their tasks in SLURM's block order, each node's address (its
name if it resolves, else SLURM's ``NodeAddr``) and a port of its own, the same in every
task without talking: derived from the job, the restart and the attempt.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SCONTROL_SECS = 10.0  # a controller that does not answer within it is an error, said so
# The workers' ports: PORT_BASE .. PORT_BASE + PORT_SPAN + tasks, below Linux's default
# ephemeral range (32768-60999), where a busy host's outgoing connections hold ports (a
# worker's gRPC server then cannot start: seen, three attempts in a row on a loaded host).
PORT_BASE = 20000
PORT_SPAN = 12000


class SlurmError(RuntimeError):
    """SLURM's environment or its controller did not give what the job needs."""


@dataclass(frozen=True)
class Step:
    """This task's place in its SLURM step (from the environment srun gives a task)."""

    job_id: str
    procid: int  # this task's rank in the step
    nodes: tuple[str, ...]  # the step's nodes, in order
    tasks_per_node: tuple[int, ...]  # how many of the step's tasks run on each
    restart_count: int  # SLURM_RESTART_COUNT: how often the batch job was requeued

    @property
    def tasks(self) -> int:
        return sum(self.tasks_per_node)

    def placement(self) -> list[tuple[str, int]]:
        """For each task (by rank): its node and its index among that node's tasks
        (SLURM's default block distribution)."""
        pairs = zip(self.nodes, self.tasks_per_node, strict=True)
        return [(node, i) for node, n in pairs for i in range(n)]


def expand_counts(text: str) -> list[int]:
    """SLURM's compressed counts, ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not found:
            raise SlurmError(f"cannot read the task counts {text!r}")
        counts += [int(found[1])] * int(found[2] or 1)
    return counts


def hostnames(nodelist: str) -> list[str]:
    """SLURM's compressed node list (``n[1-2]``) as names, by ``scontrol show hostnames``
    (SLURM's own reading of its syntax)."""
    done = _scontrol("show", "hostnames", nodelist)
    return done.split()


def node_address(name: str) -> str:
    """Where a node is reached: its name if it resolves, else SLURM's ``NodeAddr``."""
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        pass
    found = _field(_scontrol("show", "node", name, "-o"), "NodeAddr")
    if found is None:
        raise SlurmError(f"SLURM gives no address for node {name!r}")
    return found


def _field(shown: str, name: str) -> str | None:
    """The field ``name`` of what ``scontrol show ... -o`` printed (``Name=value`` pairs on
    one line), or None."""
    found = re.search(rf"\b{re.escape(name)}=(\S+)", shown)
    return found[1] if found else None


def _scontrol(*args: str) -> str:
    try:
        done = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=SCONTROL_SECS, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"scontrol {' '.join(args)}: {exc}") from None
    if done.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(args)}: {done.stderr.strip()[:200]}")
    return done.stdout


def requeue(job_id: str) -> str | None:
    """Ask SLURM to requeue the batch job ``job_id`` (``scontrol requeue``): it ends the
    job's processes, this one among them, and puts the job back in the queue. Only a job
    SLURM still shows running: one cancelled (a plain ``scancel`` stops the run as a
    notice does) or past its time limit has ended for good, and requeued it would come
    back. Returns why it was not requeued, or None."""
    state = _field(_scontrol("show", "job", "-o", job_id), "JobState") or "?"
    if state != "RUNNING":
        return f"the job is {state}, not running"
    _scontrol("requeue", job_id)
    return None


def step_of(env: Mapping[str, str]) -> Step | None:
    """This task's step, if it is one task of a SLURM step of several; else None."""
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if not tasks.isdigit() or int(tasks) < 2:
        return None
    try:
        nodes = tuple(hostnames(env["SLURM_STEP_NODELIST"]))
        per_node = tuple(expand_counts(env["SLURM_STEP_TASKS_PER_NODE"]))
        procid = int(env["SLURM_PROCID"])
    except (KeyError, ValueError) as exc:
        raise SlurmError(f"SLURM's step environment is incomplete: {exc}") from None
    if len(nodes) != len(per_node) or sum(per_node) != int(tasks):
        raise SlurmError(
            f"SLURM's step does not add up: nodes {nodes}, tasks per node {per_node}, {tasks} tasks"
        )
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return Step(
        job_id=env.get("SLURM_JOB_ID", ""),
        procid=procid,
        nodes=nodes,
        tasks_per_node=per_node,
        restart_count=int(restarts) if restarts.isdigit() else 0,
    )


def port_for(step: Step, attempt: int) -> int:
    """The first port of the job's workers (task N has this + N): the same in every task
    (no talking), and another one at each attempt and requeue (a port the attempt before
    may still hold is not reused at once)."""
    seed = int(step.job_id) if step.job_id.isdigit() else 0
    return PORT_BASE + (seed * 7919 + step.restart_count * 104729 + attempt * 613) % PORT_SPAN


def tf_config(step: Step, attempt: int, addresses: Mapping[str, str] | None = None) -> str:
    """The TF_CONFIG of this task's worker: one worker per task, in rank order."""
    where = dict(addresses or {})
    for node in step.nodes:
        if node not in where:
            where[node] = node_address(node)
    base = port_for(step, attempt)
    # A port per task, not per node's task: TF's gRPC server binds every interface, so two
    # nodes that share a host's network (containers, test clusters) must not share one.
    workers = [f"{where[node]}:{base + rank}" for rank, (node, _) in enumerate(step.placement())]
    return json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": step.procid}}
    )


def step_tasks(env: Mapping[str, str]) -> int:
    """How many tasks ``--slurm``'s step has: ``SLURM_NTASKS`` if the job asked for a
    number, else one per node of the allocation."""
    for name in ("SLURM_NTASKS", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def srun_command(
    command: Sequence[str], env: Mapping[str, str], member_options: Sequence[str], python: str
) -> list[str]:
    """The step ``asupervisor run --slurm`` starts at each attempt: one task per node of
    the allocation (or ``SLURM_NTASKS`` if the job asked for more), each an
    ``asupervisor run --restarts engine`` of the command."""
    if not env.get("SLURM_JOB_ID"):
        raise SlurmError(
            "not inside a SLURM allocation (no SLURM_JOB_ID): run it in an sbatch script "
            "or an salloc shell"
        )
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    tasks = str(step_tasks(env))
    return [
        python, "-m", "asupervisor._run.slurm",  # passes a stop on as SLURM means it
        # --export=ALL: the tasks need the run's identity (a site's SLURM_EXPORT_ENV may
        # say otherwise); block: TF_CONFIG's ranks follow SLURM's block placement.
        "srun", "--kill-on-bad-exit=1", "--export=ALL", "--distribution=block",
        f"--nodes={nodes}", f"--ntasks={tasks}",
        python, "-m", "asupervisor", "run", "--restarts", "engine", *member_options,
        "--", *command,
    ]  # fmt: skip


# -- the group's facts: how each task's run ended -------------------------------------------

MEMBER_PREFIX = ".asupervisor.member-"


@dataclass(frozen=True)
class MemberEnd:
    """How one task's run of a step ended, as it recorded it in the logdir."""

    rank: int
    host: str
    status: int  # what it passed on
    stopped: bool  # it was stopped from outside (the step's end, a notice): not the cause
    why: str
    at: float  # time.time() of its end
    # Its worker's last session, the step of its last beat and its pid, for the ledger's
    # line of the group (``_logdir/groups``); None: it never beat.
    session: str | None = None
    step: int | None = None
    pid: int | None = None
    chief: bool = False  # its worker's session was the chief's (whose end the ledger keeps)

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def from_json(cls, data: bytes) -> MemberEnd:
        found = json.loads(data)
        return cls(
            rank=int(found["rank"]), host=str(found["host"]), status=int(found["status"]),
            stopped=bool(found["stopped"]), why=str(found["why"]), at=float(found["at"]),
            session=_optional(found.get("session"), str), step=_optional(found.get("step"), int),
            pid=_optional(found.get("pid"), int), chief=found.get("chief") is True,
        )  # fmt: skip


def _optional(value: object, kind: type) -> Any:
    return kind(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def member_prefix(run: str, attempt: str) -> str:
    """The names of one attempt's records: ``member_prefix(...) + str(rank)``."""
    return f"{MEMBER_PREFIX}{run}-{attempt}-"


def group_status(
    ends: Sequence[MemberEnd], tasks: int, step_status: int, stopping: bool = False
) -> tuple[int, str]:
    """The status of a step from its tasks' recorded ends: the one decision.

    srun's own status is the highest of its tasks', so a task that failed (1) beside one
    that the step's end stopped (42) reads as a preemption. The cause is the task that
    ended on its own (not stopped), the earliest of the worst; a task that left no record
    (its node, or its run, was lost) counts as a failure among them, and is the cause
    when the others only lost their peer or hung (a lost node's peers wait in a
    collective until their watchdog ends them: they are its consequence). When every
    task that recorded its end was stopped: their common status if the run asked for the
    stop (``stopping``: a task cut off then changes nothing), else a lost task is the
    cause.
    """
    from .._outcome import Outcome
    from .statuses import outcome_of, worst_outcome

    if not ends:  # no task's run got as far as its end (srun could not start the step)
        return step_status, f"the step ended {step_status} and no worker recorded its end"
    missing = sorted(set(range(tasks)) - {e.rank for e in ends})
    lost = f"worker {missing[0]} left no end (its node or its run was lost)" if missing else ""
    own = [e for e in ends if not e.stopped]
    peers_of_the_lost = (Outcome.LOST_PEER, Outcome.STUCK)
    # Those that ended on their own, else (every one was stopped: SLURM stops the rest of
    # a job whose node failed) all of them: if each lost its peer or hung, they ended for
    # the lost task, stopped or not by then, whoever asked for the stop.
    considered = own or ends
    if missing and all(outcome_of(e.status) in peers_of_the_lost for e in considered):
        return 1, lost
    if own:
        worst = worst_outcome([*(e.status for e in own), *([1] if missing else [])])
        found = [e for e in own if outcome_of(e.status) is worst]
        if not found:  # the lost task is the worst of them
            return 1, lost
        cause = min(found, key=lambda e: e.at)
        return cause.status, f"worker {cause.rank} on {cause.host}: {cause.why}"
    if missing and not stopping:
        return 1, lost
    worst = worst_outcome(e.status for e in ends)
    first = min((e for e in ends if outcome_of(e.status) is worst), key=lambda e: e.at)
    return first.status, f"every worker was stopped (worker {first.rank}: {first.why})"


def cause_rank(ends: Sequence[MemberEnd], tasks: int, status: int) -> int | None:
    """The worker ``group_status`` named as the cause of a step that ended ``status``: the
    earliest of those that ended on their own with its outcome, else a task that left no
    end; ``None`` when the step did not fail (done, preempted, interrupted)."""
    from .._outcome import Outcome
    from .statuses import outcome_of

    if outcome_of(status) in (Outcome.DONE, Outcome.PREEMPTED, Outcome.INTERRUPTED):
        return None
    own = [e for e in ends if not e.stopped and outcome_of(e.status) is outcome_of(status)]
    if own:
        return min(own, key=lambda e: e.at).rank
    missing = sorted(set(range(tasks)) - {e.rank for e in ends})
    return missing[0] if missing and ends else None


# -- the step's process under the outer run ---------------------------------------------------


def run_step(argv: Sequence[str]) -> int:
    """The outer run's child: run ``srun ARGV...`` and pass a stop on as SLURM means it.

    srun takes SIGTERM as "kill the step": its tasks get SIGKILL after a few seconds, with
    no final checkpoint. A stop (SIGTERM or SIGINT here, the outer run's stop signal) is
    therefore sent as ``scancel --signal=TERM $SLURM_JOB_ID``: SIGTERM to every process of
    the job's steps (each task's run and its worker: their graceful stop), the batch
    script left out; srun then ends when its tasks have. A second SIGINT kills the step.
    """
    import os
    import signal as _signal
    import sys

    job = os.environ.get("SLURM_JOB_ID", "")
    asked = {"count": 0}
    procs: list[subprocess.Popen[bytes]] = []

    def stop(signum: int, _frame: object) -> None:
        asked["count"] += 1
        if asked["count"] > 1 and signum == _signal.SIGINT:
            for proc in procs:
                proc.kill()
            return
        if asked["count"] == 1 and job:
            subprocess.Popen(
                ["scancel", f"--signal={_signal.Signals(signum).name.removeprefix('SIG')}",
                 "--quiet", job],
                stdout=subprocess.DEVNULL, stderr=sys.stderr,
            )  # fmt: skip

    for sig in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGUSR1):
        _signal.signal(sig, stop)  # before srun starts: no stop is lost in between
    proc = subprocess.Popen(list(argv))
    procs.append(proc)
    while True:
        try:
            returncode = proc.wait()
            break
        except InterruptedError:  # pragma: no cover (PEP 475 retries)
            continue
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":  # python -m asupervisor._run.slurm srun ...
    import sys

    sys.exit(run_step(sys.argv[1:]))
