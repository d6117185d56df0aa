"""`asupervisor run` and `asupervisor health` with tiny children that import no TensorFlow.

What is tested here is the process supervisor (restarts, the budget, the report, the
stop, no orphans), so the children are a few lines of plain Python that write what a
checkpoint leaves for it to read: the logdir's state file. tests/test_run_sessions.py
runs real training sessions under it.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from asupervisor._logdir import heartbeat as _heartbeat
from asupervisor._run.supervisor import outcome_of, standby_plan
from asupervisor.cli import main
from tests import forked
from tests.test_heartbeat import beat

ROOT = Path(__file__).parents[1]


def supervisor(*args: str, **popen: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "asupervisor", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **popen,  # type: ignore[call-overload]
    )


def child(tmp_path: Path, source: str) -> str:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


# What a session tells `asupervisor run` on its channel, in a tiny child's words.
TELL = """
    import json, os, time
    def tell(kind, **fields):
        line = json.dumps({"kind": kind, **fields}) + "\\n"
        os.write(int(os.environ["ASUPERVISOR_CHANNEL"]), line.encode())
"""

# A child that saves a checkpoint (the state file names it, and it tells the commit) and
# then fails.
SAVES_THEN_FAILS = (
    TELL
    + """
    import signal, sys
    logdir, attempt = sys.argv[1], int(os.environ["ASUPERVISOR_ATTEMPT"])
    step = int(sys.argv[2]) if len(sys.argv) > 2 else 10 * attempt
    with open(os.path.join(logdir, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "model.ckpt-{step}"\\n')
    if len(sys.argv) == 2:
        tell("commit", session=f"s{attempt}", step=step, at=time.time())
    print(f"attempt {attempt} step {step}", flush=True)
    print(f"noise\\n" * 30 + f"boom at step {step}", file=sys.stderr, flush=True)
    if len(sys.argv) > 2:
        sys.exit(1)  # always the same step, committed by nobody: a crash loop
    if attempt == 1:
        sys.exit(1)
    if attempt == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 3:
        raise RuntimeError("a bug that strikes once")
"""
)


def test_three_crashes_with_progress_between_are_each_restarted_and_the_run_finishes(
    tmp_path: Path,
) -> None:
    logdir = tmp_path / "run"
    logdir.mkdir()
    script = child(tmp_path, SAVES_THEN_FAILS)
    # A backoff longer than the test: progress must make every restart free and at once.
    run = supervisor(
        "--logdir", str(logdir), "--backoff", "600", "--", sys.executable, script, str(logdir)
    )
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert out.splitlines() == [f"attempt {n} step {10 * n}" for n in (1, 2, 3, 4)]
    exits = [line for line in err.splitlines() if "child.exited" in line]
    assert ["status='1 (failed)'" in exits[0], "status='137 (SIGKILL)'" in exits[1]] == [True] * 2
    assert "RuntimeError: a bug that strikes once" in err
    assert (
        err.count("progress='yes (costs nothing)' failures_without_progress=0/3 in_secs=0.0") == 3
    )


def test_a_crash_loop_gives_up_with_a_report_naming_the_step(tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    logdir.mkdir()
    (logdir / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-7"\n')
    script = child(tmp_path, SAVES_THEN_FAILS)
    run = supervisor(
        "--logdir",
        str(logdir),
        "--max-failures",
        "3",
        "--backoff",
        "0.05",
        "--",
        sys.executable,
        script,
        str(logdir),
        "7",
    )
    _, err = run.communicate(timeout=120)
    assert run.returncode == 1, err
    report = err[err.index("crash loop") :]
    assert "3 failures in a row without a checkpoint committed by this run" in report
    assert "(the newest it committed: none; the logdir's newest: step 7)" in report
    rows = [line.split() for line in report.splitlines() if line.strip()[:1].isdigit()]
    assert [(row[0], row[1], row[3], row[4]) for row in rows] == [
        (n, "1", "?", "none") for n in "123"
    ]
    assert "    | noise\n    | boom at step 7\n" in report  # the last lines of its stderr
    assert err.count("child.started") == 3


ANOTHER_WRITER = (
    TELL
    + """
    import sys
    logdir, attempt = sys.argv[1], int(os.environ["ASUPERVISOR_ATTEMPT"])
    # Another run's chief advances the logdir; this child commits nothing and fails.
    with open(os.path.join(logdir, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "model.ckpt-{100 * attempt}"\\n')
    tell("session", session=f"s{attempt}", pid=os.getpid(), chief=True, stop_grace_secs=1)
    sys.exit(1)
"""
)


def test_checkpoints_another_process_writes_do_not_refill_this_runs_budget(
    tmp_path: Path,
) -> None:
    logdir = tmp_path / "run"
    logdir.mkdir()
    script = child(tmp_path, ANOTHER_WRITER)
    run = supervisor(
        "--logdir", str(logdir), "--backoff", "0.05", "--", sys.executable, script, str(logdir)
    )
    _, err = run.communicate(timeout=120)
    assert run.returncode == 1, err
    assert err.count("child.started") == 3 and "crash loop: 3 failures in a row" in err
    assert "progress='yes" not in err
    assert "the logdir's newest: step 300" in err  # it moved, and was not this run's


@pytest.mark.parametrize("status", [0, 42, 78, 130])
def test_done_preempted_permanent_and_interrupted_children_are_not_restarted(
    tmp_path: Path, status: int
) -> None:
    script = child(tmp_path, f"import sys; sys.exit({status})")
    run = supervisor("--", sys.executable, script)
    _, err = run.communicate(timeout=60)
    assert run.returncode == status, err
    assert err.count("child.started") == 1


BAD_CONFIGURATION = """
    import sys
    import asupervisor as asv  # no TensorFlow: asv.run and the statuses need none

    async def main() -> None:
        raise ValueError("learning_rate must be > 0, not -0.1")

    sys.exit(asv.run(main))
"""


def test_a_bad_configuration_is_not_retried(tmp_path: Path) -> None:
    run = supervisor(
        "--max-failures", "5", "--", sys.executable, child(tmp_path, BAD_CONFIGURATION)
    )
    _, err = run.communicate(timeout=60)
    assert run.returncode == 78, err  # asv.run: a ValueError is permanent (EX_CONFIG)
    assert "ValueError: learning_rate must be > 0" in err and err.count("child.started") == 1
    assert "78 (failed_permanently)" in err and "run.restarting" not in err


def test_a_command_that_cannot_run_is_one_line(tmp_path: Path) -> None:
    for args, status in [
        (["--", str(tmp_path / "no-such-command")], 127),
        (["--logdir", str(tmp_path)], 2),  # no command at all
    ]:
        run = supervisor(*args)
        _, err = run.communicate(timeout=60)
        assert run.returncode == status, err
        assert len(err.splitlines()) == 1 and err.startswith("asupervisor run: error:"), err


STUBBORN = """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, lambda *a: print("SIGTERM ignored", flush=True))
    grandchild = subprocess.Popen(["sleep", "1000"])
    print(f"pids {os.getpid()} {grandchild.pid}", flush=True)
    time.sleep(1000)
"""


def started_pids(run: subprocess.Popen[str]) -> list[int]:
    assert run.stdout is not None
    line = run.stdout.readline()
    assert line.startswith("pids"), line
    return [int(p) for p in line.split()[1:]]


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody reaped yet (no init here reaps)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_child_killed_after_the_grace_of_a_stop_is_reported_so_not_as_stuck(
    tmp_path: Path,
) -> None:
    run = supervisor("--grace", "1", "--", sys.executable, child(tmp_path, STUBBORN))
    pids = started_pids(run)
    run.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, err = run.communicate(timeout=60)
    # Bounded by what happened: the child ignored SIGTERM and was killed after its grace.
    assert run.returncode == 137, err  # its status, as the facts say: SIGKILLed
    (exited,) = [line for line in err.splitlines() if "child.exited" in line]
    assert "status='137 (SIGKILL)'" in exited and "stuck" not in exited, exited
    assert "killed after the grace period of the stop (the run was asked to stop)" in exited
    assert time.monotonic() - sent < 30
    assert wait_gone(pids), pids  # the child and the process it started


def test_a_second_sigint_kills_at_once(tmp_path: Path) -> None:
    run = supervisor("--grace", "600", "--", sys.executable, child(tmp_path, STUBBORN))
    pids = started_pids(run)
    run.send_signal(signal.SIGINT)
    time.sleep(0.3)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)  # long before the 600 s grace
    assert run.returncode == 130, err
    assert wait_gone(pids), pids


def test_a_supervisor_killed_by_sigkill_takes_its_child_along(tmp_path: Path) -> None:
    run = supervisor("--", sys.executable, child(tmp_path, STUBBORN))
    child_pid, grandchild = started_pids(run)
    run.kill()
    run.wait(60)  # not communicate(): the grandchild still holds the pipes
    try:
        assert wait_gone([child_pid]), "the child outlived its supervisor"
    finally:
        # Not the supervisor's child: it dies with its parent only if made so (the docs).
        if not gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        for stream in (run.stdout, run.stderr):
            assert stream is not None
            stream.close()


def test_a_child_that_never_beats_is_stuck_after_the_start_up_deadline(tmp_path: Path) -> None:
    script = child(tmp_path, "import time; time.sleep(1000)")
    run = supervisor(
        "--stuck-after",
        "0.5",
        "--startup-timeout",
        "1",
        "--max-failures",
        "1",
        "--",
        sys.executable,
        script,
    )
    _, err = run.communicate(timeout=60)
    assert run.returncode == 124, err
    assert "no heartbeat 1 s after its start" in err and "crash loop" in err


def test_help_says_what_it_does_and_the_command_line_imports_no_tensorflow() -> None:
    code = (
        "import contextlib, io, sys\n"
        "from asupervisor.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(['run', '--help'])\n"
        "print(out.getvalue()); print('tensorflow' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.stdout.rstrip().endswith("False"), done.stdout + done.stderr
    for text in ("examples:", "exit status", "42 ", "crash loop", "--standby", "SIGUSR1"):
        assert text in done.stdout, text
    assert "(default: 150)" in done.stdout and "stop_grace_secs" in done.stdout


def test_which_commands_a_standby_can_take(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    path = os.path.dirname(sys.executable)
    assert standby_plan(["python", str(script), "--x"], path) == (
        os.path.join(path, "python"),
        str(script),
    )
    for command, why in [
        (["python", "-m", "train"], "interpreter options"),
        (["bash", "train.sh"], "not a Python interpreter"),
        (["python"], "not `python SCRIPT"),
        (["python", str(tmp_path / "missing.py")], "is not a file"),
    ]:
        plan = standby_plan(command, path)
        assert isinstance(plan, str) and why in plan, (command, plan)
    assert outcome_of(137).value == "failed" and outcome_of(127).value == "failed_permanently"


def test_health_judges_a_heartbeat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logdir = tmp_path / "run"
    logdir.mkdir()
    assert main(["health", str(logdir)]) == 2  # none yet
    path = logdir / _heartbeat.NAME
    path.write_bytes(beat().to_json())
    # Limits of an hour, ages of two: a loaded machine's delays are neither.
    assert main(["health", str(logdir), "--max-age", "3600"]) == 0
    path.write_bytes(beat(written_at=time.time() - 7200).to_json())
    assert main(["health", str(logdir), "--max-age", "3600"]) == 1
    assert "event loop is blocked" in capsys.readouterr().out
    other = tmp_path / "beat.json"
    other.write_bytes(beat(busy_since=time.time() - 7200, job="train_step").to_json())
    assert main(["health", str(other), "--max-age", "3600", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["healthy"] and "train_step has run for" in report["why"]
    other.write_text("{")
    assert main(["health", str(other)]) == 3  # cannot tell: a damaged beat is not "stale"


IMPORTING = """
    import time
    print("importing", flush=True)  # no session yet: no handler for the stop signal
    time.sleep(600)
"""


def test_sigterm_while_the_child_is_still_importing_is_a_preemption(tmp_path: Path) -> None:
    run = supervisor("--", sys.executable, child(tmp_path, IMPORTING))
    assert run.stdout is not None and run.stdout.readline() == "importing\n"
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 42, err  # nothing trained, nothing lost: start it again
    (exited,) = [line for line in err.splitlines() if "child.exited" in line]
    assert "status='42 (preempted)'" in exited and "143 (SIGTERM)" in exited, exited


# A child that speaks for its sessions on its channel with the library's own reports.
SESSIONS = """
    import json, os, time
    from asupervisor._logdir import channel, heartbeat
    from asupervisor._outcome import Outcome

    rank = json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]
    attempt = int(os.environ["ASUPERVISOR_ATTEMPT"])

    def tell(*reports):  # one write: the runner reads them together
        os.write(int(os.environ["ASUPERVISOR_CHANNEL"]),
                 b"".join(channel.encode(r) for r in reports))

    def began(session):
        return channel.SessionBegan(session, os.getpid(), rank == 0, 1.0)

    def beat(session, step, outcome=None):
        now = time.time()
        return heartbeat.Beat(
            pid=os.getpid(), host="h", session=session, chief=rank == 0, worker=None,
            phase=heartbeat.Phase.CLOSED if outcome else heartbeat.Phase.RUNNING,
            first_step_done=True, step=step, restored_step=0, interval_secs=0.2,
            started_at=now, written_at=now, busy_since=None, job=None, last_step_at=now,
            last_commit_step=None, last_commit_at=None, outcome=outcome,
            exit_status=None if outcome is None else outcome.exit_status)

    def train(session, secs):  # a session that beats while it trains, then is done
        tell(began(session))
        for step in range(int(secs / 0.1)):
            tell(beat(session, step))
            time.sleep(0.1)
        tell(beat(session, step, Outcome.DONE))
"""

LINGERS_BESIDE_ITS_PEER = """
    if rank == 1:
        tell(began("s1"), beat("s1", 1, Outcome.DONE))
        time.sleep(600)  # its session has ended; its process does not
    train("s0", 8)  # past --stuck-after: its peer lingers meanwhile
"""


def test_a_worker_that_outlives_its_done_session_is_stopped_alone_and_the_run_is_done(
    tmp_path: Path,
) -> None:
    script = child(tmp_path, SESSIONS + LINGERS_BESIDE_ITS_PEER)
    run = supervisor(
        "--workers", "2", "--stuck-after", "3", "--backoff", "0", "--", sys.executable, script
    )
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    (lingering,) = [line for line in err.splitlines() if "child.lingering" in line]
    assert "worker=1" in lingering and "the session has ended (done) at step 1" in lingering, err
    assert "child.stuck" not in err and "run.restarting" not in err, err
    exits = sorted(line for line in err.splitlines() if "child.exited" in line)
    # Its peer trains on to its own end (a stop signal would have ended it 143).
    assert "worker=0 status='0 (done)' how=exited" in exits[0], exits
    assert "worker=1 status='0 (done)' how='stopped: the session has ended" in exits[1], exits


LINGERS_AFTER_A_FAILURE = """
    if attempt == 1:
        tell(began("s1"), beat("s1", 3, Outcome.FAILED))
        time.sleep(600)
    train("s2", 0.3)
"""


def test_a_process_that_outlives_its_failed_session_is_restarted_as_a_failure(
    tmp_path: Path,
) -> None:
    script = child(tmp_path, SESSIONS + LINGERS_AFTER_A_FAILURE)
    run = supervisor("--stuck-after", "1", "--backoff", "0", "--", sys.executable, script)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    (restart,) = [line for line in err.splitlines() if "run.restarting" in line]
    assert "after='worker 0: 1 (failed), stopped: the session has ended (failed)" in restart, err
    assert "child.stuck" not in err, err


A_SECOND_SESSION_THAT_NEVER_BEATS = """
    if attempt == 1:
        # The first session ends and a second begins in the same write; the second never
        # beats. Its process is judged as a start (--startup-timeout), not by the first
        # session's end (--stuck-after), which would pass on the first session's 0.
        tell(began("s1"), beat("s1", 3, Outcome.DONE), began("s2"))
        time.sleep(600)
    train("s3", 0.3)
"""


def test_a_new_session_that_has_not_beaten_is_judged_as_a_start_not_by_the_one_before(
    tmp_path: Path,
) -> None:
    script = child(tmp_path, SESSIONS + A_SECOND_SESSION_THAT_NEVER_BEATS)
    run = supervisor(
        "--stuck-after", "1", "--startup-timeout", "3", "--backoff", "0", "--",
        sys.executable, script,
    )  # fmt: skip
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert "child.lingering" not in err, err
    (stuck,) = [line for line in err.splitlines() if "child.stuck" in line]
    assert "a new session began and has not beaten 3 s after the one before ended" in stuck, err
    (restart,) = [line for line in err.splitlines() if "run.restarting" in line]
    assert "after='worker 0: 124 (stuck)" in restart, err


def test_a_child_dead_of_the_stop_signal_after_its_session_began_keeps_its_status() -> None:
    from asupervisor._run.attempt import Kill, StopCause, passed_on

    term = int(signal.SIGTERM)
    assert passed_on(143, StopCause.REQUESTED, None, None, True, term) == 42  # untrained
    assert passed_on(143, StopCause.REQUESTED, None, None, False, term) == 143  # it ran
    assert passed_on(143, StopCause.PEER, None, None, True, term) == 143  # one for all
    assert passed_on(143, None, None, None, True, term) == 143  # not the runner's signal
    assert passed_on(137, StopCause.REQUESTED, Kill.PAST_DEADLINE, None, False, term) == 137
    assert passed_on(0, StopCause.STUCK, None, "no heartbeat", False, term) == 124
    # A process stopped after its session ended: that session's status, however it ended.
    lingering = StopCause.LINGERING
    assert passed_on(143, lingering, None, None, False, term, session_status=0) == 0
    assert passed_on(137, lingering, Kill.PAST_DEADLINE, None, False, term, session_status=42) == 42
    assert passed_on(143, lingering, None, None, False, term, session_status=None) == 143


def test_a_child_dead_of_a_signal_after_its_session_ended_preempted_is_preempted() -> None:
    """Its final checkpoint is committed: SLURM ending the step when another task exited
    42 (srun --kill-on-bad-exit), or a runtime's thread torn down at exit (SIGABRT), loses
    nothing. Seen on the SLURM cluster: 143 and 134 after 'stopped 42', and no requeue."""
    from asupervisor._run.attempt import StopCause, passed_on

    term = int(signal.SIGTERM)
    for returned in (143, 134, 137):
        assert passed_on(returned, None, None, None, False, term, session_status=42) == 42
        stopped = StopCause.REQUESTED
        assert passed_on(returned, stopped, None, None, False, term, session_status=42) == 42
    # A session that ended done, then the run's stop as it left (a time limit's warning
    # at the end; seen on the SLURM cluster: 143, the job FAILED): preempted, so what
    # came after the session runs again at the requeue. Not the runner's stop: its own.
    stopped = StopCause.REQUESTED
    assert passed_on(143, stopped, None, None, False, term, session_status=0) == 42
    assert passed_on(137, None, None, None, False, term, session_status=0) == 137
    assert passed_on(1, None, None, None, False, term, session_status=42) == 1  # no signal


WORKERS = """
    import json, os, signal, sys, time
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    attempt = os.environ["ASUPERVISOR_ATTEMPT"]
    # A collective that loses its peer fails: the survivor exits 1 when stopped.
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))
    ready = os.path.join(sys.argv[1], f"ready-{attempt}-{rank}")
    open(ready, "w").close()
    print(f"attempt {attempt} worker {rank} pid {os.getpid()}", flush=True)
    if rank == 1 and attempt == "1":
        while not os.path.exists(os.path.join(sys.argv[1], "ready-1-0")):  # its peer is up
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == "2":
        sys.exit(0)
    time.sleep(600)
