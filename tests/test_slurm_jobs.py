"""``asupervisor run --slurm`` on a real two-node SLURM cluster (tests/slurm_cluster.py):
the job runs as one step of a task per node, each task's worker with its TF_CONFIG from
SLURM's environment; a failed step is started again inside the allocation, every worker
together, with the outer run's identity. Tiny workers (no TensorFlow) speak what a real
one would: their exit statuses. They start cold (``python worker.py`` under each task's
run, SLURM's environment and the node's host name their own): the cold start of a
command under SLURM stays pinned here and in tests/test_slurm_ledger.py, cheaply, while
the faults of a real TensorFlow job (a notice and SLURM's requeue among them), whose
trainers are forked from the suite's fork server, are tests/test_slurm_faults.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import Cluster

ROOT = Path(__file__).parents[1]

# Each worker writes one line per start: its rank, node, attempt, run id, TF_CONFIG and
# SLURM's restart count; what it does next is the test's.
WORKER = """
    import json, os, signal, socket, sys, time
    out = sys.argv[1]
    rank = int(os.environ["SLURM_PROCID"])
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    attempt = int(os.environ["ASUPERVISOR_ATTEMPT"])
    line = json.dumps({
        "rank": rank, "node": socket.gethostname(), "attempt": attempt,
        "run": os.environ["ASUPERVISOR_RUN"], "tf_config": json.loads(os.environ["TF_CONFIG"]),
        "job": os.environ["SLURM_JOB_ID"], "restart": restart,
    })
    with open(os.path.join(out, f"start-{restart}-{attempt}-{rank}"), "w") as f:
        f.write(line)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))  # a final save, then preempted
    signal.signal(signal.SIGUSR1, lambda *_: sys.exit(42))
"""


def submit(slurm: Cluster, tmp_path: Path, worker: str, *run_args: str) -> str:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER) + textwrap.dedent(worker))
    batch = tmp_path / "job.sh"
    # exec: the batch shell becomes the outer run, which hears the batch's signals.
    batch.write_text(
        "#!/bin/sh\n"
        f"exec {sys.executable} -m asupervisor run --slurm --logdir {tmp_path / 'run'} "
        f"{' '.join(run_args)} -- {sys.executable} {script} {out}\n"
    )
    env = {**slurm.env, "PYTHONPATH": str(ROOT)}
    for name in ("ASUPERVISOR_RUN", "ASUPERVISOR_ATTEMPT", "ASUPERVISOR_CHANNEL", "TF_CONFIG"):
        env.pop(name, None)
    done = subprocess.run(
        # Appended: a requeued job's run writes on after the run before it.
        ["sbatch", "--parsable", "-N2", "--requeue", "--open-mode=append", "-o",
         str(tmp_path / "job.log"), str(batch)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_state(slurm: Cluster, job: str) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "show", "job", job, "-o"],
        env=dict(slurm.env), capture_output=True, text=True, timeout=30, check=False,
    ).stdout  # fmt: skip
    return dict(w.split("=", 1) for w in shown.split() if "=" in w)


def over(state: dict[str, str]) -> bool:
    """The job has ended for good: not one that exited 42 and is about to be requeued
    (SLURM shows it COMPLETED for a moment before it requeues it)."""
    ended = state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    requeuing = state.get("ExitCode", "").startswith("42:") and state.get("Requeue") == "1"
    return ended and not requeuing


def wait_for_end(slurm: Cluster, job: str, log: Path) -> dict[str, str]:
    """Bounded by what happens: the controller's state of the job, until it is over."""
    for _ in range(1500):
        state = job_state(slurm, job)
        if over(state):
            return state
        time.sleep(0.2)
    raise AssertionError(f"job {job} did not end: {state}\n{log.read_text()}")


def wait_for_state(slurm: Cluster, job: str, state: str) -> None:
    """Until the controller shows the job in ``state`` (bounded)."""
    for _ in range(600):
        if job_state(slurm, job).get("JobState") == state:
            return
        time.sleep(0.1)
    raise AssertionError(f"job {job} never {state}: {job_state(slurm, job)}")


def starts(out: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("start-*"))]


def test_a_failed_step_is_started_again_in_the_allocation_every_worker_together(
    slurm: Cluster, tmp_path: Path
) -> None:
    job = submit(
        slurm, tmp_path,
        """
        if attempt == 1 and rank == 1:
            while not os.path.exists(os.path.join(out, "start-0-1-0")):
                time.sleep(0.05)  # the worker on n1 runs: the crash ends a running group
            sys.exit(1)  # a crash on n2: the step ends, no worker restarts alone
        if attempt == 1:
            time.sleep(600)
        """,
        "--backoff", "0", "--grace", "10",
    )  # fmt: skip
    log = tmp_path / "job.log"
    state = wait_for_end(slurm, job, log)
    assert state["JobState"] == "COMPLETED", log.read_text()
    assert state["Restarts"] == "0"  # inside the allocation: never requeued
    seen = starts(tmp_path / "out")
    assert [(s["attempt"], s["rank"], s["node"]) for s in seen] == [
        (1, 0, "n1"), (1, 1, "n2"), (2, 0, "n1"), (2, 1, "n2"),
    ]  # fmt: skip
    assert len({s["run"] for s in seen}) == 1  # the outer run's identity, in every task
    for s in seen:
        config = s["tf_config"]
        assert isinstance(config, dict)
        hosts = [w.rsplit(":", 1)[0] for w in config["cluster"]["worker"]]
        assert hosts == ["127.0.0.1", "127.0.0.2"]  # SLURM's NodeAddr: n1, n2 do not resolve
        assert config["task"] == {"type": "worker", "index": s["rank"]}
    text = log.read_text()
    assert text.count("run.restart_left_to_engine") == 1, text  # the task on n2, once
    assert "run.restarting attempt=2" in text and "run.ended status='0 (done)'" in text


