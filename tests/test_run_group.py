"""A member of a job across hosts never restarts its worker alone: ``asupervisor run``
whose one child is one worker of a larger job (its TF_CONFIG names more tasks, or it is
one task of a SLURM step of several) exits at once after a failure or a hang, with the
child's status, for the engine to restart the job as a whole; the exit status can be
mapped for an engine that retries only some (Kubeflow's TFJob)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asupervisor._outcome import Outcome
from asupervisor._run.group import Restarts, StatusMap, membership
from asupervisor._run.slurm import (
    MemberEnd,
    Step,
    cause_rank,
    expand_counts,
    group_status,
    tf_config,
)
from tests.slurm_cluster import Cluster
from tests.test_run import ROOT, child

TWO_WORKERS = json.dumps(
    {
        "cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
        "task": {"type": "worker", "index": 1},
    }
)


@pytest.mark.parametrize(
    ("asked", "env", "workers", "restarts"),
    [
        (Restarts.AUTO, {}, 1, Restarts.HERE),
        (Restarts.AUTO, {}, 2, Restarts.HERE),  # it starts every worker itself
        (Restarts.AUTO, {"TF_CONFIG": TWO_WORKERS}, 1, Restarts.ENGINE),
        (Restarts.AUTO, {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}})}, 1,
         Restarts.HERE),
        (Restarts.AUTO, {"TF_CONFIG": "not json"}, 1, Restarts.HERE),
        (Restarts.AUTO, {"SLURM_STEP_NUM_TASKS": "2"}, 1, Restarts.ENGINE),
        (Restarts.AUTO, {"SLURM_STEP_NUM_TASKS": "1"}, 1, Restarts.HERE),
        (Restarts.AUTO, {"SLURM_NNODES": "2"}, 1, Restarts.HERE),  # a batch script: the outer
        (Restarts.HERE, {"TF_CONFIG": TWO_WORKERS}, 1, Restarts.HERE),
        (Restarts.ENGINE, {}, 1, Restarts.ENGINE),
    ],
)  # fmt: skip
def test_who_restarts_a_failed_worker_is_decided_from_the_flag_then_the_environment(
    asked: Restarts, env: dict[str, str], workers: int, restarts: Restarts
) -> None:
    decided = membership(asked, env, workers)
    assert decided.restarts is restarts
    assert decided.why


def test_a_status_map_names_outcomes_or_the_tfjob_preset() -> None:
    tfjob = StatusMap.parse("tfjob")
    statuses = (0, 1, 42, 69, 75, 78, 124, 130, 137)
    assert [tfjob(s) for s in statuses] == [0, 1, 143, 137, 137, 78, 138, 130, 137]
    mapped = StatusMap.parse("tfjob, failed=137")
    assert (mapped(1), mapped(42), str(mapped)) == (
        137, 143, "preempted=143,stuck=138,lost-peer=137,unreachable=137,failed=137"
    )  # fmt: skip
    assert StatusMap.parse("lost-peer=143").mapped == {Outcome.LOST_PEER: 143}
    assert StatusMap.parse("")(42) == 42
    assert StatusMap.parse("permanent=1").mapped == {Outcome.FAILED_PERMANENTLY: 1}


def test_a_collectives_error_in_a_worker_of_a_job_is_a_lost_peer_with_a_status_of_its_own() -> None:
    import tensorflow as tf

    from asupervisor._outcome import outcome_of, worst
    from asupervisor._run import statuses

    for kind in (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError):
        error = kind(None, None, "a peer is gone")
        assert outcome_of(error, in_group=True) is Outcome.LOST_PEER
        assert outcome_of(error) is Outcome.FAILED  # one process alone has no peer
    assert outcome_of(RuntimeError("a bug"), in_group=True) is Outcome.FAILED
    assert Outcome.LOST_PEER.exit_status == 75
    assert statuses.outcome_of(75) is Outcome.LOST_PEER
    assert statuses.describe_status(75) == "75 (lost_peer)"
    assert Outcome.LOST_PEER in statuses.RESTARTED  # the group is started again
    # Beside a worker that failed, the one that lost its peer is not the job's outcome.
    assert worst([Outcome.LOST_PEER, Outcome.FAILED]) is Outcome.FAILED
    assert worst([Outcome.LOST_PEER, Outcome.PREEMPTED]) is Outcome.LOST_PEER


@pytest.mark.parametrize("text", ["tfjobs", "preempted", "preempted=x", "late=3", "stuck=256"])
def test_a_bad_status_map_is_an_error_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text.split(",")[0])):
        StatusMap.parse(text)


def test_a_bad_status_map_on_the_command_line_names_the_option(tmp_path: Path) -> None:
    run = supervisor("--exit-status-map", "preempted=x", "--", sys.executable, "-c", "pass")
    _, err = run.communicate(timeout=60)
    assert run.returncode == 2
    assert "argument --exit-status-map: 'preempted=x': the status must be" in err


def supervisor(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    for name in ("TF_CONFIG", "SLURM_STEP_NUM_TASKS"):
        if name not in (env_extra or {}):
            env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "asupervisor", "run", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


FAILS = "import sys; print('started', flush=True); sys.exit(int(sys.argv[1]))"


def test_requeue_without_slurm_is_an_error_naming_it() -> None:
    run = supervisor("--requeue", "--", sys.executable, "-c", "pass")
    _, err = run.communicate(timeout=60)
    assert run.returncode == 2
    (line,) = err.splitlines()
    assert line.startswith("asupervisor run: error: --requeue ") and "--slurm" in line, line


@pytest.mark.parametrize(
    ("status", "mapping", "shown"),
    [(1, "", 1), (124, "tfjob", 138), (75, "", 75), (75, "tfjob", 137)],
)
def test_a_member_of_a_job_across_hosts_exits_at_once_with_its_childs_status(
    tmp_path: Path, status: int, mapping: str, shown: int
) -> None:
    script = child(tmp_path, FAILS)
    args = ["--exit-status-map", mapping] if mapping else []
    run = supervisor(
        *args, "--no-heartbeat", "--", sys.executable, script, str(status),
        env_extra={"TF_CONFIG": TWO_WORKERS},
    )  # fmt: skip
    out, err = run.communicate(timeout=60)
    assert run.returncode == shown, err
    assert out == "started\n"  # once: not restarted here
    assert "restarts='engine (one task of 2 in its TF_CONFIG)'" in err
    assert "run.restart_left_to_engine" in err and "run.restarting" not in err


def test_a_member_still_passes_on_what_it_never_restarts(tmp_path: Path) -> None:
    run = supervisor(
        "--exit-status-map", "tfjob", "--no-heartbeat", "--", sys.executable,
        child(tmp_path, FAILS), "42", env_extra={"TF_CONFIG": TWO_WORKERS},
    )  # fmt: skip
    _, err = run.communicate(timeout=60)
    assert run.returncode == 143, err  # preempted, as TFJob retries it
    assert "run.ended status='42 (preempted)' exit_status=143" in err
    assert "run.restart_left_to_engine" not in err


def test_with_restarts_here_the_same_member_restarts_its_worker(tmp_path: Path) -> None:
    once = child(
        tmp_path,
        """
        import os, sys
        print("started", flush=True)
        sys.exit(1 if os.environ["ASUPERVISOR_ATTEMPT"] == "1" else 0)
        """,
    )
    run = supervisor(
        "--restarts", "here", "--backoff", "0", "--no-heartbeat", "--", sys.executable, once,
        env_extra={"TF_CONFIG": TWO_WORKERS},
    )  # fmt: skip
    out, err = run.communicate(timeout=60)
    assert (run.returncode, out) == (0, "started\nstarted\n"), err


def test_slurms_task_counts_and_placement_are_read_as_slurm_writes_them() -> None:
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("1(x2)") == [1, 1]
    step = Step("77", procid=2, nodes=("a", "b"), tasks_per_node=(2, 1), restart_count=0)
    assert step.placement() == [("a", 0), ("a", 1), ("b", 0)]
    config = json.loads(tf_config(step, attempt=3, addresses={"a": "10.0.0.1", "b": "b"}))
    port = int(config["cluster"]["worker"][0].rsplit(":", 1)[1])
    assert config == {
        "cluster": {"worker": [f"10.0.0.1:{port}", f"10.0.0.1:{port + 1}", f"b:{port + 2}"]},
        "task": {"type": "worker", "index": 2},
    }
    # Every task derives the same ports; the next attempt and a requeue use others.
    again = json.loads(tf_config(step, attempt=4, addresses={"a": "x", "b": "y"}))
    assert again["cluster"]["worker"][0] != f"x:{port}"


def end(rank: int, status: int, stopped: bool, at: float) -> MemberEnd:
    return MemberEnd(rank, f"n{rank + 1}", status, stopped, "how", at)


@pytest.mark.parametrize(
    ("ends", "status", "cause"),
    [
        # srun says 42 (the highest): the task that failed on its own is the cause
        ([end(0, 42, True, 2.0), end(1, 1, False, 1.0)], 1, "worker 1 on n2"),
        ([end(0, 124, False, 2.0), end(1, 1, False, 1.0)], 124, "worker 0 on n1"),
        ([end(0, 1, False, 2.0), end(1, 1, False, 1.0)], 1, "worker 1 on n2"),  # the first
        ([end(0, 42, True, 1.0)], 1, "worker 1 left no end"),  # its node was lost
        ([end(0, 42, True, 1.0), end(1, 42, True, 1.5)], 42, "every worker was stopped"),
        ([end(0, 0, False, 1.0), end(1, 0, False, 1.5)], 0, "worker 0 on n1"),
        ([], 137, "no worker recorded its end"),
        # a task lost beside one that ended done: the lost one is the cause, not "done"
        ([end(0, 0, False, 1.0)], 1, "worker 1 left no end"),
        # worker 0 lost its peer: the one that failed is the cause, whichever ended first
        ([end(0, 75, False, 1.0), end(1, 137, False, 2.0)], 137, "worker 1 on n2"),
        ([end(0, 75, False, 2.0), end(1, 1, False, 1.0)], 1, "worker 1 on n2"),
        ([end(0, 124, False, 2.0), end(1, 75, False, 1.0)], 124, "worker 0 on n1"),
        ([end(0, 75, False, 1.0)], 1, "worker 1 left no end"),  # its peer's node was lost
        # its peer's node was lost with no word on the wire: worker 0 hung in a collective
        # until its watchdog ended it; the lost one is the cause, not the survivor
        ([end(0, 124, False, 1.0)], 1, "worker 1 left no end"),
        ([end(0, 75, False, 1.5), end(1, 75, False, 1.0)], 75, "worker 1 on n2"),  # restarted
    ],
)
def test_a_steps_status_is_its_causes_not_sruns(
    ends: list[MemberEnd], status: int, cause: str
) -> None:
    decided, why = group_status(ends, tasks=2, step_status=137)
    assert decided == status
    assert cause in why


def test_a_task_cut_off_while_the_run_stops_does_not_turn_the_stop_into_a_failure() -> None:
    # A notice: one task recorded its stop (42), the other was cut off before it could.
    assert group_status([end(0, 42, True, 1.0)], 2, 137, stopping=True)[0] == 42


def test_a_task_lost_with_its_node_is_the_cause_when_the_rest_were_stopped_for_it() -> None:
    # SLURM stops the rest of a job whose node failed: the task left on n1 lost its peer
    # and was stopped with the step, the one on n2 left nothing. The lost one is the cause.
    status, why = group_status([end(0, 75, True, 1.0)], 2, 137, stopping=True)
    assert (status, why) == (1, "worker 1 left no end (its node or its run was lost)")
    assert cause_rank([end(0, 75, True, 1.0)], 2, status) == 1


# -- on a real SLURM cluster ----------------------------------------------------------------


def test_in_a_slurm_step_the_failed_task_ends_the_step_and_no_task_restarts_alone(
    slurm: Cluster, tmp_path: Path
) -> None:
    # Task 1 (on n2) fails; task 0 (on n1) would sleep for ten minutes. With srun -K1 the
    # step ends when the one fails: nobody restarted a worker alone.
    script = child(
        tmp_path,
        """
        import os, socket, sys, time
        rank = os.environ["SLURM_PROCID"]
        print(f"{rank} {socket.gethostname()} attempt {os.environ['ASUPERVISOR_ATTEMPT']}",
              flush=True)
        if rank == "1":
            while not os.path.exists(sys.argv[1]):
                time.sleep(0.05)  # task 0's worker runs: the crash ends a running group
            sys.exit(1)
        open(sys.argv[1], "w").close()
        time.sleep(600)
        """,
    )
    done = subprocess.run(
        ["srun", "-N2", "-n2", "-K1", "--kill-on-bad-exit=1",
         sys.executable, "-m", "asupervisor", "run", "--no-heartbeat", "--grace", "5",
         "--", sys.executable, script, str(tmp_path / "rank0-runs")],
        env={**slurm.env, "PYTHONPATH": str(Path(__file__).parents[1])},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout + done.stderr
    lines = sorted(done.stdout.splitlines())
    assert lines == ["0 n1 attempt 1", "1 n2 attempt 1"], done.stdout + done.stderr
    # The task that failed left the restart to SLURM (the other one was ended with the step).
    assert "run.restart_left_to_engine after='worker 0: 1 (failed)'" in done.stderr
    assert "restarts='engine (one task of a SLURM step of 2 tasks)'" in done.stderr
    assert "run.restarting" not in done.stderr  # and the sleeping task ended with the step


def test_the_ports_of_a_slurm_jobs_workers_stay_below_the_ephemeral_range() -> None:
    """A busy host's outgoing connections take ports from 32768 on (Linux's default): a
    worker's gRPC server there could not start, attempt after attempt."""
    from asupervisor._run.slurm import Step, port_for

    for job in range(1, 400):
        for restart in range(3):
            step = Step(str(job), 0, ("n1", "n2", "n3", "n4"), (2, 2, 2, 2), restart)
            for attempt in range(1, 6):
                base = port_for(step, attempt)
                assert 1024 < base and base + step.tasks <= 32768, (job, restart, attempt)


