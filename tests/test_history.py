"""One history per logdir: the catalog and the retention rules against a plain model.

Everything here but the last tests runs without TensorFlow: the catalog, the state file
and the rules read and write plain files. A checkpoint is stood in for by its two files.
The stateful search commits, rolls back, restarts, holds leases and moves an evaluator
along, and after each step checks the logdir against a reference model: the head, the
state file, which checkpoints are on disk (no more, no fewer), that an abandoned commit
is never a candidate and is kept until the new branch's first commit, that the rollback
target, the last good commit and the evaluator's backlog survive every sweep. Seeded and
bounded by time like the other searches (tests/search.py: ``ASV_SEED=<seed>`` runs it
again, ``ASV_FUZZ=1`` long); each minimal failing sequence it found is a plain test below.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from asupervisor._logdir import statefile
from asupervisor._logdir.catalog import Catalog
from asupervisor._logdir.history import HISTORY, NameFormat, read_history
from asupervisor._logdir.leases import hold, let_go, register
from asupervisor._logdir.records import EVALUATED, Record, evaluated_store, write_evaluated
from asupervisor._logdir.retention import Retention
from asupervisor._logdir.store import Store
from tests.search import FUZZ, search_budget, search_seed, search_settings, seeded, traced

BASENAME = "model.ckpt"
EVERY_HOURS = 0.5  # with commits 1000 s apart: every other one leaves the list preserved


def touch(store: Store, name: str) -> None:
    """A checkpoint's files, as TF leaves them."""
    for suffix in (".data-00000-of-00001", ".index"):
        Path(store.path(name + suffix)).write_bytes(b"x")


def on_disk(store: Store) -> set[str]:
    return {n[: -len(".index")] for n in store.names() if n.endswith(".index")}


# -- the reference model ------------------------------------------------------------------


@dataclass
class Ref:
    seq: int
    name: str
    step: int
    time: float
    healthy: bool | None
    kept: str = "listed"
    abandoned: bool = False


class Model:
    """What the logdir should hold, in the plainest terms."""

    def __init__(self, max_to_keep: int, lookback: int, backlog: int, since: int) -> None:
        self.commits: list[Ref] = []
        self.head: Ref | None = None
        self.max_to_keep, self.lookback = max_to_keep, lookback
        self.backlog, self.since = backlog, since
        self.last_preserved = 0.0
        self.seen: set[int] = set()  # by the evaluator (evaluated or skipped)
        self.leased: set[str] = set()
        self.rollbacks = 0

    def line(self) -> list[Ref]:
        return [c for c in reversed(self.commits) if not c.abandoned and c.kept != "gone"]

    def target(self, step: int) -> Ref | None:
        for c in self.line():
            if c.healthy is not False and c.step <= step - self.lookback:
                return c
        return None

    def newest_healthy(self) -> Ref | None:
        line = self.line()
        return next((c for c in line if c.healthy is True), None) or next(
            (c for c in line if c.healthy is None), None
        )

    def keeps(self) -> set[int]:
        line = self.line()
        keep = {c.seq for c in [c for c in line if c.kept == "listed"][: self.max_to_keep]}
        healthy = self.newest_healthy()
        if healthy is not None:
            keep.add(healthy.seq)
        if self.head is not None:
            target = self.target(self.head.step + 1)
            if target is not None:
                keep |= {c.seq for c in line if c.seq >= target.seq and c.healthy is not False}
        keep |= {c.seq for c in self.commits if c.name in self.leased and c.kept != "gone"}
        unseen = [
            c
            for c in self.commits
            if c.kept != "gone" and c.seq >= self.since and c.seq not in self.seen
        ]
        if self.backlog:
            keep |= {c.seq for c in unseen[-self.backlog :]}
        return keep

    def sweep(self) -> None:
        keep = self.keeps()
        for c in self.commits:
            if c.kept != "listed" or c.seq in keep:
                continue
            if not c.abandoned and c.time - EVERY_HOURS * 3600 >= self.last_preserved:
                c.kept, self.last_preserved = "preserved", c.time
            else:
                c.kept = "gone"

    def standing(self) -> set[str]:
        return {c.name for c in self.commits if c.kept != "gone"}


