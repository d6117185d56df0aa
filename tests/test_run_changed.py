"""A resume into a run that changed says what changed (``run.changed``): each checkpoint
records what the run is made of (its variables, its optimizers' hyperparameters, the
command line, the data pipeline), and a restore compares the commit's record with the
run as it is now. A hyperparameter the command changes is restored over by the
checkpoint's: said, with how to change one."""

from __future__ import annotations

import sys
from typing import Any

import pytest

import asupervisor as asv
from tests.conftest import named

# What a checkpoint records and a restore compares, not how the loop runs: one backend.
pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


async def session(logdir: str, learning_rate: float) -> Any:
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    sv = asv.Supervisor(
        logdir, checkpoint={"model": model, "opt": model.optimizer}, save_model_secs=0,
        save_model_steps=1, save_summaries_secs=0, handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.run(lambda: None)
    return model


async def test_a_learning_rate_changed_on_resume_is_said_and_the_restored_one_used(
    logdir: str, events: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.01"])
    await session(logdir, 0.01)
    await session(logdir, 0.01)  # the same run again: nothing changed
    assert not named(events, "run.changed")
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.5"])
    model = await session(logdir, 0.5)
    (changed,) = named(events, "run.changed")
    assert "optimizer opt.learning_rate: restored 0.01, the command gives 0.5" in changed["changed"]
    assert "command: train.py --lr 0.01 -> train.py --lr 0.5" in changed["changed"]
    assert "learning_rate.assign" in changed["hint"] and "new logdir" in changed["hint"]
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.01)


async def test_inspect_shows_where_the_run_was_changed(
    logdir: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from asupervisor.cli import main

    await session(logdir, 0.01)
    await session(logdir, 0.5)  # the step restored: 1 (a save each step)
    capsys.readouterr()
    assert main(["inspect", logdir]) == 0
    out = capsys.readouterr().out
    assert out.count("changed at") == 1
    text = " ".join(out[out.index("changed at") :].split())  # one change, wrapped to 100
    assert "(step 1): optimizer opt.learning_rate: restored 0.01, the command gives 0.5" in text


async def test_each_save_walks_the_objects_again_only_when_the_variables_changed(
    logdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record's walk over the checkpoint's objects costs milliseconds per hundred
    variables: done again only when the variables a save writes change (Adam's slots,
    made at its first step), and the record names them then."""
    import json

    import keras
    import tensorflow as tf

    from asupervisor._training import makeup

    walks: list[int] = []
    walk = makeup._walk
    monkeypatch.setattr(makeup, "_walk", lambda root: walks.append(1) or walk(root))
    model = keras.Sequential([keras.layers.Dense(1)])  # built at the first step
    optimizer = keras.optimizers.Adam(0.01)
    x, y = tf.ones((4, 2)), tf.ones((4, 1))

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    sv = asv.Supervisor(
        logdir, checkpoint={"model": model, "opt": optimizer}, save_model_secs=0,
        save_model_steps=1, save_summaries_secs=0, handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        for _ in range(2):
            await sess.run(step)
        after_two = len(walks)
        for _ in range(8):
            await sess.run(step)
        assert len(walks) == after_two  # eight saves more, the same variables: no walk
    path = tf.train.latest_checkpoint(logdir)
    assert path.endswith("-10")
    key = "supervised_state/json/.ATTRIBUTES/VARIABLE_VALUE"  # the kept states' variable
    assert key in dict(tf.train.list_variables(path))
    record = json.loads(tf.train.load_checkpoint(path).get_tensor(key))["run"]["makeup"]
    assert sorted(record["variables"].values()) == [[1], [2, 1]], record["variables"]
