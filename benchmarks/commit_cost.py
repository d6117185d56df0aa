"""Whether a commit's cost grows with the run, and what a save costs against TensorFlow's.

    python benchmarks/commit_cost.py                        # 3,000 commits
    python benchmarks/commit_cost.py --commits 3000 30000   # and a run of 30,000
    python benchmarks/commit_cost.py --rounds 200           # the second table's rounds
    python benchmarks/commit_cost.py --commits 30000 --results commit_cost_30000

**Growth.** A supervised session over a one-variable model saves after every step
(``max_to_keep=3``, the session's other defaults); each commit is timed from outside,
as a user sees it: ``await sess.run(step)`` then ``await sess.save_checkpoint()``. The
table gives the median of the first 200 and of the last 200 commits and their ratio: a
commit whose cost does not depend on how many came before has a ratio near 1. On a shared
machine whose load drifts over the minutes of a run, each commit is followed by a
reference, ``tf.train.Checkpoint.write`` of the same variable and an fsync of its files
and the directory (whose cost does not grow), and the ratio is also given against the
reference's own over the same commits.

**Against TensorFlow.** A small Keras model (64-32-10 with Adam: 2,708 weights and the
optimizer's slots) is saved, in the same process, round by round in turn, by:

- ``tf write+fsync``: ``tf.train.Checkpoint.write`` and an fsync of its files and of the
  directory (what a save that survives a power cut needs; TF does not fsync), the
  fourth-newest deleted as ``max_to_keep=3`` would;
- ``asv save``: a supervised session's ``await sess.save_checkpoint()`` (a step between
  two saves, not timed), fsynced and committed (the history, the state file, the sweep).

The table gives the medians and the ratio of the supervisor's save to TensorFlow's.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import anyio
import keras
import tensorflow as tf
from _results import write

import asupervisor as asv

WINDOW = 200  # commits in each median
X = "\N{MULTIPLICATION SIGN}"


def supervisor(directory: str, checkpoint: Any) -> asv.Supervisor:
    return asv.Supervisor(
        directory,
        checkpoint=checkpoint,
        save_model_secs=0,
        max_to_keep=3,
        save_summaries_secs=0,
        handle_signals=False,
    )


async def growth(commits: int, root: str) -> dict[str, Any]:
    """Step + save, ``commits`` times, each timed; the first and last ``WINDOW``."""
    v = tf.Variable(0.0)

    @tf.function
    def step() -> tf.Tensor:
        return v.assign_add(1.0)

    times, reference = [], []
    directory = tempfile.mkdtemp(dir=root, prefix=f"growth-{commits}-")
    tf_dir = tempfile.mkdtemp(dir=root, prefix=f"growth-tf-{commits}-")
    tf_checkpoint = tf.train.Checkpoint(v=v)
    async with supervisor(directory, {"v": v}).session() as sess:
        for n in range(commits):
            started = time.perf_counter()
            await sess.run(step)
            await sess.save_checkpoint()
            times.append(time.perf_counter() - started)
            reference.append(tf_write(tf_checkpoint, tf_dir, n))
    first = statistics.median(times[:WINDOW]) * 1e3
    last = statistics.median(times[-WINDOW:]) * 1e3
    drift = statistics.median(reference[-WINDOW:]) / statistics.median(reference[:WINDOW])
    history = os.path.getsize(os.path.join(directory, ".asupervisor.history"))
    return {
        "commits": commits,
        f"first {WINDOW} ms": round(first, 2),
        f"last {WINDOW} ms": round(last, 2),
        "last / first": round(last / first, 2),
        "tf write+fsync, last / first": round(drift, 2),
        "last / first, against tf": round(last / first / drift, 2),
        "history KiB": round(history / 1024, 1),
    }


def small_model() -> tf.train.Checkpoint:
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
    )
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)  # the slots exist, as after a first step
    return tf.train.Checkpoint(model=model, optimizer=opt)


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tf_write(checkpoint: tf.train.Checkpoint, directory: str, n: int) -> float:
    started = time.perf_counter()
    prefix = checkpoint.write(os.path.join(directory, f"ckpt-{n}"))
    for path in glob.glob(prefix + ".*"):
        fsync(path)
    fsync(directory)
    seconds = time.perf_counter() - started
    for path in glob.glob(os.path.join(directory, f"ckpt-{n - 3}.*")):
        os.remove(path)
    return seconds


async def against_tf(rounds: int, root: str) -> list[dict[str, Any]]:
    checkpoint = small_model()
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step() -> tf.Tensor:
        return counter.assign_add(1)

    tf_dir = tempfile.mkdtemp(dir=root, prefix="tf-")
    asv_dir = tempfile.mkdtemp(dir=root, prefix="asv-")
    ours: list[float] = []
    theirs: list[float] = []
    async with supervisor(asv_dir, checkpoint).session() as sess:
        for n in range(rounds):
            await sess.run(step)  # a save with no step since writes nothing
            if n % 2:  # the order alternates: drift falls on both alike
                theirs.append(tf_write(checkpoint, tf_dir, n))
            started = time.perf_counter()
            await sess.save_checkpoint()
            ours.append(time.perf_counter() - started)
            if not n % 2:
                theirs.append(tf_write(checkpoint, tf_dir, n))
    tf_ms = statistics.median(theirs) * 1e3
    asv_ms = statistics.median(ours) * 1e3
    return [
        {"saver": "tf write+fsync", "ms": round(tf_ms, 2), f"{X} tf": 1.0},
        {"saver": "asv save", "ms": round(asv_ms, 2), f"{X} tf": round(asv_ms / tf_ms, 2)},
    ]


async def main(commits: Sequence[int], rounds: int, results: str) -> None:
    root = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"), prefix="commit-cost-")
    growth_rows = []
    for n in commits:
        if n < 2 * WINDOW:
            raise SystemExit(f"--commits: at least {2 * WINDOW} (two windows of {WINDOW})")
        row = await growth(n, root)
        growth_rows.append(row)
        print(
            f"{n:>7} commits: first {WINDOW} {row[f'first {WINDOW} ms']:.2f} ms, "
            f"last {WINDOW} {row[f'last {WINDOW} ms']:.2f} ms, "
            f"ratio {row['last / first']:.2f}; tf write+fsync's own "
            f"{row['tf write+fsync, last / first']:.2f}: against it "
            f"{row['last / first, against tf']:.2f} (history {row['history KiB']} KiB)",
            flush=True,
        )
    saves = await against_tf(rounds, root)
    for row in saves:
        print(f"{row['saver']:>15}: {row['ms']:.2f} ms ({row[f'{X} tf']:.2f}{X} tf)")
    write(results, growth_rows, against_tf=saves)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, nargs="+", default=[3000])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--results", default="commit_cost", help="benchmarks/results/NAME.json")
    args = parser.parse_args()
    anyio.run(main, args.commits, args.rounds, args.results)