# -- the machine ----------------------------------------------------------------------------


@traced
class HistoryMachine(RuleBasedStateMachine):
    budget = search_budget(suite=4, fuzz=600)

    def __init__(self) -> None:
        self.budget.admit()
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="asv-history-")
        self.store = Store(self.dir)
        self.clock = time.time() + 10_000.0  # commit times, 1000 s apart
        self.model: Model | None = None
        self.catalog: Catalog | None = None
        self.retention: Retention | None = None
        self.since_rollback: set[str] | None = None  # abandoned, awaiting the next commit
        self.results: dict[str, dict[str, Any]] = {}

    def teardown(self) -> None:
        import shutil

        self.budget.ended()
        shutil.rmtree(self.dir, ignore_errors=True)

    @invariant()
    def within_the_budget(self) -> None:
        self.budget.check()

    @precondition(lambda self: self.model is None)
    @rule(
        max_to_keep=st.integers(1, 3),
        lookback=st.integers(0, 4),
        backlog=st.integers(0, 3),
    )
    def start(self, max_to_keep: int, lookback: int, backlog: int) -> None:
        register(self.store, "evaluator", 1, backlog, seconds=3600)
        self.model = Model(max_to_keep, lookback, backlog, since=1)
        self.retention = Retention(self.store, max_to_keep, EVERY_HOURS, None, lookback)
        self.open()
        self.model.last_preserved = self.catalog_().history.last_preserved

    def open(self) -> None:
        self.catalog = Catalog(self.store, BASENAME, writer=True)
        self.catalog.load()

    def catalog_(self) -> Catalog:
        assert self.catalog is not None
        return self.catalog

    def model_(self) -> Model:
        assert self.model is not None
        return self.model

    @precondition(lambda self: self.model is not None)
    @rule(advance=st.integers(0, 3), healthy=st.sampled_from([True, True, True, None, False]))
    def commit(self, advance: int, healthy: bool | None) -> None:
        model, catalog = self.model_(), self.catalog_()
        step = (model.head.step if model.head else 0) + advance
        name = catalog.next_name(step)
        assert name not in {c.name for c in model.commits}  # names are never reused
        self.clock += 1000.0
        touch(self.store, name)
        assert self.retention is not None
        self.retention.commit(catalog, name, Record(step, self.clock, {}, healthy))  # a save's
        commit = catalog.history.by_name(name)
        assert commit is not None
        ref = Ref(commit.seq, name, step, self.clock, healthy)
        model.commits.append(ref)
        model.head = ref
        model.sweep()
        self.since_rollback = None

    @precondition(lambda self: self.model is not None and self.model.head is not None)
    @rule(ahead=st.integers(1, 5))
    def roll_back(self, ahead: int) -> None:
        model, catalog = self.model_(), self.catalog_()
        assert model.head is not None
        at = model.head.step + ahead
        target = model.target(at)
        real = catalog.history.rollback_target(at, model.lookback)
        assert (None if real is None else real.seq) == (None if target is None else target.seq)
        if target is None:
            return
        catalog.roll_back(target.seq, kind="divergence", reason="nan", at_step=at)
        model.rollbacks += 1
        abandoned = [c for c in model.commits if c.seq > target.seq and not c.abandoned]
        for c in abandoned:
            c.abandoned = True
        model.head = target
        self.since_rollback = {c.name for c in abandoned if c.kept != "gone"}

    @precondition(lambda self: self.model is not None)
    @rule()
    def restart(self) -> None:
        before = self.catalog_().history
        self.open()
        after = self.catalog_().history
        assert after.commits == before.commits and after.head == before.head
        assert after.rollbacks == before.rollbacks
        # TF's rule (its testClockReset): a time kept every N hours that lies in the
        # future (a clock set back) is taken as now. The commits here are in the future.
        self.model_().last_preserved = min(self.model_().last_preserved, time.time())
        assert after.last_preserved == pytest.approx(self.model_().last_preserved, abs=5)

    @precondition(lambda self: self.model is not None)
    @rule(ahead=st.integers(1, 3))
    def killed_before_its_commit_then_restarted(self, ahead: int) -> None:
        """A kill between a checkpoint's files and its commit: the restart tries it first
        and adopts it (as the restorer does once it reads back whole)."""
        model = self.model_()
        step = (model.head.step if model.head else 0) + ahead
        name = self.catalog_().next_name(step)
        touch(self.store, name)
        self.restart()
        catalog = self.catalog_()
        assert catalog.orphans() == [name]
        assert catalog.candidates(committed_only=False)[0] == name
        assert name not in catalog.candidates(committed_only=True)
        catalog.adopt([name])
        adopted = catalog.history.head_commit()
        assert adopted is not None and adopted.name == name and adopted.healthy is None
        ref = Ref(adopted.seq, name, step, adopted.time, None)
        model.commits.append(ref)
        model.head = ref
        self.since_rollback = None  # the branch has a commit: the next sweep may go on

    @precondition(lambda self: self.model is not None)
    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        model = self.model_()
        standing = sorted(model.standing())
        if model.leased:
            let_go(self.store, "reader")
            model.leased.clear()
        elif standing:
            name = data.draw(st.sampled_from(standing))
            hold(self.store, "reader", name, seconds=3600)
            model.leased = {name}

    @precondition(lambda self: self.model is not None)
    @rule()
    def evaluate_one(self) -> None:
        """The evaluator deals with the oldest commit it has not seen: evaluated if it is
        on disk, recorded as skipped if it is gone."""
        model = self.model_()
        unseen = [c for c in model.commits if c.seq >= model.since and c.seq not in model.seen]
        if not unseen:
            return
        c = unseen[0]
        skipped = None if c.kept != "gone" else "swept"
        self.results[c.name] = {"step": c.step, "time": 0.0, "seq": c.seq, "skipped": skipped}
        write_evaluated(self.dir, self.results)
        model.seen.add(c.seq)

    # -- what must hold after every step --------------------------------------------------

    @invariant()
    def the_history_is_the_model(self) -> None:
        if self.model is None:
            return
        history, model = self.catalog_().history, self.model_()
        assert history.head == (None if model.head is None else model.head.seq)
        got = {c.seq: (c.name, c.kept, c.abandoned_by is not None) for c in history.commits}
        want = {c.seq: (c.name, c.kept, c.abandoned) for c in model.commits}
        assert got == want
        assert len(history.divergences()) == model.rollbacks

    @invariant()
    def the_state_file_follows_the_head(self) -> None:
        if self.model is None or self.model.head is None:
            return
        state = statefile.read(self.store)
        assert state is not None and state.latest == self.model.head.name
        listed = [c for c in self.model.commits if c.kept == "listed"]
        names = [c.name for c in listed if c is not self.model.head]
        names += [self.model.head.name] if self.model.head.kept == "listed" else []
        assert list(state.listed) == names

    @invariant()
    def on_disk_is_what_stands(self) -> None:
        if self.model is None:
            return
        assert on_disk(self.store) == self.model.standing()

    @invariant()
    def an_abandoned_commit_is_never_restored(self) -> None:
        if self.model is None:
            return
        abandoned = {c.name for c in self.model.commits if c.abandoned}
        candidates = self.catalog_().candidates(committed_only=False)
        assert not abandoned & set(candidates)
        if candidates:
            assert self.model.head is not None and candidates[0] == self.model.head.name

    @invariant()
    def what_a_rollback_abandons_stays_until_the_branch_commits(self) -> None:
        if self.since_rollback is not None:
            assert self.since_rollback <= on_disk(self.store)

    @invariant()
    def the_rollback_target_and_the_last_good_are_kept(self) -> None:
        model = self.model
        if model is None or model.head is None:
            return
        for ahead in range(1, 4):
            target = model.target(model.head.step + ahead)
            if target is not None:
                assert target.name in on_disk(self.store)
        healthy = model.newest_healthy()
        if healthy is not None:
            assert healthy.name in on_disk(self.store)


