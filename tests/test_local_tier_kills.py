"""Two tiers of checkpoints through real kills, with the logdir on the GCS protocol
(tests/gcs_fixture.py): a trainer (tests/faults/trainer.py --local-dir) SIGKILLed during a
local save, between a local commit and its copy, during a copy to the store; a new host
(the local tier gone); the store out of reach for a while; a preemption's SIGTERM.

Every kill lands at a point read from what is on disk (the local tier's files and
history, the requests the store has seen, its objects), never after a sleep.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor._logdir.history import read_history
from asupervisor._logdir.store import Store
from tests.faults.harness import Trainer, checkpoint_problems
from tests.gcs_fixture import FakeGcs

pytestmark = pytest.mark.slow

LEASE = ".asupervisor.lease"
WAIT_SECS = 180


def until(condition: Callable[[], bool], what: str, poll: float = 0.002) -> None:
    """Poll what is on disk (or in the store) until ``condition`` holds."""
    deadline = time.monotonic() + WAIT_SECS
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(poll)


def remote_head(gcs: FakeGcs, where: str) -> int | None:
    """The step of the logdir's head, as the store holds its history now (past this
    process's TF caches)."""
    raw = gcs.stored(f"{where}/.asupervisor.history")
    if raw is None:
        return None
    history = json.loads(raw)
    steps = {c["seq"]: c["step"] for c in history["commits"]}
    return steps.get(history["head"])


def local_head(here: str) -> int | None:
    return read_history(Store(here)).head_step()


def tier_of(run: Trainer) -> str:
    run.wait_for(lambda: any(line.startswith("tier ") for line in run.lines))
    return next(line.split()[1] for line in run.lines if line.startswith("tier "))


def uncommitted_left(where: str) -> list[str]:
    """Files a cut-short save or copy left: temporary directories, data with no index."""
    names = set(tf.io.gfile.listdir(where)) if tf.io.gfile.isdir(where) else set()
    names = {n.rstrip("/") for n in names}
    return sorted(
        n
        for n in names
        if n.endswith("_temp") or (".data-" in n and n.split(".data-")[0] + ".index" not in names)
    )


def released(where: str) -> None:
    """The killed chief's lease on the store (it would expire in 30 s): an operator's step."""
    tf.io.gfile.remove(f"{where}/{LEASE}")


def trainer_args(local: str, *more: str) -> list[str]:
    return [
        "--local-dir",
        local,
        "--local-steps",
        "3",
        "--save-steps",
        "100000",  # the logdir gets only the mirror's copies
        "--grace",
        "60",
        "--summaries-secs",
        "0",
        *more,
    ]


