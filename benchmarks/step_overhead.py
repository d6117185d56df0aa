"""What a supervised step costs: a plain TensorFlow loop vs sess.run vs sess.train.

    python benchmarks/step_overhead.py               # tiny, medium and large models
    python benchmarks/step_overhead.py --rounds 9
    python benchmarks/step_overhead.py --health-only # only the second table

A second table is what a save adds to find out whether the state it commits is
healthy: one finite check over every floating-point variable the checkpoint saves
(``SavedRoot.finite``, on the training thread), against the checkpoint's write itself
and against one step (``benchmarks/results/health_check.json``).

All three run in the same process, on the same batches, interleaved (the order
rotates every round) and the table shows medians over rounds of the time per
step, and each one's ratio to the plain loop. The supervisor runs with its
defaults: its own global step advanced after every step, the checkpoint,
summary and step-counter services alive beside the loop. Each model runs twice:
with the supervisor's own global step, and with ``global_step=optimizer.iterations``
(the user's step advances it; the supervisor reads it back only when asked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import anyio
import keras
import structlog
import tensorflow as tf
from _results import write

import asupervisor as asv

# name: (inputs, hidden layers, outputs, batch)
MODELS = {
    "tiny 64-32-10, batch 32": (64, [32], 10, 32),
    "medium 784-512-512-10, batch 128": (784, [512, 512], 10, 128),
    "large 512-1024-1024-10, batch 256": (512, [1024, 1024], 10, 256),
}


def build(inputs: int, hidden: list[int], outputs: int, batch: int) -> tuple[Any, Any, list[Any]]:
    layers = [keras.Input((inputs,))] + [keras.layers.Dense(h, activation="relu") for h in hidden]
    model = keras.Sequential([*layers, keras.layers.Dense(outputs)])
    opt = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    batches = [
        (
            tf.random.normal((batch, inputs), seed=i),
            tf.random.uniform((batch,), 0, outputs, tf.int64, seed=i),
        )
        for i in range(16)
    ]
    step(*batches[0])  # trace outside the measurement
    return (model, opt), step, batches


async def per_step(run: Callable[[int], Awaitable[None]], steps: int) -> float:
    started = time.perf_counter()
    await run(steps)
    return (time.perf_counter() - started) / steps


async def compare(
    name: str, shape: tuple[Any, ...], rounds: int, seconds: float, owned: bool
) -> dict[str, float]:
    (model, opt), step, batches = build(*shape)
    # Steps per measurement: about `seconds` of the plain loop.
    started = time.perf_counter()
    for x, y in batches * 4:
        step(x, y)
    steps = max(20, int(seconds / ((time.perf_counter() - started) / (len(batches) * 4))))
    data = [batches[i % len(batches)] for i in range(steps)]

    async def plain(n: int) -> None:
        for x, y in data:
            step(x, y)

    with tempfile.TemporaryDirectory() as logdir:
        sv = asv.Supervisor(
            logdir,
            checkpoint={"model": model, "opt": opt},
            global_step=None if owned else opt.iterations,
            handle_signals=False,
        )
        async with sv.session() as sess:

            async def run(n: int) -> None:
                for x, y in data:
                    await sess.run(step, x, y)

            async def train(n: int) -> None:
                await sess.train(step, data)

            methods = {"plain": plain, "run": run, "train": train}
            times: dict[str, list[float]] = {m: [] for m in methods}
            order = list(methods)
            for r in range(rounds):
                for m in order[r % 3 :] + order[: r % 3]:
                    times[m].append(await per_step(methods[m], steps))
    return {m: statistics.median(t) for m, t in times.items()}


def health_check(name: str, shape: tuple[Any, ...], rounds: int) -> dict[str, Any]:
    """The finite check at a save vs the save's write and one step, medians of ``rounds``."""
    from asupervisor._checkpointing.root import SavedRoot
    from asupervisor._training.kept_state import KeptState
    from asupervisor._training.position import Position

    (model, opt), step, batches = build(*shape)
    step(*batches[1])  # the optimizer's slots exist: the state a save writes
    root = SavedRoot(
        tf.train.Checkpoint(model=model, opt=opt),
        tf.Variable(0, dtype=tf.int64),
        Position(),
        KeptState(),
    )
    root.finite()  # traced once, as at a session's first save
    checks, writes, steps = [], [], []
    with tempfile.TemporaryDirectory() as logdir:
        for r in range(rounds):
            started = time.perf_counter()
            assert root.finite()
            checks.append(time.perf_counter() - started)
            started = time.perf_counter()
            root.checkpoint.write(os.path.join(logdir, f"ckpt-{r}"))
            writes.append(time.perf_counter() - started)
            started = time.perf_counter()
            float(step(*batches[r % len(batches)]))
            steps.append(time.perf_counter() - started)
    variables = root.float_variables()
    check, write_, one = (statistics.median(t) for t in (checks, writes, steps))
    return {
        "model": name,
        "float variables": len(variables),
        "values": int(sum(v.shape.num_elements() for v in variables)),
        "finite check ms": check * 1e3,
        "save write ms": write_ * 1e3,
        "check / write": check / write_,
        "one step ms": one * 1e3,
        "check / step": check / one,
    }


