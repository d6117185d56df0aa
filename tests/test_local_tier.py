"""Two tiers of checkpoints, in one process: saves into a local tier, a mirror copying them
into the logdir behind the training, one history over both at a restore.

The kills (during a local save, during a copy, between the two), the store out of reach
and resume equivalence through kills are in tests/test_local_tier_kills.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import tensorflow as tf
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import asupervisor as asv
from asupervisor._checkpointing.tiers import ENV_DIR, ENV_SAVE_SECS, LocalTier, tier_name
from asupervisor._cli.inspect import describe_at_risk
from asupervisor._logdir.heartbeat import Beat
from asupervisor._logdir.history import read_history
from asupervisor._logdir.ledger import NAME as LEDGER
from asupervisor._logdir.lock import LeaseLock
from asupervisor._logdir.store import Store
from asupervisor._logdir.verify import verify_checkpoint
from tests.conftest import Pair, named
from tests.gcs_fixture import BUCKET, FakeGcs
from tests.search import replay_line, search_budget, search_settings, seeded, traced


def tiered(logdir: str, pair: Pair, local: str, **tier: Any) -> asv.Supervisor:
    tier.setdefault("save_secs", None)
    tier.setdefault("save_steps", 2)
    return asv.Supervisor(
        logdir,
        checkpoint={"pair": pair},
        save_model_secs=0,
        save_summaries_secs=0,
        handle_signals=False,
        local_tier=asv.LocalTier(local, **tier),
    )


async def train(sv: asv.Supervisor, to_step: int) -> asv.RestoreReport:
    pair = sv.checkpoint.pair  # the Pair it saves
    async with sv.session() as sess:
        report = sess.restore_report
        while sess.global_step < to_step:
            await sess.run(pair.step)
            settle(sv)
    return report


def settle(sv: asv.Supervisor) -> None:
    """Until the local write and the mirror's copy are done. Both are in the background:
    a timed save is skipped while a write runs, and the mirror copies only the newest
    commit offered: waiting makes every save happen and every copy, in order."""
    runtime = sv._runtime
    assert runtime is not None and runtime.checkpointer is not None
    assert runtime.checkpointer.wait_for_write(60)
    assert runtime.checkpointer.wait_for_mirror(60)


# -- the setting -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named_argument"),
    [
        ({"directory": ""}, "directory"),
        ({"directory": "gs://bucket/x"}, "directory"),
        ({"save_secs": 0}, "save_secs"),
        ({"save_secs": float("inf")}, "save_secs"),
        ({"save_secs": "10"}, "save_secs"),
        ({"save_steps": 0}, "save_steps"),
        ({"save_steps": 2.5}, "save_steps"),
        ({"save_secs": None, "save_steps": None}, "save_secs and save_steps"),
        ({"keep": 0}, "keep"),
        ({"keep": True}, "keep"),
        ({"mirror_every": 0}, "mirror_every"),
    ],
)
def test_a_bad_local_tier_setting_is_refused_naming_it(
    tmp_path: Path, kwargs: dict[str, Any], named_argument: str
) -> None:
    kwargs.setdefault("directory", str(tmp_path))
    with pytest.raises(ValueError, match=named_argument):
        LocalTier(**kwargs)


def test_a_local_tier_is_refused_where_it_cannot_serve(tmp_path: Path, pair: Pair) -> None:
    tier = asv.LocalTier(tmp_path / "local")
    with pytest.raises(ValueError, match=r"local_tier must be an asupervisor\.LocalTier"):
        asv.Supervisor(str(tmp_path / "run"), checkpoint={"p": pair}, local_tier="/dev/shm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_tier needs a logdir"):
        asv.Supervisor(None, checkpoint={"p": pair}, local_tier=tier)
    with pytest.raises(ValueError, match=r"local_tier with keep_best=KeepBest\(export"):
        asv.Supervisor(
            str(tmp_path / "run"),
            checkpoint={"p": pair},
            local_tier=tier,
            keep_best=asv.KeepBest("loss", export=lambda path: None),
        )


def test_asupervisor_run_turns_the_local_tier_on_for_its_children(
    tmp_path: Path, pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert asv.Supervisor(str(tmp_path / "run"), checkpoint={"p": pair}).local_tier is None
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "local"))
    monkeypatch.setenv(ENV_SAVE_SECS, "2.5")
    sv = asv.Supervisor(str(tmp_path / "run"), checkpoint={"p": pair})
    assert sv.local_tier == asv.LocalTier(str(tmp_path / "local"), save_secs=2.5)
    assert sv.save_secs == 2.5  # the session saves on the local tier's interval
    # Two runs on one host never share a directory; one run finds its own again.
    one, two = tier_name(str(tmp_path / "run")), tier_name(str(tmp_path / "other" / "run"))
    assert one != two and one.startswith("run-")
    assert sv.local_tier is not None and sv.local_tier.tier_dir(str(tmp_path / "run")) == str(
        tmp_path / "local" / one
    )
    monkeypatch.setenv(ENV_SAVE_SECS, "-1")
    with pytest.raises(ValueError, match=ENV_SAVE_SECS):
        asv.Supervisor(str(tmp_path / "run"), checkpoint={"p": pair})


# -- saving, mirroring, restoring ----------------------------------------------------


def commits(where: str) -> list[tuple[str, int | None]]:
    return [(c.name, c.step) for c in read_history(Store(where)).committed()]


@pytest.mark.asyncio
async def test_saves_go_to_the_local_tier_and_the_logdir_gets_each_commit_behind_them(
    logdir: str, tmp_path: Path, events: list[dict[str, Any]]
) -> None:
    local = str(tmp_path / "local")
    pair = Pair()
    sv = tiered(logdir, pair, local, keep=2)
    report = await train(sv, 9)
    assert report.tier is None and report.source == asv.RestoreSource.FRESH
    here = LocalTier(local).tier_dir(logdir)
    saved = [e for e in named(events, "checkpoint.saved")]
    assert saved and all(e["path"].startswith(here) for e in saved)  # written locally
    assert [s for _, s in commits(here)] == [8, 9]  # its own retention: the newest 2
    mirrored = named(events, "checkpoint.mirrored")
    remote = commits(logdir)
    # Each copy is committed in the logdir's history, in order, the final one too; the
    # logdir keeps its own max_to_keep (5).
    assert [e["step"] for e in mirrored] == [e["step"] for e in saved] == [0, 2, 4, 6, 8, 9]
    assert [s for _, s in remote] == [2, 4, 6, 8, 9]
    assert remote[-1] == commits(here)[-1]  # the same commit, by name, in both tiers
    assert mirrored[-1]["steps_at_risk"] == 0
    for name, _ in remote:
        assert verify_checkpoint(os.path.join(logdir, name)) is None
    assert not [n for n in os.listdir(logdir) if n.endswith("_temp")]
    assert tf.train.latest_checkpoint(logdir) == os.path.join(logdir, remote[-1][0])


@pytest.mark.asyncio
async def test_a_restart_restores_from_the_local_tier_and_from_the_logdir_once_it_is_gone(
    logdir: str, tmp_path: Path, events: list[dict[str, Any]]
) -> None:
    local = str(tmp_path / "local")
    await train(tiered(logdir, Pair(), local), 5)
    here = LocalTier(local).tier_dir(logdir)

    again = Pair()
    report = await train(tiered(logdir, again, local), 7)
    assert (report.step, report.tier) == (5, "local")
    assert report.path is not None and report.path.startswith(here)
    assert named(events, "checkpoint.restored")[-1]["tier"] == "local"

    shutil.rmtree(local)  # a new host: the local tier is empty
    third = Pair()
    report = await train(tiered(logdir, third, local), 8)
    assert (report.step, report.tier) == (7, "store")
    assert report.path == os.path.join(logdir, commits(logdir)[-2][0])
    ledger = [json.loads(line) for line in open(os.path.join(logdir, LEDGER))]
    assert [e["restored_tier"] for e in ledger if e["event"] == "start"] == [
        None,
        "local",
        "store",
    ]


@pytest.mark.asyncio
async def test_the_chief_proposes_no_timed_save_while_its_local_write_runs_below_training(
    logdir: str, tmp_path: Path, events: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a multi-worker job every worker takes part in each save, so the chief's local
    writer never skips one; a timed save is not proposed while the chief's local write is
    in flight instead (the next interval proposes it). In process: the job's agreement is
    a stand-in that records what the chief proposes, and the local write is held."""
    from asupervisor._checkpointing import async_save
    from asupervisor._cluster import DecisionKind

    held, write = threading.Event(), async_save.write_snapshot
    writes: list[int] = []

    def held_write(snapshot: Any, path: str) -> None:
        writes.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert held.wait(60), "the write was never let go"
        write(snapshot, path)

    class Agreement:
        def __init__(self) -> None:
            self.proposed: list[tuple[DecisionKind, str, int]] = []

        def propose(self, kind: DecisionKind, reason: str, step: int) -> None:
            self.proposed.append((kind, reason, step))

    base = os.getpriority(os.PRIO_PROCESS, 0)  # a thread starts at the process's
    pair = Pair()
    sv = tiered(logdir, pair, str(tmp_path / "local"), save_steps=2)
    async with sv.session() as sess:
        await sess.run(pair.step)
        settle(sv)
        monkeypatch.setattr(async_save, "write_snapshot", held_write)
        await sess.run(pair.step)  # step 2: a local save, written in the background
        runtime = sv._runtime
        assert runtime is not None and runtime.checkpointer is not None
        checkpoints, agreement = runtime.checkpoints, Agreement()
        checkpoints.agreement = agreement  # type: ignore[assignment]
        try:
            while not writes:  # the write is in flight (held)
                await anyio.sleep(0.01)
            checkpoints.timed_save()
            assert agreement.proposed == []
            # The write gives way to training, but not at the lowest priority: what a
            # kill loses is the interval and the write in flight, so it must not starve.
            assert writes == [10] or (base > 10 and writes == [base])
            assert named(events, "checkpoint.local_skipped")[-1]["step"] == 2
            held.set()
            assert runtime.checkpointer.wait_for_write(60)
            checkpoints.timed_save()  # the write is done: the timer's save is proposed
            assert agreement.proposed == [(DecisionKind.SAVE, "timer", 2)]
        finally:
            held.set()
            checkpoints.agreement = None


