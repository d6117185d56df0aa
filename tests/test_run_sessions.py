"""`asupervisor run` over real training sessions: a hung step and a blocked event loop are
killed after the deadline and restarted (from a warm standby), SIGTERM to the supervisor
ends both with the preempted status, and a two-worker job where one worker is SIGKILLed
restarts both from one checkpoint (the other worker's end: it lost its peer, 75)."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import tensorflow as tf

from asupervisor._logdir import ledger as _ledger
from asupervisor._logdir.store import Store
from asupervisor.cli import main
from tests import forked
from tests.test_run_group import assert_folded_and_shown

ROOT = Path(__file__).parents[1]

pytestmark = pytest.mark.slow


class Supervised:
    """`asupervisor run` in a subprocess; the children's stdout (inherited) collected."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asupervisor", "run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.errors), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._changed:
                into.append(line.rstrip())
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match[str]:
        wanted = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if found := wanted.search(line):
                        return found
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(f"no line matches {pattern!r}:\n{self.output}")
                self._changed.wait(0.5)

    def finish(self, timeout: float = 180) -> int:
        code = self.proc.wait(timeout)
        for reader in self._readers:  # to the end of the output: every line is read
            reader.join(30)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines[-40:]) + "\n" + "\n".join(self.errors[-60:])


def matches(lines: list[str], pattern: str) -> list[re.Match[str]]:
    return [m for line in lines if (m := re.match(pattern, line))]


HANGS = """
    import sys
    WARM = "tensorflow" in sys.modules  # a warm standby imported it before this script ran
    import os, time
    import anyio, tensorflow as tf
    import asupervisor as asv

    logdir, attempt = sys.argv[1], int(os.environ["ASUPERVISOR_ATTEMPT"])
    v = tf.Variable(0.0)

    async def main() -> None:
        sv = asv.Supervisor(logdir, checkpoint={"v": v}, save_model_secs=0, save_model_steps=5,
                            save_summaries_secs=0, heartbeat_secs=0.2, stop_grace_secs=1)
        async with sv.session() as sess:
            restored = sess.restore_report.step
            print(f"attempt {attempt} warm {WARM} restored {restored}", flush=True)
            while not sess.should_stop():
                await sess.run(v.assign_add, 1.0)
                if attempt == 1 and sess.global_step == 8:
                    await sess.run(time.sleep, 3600)  # a step that never ends
                if attempt == 2 and sess.global_step == restored + 8:
                    time.sleep(3600)  # blocks the event loop
                if attempt == 3 and sess.global_step == restored + 20:
                    print("trained", flush=True)
                await anyio.sleep(0.005)
        print(f"stopped {sess.global_step} {sess.stop_reason}", flush=True)

    sys.exit(asv.run(main))
"""


def test_hung_children_are_killed_and_restarted_and_sigterm_ends_both_preempted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logdir = tmp_path / "run"
    script = tmp_path / "hangs.py"
    script.write_text(textwrap.dedent(HANGS))
    run = Supervised(
        "--logdir",
        str(logdir),
        "--stuck-after",
        "4",
        "--startup-timeout",
        "120",
        "--grace",
        "6",
        "--standby",
        "--",
        sys.executable,
        str(script),
        str(logdir),
    )
    try:
        run.wait_for(r"^trained")
        # Alive from outside while it trains; the ledger shows its three sessions.
        assert main(["health", str(logdir), "--max-age", "60"]) == 0
        run.proc.send_signal(signal.SIGTERM)
        code = run.finish()
    finally:
        run.proc.kill()
    assert code == 42, run.output  # the child's 42, passed on: preempted, not done
    starts = matches(run.lines, r"attempt (\d) warm (\w+) restored (\d+)")
    # Attempt 2 holds its event loop: once its grace (1 s) is spent after the runner's stop,
    # it ends itself stuck with a final checkpoint (step 13), before the runner's kill.
    assert [(m[1], m[3]) for m in starts] == [("1", "0"), ("2", "5"), ("3", "13")], run.output
    assert [m[2] for m in starts] == ["True"] * 3  # all three forked from the standby
    stuck = [line for line in run.errors if "child.stuck" in line]
    assert "v.assign_add" not in stuck[0] and "has run for" in stuck[0], stuck  # the hung step
    assert "event loop is blocked" in stuck[1], stuck
    (final,) = [line for line in run.lines if line.startswith("stopped")]
    step, reason = final.split()[1:]
    assert reason == "signal"
    assert tf.train.latest_checkpoint(str(logdir)).endswith(f"model.ckpt-{step}")  # saved

    first, second, third = _ledger.sessions(_ledger.read(Store(str(logdir))))
    assert (first.restored_step, first.outcome, first.exit_status) == (0, "stuck", 124)
    assert (second.restored_step, second.outcome, second.exit_status) == (5, "stuck", 124)
    assert (third.restored_step, third.outcome, third.exit_status) == (13, "preempted", 42)
    assert (third.step, [s.attempt for s in (first, second, third)]) == (int(step), [1, 2, 3])
    capsys.readouterr()
    assert main(["inspect", str(logdir), "--no-verify"]) == 0
    shown = capsys.readouterr().out
    assert "sessions (3; from" in shown and "no end recorded" not in shown