def test_the_history_and_its_rules_hold_against_a_plain_model() -> None:
    with HistoryMachine.budget.reporting():
        run_state_machine_as_test(
            seeded(HistoryMachine),
            settings=search_settings(examples=400 if FUZZ else 200, steps=40 if FUZZ else 25),
        )


# -- plain tests -------------------------------------------------------------------------


def committed_logdir(tmp_path: Path, steps: list[int], **retention: Any) -> tuple[Store, Catalog]:
    store = Store(str(tmp_path / "run"))
    store.make()
    catalog = Catalog(store, BASENAME, writer=True)
    catalog.load()
    rules = Retention(store, retention.get("max_to_keep"), None, None, retention.get("lookback"))
    for step in steps:
        name = catalog.next_name(step)
        touch(store, name)
        catalog.commit(name, Record(step, time.time(), {}, True))
        rules.sweep(catalog)
    return store, catalog


def test_a_rollback_abandons_the_line_after_its_target_and_the_head_moves_there(
    tmp_path: Path,
) -> None:
    store, catalog = committed_logdir(tmp_path, [0, 3, 6, 9, 12])
    target = catalog.history.rollback_target(14, 4)
    assert target is not None and target.name == "model.ckpt-9"
    catalog.roll_back(target.seq, kind="divergence", reason="nan", at_step=14)
    history = read_history(store)
    assert history.head_commit() == history.by_name("model.ckpt-9")
    assert [c.name for c in history.abandoned()] == ["model.ckpt-12"]
    assert statefile.read(store) is not None
    assert statefile.read(store).latest == "model.ckpt-9"  # type: ignore[union-attr]
    name = catalog.next_name(9)
    assert name == "model.ckpt-9_1"
    touch(store, name)
    commit = catalog.commit(name, Record(9, time.time(), {}, True))
    assert commit.parent == target.seq and commit.branch == 1