def health_table(rounds: int) -> None:
    print("\nThe health check at a save (medians of", rounds, "rounds):")
    header = (
        f"| {'model':<36} | {'values':>9} | {'check ms':>8} | {'write ms':>8} | "
        f"{'check/write':>11} | {'step ms':>7} | {'check/step':>10} |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    rows = []
    for name, shape in MODELS.items():
        row = health_check(name, shape, rounds)
        print(
            f"| {name:<36} | {row['values']:>9} | {row['finite check ms']:>8.3f} | "
            f"{row['save write ms']:>8.3f} | {row['check / write']:>10.3f}x | "
            f"{row['one step ms']:>7.3f} | {row['check / step']:>9.3f}x |",
            flush=True,
        )
        rows.append(row)
    write("health_check", rows)


async def main(rounds: int, seconds: float) -> None:
    print(
        f"TensorFlow {tf.__version__}, {os.cpu_count()} cores; "
        f"medians of {rounds} interleaved rounds"
    )
    header = (
        f"| {'model':<36} | {'global step':<20} | {'plain ms':>8} | {'sess.run ms':>11} | "
        f"{'run/plain':>9} | {'sess.train ms':>13} | {'train/plain':>11} |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    rows = [(name, shape, owned) for name, shape in MODELS.items() for owned in (True, False)]
    results = []
    for name, shape, owned in rows:
        t = await compare(name, shape, rounds, seconds, owned)
        kind = "supervisor's own" if owned else "optimizer.iterations"
        print(
            f"| {name:<36} | {kind:<20} | {t['plain'] * 1e3:>8.3f} | {t['run'] * 1e3:>11.3f} | "
            f"{t['run'] / t['plain']:>8.3f}x | {t['train'] * 1e3:>13.3f} | "
            f"{t['train'] / t['plain']:>10.3f}x |",
            flush=True,
        )
        results.append(
            {
                "model": name,
                "global step": kind,
                "plain ms": t["plain"] * 1e3,
                "sess.run ms": t["run"] * 1e3,
                "run / plain": t["run"] / t["plain"],
                "sess.train ms": t["train"] * 1e3,
                "train / plain": t["train"] / t["plain"],
            }
        )
    write("step_overhead", results)
    health_table(rounds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument(
        "--seconds",
        type=float,
        default=0.25,
        help="length of one measurement: short, so that the machine's drift falls on all alike",
    )
    parser.add_argument(
        "--health-only", action="store_true", help="only the health check at a save"
    )
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings only
    if args.health_only:
        health_table(args.rounds)
    else:
        anyio.run(main, args.rounds, args.seconds)
