"""Keras ``model.fit`` bare vs under ``sess.fit`` (checkpoints every 2 s, summaries every 1 s).

Both run the same compiled model over the same data in this process, interleaved,
for several rounds; the medians and their ratio are printed.

    python benchmarks/fit_overhead.py [--rounds 3] [--epochs 4] [--steps-per-execution 1 10]

With ``--steps-per-execution K ...`` each K is measured (``compile(steps_per_execution=K)``,
the same for both), interleaved with the others, a pair of rows each.
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


def setup(tf: Any, keras: Any, per_call: int = 1) -> tuple[Any, Any]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=per_call,
    )
    x = tf.random.normal((4096, 64))
    y = tf.random.uniform((4096,), maxval=10, dtype=tf.int64)
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(32).cache()


async def supervised(tf: Any, keras: Any, epochs: int, per_call: int = 1) -> float:
    import asupervisor as asv

    model, data = setup(tf, keras, per_call)
    model.fit(data.take(2), epochs=1, verbose=0)  # trace, as the bare run does
    # and over the session's stream (its iterator is of another type: a trace of its own,
    # once per process, that the bare run does not pay either)
    warm = asv.Supervisor(tempfile.mkdtemp(), checkpoint={"model": model}, handle_signals=False)
    async with warm.session() as sess:
        await sess.fit(model, data.take(2), epochs=1, verbose=0)
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


def bare(tf: Any, keras: Any, epochs: int, per_call: int = 1) -> float:
    model, data = setup(tf, keras, per_call)
    model.fit(data.take(2), epochs=1, verbose=0)
    started = time.perf_counter()
    model.fit(data, epochs=epochs, verbose=0)
    return epochs * int(data.cardinality()) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-execution", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    import anyio
    import keras
    import tensorflow as tf

    ks = args.steps_per_execution
    plain: dict[int, list[float]] = {k: [] for k in ks}
    managed: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(args.rounds):
        for k in ks:
            plain[k].append(bare(tf, keras, args.epochs, k))
            managed[k].append(anyio.run(supervised, tf, keras, args.epochs, k))
    rows = []
    for k in ks:
        p, m = statistics.median(plain[k]), statistics.median(managed[k])
        per = "" if ks == [1] else f", steps_per_execution={k}"
        for name, rate, rounds in (
            ("model.fit bare", p, plain[k]),
            ("sess.fit supervised", m, managed[k]),
        ):
            shown = ", ".join(f"{r:.0f}" for r in rounds)
            print(f"{name + per:<44} {rate:8.1f} steps/s  ({shown})")
        print(f"step time, supervised / bare: {p / m:.2f}x")
        rows += [
            {
                "system": f"model.fit bare{per}",
                "steps/s": p,
                "rounds": plain[k],
                "time per step": 1.0,
            },
            {
                "system": f"sess.fit supervised{per}",
                "steps/s": m,
                "rounds": managed[k],
                "time per step": p / m,
            },
        ]
    write("fit_overhead", rows)


if __name__ == "__main__":
    main()