# What a start that restores the local tier asks of the store (gs://, the real protocol):
# the lease (read, written, read back), one listing, the history and the state file read
# once each, the events file; 66 requests before these were cut, 17 after.
RESTORE_REQUESTS = 20
LEASE = LeaseLock.NAME


@pytest.mark.asyncio
async def test_a_restore_from_the_local_tier_asks_the_store_only_what_it_must(
    gcs: FakeGcs, tmp_path: Path
) -> None:
    logdir, local = gcs.new_path(), str(tmp_path / "local")
    await train(tiered(logdir, Pair(), local), 3)
    seen = len(gcs.requests_seen())
    async with tiered(logdir, Pair(), local).session() as sess:
        asked = gcs.requests_seen()[seen:]
        assert (sess.restore_report.step, sess.restore_report.tier) == (3, "local")

    # Nothing is written into the history nor the state file (they are as read), no
    # object is copied (a write on gs:// is one upload, not a copy and a delete), and
    # the history and the state file are read in one request each; the lease in two
    # (before it is written, and read back after).
    def objects(method: str) -> list[str]:
        names = [r.split()[1].rsplit("%2F", 1)[-1] for r in asked if r.startswith(method)]
        return [re.sub(r"\.tmp\d+$", "", n) for n in names]  # written aside, then renamed

    assert not {".asupervisor.history", "checkpoint"} & set(objects("POST /upload/"))
    assert not [r for r in asked if "/rewriteTo/" in r]
    reads = objects(f"GET /{BUCKET}/")  # an object's contents (not a listing, not a stat)
    assert [reads.count(n) for n in (".asupervisor.history", "checkpoint", LEASE)] == [1, 1, 2]
    assert len(asked) <= RESTORE_REQUESTS, "\n".join(asked)


