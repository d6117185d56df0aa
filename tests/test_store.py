"""The logdir as a store: the same rules on a local directory and on object stores (TF's
in-memory ``ram://``, and ``gs://`` on the real GCS protocol through the emulator of
tests/gcs_fixture.py), hostile contents that are skipped instead of followed, one writer
per logdir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from tests import forked
from tests.conftest import Pair, named, pair_supervisor
from tests.gcs_fixture import FakeGcs


@pytest.fixture(params=["local", "ram", "gs"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A logdir that does not exist yet, on a local disk or on an object store."""
    if request.param == "local":
        return str(tmp_path / "run")
    if request.param == "gs":
        gcs: FakeGcs = request.getfixturevalue("gcs")
        return gcs.new_path()
    return f"ram://{tmp_path.name}/run"


make = pair_supervisor


async def train(logdir: str, steps: int, **kwargs: Any) -> Pair:
    pair = Pair()
    async with make(logdir, pair, **kwargs).session() as sess:
        for _ in range(steps):
            await sess.run(pair.step)
    return pair


def steps_on_disk(logdir: str) -> list[int]:
    names = tf.io.gfile.listdir(logdir)
    return sorted(int(n.split("-")[1].split(".")[0]) for n in names if n.endswith(".index"))


def write(path: str, data: bytes) -> None:
    if tf.io.gfile.exists(path):  # ram:// keeps the old contents under an empty write
        tf.io.gfile.remove(path)
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(data)


@pytest.mark.asyncio
async def test_a_run_saves_resumes_sweeps_and_writes_events_on_the_store(where: str) -> None:
    await train(where, 6, max_to_keep=2, save_summaries_steps=2)
    assert steps_on_disk(where) == [4, 6]  # the sweep works on the store too
    assert tf.train.latest_checkpoint(where).endswith("model.ckpt-6")
    pair = Pair()
    async with make(where, pair, max_to_keep=2).session() as sess:
        assert sess.restore_report.source == "checkpoint" and sess.restore_report.step == 6
        assert float(pair.a.numpy()) == 6.0
    events = [n for n in tf.io.gfile.listdir(where) if n.startswith("events.out.tfevents.")]
    assert len(events) == 2  # one per session, both on the store
    first = [
        tf.compat.v1.Event.FromString(record.numpy())
        for record in tf.data.TFRecordDataset(f"{where}/{sorted(events)[0]}")
    ]
    steps = [e.step for e in first for value in e.summary.value if value.tag == "loss"]
    assert steps == [1, 3, 5]  # as TF's SummarySaverHook: the first step, then every 2


@pytest.mark.asyncio
async def test_retention_never_deletes_outside_the_logdir_on_the_store(where: str) -> None:
    parent = where.rsplit("/", 1)[0]
    victim = f"{parent}/victim"
    tf.io.gfile.makedirs(victim)
    for ext in ("index", "data-00000-of-00001"):
        write(f"{victim}/model.ckpt-5.{ext}", b"someone else's")
    await train(where, 2)
    state = f"{where}/checkpoint"
    with tf.io.gfile.GFile(state) as f:
        text = f.read()
    write(
        state,
        text.replace(
            'all_model_checkpoint_paths: "model.ckpt-0"',
            f'all_model_checkpoint_paths: "../victim/model.ckpt-5"\n'
            f'all_model_checkpoint_paths: "{victim}/model.ckpt-5"\n'
            'all_model_checkpoint_paths: "model.ckpt-0"',
        ).encode(),
    )
    await train(where, 6, max_to_keep=1)  # saves at 4, 6, 8: each sweeps with max_to_keep=1
    assert sorted(tf.io.gfile.listdir(victim)) == [
        "model.ckpt-5.data-00000-of-00001",
        "model.ckpt-5.index",
    ]
    assert steps_on_disk(where) == [8]


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["local", "ram"], indirect=True)  # gs://: the same parse
@pytest.mark.parametrize("content", [b"", b"\xff\xfe\x00garbage\x80"], ids=["empty", "bytes"])
async def test_a_damaged_state_file_is_skipped_and_reported_on_the_store(
    where: str, content: bytes
) -> None:
    await train(where, 4)
    write(f"{where}/checkpoint", content)
    pair = Pair()
    async with make(where, pair).session() as sess:
        report = sess.restore_report
    assert report.step == 4 and float(pair.a.numpy()) == 4.0
    assert [p.rsplit("/", 1)[-1] for p, _ in report.skipped] == ["checkpoint"]
    assert tf.train.latest_checkpoint(where).endswith("model.ckpt-4")  # a good one again


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["local", "ram"], indirect=True)  # gs://: as ram://
async def test_orphans_are_committed_then_swept_on_the_store(where: str) -> None:
    await train(where, 8)  # saves at 0, 2, 4, 6, 8
    # As if killed after writing 8 but before the state file named it; 2 lost the same way.
    listed = [f"{where}/model.ckpt-{s}" for s in (0, 4, 6)]
    tf.compat.v1.train.update_checkpoint_state(where, listed[-1], all_model_checkpoint_paths=listed)
    pair = Pair()
    async with make(where, pair, max_to_keep=2).session() as sess:
        assert sess.restore_report.step == 8
        for _ in range(4):
            await sess.run(pair.step)  # saves at 10 and 12
    assert steps_on_disk(where) == [10, 12]


