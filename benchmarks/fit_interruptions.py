"""Steps lost when `fit` is interrupted: `sess.fit` vs Keras' `BackupAndRestore`.

The same model and data (the digits MLP of examples/fit.py, 47 batches an epoch) train
in a child process; the child is sent SIGKILL or SIGTERM at a moment after the first epoch,
then started again. "Lost" is the last batch the killed run finished minus the batch the
next run starts from. Both save every 20 batches: `sess.fit` with `save_model_steps=20`
(and a final checkpoint on SIGTERM), `BackupAndRestore` with `save_freq=20` (Keras 3 has
no save-before-preemption).

    python benchmarks/fit_interruptions.py [--trials 3]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from _results import write

EVERY = 20  # batches between saves, for both


def child(mode: str, directory: str) -> None:
    """Train until killed; print the global step at the start and after every batch."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int64")
    data = tf.data.Dataset.from_tensor_slices((x[:1500], y[:1500])).shuffle(1500, seed=0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    class Steps(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            print(f"starting at step {int(model.optimizer.iterations.numpy())}", flush=True)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            print(f"done {int(model.optimizer.iterations.numpy())}", flush=True)

    if mode == "keras":
        backup = keras.callbacks.BackupAndRestore(directory, save_freq=EVERY)
        model.fit(data.batch(32), epochs=1000, callbacks=[backup, Steps()], verbose=0)
        return
    import anyio

    import asupervisor as asv

    sv = asv.Supervisor(
        directory,
        checkpoint={"model": model, "optimizer": model.optimizer},
        global_step=model.optimizer.iterations,
        save_model_secs=0,
        save_model_steps=EVERY,
        save_summaries_secs=1,
    )

    async def supervised() -> None:
        async with sv.session() as sess:
            await sess.fit(model, data.batch(32), epochs=1000, callbacks=[Steps()], verbose=0)

    anyio.run(supervised)


def trial(mode: str, sig: int, wait: float) -> int:
    """One interruption: the steps lost."""
    command = [sys.executable, __file__, "--child", mode, tempfile.mkdtemp()]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stdout is not None
    done, started = 0, None
    for line in proc.stdout:
        if line.startswith("done "):
            done = int(line.split()[1])
            if started is None:
                started = time.monotonic()
            elif done > 47 and time.monotonic() - started > wait:
                proc.send_signal(sig)
                break
    for line in proc.stdout:  # what finished before the signal took effect
        if line.startswith("done "):
            done = int(line.split()[1])
    proc.wait(120)
    again = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    assert again.stdout is not None
    resumed = None
    for line in again.stdout:
        if "starting at" in line and "step " in line:
            resumed = int(line.split("step ")[1].split()[0].rstrip(",)"))
            break
    again.kill()
    again.wait(60)
    assert resumed is not None, "the second run did not say where it started"
    return done - resumed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    rng = random.Random(0)
    rows = []
    print("| system | signal | steps lost (per trial) | max |")
    print("|---|---|---|---|")
    for sig in (signal.SIGKILL, signal.SIGTERM):
        for mode, name in (
            ("asv", "asupervisor `sess.fit`"),
            ("keras", "Keras `BackupAndRestore`"),
        ):
            lost = [trial(mode, sig, rng.uniform(2.0, 6.0)) for _ in range(args.trials)]
            print(
                f"| {name} | {signal.Signals(sig).name} | {', '.join(map(str, lost))} | "
                f"{max(lost)} |",
                flush=True,
            )
            rows.append(
                {
                    "system": name,
                    "signal": signal.Signals(sig).name,
                    "steps lost": lost,
                    "max": max(lost),
                }
            )
    write("fit_interruptions", rows, trials=args.trials)


if __name__ == "__main__":
    main()