MULTIWORKER = """
    import os, sys
    import anyio, tensorflow as tf
    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():  # MEAN: each update is an all-reduce, so the workers go in lockstep
        w = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN)

    @tf.function
    def step():
        strategy.run(lambda: w.assign_add(1.0))

    attempt = os.environ["ASUPERVISOR_ATTEMPT"]

    def say(line):  # one write: the two workers share the pipe (print writes the end apart)
        os.write(1, (line + "\\n").encode())

    async def main() -> None:
        sv = asv.Supervisor(
            sys.argv[1], checkpoint={"w": w}, strategy=strategy, is_chief=None,
            save_model_secs=0, save_model_steps=10, save_summaries_secs=0, heartbeat_secs=0.2,
            hooks=[StopAtStepHook(num_steps=30)] if attempt != "1" else [], stop_grace_secs=5,
        )
        async with sv.session() as sess:
            say(f"attempt {attempt} worker {sv.role.rank} pid {os.getpid()} restored "
                f"{sess.restore_report.step} w {float(w.numpy()):.0f}")
            while not sess.should_stop():
                await sess.run(step)
        say(f"worker {sv.role.rank} stopped {sess.global_step} {sess.stop_reason}")

    sys.exit(asv.run(main))
"""


def test_two_workers_one_killed_both_restart_from_one_checkpoint(tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    script = tmp_path / "mw.py"
    script.write_text(textwrap.dedent(MULTIWORKER))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.environ["TMPDIR"] = str(scratch)  # where the non-chief's scratch saves go
    try:
        run = Supervised(
            "--workers", "2", "--logdir", str(logdir),
            "--", *forked.runner_child(script, str(logdir)),
        )  # fmt: skip
    finally:
        del os.environ["TMPDIR"]
    try:
        victim = int(run.wait_for(r"^attempt 1 worker 1 pid (\d+)")[1])
        deadline = time.monotonic() + 120
        while not (logdir / "model.ckpt-20.index").exists():  # read the disk, not log lines
            assert time.monotonic() < deadline and run.proc.poll() is None, run.output
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        code = run.finish()
    finally:
        run.proc.kill()
    assert code == 0, run.output
    # Decided from the ledger (facts on disk), not from the runner's lines. The runner
    # started both workers: its group line has how each ended, and the first to fail.
    from asupervisor._logdir.groups import groups

    records = _ledger.read(Store(str(logdir)))
    group = groups(records)[0]
    ended = {w.rank: w for w in group.workers}
    assert (ended[1].status, ended[1].first, ended[1].stopped) == (137, True, False), group
    # The chief lost its peer: its end says so, with a status of its own (75); unless the
    # group's stop, sent once worker 1 was gone, reached it first (seen beside two busy
    # loops: 143). Either way the group's restart counted the SIGKILL, the first failure,
    # as its cause.
    lost = ended[0].status == 75
    assert ended[0].status in (75, 143) and not ended[0].first, group
    assert (group.attempt, group.status) == (1, 137) and "worker 1" in group.cause, group
    sessions = _ledger.sessions(records)
    first = next(s for s in sessions if s.attempt == 1)
    if lost:
        assert (first.outcome, first.exit_status, first.worker) == ("lost_peer", 75, "worker:0")
    assert ended[0].session == first.session
    # The group restarted: the chief's second session is attempt 2 of the same run.
    second = next(s for s in sessions if s.attempt == 2)
    assert second.run == first.run == group.run and second.outcome == "done", sessions
    again = matches(run.lines, r"attempt 2 worker (\d) .* restored (\d+) w (\d+)")
    assert sorted(m[1] for m in again) == ["0", "1"], run.output
    (restored,) = {(m[2], m[3]) for m in again}  # both from one checkpoint, its values too
    assert restored[0] == restored[1] and int(restored[0]) >= 20
    assert second.restored_step == int(restored[0]), second
    stops = {line for line in run.lines if "stopped" in line}
    assert stops == {f"worker {r} stopped {int(restored[0]) + 30} step_limit" for r in (0, 1)}


def test_per_host_members_of_a_job_fold_each_workers_end_into_the_chiefs_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two `asupervisor run`, one per "host", each one member of a two-worker job (its
    TF_CONFIG names the other), as a JobSet's or a TFJob's pods run it. Worker 1's trainer
    is killed. Each member records its end; the chief's folds them into the ledger as the
    group's attempt: worker 1 first, with its host and status, and the chief's session.
    (Members stopped together, every worker stopped and none first, and an attempt
    counted on at the next chief's start: test_run_group.py, without TensorFlow.)"""
    from asupervisor._logdir.groups import groups
    from examples.multiworker import local_tf_configs

    logdir = tmp_path / "run"
    script = tmp_path / "mw.py"
    script.write_text(textwrap.dedent(MULTIWORKER))
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def start() -> list[Supervised]:
        members = []
        os.environ["TMPDIR"] = str(scratch)  # where the non-chief's scratch saves go
        try:
            for config in local_tf_configs(2):
                os.environ["TF_CONFIG"] = config
                args = ("--logdir", str(logdir), "--", *forked.runner_child(script, str(logdir)))
                members.append(Supervised(*args))
        finally:
            del os.environ["TMPDIR"], os.environ["TF_CONFIG"]
        return members

    members = start()
    try:
        victim = int(members[1].wait_for(r"^attempt 1 worker 1 pid (\d+)")[1])
        deadline = time.monotonic() + 120
        while not (logdir / "model.ckpt-10.index").exists():  # read the disk, not log lines
            assert time.monotonic() < deadline and members[0].proc.poll() is None
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        codes = [m.finish(120) for m in members]
    finally:
        for m in members:
            m.proc.kill()
    # Each member exits at once for the engine to restart the group; the survivor lost its
    # peer, unless it was still in a step the kill cut (then TF's own error: failed).
    assert codes[1] == 137 and codes[0] in (75, 1), [m.output for m in members]
    records = _ledger.read(Store(str(logdir)))
    (killed,) = groups(records)
    ended = {w.rank: w for w in killed.workers}
    host = socket.gethostname()
    assert (ended[1].host, ended[1].status, ended[1].first, ended[1].stopped) == (
        host, 137, True, False
    ), killed  # fmt: skip
    assert (ended[0].host, ended[0].status, ended[0].first) == (host, codes[0], False), killed
    assert (killed.attempt, killed.status) == (1, 137) and f"worker 1 on {host}" in killed.cause
    chiefs = [s.session for s in _ledger.sessions(records)]
    assert [ended[0].session] == chiefs
    assert ended[0].step is not None
    assert_folded_and_shown(logdir, capsys, f"1 * 1 {host} ", "137 (SIGKILL)")


TRAINS = """
    import os, sys, time
    import anyio, tensorflow as tf
    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook

    logdir, attempt = sys.argv[1], int(os.environ["ASUPERVISOR_ATTEMPT"])
    last_step, hang_after, pause = int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    v = tf.Variable(0.0)

    async def main() -> None:
        sv = asv.Supervisor(logdir, checkpoint={"v": v}, save_model_secs=0, save_model_steps=5,
                            save_summaries_secs=0, heartbeat_secs=0.2, stop_grace_secs=1,
                            hooks=[StopAtStepHook(last_step=last_step)])
        async with sv.session() as sess:
            print(f"attempt {attempt} pid {os.getpid()} restored {sess.restore_report.step}",
                  flush=True)
            while not sess.should_stop():
                await sess.run(v.assign_add, 1.0)
                await anyio.sleep(pause)
        print(f"attempt {attempt} ended {sess.outcome.value} at {sess.global_step}", flush=True)
        if hang_after == "yes" and attempt == 1:
            time.sleep(3600)  # the session has ended; the process never does

    sys.exit(asv.run(main))
"""


def trains(
    tmp_path: Path, logdir: Path, last_step: int, hang_after: bool = False, pause: float = 0.05
) -> list[str]:
    """A child that trains to ``last_step``, ``pause`` seconds between steps."""
    script = tmp_path / "trains.py"
    script.write_text(textwrap.dedent(TRAINS))
    hang = "yes" if hang_after else ""
    return forked.runner_child(script, str(logdir), str(last_step), hang, str(pause))


def wait_for_file(path: Path, run: Supervised, timeout: float = 180) -> None:
    """Until ``path`` exists: what is on disk, not a log line."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline and run.proc.poll() is None, run.output
        time.sleep(0.05)


def test_a_second_run_on_a_logdir_another_run_holds_fails_permanently_at_once(
    tmp_path: Path,
) -> None:
    logdir = tmp_path / "run"
    first = Supervised("--logdir", str(logdir), "--", *trains(tmp_path, logdir, 10**6))
    try:
        wait_for_file(logdir / "model.ckpt-5.index", first)
        second = Supervised("--logdir", str(logdir), "--", *trains(tmp_path, logdir, 10**6))
        try:
            code = second.finish()
        finally:
            second.proc.kill()
        assert first.proc.poll() is None, first.output  # the first run goes on untouched
        first.proc.send_signal(signal.SIGTERM)
        assert first.finish() == 42, first.output
    finally:
        first.proc.kill()
    assert code == 78, second.output  # LogdirLockedError: a retry meets it again
    assert sum("child.started" in line for line in second.errors) == 1, second.output
    assert any("LogdirLockedError" in line for line in second.errors), second.output


def test_a_process_that_outlives_its_session_is_stopped_and_its_sessions_end_passed_on(
    tmp_path: Path,
) -> None:
    """A process still running --stuck-after after its session ended done is stopped, but
    its training is over: the run is done, with one attempt (before, it was judged stuck
    and restarted; a slow interpreter exit under load restarted a finished run until its
    failure budget ran out)."""
    logdir = tmp_path / "run"
    run = Supervised(
        "--logdir", str(logdir), "--stuck-after", "6", "--backoff", "0",
        "--grace", "2",  # the kill comes 2 s after the stop signal (its sleep ignores it)
        "--", *trains(tmp_path, logdir, 10, hang_after=True),
    )  # fmt: skip
    try:
        code = run.finish(timeout=240)
    finally:
        run.proc.kill()
    assert code == 0, run.output
    (lingering,) = [line for line in run.errors if "child.lingering" in line]
    assert "the session has ended (done) at step 10" in lingering, lingering
    assert "its process still runs (limit 6 s)" in lingering, lingering
    assert not [line for line in run.errors if "child.stuck" in line], run.output
    assert not [line for line in run.errors if "run.restarting" in line], run.output
    (exited,) = [line for line in run.errors if "child.exited" in line]
    assert "status='0 (done)'" in exited and "stopped: the session has ended" in exited, exited
    assert [line for line in run.lines if "ended" in line] == ["attempt 1 ended done at 10"]
    # On disk: one session, its end recorded done before the process was stopped.
    (session,) = _ledger.sessions(_ledger.read(Store(str(logdir))))
    assert (session.outcome, session.exit_status) == ("done", 0), run.output


def test_a_full_tmpdir_does_not_make_a_healthy_child_look_dead(tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    os.environ["TMPDIR"] = str(tmpdir)  # the supervisor's scratch, if it has one
    try:
        run = Supervised(
            "--logdir", str(logdir), "--stuck-after", "5",
            "--", *trains(tmp_path, logdir, 10**6, pause=0.25),
        )  # fmt: skip
    finally:
        del os.environ["TMPDIR"]
    try:
        wait_for_file(logdir / "model.ckpt-10.index", run)
        shutil.rmtree(tmpdir)  # nothing can be written there any more
        tmpdir.write_text("full")
        # Several --stuck-after periods of training while TMPDIR cannot be written: 50
        # steps, each over 0.25 s (the pause, a few steps' CPU: not 240 steps of 0.05 s).
        wait_for_file(logdir / "model.ckpt-60.index", run)
        run.proc.send_signal(signal.SIGTERM)
        code = run.finish()
    finally:
        run.proc.kill()
    assert code == 42, run.output
    assert not [line for line in run.errors if "child.stuck" in line], run.output
    assert sum("child.started" in line for line in run.errors) == 1, run.output


THREE_FAULTS = """
    import os, signal, sys, time
    import anyio, tensorflow as tf
    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook

    logdir, attempt = sys.argv[1], int(os.environ["ASUPERVISOR_ATTEMPT"])
    ledger = os.path.join(logdir, "asupervisor-ledger.jsonl")
    v = tf.Variable(0.0)

    async def main() -> None:
        sv = asv.Supervisor(logdir, checkpoint={"v": v}, save_model_secs=0, save_model_steps=5,
                            save_summaries_secs=0, heartbeat_secs=0.2, stop_grace_secs=1,
                            hooks=[StopAtStepHook(last_step=40)])
        async with sv.session() as sess:
            restored = sess.restore_report.step
            while not sess.should_stop():
                await sess.run(v.assign_add, 1.0)
                at = sess.global_step - restored
                if attempt == 1 and at == 8:
                    raise RuntimeError("a bug that strikes once")
                if attempt == 2 and at == 7:
                    # The OOM killer, once this session's first step is on disk (the
                    # heartbeat writes it within one beat; a loaded machine may run 7
                    # steps before that).
                    while open(ledger).read().count('"first_step"') < 2:
                        await anyio.sleep(0.05)
                    os.kill(os.getpid(), signal.SIGKILL)
                if attempt == 3 and at == 7:
                    await sess.run(time.sleep, 3600)  # a step that never ends
                await anyio.sleep(0.02)

    sys.exit(asv.run(main))
"""


@pytest.fixture(scope="module")
def three_faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A logdir of a run under `asupervisor run` with three faults (an error, a SIGKILL,
    a stuck step), then done: four sessions."""
    tmp_path = tmp_path_factory.mktemp("three_faults")
    logdir = tmp_path / "run"
    script = tmp_path / "faults.py"
    script.write_text(textwrap.dedent(THREE_FAULTS))
    run = Supervised(
        "--logdir", str(logdir), "--stuck-after", "8", "--startup-timeout", "120",
        "--", *forked.runner_child(script, str(logdir)),
    )  # fmt: skip
    try:
        code = run.finish(timeout=300)
    finally:
        run.proc.kill()
    assert code == 0, run.output
    return logdir


def test_inspect_shows_each_restart_its_cost_and_the_runs_goodput(
    three_faults: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logdir = three_faults
    sessions = _ledger.sessions(_ledger.read(Store(str(logdir))))
    assert [s.attempt for s in sessions] == [1, 2, 3, 4]
    assert len({s.run for s in sessions}) == 1 and sessions[0].run is not None
    assert [s.outcome for s in sessions] == ["failed", None, "stuck", "done"]
    assert all(s.first_step_at is not None for s in sessions)
    assert [s.restored_step for s in sessions] == [0, 5, 10, 15]
    assert all(s.restored_commit_at is not None for s in sessions[1:])
    capsys.readouterr()
    assert main(["inspect", str(logdir), "--no-verify"]) == 0
    shown = capsys.readouterr().out
    print(shown)  # the report pastes it
    assert "restarts (3; from asupervisor-ledger.jsonl):" in shown
    assert re.search(r"goodput: \d+\.\d% of [\d.]+ s", shown), shown


def test_the_runner_records_the_step_a_killed_session_reached_from_its_last_beat(
    three_faults: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    killed = _ledger.sessions(_ledger.read(Store(str(three_faults))))[1]
    # SIGKILLed at step 12 (5 restored + 7), after its first beats: its session wrote no
    # end; the runner wrote it, with its last beat's step.
    assert killed.recorded_by == "runner" and killed.exit_status == 128 + signal.SIGKILL
    assert killed.ended is not None and killed.step is not None and 5 <= killed.step <= 12
    capsys.readouterr()
    assert main(["inspect", str(three_faults), "--no-verify"]) == 0
    shown = capsys.readouterr().out
    restart = next(line.split() for line in shown.splitlines() if "killed (137)" in line)
    assert str(killed.step) in restart and "?" not in restart  # step reached, steps lost


HUNG_STEP = """
    import sys, time
    import anyio, tensorflow as tf
    import asupervisor as asv

    v = tf.Variable(0.0)

    async def main() -> None:
        # The summary and step-counter services write through the training thread: behind
        # a hung step they wait too.
        sv = asv.Supervisor(sys.argv[1], checkpoint={"v": v}, save_model_secs=0,
                            save_model_steps=5, save_summaries_secs=0.2, heartbeat_secs=0.2,
                            stop_grace_secs=6)
        async with sv.session() as sess:
            while not sess.should_stop():
                await sess.run(v.assign_add, 1.0)
                if sess.global_step == 5:
                    print("hung", flush=True)
                    await sess.run(time.sleep, 3600)  # a step that never ends
                await anyio.sleep(0.01)

    sys.exit(asv.run(main))
"""


def test_a_hung_step_ends_its_process_within_one_grace_with_its_end_on_record(
    tmp_path: Path,
) -> None:
    """SIGTERM to `asupervisor run` over a child whose step hangs, with a 6 s stop grace:
    the child's session ends stuck within its one grace (the services get no second one:
    they used to wait a grace of their own after the step's), and its ledger says so,
    before the supervisor's kill could come (a SIGKILLed session has none). `--grace`
    follows the rule the runner states: the child's grace plus time to exit."""
    logdir = tmp_path / "run"
    script = tmp_path / "hung.py"
    script.write_text(textwrap.dedent(HUNG_STEP))
    run = Supervised(
        "--logdir",
        str(logdir),
        "--grace",
        "30",
        "--",
        *forked.runner_child(script, str(logdir)),
    )
    try:
        run.wait_for(r"^hung")
        time.sleep(0.5)  # the summary service is queued behind the hung step by now
        signalled = time.time()
        run.proc.send_signal(signal.SIGTERM)
        code = run.finish()
    finally:
        run.proc.kill()
    assert code == 124, run.output
    (session,) = _ledger.sessions(_ledger.read(Store(str(logdir))))
    # One grace (6 s) and the record's few seconds; two graces would be 12 s and more.
    ended = datetime.datetime.fromisoformat(session.ended or "").timestamp()
    assert ended - signalled < 11, (ended - signalled, run.output)
    assert (session.outcome, session.exit_status) == ("stuck", 124), run.output


JUDGED_STUCK = """
    import os, sys, time
    import anyio, tensorflow as tf
    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook

    v = tf.Variable(0.0)
    attempt = int(os.environ["ASUPERVISOR_ATTEMPT"])

    async def main() -> None:
        # A long grace: a step judged stuck must not be given it (the runner kills 10 s
        # after its stop signal, and a killed session leaves no end on record).
        sv = asv.Supervisor(sys.argv[1], checkpoint={"v": v}, save_model_secs=0,
                            save_model_steps=5, save_summaries_secs=0, heartbeat_secs=0.2,
                            stop_grace_secs=60, hooks=[StopAtStepHook(last_step=12)])
        async with sv.session() as sess:
            while not sess.should_stop():
                await sess.run(v.assign_add, 1.0)
                if attempt == 1 and sess.global_step == 7:
                    print("hung", flush=True)
                    await sess.run(time.sleep, 3600)  # a step that never ends
                await anyio.sleep(0.01)

    sys.exit(asv.run(main))
"""


def test_a_step_judged_stuck_is_not_given_the_grace_and_its_end_is_on_record(
    tmp_path: Path,
) -> None:
    """`--stuck-after 3` over a child whose step hangs, with a 60 s stop grace: the runner
    judges the step stuck and sends the stop signal; the child's session does not wait for
    that step again (it would be killed 10 s later, its end unrecorded), records its end
    (stuck, 124) and exits; the restart goes on from the last checkpoint to the end."""
    logdir = tmp_path / "run"
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(JUDGED_STUCK))
    run = Supervised(
        "--logdir",
        str(logdir),
        "--stuck-after",
        "3",
        "--startup-timeout",
        "120",
        "--grace",
        "90",
        "--",
        *forked.runner_child(script, str(logdir)),
    )
    try:
        code = run.finish()
    finally:
        run.proc.kill()
    assert code == 0, run.output
    sessions = _ledger.sessions(_ledger.read(Store(str(logdir))))
    assert len(sessions) == 2, run.output
    first, second = sessions
    assert first.ended is not None, run.output  # it ended itself, before the runner's kill
    assert (first.outcome, first.exit_status) == ("stuck", 124), run.output
    assert "past its deadline of 3 s" in "\n".join(run.errors), run.output
    assert (second.restored_step, second.outcome) == (5, "done"), run.output
    assert tf.train.latest_checkpoint(str(logdir)).endswith("model.ckpt-12")
