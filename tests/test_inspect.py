"""`asupervisor inspect` for a long run: the summary first, the history's tail with its
counts, every line within 100 columns, a cost that does not grow with the run, no
TensorFlow with ``--no-verify``; what a kill and a person's rerun cost (``_logdir/costs``)."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from asupervisor._logdir import ledger as _ledger
from asupervisor._logdir.events import crc32c, masked_crc32c
from asupervisor._logdir.history import HISTORY, Commit, History, read_history, write_history
from asupervisor._logdir.report import inspect_logdir
from asupervisor._logdir.store import Store
from asupervisor.cli import main

T0 = 1_700_000_000.0  # the fake run's start (seconds since the epoch)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


def write_commits(logdir: str, commits: int, on_disk: int, every: float = 1.0) -> None:
    """A history of ``commits`` commits (one step each, ``every`` s apart) of which the
    newest ``on_disk`` have their files (a few bytes each: inspect ``--no-verify`` reads
    no tensors)."""
    kept = range(commits - on_disk, commits)
    history = History(
        commits=tuple(
            Commit(
                seq=n + 1,
                parent=n or None,
                name=f"model.ckpt-{n + 1}",
                step=n + 1,
                time=T0 + every * (n + 1),
                healthy=True,
                metrics={"loss": 1.0 / (n + 1)},
                kept="listed" if n in kept else "gone",
                session=f"s{n // 50}",
                run="r",
                attempt=n // 50 + 1,
            )
            for n in range(commits)
        ),
        head=commits,
        next_seq=commits + 1,
    )
    store = Store(logdir)
    write_history(store, history)
    for n in kept:
        Path(logdir, f"model.ckpt-{n + 1}.index").write_bytes(b"i")
        Path(logdir, f"model.ckpt-{n + 1}.data-00000-of-00001").write_bytes(b"d" * 10)


def write_ledger(logdir: str, records: list[dict[str, Any]]) -> None:
    for record in records:
        _ledger.append(Store(logdir), record)


def session_lines(
    session: str,
    start: float,
    *,
    restored: int | None = None,
    first_step: float | None = None,
    end: tuple[float, int, str, int] | None = None,  # (when, step, outcome, status)
    run: str | None = "r",
    attempt: int | None = 1,
    committed: tuple[int, float] | None = None,
    restored_commit_at: float | None = None,
) -> list[dict[str, Any]]:
    """A session's ledger lines, as a session writes them."""
    lines: list[dict[str, Any]] = [
        {
            "event": "start",
            "session": session,
            "started": _iso(start),
            "host": "h",
            "pid": 100,
            "attempt": attempt,
            "run": run,
            "restored_step": restored,
            "source": "fresh" if restored is None else "checkpoint",
            "restored_commit_at": restored_commit_at,
        }
    ]
    if first_step is not None:
        lines.append({"event": "first_step", "session": session, "first_step_at": first_step})
    if end is not None:
        when, step, outcome, status = end
        lines.append(
            {
                "event": "end",
                "session": session,
                "ended": _iso(when),
                "step": step,
                "outcome": outcome,
                "exit_status": status,
                "reason": "done" if outcome == "done" else "a stop signal",
                "committed_step": None if committed is None else committed[0],
                "committed_at": None if committed is None else committed[1],
            }
        )
    return lines


def write_events(logdir: str, scalars: int) -> None:
    """An events file of ``scalars`` points of one tag, written without TensorFlow."""
    from tensorboard.compat.proto import event_pb2

    with open(os.path.join(logdir, "events.out.tfevents.1.h"), "wb") as f:
        for step in range(scalars):
            event = event_pb2.Event(wall_time=T0 + step, step=step)
            event.summary.value.add(tag="loss", simple_value=1.0 / (step + 1))
            data = event.SerializeToString()
            length = struct.pack("<Q", len(data))
            f.write(length + struct.pack("<I", masked_crc32c(length)))
            f.write(data + struct.pack("<I", masked_crc32c(data)))
    assert crc32c(b"123456789") == 0xE3069283  # the checksum TFRecord uses