"""


def test_the_restart_after_a_worker_died_names_that_worker(tmp_path: Path) -> None:
    script = child(tmp_path, WORKERS)
    run = supervisor(
        "--workers", "2", "--backoff", "0", "--", sys.executable, script, str(tmp_path)
    )
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    (restart,) = [line for line in err.splitlines() if "run.restarting" in line]
    assert "after='worker 1: 137 (SIGKILL)'" in restart, restart
    exits = [line for line in err.splitlines() if "child.exited attempt=1" in line]
    assert any("worker=0 status='1 (failed)'" in line for line in exits), exits


SLOW_IMPORT = """
    import os, time
    with open(__file__ + ".imports", "a") as f:  # one line per import
        f.write(f"{os.getpid()}\\n")
    time.sleep(1)
"""

STANDBY_CHILD = """
    import json, os, signal, sys, time
    attempt = os.environ["ASUPERVISOR_ATTEMPT"]
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    warm = "slowimport" in sys.modules
    # One write of the whole line: two workers share the runner's stdout, and print()
    # writes the text and its newline apart when the stream is unbuffered.
    os.write(1, (f"attempt {attempt} worker {rank} warm {warm} parent {os.getppid()} "
                 f"group {os.getpgid(0) == os.getpid()} argv {sys.argv[1:]}\\n").encode())
    open(os.path.join(sys.argv[1], f"up-{attempt}-{rank}"), "w").close()
    if attempt == "1" and rank == 1:
        while not os.path.exists(os.path.join(sys.argv[1], "up-1-0")):  # its peer is up
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == "1":
        time.sleep(600)