@pytest.mark.asyncio
async def test_only_every_nth_local_commit_and_the_final_one_are_mirrored(
    logdir: str, tmp_path: Path
) -> None:
    pair = Pair()
    local = str(tmp_path / "local")
    await train(tiered(logdir, pair, local, mirror_every=3, keep=20), 10)
    local_steps = [s for _, s in commits(LocalTier(local).tier_dir(logdir))]
    assert local_steps == [0, 2, 4, 6, 8, 10]
    assert [s for _, s in commits(logdir)] == [4, 10]  # the 3rd and 6th, and the final


def test_the_final_copy_waits_for_no_retry_pause_once_the_session_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy that failed (the store out of reach) is tried again after a pause that
    grows to 30 s; at a stop the final copy has only what is left of the grace (GKE
    Spot: 15 s), so the session's end cuts the pause under way. In process, the copy
    stubbed: the first try fails, the pause is an hour, and the retry comes anyway."""
    from asupervisor._checkpointing import mirror as mirror_module
    from asupervisor._logdir.catalog import Catalog
    from asupervisor._logdir.lock import WriteGuard
    from asupervisor._logdir.records import Record
    from asupervisor._logdir.retention import Retention

    monkeypatch.setattr(mirror_module, "RETRY_FIRST_SECS", 3600.0)
    monkeypatch.setattr(mirror_module, "HURRIED_RETRY_SECS", 0.0)
    remote = Catalog(Store(str(tmp_path / "logdir")), "model.ckpt", writer=True)
    remote.load()
    local = Store(str(tmp_path / "local"))
    local.make()
    open(local.path("model.ckpt-1.index"), "wb").close()  # what a retry looks for
    mirror = mirror_module.Mirror(local, remote, Retention(remote.store, 5, None), WriteGuard(None))
    tries: list[str] = []
    failed = threading.Event()

    def copy(name: str, record: Record) -> bool:
        tries.append(name)
        if len(tries) == 1:
            failed.set()
            raise OSError("the store is out of reach")
        return True

    monkeypatch.setattr(mirror, "_copy", copy)
    try:
        mirror.committed("model.ckpt-1", Record(1, 0.0, {}, True))
        assert failed.wait(60)
        assert not mirror.wait(0.05)  # in its pause: an hour, if nothing cuts it
        mirror.hurry()  # the session ends (Checkpointer.finish_mirror)
        assert mirror.wait(60), tries
        assert tries == ["model.ckpt-1", "model.ckpt-1"]
        assert (mirror.mirrored_step, mirror.steps_at_risk()) == (1, 0)
    finally:
        mirror.close()


def test_at_the_sessions_end_a_copy_a_newer_commit_replaced_is_abandoned_before_its_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mirror copies commit 1 when the stop's final save (commit 2) comes: once the
    session ends, the rest of the grace goes to commit 2. Commit 1 stops before its
    ``.index`` (it is never a checkpoint of the logdir), and nothing of it stays there.
    In process, on checkpoint-shaped files; the copy of commit 1's data file is held."""
    from asupervisor._checkpointing.mirror import Mirror
    from asupervisor._logdir.catalog import Catalog
    from asupervisor._logdir.lock import WriteGuard
    from asupervisor._logdir.records import Record
    from asupervisor._logdir.retention import Retention

    logdir = str(tmp_path / "logdir")
    remote = Catalog(Store(logdir), "model.ckpt", writer=True)
    remote.load()
    local = Store(str(tmp_path / "local"))
    local.make()
    for step in (1, 2):
        for suffix in (".data-00000-of-00001", ".index"):
            with open(local.path(f"model.ckpt-{step}{suffix}"), "wb") as file:
                file.write(b"x" * 64)
    mirror = Mirror(local, remote, Retention(remote.store, 5, None), WriteGuard(None))
    read: list[str] = []
    copying, go_on = threading.Event(), threading.Event()
    path = local.path

    def held_path(name: str) -> str:  # each file the mirror reads, in order
        read.append(name)
        if name == "model.ckpt-1.data-00000-of-00001":
            copying.set()
            assert go_on.wait(60), "never let go"
        return path(name)

    monkeypatch.setattr(local, "path", held_path)
    try:
        mirror.committed("model.ckpt-1", Record(1, 1.0, {}, True))
        assert copying.wait(60)
        mirror.committed("model.ckpt-2", Record(2, 2.0, {}, True))  # the final save
        mirror.hurry()  # the session ends (Checkpointer.finish_mirror)
        go_on.set()
        assert mirror.wait(60)
    finally:
        go_on.set()
        mirror.close()
    assert read == [
        "model.ckpt-1.data-00000-of-00001",
        "model.ckpt-2.data-00000-of-00001",
        "model.ckpt-2.index",
    ]
    assert [c.step for c in read_history(Store(logdir)).committed()] == [2]
    left = [n for n in os.listdir(logdir) if n.startswith("model.ckpt")]
    assert sorted(left) == ["model.ckpt-2.data-00000-of-00001", "model.ckpt-2.index"]
    assert (mirror.mirrored_step, mirror.steps_at_risk()) == (2, 0)


