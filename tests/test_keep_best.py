"""Retention of the library's own: the best by a metric, the newest healthy checkpoint and
what readers lease are kept beside the newest `max_to_keep`; what each commit recorded is
read back by the next session, and the best survives a kill."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor._logdir.history import read_history
from asupervisor._logdir.leases import hold, let_go
from asupervisor._logdir.store import Store
from tests import forked
from tests.conftest import Pair


def on_disk(logdir: str) -> list[str]:
    return sorted(n[: -len(".index")] for n in os.listdir(logdir) if n.endswith(".index"))


@pytest.mark.asyncio
async def test_the_best_by_a_metric_is_kept_beside_the_newest(logdir: str, pair: Pair) -> None:
    sv = asv.Supervisor(
        logdir, checkpoint={"p": pair}, save_model_secs=0, max_to_keep=2, save_summaries_secs=0,
        keep_best=asv.KeepBest("val", mode="min"), handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        for val in (5.0, 3.0, 4.0, 6.0, 7.0):
            await sess.run(pair.step)
            await sess.save_checkpoint(metrics={"val": val})
    assert on_disk(logdir) == ["model.ckpt-2", "model.ckpt-4", "model.ckpt-5"]  # 3.0, newest 2
    best = read_history(Store(logdir)).by_name("model.ckpt-2")
    assert best is not None and best.metrics["val"] == 3.0 and best.healthy
    state = tf.train.get_checkpoint_state(logdir)
    assert [Path(p).name for p in state.all_model_checkpoint_paths] == on_disk(logdir)


@pytest.mark.asyncio
async def test_a_checkpoint_a_reader_holds_a_lease_on_is_not_swept(logdir: str, pair: Pair) -> None:
    sv = asv.Supervisor(
        logdir, checkpoint={"p": pair}, save_model_secs=0, save_model_steps=1, max_to_keep=1,
        save_summaries_secs=0, handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.run(pair.step)
        hold(Store(logdir), "evaluator", "model.ckpt-1", seconds=60)  # reading it, slowly
        for _ in range(3):
            await sess.run(pair.step)
    assert on_disk(logdir) == ["model.ckpt-1", "model.ckpt-4"]


@pytest.mark.asyncio
async def test_a_lease_written_just_after_the_sweep_read_leases_still_keeps_its_checkpoint(
    logdir: str, pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reader's protocol: write the lease, then check the history still commits the
    # checkpoint. Here it does both at the worst moment: after the sweep has read the
    # leases, before it writes the history without the checkpoint.
    from asupervisor._logdir import retention as _retention

    store, seen_listed = Store(logdir), []
    keeps = _retention.Retention.keeps

    def reader_comes_now(self: _retention.Retention, facts: _retention.Facts) -> set[int]:
        keep = keeps(self, facts)
        if not seen_listed and [c.name for c in facts.history.listed()][-1:] == ["model.ckpt-2"]:
            hold(store, "evaluator", "model.ckpt-1", seconds=60)  # ckpt-1 goes
            committed = read_history(store).committed()
            seen_listed.append(any(c.name == "model.ckpt-1" for c in committed))
        return keep

    monkeypatch.setattr(_retention.Retention, "keeps", reader_comes_now)
    sv = asv.Supervisor(
        logdir, checkpoint={"p": pair}, save_model_secs=0, save_model_steps=1, max_to_keep=1,
        save_summaries_secs=0, handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.run(pair.step)
        await sess.run(pair.step)  # its sweep lets model.ckpt-1 go as the reader comes
        assert seen_listed == [True]  # so the reader goes on to read it: it must stay
        assert "model.ckpt-1" in on_disk(logdir)
        listed = tf.train.get_checkpoint_state(logdir).all_model_checkpoint_paths
        assert [Path(p).name for p in listed] == ["model.ckpt-1", "model.ckpt-2"]
        let_go(store, "evaluator")
        await sess.run(pair.step)
    assert on_disk(logdir) == ["model.ckpt-3"]


KILLED_FIT = textwrap.dedent(
    """
    import sys
    import anyio, keras, numpy as np, tensorflow as tf
    import asupervisor as asv

    logdir = sys.argv[1]
    keras.utils.set_random_seed(int(sys.argv[2]))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype("float32")
    y = (x[:, :4].sum(1) > 0).astype("int64")
    noise = rng.normal(size=(256, 16)).astype("float32")
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    val = tf.data.Dataset.from_tensor_slices((noise, (noise[:, :4].sum(1) > 0).astype("int64")))
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(2)])
    model.build((None, 16))
    model.compile(optimizer=keras.optimizers.Adam(0.03),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Report(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print(f"epoch {epoch} val_loss {logs['val_loss']:.6f}", flush=True)

    async def main():
        sv = asv.Supervisor(logdir, checkpoint={"model": model, "opt": model.optimizer},
                            save_model_secs=0, save_model_steps=7, max_to_keep=1,
                            save_summaries_secs=0, keep_best=asv.KeepBest("val_loss"))
        async with sv.session() as sess:
            await sess.fit(model, train, epochs=12, validation_data=val.batch(64),
                           callbacks=[Report()], verbose=0)

    anyio.run(main)
    """
)


@pytest.mark.slow
def test_the_true_best_survives_a_sigkill_and_a_resume(tmp_path: Path) -> None:
    logdir = str(tmp_path / "run")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    args = [sys.executable, "-c", KILLED_FIT, logdir]
    first = forked.Popen([*args, "1"], stdout=subprocess.PIPE, text=True, env=env)
    assert first.stdout is not None
    seen: list[str] = []
    for line in first.stdout:
        seen.append(line)
        if line.startswith("epoch 5 "):
            first.kill()  # in the middle of epoch 6, after 6 epoch ends
            break
    first.wait(60)
    second = forked.run([*args, "2"], capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    seen += second.stdout.splitlines()
    vals = [float(v) for v in re.findall(r"val_loss ([\d.]+)", "".join(seen))]
    assert len(vals) >= 12  # both runs' epochs (an epoch cut by the kill runs again)
    history = read_history(Store(logdir))
    kept = {c.name: c.metrics.get("val_loss") for c in history.committed()}
    best = min(vals)
    assert any(v is not None and abs(v - best) < 1e-5 for v in kept.values()), (kept, best)
    name = min((n for n, v in kept.items() if v is not None), key=lambda n: kept[n] or 0)
    assert os.path.exists(os.path.join(logdir, name + ".index"))  # on disk, whole
    print("kept:", json.dumps(kept), "best val_loss:", best)


@pytest.mark.asyncio
async def test_checkpoints_kept_every_n_hours_stay_on_disk_unlisted_as_tf_keeps_them(
    logdir: str,
) -> None:
    """TF's CheckpointManager rule (its testSaveRestoreState): a checkpoint kept by
    keep_checkpoint_every_n_hours leaves the state file's list and stays on disk, so that
    a TF manager over the same directory never deletes it; the history still knows it."""
    from asupervisor._logdir.history import read_history

    every = 0.05 / 3600  # each checkpoint that leaves the newest two is kept this way
    for _ in range(2):  # across sessions too
        pair = Pair()
        sv = asv.Supervisor(
            logdir, checkpoint={"p": pair}, save_model_secs=0, save_model_steps=1,
            max_to_keep=2, keep_checkpoint_every_n_hours=every, save_summaries_secs=0,
            handle_signals=False,
        )  # fmt: skip
        async with sv.session() as sess:
            for _ in range(4):
                await sess.run(pair.step)
                time.sleep(0.06)  # longer than `every` between two commits
        newest = sorted(on_disk(logdir), key=lambda n: int(n.split("-")[1]))[-2:]
        state = tf.train.get_checkpoint_state(logdir)
        assert [Path(p).name for p in state.all_model_checkpoint_paths] == newest
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(), logdir, max_to_keep=2)
        assert [Path(p).name for p in manager.checkpoints] == newest
        history = read_history(Store(logdir))
        kept = {c.name: c.kept for c in history.committed()}
        assert set(kept) == set(on_disk(logdir))  # all on disk, all known
        assert [n for n, how in kept.items() if how == "listed"] == newest
        assert all(how == "preserved" for n, how in kept.items() if n not in newest)
        assert state.last_preserved_timestamp == max(
            c.time for c in history.committed() if c.kept == "preserved"
        )


# -- exports of each new best ---------------------------------------------------------


class Exports:
    """An ``export=`` that writes the pair's values into the directory it is given."""

    def __init__(self, pair: Pair, fail_at: float | None = None) -> None:
        self.pair, self.fail_at = pair, fail_at
        self.given: list[tuple[str, list[str]]] = []  # (path, what it held when given)

    def __call__(self, path: str) -> None:
        self.given.append((path, os.listdir(path)))
        with open(os.path.join(path, "values.json"), "w") as f:
            f.write(json.dumps([float(self.pair.a), float(self.pair.b)]))
        if float(self.pair.a) == self.fail_at:
            raise OSError("disk full")  # half an export written


def exports_of(logdir: str) -> dict[str, list[float]]:
    best = os.path.join(logdir, "best")
    return {
        name: json.loads(Path(best, name, "values.json").read_text())
        for name in sorted(os.listdir(best))
    }


@pytest.mark.asyncio
async def test_each_new_best_is_exported_and_the_exports_rotate_with_the_best(
    logdir: str, pair: Pair
) -> None:
    export = Exports(pair)
    sv = asv.Supervisor(
        logdir, checkpoint={"p": pair}, save_model_secs=0, max_to_keep=1, save_summaries_secs=0,
        keep_best=asv.KeepBest("val", mode="min", count=2, export=export), handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        for val in (5.0, 3.0, 4.0, 6.0, 2.0):
            await sess.run(pair.step)
            await sess.save_checkpoint(metrics={"val": val})
    # New bests at steps 1, 2 and 5; the two best (3.0 at 2, 2.0 at 5) keep theirs, each
    # the state its checkpoint holds.
    assert [len(listed) for _, listed in export.given] == [0, 0, 0]  # a new, empty directory
    assert exports_of(logdir) == {"2": [2.0, 2.0], "5": [5.0, 5.0]}
    assert on_disk(logdir) == ["model.ckpt-2", "model.ckpt-5"]


@pytest.mark.asyncio
async def test_an_export_that_fails_leaves_no_export_and_training_gets_its_error(
    logdir: str, pair: Pair
) -> None:
    sv = asv.Supervisor(
        logdir, checkpoint={"p": pair}, save_model_secs=0, save_summaries_secs=0,
        keep_best=asv.KeepBest("val", export=Exports(pair, fail_at=2.0)), handle_signals=False,
    )  # fmt: skip
    with pytest.raises(OSError, match="disk full"):
        async with sv.session() as sess:
            for val in (5.0, 3.0):
                await sess.run(pair.step)
                await sess.save_checkpoint(metrics={"val": val})
    assert os.listdir(os.path.join(logdir, "best")) == ["1"]  # whole, or not at all


@pytest.mark.asyncio
async def test_a_new_best_is_exported_as_a_keras_file_that_loads_back(logdir: str) -> None:
    import keras
    import numpy as np

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    sv = asv.Supervisor(
        logdir, checkpoint={"model": model}, save_model_secs=0, save_summaries_secs=0,
        keep_best=asv.KeepBest(
            "val", export=lambda path: model.save(os.path.join(path, "model.keras"))
        ),
        handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.run(lambda: model.layers[0].kernel.assign_add(tf.ones((2, 1))))
        await sess.save_checkpoint(metrics={"val": 1.0})
        saved = model.get_weights()
        await sess.run(lambda: model.layers[0].kernel.assign_add(tf.ones((2, 1))))
        await sess.save_checkpoint(metrics={"val": 2.0})  # not a new best: no export
    loaded = keras.models.load_model(os.path.join(logdir, "best", "1", "model.keras"))
    assert all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), saved, strict=True))
    assert os.listdir(os.path.join(logdir, "best")) == ["1"]


def test_keep_best_export_is_checked_early() -> None:
    with pytest.raises(ValueError, match="export"):
        asv.KeepBest("val", export="saved_model")  # type: ignore[arg-type]


def test_an_export_with_background_saves_is_refused_early(logdir: str, pair: Pair) -> None:
    with pytest.raises(ValueError, match="async_checkpoint"):
        asv.Supervisor(
            logdir, checkpoint={"p": pair}, async_checkpoint=True,
            keep_best=asv.KeepBest("val", export=lambda path: None),
        )  # fmt: skip


def test_an_export_on_an_object_store_is_refused_early(tmp_path: Path) -> None:
    """An object store has no rename of a directory: an export there could be read
    half-written."""
    with pytest.raises(ValueError, match=r"keep_best.*local"):
        asv.Supervisor(
            f"ram://{tmp_path.name}/run", checkpoint={"v": tf.Variable(0.0)},
            keep_best=asv.KeepBest("val", export=lambda path: None),
        )  # fmt: skip
