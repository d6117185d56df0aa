"""What lives outside the model is kept across restarts: Keras' callbacks under sess.fit,
hooks and services with state()/restore(), and Keras' random generators (Dropout)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import asupervisor as asv
from tests import forked

PLATEAU = textwrap.dedent(
    """
    import sys
    import anyio, keras, numpy as np, tensorflow as tf
    import asupervisor as asv

    logdir = sys.argv[1]
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(8)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")

    class Report(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            lr = float(self.model.optimizer.learning_rate.numpy())
            print(f"epoch {epoch} lr {lr:.6f}", flush=True)

    def callbacks():
        # Nothing beats 1e9 of improvement: both count every epoch, as known in advance.
        return [keras.callbacks.EarlyStopping("val_loss", min_delta=1e9, patience=4),
                keras.callbacks.ReduceLROnPlateau("val_loss", min_delta=1e9, patience=1,
                                                  factor=0.5, cooldown=1),
                Report()]

    async def main():
        sv = asv.Supervisor(logdir, checkpoint={"model": model, "opt": model.optimizer},
                            save_model_secs=0, save_model_steps=1, save_summaries_secs=0)
        async with sv.session() as sess:
            await sess.fit(model, data, epochs=20, validation_data=data, callbacks=callbacks(),
                           verbose=0)
        print(f"stopped after {sess.data_position}", flush=True)

    anyio.run(main)
    """
)


def epochs_of(text: str) -> list[tuple[int, float]]:
    return [(int(e), float(lr)) for e, lr in re.findall(r"epoch (\d+) lr ([\d.]+)", text)]


@pytest.mark.slow
def test_early_stopping_and_lr_on_plateau_keep_their_count_through_a_sigkill(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}

    def run(logdir: Path, kill_after: int | None = None) -> str:
        proc = forked.Popen(
            [sys.executable, "-c", PLATEAU, str(logdir)], stdout=subprocess.PIPE, text=True,
            env=env,
        )  # fmt: skip
        assert proc.stdout is not None
        out = []
        for line in proc.stdout:
            out.append(line)
            if kill_after is not None and line.startswith(f"epoch {kill_after} "):
                proc.kill()  # inside the patience window, mid-run
                break
        proc.wait(120)
        return "".join(out)

    reference = run(tmp_path / "whole")
    killed = run(tmp_path / "killed", kill_after=2)
    resumed = run(tmp_path / "killed")
    expected = epochs_of(reference)
    assert expected[-1][0] == 4 and "stopped after (5, 0)" in reference  # patience 4
    together = {**dict(epochs_of(killed)), **dict(epochs_of(resumed))}
    assert sorted(together.items()) == expected  # the same epochs, the same rates
    assert "stopped after (5, 0)" in resumed  # stopped at the same epoch


class CountingHook(asv.Hook):
    """A hook with state: the steps it has seen, across restarts."""

    def __init__(self) -> None:
        self.seen = 0

    def after_run(self, ctx: asv.RunContext, result: Any) -> None:
        self.seen += 1

    def state(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def restore(self, state: Any) -> None:
        self.seen = int(state["seen"])


class CountingService:
    name = "counting"

    def __init__(self) -> None:
        self.ticks = 0

    async def run(self, sess: asv.ManagedSession) -> None:
        self.ticks += 1
        await sess.sleep_until_stop(3600)

    def state(self) -> dict[str, Any]:
        return {"ticks": self.ticks}

    def restore(self, state: Any) -> None:
        self.ticks = int(state["ticks"])


@pytest.mark.asyncio
async def test_hooks_and_services_with_state_get_it_back_after_a_restart(logdir: str) -> None:
    for session in range(3):
        v, hook, service = tf.Variable(0.0), CountingHook(), CountingService()
        sv = asv.Supervisor(
            logdir, checkpoint={"v": v}, hooks=[hook], save_model_secs=0, save_summaries_secs=0,
            handle_signals=False,
        )  # fmt: skip
        sv.add_service(service)
        async with sv.session() as sess:
            for _ in range(4):
                await sess.run(v.assign_add, 1.0)
            await sess.save_checkpoint()
        assert hook.seen == 4 * (session + 1) and service.ticks == session + 1


def dropout_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dropout(0.5)])
    model.build((None, 16))
    return model


@pytest.mark.asyncio
async def test_a_resumed_run_with_dropout_draws_the_numbers_an_uninterrupted_one_draws(
    tmp_path: Path,
) -> None:
    ones = tf.ones((1, 16))

    async def masks(logdir: str, steps: int, crash: bool = False) -> list[list[float]]:
        model, drawn = dropout_model(), []
        sv = asv.Supervisor(
            logdir, checkpoint={"model": model}, save_model_secs=0, save_model_steps=3,
            save_summaries_secs=0, handle_signals=False,
        )  # fmt: skip
        try:
            async with sv.session() as sess:
                while sess.global_step < steps:
                    out = await sess.run(lambda: model(ones, training=True))
                    drawn.append(out.numpy().ravel().tolist())
                if crash:
                    raise RuntimeError("crash: no final save")
        except RuntimeError:
            pass
        return drawn

    whole = await masks(str(tmp_path / "whole"), 9)
    first = await masks(str(tmp_path / "cut"), 5, crash=True)  # the last save was at 3
    rest = await masks(str(tmp_path / "cut"), 9)
    assert first[:3] == whole[:3] and rest == whole[3:]
    assert len({tuple(m) for m in whole}) > 1  # the masks do differ step to step
    assert np.array(whole).shape == (9, 16)