@pytest.mark.asyncio
async def test_data_without_an_index_is_removed_at_a_chiefs_start_on_the_store(
    where: str, events: list[dict[str, Any]]
) -> None:
    """A kill between TF's rename of a checkpoint's data and the upload of its index
    leaves data no index names. The chief removes its own (never another tool's, never
    one the state file names) at start, as it removes unfinished ``*_temp`` saves."""
    await train(where, 4)  # 0, 2, 4
    data = "data-00000-of-00001"
    with tf.io.gfile.GFile(f"{where}/model.ckpt-4.{data}", "rb") as f:
        content = f.read()
    for name in (f"model.ckpt-6.{data}", f"ckpt-3.{data}", f"model.ckpt-7.{data}.bak"):
        write(f"{where}/{name}", content)
    tf.io.gfile.remove(f"{where}/model.ckpt-2.index")  # named by the state file: kept
    pair = Pair()
    async with make(where, pair).session() as sess:
        assert sess.restore_report.step == 4
    left = sorted(n for n in tf.io.gfile.listdir(where) if data in n)
    assert left == [
        f"ckpt-3.{data}",
        f"model.ckpt-0.{data}",
        f"model.ckpt-2.{data}",
        f"model.ckpt-4.{data}",
        f"model.ckpt-7.{data}.bak",
    ]
    (removed,) = named(events, "checkpoint.unfinished_removed")
    assert removed["paths"] == [f"model.ckpt-6.{data}"]


@pytest.mark.asyncio
async def test_a_second_chief_is_refused_on_the_store(where: str) -> None:
    pair = Pair()
    async with make(where, pair).session():
        with pytest.raises(asv.LogdirLockedError, match="another chief"):
            async with make(where, Pair()).session():
                pass


@pytest.mark.asyncio
async def test_a_chief_whose_lock_or_lease_is_taken_stops_before_its_next_save(
    where: str,
) -> None:
    pair = Pair()
    with pytest.raises(asv.LogdirLockedError, match="removed or"):
        async with make(where, pair).session() as sess:
            await sess.run(pair.step)
            if "://" in where:  # a second chief's lease replaces ours
                lease = {"owner": "elsewhere:1:abc", "expires": time.time() + 600}
                write(f"{where}/.asupervisor.lease", json.dumps(lease).encode())
            else:
                Path(where, ".asupervisor.lock").unlink()
            for _ in range(3):
                await sess.run(pair.step)  # the save at step 2 finds it gone
    assert steps_on_disk(where) == [0]  # nothing written after


@pytest.mark.asyncio
async def test_an_expired_lease_of_a_killed_chief_is_taken_over(
    object_store: str, events: list[dict[str, Any]]
) -> None:
    where = object_store
    tf.io.gfile.makedirs(where)
    dead = {"owner": "gone:4242:dead", "expires": time.time() - 1}
    write(f"{where}/.asupervisor.lease", json.dumps(dead).encode())
    await train(where, 2)
    assert steps_on_disk(where) == [0, 2]
    assert named(events, "logdir.lease_expired")[0]["owner"] == "gone:4242:dead"
    assert not tf.io.gfile.exists(f"{where}/.asupervisor.lease")  # released at the end