# -- one history, many hosts: the members' ends folded by the chief's member -------------


def test_a_members_rank_is_its_place_among_the_workers_its_tf_config_names() -> None:
    from asupervisor._run.members import rank_in

    cluster = {"chief": ["c:1"], "worker": ["a:1", "b:1"]}

    def as_task(kind: str, index: int) -> str:
        return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})

    assert [rank_in(as_task("chief", 0)), rank_in(as_task("worker", 1))] == [(0, 3), (2, 3)]
    assert rank_in(TWO_WORKERS) == (1, 2)
    one = json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})
    for text in (one, as_task("ps", 0), as_task("worker", 5), "not json", ""):
        assert rank_in(text) is None, text


def test_the_ends_an_attempt_whose_chief_was_lost_left_are_folded_at_the_next_chiefs_start(
    tmp_path: Path,
) -> None:
    """The chief's pod was lost with its run: no record of rank 0, and no fold at that
    attempt's end. The next chief's start folds what the others recorded: the chief that
    left no end is the first, the peer that lost it is not; the records are gone after."""
    from asupervisor._logdir import ledger as _ledger
    from asupervisor._logdir.groups import groups
    from asupervisor._logdir.store import Store
    from asupervisor._run import members

    logdir = str(tmp_path)
    lost = MemberEnd(1, "pod-1", 75, False, "exited", at=1000.0, session="s1", step=7, pid=11)
    stopped = MemberEnd(2, "pod-2", 143, True, "exited", at=1001.0)
    for end in (lost, stopped):
        members.write(logdir, f"run{end.rank}", end)
    group = members.fold(logdir, "chief-run", 3, wait_tries=1, pause_secs=0)
    assert group is not None
    assert [(w.rank, w.host, w.status, w.first, w.stopped) for w in group.workers] == [
        (0, "?", 1, True, False),
        (1, "pod-1", 75, False, False),
        (2, "pod-2", 143, False, True),
    ]
    assert (group.attempt, group.status, group.run) == (1, 1, "chief-run"), group
    assert "worker 0 left no end" in group.cause
    assert groups(_ledger.read(Store(logdir))) == [group]
    left = [n for n in os.listdir(logdir) if n.startswith(".asupervisor.member-")]
    assert all(n.endswith(".folded") for n in left) and len(left) == 2, left
    # Nothing left: the next fold writes nothing; the one after a whole attempt counts on.
    assert members.fold(logdir, "chief-run", 3, wait_tries=1, pause_secs=0) is None
    for rank in range(3):
        members.write(logdir, "r", MemberEnd(rank, f"pod-{rank}", 0, False, "exited", at=2000.0))
    again = members.fold(logdir, "next-run", 3, wait_tries=1, pause_secs=0)
    assert again is not None and (again.attempt, again.status, again.first) == (2, 0, None)