@pytest.mark.asyncio
async def test_steps_at_risk_is_in_tensorboard_and_in_the_heartbeat(
    logdir: str, tmp_path: Path
) -> None:
    pair = Pair()
    await train(tiered(logdir, pair, str(tmp_path / "local")), 6)
    acc = EventAccumulator(logdir)
    acc.Reload()
    points = [float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors("run/steps_at_risk")]
    assert points and points[-1] == 0.0
    beat = Beat.from_json(open(os.path.join(logdir, ".asupervisor.heartbeat"), "rb").read())
    assert beat.steps_at_risk == 0
    # What inspect says of it: what a host that never comes back would lose.
    assert describe_at_risk(beat) == "every local commit is in the logdir (0 steps at risk)"
    assert describe_at_risk(dataclasses.replace(beat, steps_at_risk=12)) == (
        f"12 steps at risk: committed on {beat.host}, not yet in the logdir"
    )


@pytest.mark.asyncio
async def test_a_restore_takes_the_logdir_when_another_host_went_further(
    logdir: str, tmp_path: Path
) -> None:
    """The newest commit of either tier: this host's local tier is behind the logdir,
    which another host's run carried on."""
    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    await train(tiered(logdir, Pair(), here), 4)
    report = await train(tiered(logdir, Pair(), there), 9)  # another host
    assert (report.step, report.tier) == (4, "store")
    back = Pair()
    report = await train(tiered(logdir, back, here), 10)
    assert (report.step, report.tier) == (9, "store")  # not this host's older step 4
    assert float(back.a.numpy()) == 10.0