def test_killed_in_a_local_save_between_a_commit_and_its_copy_and_in_a_copy_it_resumes_whole(
    gcs: FakeGcs, tmp_path: Path
) -> None:
    where, local = gcs.new_path(), str(tmp_path / "local")
    here = asv.LocalTier(local).tier_dir(where)
    args = trainer_args(local, "--megabytes", "8")

    # 1. SIGKILL in the middle of a local save: TF writes it into <name>_temp first.
    run = Trainer(where, *args)
    run.wait_for(lambda: run.last_saved >= 3)
    until(lambda: any(n.endswith("_temp") for n in os.listdir(here)), "a local save")
    run.kill()
    assert [n for n in os.listdir(here) if n.endswith("_temp")]  # the case under test
    committed = local_head(here)
    assert committed is not None and committed >= 3

    # 2. The same host: the newest local commit, whole; what the kill cut short is gone.
    released(where)
    run = Trainer(where, *args)
    assert run.wait_restored() == committed
    assert tier_of(run) == "local"
    assert uncommitted_left(here) == []

    # 3. SIGKILL between a local commit and its copy: a slow store keeps the mirror
    # behind, and the local tier's head is newer than the logdir's.
    with gcs.slow(0.3):
        # Each look asks the emulator: not every 2 ms (a lead lasts a slow request, 0.3 s).
        until(lambda: (local_head(here) or 0) > (remote_head(gcs, where) or 0), "a lead", poll=0.02)
        run.kill()
    ahead, behind = local_head(here), remote_head(gcs, where)
    # The case under test: the logdir's commit is behind the local tier's. Whether the
    # mirror had begun copying the newer one's files depends on the machine's load (the
    # kill lands after the check above); either way it is not committed there, which is
    # what a restore reads. A kill in the middle of a copy is step 5's case.
    assert ahead is not None and ahead > (behind or 0)

    # 4. The same host again: that commit is restored from the local tier, and the
    # mirror goes on with what the logdir lacks: it copies it.
    released(where)
    run = Trainer(where, *args)
    assert run.wait_restored() == ahead
    assert tier_of(run) == "local"
    until(lambda: (remote_head(gcs, where) or 0) >= ahead, "the copy of the restored commit", 0.05)

    # 5. SIGKILL during a copy: the mirror's upload of a newer checkpoint has begun.
    prefix = where.removeprefix(f"gs://{where.split('/')[2]}/").replace("/", "%2F")
    upload = re.compile(re.escape(prefix) + r"%2Fmodel\.ckpt-(\d+)\.data-")
    seen = len(gcs.requests_seen())
    found: list[int] = []

    def uploading() -> bool:
        head = remote_head(gcs, where) or 0
        steps = [int(m[1]) for r in gcs.requests_seen()[seen:] if (m := upload.search(r))]
        found[:] = [s for s in steps if s > head]
        return bool(found)

    with gcs.slow(0.05):
        until(uploading, "an upload of the mirror's", poll=0.005)
        run.kill()
    copied_last, cut = remote_head(gcs, where), max(found)
    assert copied_last is not None and cut > copied_last
    assert gcs.stored(f"{where}/model.ckpt-{cut}.index") is None  # the case under test

    # 6. A new host: its local tier is empty. The last whole copy is restored, never the
    # half-copied one, and what the copy left is removed.
    shutil.rmtree(local)
    released(where)
    run = Trainer(where, *args, "--max-steps", "0")
    assert run.wait_restored() == copied_last
    assert tier_of(run) == "store"
    assert run.proc.wait(WAIT_SECS) == 0, run.stderr_text()[-3000:]
    names = [n.rstrip("/") for n in tf.io.gfile.listdir(where)]
    assert not [n for n in names if n.startswith(f"model.ckpt-{cut}.")], names
    assert uncommitted_left(where) == []
    count, problems = checkpoint_problems(where)
    assert count >= 1 and problems == []


def test_with_the_store_out_of_reach_training_goes_on_and_the_mirror_catches_up(
    gcs: FakeGcs, tmp_path: Path
) -> None:
    where, local = gcs.new_path(), str(tmp_path / "local")
    here = asv.LocalTier(local).tier_dir(where)
    run = Trainer(where, *trainer_args(local, "--megabytes", "1", "--pause", "0.02"))
    until(lambda: remote_head(gcs, where) is not None, "a first copy", poll=0.05)
    with gcs.down():
        at = local_head(here) or 0
        # Training and local saves go on: three more local commits, the store unreachable.
        until(lambda: (local_head(here) or 0) >= at + 9, "local commits", poll=0.01)
        assert (remote_head(gcs, where) or 0) < (local_head(here) or 0)
    reached = local_head(here) or 0
    until(lambda: (remote_head(gcs, where) or 0) >= reached, "the mirror caught up", poll=0.05)

    # A preemption: the final save goes to the local tier, then the mirror copies it.
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(WAIT_SECS) == 42, run.stderr_text()[-3000:]
    run.wait_for(lambda: run.stopped is not None)
    assert run.stopped is not None
    final = run.stopped[0]
    assert local_head(here) == remote_head(gcs, where) == final
    count, problems = checkpoint_problems(where)
    assert count >= 1 and problems == []
    assert uncommitted_left(where) == [] and uncommitted_left(here) == []
