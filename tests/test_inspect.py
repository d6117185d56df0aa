"""`asupervisor inspect` for a long run: the summary first, the history's tail with its
counts, every line within 100 columns, a cost that does not grow with the run, no
TensorFlow with ``--no-verify``; what a kill and a person's rerun cost (``_logdir/costs``)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from asupervisor._logdir import ledger as _ledger
from asupervisor._logdir.events import crc32c, masked_crc32c
from asupervisor._logdir.history import Commit, History, write_history
from asupervisor._logdir.report import inspect_logdir
from asupervisor._logdir.store import Store

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
