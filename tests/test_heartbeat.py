"""The heartbeat and the ledger: a session seen from outside its process.

A sampler thread reads the heartbeat file as another process would while the session
blocks its own event loop, and while one step never ends: both must show as stale.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import asupervisor as asv
from asupervisor._cli.inspect import ledger_table
from asupervisor._kinds import Phase
from asupervisor._logdir import heartbeat as _heartbeat
from asupervisor._logdir import ledger as _ledger
from asupervisor._logdir.heartbeat import Beat, Verdict, judge
from asupervisor._logdir.store import Store
from asupervisor.cli import main
from tests.conftest import Pair, named, pair_supervisor
from tests.disk import fill, small_disk


class Sampler:
    """Reads a heartbeat file every 20 ms from a thread of its own, judging each beat."""

    def __init__(self, path: str, max_age: float) -> None:
        self.path, self.max_age = path, max_age
        self.verdicts: list[Verdict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            beat = _heartbeat.read(self.path)
            if beat is not None:
                self.verdicts.append(judge(beat, time.time(), self.max_age, 60.0))

    @property
    def stale(self) -> list[str]:
        return [v.why for v in self.verdicts if v.stale]

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def beat_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    path = str(tmp_path / "beat.json")
    monkeypatch.setenv(_heartbeat.ENV_FILE, path)
    monkeypatch.setenv(_heartbeat.ENV_ATTEMPT, "3")
    yield path


@pytest.mark.asyncio
async def test_a_blocked_loop_and_a_step_that_does_not_end_both_make_the_beat_stale(
    logdir: str, pair: Pair, beat_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sv = pair_supervisor(logdir, pair, heartbeat_secs=0.05)
    async with sv.session() as sess:
        for _ in range(3):
            await sess.run(pair.step)
        await anyio.sleep(0.2)
        beat = _heartbeat.read(beat_file)
        in_logdir = _heartbeat.read(os.path.join(logdir, _heartbeat.NAME))
        # The same beat in both files, but for the times of the one written in between.
        assert beat is not None and in_logdir is not None
        times = {"written_at": 0.0, "last_commit_at": 0.0, "last_step_at": 0.0}
        assert dataclasses.replace(beat, **times) == dataclasses.replace(in_logdir, **times)
        assert (beat.phase, beat.step, beat.first_step_done, beat.chief) == (
            Phase.RUNNING,
            3,
            True,
            True,
        )
        assert beat.last_commit_step == 2 and beat.busy_since is None
        assert not judge(beat, time.time(), 0.3, 60).stale

        with Sampler(beat_file, max_age=0.3) as blocked:
            time.sleep(0.8)  # blocks the event loop: no beat is written meanwhile
        assert any("event loop is blocked" in why for why in blocked.stale), blocked.verdicts

        await anyio.sleep(0.2)
        with Sampler(beat_file, max_age=0.3) as busy:
            await sess.run(time.sleep, 0.8)  # one step that takes too long; the loop is free
        assert any("sleep has run for" in why for why in busy.stale), busy.verdicts
        assert not any("event loop" in why for why in busy.stale)

    final = _heartbeat.read(beat_file)
    assert final is not None
    assert (final.phase, final.outcome, final.exit_status) == (Phase.CLOSED, asv.Outcome.DONE, 0)
    assert not judge(final, time.time() + 3600, 0.3, 60).stale  # ended: not judged

    with pytest.raises(RuntimeError, match="broken"):
        async with pair_supervisor(logdir, pair, heartbeat_secs=0.05).session() as sess:
            await sess.run(pair.step)
            sess.request_stop(RuntimeError("broken"))
    # The ledger: two sessions, the second restored from the first one's last step.
    first, second = _ledger.sessions(_ledger.read(Store(logdir)))
    assert (first.source, first.restored_step, first.step) == ("fresh", 0, 4)
    assert (first.outcome, first.exit_status, first.attempt) == ("done", 0, 3)
    assert (second.source, second.restored_step, second.pid) == ("checkpoint", 4, os.getpid())
    assert (second.outcome, second.exit_status) == ("failed", 1)
    assert second.error is not None and "broken" in second.error
    capsys.readouterr()
    assert main(["inspect", logdir, "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert f"sessions (2; from {_ledger.NAME}):" in out
    assert "failed" in out and "RuntimeError: broken" in out
    assert "heartbeat: session ended (failed, exit status 1) at step 5" in out


@pytest.mark.asyncio
async def test_a_killed_session_has_no_end_line_and_inspect_says_so(
    logdir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    os.makedirs(logdir)
    record = {"event": "start", "session": "abc", "host": "h", "pid": 7, "source": "fresh"}
    _ledger.append(Store(logdir), {**record, "restored_step": 0, "started": "t0"})
    with open(os.path.join(logdir, _ledger.NAME), "ab") as f:
        f.write(b'{"event": "end", "sess')  # a line cut by a full disk is skipped
    (entry,) = _ledger.sessions(_ledger.read(Store(logdir)))
    assert entry.ended is None
    assert "no end recorded" in "\n".join(ledger_table([entry]))


@pytest.mark.asyncio
async def test_a_non_chief_beats_into_its_own_file_only(
    logdir: str, beat_file: str, events: list[dict[str, Any]]
) -> None:
    chief_pair, worker_pair = Pair(), Pair()
    async with pair_supervisor(logdir, chief_pair).session() as sess:
        await sess.run(chief_pair.step)
    before = sorted(os.listdir(logdir))
    worker = pair_supervisor(logdir, worker_pair, is_chief=False, heartbeat_secs=0.05)
    async with worker.session(wait_for_checkpoint=True, max_wait_secs=5) as sess:
        await sess.run(worker_pair.step)
        await anyio.sleep(0.15)
        beat = _heartbeat.read(beat_file)
        assert beat is not None and not beat.chief and beat.restored_step == 1
    assert sorted(os.listdir(logdir)) == before  # the chief's beat and ledger, untouched
    assert not named(events, "heartbeat.failed")


def beat(**changes: Any) -> Beat:
    now = time.time()
    fields: dict[str, Any] = {
        "pid": 1,
        "host": "h",
        "session": "s",
        "chief": True,
        "worker": None,
        "phase": Phase.RUNNING,
        "first_step_done": True,
        "step": 10,
        "restored_step": 0,
        "interval_secs": 1.0,
        "started_at": now - 100,
        "written_at": now,
        "busy_since": None,
        "job": None,
        "last_step_at": now,
        "last_commit_step": 5,
        "last_commit_at": now - 1,
    }
    fields.update(changes)
    return Beat(**fields)


def test_start_up_and_the_final_save_get_the_longer_deadline() -> None:
    now = time.time()
    slow_restore = beat(phase=Phase.STARTING, first_step_done=False, busy_since=now - 50)
    assert not judge(slow_restore, now, 10, 60).stale
    assert judge(slow_restore, now, 10, 40).stale
    first_step = beat(busy_since=now - 50, first_step_done=False, job="train_step")
    assert not judge(first_step, now, 10, 60).stale  # tracing the first step
    assert judge(beat(busy_since=now - 50, job="train_step"), now, 10, 60).stale
    assert not judge(beat(phase=Phase.FINISHING, busy_since=now - 50), now, 10, 60).stale
    # The loop answers within max_age in every phase: start-up runs on the training thread.
    blocked_at_start = beat(phase=Phase.STARTING, first_step_done=False, written_at=now - 20)
    assert "event loop is blocked" in judge(blocked_at_start, now, 10, 60).why
    # A deadline shorter than the beats' own interval would call every run stale.
    assert not judge(beat(interval_secs=5.0, written_at=now - 12), now, 2, 60).stale
    assert judge(None, now, 10, 60) == Verdict(False, "no heartbeat", 60)


def test_a_file_that_is_not_a_beat_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "beat.json"
    for text in (
        "",
        "[]",
        json.dumps({"version": 1}),
        json.dumps({**beat().as_dict(), "phase": 1}),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match="heartbeat"):
            _heartbeat.read(str(path))
    written = beat()
    path.write_bytes(written.to_json())
    assert _heartbeat.read(str(path)) == written
    os.remove(path)
    os.mkfifo(path)  # never opened for reading as a beat (it would block)
    with pytest.raises(OSError):
        _heartbeat.read(str(path))


def test_heartbeat_secs_is_checked(logdir: str) -> None:
    with pytest.raises(ValueError, match="heartbeat_secs"):
        asv.Supervisor(logdir, heartbeat_secs=-1)


def test_a_session_that_ended_in_a_process_that_still_runs_is_stale_after_max_age() -> None:
    now = time.time()
    ended = beat(phase=Phase.CLOSED, outcome=asv.Outcome.DONE, exit_status=0, written_at=now - 5)
    assert not judge(ended, now, 3, 60).stale  # a reader that knows nothing of the process
    verdict = judge(ended, now, 3, 60, still_running=True)
    assert verdict.stale and "its process still runs (limit 3 s)" in verdict.why
    assert not judge(ended, now, 10, 60, still_running=True).stale


def session(**fields: Any) -> _ledger.SessionRecord:
    return _ledger.SessionRecord(**{"session": "s", **fields})


def test_inspect_tables_fit_their_columns_and_a_session_stopped_as_it_began_says_so() -> None:
    entries = [
        session(host="a-very-long-host-name.example.org", pid=123456, started="2026-01-01T00:00:00",
                source="fresh", restored_step=0, ended="2026-01-01T00:01:00", step=10,
                outcome="failed_permanently", exit_status=78, reason="exception",
                error="ValueError: bad"),
        session(host="h", pid=7, started="2026-01-01T00:02:00", source="interrupted",
                restored_step=0, ended="2026-01-01T00:02:01", step=10, outcome="done",
                exit_status=0, reason="step_limit"),
    ]  # fmt: skip
    header, *rows = ledger_table(entries)[1:]
    starts = [header.index(name) for name in ("host:pid", "outcome", "reason")]
    for row in rows:  # every cell begins where its column does, whatever its width
        assert [row[i - 2 : i] == "  " and row[i] != " " for i in starts] == [True] * 3, row
    assert "interrupted" not in rows[1]
    assert rows[1].split()[3:5] == ["10", "10"] and "no step trained" in rows[1]


def test_goodput_and_what_each_restart_cost_come_from_the_ledgers_times() -> None:
    from asupervisor._logdir.costs import goodput

    t = 1_000_000.0
    iso = lambda s: _iso(t + s)  # noqa: E731
    entries = [
        session(started=iso(0), source="fresh", restored_step=0, first_step_at=t + 10,
                committed_step=50, committed_at=t + 60, ended=iso(70), step=55,
                outcome="failed", exit_status=1),
        session(started=iso(80), source="checkpoint", restored_step=50,
                restored_commit_at=t + 60, first_step_at=t + 90),  # killed: no end line
        session(started=iso(200), source="checkpoint", restored_step=100,
                restored_commit_at=t + 190, first_step_at=t + 205, ended=iso(300), step=200,
                outcome="done", exit_status=0, committed_step=200, committed_at=t + 299),
    ]  # fmt: skip
    found = goodput(entries)
    assert found is not None
    first, second = found.restarts
    assert (first.after, first.reached, first.restored, first.lost_steps) == (
        "failed (1)", 55, 50, 5,
    )  # fmt: skip
    assert (first.lost_secs, first.down_secs) == (30.0, 20.0)
    assert (second.after, second.lost_steps, second.lost_secs, second.down_secs) == (
        "no end recorded (killed)", None, 15.0, None,
    )  # fmt: skip
    # Lost: the first start-up (10 s), 60..90 and 190..205: 55 s of the 300 s.
    assert (found.wall_secs, found.lost_secs) == (300.0, 55.0)
    assert f"{found.fraction:.4f}" == f"{1 - 55 / 300:.4f}"


def _iso(seconds: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="milliseconds")


@pytest.mark.anyio
async def test_a_session_tells_the_runner_its_commits_not_its_restores(
    logdir: str, pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asupervisor._logdir import channel as _channel

    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    monkeypatch.setenv(_channel.ENV, str(write_end))
    monkeypatch.setenv(_heartbeat.ENV_RUN, "run-1")
    try:
        async with pair_supervisor(logdir, pair, heartbeat_secs=0.05).session() as sess:
            for _ in range(5):
                await sess.run(pair.step)  # commits at 2 and 4, the final save at 5
                await anyio.sleep(0.15)  # beats between: each commit is seen
        async with pair_supervisor(logdir, Pair(), heartbeat_secs=0.05).session() as sess:
            await anyio.sleep(0.2)  # beats: it restored 5 and commits nothing
        reports = _channel.Receiver().feed(os.read(read_end, 1 << 20))
    finally:
        os.close(read_end)
        os.close(write_end)
    began = [r for r in reports if isinstance(r, _channel.SessionBegan)]
    assert [b.stop_grace_secs for b in began] == [120.0, 120.0] and began[0].chief
    assert [b.logdir for b in began] == [os.path.abspath(logdir)] * 2  # read after the attempt
    commits = [(r.session, r.step) for r in reports if isinstance(r, _channel.Commit)]
    # The fresh start's checkpoint, two saves, the final save; the restore of 5: nothing.
    assert commits == [(began[0].session, step) for step in (0, 2, 4, 5)]
    beats = [r for r in reports if isinstance(r, Beat) and r.session == began[1].session]
    assert beats and beats[-1].outcome is asv.Outcome.DONE and beats[-1].last_commit_step == 5
    first, second = _ledger.sessions(_ledger.read(Store(logdir)))
    assert (first.run, first.committed_step, second.committed_step) == ("run-1", 5, None)
    assert first.first_step_at is not None and second.restored_commit_at is not None
    assert second.restored_commit_at == pytest.approx(first.committed_at, abs=1.0)


def test_a_ledger_line_a_full_disk_cuts_is_an_error_and_takes_no_other_line_with_it(
    tmp_path: Path,
) -> None:
    """A write the disk has room for only part of is short, not an error: the ledger
    must not take it as written, nor leave the cut line for the next one to be glued to
    (both would be lost to every reader)."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        if disk is None:
            pytest.skip("no tmpfs can be mounted here to fill")
        store = Store(str(disk))
        _ledger.append(store, {"session": "a", "event": "start", "pad": "x" * 3000})
        with fill(disk / "filler"):  # about 1 KiB left in the ledger's page
            with pytest.raises(OSError) as raised:
                _ledger.append(store, {"session": "a", "event": "end", "pad": "y" * 3000})
        assert raised.value.errno == errno.ENOSPC
        _ledger.append(store, {"session": "b", "event": "start"})
        lines = (disk / _ledger.NAME).read_text().splitlines()
        assert [json.loads(line)["session"] for line in lines] == ["a", "b"]