def test_the_history_file_writes_no_field_at_its_default_and_reads_back_the_same(
    tmp_path: Path,
) -> None:
    """The file is written whole and fsynced at every commit and remembers hundreds of swept
    ones: a field at its default is left out (a reader takes a missing one for it)."""
    store, catalog = committed_logdir(tmp_path, [0, 3, 6, 9])
    first = catalog.history.by_name("model.ckpt-3")
    assert first is not None
    catalog.roll_back(first.seq, kind="divergence", reason="nan", at_step=8, loss=12.5)
    raw = json.loads((tmp_path / "run" / HISTORY).read_text())
    by_name = {c["name"]: c for c in raw["commits"]}
    assert (
        "abandoned_by" not in by_name["model.ckpt-3"] and "metrics" not in by_name["model.ckpt-3"]
    )
    assert by_name["model.ckpt-6"]["abandoned_by"] == 1  # not at its default: written
    assert "batches_dropped" not in raw["rollbacks"][0] and "loss" in raw["rollbacks"][0]
    assert read_history(store) == catalog.history


def test_the_head_not_the_highest_step_is_the_latest(tmp_path: Path) -> None:
    store, catalog = committed_logdir(tmp_path, [0, 5, 10])
    first = catalog.history.by_name("model.ckpt-5")
    assert first is not None
    catalog.roll_back(first.seq, kind="divergence", reason="spike", at_step=11)
    assert catalog.candidates(committed_only=True) == ["model.ckpt-5", "model.ckpt-0"]
    assert read_history(store).head_step() == 5


