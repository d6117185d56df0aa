"""Keras ``model.fit`` bare vs under ``sess.fit`` (checkpoints every 2 s, summaries every 1 s).

Both run the same compiled model over the same data in this process, interleaved,
for several rounds; the medians and their ratio are printed.

    python benchmarks/fit_overhead.py [--rounds 3] [--epochs 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from _results import write

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def setup(tf: Any, keras: Any) -> tuple[Any, Any]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = tf.random.normal((4096, 64))
    y = tf.random.uniform((4096,), maxval=10, dtype=tf.int64)
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(32).cache()


async def supervised(tf: Any, keras: Any, epochs: int) -> float:
    import asupervisor as asv

    model, data = setup(tf, keras)
    model.fit(data.take(2), epochs=1, verbose=0)  # trace, as the bare run does
    sv = asv.Supervisor(
        tempfile.mkdtemp(),
        checkpoint={"model": model, "optimizer": model.optimizer},
        global_step=model.optimizer.iterations,
        save_model_secs=2,
        save_summaries_secs=1,
        handle_signals=False,
    )
    async with sv.session() as sess:
        started = time.perf_counter()
        await sess.fit(model, data, epochs=epochs, verbose=0)
        seconds = time.perf_counter() - started
    return epochs * int(data.cardinality()) / seconds


def bare(tf: Any, keras: Any, epochs: int) -> float:
    model, data = setup(tf, keras)
    model.fit(data.take(2), epochs=1, verbose=0)
    started = time.perf_counter()
    model.fit(data, epochs=epochs, verbose=0)
    return epochs * int(data.cardinality()) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    import anyio
    import keras
    import tensorflow as tf

    plain, managed = [], []
    for _ in range(args.rounds):
        plain.append(bare(tf, keras, args.epochs))
        managed.append(anyio.run(supervised, tf, keras, args.epochs))
    p, m = statistics.median(plain), statistics.median(managed)
    print(f"model.fit bare      {p:8.1f} steps/s  (rounds: {', '.join(f'{r:.0f}' for r in plain)})")
    print(
        f"sess.fit supervised {m:8.1f} steps/s  (rounds: {', '.join(f'{r:.0f}' for r in managed)})"
    )
    print(f"step time, supervised / bare: {p / m:.2f}x")
    write(
        "fit_overhead",
        [
            {"system": "model.fit bare", "steps/s": p, "rounds": plain, "time per step": 1.0},
            {
                "system": "sess.fit supervised",
                "steps/s": m,
                "rounds": managed,
                "time per step": p / m,
            },
        ],
    )


if __name__ == "__main__":
    main()
