"""SIGTERM and SIGINT: graceful stop, final checkpoint, a second SIGINT, handlers restored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor._logdir.verify import verify_checkpoint
from tests import forked
from tests.conftest import Pair, named, pair_supervisor
from tests.faults.harness import Trainer


@pytest.mark.asyncio
async def test_sigterm_in_process_stops_gracefully_and_restores_the_users_handler(
    logdir: str, pair: Pair, events: list[dict[str, Any]]
) -> None:
    received: list[int] = []

    def users_handler(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, users_handler)
    try:
        sv = asv.Supervisor(
            logdir, checkpoint={"p": pair}, save_model_secs=60, save_summaries_secs=0
        )
        async with sv.session() as sess:
            assert signal.getsignal(signal.SIGTERM) is not users_handler
            while not sess.should_stop():
                await sess.run(pair.step)
                if sess.global_step == 7:
                    os.kill(os.getpid(), signal.SIGTERM)
                await anyio.sleep(0)
        assert sess.stop_reason == "signal"
        assert sess.global_step >= 7
        assert tf.train.latest_checkpoint(logdir).endswith(f"model.ckpt-{sess.global_step}")
        assert signal.getsignal(signal.SIGTERM) is users_handler
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM]  # the user's handler works again
        got = named(events, "signal.received")
        assert got and got[0]["signal"] == "SIGTERM"
        assert named(events, "stop.requested")[0]["reason"] == "signal"
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.asyncio
async def test_handle_signals_false_leaves_handlers_alone(pair: Pair) -> None:
    before = signal.getsignal(signal.SIGINT)
    sv = asv.Supervisor(None, checkpoint={"p": pair}, handle_signals=False)
    async with sv.session():
        assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
def test_sigterm_to_a_training_process_loses_no_step(tmp_path: Path) -> None:
    logdir = str(tmp_path / "run")
    run = Trainer(logdir)
    run.wait_for(lambda: run.last_step >= 20)
    run.proc.send_signal(signal.SIGTERM)
    # Preempted, not done: the trainer ends with asv.run, and 42 asks to be started again.
    assert run.proc.wait(60) == asv.Outcome.PREEMPTED.exit_status == 42, run.stderr_text()
    assert run.stopped == (run.last_step, "signal")
    assert run.last_saved == run.last_step  # the final checkpoint is the last completed step
    latest = tf.train.latest_checkpoint(logdir)
    assert latest.endswith(f"model.ckpt-{run.last_step}")

    again = Trainer(logdir, "--max-steps", str(run.last_step + 3))
    assert again.wait_restored() == run.last_step  # zero lost steps
    assert again.proc.wait(60) == 0


@pytest.mark.slow
def test_a_second_sigint_stops_at_once_without_a_final_save(tmp_path: Path) -> None:
    logdir = str(tmp_path / "run")
    run = Trainer(logdir, "--save-steps", "1", "--long-step", "60")
    run.wait_for(lambda: run.last_step >= 1)
    time.sleep(0.3)
    run.proc.send_signal(signal.SIGINT)  # step 2 is in flight for 60 s: a graceful stop waits
    time.sleep(0.3)
    run.proc.send_signal(signal.SIGINT)
    # Bound by what happened: the process ends long before the 60 s step could finish
    # (a graceful stop would have waited for it; wait() raises TimeoutExpired then).
    code = run.proc.wait(45)
    assert code != 0 and "KeyboardInterrupt" in run.stderr_text()
    assert run.stopped is None and run.last_saved == 1 and run.last_step == 1
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-1")
    assert verify_checkpoint(os.path.join(logdir, "model.ckpt-1")) is None


PIPED_RUN = textwrap.dedent(
    """
    import logging, os, sys
    import anyio, structlog, tensorflow as tf
    import asupervisor as asv

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stdout))
    logging.getLogger("asupervisor").setLevel(logging.INFO)
    v = tf.Variable(0.0)

    async def main() -> None:
        sv = asv.Supervisor(sys.argv[1], checkpoint={"v": v}, save_model_secs=0,
                            save_model_steps=5, save_summaries_secs=0)
        async with sv.session() as sess:
            while not sess.should_stop():
                await sess.run(v.assign_add, 1.0)
                await anyio.sleep(0.01)
        print("ended", sess.global_step, sess.stop_reason, file=sys.stderr, flush=True)

    anyio.run(main, backend=sys.argv[2])
    try:  # Python's own idiom for a closed pipe: nothing more goes to it
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_with_the_output_piped_away_still_saves(tmp_path: Path, backend: str) -> None:
    """`make demo 2>&1 | tee log`, then Ctrl-C: the pipe is gone before the stop's log lines."""
    script, logdir = tmp_path / "piped.py", tmp_path / "run"
    script.write_text(PIPED_RUN)
    with open(tmp_path / "stderr", "w") as err:
        proc = forked.Popen(
            [sys.executable, str(script), str(logdir), backend],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if "checkpoint.saved" in line and "step=5" in line:
                break
        proc.stdout.close()  # tee has gone with the Ctrl-C
        proc.send_signal(signal.SIGINT)
        code = proc.wait(120)
    text = (tmp_path / "stderr").read_text()
    assert code == 0, text
    _, step, reason = next(line for line in text.splitlines() if line.startswith("ended")).split()
    assert reason == "signal"
    assert tf.train.latest_checkpoint(str(logdir)).endswith(f"model.ckpt-{step}")


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_a_signal_during_shutdown_reaches_the_handler_in_force_after(
    logdir: str, pair: Pair, anyio_backend: str
) -> None:
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))

    class SignalledWhileFinishing(asv.Hook):
        def end(self, session: asv.ManagedSession) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the session stops
            time.sleep(0.2)

    try:
        sv = asv.Supervisor(
            logdir,
            checkpoint={"p": pair},
            save_model_secs=60,
            save_summaries_secs=0,
            hooks=[SignalledWhileFinishing()],
        )
        async with sv.session() as sess:
            await sess.run(pair.step)
        assert sess.stop_reason == "requested"
        assert received == [signal.SIGTERM]  # not swallowed by the stopping session
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.asyncio
async def test_the_stop_signals_are_the_sessions_choice(
    logdir: str, pair: Pair, events: list[dict[str, Any]]
) -> None:
    """SLURM asks a job to requeue with SIGUSR1: a session told so stops gracefully on it,
    ends preempted, and leaves SIGTERM and SIGINT as they were."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        sv = pair_supervisor(logdir, pair, handle_signals=True, stop_signals=("SIGUSR1",))
        async with sv.session() as sess:
            assert {sig: signal.getsignal(sig) for sig in before} == before
            while not sess.should_stop():
                await sess.run(pair.step)
                if sess.global_step == 3:
                    os.kill(os.getpid(), signal.SIGUSR1)
                await anyio.sleep(0)
        assert sess.stop_reason == "signal" and sess.outcome is asv.Outcome.PREEMPTED
        assert tf.train.latest_checkpoint(logdir).endswith(f"model.ckpt-{sess.global_step}")
        assert named(events, "signal.received")[0]["signal"] == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler the process had is back
        assert received == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.asyncio
async def test_overlapping_sessions_with_different_stop_signals_put_every_handler_back(
    tmp_path: Path,
) -> None:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    first = asv.Supervisor(None, stop_signals=[signal.SIGTERM, signal.SIGUSR1])
    second = asv.Supervisor(None, stop_signals=(signal.SIGUSR1.value,))
    async with first.session() as one:
        async with second.session() as two:
            os.kill(os.getpid(), signal.SIGUSR1)  # both listen for it
            await anyio.sleep(0.1)
            assert one.should_stop() and two.should_stop()
        assert signal.getsignal(signal.SIGUSR1) is not handlers[signal.SIGUSR1]  # one listens
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


@pytest.mark.parametrize(
    "value", [(), "SIGTERM", ("SIGKILL",), (signal.SIGCHLD,), ("NOSUCH",), (999,), (True,)]
)
def test_stop_signals_are_checked_at_construction(value: Any) -> None:
    with pytest.raises(ValueError, match="stop_signals"):
        asv.Supervisor(None, stop_signals=value)


AROUND_A_SESSION = textwrap.dedent(
    """
    import os, signal, sys, time
    import anyio, tensorflow as tf
    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook

    logdir, backend, when = sys.argv[1:4]
    v = tf.Variable(0.0)


    class SignalledDuringTheFinalSave(asv.Hook):
        def end(self, session):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # the signal arrives while the hooks' end and the final save run


    async def main():
        if when == "before":
            os.kill(os.getpid(), signal.SIGTERM)
            await anyio.sleep(60)  # the program's own preparation, before any session
            print("prepared", flush=True)
        if when == "twice_before":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)  # preparation that never awaits: the first one waits for it
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
            print("prepared", flush=True)
        hooks = [StopAtStepHook(last_step=3 if when != "unhandled" else 1000)]
        if when == "during_the_final_save":
            hooks.append(SignalledDuringTheFinalSave())
        sv = asv.Supervisor(logdir, checkpoint={"v": v}, hooks=hooks, save_model_secs=0,
                            save_model_steps=100, save_summaries_secs=0,
                            handle_signals=when != "unhandled")
        async with sv.session() as sess:
            while not sess.should_stop():
                await sess.run(v.assign_add, 1.0)
                if when == "unhandled" and sess.global_step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
        print("after the block", sess.outcome.value, flush=True)

    sys.exit(asv.run(main, backend=backend))
    """
)


def around_a_session(tmp_path: Path, backend: str, when: str) -> subprocess.CompletedProcess[str]:
    path, logdir = tmp_path / "around.py", str(tmp_path / "run")
    return forked.run_script(path, AROUND_A_SESSION, logdir, backend, when)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_sigterm_during_the_final_save_waits_for_it_and_the_program_goes_on(
    tmp_path: Path, backend: str
) -> None:
    done = around_a_session(tmp_path, backend, "during_the_final_save")
    # Not killed by the signal handed on (143): the save finished, the code after the
    # block ran, and the run ends preempted (run it again: it ends at once, done).
    assert done.returncode == 42, done.stderr[-3000:]
    assert "after the block preempted" in done.stdout
    assert tf.train.latest_checkpoint(str(tmp_path / "run")).endswith("model.ckpt-3")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stop_signal_before_the_session_ends_the_program_preempted(
    tmp_path: Path, backend: str
) -> None:
    done = around_a_session(tmp_path, backend, "before")
    assert done.returncode == 42, done.stderr[-3000:]  # not killed (143): preempted
    assert "prepared" not in done.stdout and "after the block" not in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_session_that_handles_no_signals_is_preempted_at_once_under_asv_run(
    tmp_path: Path, backend: str
) -> None:
    """``handle_signals=False``: SIGTERM is the program's, and asv.run's cancels it (no
    final save, the session's ending says so)."""
    done = around_a_session(tmp_path, backend, "unhandled")
    assert done.returncode == 42, done.stderr[-3000:]  # not killed (143)
    assert "after the block" not in done.stdout
    from asupervisor._logdir import ledger as _ledger
    from asupervisor._logdir.store import Store

    (session,) = _ledger.sessions(_ledger.read(Store(str(tmp_path / "run"))))
    assert (session.outcome, session.exit_status) == ("preempted", 42)


@pytest.mark.asyncio
async def test_a_handler_installed_over_the_programs_listener_comes_back_after_a_session(
    logdir: str, pair: Pair
) -> None:
    """Under asv.run the program listens for SIGTERM; a handler the application installs
    over it is its own choice: a session still stops on SIGTERM, and that handler is
    back after the session, then after the program."""
    from asupervisor._session.signals import SignalListener

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed only in the main thread")
    original = signal.getsignal(signal.SIGTERM)
    heard: list[str] = []
    program = SignalListener(lambda call: call(), heard.append, heard.append, fallback=True)
    received: list[int] = []
    try:
        assert program.install()
        signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
        users = signal.getsignal(signal.SIGTERM)
        sv = pair_supervisor(logdir, pair, handle_signals=True)
        async with sv.session() as sess:
            while not sess.should_stop():
                await sess.run(pair.step)
                if sess.global_step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
                await anyio.sleep(0)
        assert sess.outcome is asv.Outcome.PREEMPTED and received == [] and heard == []
        assert signal.getsignal(signal.SIGTERM) is users
        program.restore()
        assert signal.getsignal(signal.SIGTERM) is users
    finally:
        program.restore()
        signal.signal(signal.SIGTERM, original)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_second_sigint_outside_a_session_interrupts_the_program_at_once(
    tmp_path: Path, backend: str
) -> None:
    done = around_a_session(tmp_path, backend, "twice_before")
    assert done.returncode == 130, done.stderr[-3000:]
    assert "KeyboardInterrupt" in done.stderr and "prepared" not in done.stdout


TWO_SIGINTS = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import anyio, tensorflow as tf
    import asupervisor as asv

    logdir, backend, when = sys.argv[1:4]
    v = tf.Variable(0.0)


    def sigint():
        os.kill(os.getpid(), signal.SIGINT)


    class SecondWhileFinishing(asv.Hook):
        def end(self, session):  # the first SIGINT's stop is under way: the hooks' end
            if when == "while_finishing":
                sigint()
                time.sleep(1.0)


    async def main():
        sv = asv.Supervisor(logdir, checkpoint={"v": v}, hooks=[SecondWhileFinishing()],
                            save_model_secs=0, save_model_steps=1000, save_summaries_secs=0)
        async with sv.session() as sess:
            while not sess.should_stop():
                await sess.run(v.assign_add, 1.0)
                if sess.global_step == 3:
                    sigint()
                    if when == "50ms_apart":
                        threading.Timer(0.05, sigint).start()
                await anyio.sleep(0.01)
        print("after the block", sess.outcome.value, sess.global_step, flush=True)
        if when == "after_the_session":  # the session has ended (preempted): the program
            threading.Timer(0.05, sigint).start()  # goes on, and the loop waits
        await anyio.sleep(30)
        print("slept", flush=True)

    sys.exit(asv.run(main, backend=backend))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("when", ["while_finishing", "after_the_session", "50ms_apart"])
def test_a_second_sigint_ends_the_program_interrupted_whatever_the_phase(
    tmp_path: Path, backend: str, when: str
) -> None:
    """A second SIGINT is the user's "now": 130, whether it comes while the session stops,
    after it ended (preempted, its final checkpoint written), or 50 ms after the first."""
    path, logdir = tmp_path / "twice.py", str(tmp_path / "run")
    done = forked.run_script(path, TWO_SIGINTS, logdir, backend, when)
    assert done.returncode == 130, (done.stdout, done.stderr[-3000:])
    assert "slept" not in done.stdout  # the program did not go on for 30 s
    if when == "after_the_session":
        from asupervisor._logdir import ledger as _ledger
        from asupervisor._logdir.store import Store

        # The session's record is how the session ended: preempted, its final save done.
        (session,) = _ledger.sessions(_ledger.read(Store(logdir)))
        assert (session.outcome, session.exit_status) == ("preempted", 42)
        step = int(done.stdout.split("after the block preempted ")[1].split()[0])
        assert tf.train.latest_checkpoint(logdir).endswith(f"model.ckpt-{step}")


HELD_LOOP = textwrap.dedent(
    """
    import os, signal, sys, time
    import anyio, tensorflow as tf
    import asupervisor as asv

    logdir, backend = sys.argv[1:3]
    v = tf.Variable(0.0)
    sv = asv.Supervisor(logdir, checkpoint={"v": v}, stop_grace_secs=2, save_model_secs=0,
                        save_model_steps=1000, save_summaries_secs=0)


    @sv.service
    async def holds_the_loop(sess):
        while sess.global_step < 3:
            await anyio.sleep(0.01)
        print("holding at", sess.global_step, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # a stop, then code that blocks the loop
        time.sleep(30)
        print("slept", flush=True)


    async def main():
        async with sv.session() as sess:
            while not sess.should_stop():
                await sess.run(v.assign_add, 1.0)
                await anyio.sleep(0.01)

    sys.exit(asv.run(main, backend=backend))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_loop_held_past_the_grace_ends_the_process_stuck_with_the_blockers_stack(
    tmp_path: Path, backend: str
) -> None:
    """A service blocks the event loop (``time.sleep(30)``) after a stop: once the grace
    (2 s) is spent with the loop still held, the process ends stuck (124), the blocker's
    stack in its log, the final checkpoint written on the idle training thread and the
    session's end on record. Bound by what happened: it ends before the sleep could."""
    from asupervisor._logdir import ledger as _ledger
    from asupervisor._logdir.store import Store

    path, logdir = tmp_path / "held.py", str(tmp_path / "run")
    done = forked.run_script(path, HELD_LOOP, logdir, backend)
    assert done.returncode == asv.Outcome.STUCK.exit_status == 124, done.stderr[-3000:]
    assert "slept" not in done.stdout
    assert "in holds_the_loop" in done.stderr and "time.sleep(30)" in done.stderr
    held = int(done.stdout.split("holding at ")[1].split()[0])
    (session,) = _ledger.sessions(_ledger.read(Store(logdir)))
    assert (session.outcome, session.exit_status) == ("stuck", 124)
    # The final checkpoint is at the step the session ended at: the step it held at, or
    # the next if one was already on the training thread when the loop was held.
    assert session.step in (held, held + 1), (held, session.step)
    assert tf.train.latest_checkpoint(logdir).endswith(f"model.ckpt-{session.step}")
