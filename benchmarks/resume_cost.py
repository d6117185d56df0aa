"""Resuming inside an epoch: session entry to the first step, by the batch resumed at.

    python benchmarks/resume_cost.py [--positions 0 300 1200] [--repeats 3]

The data is an input pipeline with a costly ``map`` (a few matrix products per example,
about 10 ms a batch of 32 here), read by ``sess.train(step, data, epochs=1)``. For each
position, a checkpoint at that batch of the epoch is made first; then, each in a fresh
process (TensorFlow imported before the clock starts), the time from entering the session
(or creating the iterator) to the end of the first step:

- ``asupervisor``: ``sv.session()`` restores the checkpoint, the iterator's state with it,
  and ``sess.train`` reads on;
- ``bare restore``: ``tf.train.Checkpoint(iterator=iter(data)).read(path)`` and ``next``,
  TensorFlow's own iterator checkpoint, nothing else;
- ``Dataset.skip``: ``iter(data.skip(batch))`` and ``next``, what a resume that keeps only
  the position (asupervisor's fallback, where no state can be saved) pays.

The ratios: each position against batch 0 for asupervisor (constant time: near 1), and
skip against asupervisor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _results import write

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = 60_000
BATCH = 32

PIPELINE = textwrap.dedent(
    f"""
    import os, sys, time
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import anyio, tensorflow as tf
    import asupervisor as asv

    def costly(i):
        x = tf.random.stateless_normal([64, 64], seed=tf.stack([i, tf.constant(0, tf.int64)]))
        for _ in range(8):
            x = tf.tanh(tf.matmul(x, x) / 8.0)
        return tf.reduce_sum(x, 1), i

    def data(epoch=0):
        return (tf.data.Dataset.range({EXAMPLES}).map(costly, num_parallel_calls=4)
                .batch({BATCH}).prefetch(2))

    total = tf.Variable(0.0)

    @tf.function
    def step(x, i):
        total.assign_add(tf.reduce_mean(x))
        return {{"loss": total}}

    def supervisor(logdir):
        return asv.Supervisor(logdir, checkpoint={{"total": total}}, save_model_secs=0,
                              save_model_steps=10**9, save_summaries_secs=0,
                              handle_signals=False)
    """
)

PREPARE = PIPELINE + textwrap.dedent(
    """
    kind, path, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])

    async def supervised():
        async with supervisor(path).session() as sess:
            if batch:
                await sess.train(step, data, epochs=1, max_steps=batch)

    if kind == "asupervisor":
        anyio.run(supervised)  # the final checkpoint: at the batch
    else:
        iterator = iter(data())
        for _ in range(batch):
            next(iterator)
        tf.train.Checkpoint(iterator=iterator).write(path)
    """
)

MEASURE = PIPELINE + textwrap.dedent(
    """
    kind, path, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    step(*next(iter(data().take(1))))  # traced, and the map's function too: not measured
    first = []

    async def supervised():
        started = time.perf_counter()
        async with supervisor(path).session() as sess:
            def first_step(x, i):
                out = step(x, i)
                first.append(time.perf_counter() - started)
                return out
            await sess.train(first_step, data, epochs=1, max_steps=1)

    started = time.perf_counter()
    if kind == "asupervisor":
        anyio.run(supervised)
        seconds = first[0]
    elif kind == "bare restore":
        iterator = iter(data())
        tf.train.Checkpoint(iterator=iterator).read(path).assert_consumed()
        step(*next(iterator))
        seconds = time.perf_counter() - started
    else:
        step(*next(iter(data().skip(batch))))
        seconds = time.perf_counter() - started
    print("seconds", seconds, flush=True)
    """
)

KINDS = ("asupervisor", "bare restore", "Dataset.skip")


def child(code: str, *args: str) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{args}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done.stdout


def state_bytes(logdir: str) -> int:
    """The size of the iterator's state in the checkpoint at ``logdir``."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(logdir))
    return len(reader.get_tensor("data_iterator/state/.ATTRIBUTES/VARIABLE_VALUE"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[0, 300, 1200])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="asv-resume-cost-"))
    paths: dict[tuple[str, int], str] = {}
    for batch in args.positions:
        for kind in KINDS[:2]:
            path = str(work / f"{kind.replace(' ', '-')}-{batch}")
            target = path if kind == "asupervisor" else path + "/ckpt"
            child(PREPARE, kind, target, str(batch))
            paths[kind, batch] = target
        paths["Dataset.skip", batch] = ""
    seconds: dict[tuple[str, int], list[float]] = {key: [] for key in paths}
    for _ in range(args.repeats):  # interleaved: the machine's drift falls on all alike
        for batch in args.positions:
            for kind in KINDS:
                path = paths[kind, batch]
                if kind == "asupervisor":  # a copy: the measured session saves at its end
                    path = str(work / "measured")
                    shutil.rmtree(path, ignore_errors=True)
                    shutil.copytree(paths[kind, batch], path)
                out = child(MEASURE, kind, path, str(batch))
                seconds[kind, batch].append(float(out.split("seconds")[-1]))
    median = {key: statistics.median(values) for key, values in seconds.items()}
    at_zero = median["asupervisor", args.positions[0]]
    rows = []
    print("| batch | asupervisor s | bare restore s | Dataset.skip s | asupervisor vs batch "
          f"{args.positions[0]} | skip vs asupervisor | iterator state KB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for batch in args.positions:
        ours, bare, skip = (median[kind, batch] for kind in KINDS)
        kilobytes = state_bytes(paths["asupervisor", batch]) / 1024
        row = {
            "batch": batch,
            "asupervisor s": round(ours, 3),
            "bare restore s": round(bare, 3),
            "Dataset.skip s": round(skip, 3),
            f"asupervisor vs batch {args.positions[0]}": round(ours / at_zero, 2),
            "skip vs asupervisor": round(skip / ours, 1),
            "iterator state KB": round(kilobytes, 1),
        }
        rows.append(row)
        print("| " + " | ".join(str(v) for v in row.values()) + " |", flush=True)
    write("resume_cost", rows, repeats=args.repeats, examples_per_batch=BATCH)


if __name__ == "__main__":
    main()