@pytest.mark.asyncio
async def test_another_worker_reads_the_chiefs_local_commit_only_if_its_own_tier_holds_the_same(
    logdir: str, tmp_path: Path
) -> None:
    """What a multi-worker job's restore agreement asks each worker (the job itself:
    tests/test_multiworker.py): the chief's local commit, by name and the digest of its
    index, looked for in the worker's own local tier."""
    from asupervisor._checkpointing.local import copy_in, offer_of

    local, elsewhere = str(tmp_path / "local"), str(tmp_path / "elsewhere")
    await train(tiered(logdir, Pair(), local, mirror_every=100), 4)
    here = LocalTier(local).tier_dir(logdir)
    name = commits(here)[-1][0]
    offer = offer_of(os.path.join(here, name))
    assert copy_in(offer, here) == os.path.join(here, name)  # the chief's host
    other = LocalTier(elsewhere).tier_dir(logdir)
    assert copy_in(offer, other) is None  # another host: its tier lacks it
    os.makedirs(other)
    for file in os.listdir(here):  # a directory every host shares: the same files
        if file.startswith(name + "."):
            shutil.copy(os.path.join(here, file), other)
    assert copy_in(offer, other) == os.path.join(other, name)
    older = commits(here)[-2][0]  # the same name over other bytes: a stale checkpoint
    shutil.copy(os.path.join(here, older + ".index"), os.path.join(other, name + ".index"))
    assert copy_in(offer, other) is None
    shutil.copy(os.path.join(here, name + ".index"), other)
    os.remove(os.path.join(other, name + ".data-00000-of-00001"))  # not whole
    assert copy_in(offer, other) is None