def test_a_permanent_failure_ends_the_job_with_no_restart_and_no_requeue(
    slurm: Cluster, tmp_path: Path
) -> None:
    """A worker that fails permanently (78: bad configuration, a NaN loss, a model that
    does not fit its checkpoint) ends its step, and no restart could change it: the run
    does not start the step again and exits 78, which SLURM does not requeue (only
    RequeueExit=42 is): the job ends FAILED, its cause in the ledger."""
    from asupervisor._logdir import groups as _groups
    from asupervisor._logdir import ledger as _ledger
    from asupervisor._logdir.store import Store

    job = submit(
        slurm, tmp_path,
        """
        if rank == 1:
            while not os.path.exists(os.path.join(out, f"start-{restart}-{attempt}-0")):
                time.sleep(0.05)  # the worker on n1 runs: the failure ends a running group
            sys.exit(78)
        time.sleep(600)
        """,
        # --requeue too: it requeues a preempted job only, never a failed one.
        "--backoff", "0", "--grace", "10", "--requeue",
    )  # fmt: skip
    log = tmp_path / "job.log"
    state = wait_for_end(slurm, job, log)
    text = log.read_text()
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == (
        "FAILED", "0", "78:0"
    ), text  # fmt: skip
    assert "run.requeue" not in text, text
    seen = starts(tmp_path / "out")
    assert [(s["attempt"], s["rank"]) for s in seen] == [(1, 0), (1, 1)], text  # not again
    (group,) = _groups.groups(_ledger.read(Store(str(tmp_path / "run"))))
    assert group.status == 78 and group.first is not None, group
    assert (group.first.rank, group.first.host) == (1, "n2"), group
    assert "run.restarting" not in text, text


def wait_for_first_run(slurm: Cluster, job: str, out: Path, log: Path) -> None:
    """Until both workers of the job's first run started (bounded by the job's end)."""
    for _ in range(600):
        if (out / "start-0-1-0").exists() and (out / "start-0-1-1").exists():
            return
        assert not over(job_state(slurm, job)), log.read_text()
        time.sleep(0.1)
    raise AssertionError(f"the first run of job {job} did not start\n{log.read_text()}")


def test_with_requeue_a_preempted_job_requeues_itself_where_the_site_does_not(
    slurm: Cluster, tmp_path: Path
) -> None:
    """``--requeue``: a run that ends preempted (the notice, every worker stopped after
    its final save) asks SLURM to requeue its job (``scontrol requeue``), for a cluster
    whose slurm.conf has no ``RequeueExit=42``. Here the run's 42 is shown to SLURM as 143
    (a status map), which this cluster's ``RequeueExit=42`` does not read: only the run's
    own request can requeue it. Requeued once, the job runs again and ends done."""
    job = submit(
        slurm, tmp_path,
        """
        if restart == 0:
            time.sleep(600)  # until the notice: SIGTERM, 42 (the prologue's handler)
        """,
        "--backoff", "0", "--grace", "10", "--requeue", "--exit-status-map", "preempted=143",
    )  # fmt: skip
    out, log = tmp_path / "out", tmp_path / "job.log"
    wait_for_first_run(slurm, job, out, log)
    subprocess.run(
        ["scancel", "--batch", "--signal=USR1", job], env=dict(slurm.env), timeout=30,
        check=True,
    )  # fmt: skip
    state = wait_for_end(slurm, job, log)
    text = log.read_text()
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == (
        "COMPLETED", "1", "0:0"
    ), text  # fmt: skip
    seen = starts(out)
    assert [(s["restart"], s["rank"]) for s in seen] == [(0, 0), (0, 1), (1, 0), (1, 1)], text
    assert f"run.requeueing slurm_job={job}" in text, text


def test_with_requeue_a_job_a_person_cancelled_is_left_ended(
    slurm: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain ``scancel`` stops the run as a notice does (every worker's final save, 42);
    where SLURM gives the batch script time to end, the run then decides on its requeue.
    It asks SLURM first: a job no longer running (cancelled) is left ended, not brought
    back."""
    from asupervisor._run.slurm import requeue

    batch = tmp_path / "sleeps.sh"
    batch.write_text("#!/bin/sh\nsleep 600\n")
    done = subprocess.run(
        ["sbatch", "--parsable", "-N1", "--requeue", "-o", os.devnull, str(batch)],
        env=dict(slurm.env), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    job = done.stdout.strip().split(";")[0]
    wait_for_state(slurm, job, "RUNNING")
    subprocess.run(["scancel", job], env=dict(slurm.env), timeout=30, check=True)
    wait_for_state(slurm, job, "CANCELLED")
    for name, value in slurm.env.items():
        monkeypatch.setenv(name, value)  # the run's scontrol talks to this cluster
    assert requeue(job) == "the job is CANCELLED, not running"
    state = job_state(slurm, job)
    assert (state["JobState"], state["Restarts"]) == ("CANCELLED", "0"), state