"""


def test_every_start_forks_from_one_standby_and_is_the_runners_own(tmp_path: Path) -> None:
    module = tmp_path / "slowimport.py"
    module.write_text(textwrap.dedent(SLOW_IMPORT))
    script = child(tmp_path, STANDBY_CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen(
        [sys.executable, "-m", "asupervisor", "run", "--standby", "--preload", "slowimport",
         "--workers", "2", "--backoff", "0", "--", sys.executable, script, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        out, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 0, err
    # Imported once, by the standby; four starts of two workers forked from it, each
    # the runner's own child (it waits for them: the SIGKILL is seen) in a group of its own.
    (standby,) = Path(f"{module}.imports").read_text().split()
    assert f"standby.started pid={standby}" in err, err
    starts = sorted(out.splitlines())
    expected = [
        f"attempt {a} worker {r} warm True parent {run.pid} group True argv ['{tmp_path}']"
        for a in (1, 2)
        for r in (0, 1)
    ]
    assert starts == expected, out + err
    assert err.count("start=standby") + err.count("still importing") >= 4, err
    (restart,) = [line for line in err.splitlines() if "run.restarting" in line]
    assert "after='worker 1: 137 (SIGKILL)'" in restart, restart
    assert "standby.ready" in err and "Traceback" not in err, err


SLOWER_IMPORT = """
    import time
    time.sleep(4)