@pytest.mark.anyio
async def test_ledger_lines_a_cancelled_write_never_began_are_written_by_the_next(
    logdir: str, pair: Pair
) -> None:
    """A write of the ledger cancelled before its worker thread began (the session's close
    cancels the beat writer, which may be just there) loses none of the lines it took:
    the close's own write takes them (its end line came after them)."""
    async with pair_supervisor(logdir, pair, heartbeat_secs=3600).session() as sess:
        presence = sess._rt.presence
        await sess.run(pair.step)
        limiter = anyio.to_thread.current_default_thread_limiter()
        borrowers = [object() for _ in range(int(limiter.total_tokens))]
        for borrower in borrowers:  # no worker thread for anyone, for now
            limiter.acquire_on_behalf_of_nowait(borrower)
        try:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(presence._flush)  # takes the first_step line, then waits
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()
        finally:
            for borrower in borrowers:
                limiter.release_on_behalf_of(borrower)
    events = [r["event"] for r in _ledger.read(Store(logdir))]
    assert events == ["start", "first_step", "end"], events


class Channel:
    """The runner's end of a session's channel, in-process: the reports and their lines."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from asupervisor._logdir import channel as _channel

        self._channel = _channel
        self.read_end, self.write_end = os.pipe()
        os.set_blocking(self.read_end, False)
        monkeypatch.setenv(_channel.ENV, str(self.write_end))
        self.lines: list[bytes] = []
        self.reports: list[Any] = []
        self._receiver = _channel.Receiver()

    def read(self) -> list[Any]:
        """What came since the last read (a pipe holds 64 KiB: read while it runs)."""
        try:
            chunk = os.read(self.read_end, 1 << 20)
        except BlockingIOError:
            return []
        self.lines += chunk.splitlines()
        new = self._receiver.feed(chunk)
        self.reports += new
        return new

    def beats(self) -> list[Beat]:
        return [r for r in self.reports if isinstance(r, Beat)]

    def close(self) -> None:
        os.close(self.read_end)
        os.close(self.write_end)


@pytest.fixture
def channel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Channel]:
    found = Channel(monkeypatch)
    yield found
    found.close()


async def reading(channel: Channel, fn: Any, *args: Any) -> Any:
    """``await fn(*args)`` while the channel is read every 20 ms (as the runner reads)."""
    async with anyio.create_task_group() as tg:

        async def read() -> None:
            while True:
                channel.read()
                await anyio.sleep(0.02)

        tg.start_soon(read)
        result = await fn(*args)
        tg.cancel_scope.cancel()
    channel.read()
    return result


def sleeps(xs: list[int], secs: float) -> None:
    time.sleep(secs)


@pytest.mark.anyio
async def test_a_job_with_a_long_name_is_cut_in_its_beats_and_the_beats_go_on(
    logdir: str, pair: Pair, channel: Channel, events: list[dict[str, Any]]
) -> None:
    import functools
    import select

    job = functools.partial(sleeps, [0] * 2000)  # its repr: about 6 KB
    async with pair_supervisor(logdir, pair, heartbeat_secs=0.05).session() as sess:
        # Read from the first step on, as the runner does: a beat every 50 ms through a
        # first step traced for seconds on a loaded machine fills a pipe no one reads.
        await reading(channel, sess.run, pair.step)
        await reading(channel, anyio.sleep, 0.1)
        channel.reports.clear()
        await reading(channel, sess.run, job, 0.4)
    busy = [b for b in channel.beats() if b.busy_since is not None]
    assert busy, channel.reports  # the runner heard the session while the job ran
    assert all(b.job is not None and b.job.startswith("functools.partial(") for b in busy), [
        b.job[:100] for b in busy if b.job
    ]
    assert all(len(line) + 1 <= select.PIPE_BUF for line in channel.lines)
    assert not named(events, "heartbeat.failed"), named(events, "heartbeat.failed")


@pytest.mark.anyio
async def test_heartbeat_secs_0_writes_no_heartbeat_file_and_still_beats_on_the_runners_channel(
    logdir: str, pair: Pair, channel: Channel
) -> None:
    async with pair_supervisor(logdir, pair, heartbeat_secs=0).session() as sess:
        await sess.run(pair.step)
        await sess.run(pair.step)  # commits at 2
        await reading(channel, anyio.sleep, 2.3)  # more than the channel's interval
        heard = list(channel.reports)
    channel.read()
    assert not os.path.exists(os.path.join(logdir, _heartbeat.NAME))  # 0: no file
    running = [b for b in heard if isinstance(b, Beat) and b.phase is Phase.RUNNING]
    assert running and running[-1].interval_secs > 0, heard
    # The runner judges it alive, and hears its commits with its beats (before its end).
    assert not judge(running[-1], running[-1].written_at, 10, 60, still_running=True).stale
    assert 2 in [r.step for r in heard if type(r).__name__ == "Commit"], heard
    assert channel.beats()[-1].outcome is asv.Outcome.DONE


@pytest.mark.anyio
async def test_a_long_save_or_call_is_no_step_that_does_not_end_and_a_long_step_is(
    logdir: str, pair: Pair, channel: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asupervisor._checkpointing.writer import Writer

    commit = Writer._commit

    def slow_commit(self: Writer, name: str, record: Any) -> None:
        time.sleep(0.6)  # a large state on a slow disk
        commit(self, name, record)

    def judged(beats: list[Beat]) -> list[Verdict]:  # as `asupervisor run --stuck-after 0.3`
        return [judge(b, b.written_at, 0.3, 60, still_running=True) for b in beats]

    sv = pair_supervisor(logdir, pair, heartbeat_secs=0.05)
    async with sv.session() as sess:
        await sess.run(pair.step)
        monkeypatch.setattr(Writer, "_commit", slow_commit)
        await reading(channel, sess.run, pair.step)  # step 2: a periodic save of 0.6 s
        await sess.run(pair.step)
        await reading(channel, sess.save_checkpoint)  # a save asked for, at 3
        monkeypatch.setattr(Writer, "_commit", commit)
        await reading(channel, sess.call, time.sleep, 0.6)  # a long call
        other = [b for b in channel.beats() if b.busy_since is not None]
        channel.reports.clear()
        await reading(channel, sess.run, time.sleep, 0.6)  # a long training step
        step = [b for b in channel.beats() if b.busy_since is not None]
    assert not any(v.stale for v in judged(other)), judged(other)
    long = [b for b in other if b.busy_since is not None and b.written_at - b.busy_since > 0.3]
    assert len(long) >= 3 and not any(b.training for b in long), long
    long = [v for v in judged(step) if v.stale]
    assert long and all("sleep has run for" in v.why for v in long), judged(step)
    assert all("a training step that does not end" in v.why for v in long)


@pytest.mark.anyio
async def test_a_long_epoch_end_is_no_step_that_does_not_end(logdir: str, channel: Channel) -> None:
    """A Keras callback's long ``on_epoch_end`` (an evaluation, an export) is work on the
    training thread that is no training step: ``asupervisor run --stuck-after`` does not
    judge it as one (its beats say ``training=False``)."""
    import keras

    from tests.test_fit_callbacks import compiled, dataset

    ends: list[tuple[float, float]] = []  # each epoch end's (start, end), wall time

    class SlowEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            began = time.time()
            time.sleep(1.0)
            ends.append((began, time.time()))

    model = compiled()
    sv = asv.Supervisor(
        logdir, checkpoint={"model": model}, save_model_secs=0, save_summaries_secs=0,
        heartbeat_secs=0.05,
    )  # fmt: skip
    async with sv.session() as sess:
        fit = functools.partial(sess.fit, epochs=2, callbacks=[SlowEpochEnd()], verbose=0)
        await reading(channel, fit, model, dataset())
    # The beats written while an epoch's end ran (a training step may itself be long on a
    # loaded machine: those are judged as steps, rightly).
    during = [
        b for b in channel.beats()
        if b.busy_since is not None and any(t0 < b.written_at < t1 for t0, t1 in ends)
    ]  # fmt: skip
    assert len(ends) == 2 and during, (ends, channel.beats())
    assert not any(b.training for b in during), during
    assert not any(judge(b, b.written_at, 0.3, 60, still_running=True).stale for b in during)


def test_work_that_is_no_training_step_gets_the_longer_deadline() -> None:
    now = time.time()
    save = beat(busy_since=now - 50, job="save", training=False)
    assert not judge(save, now, 10, 60).stale
    verdict = judge(save, now, 10, 40)
    assert verdict.stale and verdict.limit_secs == 40, verdict
    assert "save has run for 50.0 s (limit 40 s" in verdict.why
    assert "work on the training thread that does not end" in verdict.why
    assert judge(beat(busy_since=now - 50, job="train_step"), now, 10, 60).stale
    # An older writer's beat says nothing of it: its busy work is judged as a step.
    raw = {k: v for k, v in beat(busy_since=now - 50).as_dict().items() if k != "training"}
    assert judge(Beat.from_json(json.dumps(raw).encode()), now, 10, 60).stale


def test_every_report_fits_one_pipe_write_whatever_its_texts_hold() -> None:
    import select

    from asupervisor._logdir import channel as _channel

    for text in ["x" * 10_000, "é" * 5000, "\x00\u2028" * 3000, "😀" * 3000]:
        reports = [
            beat(host=text, session=text, worker=text, job=text),
            _channel.SessionBegan(text, 1, True, 1.0, logdir=text),
            _channel.Commit(text, 1, 1.0),
            _channel.Unwritten(text, text),
        ]
        for report in reports:
            line = _channel.encode(report)
            assert len(line) <= select.PIPE_BUF, (type(report), len(line))
            back = _channel.decode(line)
            assert type(back) is type(report), line[:200]
        began = _channel.decode(_channel.encode(reports[1]))
        assert isinstance(began, _channel.SessionBegan) and began.logdir is None  # not cut
    short = _channel.SessionBegan("s", 1, True, 1.0, logdir="/runs/x")
    assert _channel.decode(_channel.encode(short)) == short


def test_health_run_and_the_api_say_one_rule_for_long_work_that_is_no_training_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    said = {}
    for command in ("run", "health"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        said[command] = " ".join(capsys.readouterr().out.split())
    api = " ".join((Path(__file__).parents[1] / "docs" / "API.md").read_text().split())
    rule = "a save, a sess.call, an epoch's end, a rollback's restore"
    assert rule in said["run"] and rule in said["health"]
    assert rule.replace("sess.call", "`sess.call`") in api
    assert "one training step" in said["health"] and "training step" in said["run"]
    assert "any work on the training thread" not in said["health"] + api


@pytest.mark.asyncio
async def test_a_heartbeat_file_named_with_host_is_this_hosts_own_and_health_reads_it(
    logdir: str, pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One path on a file system the hosts of a job share: each host's worker writes, and
    # `asupervisor health` on each host reads, a file of its own.
    import socket

    template = str(tmp_path / "beat-{host}.json")
    monkeypatch.setenv(_heartbeat.ENV_FILE, template)
    async with pair_supervisor(logdir, pair, heartbeat_secs=0.05).session() as sess:
        await sess.run(pair.step)
        await anyio.sleep(0.2)
        assert main(["health", template, "--max-age", "60"]) == 0
    own = tmp_path / f"beat-{socket.gethostname()}.json"
    ended = _heartbeat.read(str(own))
    assert ended is not None and ended.host == socket.gethostname() and ended.step == 1
    assert [p.name for p in tmp_path.glob("beat-*")] == [own.name]
    assert _heartbeat.local_path(template, "n2") == str(tmp_path / "beat-n2.json")
