"""Object-store logdirs on the real GCS protocol (tests/gcs_fixture.py) and on ram://:
the lease against TF's caches and a slow store, a kill in the middle of a save, two
chiefs racing, and the schemes TensorFlow does not have."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
import time
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor._logdir.lock import LeaseLock
from asupervisor._logdir.store import Store
from tests.conftest import Pair, named, pair_supervisor
from tests.faults.harness import Trainer, checkpoint_problems
from tests.gcs_fixture import FakeGcs

LEASE = ".asupervisor.lease"
STAT_CACHE_SECS = 5.0  # TF's GCS_STAT_CACHE_MAX_AGE, by default


def lease_of(owner: str, seconds: float) -> bytes:
    """A lease as an older asupervisor wrote it: no padding, so its length varies."""
    return json.dumps({"owner": owner, "expires": time.time() + seconds}).encode()


# -- the lease against TF's stat cache (TF's default caches: this process's) ---------


@pytest.mark.asyncio
async def test_a_save_goes_on_when_a_stale_cache_makes_the_lease_unreadable(
    gcs: FakeGcs, events: list[dict[str, Any]]
) -> None:
    """TF's GCS client keeps an object's length for GCS_STAT_CACHE_MAX_AGE (5 s) and fails
    a read that comes back shorter ("File contents are inconsistent"). The chief's own
    lease, rewritten shorter behind the cache, must not fail its save."""
    where = gcs.new_path()
    pair = Pair()
    async with pair_supervisor(where, pair).session() as sess:
        await sess.run(pair.step)
        lease = f"{where}/{LEASE}"
        owner = json.loads(gcs.stored(lease) or b"{}")["owner"]
        tf.io.gfile.stat(lease)  # cached: its length now
        cached_at = time.monotonic()
        shorter = json.dumps({"owner": owner, "expires": int(time.time() + 60)}).encode()
        gcs.put(lease, shorter)  # the same owner's lease, renewed shorter elsewhere
        assert len(gcs.stored(lease) or b"") < tf.io.gfile.stat(lease).length  # still cached
        await sess.run(pair.step)  # the save at step 2 re-reads the lease
    read_within = time.monotonic() - cached_at  # the save's read came before this
    assert named(events, "checkpoint.failed") == []
    assert tf.train.latest_checkpoint(where).endswith("model.ckpt-2")
    if read_within < STAT_CACHE_SECS - 0.5:  # a loaded machine may have let the cache expire
        assert named(events, "logdir.lease_unreadable")  # said, not silently passed over


@pytest.mark.asyncio
async def test_a_live_lease_that_a_stale_cache_cannot_read_is_not_taken_over(
    gcs: FakeGcs,
) -> None:
    """A new chief whose cache holds an older, longer version of a live chief's lease
    reads it again once the cache has let go, and is refused: never a steal."""
    where = gcs.new_path()
    lease = f"{where}/{LEASE}"
    gcs.put(lease, lease_of("trainer-7:99:cafe", 600) + b" " * 40)
    tf.io.gfile.stat(lease)  # this process caches the longer length
    gcs.put(lease, lease_of("trainer-7:99:cafe", 600))  # the live chief renewed it
    with pytest.raises(asv.LogdirLockedError, match=r"trainer-7:99:cafe\) for \d+ s more"):
        async with pair_supervisor(where, Pair()).session():
            pass
    assert json.loads(gcs.stored(lease) or b"{}")["owner"] == "trainer-7:99:cafe"


def test_an_unreadable_lease_is_not_taken_over(object_store: str) -> None:
    """Not a lease a chief writes: nobody can tell whose it is, so it is not taken over;
    the error names it and says what to do."""
    store = Store(object_store)
    store.make()
    store.write(LEASE, b"\x00not a lease")
    lock = LeaseLock(store, seconds=0.6)  # gives up reading after a heartbeat (0.2 s)
    with pytest.raises(asv.LogdirLockedError, match=r"could not be read.*remove it"):
        lock.acquire()
    assert store.read(LEASE) == b"\x00not a lease"


# -- release: after the heartbeat, off the event loop -------------------------------


def test_release_waits_for_a_renewal_in_flight_and_leaves_no_lease(gcs: FakeGcs) -> None:
    """A slow store: the heartbeat is in the middle of a renewal when the lease is
    released. The renewal must not write the lease back after its removal."""
    where = gcs.new_path()
    store = Store(where)
    store.make()
    lock = LeaseLock(store, seconds=0.9)  # a renewal every 0.3 s
    before = set(threading.enumerate())
    with gcs.slow(0.1):
        lock.acquire()
        (heartbeat,) = [t for t in set(threading.enumerate()) - before if "lease" in t.name]
        seen = len(gcs.requests_seen())
        deadline = time.monotonic() + 120
        while not any(
            r.startswith("POST /upload/") and ".asupervisor.lease" in r
            for r in gcs.requests_seen()[seen:]
        ):  # the renewal's upload has begun
            assert time.monotonic() < deadline, "no renewal began"
            time.sleep(0.01)
        lock.release()  # while the renewal uploads its lease
        heartbeat.join(120)
        assert not heartbeat.is_alive(), "the heartbeat never ended"
    assert gcs.stored(f"{where}/{LEASE}") is None


@pytest.mark.asyncio
async def test_the_lease_is_released_off_the_event_loop(gcs: FakeGcs) -> None:
    """Each call to a slow store takes DELAY: a release on the event loop (several calls)
    would hold the loop for more than 2 * DELAY; off the loop, it ticks on."""
    delay = 0.5
    where = gcs.new_path()
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await anyio.sleep(0.01)

    sv = asv.Supervisor(where, save_model_secs=0, save_summaries_secs=0, handle_signals=False)
    with contextlib.ExitStack() as slow:
        async with anyio.create_task_group() as tg:
            async with sv.session():
                tg.start_soon(tick)
                slow.enter_context(gcs.slow(delay))
                started = time.monotonic()
            ended = time.monotonic()
            tg.cancel_scope.cancel()
    assert gcs.stored(f"{where}/{LEASE}") is None  # released
    during = [t for t in ticks if t >= started] + [ended]
    stall = max(b - a for a, b in itertools.pairwise(during))
    assert stall < 2 * delay, f"the loop stalled {stall:.2f} s while the session closed"


# -- the events file --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_summaries_inside_steps_upload_the_events_file_on_time_not_per_events(
    gcs: FakeGcs,
) -> None:
    """An object cannot be appended to: each flush uploads the whole events file again.
    TF's writer flushes every 10 events (here 30 times); the session's, on time only."""
    where = gcs.new_path()
    seen = len(gcs.requests_seen())

    def step() -> None:
        for i in range(10):
            tf.summary.scalar(f"tag{i}", 1.0)

    sv = pair_supervisor(where, Pair(), save_model_steps=None)
    async with sv.session() as sess:
        for _ in range(30):
            await sess.run(step)
    uploads = [r for r in gcs.requests_seen()[seen:] if r.startswith("PUT ") and "tfevents" in r]
    assert 1 <= len(uploads) <= 3, uploads  # made, closed (and a 2-minute flush, if slow)
    (name,) = [n for n in tf.io.gfile.listdir(where) if n.startswith("events.out.tfevents.")]
    records = tf.data.TFRecordDataset(f"{where}/{name}")
    values = [v for r in records for v in tf.compat.v1.Event.FromString(r.numpy()).summary.value]
    assert len([v for v in values if v.tag.startswith("tag")]) == 300  # every point is there


# -- a kill in the middle of a save, and two chiefs at once (subprocesses) ----------


def _names(where: str) -> list[str]:
    return sorted(tf.io.gfile.listdir(where))


@pytest.mark.slow
def test_a_chief_killed_between_the_data_rename_and_the_index_resumes_without_orphans(
    gcs: FakeGcs,
) -> None:
    """TF renames a checkpoint's data into place, then uploads its index. Killed in
    between, the run leaves a data file with no index: the next chief resumes from the
    checkpoint before it and removes the orphan."""
    where = gcs.new_path()
    run = Trainer(where, "--save-steps", "3", "--megabytes", "1")
    run.wait_for(lambda: run.last_saved >= 0)  # the first checkpoint, to resume from
    # The second rename's copy has returned once its source is deleted.
    renamed = re.compile(
        r"DELETE .*%2Fmodel\.ckpt-(\d+)_temp%2Fpart-\d+-of-\d+\.data-[-\d]+of-\d+ "
    )
    prefix = where.removeprefix(f"gs://{where.split('/')[2]}/").replace("/", "%2F")
    with gcs.slow(0.05):  # the kill lands inside the save, before its index
        deadline = time.monotonic() + 120
        while True:
            found = [m for r in gcs.requests_seen() if prefix in r and (m := renamed.search(r))]
            if found and int(found[-1][1]) > run.last_saved:
                break
            assert time.monotonic() < deadline, "no save renamed its data"
            time.sleep(0.005)
        run.kill()
    step = int(found[-1][1])
    left = _names(where)
    assert f"model.ckpt-{step}.data-00000-of-00001" in left
    assert f"model.ckpt-{step}.index" not in left  # the case under test
    tf.io.gfile.remove(f"{where}/{LEASE}")  # the killed chief's: an operator's step
    resumed = Trainer(where, "--max-steps", "0", "--megabytes", "1")
    assert resumed.wait_restored() == step - 3
    assert resumed.proc.wait(120) == 0, resumed.stderr_text()[-3000:]
    left = _names(where)
    assert not [n for n in left if n.startswith(f"model.ckpt-{step}")], left
    assert not [n for n in left if n.endswith("_temp")], left
    count, problems = checkpoint_problems(where)
    assert count >= 1 and problems == []


@pytest.mark.slow
def test_two_chiefs_started_together_leave_exactly_one(gcs: FakeGcs) -> None:
    where = gcs.new_path()
    runs = [Trainer(where, "--save-steps", "2", "--wait-for-go") for _ in range(2)]
    for run in runs:
        run.wait_for(lambda r=run: "ready" in r.lines)
    for run in runs:  # as close together as two writes to two pipes
        assert run.proc.stdin is not None
        run.proc.stdin.write("go\n")
        run.proc.stdin.flush()
    try:
        deadline = time.monotonic() + 180
        while all(run.proc.poll() is None for run in runs):
            assert time.monotonic() < deadline, "both chiefs are still running"
            time.sleep(0.1)
        (lost,) = [run for run in runs if run.proc.poll() is not None]
        (kept,) = [run for run in runs if run is not lost]
        lost.proc.wait(60)
        assert lost.proc.returncode != 0
        assert "LogdirLockedError" in lost.stderr_text(), lost.stderr_text()[-3000:]
        saved = kept.last_saved
        kept.wait_for(lambda: kept.last_saved > saved + 2)  # the other trains on
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.kill()
    count, problems = checkpoint_problems(where)
    assert count >= 1 and problems == []


# -- schemes TensorFlow does not have --------------------------------------------------


@pytest.mark.parametrize("scheme", ["s3", "hdfs"])
def test_a_scheme_tensorflow_lacks_is_refused_with_advice_that_works(scheme: str) -> None:
    with pytest.raises(ValueError, match="logdir") as refused:
        asv.Supervisor(f"{scheme}://bucket/run", checkpoint={"a": tf.Variable(0.0)})
    text = str(refused.value)
    assert f"no file system for {scheme}://" in text
    assert "mounted" in text and "gs://" in text
    assert "install tensorflow-io" not in text  # it does not load on TF >= 2.17
    assert ("tensorflow-io" in text) == (scheme == "s3")


# -- a store that cannot be reached ----------------------------------------------------

OFFLINE = (
    "All 10 retry attempts failed. The last failure: Error executing an HTTP request: "
    "libcurl code 7 meaning 'Could not connect to server', error details: Failed to "
    "connect to 127.0.0.1 port 9 after 0 ms: Could not connect to server\n"
    "\t when reading metadata of gs://bucket/run"
)


def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """TF's gs:// as it answers with no network: its retries spent, an AbortedError."""

    def unreachable(path: str) -> bool:
        raise tf.errors.AbortedError(None, None, OFFLINE)

    monkeypatch.setattr(tf.io.gfile, "exists", unreachable)
    monkeypatch.setattr(tf.io.gfile, "listdir", unreachable)
    monkeypatch.setattr(tf.io.gfile, "isdir", unreachable)