@pytest.mark.asyncio
async def test_a_live_lease_of_an_earlier_attempt_of_the_same_run_is_taken_over_at_once(
    object_store: str, events: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`asupervisor run` starts an attempt only once every process of the one before has
    exited: a lease of an earlier attempt of the same run is a dead chief's, however long
    it has to run. The restart after a SIGKILL trains at once (it was refused for up to
    30 s, and the refusal is permanent: the run gave up). Any other live lease is kept."""
    where = object_store
    tf.io.gfile.makedirs(where)
    lease = f"{where}/.asupervisor.lease"
    monkeypatch.setenv("ASUPERVISOR_RUN", "run-a")
    monkeypatch.setenv("ASUPERVISOR_ATTEMPT", "3")
    for run, attempt in [("run-a", 3), ("run-b", 2), (None, 2), ("run-a", None)]:
        live = {"owner": "vm:99:cafe", "expires": time.time() + 20, "run": run,
                "attempt": attempt}  # fmt: skip
        write(lease, json.dumps(live).encode())
        with pytest.raises(asv.LogdirLockedError, match=r"vm:99:cafe\) for \d+ s more"):
            await train(where, 1)
    killed = {"owner": "vm:98:dead", "expires": time.time() + 20, "run": "run-a", "attempt": 2}
    write(lease, json.dumps(killed).encode())
    await train(where, 2)
    assert steps_on_disk(where) == [0, 2]
    (taken,) = named(events, "logdir.lease_taken_over")
    assert taken["owner"] == "vm:98:dead" and taken["attempt"] == 2
    assert not tf.io.gfile.exists(lease)  # released at the end


@pytest.mark.asyncio
async def test_a_live_lease_names_its_holder_and_when_it_expires(object_store: str) -> None:
    where = object_store
    tf.io.gfile.makedirs(where)
    live = {"owner": "trainer-7:99:cafe", "expires": time.time() + 20}
    write(f"{where}/.asupervisor.lease", json.dumps(live).encode())
    with pytest.raises(asv.LogdirLockedError, match=r"trainer-7:99:cafe\) for \d+ s more"):
        async with make(where, Pair()).session():
            pass
    assert steps_on_disk(where) == []  # nothing written by the refused chief


# -- hostile contents of a local logdir ------------------------------------------


@pytest.mark.parametrize(
    "name", ["model.ckpt-4.data-00000-of-00001", "model.ckpt-4.index", "checkpoint"]
)
@pytest.mark.asyncio
async def test_a_fifo_in_a_checkpoints_place_is_skipped_not_waited_on(
    logdir: str, name: str
) -> None:
    await train(logdir, 4)
    Path(logdir, name).unlink()
    os.mkfifo(Path(logdir, name))  # opening it for reading would block until a writer came
    pair = Pair()
    with anyio.fail_after(120):
        async with make(logdir, pair).session() as sess:
            report = sess.restore_report
    skipped = [Path(p).name for p, _ in report.skipped]
    if name == "checkpoint":
        assert report.step == 4 and skipped == ["checkpoint"]
    else:
        assert report.step == 2 and skipped == ["model.ckpt-4"]
        assert "not a regular file" in report.skipped[0][1]


@pytest.mark.asyncio
async def test_a_symlink_out_of_the_logdir_is_never_read(logdir: str, tmp_path: Path) -> None:
    await train(logdir, 4)
    outside = tmp_path / "outside.index"
    outside.write_bytes(Path(logdir, "model.ckpt-4.index").read_bytes())
    Path(logdir, "model.ckpt-4.index").unlink()
    Path(logdir, "model.ckpt-4.index").symlink_to(outside)
    pair = Pair()
    async with make(logdir, pair).session() as sess:
        assert sess.restore_report.step == 2
        assert "not a regular file inside the logdir" in sess.restore_report.skipped[0][1]


@pytest.mark.asyncio
async def test_a_fifo_as_the_lock_file_is_refused_not_waited_on(logdir: str) -> None:
    os.makedirs(logdir)
    os.mkfifo(Path(logdir, ".asupervisor.lock"))
    with anyio.fail_after(60), pytest.raises(OSError, match="not a regular file"):
        async with make(logdir, Pair()).session():
            pass


# -- non-chiefs --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_non_chief_keeps_waiting_while_only_damaged_checkpoints_exist(
    logdir: str,
) -> None:
    await train(logdir, 0)  # the chief's first checkpoint, at step 0
    Path(logdir, "model.ckpt-0.index").write_bytes(b"broken")
    sv = make(logdir, Pair(), is_chief=False, recovery_wait_secs=0.05)
    with pytest.raises(asv.WaitTimeout):  # not a fresh start on a damaged checkpoint
        async with sv.session(wait_for_checkpoint=True, max_wait_secs=0.5):
            pass

    async def chief_saves_later() -> None:
        await anyio.sleep(0.3)
        await train(logdir, 2)  # a good checkpoint at step 2

    pair = Pair()
    sv = make(logdir, pair, is_chief=False, recovery_wait_secs=0.05)
    async with anyio.create_task_group() as tg:
        tg.start_soon(chief_saves_later)
        async with sv.session(wait_for_checkpoint=True, max_wait_secs=60) as sess:
            report = sess.restore_report  # the chief's own first save, good, or step 2
            assert report.source == "checkpoint" and float(pair.a.numpy()) == report.step


CHIEF_SAVING_EVERY_STEP = """
import sys

import anyio
import tensorflow as tf

import asupervisor as asv

a = tf.Variable(0.0)


async def main() -> None:
    sv = asv.Supervisor(
        sys.argv[1], checkpoint={"a": a}, save_model_secs=0, save_model_steps=1, max_to_keep=1,
        save_summaries_secs=0,
    )
    async with sv.session() as sess:
        while True:
            await sess.run(a.assign_add, 1.0)


anyio.run(main)
"""


@pytest.mark.slow
def test_non_chiefs_starting_while_the_chief_sweeps_every_step_never_fail(logdir: str) -> None:
    """The chief saves at every step with max_to_keep=1, so what a non-chief chose is
    often deleted before it is read: it chooses again instead of failing."""
    chief = forked.Popen(
        [sys.executable, "-c", CHIEF_SAVING_EVERY_STEP, logdir],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    restored: list[tuple[int, float]] = []

    async def start_non_chiefs() -> None:
        while len(restored) < 50:
            a = tf.Variable(0.0)
            sv = asv.Supervisor(
                logdir, checkpoint={"a": a}, is_chief=False, recovery_wait_secs=0.05,
                handle_signals=False,
            )  # fmt: skip
            async with sv.session(wait_for_checkpoint=True, max_wait_secs=120) as sess:
                restored.append((sess.restore_report.step, float(a.numpy())))
                assert sess.restore_report.source == "checkpoint"

    try:
        anyio.run(start_non_chiefs)
        assert chief.poll() is None, chief.communicate()[1][-3000:]  # still saving
    finally:
        chief.kill()
        chief.wait()
    assert all(value == step for step, value in restored)  # each restore whole
    assert len({step for step, _ in restored}) > 10  # the chief really moved on meanwhile


def _open_files() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_write_back_flushes_a_growing_checkpoint_and_opens_nothing_else(tmp_path: Path) -> None:
    from asupervisor._logdir.store import Store

    store = Store(str(tmp_path))
    temp = tmp_path / "model.ckpt-7_temp"
    outside = tmp_path / "outside"
    outside.write_bytes(b"x")
    with store.writing_back("model.ckpt-7"):
        temp.mkdir()  # made after the thread began, as TF's saver makes it
        os.mkfifo(temp / "part-00000-of-00001.index")  # opening it would block the thread
        (temp / "link").symlink_to(outside)
        data = temp / "part-00000-of-00001.data-00000-of-00001"
        with open(data, "wb") as f:
            f.write(os.urandom(1 << 20))
            f.flush()
            deadline = time.monotonic() + 60
            while str(data) not in _open_files():  # the thread has it open to flush it
                assert time.monotonic() < deadline, "the growing file was never flushed"
                time.sleep(0.01)
        opened = _open_files()
    assert str(temp / "part-00000-of-00001.index") not in opened
    assert str(outside) not in opened
    left = _open_files()
    assert str(data) not in left, "the write-back thread's files are closed when it ends"
    assert not [t for t in threading.enumerate() if t.name == "asupervisor-write-back"]


def test_write_back_is_a_no_op_on_an_object_store() -> None:
    from asupervisor._logdir.store import Store

    with Store("ram://write-back/run").writing_back("model.ckpt-1"):
        assert not [t for t in threading.enumerate() if t.name == "asupervisor-write-back"]


def test_write_back_starts_no_thread_for_a_write_whose_last_one_was_short(
    tmp_path: Path,
) -> None:
    """A small model's save ends before a first flush: a thread started and joined at
    each one would cost more than it saves. A write that took longer gets one."""
    from asupervisor._logdir.store import WRITE_BACK_SECS, Store

    store = Store(str(tmp_path))

    def threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "asupervisor-write-back"]

    with store.writing_back("model.ckpt-1", WRITE_BACK_SECS / 10):
        assert not threads()
    for last in (None, WRITE_BACK_SECS * 2):  # the first save, and a long one
        with store.writing_back("model.ckpt-2", last):
            assert threads()
