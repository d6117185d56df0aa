"""Recovery: damaged checkpoints are skipped, one chief per logdir, recoverable errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from tests import forked
from tests.conftest import Pair, named, pair_supervisor

pytestmark = pytest.mark.asyncio


make = pair_supervisor


async def train(logdir: str, steps: int) -> None:
    pair = Pair()
    async with make(logdir, pair).session() as sess:
        for _ in range(steps):
            await sess.run(pair.step)


def forget_history(logdir: str) -> None:
    """A logdir without a history (an older one, or one whose history is lost): both
    copies removed."""
    for name in os.listdir(logdir):
        if name.startswith(".asupervisor.history"):
            os.remove(os.path.join(logdir, name))


async def restored_step(logdir: str) -> tuple[asv.RestoreReport, float]:
    pair = Pair()
    async with make(logdir, pair).session() as sess:
        report = sess.restore_report
        value = float(pair.a.numpy())
    return report, value


async def test_a_truncated_newest_checkpoint_falls_back_to_the_previous(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    await train(logdir, 4)
    data = Path(logdir, "model.ckpt-4.data-00000-of-00001")
    data.write_bytes(data.read_bytes()[:7])
    report, a = await restored_step(logdir)
    assert report.source == "checkpoint" and report.step == 2 and a == 2.0
    assert [Path(p).name for p, _ in report.skipped] == ["model.ckpt-4"]
    fallback = named(events, "checkpoint.fallback")
    assert fallback and fallback[0]["skipped"].endswith("model.ckpt-4") and fallback[0]["reason"]


async def test_a_torn_uncommitted_checkpoint_is_skipped_and_removed_a_committed_one_kept(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """A kill in TF's save can leave the data file whole and the ``.index`` empty, before
    the commit: skipped, and removed by the chief (else, once the head is past it, nothing
    looks at it again: found by the kill trials). A damaged commit is the run's record: kept."""
    await train(logdir, 4)
    committed = Path(logdir, "model.ckpt-4.data-00000-of-00001")
    committed.write_bytes(committed.read_bytes()[:7])  # damaged, but committed
    torn = Path(logdir, "model.ckpt-6")
    torn.with_name("model.ckpt-6.data-00000-of-00001").write_bytes(
        Path(logdir, "model.ckpt-2.data-00000-of-00001").read_bytes()
    )
    torn.with_name("model.ckpt-6.index").write_bytes(b"")  # the kill came as it was made
    report, a = await restored_step(logdir)
    assert report.step == 2 and a == 2.0
    assert [Path(p).name for p, _ in report.skipped] == ["model.ckpt-6", "model.ckpt-4"]
    assert not list(Path(logdir).glob("model.ckpt-6*"))
    (removed,) = named(events, "checkpoint.torn_removed")
    assert removed["path"].endswith("model.ckpt-6") and removed["reason"]
    assert Path(logdir, "model.ckpt-4.index").exists() and committed.exists()


async def test_a_state_file_pointing_at_deleted_files_falls_back(logdir: str) -> None:
    await train(logdir, 6)
    for name in os.listdir(logdir):
        if name.startswith("model.ckpt-6."):
            os.remove(os.path.join(logdir, name))
    assert tf.train.get_checkpoint_state(logdir).model_checkpoint_path.endswith("model.ckpt-6")
    report, a = await restored_step(logdir)
    assert report.step == 4 and a == 4.0
    assert [(Path(p).name, why) for p, why in report.skipped] == [
        ("model.ckpt-6", "its .index file is gone")
    ]


async def test_a_deleted_newest_index_is_reported_as_skipped(logdir: str) -> None:
    await train(logdir, 6)
    os.remove(os.path.join(logdir, "model.ckpt-6.index"))  # the data file stays
    report, a = await restored_step(logdir)
    assert report.step == 4 and a == 4.0
    assert [Path(p).name for p, _ in report.skipped] == ["model.ckpt-6"]


async def test_an_unreadable_index_and_a_corrupt_state_file_fall_back(logdir: str) -> None:
    await train(logdir, 4)
    Path(logdir, "model.ckpt-4.index").write_bytes(b"\x00garbage" * 10)
    Path(logdir, "checkpoint").write_text("this is not a checkpoint state {{{")
    report, a = await restored_step(logdir)
    assert report.step == 2 and a == 2.0
    # Both are reported: the state file (put aside) and the checkpoint.
    assert [os.path.basename(path) for path, _ in report.skipped] == ["checkpoint", "model.ckpt-4"]