@pytest.mark.asyncio
async def test_a_rollback_with_a_local_tier_goes_back_in_both_tiers(
    logdir: str, tmp_path: Path, events: list[dict[str, Any]]
) -> None:
    from tests.test_rollback import Line, regression

    local = str(tmp_path / "local")

    def supervisor(line: Line) -> asv.Supervisor:
        return asv.Supervisor(
            logdir,
            checkpoint={"line": line},
            save_model_secs=0,
            save_summaries_secs=0,
            on_divergence=asv.Rollback(skip=1),
            handle_signals=False,
            local_tier=asv.LocalTier(local, save_secs=None, save_steps=3),
        )

    def data(epoch: int) -> tf.data.Dataset:
        return regression(poisoned={7} if epoch == 0 else set())

    line = Line()
    sv = supervisor(line)
    async with sv.session() as sess:
        await sess.train(line.step, data, epochs=2)
    assert sess.outcome is asv.Outcome.DONE
    (back,) = named(events, "checkpoint.rolled_back")
    history = read_history(Store(logdir))
    (rollback,) = history.divergences()  # recorded in the logdir's history, the record
    assert history.commit(rollback.to) is not None
    assert back["step"] == history.commit(rollback.to).step  # type: ignore[union-attr]
    abandoned = {c.name for c in history.abandoned()}
    here = LocalTier(local).tier_dir(logdir)
    local_line = [c.name for c in read_history(Store(here)).line()]
    assert not abandoned & set(local_line)  # the local tier went back too
    head = history.head_commit()
    assert head is not None and head.healthy and head.name == local_line[0]

    again = Line()
    async with supervisor(again).session() as sess:
        assert (sess.restore_report.step, sess.restore_report.tier) == (head.step, "local")
    assert float(again.w.numpy()) == float(line.w.numpy())


# -- a search against a plain reference ----------------------------------------------


class Hosts(RuleBasedStateMachine):
    """Sessions on two hosts, each with a local tier, over one logdir; a host's local tier
    lost now and then. The reference: the run's step, the host of the last session, and
    the hosts whose local tier is gone. Every session restores the run's step, from its
    own local tier if it ran last and still has it, else from the logdir."""

    budget = search_budget(suite=8, fuzz=300)

    def __init__(self) -> None:
        super().__init__()
        self.budget.admit()
        self.root = Path(tempfile.mkdtemp(prefix="asv-tiers-"))
        self.logdir = str(self.root / "run")
        self.step, self.last, self.lost = 0, None, set()  # type: ignore[var-annotated]

    @rule(host=st.sampled_from(["a", "b"]), steps=st.integers(1, 4))
    def run_on(self, host: str, steps: int) -> None:
        pair = Pair()
        sv = tiered(self.logdir, pair, str(self.root / host), save_steps=3)
        report = anyio.run(train, sv, self.step + steps)
        if self.last is None:
            expected = None
        else:
            expected = "local" if self.last == host and host not in self.lost else "store"
        assert (report.step, report.tier) == (self.step, expected)
        self.step, self.last = self.step + steps, host
        self.lost.discard(host)
        assert float(pair.a.numpy()) == float(pair.b.numpy()) == self.step
        assert read_history(Store(self.logdir)).head_step() == self.step  # the final copy
        here = LocalTier(str(self.root / host)).tier_dir(self.logdir)
        assert read_history(Store(here)).head_step() == self.step

    @rule(host=st.sampled_from(["a", "b"]))
    def lose(self, host: str) -> None:
        shutil.rmtree(self.root / host, ignore_errors=True)
        self.lost.add(host)

    @invariant()
    def within_budget(self) -> None:
        self.budget.check()

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.budget.ended()


def test_every_restore_over_two_hosts_is_the_one_the_reference_predicts() -> None:
    print(f"two-tier search: {replay_line()}")
    with Hosts.budget.reporting():
        run_state_machine_as_test(
            seeded(traced(Hosts)), settings=search_settings(examples=100, steps=6)
        )
