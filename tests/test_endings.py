"""Every way a session ends, in a real process: the ledger's end line, the last heartbeat
and the process's exit status tell the same story.

Each case runs one training script under ``asv.run`` on the fork server (a real process,
really signalled), then reads what it left: the ledger's end line, the last beat, and the
status the process exited with.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

import asupervisor as asv
from asupervisor._exit import status_of
from asupervisor._kinds import Phase
from asupervisor._logdir import heartbeat as _heartbeat
from asupervisor._logdir import ledger as _ledger
from asupervisor._logdir.store import Store
from asupervisor._outcome import Ending, Outcome, StopReason
from tests import forked

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, signal, sys, time
    import anyio, tensorflow as tf
    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook
    from tests.swallowing import pause

    logdir, backend, case = sys.argv[1:4]
    v = tf.Variable(0.0)
    me = os.getpid()


    def say(*words):
        print(*words, flush=True)


    class SignalledDuringTheFinalSave(asv.Hook):
        def end(self, session):
            os.kill(me, signal.SIGTERM)
            time.sleep(0.3)  # the signal arrives while the hooks' end and the final save run


    def hang(sess):
        sess.request_stop()  # the stop comes while this step runs, which outlives the grace
        time.sleep(60)


    def interrupt_twice():
        os.kill(me, signal.SIGINT)
        time.sleep(0.3)
        os.kill(me, signal.SIGINT)
        time.sleep(60)


    async def main():
        hooks = [StopAtStepHook(last_step=5)]
        if case == "sigterm_during_the_final_save":
            hooks.append(SignalledDuringTheFinalSave())
        sv = asv.Supervisor(
            logdir, checkpoint={"v": v}, hooks=hooks, save_model_secs=0, save_model_steps=2,
            save_summaries_secs=0, heartbeat_secs=0.2, stop_grace_secs=1,
        )
        if case == "sigterm_while_closing":

            @sv.service
            async def signals_when_cancelled(sess):
                try:
                    await anyio.sleep_forever()  # ends only when the session cancels it
                except anyio.get_cancelled_exc_class():
                    os.kill(me, signal.SIGTERM)  # the session's work and final save are over
                    raise

        if case == "a_swallowing_service":

            @sv.service
            async def stubborn(sess):
                while True:
                    try:
                        await sess.sleep_until_stop(1)
                    except anyio.get_cancelled_exc_class():
                        pass  # swallowed: it goes on
                    await pause()  # no spin through the grace

        with anyio.CancelScope() as outside:
            async with sv.session() as sess:
                while not sess.should_stop():
                    step = sess.global_step
                    if step == 3 and case == "preempted":
                        os.kill(me, signal.SIGTERM)
                    if step == 3 and case == "failed":
                        raise OSError("the disk went away")
                    if step == 3 and case == "failed_permanently":
                        raise ValueError("learning_rate must be > 0")
                    if step == 3 and case == "stuck_past_the_grace":
                        await sess.run(hang, sess)
                    if step == 3 and case == "interrupted":
                        await sess.run(interrupt_twice)
                    if step == 3 and case == "cancelled_from_outside":
                        outside.cancel()  # a scope around the session, in the body's task
                        await anyio.sleep(60)
                    if step == 3 and case == "cancelled_from_outside_natively":
                        asyncio.current_task().cancel()
                        await anyio.sleep(60)
                    await sess.run(v.assign_add, 1.0)
            say("after the block", sess.outcome.value)
            if case == "sigterm_after_the_session_ended":
                os.kill(me, signal.SIGTERM)
                await anyio.sleep(60)  # post-processing that the signal cuts short
                say("post-processing done")

    sys.exit(asv.run(main, backend=backend))
    """
)

# case -> (the session's outcome in the ledger and the last beat, the process's status)
CASES = {
    "done": ("done", 0),
    "preempted": ("preempted", 42),
    "failed": ("failed", 1),
    "failed_permanently": ("failed_permanently", 78),
    "stuck_past_the_grace": ("stuck", 124),
    "interrupted": ("interrupted", 130),
    "cancelled_from_outside": ("interrupted", 130),
    "cancelled_from_outside_natively": ("interrupted", 130),
    "sigterm_during_the_final_save": ("preempted", 42),
    "sigterm_while_closing": ("preempted", 42),
    "a_swallowing_service": ("done", 0),
}
# case -> the phase the session was in when the stop signal reached it, in its end line
SIGNAL_PHASE = {
    "preempted": "running",
    "interrupted": "running",
    "sigterm_during_the_final_save": "finishing",
    "sigterm_while_closing": "closing",
}