def test_an_older_logdir_is_derived_once_from_its_state_file_and_records(
    tmp_path: Path,
) -> None:
    """A logdir from before the history: the state file and .asupervisor.checkpoints. An
    unlisted older checkpoint is a sweep's leftover (gone), a newer one an orphan."""
    store = Store(str(tmp_path / "run"))
    store.make()
    for step in (0, 2, 4, 6, 8):
        touch(store, f"model.ckpt-{step}")
    statefile.write(
        store,
        statefile.StateFile("model.ckpt-6", ("model.ckpt-4", "model.ckpt-6"), (1.0, 2.0), 0.5),
    )
    records = {
        "model.ckpt-4": {"step": 4, "time": 1.0, "metrics": {"val": 0.5}, "healthy": False},
        "model.ckpt-6": {"step": 6, "time": 2.0, "metrics": {}, "healthy": True},
    }
    store.write(".asupervisor.checkpoints", json.dumps(records).encode())
    history = read_history(store, BASENAME)
    assert history.derived
    assert [(c.name, c.kept, c.healthy) for c in history.commits] == [
        ("model.ckpt-0", "gone", None),
        ("model.ckpt-2", "gone", None),
        ("model.ckpt-4", "listed", False),
        ("model.ckpt-6", "listed", True),
    ]
    assert history.head_commit() == history.by_name("model.ckpt-6")
    catalog = Catalog(store, BASENAME, writer=True)
    catalog.load()
    assert catalog.orphans() == ["model.ckpt-8"]  # newer than the head: a kill's
    assert not read_history(store).derived and store.kind(HISTORY) == "file"
    assert store.kind(".asupervisor.checkpoints") is None  # read into the history


def test_a_foreign_checkpoint_is_listed_and_never_swept(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "run"))
    store.make()
    for n in (1, 2):
        touch(store, f"ckpt-{n}")
    statefile.write(store, statefile.StateFile("ckpt-2", ("ckpt-1", "ckpt-2"), (1.0, 2.0)))
    catalog = Catalog(store, BASENAME, writer=True)
    catalog.load()
    assert catalog.candidates(committed_only=True) == ["ckpt-2", "ckpt-1"]
    rules = Retention(store, 1, None)
    for step in (3, 4, 5):
        touch(store, f"model.ckpt-{step}")
        catalog.commit(f"model.ckpt-{step}", Record(step, time.time(), {}, True))
        rules.sweep(catalog)
    assert on_disk(store) == {"ckpt-1", "ckpt-2", "model.ckpt-5"}


def test_the_evaluator_backlog_keeps_the_newest_unseen_and_lets_seen_ones_go(
    tmp_path: Path,
) -> None:
    store = Store(str(tmp_path / "run"))
    store.make()
    register(store, "evaluator", 1, 2, seconds=3600)
    _, catalog = committed_logdir(tmp_path, [0, 1, 2, 3, 4], max_to_keep=1)
    assert on_disk(store) == {"model.ckpt-3", "model.ckpt-4"}  # the two newest unseen
    evaluated_store(str(tmp_path / "run")).make()
    seen = catalog.history.by_name("model.ckpt-3")
    assert seen is not None
    results = {seen.name: {"step": 3, "time": 0.0, "seq": seen.seq}}
    write_evaluated(str(tmp_path / "run"), results)  # the evaluator has seen one
    touch(store, "model.ckpt-5")
    catalog.commit("model.ckpt-5", Record(5, time.time(), {}, True))
    Retention(store, 1, None).sweep(catalog)
    assert on_disk(store) == {"model.ckpt-4", "model.ckpt-5"}  # unseen: kept
    assert Path(evaluated_store(str(tmp_path / "run")).path(EVALUATED)).exists()


def test_names_are_never_reused_while_the_history_remembers_them(tmp_path: Path) -> None:
    store, catalog = committed_logdir(tmp_path, [0, 3], max_to_keep=1)
    assert on_disk(store) == {"model.ckpt-3"}
    first = catalog.history.by_name("model.ckpt-3")
    zero = catalog.history.by_name("model.ckpt-0")
    assert first is not None and zero is not None and zero.kept == "gone"
    assert catalog.next_name(0) == "model.ckpt-0_1"
    assert NameFormat(BASENAME).order("model.ckpt-0_1") == (0, 1)