@pytest.mark.parametrize("content", [b"", os.urandom(256)], ids=["empty", "random bytes"])
async def test_an_unreadable_state_file_is_skipped_like_a_damaged_checkpoint(
    logdir: str, content: bytes, events: list[dict[str, Any]]
) -> None:
    await train(logdir, 4)
    Path(logdir, "checkpoint").write_bytes(content)
    report, a = await restored_step(logdir)
    assert report.source == "checkpoint" and report.step == 4 and a == 4.0
    assert [Path(p).name for p, _ in report.skipped] == ["checkpoint"]
    assert named(events, "checkpoint.state_damaged")
    assert Path(logdir, "checkpoint.damaged").read_bytes() == content  # kept, for a look
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-4")  # a good one again


async def test_every_checkpoint_damaged_means_a_fresh_start_that_says_so(logdir: str) -> None:
    await train(logdir, 2)
    for name in os.listdir(logdir):
        if name.endswith(".index"):
            Path(logdir, name).write_bytes(b"broken")
    report, a = await restored_step(logdir)
    assert report.source == "fresh" and a == 0.0
    assert len(report.skipped) == 2  # model.ckpt-2 and model.ckpt-0


async def test_a_mismatched_checkpoint_lists_what_differs(logdir: str) -> None:
    await train(logdir, 2)

    class Wider(tf.Module):
        def __init__(self) -> None:
            self.a = tf.Variable([0.0, 0.0])  # the checkpoint has a scalar
            self.b = tf.Variable(0.0)

    with pytest.raises(
        asv.CheckpointMismatchError,
        match=r"(?s)model\.ckpt-2 .*\n  pair/a: checkpoint \(\), model \(2,\)",
    ):
        async with asv.Supervisor(
            logdir, checkpoint={"pair": Wider()}, handle_signals=False
        ).session():
            pass

    with pytest.raises(
        asv.CheckpointMismatchError,
        match=r"the model has \['other'\] that the checkpoint lacks; "
        r"the checkpoint has \['pair'\] that the model lacks",
    ):
        async with asv.Supervisor(
            logdir, checkpoint={"other": Pair()}, handle_signals=False
        ).session():
            pass


async def test_a_second_live_chief_is_refused(logdir: str) -> None:
    first = make(logdir, Pair())
    async with first.session():
        with pytest.raises(asv.LogdirLockedError, match=f"pid {os.getpid()}"):
            async with make(logdir, Pair()).session():
                pass
        # a non-chief may read along
        async with make(logdir, Pair(), is_chief=False).session() as reader:
            assert reader.restore_report.step == 0
    async with make(logdir, Pair()).session() as again:  # released on exit
        assert again.restore_report.step == 0


@pytest.mark.slow
async def test_a_lock_left_by_a_killed_process_does_not_block(logdir: str) -> None:
    os.makedirs(logdir)
    holder = forked.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from asupervisor._logdir.lock import LogdirLock\n"
            f"LogdirLock({logdir!r}).acquire()\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(asv.LogdirLockedError, match=f"pid {holder.pid}"):
            async with make(logdir, Pair()).session():
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        async with make(logdir, Pair()).session() as sess:
            assert sess.restore_report.source == "fresh"
    finally:
        holder.kill()


class Aborting:
    """A step that writes half its update, then aborts, on the listed calls."""

    def __init__(self, pair: Pair, abort_on: set[int]) -> None:
        self.pair, self.abort_on, self.calls = pair, abort_on, 0

    def __call__(self) -> None:
        self.calls += 1
        self.pair.a.assign_add(1.0)
        if self.calls in self.abort_on:
            raise tf.errors.AbortedError(None, None, "the parameter server went away")
        self.pair.b.assign_add(1.0)