def test_a_members_record_being_written_is_not_taken_for_its_end(tmp_path: Path) -> None:
    """A member's record mid-write (``Store.write``'s temporary name, whole already) is no
    record: the chief's fold waits for the renamed one, not folding the stop it holds as
    the member's end (under load, the other member's stop was folded as a kill, 137)."""
    from asupervisor._logdir.store import Store
    from asupervisor._run import members

    logdir = str(tmp_path)
    members.write(logdir, "chief", MemberEnd(0, "pod-0", 42, True, "exited", at=1000.0))
    stopping = MemberEnd(1, "pod-1", 137, True, "killed before its end", at=1000.0)
    name = members.record_name(1, "other", stopping=True) + ".tmp123"
    Store(logdir).write(name, stopping.to_json())  # as a write caught before its rename
    group = members.fold(logdir, "chief", 2, wait_tries=1, pause_secs=0)
    assert group is not None
    assert [(w.rank, w.status) for w in group.workers] == [(0, 42), (1, 1)], group
    assert "worker 1 left no end" in group.cause, group


def test_a_slurm_step_whose_outer_run_was_lost_with_its_node_is_folded_at_the_requeued_start(
    tmp_path: Path,
) -> None:
    """SLURM ended the batch script with a lost node before its outer run read the step's
    records: the worker on the lost node left none, the one on n3 lost its peer. The
    requeued run's start folds them into the attempt's group line (the lost worker first,
    the restart count before the requeue's); a record that came after its outer run wrote
    its line is only removed; the records are gone after."""
    from asupervisor._logdir import ledger as _ledger
    from asupervisor._logdir.groups import GroupAttempt, WorkerEnd, groups
    from asupervisor._logdir.store import Store
    from asupervisor._run import members
    from asupervisor._run.slurm import member_prefix

    logdir = str(tmp_path)
    store = Store(logdir)
    written = GroupAttempt(
        run="early", attempt=1, time="t", status=0, cause="", slurm_job="7", slurm_restart=0,
        workers=(WorkerEnd(rank=0, host="n3", status=0, how="done", stopped=False, first=False),),
    )  # fmt: skip
    _ledger.append(store, written.to_record())
    late = MemberEnd(1, "n4", 0, False, "exited", at=900.0)
    store.write(member_prefix("early", "1") + "1", late.to_json())
    survivor = MemberEnd(0, "n3", 75, False, "lost a peer", at=1000.0, session="s", step=12)
    store.write(member_prefix("lostrun", "1") + "0", survivor.to_json())
    facts = {"slurm_job": "7", "slurm_restart": 1}
    (group,) = members.fold_lost_steps(logdir, 2, facts)
    assert [(w.rank, w.status, w.first) for w in group.workers] == [(0, 75, False), (1, 1, True)]
    assert (group.run, group.attempt, group.status) == ("lostrun", 2, 1), group
    assert "worker 1 left no end" in group.cause, group
    assert (group.slurm_job, group.slurm_restart) == ("7", 0), group
    assert groups(_ledger.read(store)) == [written, group]
    assert not [n for n in os.listdir(logdir) if n.startswith(".asupervisor.member-")]
    assert members.fold_lost_steps(logdir, 2, facts) == []


