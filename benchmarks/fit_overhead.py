"""Keras ``model.fit`` bare vs under ``sess.fit`` (checkpoints every 2 s, summaries every 1 s).

Both run the same compiled model over the same data in this process, interleaved,
for several rounds; the medians are printed, and the ratio of the two taken in each round
(the one to read on a machine whose speed drifts), with its median.

    python benchmarks/fit_overhead.py [--rounds 5] [--epochs 3] [--steps-per-execution 1 10]
        [--pipelines plain cached]

With ``--steps-per-execution K ...`` each K is measured (``compile(steps_per_execution=K)``,
the same for both), interleaved with the others, a pair of rows each. The pipelines: the
in-memory data batched (``plain``), and the same with an in-memory ``cache()``
(``cached``), whose whole content TF's state of the iterator holds: ``sess.fit`` saves that
state with every checkpoint, bare ``fit`` saves nothing. Each is timed around the ``fit``
call alone: the session's start and end (its final save) are outside the window.
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

SAMPLES = 32768  # 1,024 batches of 32 an epoch: 8.25 MiB of data, as much cached state
PIPELINES = ("plain", "cached")


def setup(tf: Any, keras: Any, per_call: int = 1, cached: bool = False) -> tuple[Any, Any]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=per_call,
    )
    x = tf.random.normal((SAMPLES, 64))
    y = tf.random.uniform((SAMPLES,), maxval=10, dtype=tf.int64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    return model, data.cache() if cached else data


async def supervised(
    tf: Any, keras: Any, epochs: int, per_call: int = 1, cached: bool = False
) -> float:
    import asupervisor as asv

    model, data = setup(tf, keras, per_call, cached)
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


def bare(tf: Any, keras: Any, epochs: int, per_call: int = 1, cached: bool = False) -> float:
    model, data = setup(tf, keras, per_call, cached)
    model.fit(data.take(2), epochs=1, verbose=0)
    started = time.perf_counter()
    model.fit(data, epochs=epochs, verbose=0)
    return epochs * int(data.cardinality()) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    # 1,024 batches an epoch: 3 epochs are seconds long, several saves and summaries.
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=int, nargs="+", default=[1])
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    args = parser.parse_args()
    import anyio
    import keras
    import tensorflow as tf

    cases = [(k, p) for k in args.steps_per_execution for p in args.pipelines]
    plain: dict[tuple[int, str], list[float]] = {c: [] for c in cases}
    managed: dict[tuple[int, str], list[float]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for k, pipeline in cases:
            cached = pipeline == "cached"

            def run_bare(k: int = k, cached: bool = cached) -> float:
                return bare(tf, keras, args.epochs, k, cached)

            def run_managed(k: int = k, cached: bool = cached) -> float:
                return anyio.run(supervised, tf, keras, args.epochs, k, cached)

            # Which goes first alternates: on a machine that slows down, neither always
            # gets the later slot.
            order = (run_bare, run_managed) if r % 2 == 0 else (run_managed, run_bare)
            rates = {run: run() for run in order}
            plain[k, pipeline].append(rates[run_bare])
            managed[k, pipeline].append(rates[run_managed])
    rows = []
    for case in cases:
        k, pipeline = case
        p, m = statistics.median(plain[case]), statistics.median(managed[case])
        per = f", steps_per_execution={k}" if args.steps_per_execution != [1] else ""
        per += ", cache()" if pipeline == "cached" else ""
        for name, rate, rounds in (
            ("model.fit bare", p, plain[case]),
            ("sess.fit supervised", m, managed[case]),
        ):
            shown = ", ".join(f"{r:.0f}" for r in rounds)
            print(f"{name + per:<56} {rate:8.1f} steps/s  ({shown})")
        paired = [b / a for b, a in zip(plain[case], managed[case], strict=True)]
        middle = statistics.median(paired)
        each = ", ".join(f"{r:.2f}" for r in paired)
        print(f"step time, supervised / bare, each round: {middle:.2f}x ({each})")
        rows += [
            {
                "system": f"model.fit bare{per}",
                "steps/s": p,
                "rounds": plain[case],
                "time per step": 1.0,
                "time per step, each round": "\u2014",
            },
            {
                "system": f"sess.fit supervised{per}",
                "steps/s": m,
                "rounds": managed[case],
                "time per step": p / m,
                "time per step, each round": f"**{middle:.2f}\u00d7** ({each})",
            },
        ]
    write("fit_overhead", rows)


if __name__ == "__main__":
    main()