async def test_an_aborted_step_is_recovered_from_the_last_checkpoint(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    pair = Pair()
    step = Aborting(pair, abort_on={4, 5})
    async with make(logdir, pair, save_model_steps=1).session() as sess:
        for _ in range(6):
            await sess.run(step)
        assert sess.global_step == 6
    # the aborted calls' half-updates of `a` did not survive the restore
    assert float(pair.a.numpy()) == float(pair.b.numpy()) == 6.0
    recovered = named(events, "step.recovered")
    assert [e["restored_step"] for e in recovered] == [3, 3]
    assert "AbortedError" in recovered[0]["error"]


async def test_recoveries_in_a_row_are_capped(logdir: str) -> None:
    pair = Pair()
    always = Aborting(pair, abort_on=set(range(2, 100)))
    with pytest.raises(tf.errors.AbortedError):
        async with make(logdir, pair, save_model_steps=1, max_recoveries=2).session() as sess:
            for _ in range(5):
                await sess.run(always)
    assert always.calls == 1 + 3  # one good step, then the first try and two recoveries


async def test_without_a_checkpoint_a_recoverable_error_is_raised(pair: Pair) -> None:
    sv = asv.Supervisor(None, checkpoint={"pair": pair}, handle_signals=False)
    with pytest.raises(tf.errors.UnavailableError):
        async with sv.session() as sess:
            await sess.run(
                lambda: (_ for _ in ()).throw(tf.errors.UnavailableError(None, None, "x"))
            )


def half_step(pair: Pair) -> None:
    pair.a.assign_add(1.0)
    time.sleep(0.03)  # far longer than the save interval
    pair.b.assign_add(1.0)


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["sync", "async"])
async def test_every_checkpoint_holds_one_step_boundary(
    logdir: str, async_checkpoint: bool
) -> None:
    pair = Pair()
    sv = make(
        logdir,
        pair,
        save_model_secs=0.005,
        save_model_steps=None,
        async_checkpoint=async_checkpoint,
    )
    async with sv.session() as sess:
        # Train until five timed saves have landed (a loaded machine saves less often per
        # step): bounded by what happened, not by a step count that assumes a speed.
        for _ in range(3000):
            await sess.run(half_step, pair)
            if len(list(Path(logdir).glob("model.ckpt-*.index"))) >= 5:
                break
    paths = [p for p in Path(logdir).glob("model.ckpt-*.index")]
    assert len(paths) >= 5
    for index in paths:
        reader = tf.train.load_checkpoint(str(index)[: -len(".index")])
        values = {
            k.split("/")[1]: reader.get_tensor(k)
            for k in reader.get_variable_to_shape_map()
            if k.startswith("pair/")
        }
        step = int(index.name.split("-")[1].split(".")[0])
        assert values["a"] == values["b"] == step, index.name