def run_case(tmp_path: Path, backend: str, case: str) -> tuple[int, str, str]:
    path, logdir = tmp_path / "train.py", str(tmp_path / "run")
    done = forked.run_script(path, SCRIPT, logdir, backend, case)
    return done.returncode, done.stdout, done.stderr


def ending_of(logdir: Path) -> tuple[str | None, int | None, str | None, int | None]:
    """(outcome, status) of the ledger's end line, then of the last beat."""
    (record,) = _ledger.sessions(_ledger.read(Store(str(logdir))))
    beat = _heartbeat.read(str(logdir / _heartbeat.NAME))
    assert beat is not None
    outcome = None if beat.outcome is None else beat.outcome.value
    return record.outcome, record.exit_status, outcome, beat.exit_status


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_ledger_the_last_beat_and_the_exit_status_agree(
    tmp_path: Path, backend: str, case: str
) -> None:
    if case == "cancelled_from_outside_natively" and backend == "trio":
        pytest.skip("a native task cancellation is asyncio's own")
    outcome, status = CASES[case]
    code, out, err = run_case(tmp_path, backend, case)
    assert code == status, f"{case}: exit {code}\n{out}\n{err[-3000:]}"
    assert ending_of(tmp_path / "run") == (outcome, status, outcome, status), err[-3000:]
    (end,) = [r for r in _ledger.read(Store(str(tmp_path / "run"))) if r["event"] == "end"]
    signalled = case in SIGNAL_PHASE
    assert end["signal_phase"] == SIGNAL_PHASE.get(case), end
    expected = "SIGINT" if case == "interrupted" else "SIGTERM" if signalled else None
    assert end["signal"] == expected, end


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_sigterm_after_the_session_ended_preempts_the_program_not_the_session(
    tmp_path: Path, backend: str
) -> None:
    """The session had ended done (its ledger line and last beat say so, written before
    the signal came); the program after it was cut short: run it again (42)."""
    code, out, err = run_case(tmp_path, backend, "sigterm_after_the_session_ended")
    assert code == 42, f"exit {code}\n{out}\n{err[-3000:]}"
    assert "after the block done" in out and "post-processing done" not in out
    assert ending_of(tmp_path / "run") == ("done", 0, "done", 0)


def test_the_sessions_own_error_has_its_status_wherever_it_escapes() -> None:
    """``status_of``, the one decision: the error the session raised is known by identity
    (also inside a task group's exception group), a cancellation by kind (asyncio makes a
    new one on its way out of a cancelled task), an error of the program's own by its
    outcome; a stop signal outside a session preempts only a run that was done."""
    expired = asv.GracePeriodExpired("'step' was still running", job="step", unsaved_steps=3)
    stuck = Ending(
        Outcome.STUCK, StopReason.SIGNAL, None, expired, 5, 3, 2, "step", "SIGTERM",
        Phase.RUNNING, (),
    )  # fmt: skip
    assert status_of(expired, stuck) == status_of(expired) == 124  # it carries its outcome
    assert status_of(BaseExceptionGroup("a task group", [expired]), stuck) == 124
    cancelled = replace(stuck, outcome=Outcome.INTERRUPTED, raised=asyncio.CancelledError())
    assert status_of(asyncio.CancelledError("made anew"), cancelled) == 130
    failed = replace(stuck, outcome=Outcome.FAILED, raised=OSError("disk"))
    assert status_of(ValueError("the program's own"), failed) == 78
    assert status_of(SystemExit(3), failed) == 3
    assert status_of(KeyboardInterrupt(), failed) == 130
    done = replace(stuck, outcome=Outcome.DONE, raised=None)
    assert status_of(None, done) == 0 and status_of(None, done, "SIGTERM") == 42
    assert status_of(None, None, "SIGTERM") == 42  # no session yet
    assert status_of(None, failed, "SIGTERM") == 1  # a failure stays a failure
    # A second SIGINT is the user's "now": 130 whatever the session's ending or the error.
    preempted = replace(done, outcome=Outcome.PREEMPTED)
    for error, ending in ((None, preempted), (None, done), (expired, stuck), (None, None)):
        assert status_of(error, ending, "SIGINT", interrupted=True) == 130