"""

ONCE = """
    import os, sys
    print(f"ran warm {'slowerimport' in sys.modules} pid {os.getpid()}", flush=True)
"""


def test_a_standby_that_forks_nothing_in_time_is_given_up_and_the_start_goes_cold(
    tmp_path: Path,
) -> None:
    (tmp_path / "slowerimport.py").write_text(textwrap.dedent(SLOWER_IMPORT))
    script = child(tmp_path, ONCE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "asupervisor", "run", "--standby", "--preload", "slowerimport",
         "--startup-timeout", "1", "--stuck-after", "1", "--no-heartbeat",
         "--", sys.executable, script],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "no start forked within 1 s" in run.stderr, run.stderr
    assert "start=cold" in run.stderr, run.stderr
    # The start the runner gave up on never ran the command: one line, from the cold one.
    (line,) = run.stdout.splitlines()
    assert line.startswith("ran warm False"), line


SESSION_GRACE = (
    TELL
    + """
    tell("session", session="s", pid=os.getpid(), chief=True, stop_grace_secs=120.0)
    time.sleep(1)
"""
)


def test_a_grace_that_leaves_no_time_for_the_childs_own_stop_is_said(tmp_path: Path) -> None:
    run = supervisor("--grace", "60", "--", sys.executable, child(tmp_path, SESSION_GRACE))
    _, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    (told,) = [line for line in err.splitlines() if "run.grace_too_short" in line]
    assert "grace_secs=60" in told and "child_stop_grace_secs=120.0" in told, told


def test_health_that_cannot_read_the_heartbeat_says_cannot_tell_not_stale(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    # A store without a file system here, and one out of reach (a dead proxy: TF's GCS
    # client retries for minutes; --timeout bounds it).
    offline = {**env, "https_proxy": "http://127.0.0.1:9", "NO_GCE_CHECK": "True",
               "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x"}  # fmt: skip
    for target, extra, environment in [
        ("s3://bucket/run", [], env),
        ("gs://bucket/run", ["--timeout", "2"], offline),
    ]:
        done = forked.run(
            [sys.executable, "-m", "asupervisor", "health", target, *extra],
            capture_output=True, text=True, timeout=120, env=environment,
        )  # fmt: skip
        assert done.returncode == 3, done.stderr
        mine = [line for line in done.stderr.splitlines() if line.startswith("asupervisor")]
        assert len(mine) == 1 and "cannot tell" in mine[0], done.stderr
        assert "Traceback" not in done.stderr, done.stderr


def test_a_logdir_that_cannot_be_read_is_a_phrase_in_the_report_not_a_traceback(
    tmp_path: Path,
) -> None:
    script = child(tmp_path, "import sys; sys.exit(1)")
    args = ["--logdir", "s3://bucket/run", "--max-failures", "1", "--", sys.executable, script]
    run = forked.Popen(  # the supervisor reads the logdir through TensorFlow: imported there
        [sys.executable, "-m", "asupervisor", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    _, err = run.communicate(timeout=120)
    assert run.returncode == 1, err
    assert "Traceback" not in err, err
    # TensorFlow says it has no s3://, or its import alone outlasts the bound under load.
    assert "the logdir cannot be read" in err or "the logdir did not answer" in err, err


def test_more_workers_than_the_open_file_limit_holds_is_one_line() -> None:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "asupervisor", "run", "--workers", "300", "--", "true"],
        capture_output=True, text=True, timeout=60, env=env, preexec_fn=low_limit,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "--workers 300 needs about" in done.stderr and "256" in done.stderr


@pytest.mark.anyio
async def test_a_process_reports_on_its_channel_and_its_end_is_seen(tmp_path: Path) -> None:
    from asupervisor._logdir import channel as _channel
    from asupervisor._run.process import Proc, spawn

    heard: list[object] = []
    ended: list[Proc] = []
    code = textwrap.dedent(TELL) + textwrap.dedent(
        """
        tell("commit", session="s", step=5, at=1.0)
        os.write(int(os.environ["ASUPERVISOR_CHANNEL"]), b"not a report\\n")
        tell("ready", seconds=0.5)
        """
    )
    async with anyio.create_task_group() as tg:
        proc = await spawn(
            [sys.executable, "-c", code], dict(os.environ), tg, lambda chunk: None,
            lambda p, report: heard.append(report), ended.append,
        )  # fmt: skip
        with anyio.fail_after(30):
            await proc.exited.wait()
    assert heard == [_channel.Commit("s", 5, 1.0), _channel.Ready(0.5)]
    assert (proc.heard.commits, proc.heard.committed, proc.returncode) == (1, 5, 0)
    assert ended == [proc]


# A chief's commit as a session makes it (the library's own catalog: the history names
# the checkpoint, with this run and attempt), then a SIGKILL before the session told the
# runner of it on its channel (a session tells its commits with its next beat).
COMMITS_THEN_KILLED = """
    import json, os, signal, sys
    from asupervisor._logdir.catalog import Catalog
    from asupervisor._logdir.history import Provenance
    from asupervisor._logdir.records import Record
    from asupervisor._logdir.store import Store

    logdir, attempt = sys.argv[1], int(os.environ["ASUPERVISOR_ATTEMPT"])
    session = f"s{attempt}"
    began = {"kind": "session", "session": session, "pid": os.getpid(), "chief": True,
             "stop_grace_secs": 1.0, "logdir": logdir}
    os.write(int(os.environ["ASUPERVISOR_CHANNEL"]), (json.dumps(began) + "\\n").encode())
    if attempt == 4:
        sys.exit(0)
    catalog = Catalog(Store(logdir), "model.ckpt", writer=True,
                      provenance=Provenance.of_session(session))
    catalog.load()
    catalog.commit(f"model.ckpt-{100 * attempt}", Record(100 * attempt, 0.0))
    os.kill(os.getpid(), signal.SIGKILL)  # 30 steps later: no beat since the commit
