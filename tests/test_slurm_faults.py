"""Faults of a real multi-worker TensorFlow job on the real two-node SLURM cluster
(tests/slurm_cluster.py): ``examples/slurm/train.sbatch``, the batch script the docs
show, runs tests/faults/deterministic.py as a MultiWorkerMirroredStrategy job of one
worker per node (n1, n2; data auto-sharded by ``experimental_distribute_dataset``) under
``asupervisor run --slurm``. The faults come from the workers' ``--faults`` plan at given
steps (a SIGKILL, a hung step, a crash, a slow stretch for a signal to land in) or from
outside (``scancel --signal``, the time limit's warning, a node lost).

Each test decides from facts on disk: the marks the faults leave, the chief's ledger, the
workers' records of the steps they trained and the checkpoints they restored, the final
state and SLURM's own view of the job (``scontrol show job``).

The workers' trainers are forked from the suite's fork server (``tests/forkshim.py``
stands in for each under its task's run; cold without a shared server: pytest without
``-n``): every attempt of every step starts both again, and a cold start imports
TensorFlow each time. What the faults rely on holds through the shim: the trainer joins
its node's UTS namespace (the node's host name; a lost node's SIGKILL reaches it), the
signals SLURM and the runs send (a notice, the time limit's warning, a stop) reach it
through the shim, and a shim SIGKILLed (srun ending a failed step, a run killing its
child) has the server kill its trainer at once, before the next attempt starts. A cold
start under SLURM stays pinned by tests/test_slurm_jobs.py and tests/test_slurm_ledger.py,
whose tiny workers start cold."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import forked
from tests.slurm_cluster import LOSS_PARTITION, Cluster
from tests.test_slurm_jobs import job_state, wait_for_end

ROOT = Path(__file__).parents[1]
BATCH = ROOT / "examples" / "slurm" / "train.sbatch"
PROGRAM = ROOT / "tests" / "faults" / "deterministic.py"
SAVE_STEPS = 7  # the save interval of the job, in steps: what a fault may lose at most
STEPS = 80  # deterministic.py's 4 epochs of 20 batches


@dataclass(frozen=True)
class Job:
    id: str
    dir: Path

    @property
    def run(self) -> Path:
        return self.dir / "run"

    @property
    def log(self) -> Path:
        return self.dir / "job.log"

    @property
    def marks(self) -> Path:
        return self.dir / "marks"

    @property
    def final(self) -> Path:
        return self.dir / "final.npz"

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else "(no log yet)"


def submit(
    slurm: Cluster,
    where: Path,
    faults: list[dict[str, object]],
    run_options: tuple[str, ...] = (),
    sbatch_options: tuple[str, ...] = (),
    worker_options: tuple[str, ...] = (),
) -> Job:
    """``sbatch examples/slurm/train.sbatch`` of the deterministic job, with its faults."""
    where.mkdir(parents=True, exist_ok=True)
    job = Job("", where)
    job.marks.mkdir(exist_ok=True)
    plan = where / "faults.json"
    plan.write_text(json.dumps({"marks": str(job.marks), "plan": faults}))
    env = {
        **slurm.env,  # with ASV_FORKSERVER, in a pytest-xdist run: the shim's server
        "PYTHONPATH": str(ROOT),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        # The batch script runs `asupervisor` and `python` of this interpreter's install.
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    for name in ("ASUPERVISOR_RUN", "ASUPERVISOR_ATTEMPT", "ASUPERVISOR_CHANNEL", "TF_CONFIG"):
        env.pop(name, None)
    argv = [
        "sbatch", "--parsable", "-o", str(job.log), *sbatch_options, str(BATCH),
        "--logdir", str(job.run), "--backoff", "0", "--grace", "20", *run_options,
        "--", *forked.runner_child(
            PROGRAM, str(job.run), "--record", str(where / "record"), "--final", str(job.final),
            "--faults", str(plan), *worker_options,
        ),
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return Job(done.stdout.strip().split(";")[0], where)


def wait_for_mark(slurm: Cluster, job: Job, name: str) -> None:
    """Until the fault ``name`` fired (its mark is on disk); bounded by the job's end."""
    for _ in range(3000):
        if (job.marks / name).exists():
            return
        state = job_state(slurm, job.id)
        assert state.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"), job.text()
        time.sleep(0.1)
    raise AssertionError(f"no {name} in {sorted(os.listdir(job.marks))}\n{job.text()}")