def test_the_state_file_reads_and_writes_as_tensorflows_does() -> None:
    from google.protobuf import text_format
    from tensorflow.python.checkpoint import checkpoint_management as tf_state

    rng = random.Random(search_seed())
    alphabet = "abé\"'\\\n\t /€-09_.\x01"
    for _ in range(300):
        listed = ["".join(rng.choices(alphabet, k=rng.randint(1, 9))) for _ in range(3)]
        latest = "".join(rng.choices(alphabet, k=rng.randint(1, 9)))
        stamps = [rng.random() * 1e10 for _ in listed]
        theirs = tf_state.CheckpointState(
            model_checkpoint_path=latest,
            all_model_checkpoint_paths=listed,
            all_model_checkpoint_timestamps=stamps,
            last_preserved_timestamp=rng.random() * 1e9,
        )
        ours = statefile.parse(text_format.MessageToString(theirs))
        assert ours == statefile.StateFile(
            latest, tuple(listed), tuple(stamps), theirs.last_preserved_timestamp
        )
        back = tf_state.CheckpointState()
        text_format.Merge(statefile.format_state(ours), back)
        assert back == theirs
    for damaged in [
        "",
        "this is not a checkpoint state {{{",
        'other: "x"',
        "model_checkpoint_path: 3",
    ]:
        with pytest.raises(ValueError):
            statefile.parse(damaged)