def test_an_end_recorded_after_the_chief_folded_its_members_stop_is_never_an_attempt_of_its_own(
    tmp_path: Path,
) -> None:
    """The engine stops every pod (a JobSet's restart): worker 1 records its stop at once,
    the chief ends and folds it before worker 1's own end is written. That end, coming
    late, is dropped with the fold's mark, not folded at the next start as an attempt."""
    from asupervisor._logdir import ledger as _ledger
    from asupervisor._logdir.groups import groups
    from asupervisor._logdir.store import Store
    from asupervisor._run import members

    logdir = str(tmp_path)
    stopping = MemberEnd(1, "pod-1", 137, True, "killed before its end was recorded", at=9.0)
    members.write(logdir, "w1", stopping, stopping=True)
    members.write(logdir, "c", MemberEnd(0, "pod-0", 42, True, "exited", at=10.0))
    # Its stop is all there is of worker 1 after the looks: folded as it.
    first = members.fold(logdir, "c", 2, wait_tries=2, pause_secs=0)
    assert first is not None and [(w.rank, w.status, w.stopped) for w in first.workers] == [
        (0, 42, True),
        (1, 137, True),
    ]
    members.write(logdir, "w1", MemberEnd(1, "pod-1", 42, True, "exited", at=11.0))  # late
    assert members.fold(logdir, "next", 2, wait_tries=1, pause_secs=0) is None
    assert len(groups(_ledger.read(Store(logdir)))) == 1
    # A member's end replaces its record of its stop; the next chief's end sweeps the marks.
    members.write(logdir, "c2", MemberEnd(0, "pod-0", 0, False, "exited", at=20.0))
    members.write(logdir, "w2", stopping, stopping=True)
    members.write(logdir, "w2", MemberEnd(1, "pod-1", 0, False, "exited", at=21.0))
    last = members.fold(logdir, "c2", 2, wait_tries=2, pause_secs=0)
    assert last is not None and (last.attempt, [w.status for w in last.workers]) == (2, [0, 0])
    left = sorted(n for n in os.listdir(logdir) if n.startswith(".asupervisor.member-"))
    assert left == [
        members.record_name(0, "c2") + ".folded",
        members.record_name(1, "w2") + ".folded",
    ]