"""


@pytest.mark.parametrize("start", ["cold", "standby"])
def test_a_restart_after_a_kill_soon_after_a_commit_is_progress_at_once(
    tmp_path: Path, start: str
) -> None:
    logdir = tmp_path / "run"
    logdir.mkdir()
    script = child(tmp_path, COMMITS_THEN_KILLED)
    warm = ["--standby", "--preload", "asupervisor._logdir.catalog"] if start == "standby" else []
    # No --logdir: the runner learns where its sessions commit from their channel.
    run = supervisor(*warm, "--backoff", "0.05", "--", sys.executable, script, str(logdir))
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    restarts = [line for line in err.splitlines() if "run.restarting" in line]
    assert len(restarts) == 3, err
    for number, line in enumerate(restarts, start=1):
        assert f"attempt={number + 1} " in line and f"committed={100 * number} " in line, line
        assert "progress='yes (costs nothing)' failures_without_progress=0/3 in_secs=0.0" in line
    if start == "standby":
        assert err.count("start=standby") + err.count("still importing") == 4, err


def test_a_store_that_cannot_be_reached_is_restarted_within_the_budget() -> None:
    """An outage passes; credentials that are missing do not, and the crash-loop budget
    ends that run after --max-failures attempts without progress."""
    from asupervisor._run import statuses

    assert statuses.outcome_of(69).value == "unreachable"
    assert statuses.outcome_of(69) in statuses.RESTARTED
    assert statuses.describe_status(69) == "69 (unreachable)"