def count_listings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every listing of a directory through the logdir's store, as it happens."""
    calls: list[str] = []
    names = Store.names

    def counted(self: Store) -> list[str]:
        calls.append(self.root)
        return names(self)

    monkeypatch.setattr(Store, "names", counted)
    return calls


def test_inspect_lists_the_logdir_once_however_many_checkpoints_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = []
    for on_disk in (3, 60):
        logdir = str(tmp_path / f"run{on_disk}")
        os.makedirs(logdir)
        write_commits(logdir, commits=100, on_disk=on_disk)
        calls = count_listings(monkeypatch)
        report = inspect_logdir(logdir, verify=False)
        assert len(report.checkpoints) == on_disk
        assert all(c.readable and c.bytes == 11 for c in report.checkpoints)
        counts.append(calls.count(logdir))
    assert counts == [1, 1]


def test_inspect_without_verifying_imports_no_tensorflow(tmp_path: Path) -> None:
    logdir = str(tmp_path)
    write_commits(logdir, commits=30, on_disk=3)
    write_events(logdir, scalars=5)
    code = (
        "import sys\n"
        "from asupervisor.cli import main\n"
        f"status = main(['inspect', '--no-verify', {logdir!r}])\n"
        "print('status', status, 'TF' if 'tensorflow' in sys.modules else 'no TF')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("status 0 no TF")
    assert "loss" in done.stdout and "0..4" in done.stdout  # its tags were read all the same
    assert "model.ckpt-30" in done.stdout


def test_a_persons_rerun_after_a_clean_end_is_a_new_segment_and_the_time_between_is_not_lost(
    tmp_path: Path,
) -> None:
    from asupervisor._logdir.costs import goodput

    def sessions(*lines: list[dict[str, Any]]) -> list[_ledger.SessionRecord]:
        return _ledger.sessions([line for group in lines for line in group])

    first = session_lines("a", T0, first_step=T0 + 5, end=(T0 + 100, 100, "done", 0), run=None)
    again = session_lines(
        "b",
        T0 + 1000,  # a person ran it again, 900 s later
        restored=100,
        restored_commit_at=T0 + 99,
        first_step=T0 + 1005,
        end=(T0 + 1100, 200, "done", 0),
        run=None,
    )
    found = goodput(sessions(first, again))
    assert found is not None
    assert (found.segments, found.restarts) == (2, ())
    assert found.wall_secs == pytest.approx(200.0)
    assert found.lost_secs == pytest.approx(10.0)  # each segment's own start-up
    # Preempted, then started again by the same `asupervisor run`: a restart, whose
    # time between counts.
    preempted = session_lines("c", T0, first_step=T0 + 5, end=(T0 + 100, 100, "preempted", 42))
    resumed = session_lines(
        "d", T0 + 160, restored=100, restored_commit_at=T0 + 99, first_step=T0 + 165, attempt=2
    )
    found = goodput(sessions(preempted, resumed))
    assert found is not None and (found.segments, len(found.restarts)) == (1, 1)
    assert found.lost_secs == pytest.approx(5.0 + 66.0)
    # A person's start after a session that was killed (no end recorded): a restart.
    killed = session_lines("e", T0, first_step=T0 + 5, run=None)
    found = goodput(sessions(killed, session_lines("f", T0 + 50, restored=0, run=None)))
    assert found is not None and (found.segments, len(found.restarts)) == (1, 1)


def four_sessions(logdir: str, host: str = "h", run: str = "r") -> None:
    """A run of 200 commits in four sessions: a failure, a SIGKILL (its end recorded by
    the runner), a stuck step, then done."""
    write_commits(logdir, commits=200, on_disk=3)
    lines = []
    ends = [(51, "failed", 1), (103, None, 137), (152, "stuck", 124), (200, "done", 0)]
    restored = None
    for n, (step, outcome, status) in enumerate(ends):
        start = T0 + 60 * n
        group = session_lines(
            f"s{n}",
            start,
            restored=restored,
            restored_commit_at=None if restored is None else T0 + restored,
            first_step=start + 4,
            end=None if outcome is None else (start + 55, step, outcome, status),
            run=run,
            attempt=n + 1,
            committed=(50 * (n + 1), start + 50),
        )
        if outcome is None:  # killed: the runner wrote its end from its last beat
            group.append(
                {
                    "event": "end_seen",
                    "session": f"s{n}",
                    "ended": _iso(start + 55),
                    "step": step,
                    "exit_status": status,
                    "recorded_by": "runner",
                }
            )
        for line in group:
            line["host"] = host
        lines += group
        restored = 50 * (n + 1)
    write_ledger(logdir, lines)


def test_inspect_shows_the_summary_first_then_the_tail_of_the_history_with_its_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    four_sessions(str(tmp_path))
    assert main(["inspect", "--no-verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    starts = [next(i for i, line in enumerate(out) if line.startswith(s)) for s in (
        "logdir:", "latest checkpoint: model.ckpt-200  (step 200)",
        "run: 200 commits, 4 sessions, 3 restarts, 0 rollbacks", "goodput:", "sessions (4;",
        "restarts (3;", "checkpoints (3 on disk)", "history: 200 commits (197 gone, 3 listed)",
        "commits (the last 10 of 200 commits; --all shows every one)", "tags (0)",
    )]  # fmt: skip
    assert starts == sorted(starts)
    commits = [int(m[1]) for line in out if (m := re.match(r"\s+#(\d+)\s", line))]
    assert commits == list(range(191, 201))
    assert main(["inspect", "--no-verify", "--all", str(tmp_path)]) == 0
    every = capsys.readouterr().out.splitlines()
    commits = [int(m[1]) for line in every if (m := re.match(r"\s+#(\d+)\s", line))]
    assert commits == list(range(1, 201))


def test_every_line_of_inspect_fits_100_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logdir = tmp_path / ("a-long-directory-name-" * 3) / "run"
    logdir.mkdir(parents=True)
    four_sessions(str(logdir), host="a-very-long-host-name.example.org", run="r" * 40)
    write_ledger(
        str(logdir),
        [
            *session_lines("s9", T0 + 900, restored=200, end=(T0 + 960, 200, "failed", 1)),
            {"session": "s9", "error": "ValueError: " + "a long message " * 20},
        ],
    )
    Path(logdir, "model.ckpt-199.index").unlink()
    Path(logdir, "model.ckpt-199.index").mkdir()  # not a regular file: a long problem
    from tensorboard.compat.proto import event_pb2

    write_events(str(logdir), scalars=3)
    with open(os.path.join(logdir, "events.out.tfevents.1.h"), "ab") as f:
        event = event_pb2.Event(step=3)
        event.summary.value.add(tag="a/very/long/tag/name/" * 6, simple_value=1.0)
        data = event.SerializeToString()
        length = struct.pack("<Q", len(data))
        f.write(length + struct.pack("<I", masked_crc32c(length)))
        f.write(data + struct.pack("<I", masked_crc32c(data)))
    for args in (["--no-verify"], ["--no-verify", "--all"]):
        assert main(["inspect", *args, str(logdir)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert max(len(line) for line in out) <= 100, max(out, key=len)
        assert any(line.endswith("...") for line in out)  # what did not fit was cut
        print("\n".join(out))


@pytest.mark.asyncio
async def test_a_restore_falling_back_past_damaged_checkpoints_lists_the_logdir_less_per_skip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass over the candidates checks each one's files against one listing; a skip
    looks again (the logdir may have changed under the read): two listings a skip, where
    each check listed too (three)."""
    from tests.conftest import Pair, pair_supervisor

    per_skip = []
    for damaged in (1, 4):
        logdir = str(tmp_path / f"run{damaged}")
        pair = Pair()
        async with pair_supervisor(logdir, pair, save_model_steps=1).session() as sess:
            for _ in range(6):
                await sess.run(pair.step)
        for step in range(7 - damaged, 7):
            data = Path(logdir, f"model.ckpt-{step}.data-00000-of-00001")
            data.write_bytes(data.read_bytes()[:7])
        calls = count_listings(monkeypatch)
        async with pair_supervisor(logdir, Pair()).session() as sess:
            assert sess.restore_report.step == 6 - damaged
            per_skip.append(calls.count(logdir))
            calls.clear()
    assert (per_skip[1] - per_skip[0]) / 3 <= 2


def test_the_runner_never_overwrites_a_sessions_own_end(tmp_path: Path) -> None:
    from asupervisor._run import ends

    logdir = str(tmp_path)
    write_ledger(logdir, session_lines("own", T0, end=(T0 + 9, 9, "done", 0)))
    write_ledger(logdir, session_lines("killed", T0 + 10))
    runner = [
        {"event": "end_seen", "session": s, "ended": _iso(T0 + 20), "step": 20,
         "exit_status": 137, "recorded_by": "runner"}
        for s in ("own", "killed")
    ]  # fmt: skip
    ends.record(logdir, runner)
    own, killed = _ledger.sessions(_ledger.read(Store(logdir)))
    assert (own.step, own.outcome, own.recorded_by) == (9, "done", None)
    assert (killed.step, killed.exit_status, killed.recorded_by) == (20, 137, "runner")


def test_an_events_file_cut_short_is_damage_without_tensorflow_too(tmp_path: Path) -> None:
    logdir = str(tmp_path)
    write_commits(logdir, commits=3, on_disk=1)
    write_events(logdir, scalars=5)
    events = Path(logdir, "events.out.tfevents.1.h")
    events.write_bytes(events.read_bytes()[:-3])  # a kill mid-write: the last record cut
    (info,) = inspect_logdir(logdir, verify=False).events_files
    assert info.events == 4 and info.damaged is not None and "cut short" in info.damaged
    garbled = bytearray(events.read_bytes())
    garbled[0] ^= 0xFF  # the first record's length: its checksum no longer matches
    events.write_bytes(bytes(garbled))
    report = inspect_logdir(logdir, verify=False)
    assert report.events_files[0].events == 0 and report.events_files[0].damaged is not None


def slurm_group(attempt: int, restart: int, ends: list[tuple[int, str, int, str, bool, bool]]):
    """A group line as ``asupervisor run --slurm`` writes it: (rank, host, status, how,
    stopped, first) per worker."""
    from asupervisor._logdir.groups import GroupAttempt, WorkerEnd

    workers = tuple(
        WorkerEnd(rank, host, status, how, stopped, first, ended=_iso(T0 + 60 * attempt + rank),
                  pid=200 + rank, session=f"w{attempt}{rank}", step=50 * attempt + 3)
        for rank, host, status, how, stopped, first in ends
    )  # fmt: skip
    cause = next((f"worker {w.rank} on {w.host}: {w.how}" for w in workers if w.first), "")
    status = next((w.status for w in workers if w.first), 0)
    return GroupAttempt("r", attempt, _iso(T0 + 60 * attempt + 5), status, cause, workers,
                        slurm_job="4711", slurm_restart=restart).to_record()  # fmt: skip


def test_inspect_shows_the_groups_attempts_which_worker_on_which_host_ended_how_and_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logdir = str(tmp_path)
    four_sessions(logdir, host="n1")
    write_ledger(
        logdir,
        [
            slurm_group(1, 0, [(0, "n1", 75, "exited", False, False),
                               (1, "n2", 137, "exited", False, True)]),
            slurm_group(2, 0, [(0, "n1", 42, "exited", True, False),
                               (1, "n2", 1, "exited", False, True)]),
            slurm_group(3, 1, [(0, "n1", 0, "exited", False, False),
                               (1, "n2", 0, "exited", False, False)]),
        ],
    )  # fmt: skip
    # The chief's sessions stay the sessions: a group line is not one.
    report = inspect_logdir(logdir, verify=False)
    assert len(report.sessions) == 4 and len(report.groups) == 3
    assert report.groups[0].first is not None and report.groups[0].first.host == "n2"
    assert main(["inspect", "--no-verify", logdir]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "group: 2 workers on n1, n2; 3 attempts; SLURM job 4711 (requeued 1 times)" in out
    at = out.index("group attempts (3; from asupervisor-ledger.jsonl):")
    table = [line.split() for line in out[at + 1 : at + 8]]
    assert table[0][:7] == ["attempt", "job.restart", "worker", "host", "ended", "(UTC)", "step"]
    rows = [(r[0], r[1], " ".join(r[2:-7]), r[-7], r[-4], " ".join(r[-3:])) for r in table[1:]]
    assert rows[:2] == [
        ("1", "4711.0", "0", "n1", "53", "75 (lost_peer) exited"),
        ("1", "4711.0", "* 1", "n2", "53", "137 (SIGKILL) exited"),
    ]
    assert table[3][2:3] == ["0"] and "42 (preempted)  stopped: exited" in out[at + 4]
    assert rows[5][:4] == ("3", "4711.1", "1", "n2")  # requeued once: no worker failed
    assert out[at + 8].startswith("  *: the first worker to fail in its attempt")
    assert max(len(line) for line in out) <= 100
    # The sessions' own lines keep SLURM's facts (a session reads them as it starts).
    assert main(["inspect", "--no-verify", "--json", logdir]) == 0
    shown = capsys.readouterr().out
    assert '"slurm_job": "4711"' in shown and '"first": true' in shown


def test_inspect_at_100000_commits_reads_the_history_once_and_prints_its_tail_with_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that saved every second for a day or a week: the history remembers only the
    newest swept commits (``KEEP_GONE``), so what inspect reads and prints is the same at
    1,000 commits as at 100,000; the counts say how many were made."""
    from asupervisor._logdir.catalog import KEEP_GONE

    work: list[dict[str, int]] = []
    reads: list[str] = []
    read = Store.read

    def counted(self: Store, name: str, *args: Any, **kwargs: Any) -> bytes:
        reads.append(name)
        return read(self, name, *args, **kwargs)

    for made in (1_000, 100_000):
        logdir = str(tmp_path / f"run{made}")
        os.makedirs(logdir)
        remembered = KEEP_GONE + 3  # what the sweep leaves in the history
        write_commits(logdir, commits=remembered, on_disk=3)
        history = read_history(Store(logdir))
        first = made - remembered  # the commits before these were forgotten
        commits = tuple(
            replace(c, seq=c.seq + first, parent=c.seq + first - 1, step=c.step + first)
            for c in history.commits
        )
        moved = replace(history, commits=commits, head=made, next_seq=made + 1)
        write_history(Store(logdir), moved)
        reads.clear()
        monkeypatch.setattr(Store, "read", counted)
        listings = count_listings(monkeypatch)
        assert main(["inspect", "--no-verify", logdir]) == 0
        out = capsys.readouterr().out.splitlines()
        assert any(line.startswith(f"run: {made} commits,") for line in out)
        counts = f"history: {made} commits, the newest {remembered} remembered"
        assert any(line.startswith(counts) for line in out), out
        rows = [int(m[1]) for line in out if (m := re.match(r"\s+#(\d+)\s", line))]
        assert rows == list(range(made - 9, made + 1))  # the tail, the head last
        work.append({"reads": reads.count(HISTORY), "listings": len(listings), "lines": len(out)})
    assert work[0] == work[1] and work[0]["reads"] == 1, work