STOPPED_42 = """
    import os, signal, sys, time
    # As a session does: a stop signal ends it preempted (42), after its final save
    # (STOP_SECS: how long that takes).
    def stop(*_):
        time.sleep(float(os.environ.get("STOP_SECS", "0")))
        sys.exit(42)
    signal.signal(signal.SIGTERM, stop)
    print("started", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("non_chief_stop_secs", [0, 8])
def test_per_host_members_stopped_together_fold_into_one_attempt_every_worker_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], non_chief_stop_secs: int
) -> None:
    """Two `asupervisor run`, each one member of a two-worker job (its TF_CONFIG names the
    other), stopped together as a JobSet's restart or a preemption stops its pods: each
    records its stop and its end (42); the chief's folds them into its ledger as one
    attempt, every worker stopped, none first, and inspect shows it, also when the other
    member's end comes seconds after the chief's (its final save is slower, its host is
    loaded): the chief waits for it within the grace, not taking its stop for a kill.
    (A real two-worker job under per-host members, one killed, is in
    test_run_sessions.py.)"""
    import socket

    from asupervisor._logdir import ledger as _ledger
    from asupervisor._logdir.groups import groups
    from asupervisor._logdir.store import Store
    from examples.multiworker import local_tf_configs

    logdir = tmp_path / "run"
    logdir.mkdir()
    script = child(tmp_path, STOPPED_42)
    args = ("--logdir", str(logdir), "--no-heartbeat", "--grace", "120", "--", sys.executable,
            script)  # fmt: skip
    members = [
        supervisor(*args, env_extra={"TF_CONFIG": c, "STOP_SECS": str(non_chief_stop_secs * i)})
        for i, c in enumerate(local_tf_configs(2))
    ]
    try:
        for member in members:
            assert member.stdout is not None and member.stdout.readline() == "started\n"
        for member in members:
            member.send_signal(signal.SIGTERM)
        done = [member.communicate(timeout=120) for member in members]
    finally:
        for member in members:
            member.kill()
    assert [m.returncode for m in members] == [42, 42], done
    host = socket.gethostname()
    (preempted,) = groups(_ledger.read(Store(str(logdir))))
    assert (preempted.attempt, preempted.status, preempted.first) == (1, 42, None), preempted
    assert [(w.host, w.status, w.stopped) for w in preempted.workers] == [(host, 42, True)] * 2
    assert preempted.cause.startswith("every worker was stopped"), preempted
    assert_folded_and_shown(logdir, capsys, f"1 1 {host} ", "42 (preempted) stopped:")


def assert_folded_and_shown(
    logdir: Path, capsys: pytest.CaptureFixture[str], row_start: str, row_has: str
) -> None:
    """Every member's record is folded, and ``inspect`` shows the one attempt of two workers
    on this host, with a row that starts with ``row_start`` and holds ``row_has``."""
    import socket

    from asupervisor.cli import main

    host = socket.gethostname()
    left = [n for n in os.listdir(logdir) if n.startswith(".asupervisor.member-")]
    assert left and all(n.endswith(".folded") for n in left), left  # the records are folded
    assert main(["inspect", str(logdir), "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert f"group: 2 workers on {host}; 1 attempts" in out, out
    rows = [" ".join(line.split()) for line in out.splitlines()]
    assert any(r.startswith(row_start) and row_has in r for r in rows), out