async def test_retention_never_deletes_files_outside_the_logdir(
    logdir: str, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    for ext in ("index", "data-00000-of-00001"):
        (victim / f"model.ckpt-5.{ext}").write_text("someone else's")
    await train(logdir, 2)
    state = Path(logdir, "checkpoint")
    forged = state.read_text().replace(
        'all_model_checkpoint_paths: "model.ckpt-0"',
        f'all_model_checkpoint_paths: "../victim/model.ckpt-5"\n'
        f'all_model_checkpoint_paths: "{victim}/model.ckpt-5"\n'
        'all_model_checkpoint_paths: "model.ckpt-0"',
    )
    assert forged != state.read_text()
    state.write_text(forged)
    pair = Pair()
    async with make(logdir, pair, max_to_keep=1).session() as sess:
        for _ in range(6):  # saves at 4, 6, 8: the sweep runs with max_to_keep=1
            await sess.run(pair.step)
    assert sorted(p.name for p in victim.iterdir()) == [
        "model.ckpt-5.data-00000-of-00001",
        "model.ckpt-5.index",
    ]


async def test_a_bit_flip_in_a_saved_iterator_is_caught_and_falls_back(logdir: str) -> None:
    def supervised() -> tuple[asv.Supervisor, Any]:
        it = iter(tf.data.Dataset.range(10_000).shuffle(1000, seed=1).batch(7))
        sv = asv.Supervisor(
            logdir,
            checkpoint={"it": it},
            save_model_secs=0,
            save_model_steps=2,
            max_to_keep=None,
            save_summaries_secs=0,
            handle_signals=False,
        )
        return sv, it

    sv, it = supervised()
    async with sv.session() as sess:
        for _ in range(4):  # saves at 2 and 4; the iterator's state is a variant tensor
            await sess.run(next, it)
    data = Path(logdir, "model.ckpt-4.data-00000-of-00001")
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01  # inside the iterator's state, the bulk of the file
    data.write_bytes(bytes(damaged))
    sv, it = supervised()
    async with sv.session() as sess:
        assert sess.restore_report.step == 2
        assert [Path(p).name for p, _ in sess.restore_report.skipped] == ["model.ckpt-4"]
        assert "RestoreV2" in sess.restore_report.skipped[0][1]  # found as a restore reads it
        await sess.run(next, it)  # the restored iterator works


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_chief_whose_lock_file_is_taken_away_stops_before_its_next_save(
    logdir: str, how: str
) -> None:
    pair = Pair()
    with pytest.raises(asv.LogdirLockedError, match="removed or replaced"):
        async with make(logdir, pair).session() as sess:
            await sess.run(pair.step)
            lock = Path(logdir, ".asupervisor.lock")
            lock.unlink()
            if how == "replaced":  # a second chief's lock, say
                lock.write_text("12345")
            for _ in range(3):
                await sess.run(pair.step)  # the save at step 2 finds the lock gone
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-0")  # nothing after


async def test_orphaned_checkpoints_are_committed_then_swept(
    logdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asupervisor._logdir.history import read_history
    from asupervisor._logdir.store import Store

    await train(logdir, 8)  # saves at 0, 2, 4, 6, 8
    # An older logdir (no history: derived from the state file), as if killed after
    # writing 8 but before the state file named it, and in the middle of a sweep of 2.
    forget_history(logdir)
    state = [os.path.join(logdir, f"model.ckpt-{s}") for s in (0, 4, 6)]
    tf.compat.v1.train.update_checkpoint_state(logdir, state[-1], all_model_checkpoint_paths=state)
    pair = Pair()
    monkeypatch.setenv("ASUPERVISOR_RUN", "r")  # as `asupervisor run` starts it
    monkeypatch.setenv("ASUPERVISOR_ATTEMPT", "2")
    async with make(logdir, pair, max_to_keep=2).session() as sess:
        assert sess.restore_report.step == 8  # complete: the newest, restored
        assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-8")  # and committed
        for _ in range(4):
            await sess.run(pair.step)  # saves at 10 and 12: retention keeps two
    on_disk = sorted(
        int(n.split("-")[1].split(".")[0]) for n in os.listdir(logdir) if n.endswith(".index")
    )
    assert on_disk == [10, 12]  # no orphan left behind
    # The attempt's progress (what the runner reads): its saves, not the orphan it adopted.
    history = read_history(Store(logdir))
    assert [c.step for c in history.saved_by("r", 2)] == [10, 12]
    assert [c.step for c in history.commits if c.adopted] == [8]


async def test_a_deleted_newest_index_is_logged_as_a_fallback(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    await train(logdir, 6)
    os.remove(os.path.join(logdir, "model.ckpt-6.index"))
    report, _ = await restored_step(logdir)
    assert report.step == 4
    (fallback,) = named(events, "checkpoint.fallback")
    assert fallback["skipped"].endswith("model.ckpt-6") and "index" in fallback["reason"]


async def test_an_older_logdir_without_a_history_resumes_from_its_state_file(logdir: str) -> None:
    """A logdir written before the history (the state file and .asupervisor.checkpoints):
    its history is derived once, with what each commit recorded, and written down."""
    import json

    from asupervisor._logdir.history import read_history
    from asupervisor._logdir.store import Store

    await train(logdir, 6)  # 0, 2, 4, 6
    forget_history(logdir)
    records = {
        "model.ckpt-4": {"step": 4, "time": 1.0, "metrics": {"val": 0.5}, "healthy": False},
        "model.ckpt-6": {"step": 6, "time": 2.0, "metrics": {"val": 0.7}, "healthy": True},
    }
    Path(logdir, ".asupervisor.checkpoints").write_text(json.dumps(records))
    report, a = await restored_step(logdir)
    assert report.step == 6 and a == 6.0
    history = read_history(Store(logdir))
    assert not history.derived
    assert [c.name for c in history.commits] == [f"model.ckpt-{s}" for s in (0, 2, 4, 6)]
    four = history.by_name("model.ckpt-4")
    assert four is not None and four.healthy is False and four.metrics == {"val": 0.5}
    assert not Path(logdir, ".asupervisor.checkpoints").exists()
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-6")


async def test_a_commit_whose_files_a_crash_left_unnamed_restores_the_commit_before_it(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """A commit makes its files' names durable with the history's and the state file's,
    in one fsync of the directory at its end: a crash before it may leave a history (and
    a state file) naming a checkpoint whose files are not there. That commit never
    completed; the one before it, whose files nothing deleted yet, is restored."""
    await train(logdir, 4)  # 0, 2, 4
    for name in os.listdir(logdir):
        if name.startswith("model.ckpt-4."):
            os.remove(os.path.join(logdir, name))
    report, a = await restored_step(logdir)
    assert report.source == "checkpoint" and report.step == 2 and a == 2.0
    assert [Path(p).name for p, _ in report.skipped] == ["model.ckpt-4"]
    assert named(events, "checkpoint.fallback")


async def test_a_state_file_naming_a_missing_checkpoint_restores_the_newest_whole_one_beside_it(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """No history; the state file names ``model.ckpt-9``, whose files are gone; whole
    checkpoints it does not name are on disk: the newest that reads back whole is restored
    (TF's ``latest_checkpoint`` gives up there), not a fresh start."""
    await train(logdir, 4)  # 0, 2, 4
    forget_history(logdir)
    missing = os.path.join(logdir, "model.ckpt-9")
    tf.compat.v1.train.update_checkpoint_state(
        logdir, missing, all_model_checkpoint_paths=[missing]
    )
    report, a = await restored_step(logdir)
    assert report.source == "checkpoint" and report.step == 4 and a == 4.0
    assert [Path(p).name for p, _ in report.skipped] == ["model.ckpt-9"]
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-4")


async def test_a_damaged_commit_skipped_at_restore_is_kept_by_later_sweeps(logdir: str) -> None:
    """The restore skips a damaged commit and falls back past it (recorded as a rollback
    of kind fallback): its files stay, as the run's record, through later sweeps."""
    await train(logdir, 6)  # 0, 2, 4, 6
    data = Path(logdir, "model.ckpt-6.data-00000-of-00001")
    data.write_bytes(data.read_bytes()[:7])
    pair = Pair()
    async with make(logdir, pair, max_to_keep=2).session() as sess:
        assert sess.restore_report.step == 4
        for _ in range(6):
            await sess.run(pair.step)  # commits at 6 (model.ckpt-6_1), 8, 10: sweeps
    assert data.exists() and Path(logdir, "model.ckpt-6.index").exists()
    from asupervisor._logdir.history import read_history
    from asupervisor._logdir.store import Store

    damaged = read_history(Store(logdir)).by_name("model.ckpt-6")
    assert damaged is not None and damaged.on_disk


async def test_a_whole_uncommitted_checkpoint_is_not_removed_after_a_transient_read_error(
    logdir: str, events: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only an empty or short ``.index`` is evidence of a torn write: an uncommitted
    checkpoint that failed to read for another reason (EIO, EACCES, a store whose writes
    are not visible yet) is skipped, and its files are left alone."""
    from asupervisor._checkpointing import restorer

    await train(logdir, 4)  # 0, 2, 4
    for suffix in (".index", ".data-00000-of-00001"):  # whole, uncommitted: a kill's
        Path(logdir, "model.ckpt-6" + suffix).write_bytes(
            Path(logdir, "model.ckpt-4" + suffix).read_bytes()
        )
    real = restorer.checkpoint_problem

    def flaky(store: Any, prefix: str, names: Any = None) -> str | None:
        if prefix.endswith("model.ckpt-6"):
            return "OSError: [Errno 5] Input/output error"
        return real(store, prefix, names)

    monkeypatch.setattr(restorer, "checkpoint_problem", flaky)
    report, _ = await restored_step(logdir)
    assert report.step == 4
    assert not named(events, "checkpoint.torn_removed")
    assert Path(logdir, "model.ckpt-6.index").exists()
    assert Path(logdir, "model.ckpt-6.data-00000-of-00001").exists()


async def test_a_history_derived_again_keeps_the_checkpoints_kept_every_n_hours(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """Both copies of the history gone (``cp -r run/* elsewhere/`` leaves dot files
    behind): the history derived from the state file and the disk still knows every
    checkpoint kept every N hours (each written no later than the state file's
    ``last_preserved_timestamp``), and the next commits sweep none of them; a warning says
    the history was derived."""
    from asupervisor._logdir.history import read_history
    from asupervisor._logdir.store import Store

    pair = Pair()
    every = 0.3 / 3600
    sv = make(logdir, pair, save_model_steps=1, max_to_keep=1, keep_checkpoint_every_n_hours=every)
    async with sv.session() as sess:
        while not [c for c in read_history(Store(logdir)).commits if c.kept == "preserved"]:
            await sess.run(pair.step)
            await anyio.sleep(0.05)
    preserved = [c.name for c in read_history(Store(logdir)).commits if c.kept == "preserved"]
    forget_history(logdir)
    sv = make(logdir, pair, save_model_steps=1, max_to_keep=1, keep_checkpoint_every_n_hours=every)
    async with sv.session() as sess:
        for _ in range(3):
            await sess.run(pair.step)
    for name in preserved:
        assert Path(logdir, name + ".index").exists(), name
    (warning,) = named(events, "history.damaged")
    assert warning["read_from"] is None
