"""The tests' SLURM cluster (tests/slurm_cluster.py) is a real one: a step of two tasks runs
one task on each node, each node with its own host name; a batch job that exits 42 is
requeued by SLURM itself (``RequeueExit=42``) and runs again with ``SLURM_RESTART_COUNT``;
``down`` ends every process the cluster started. Skipped, with the reason in one line, on a
machine that cannot run it (not root, SLURM not installed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forked
from tests.slurm_cluster import Cluster, alive, in_namespaces, unavailable, uts_namespace

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")


def run(slurm: Cluster, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=dict(slurm.env), capture_output=True, text=True, timeout=timeout, check=False
    )


def test_a_step_of_two_tasks_runs_one_on_each_node_with_its_own_host_name(
    slurm: Cluster,
) -> None:
    done = run(slurm, "srun", "-N2", "-n2", "-K1", "sh", "-c", 'echo "$SLURM_PROCID $(hostname)"')
    assert done.returncode == 0, done.stderr + slurm.logs()
    assert sorted(done.stdout.split("\n")[:2]) == ["0 n1", "1 n2"], done.stdout


def test_a_trainer_forked_for_a_shim_on_a_node_is_one_of_the_nodes_processes(
    slurm: Cluster,
) -> None:
    """tests/forkshim.py on each node of a step: what the suite's fork server forks for it
    has the node's host name and is in the node's UTS namespace (a lost node's SIGKILL
    reaches it), as a cold start there would be (tests/test_slurm_faults.py's trainers).
    Cold, and so the same, without a shared server (pytest without ``-n``)."""
    code = (
        "import os, socket; "
        "parent = open(f'/proc/{os.getppid()}/cmdline').read().replace(chr(0), ' '); "
        "print(os.environ['SLURM_PROCID'], socket.gethostname(), "
        "os.readlink('/proc/self/ns/uts'), 'forkserver.py' in parent)"
    )
    done = run(
        slurm, "srun", "-N2", "-n2", "-K1", sys.executable, "-I", str(forked.SHIM), "-c", code
    )
    assert done.returncode == 0, done.stderr + slurm.logs()
    pids = slurm.pids()
    shared = bool(os.environ.get(forked.ENV_SHARED))
    assert sorted(done.stdout.splitlines()) == [
        f"{rank} {name} {uts_namespace(pids[name])} {shared}"
        for rank, name in enumerate(("n1", "n2"))
    ], done.stdout + done.stderr


def test_a_batch_job_that_exits_42_is_requeued_and_runs_again(
    slurm: Cluster, tmp_path: Path
) -> None:
    out = tmp_path / "runs.txt"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "${{SLURM_JOB_ID}} ${{SLURM_RESTART_COUNT:-0}}" >> {out}\n'
        '[ "${SLURM_RESTART_COUNT:-0}" -ge 1 ] && exit 0\n'
        "exit 42\n"
    )
    submitted = run(slurm, "sbatch", "--parsable", "--requeue", "-o", "/dev/null", str(script))
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    # Bounded by what happens: the job's state, read from the controller, until it is over.
    state = ""
    for _ in range(600):
        shown = run(slurm, "scontrol", "show", "job", job, "-o").stdout
        state = next((w for w in shown.split() if w.startswith("JobState=")), "")
        # SLURM shows a job that exited 42 COMPLETED for a moment before it requeues it.
        requeuing = "ExitCode=42:0" in shown.split()
        if state in ("JobState=COMPLETED", "JobState=FAILED", "JobState=CANCELLED") and not (
            requeuing
        ):
            break
        time.sleep(0.2)
    assert state == "JobState=COMPLETED", shown + slurm.logs()
    assert "Restarts=1" in shown
    assert out.read_text().split("\n")[:2] == [f"{job} 0", f"{job} 1"]


# A cluster of its own, beside the suite's: other node names and addresses, other job ids.
OWN_NODES = (("m1", "127.0.0.5"), ("m2", "127.0.0.6"))


def test_down_ends_every_process_the_cluster_started(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "own", OWN_NODES, (("debug", ("m1", "m2")),), first_job=100000)
    c.up()
    c.up()  # idempotent: a cluster that is up is left as it is
    pids = dict(c.pids())
    namespaces = {uts_namespace(pids[name]) for name, _ in OWN_NODES}
    sleeper = run(c, "srun", "-N2", "-n2", "--immediate=10", "true")  # a step ran on each
    assert sleeper.returncode == 0, sleeper.stderr
    c.down()
    assert not [name for name, pid in pids.items() if alive(pid)]
    assert [p for p in in_namespaces(namespaces) if alive(p)] == []
    assert not c.running()
