"""What a SLURM job leaves in its ledger, on a real two-node cluster (tests/slurm_cluster.py):
``asupervisor run --slurm``'s outer run writes, after each attempt of its step, how every
worker ended and on which node, which one failed first, SLURM's job id and restart count;
``asupervisor inspect`` shows the group's attempts. Tiny workers (no TensorFlow), started
cold, as in tests/test_slurm_jobs.py: the hosts the ledger holds come from processes
started on the nodes themselves."""

from __future__ import annotations

import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from asupervisor._logdir import groups as _groups
from asupervisor._logdir import ledger as _ledger
from asupervisor._logdir.store import Store
from asupervisor.cli import main
from tests.slurm_cluster import Cluster
from tests.test_run import SESSIONS
from tests.test_slurm_jobs import starts, submit, wait_for_end


def test_the_ledger_holds_each_attempts_workers_their_nodes_the_first_to_fail_and_slurms_facts(
    slurm: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Attempt 1: the worker on n2 fails; the chief on n1 (a session at step 7, as its
    # channel tells) does not end when the step is stopped, and SLURM kills it (KillWait).
    # Attempt 2 runs until a notice (exit 42), SLURM requeues the job, and its first
    # attempt is done.
    worker = """
        if restart == 0 and attempt == 1 and rank == 0:
            tell(began("s0"), beat("s0", 7))
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # held: SLURM kills it
        if restart == 0 and attempt == 1 and rank == 1:
            while not os.path.exists(os.path.join(out, "start-0-1-0")):
                time.sleep(0.05)  # the worker on n1 runs: the crash ends a running group
            time.sleep(0.5)  # and its beat has reached its run
            sys.exit(1)
        if restart == 0:
            time.sleep(600)  # until the step's end, or the notice
    """
    job = submit(
        slurm, tmp_path, textwrap.dedent(SESSIONS) + textwrap.dedent(worker),
        "--backoff", "0", "--grace", "10",
    )  # fmt: skip
    out = tmp_path / "out"
    for _ in range(1500):  # attempt 2 runs on both nodes: the notice reaches a running step
        if len(list(out.glob("start-0-2-*"))) == 2:
            break
        time.sleep(0.2)
    notice = subprocess.run(
        ["scancel", "--batch", "--signal=USR1", job],
        env=dict(slurm.env), capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert notice.returncode == 0, notice.stderr
    log = tmp_path / "job.log"
    state = wait_for_end(slurm, job, log)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), log.read_text()
    assert len(starts(out)) == 6

    logdir = str(tmp_path / "run")
    found = _groups.groups(_ledger.read(Store(logdir)))
    assert [(g.slurm_job, g.slurm_restart, g.attempt, g.status) for g in found] == [
        (job, 0, 1, 1), (job, 0, 2, 42), (job, 1, 1, 0),
    ], log.read_text()  # fmt: skip
    crashed = {w.rank: w for w in found[0].workers}
    assert (crashed[1].host, crashed[1].status, crashed[1].first) == ("n2", 1, True)
    killed = (crashed[0].host, crashed[0].status, crashed[0].stopped, crashed[0].first)
    assert killed == ("n1", 137, True, False)
    assert (crashed[0].session, crashed[0].step) == ("s0", 7)
    assert crashed[0].how == "killed before its end was recorded (after the step's stop)"
    assert found[0].cause.startswith("worker 1 on n2")
    # The chief's session, killed with its run, has its end in the ledger all the same.
    (chief,) = _ledger.sessions(_ledger.read(Store(str(tmp_path / "run"))))
    assert (chief.session, chief.host, chief.step, chief.exit_status) == ("s0", "n1", 7, 137)
    assert chief.recorded_by == "runner"
    for group in found[1:]:  # a notice and a clean end: nobody failed
        assert group.first is None
        assert sorted((w.rank, w.host) for w in group.workers) == [(0, "n1"), (1, "n2")]
    assert len({g.run for g in found}) == 2  # the requeued job is a new run

    capsys.readouterr()
    assert main(["inspect", "--no-verify", logdir]) == 0  # a ledger alone: tiny workers save none
    shown = capsys.readouterr().out.splitlines()
    assert f"group: 2 workers on n1, n2; 3 attempts; SLURM job {job} (requeued 1 times)" in shown
    at = shown.index("group attempts (3; from asupervisor-ledger.jsonl):")
    rows = [line.split() for line in shown[at + 2 : at + 8]]
    workers = [(r[0], r[1], " ".join(r[2:4]) if r[2] == "*" else r[2]) for r in rows]
    assert workers == [
        ("1", f"{job}.0", "0"), ("1", f"{job}.0", "* 1"), ("2", f"{job}.0", "0"),
        ("2", f"{job}.0", "1"), ("1", f"{job}.1", "0"), ("1", f"{job}.1", "1"),
    ]  # fmt: skip
    assert rows[1][4] == "n2"  # the first to fail, on its node


def test_health_on_each_node_reads_that_nodes_own_heartbeat_file(
    slurm: Cluster, tmp_path: Path
) -> None:
    # One path with {host} on the file system the nodes share (ASUPERVISOR_HEARTBEAT): the
    # worker on n1 beats, the one on n2 stopped beating ten minutes ago.
    import sys

    from asupervisor._kinds import Phase
    from asupervisor._logdir import heartbeat as _heartbeat

    now = time.time()
    for host, written in (("n1", now), ("n2", now - 600)):
        beat = _heartbeat.Beat(
            pid=1, host=host, session=host, chief=host == "n1", worker=None,
            phase=Phase.RUNNING, first_step_done=True, step=7, restored_step=0,
            interval_secs=1.0, started_at=written - 60, written_at=written, busy_since=None,
            job=None, last_step_at=written, last_commit_step=None, last_commit_at=None,
        )  # fmt: skip
        _heartbeat.write_local(str(tmp_path / f"beat-{host}.json"), beat.to_json())
    probe = (
        f"{sys.executable} -m asupervisor health '{tmp_path}/beat-{{host}}.json' --max-age 60 "
        '>/dev/null 2>&1; echo "$(hostname) $?"'
    )
    done = subprocess.run(
        ["srun", "-N2", "-n2", "sh", "-c", probe],
        env={**slurm.env, "PYTHONPATH": str(Path(__file__).parents[1])},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert sorted(done.stdout.split("\n")[:2]) == ["n1 0", "n2 1"], done.stdout + done.stderr