def test_a_supervisor_on_a_store_that_cannot_be_reached_fails_in_one_line_with_its_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    offline(monkeypatch)
    with pytest.raises(asv.StoreUnreachableError) as raised:
        asv.Supervisor("gs://bucket/run", checkpoint={"v": tf.Variable(0.0)})
    text = str(raised.value)
    assert "\n" not in text and "gs://bucket/run" in text and "Could not connect" in text
    assert "credentials" in text  # where to look
    assert raised.value.outcome is asv.Outcome.UNREACHABLE

    async def main() -> None:
        asv.Supervisor("gs://bucket/run", checkpoint={"v": tf.Variable(0.0)})

    capsys.readouterr()
    status = asv.run(main)
    assert status == asv.Outcome.UNREACHABLE.exit_status == 69
    (line,) = capsys.readouterr().err.splitlines()  # no traceback: nothing in user code
    assert line.startswith("asupervisor.StoreUnreachableError: logdir 'gs://bucket/run'")


def test_inspect_of_a_store_that_cannot_be_reached_is_one_line_and_its_own_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from asupervisor.cli import main

    offline(monkeypatch)
    capsys.readouterr()
    assert main(["inspect", "gs://bucket/run"]) == 69  # not 1, "no checkpoints"
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert line.startswith("asupervisor inspect: error: logdir 'gs://bucket/run'"), line
    assert "Could not connect" in line and out == ""


@pytest.mark.slow
def test_tensorflows_own_error_for_an_offline_bucket_is_the_one_line(tmp_path: Any) -> None:
    """The real gs:// client, its proxy a port where nothing listens (one retry, not ten:
    TF's ten take minutes)."""
    import os
    import subprocess
    import sys

    from tests.gcs_fixture import free_port

    env = {
        **os.environ,
        "https_proxy": f"http://127.0.0.1:{free_port()}",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token",
        "NO_GCE_CHECK": "True",
        "GCS_RETRY_CONFIG_MAX_RETRIES": "1",
        "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "1000",  # its first wait: 1 ms, not 1 s
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    done = subprocess.run(
        [sys.executable, "-m", "asupervisor", "inspect", "gs://asupervisor-tests/offline"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 69, done.stderr
    (line,) = done.stderr.splitlines()
    assert "cannot be reached" in line and "Could not connect" in line, line