def scancel(slurm: Cluster, *args: str) -> None:
    done = subprocess.run(
        ["scancel", *args], env=dict(slurm.env), capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def restores(job: Job) -> list[list[int]]:
    """Each worker's restored steps, in order (what its record says at each start)."""
    return [
        [int(line.split()[1]) for line in path.read_text().splitlines() if line.startswith("r")]
        for path in sorted(job.dir.glob("record.*"))
    ]


def sessions(job: Job) -> list[object]:
    from asupervisor._logdir import ledger as _ledger
    from asupervisor._logdir.store import Store

    return list(_ledger.sessions(_ledger.read(Store(str(job.run)))))


def inspect(job: Job) -> str:
    """``asupervisor inspect`` of the job's logdir, run in this process: TensorFlow is
    imported here already (a process of its own would import it again, for a table; a
    cold ``inspect`` stays pinned by tests/test_cli.py and the nohup recipe)."""
    from asupervisor.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["inspect", str(job.run)])
    assert status == 0, out.getvalue()
    return out.getvalue()


@pytest.fixture
def left_alone(slurm: Cluster, tmp_path: Path) -> Job:
    """The job left alone, submitted as the test that compares with it begins (it waits
    for it at its end: meanwhile it runs beside it)."""
    return submit(slurm, tmp_path / "left-alone", [])


