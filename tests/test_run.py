"""`asupervisor run` and `asupervisor health` with tiny children that import no TensorFlow.

What is tested here is the process supervisor (restarts, the budget, the report, the
stop, no orphans), so the children are a few lines of plain Python that write what a
checkpoint leaves for it to read: the logdir's state file. tests/test_run_sessions.py
runs real training sessions under it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asupervisor._logdir import heartbeat as _heartbeat
from asupervisor._run.supervisor import outcome_of, standby_plan
from asupervisor.cli import main
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


# A child that "saves" a checkpoint (the state file names it) and then fails.
SAVES_THEN_FAILS = """
    import os, signal, sys
    logdir, attempt = sys.argv[1], int(os.environ["ASUPERVISOR_ATTEMPT"])
    step = int(sys.argv[2]) if len(sys.argv) > 2 else 10 * attempt
    with open(os.path.join(logdir, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "model.ckpt-{step}"\\n')
    print(f"attempt {attempt} step {step}", flush=True)
    print(f"noise\\n" * 30 + f"boom at step {step}", file=sys.stderr, flush=True)
    if len(sys.argv) > 2:
        sys.exit(1)  # always the same step: a crash loop
    if attempt == 1:
        sys.exit(1)
    if attempt == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 3:
        raise RuntimeError("a bug that strikes once")
"""


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
    assert "3 failures in a row without a checkpoint newer than step 7" in report
    rows = [line.split() for line in report.splitlines() if line.strip()[:1].isdigit()]
    assert [(row[0], row[1], row[4], row[5]) for row in rows] == [
        (n, "1", "7", "no") for n in "123"
    ]
    assert "    | noise\n    | boom at step 7\n" in report  # the last lines of its stderr
    assert err.count("child.started") == 3


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


def test_a_command_that_cannot_run_is_not_retried(tmp_path: Path) -> None:
    run = supervisor("--", str(tmp_path / "no-such-command"))
    _, err = run.communicate(timeout=60)
    assert run.returncode == 127 and "cannot run" in err and err.count("child.started") == 1


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


def test_a_stop_waits_the_grace_then_kills_the_whole_group(tmp_path: Path) -> None:
    run = supervisor("--grace", "1", "--", sys.executable, child(tmp_path, STUBBORN))
    pids = started_pids(run)
    run.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, err = run.communicate(timeout=60)
    # Bounded by what happened: the child ignored SIGTERM and was killed after its grace.
    assert run.returncode == 124, err
    assert "killed after the grace period" in err and time.monotonic() - sent < 30
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
    assert main(["health", str(logdir), "--max-age", "30"]) == 0
    path.write_bytes(beat(written_at=time.time() - 100).to_json())
    assert main(["health", str(logdir), "--max-age", "30"]) == 1
    assert "event loop is blocked" in capsys.readouterr().out
    other = tmp_path / "beat.json"
    other.write_bytes(beat(busy_since=time.time() - 100, job="train_step").to_json())
    assert main(["health", str(other), "--max-age", "30", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["healthy"] and "train_step has run for" in report["why"]
    other.write_text("{")
    assert main(["health", str(other)]) == 2