def test_reading_a_history_needs_no_tensorflow(tmp_path: Path) -> None:
    store, _ = committed_logdir(tmp_path, [0, 7])
    code = (
        "import sys\n"
        "from asupervisor._logdir.history import head_step, read_history\n"
        "from asupervisor._logdir.store import Store\n"
        f"print(head_step({store.root!r}), len(read_history(Store({store.root!r})).commits))\n"
        "print('TF' if 'tensorflow' in sys.modules else 'no TF')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["7", "2", "no", "TF"]


def test_a_backlog_larger_than_the_unseen_commits_keeps_them_all(tmp_path: Path) -> None:
    """Found by the search (seed 1318996822): with a backlog of 3 and two unseen commits,
    only the newest was kept (a negative slice start)."""
    store = Store(str(tmp_path / "run"))
    store.make()
    register(store, "evaluator", 1, 3, seconds=3600)
    committed_logdir(tmp_path, [0, 0], max_to_keep=1)
    assert on_disk(store) == {"model.ckpt-0", "model.ckpt-0_1"}


def test_a_commit_records_the_session_run_and_attempt_that_made_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asupervisor._logdir.heartbeat import ENV_ATTEMPT, ENV_RUN
    from asupervisor._logdir.history import Provenance

    monkeypatch.setenv(ENV_RUN, "run-7")
    monkeypatch.setenv(ENV_ATTEMPT, "3")
    store = Store(str(tmp_path / "run"))
    store.make()
    catalog = Catalog(store, BASENAME, writer=True, provenance=Provenance.of_session("abc"))
    catalog.load()
    touch(store, "model.ckpt-1")
    catalog.commit("model.ckpt-1", Record(1, time.time(), {"loss": 0.5}, True))
    (commit,) = read_history(store).commits
    assert (commit.session, commit.run, commit.attempt) == ("abc", "run-7", 3)
    assert commit.metrics == {"loss": 0.5} and commit.healthy is True


def test_a_sweep_deletes_only_tensorflows_files_of_a_checkpoint(tmp_path: Path) -> None:
    """A user's file beside a checkpoint (an after_save hook's ``path + ".metrics.json"``)
    is not the checkpoint's: only ``.index`` and ``.data-?????-of-?????`` are swept."""
    store = Store(str(tmp_path / "run"))
    store.make()
    catalog = Catalog(store, BASENAME, writer=True)
    catalog.load()
    rules = Retention(store, 1, None)
    for step in (0, 1, 2):
        name = catalog.next_name(step)
        touch(store, name)
        Path(store.path(name + ".metrics.json")).write_text("{}")
        Path(store.path(name + ".data-notes")).write_text("mine")
        catalog.commit(name, Record(step, time.time(), {}, True))
        rules.sweep(catalog)
    assert on_disk(store) == {"model.ckpt-2"}
    for step in (0, 1, 2):
        assert Path(store.path(f"model.ckpt-{step}.metrics.json")).exists()
        assert Path(store.path(f"model.ckpt-{step}.data-notes")).exists()
    assert store.files_of("model.ckpt-2") == [
        "model.ckpt-2.data-00000-of-00001",
        "model.ckpt-2.index",
    ]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_keep_best_takes_only_a_strictly_better_value_as_a_new_best(
    tmp_path: Path, mode: str
) -> None:
    """One tie rule for both modes (Orbit's): a later checkpoint with the same value as
    the best is not a new best; the earlier one is kept."""
    from asupervisor._logdir.retention import KeepBest

    store = Store(str(tmp_path / "run"))
    store.make()
    catalog = Catalog(store, BASENAME, writer=True)
    catalog.load()
    rules = Retention(store, 1, None, KeepBest("value", mode=mode))
    for step in (0, 1, 2):
        name = catalog.next_name(step)
        touch(store, name)
        value = 5.0 if step < 2 else (9.0 if mode == "min" else 1.0)  # the last is worse
        catalog.commit(name, Record(step, time.time(), {"value": value}, True))
        rules.sweep(catalog)
    assert on_disk(store) == {"model.ckpt-0", "model.ckpt-2"}


def test_the_state_file_lists_only_the_supervisors_own_checkpoints_beside_the_head(
    tmp_path: Path,
) -> None:
    """A migrated foreign checkpoint stays in the history (never swept) but the state
    file's ``all_model_checkpoint_paths`` lists ``max_to_keep`` of the supervisor's own,
    as TF's manager would."""
    store = Store(str(tmp_path / "run"))
    store.make()
    touch(store, "unusual_prefix-2")
    statefile.write(store, statefile.StateFile("unusual_prefix-2", ("unusual_prefix-2",), (1.0,)))
    catalog = Catalog(store, BASENAME, writer=True)
    catalog.load()
    state = statefile.read(store)
    assert state is not None and state.listed == ("unusual_prefix-2",)  # the head: named
    rules = Retention(store, 2, None)
    for step in (3, 4, 5):
        touch(store, f"model.ckpt-{step}")
        catalog.commit(f"model.ckpt-{step}", Record(step, time.time(), {}, True))
        rules.sweep(catalog)
    state = statefile.read(store)
    assert state is not None
    assert state.listed == ("model.ckpt-4", "model.ckpt-5")
    assert len(state.timestamps) == 2
    assert on_disk(store) == {"unusual_prefix-2", "model.ckpt-4", "model.ckpt-5"}
    history = read_history(store)
    foreign = history.by_name("unusual_prefix-2")
    assert foreign is not None and foreign.on_disk  # still in the history, never swept


@pytest.mark.parametrize("damage", ["removed", "overwritten"])
def test_a_damaged_or_missing_history_is_read_from_its_second_copy_and_logged(
    tmp_path: Path, damage: str, events: list[dict[str, Any]]
) -> None:
    """The history is written twice (the second copy after the first): a history file
    removed or overwritten is read from the other, with its rollback records, health marks
    and checkpoints kept every N hours, and a warning says so."""
    store, catalog = committed_logdir(tmp_path, [0, 3, 6, 9], max_to_keep=2)
    six, nine = catalog.history.by_name("model.ckpt-6"), catalog.history.by_name("model.ckpt-9")
    assert six is not None and nine is not None
    catalog.judged(nine.seq, False)
    catalog.roll_back(six.seq, kind="divergence", reason="nan", at_step=10)
    before = catalog.history
    if damage == "removed":
        Path(store.path(HISTORY)).unlink()
    else:
        Path(store.path(HISTORY)).write_bytes(b"{not json")
    again = Catalog(store, BASENAME, writer=True)
    again.load()
    assert again.history.commits == before.commits
    assert again.history.rollbacks == before.rollbacks and again.history.head == before.head
    assert read_history(store).rollbacks == before.rollbacks  # and written down again
    (warning,) = [e for e in events if e["event"] == "history.damaged"]
    assert warning["log_level"] == "warning" and warning["read_from"].endswith(".backup")


def test_a_history_derived_again_keeps_the_seq_the_evaluators_results_name(
    tmp_path: Path, events: list[dict[str, Any]]
) -> None:
    """Both copies gone (``cp -r run/* elsewhere/`` leaves dot files behind): the history
    derived from the state file gives each commit the ``seq`` the evaluator's results
    matched it by, and later commits numbers none of them used; a warning says so."""
    store, catalog = committed_logdir(tmp_path, [0, 1, 2, 3, 4], max_to_keep=2)
    kept = [c for c in catalog.history.commits if c.kept == "listed"]
    assert [c.seq for c in kept] == [4, 5]
    evaluated_store(store.root).make()
    write_evaluated(
        store.root,
        {c.name: {"step": c.step, "time": 0.0, "seq": c.seq, "metrics": {}} for c in kept}
        | {"model.ckpt-9": {"step": 9, "time": 0.0, "seq": 12, "metrics": {}}},
    )
    for name in store.names():
        if name.startswith(HISTORY):
            Path(store.path(name)).unlink()
    again = Catalog(store, BASENAME, writer=True)
    again.load()
    assert [(c.name, c.seq) for c in again.history.commits] == [
        ("model.ckpt-3", 4),
        ("model.ckpt-4", 5),
    ]
    assert again.history.next_seq > 12
    (warning,) = [e for e in events if e["event"] == "history.damaged"]
    assert warning["read_from"] is None and "missing" in warning["reason"]


def test_a_commit_does_as_much_work_after_hundreds_of_commits_as_after_ten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit's cost may not grow with the commits before it: the entries it encodes into
    JSON, the directory listings and the files it reads are the same at the 70th commit as
    at the 10th, while the history remembers up to ``KEEP_GONE`` swept commits (made 20
    here so that the history is full well before the end)."""
    from asupervisor._logdir import catalog as catalog_module

    monkeypatch.setattr(catalog_module, "KEEP_GONE", 20)
    work = {"encoded": 0, "listed": 0, "read": 0, "written": 0}
    dumps, names, read, write = json.dumps, Store.names, Store.read, Store.write

    def entries(obj: Any) -> int:
        """The commits and rollbacks in what is encoded (each has ``seq`` or ``number``)."""
        if isinstance(obj, dict):
            own = 1 if "seq" in obj or "number" in obj else 0
            return own + sum(entries(v) for v in obj.values())
        if isinstance(obj, list):
            return sum(entries(v) for v in obj)
        return 0

    def counted_dumps(obj: Any, *args: Any, **kwargs: Any) -> str:
        work["encoded"] += entries(obj)
        return dumps(obj, *args, **kwargs)

    def counted_names(self: Store) -> Any:
        work["listed"] += 1
        return names(self)

    def counted_read(self: Store, *args: Any, **kwargs: Any) -> bytes:
        work["read"] += 1
        return read(self, *args, **kwargs)

    def counted_write(self: Store, *args: Any, **kwargs: Any) -> None:
        work["written"] += 1
        write(self, *args, **kwargs)

    monkeypatch.setattr(json, "dumps", counted_dumps)
    monkeypatch.setattr(Store, "write", counted_write)
    monkeypatch.setattr(Store, "names", counted_names)
    monkeypatch.setattr(Store, "read", counted_read)
    per_commit = []
    store, catalog = committed_logdir(tmp_path, [], max_to_keep=3)
    rules = Retention(store, 3, None, None, None)
    for step in range(80):
        before = dict(work)
        name = catalog.next_name(step)
        touch(store, name)
        rules.commit(catalog, name, Record(step, time.time(), {"loss": 0.5}, True))  # a save's
        per_commit.append({k: work[k] - before[k] for k in work})
    assert len(catalog.history.commits) == 3 + 20  # the history is full
    assert per_commit[10] == per_commit[70], per_commit
    # The new commit and the one the sweep let go, in one write of the history (and its
    # second copy) and one of the state file.
    assert (per_commit[10]["encoded"], per_commit[10]["written"]) == (2, 3)