def scontrol(slurm: Cluster, *args: str) -> None:
    done = subprocess.run(
        ["scontrol", *args], env=dict(slurm.env), capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def wait_for_restarts(slurm: Cluster, job: Job, restarts: int) -> None:
    """Until SLURM has requeued the job ``restarts`` times (bounded by its end)."""
    for _ in range(3000):
        state = job_state(slurm, job.id)
        if int(state.get("Restarts", "0")) >= restarts:
            return
        assert state.get("JobState") not in ("FAILED", "CANCELLED", "TIMEOUT"), job.text()
        time.sleep(0.1)
    raise AssertionError(f"job {job.id} was not requeued {restarts} times\n{job.text()}")


WARN_SECS = 240  # the time limit's warning: this long before it


def run_secs(shown: str) -> int:
    """SLURM's ``RunTime`` (``[D-]HH:MM:SS``) in seconds."""
    days, _, clock = shown.rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


def step_ends(job: Job) -> list[tuple[int, str]]:
    """Each step's status and the worker that caused its end (``rank on host``, or "" if
    none failed), over requeues: the ledger's group lines, which the outer runs wrote."""
    from asupervisor._logdir import groups as _groups
    from asupervisor._logdir import ledger as _ledger
    from asupervisor._logdir.store import Store

    return [
        (g.status, f"{g.first.rank} on {g.first.host}" if g.first else "")
        for g in _groups.groups(_ledger.read(Store(str(job.run))))
    ]


def ended_as(slurm: Cluster, job: Job, state: str, restarts: str, exit_code: str) -> str:
    """Once the job is over, SLURM's view of its end (state, requeues, exit code) is
    this; its log."""
    shown = wait_for_end(slurm, job.id, job.log)
    text = job.text()
    found = (shown["JobState"], shown["Restarts"], shown["ExitCode"])
    assert found == (state, restarts, exit_code), text[-4000:]
    return text


def assert_resumed_from_agreed_checkpoints(job: Job, ended: list[Any]) -> None:
    """Each start restored one checkpoint both workers agreed on (their records), the
    one the chief's session says; nothing was lost beyond the save interval at a failure,
    nothing at a notice (its final save); the last session trained to the end. Each
    session line holds SLURM's facts: the job, its restart count, the chief's node."""
    restart, facts = 0, []
    for s in ended:  # a preempted run is requeued: the next one is SLURM's next restart
        facts.append((job.id, restart, "n1"))
        restart += s.outcome == "preempted"
    assert [(s.slurm_job, s.slurm_restart, s.node) for s in ended] == facts, ended
    first, second = restores(job)
    assert first == second == [s.restored_step for s in ended], (first, second, ended)
    for before, after in itertools.pairwise(ended):
        assert after.restored_step is not None and before.step is not None
        lost = before.step - after.restored_step
        assert 0 <= lost <= (0 if before.outcome == "preempted" else SAVE_STEPS), ended
    assert ended[-1].step == STEPS


def assert_inspect_tells(job: Job, outcomes: list[str], ends: list[tuple[int, str]]) -> str:
    """``asupervisor inspect`` tells the job's story: its sessions and how each ended, in
    order, the SLURM job and its requeues, and each attempt of the group, the first to
    fail marked. Returns what it showed."""
    shown = inspect(job)
    lines = shown.splitlines()
    table = lines.index(next(line for line in lines if line.startswith("sessions (")))
    rows = list(itertools.takewhile(str.strip, lines[table + 2 :]))  # under its header
    assert [row.split()[5] for row in rows] == outcomes, shown  # date, time, host, from, to
    assert f"SLURM job {job.id}" in shown, shown
    assert "goodput: " in shown, shown  # the group's, across its hosts
    assert "n1" in shown and "n2" in shown, shown
    # The attempts' table: in each failed attempt, the first to fail starred, with its
    # rank, node and status (columns: attempt, job.restart, worker, host, ended, step, exit).
    starred = [
        (int(m[1]), m[2], int(m[3]))
        for m in (re.search(r"\* (\d+)\s+(\S+)\s+\S+ \S+\s+\S+\s+(\d+) \(", line) for line in lines)
        if m
    ]
    causes = [(int(c.split(" on ")[0]), c.split(" on ")[1], st) for st, c in ends if c]
    assert starred == causes, (starred, causes, shown)
    return shown


@pytest.mark.slow
def test_trainers_killed_three_times_on_either_node_restart_the_group_and_the_job_ends_bitwise_equal_to_the_job_left_alone(  # noqa: E501
    slurm: Cluster, tmp_path: Path, left_alone: Job
) -> None:
    """Cases 1 and 7 of the SLURM faults. The trainer on n2 SIGKILLs itself after a
    checkpoint: the worker on n1 does not hang (it loses its peer), the step ends 137 and
    the run starts it again in the allocation. Then the chief's trainer on n1 is killed,
    then n2's again. Each start restored one checkpoint both workers agreed on, losing at
    most the save interval; the job, killed and restarted three times, finishes without a
    requeue and ends bitwise equal to the job left alone."""
    import numpy as np

    from tests.faults.deterministic import compare

    job = submit(
        slurm, tmp_path,
        [
            {"worker": 1, "step": 10, "do": "kill"},  # restores 7
            {"worker": 0, "step": 12, "do": "kill"},  # restores 7 again
            {"worker": 1, "step": 17, "do": "kill"},  # restores 14
        ],
    )  # fmt: skip
    text = ended_as(slurm, job, "COMPLETED", "0", "0:0")
    ends = step_ends(job)
    assert ends == [(137, "1 on n2"), (137, "0 on n1"), (137, "1 on n2"), (0, "")], (
        ends, text[-4000:]
    )  # fmt: skip
    ended = sessions(job)
    # The chief lost its peer when n2's trainer was killed (it did not hang, and it is
    # not the cause); its own trainer, killed, left its end to its run, which recorded
    # the status and the step of its last beat.
    assert [s.outcome for s in ended] == ["lost_peer", None, "lost_peer", "done"], ended
    assert (ended[1].exit_status, ended[1].recorded_by) == (137, "runner"), ended
    assert_resumed_from_agreed_checkpoints(job, ended)
    assert [s.restored_step for s in ended] == [0, 7, 7, 14], ended
    assert_inspect_tells(job, ["lost_peer", "killed", "lost_peer", "done"], ends)

    left = wait_for_end(slurm, left_alone.id, left_alone.log)
    assert (left["JobState"], left["Restarts"]) == ("COMPLETED", "0"), left_alone.text()
    with np.load(job.final) as a, np.load(left_alone.final) as b:
        found = compare(dict(a), dict(b))
    assert found["weights_bitwise"] and not found["unequal"], found


@pytest.mark.slow
def test_a_step_hung_on_one_node_logs_its_stack_ends_124_and_the_group_restarts(
    slurm: Cluster, tmp_path: Path
) -> None:
    """Case 2 of the SLURM faults: a step on n1 hangs. The worker's watchdog logs every
    thread's stack and ends it 124 (its peer, waiting in the same all-reduce, times out
    too); the run starts the step again in the allocation from the checkpoint both agree
    on, and the job finishes."""
    job = submit(
        slurm, tmp_path,
        [{"worker": 0, "step": 15, "do": "hang"}],  # restores 14
        # A step of this job takes milliseconds, but a loaded machine has held one for 10 s.
        worker_options=("--step-timeout", "20"),
    )  # fmt: skip
    text = ended_as(slurm, job, "COMPLETED", "0", "0:0")
    # The cause is whichever worker's watchdog fired first (both wait in one all-reduce).
    ends = step_ends(job)
    assert [status for status, _ in ends] == [124, 0], (ends, text[-4000:])
    assert ends[0][1] in ("0 on n1", "1 on n2"), ends
    ended = sessions(job)
    assert [s.outcome for s in ended] == ["stuck", "done"], ended
    timeouts = [line for line in text.splitlines() if "step.timeout" in line]
    assert any("in fault" in t and "time.sleep(1)" in t for t in timeouts), timeouts
    assert_resumed_from_agreed_checkpoints(job, ended)
    assert_inspect_tells(job, ["stuck", "done"], ends)


def noticed(slurm: Cluster, tmp_path: Path, worker_options: tuple[str, ...] = ()) -> Job:
    """A job that trains slowly on n1 from step 10 of its first run, until a notice ends
    it (one lands within a step); its requeued run trains at full speed. The warning
    WARN_SECS before the time limit, the limit far until a test brings it near."""
    return submit(
        slurm, tmp_path,
        # Slow enough that SLURM's pass over time limits (30 s apart) finds the first run
        # still training: 70 steps to go.
        [{"restart": 0, "worker": 0, "step": 10, "do": "slow", "secs": 2}],
        # Appended: a requeued job's run writes on after the runs before it.
        sbatch_options=("--open-mode=append", "--time=30", f"--signal=B:USR1@{WARN_SECS}"),
        worker_options=worker_options,
    )  # fmt: skip


def assert_noticed_and_resumed(slurm: Cluster, job: Job) -> None:
    """One final save every worker agreed on, 42 at every layer, SLURM's requeue
    (RequeueExit=42), and the requeued run resumed from that save and finished."""
    text = ended_as(slurm, job, "COMPLETED", "1", "0:0")
    ends = step_ends(job)
    assert ends == [(42, ""), (0, "")], (ends, text[-4000:])  # nobody failed
    ended = sessions(job)
    assert [s.outcome for s in ended] == ["preempted", "done"], ended
    assert_resumed_from_agreed_checkpoints(job, ended)
    assert ended[0].step is not None and ended[0].step >= 10, ended
    shown = assert_inspect_tells(job, ["preempted", "done"], ends)
    assert "(requeued 1 times)" in shown, shown


@pytest.mark.slow
def test_the_notice_ends_the_job_in_one_agreed_final_save_42_a_requeue_and_a_resume(
    slurm: Cluster, tmp_path: Path
) -> None:
    """Case 3 of the SLURM faults: ``scancel --batch --signal=USR1``, the notice to the
    batch script: every worker takes the same final save, the step and the run end 42,
    SLURM requeues the job and it resumes from that save."""
    job = noticed(slurm, tmp_path)
    wait_for_mark(slurm, job, "slow-0-0-10")
    scancel(slurm, "--batch", "--signal=USR1", job.id)
    assert_noticed_and_resumed(slurm, job)


@pytest.mark.slow
def test_usr1_to_the_jobs_steps_ends_the_job_as_the_notice_does_for_workers_that_stop_on_it(
    slurm: Cluster, tmp_path: Path
) -> None:
    """``scancel --signal=USR1`` without ``--batch``: SLURM sends the signal to every
    process of the job's steps, each task's run and its worker among them. With SIGUSR1
    among the workers' stop signals (what the docs say to give them), it ends the job
    as the notice does: one agreed final save, 42, a requeue, a resume."""
    job = noticed(slurm, tmp_path, ("--stop-signals", "SIGTERM,SIGINT,SIGUSR1"))
    wait_for_mark(slurm, job, "slow-0-0-10")
    scancel(slurm, "--signal=USR1", job.id)
    assert_noticed_and_resumed(slurm, job)


@pytest.mark.slow
def test_the_time_limits_warning_ends_the_job_in_one_agreed_final_save_42_a_requeue_and_a_resume(
    slurm: Cluster, tmp_path: Path
) -> None:
    """Case 4 of the SLURM faults: the time limit's ``--signal=B:USR1@secs`` warning, sent
    by SLURM itself: the same ending as the notice, and the same resume."""
    job = noticed(slurm, tmp_path)
    wait_for_mark(slurm, job, "slow-0-0-10")
    # The time limit near: between 3 and 4 minutes left (SLURM's limits are in minutes),
    # so the warning is due now, SLURM sends it at its next pass over the jobs' limits
    # (every 30 s or sooner), and the final save has minutes before the limit.
    ran = run_secs(job_state(slurm, job.id)["RunTime"])
    scontrol(slurm, "update", f"JobId={job.id}", f"TimeLimit={(ran + WARN_SECS) // 60}")
    wait_for_restarts(slurm, job, 1)
    scontrol(slurm, "update", f"JobId={job.id}", "TimeLimit=30")  # no warning again
    assert_noticed_and_resumed(slurm, job)


@pytest.mark.slow
def test_a_crash_at_the_same_step_on_every_start_ends_in_the_crash_loop_report_and_no_requeue(
    slurm: Cluster, tmp_path: Path
) -> None:
    """Case 6 of the SLURM faults: the worker on n2 raises at step 10 at every start. The
    first attempt committed checkpoints (a failure after progress costs nothing); the
    second restored the same one and failed at the same step without a commit: with
    ``--max-failures 1`` that is the crash loop. The run prints its report and exits 1,
    which SLURM does not requeue (RequeueExit=42 only): the job ends FAILED, never
    requeued."""
    job = submit(
        slurm, tmp_path,
        [{"worker": 1, "step": 10, "do": "crash", "again": True}],
        run_options=("--max-failures", "1"),
    )  # fmt: skip
    text = ended_as(slurm, job, "FAILED", "0", "1:0")
    assert step_ends(job) == [(1, "1 on n2"), (1, "1 on n2")], text[-4000:]
    ended = sessions(job)
    # The chief's sessions: both lost their peer at the crash's step, the second restored
    # the checkpoint the first committed before it (the same one at every start).
    assert [(s.outcome, s.restored_step, s.step) for s in ended] == [
        ("lost_peer", 0, 10), ("lost_peer", 7, 10),
    ], ended  # fmt: skip
    first, second = restores(job)
    assert first == second == [0, 7]
    report = text[text.index("asupervisor run: crash loop: ") :]
    assert "1 failures in a row without a checkpoint" in report, report
    assert "the newest it committed: step 7" in report, report
    assert "the last failure: worker 1 on n2: exited 1 (failed)" in report, report
    shown = inspect(job)
    assert "2 sessions" in shown and "1 restarts" in shown, shown


@pytest.mark.slow
def test_a_node_lost_ends_the_job_which_slurm_requeues_and_which_resumes_once_the_node_is_back(
    slurm: Cluster, tmp_path: Path
) -> None:
    """Case 5 of the SLURM faults: node n4 is lost while the job trains (its slurmd and
    every process on it SIGKILLed) and marked down, as SLURM's controller does when it has
    not answered for SlurmdTimeout. SLURM ends the job for the node's failure and requeues
    it (``--requeue``); the job waits for two nodes, runs again once n4 is back, resumes
    from the checkpoint both workers agree on, losing at most the save interval, and
    finishes. The job runs on the nodes of a partition no other test uses (n3, n4), so
    the other tests' jobs run on beside it; the test brings the node back whatever
    happens."""
    job = submit(
        slurm, tmp_path,
        [{"restart": 0, "worker": 0, "step": 10, "do": "slow", "secs": 0.5}],
        sbatch_options=("--open-mode=append", "--partition", LOSS_PARTITION),
    )  # fmt: skip
    wait_for_mark(slurm, job, "slow-0-0-10")
    try:
        slurm.lose_node("n4")
        # What the controller does once the node has not answered for SlurmdTimeout (a
        # health check or a person may say it sooner): the node is down.
        scontrol(slurm, "update", "NodeName=n4", "State=DOWN", "Reason=lost")
        wait_for_restarts(slurm, job, 1)  # SLURM's own requeue, for the node's failure
    finally:
        slurm.restore_node("n4")
    text = ended_as(slurm, job, "COMPLETED", "1", "0:0")
    # The requeue was SLURM's, for the node: the first run did not end 42. Its step failed,
    # its worker on n3 having lost its peer; the worker on n4, which recorded nothing, is
    # the cause, whether its outer run wrote the step's line or SLURM ended that run first
    # and the requeued run's outer run wrote it as it started. Then it ran again.
    *first_run, last = step_ends(job)
    assert last == (0, ""), (first_run, text[-4000:])
    assert [(status, cause.split(" on ")[0]) for status, cause in first_run] == [(1, "1")], (
        first_run, text[-4000:]
    )  # fmt: skip
    ended = sessions(job)
    assert [s.outcome for s in ended] == ["lost_peer", "done"], ended
    first, second = restores(job)
    assert first == second == [s.restored_step for s in ended], (first, second, ended)
    lost, resumed = ended
    assert lost.step is not None and resumed.restored_step is not None
    assert lost.step >= 10 and 0 < lost.step - resumed.restored_step <= SAVE_STEPS, ended
    assert resumed.step == STEPS
    shown = inspect(job)
    assert "2 sessions, 1 restarts" in shown, shown
    assert slurm.running()  # the node is back, for the tests after this one
