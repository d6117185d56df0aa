"""``python benchmarks/goodput.py --slurm``: the six faults of the goodput benchmark on a
two-node SLURM cluster, one two-worker MultiWorkerMirroredStrategy job under
``asupervisor run --slurm --standby`` (its step restarted inside the allocation; a notice
requeues the job).

The cluster is the test suite's (``tests/slurm_cluster.py``): ``ASV_SLURM_DIR`` names a
running one, as the tests use it; without it one is brought up for the benchmark. The
same trainer as on one host (``goodput_trainer.py asv-mw``: the same model and global
batch, split between the two workers) runs once without faults and once under the same
seeded schedule: three SIGKILLs, one step that
raises, one hang, each to the worker on the second node, and one notice to the batch
script (``scancel --batch --signal=USR1``: the agreed final save, exit 42, SLURM's
requeue). Times are from the batch script's first start (the queue wait before it is not
the job's). What each fault cost is split as on one host (``goodput.fault_costs``):
``notice`` runs from the fault to the next worker process's start, and holds the engine's
restart of the step: the failed task's end, srun's end of the step (the tasks it stopped,
killed after ``KillWait``), the outer run's new step, its tasks' standbys importing
TensorFlow again and forking (and for the notice the final save, the exit, SLURM's
requeue and the batch script's new start). Each fault's floor holds a cold start of the
job (every restart is a new step, with new processes on every node), measured in the
fault-free run from the batch script's start to the first worker's imports.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import goodput as g

SCANCEL_SECS = 30.0
SLURM_STUCK_AFTER = 20.0  # --stuck-after at least this (a hang's floor holds it)
SLURM_STALL_SECS = 240.0  # a run cut for no step at least this long after the last


@contextlib.contextmanager
def cluster_env() -> Iterator[dict[str, str]]:
    """The environment SLURM's commands need: for the cluster ``ASV_SLURM_DIR`` names (a
    running one, left running), else for one brought up for the benchmark and ended
    after it (the test suite's script: root and Debian's ``slurm-wlm`` and ``munge``)."""
    sys.path.insert(0, str(g.ROOT))
    from tests import slurm_cluster

    place = os.environ.get(slurm_cluster.SHARED_ENV)
    if place:
        yield {**slurm_cluster.Cluster(Path(place)).env, "PYTHONPATH": str(g.ROOT)}
        return
    why = slurm_cluster.unavailable()
    if why:
        raise SystemExit(f"--slurm: no SLURM cluster can run here: {why}")
    cluster = slurm_cluster.Cluster(Path(tempfile.mkdtemp(prefix="goodput-slurm-cluster-")))
    cluster.up()
    try:
        yield {**cluster.env, "PYTHONPATH": str(g.ROOT)}
    finally:
        cluster.down()


def submit(workdir: str, args: argparse.Namespace, env: dict[str, str]) -> str:
    logdir = os.path.join(workdir, "logdir")
    trainer = [sys.executable, str(g.TRAINER), "asv-mw", workdir, "--steps", str(args.steps),
               "--save-steps", str(args.save_steps)]  # fmt: skip
    run = [sys.executable, "-m", "asupervisor", "run", "--slurm", "--standby", "--logdir",
           logdir, "--stuck-after", str(args.stuck_after), "--startup-timeout", "300",
           "--grace", str(g.PREEMPT_GRACE - 5), "--backoff", "0", "--max-failures", "10",
           "--", *trainer]  # fmt: skip
    batch = Path(workdir, "job.sh")
    # Each start of the batch script (the first, and one per requeue) is timed; exec: the
    # script becomes the outer run, which hears the notice.
    batch.write_text(
        "#!/bin/sh\n"
        f"{sys.executable} -c 'import time; print(time.time())' >> {workdir}/batch-starts\n"
        f"exec {' '.join(run)}\n"
    )
    done = subprocess.run(
        ["sbatch", "--parsable", "-N2", "--requeue", "--open-mode=append", "-o",
         os.path.join(workdir, "job.log"), str(batch)],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.strip().split(";")[0]


def job_started(workdir: str) -> float | None:
    try:
        return float(Path(workdir, "batch-starts").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def job_over(job: str, env: dict[str, str]) -> bool:
    shown = subprocess.run(
        ["scontrol", "show", "job", job, "-o"],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    ).stdout  # fmt: skip
    state = dict(w.split("=", 1) for w in shown.split() if "=" in w)
    ended = state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    requeuing = state.get("ExitCode", "").startswith("42:") and state.get("Requeue") == "1"
    return ended and not requeuing  # no answer (a busy controller): not over


def run(
    schedule: list[tuple[float, str]],
    budget: float,
    args: argparse.Namespace,
    keep: str,
    env: dict[str, str],
    cold: float | None = None,
) -> g.Result:
    workdir = tempfile.mkdtemp(prefix="goodput-slurm-", dir=args.slurm_workdir)
    result = g.Result("asv-slurm", bool(schedule))
    delivered: list[g.Fault] = []
    job = submit(workdir, args, env)
    pending = list(schedule)
    waiting: list[tuple[str, float, int]] = []
    faulted: set[int] = set()
    began: float | None = None
    try:
        while True:
            started = job_started(workdir)
            if started is None:  # queued behind other jobs: not the job's time
                time.sleep(0.2)
                continue
            began = started
            now = time.time() - began
            if Path(workdir, "done").exists() and job_over(job, env):
                result.finished = True
                break
            if now > budget or job_over(job, env):
                break
            if now - g.last_progress(workdir, time.monotonic() - now) > args.stall_secs:
                result.stalled = True
                break
            current = g.trainer_pid(workdir, "pid-1")  # the worker on the second node
            if current is not None:
                for kind, at, pid in list(waiting):
                    if current[0] != pid:
                        result.recoveries.append((kind, current[1] - at))
                        waiting.remove((kind, at, pid))
            if pending and now >= pending[0][0] and current is not None:
                pid = current[0]
                if g.alive(pid) and pid not in faulted:
                    _, kind = pending.pop(0)
                    faulted.add(pid)
                    waiting.append((kind, time.time(), pid))
                    delivered.append(g.Fault(kind, time.time(), pid))
                    deliver(kind, pid, job, env)
            time.sleep(0.05)
        result.wall = (
            Path(workdir, "done").stat().st_mtime - began
            if result.finished and began is not None
            else budget
        )
        result.restarts = len(Path(workdir, "batch-starts").read_text().split()) - 1
    finally:
        subprocess.run(["scancel", "--quiet", job], env=env, timeout=SCANCEL_SECS, check=False)
        time.sleep(0.5)
        logdir = os.path.join(workdir, "logdir")  # as submit gives it to the job
        result.productive = g.productive_steps("asv", g.Where(workdir, logdir, None), args)
        result.speed = g.training_speed(workdir)
        if began is not None:
            result.cold_start = g.cold_start(workdir, began)
            costs = g.fault_costs("asv-slurm", delivered, workdir, began, cold, args)
            result.costs = [with_step_restart(row, cold) for row in costs]
        kept = os.path.join(keep, f"slurm-{'faults' if schedule else 'clean'}.log")
        with contextlib.suppress(OSError):
            shutil.copy(os.path.join(workdir, "job.log"), kept)
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def with_step_restart(row: dict[str, object], cold: float | None) -> dict[str, object]:
    """A fault's row with the engine's restart of the step in its floor: every restart is
    a new step, new processes on every node (a new standby: TensorFlow imported again),
    which costs at least a cold start of the job, measured in its fault-free run (the
    notice's floor holds one already)."""
    floor, over = row.get("floor s"), row.get("over floor s")
    if row["fault"] == "preempt" or cold is None:
        return row
    if not isinstance(floor, float) or not isinstance(over, float):
        return row
    return row | {"floor s": round(floor + cold, 2), "over floor s": round(over - cold, 2)}


def deliver(kind: str, pid: int, job: str, env: dict[str, str]) -> None:
    if kind == "preempt":  # the notice: SLURM's --signal=B:USR1, or a person's
        subprocess.run(
            ["scancel", "--batch", "--signal=USR1", job],
            env=env, timeout=SCANCEL_SECS, check=False,
        )  # fmt: skip
    else:
        os.kill(pid, {"kill": signal.SIGKILL, "exception": signal.SIGUSR2, "hang": g.HANG}[kind])


def main(args: argparse.Namespace) -> None:
    with cluster_env() as env:
        measure(args, env)


def measure(args: argparse.Namespace, env: dict[str, str]) -> None:
    # Two workers on nodes that share two cores with everything else: a step of the job
    # that waits for its peer's takes longer than one process's; a restart is a cold start.
    args.stuck_after = max(args.stuck_after, SLURM_STUCK_AFTER)
    args.stall_secs = max(args.stall_secs, SLURM_STALL_SECS)
    keep = args.logs or tempfile.mkdtemp(prefix="goodput-slurm-logs-")
    os.makedirs(keep, exist_ok=True)
    clean = run([], 10**6, args, keep, env)
    print(
        f"slurm: fault-free {clean.wall:.1f} s, {clean.rate:.1f} steps/s, cold start "
        f"{clean.cold_start or float('nan'):.1f} s",
        flush=True,
    )
    schedule = g.make_schedule(clean.wall, args.seed)
    print("schedule: " + ", ".join(f"{kind} at {at:.0f} s" for at, kind in schedule), flush=True)
    faulted = run(schedule, args.budget * clean.wall, args, keep, env, clean.cold_start)
    print(
        f"slurm: with faults {faulted.wall:.1f} s, {faulted.productive} productive steps, "
        f"finished {faulted.finished}, requeues {faulted.restarts}",
        flush=True,
    )
    print("\n| fault | " + " | ".join(k for k in faulted.costs[0] if k not in ("system", "fault"))
          + " |" if faulted.costs else "")  # fmt: skip
    for row in faulted.costs:
        print("| " + " | ".join(str(v) for k, v in row.items() if k != "system") + " |")
    print(f"\nlogs: {keep}")
    from _results import write

    name = "two workers on two SLURM nodes: `asupervisor run --slurm --standby` + `sess.train`"
    write(
        "goodput_slurm",
        [{**g.summary_row(name, clean, faulted), "requeues": faulted.restarts}],
        steps=args.steps,
        save_steps=args.save_steps,
        faults=[[kind, round(at)] for at, kind in schedule],
        load=g.load(),
        costs=faulted.costs,
    )
