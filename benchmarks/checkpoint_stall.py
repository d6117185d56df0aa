"""How long training is held per checkpoint: synchronous saves vs async_checkpoint=True.

    python benchmarks/checkpoint_stall.py            # 100 MB and 1 GB of variables
    python benchmarks/checkpoint_stall.py --sizes-mb 10 100

For each state size it trains a model whose step updates a tenth of the state,
saves every few seconds (more than a write takes), and reports medians from the library's own
``checkpoint.saved`` events: ``seconds`` (the whole save) and
``blocked_seconds`` (how long the training thread was held). The disk's write
bandwidth (write + fsync of the same number of bytes) is measured in the same
run for scale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import anyio
import structlog
import tensorflow as tf

import asupervisor as asv


class Big(tf.Module):
    def __init__(self, megabytes: int, parts: int = 10) -> None:
        super().__init__()
        floats = megabytes * 1024 * 1024 // 4 // parts
        self.parts = [tf.Variable(tf.zeros([floats])) for _ in range(parts)]
        self.turn = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step(self) -> tf.Tensor:
        # One tenth of the state changes per step, round robin: every save
        # snapshot is soon shared with an update, the copy-on-write worst case.
        i = self.turn % len(self.parts)
        for k, part in enumerate(self.parts):
            if tf.equal(i, k):
                part.assign_add(tf.ones_like(part))
        self.turn.assign_add(1)
        return tf.constant(0.0)


def disk_bandwidth(directory: str, megabytes: int) -> float:
    """MB/s for writing and fsyncing ``megabytes`` in 8 MB blocks."""
    block = os.urandom(8 * 1024 * 1024)
    path = os.path.join(directory, "bandwidth.bin")
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, megabytes // 8)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    os.remove(path)
    return max(1, megabytes // 8) * 8 / seconds


async def measure(
    megabytes: int, async_checkpoint: bool, saves: int, gap: float
) -> dict[str, float]:
    """Train, and save every ``gap`` seconds: longer than a write takes, as in a real
    run that saves every few minutes, so no save waits for the one before."""
    big = Big(megabytes)
    big.step()  # trace outside the measurement
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as logdir:
        sv = asv.Supervisor(
            logdir,
            checkpoint={"big": big},
            save_model_secs=3600,
            max_to_keep=2,
            async_checkpoint=async_checkpoint,
            save_summaries_secs=0,
            handle_signals=False,
        )
        with structlog.testing.capture_logs() as events:
            async with sv.session() as sess:
                for _ in range(saves):
                    until = time.perf_counter() + gap
                    while time.perf_counter() < until:
                        await sess.run(big.step)
                    await sess.call(sess._save_checkpoint)  # a save at a step boundary
    saved = [e for e in events if e["event"] == "checkpoint.saved" and e["step"] > 0]
    return {
        "save": statistics.median(e["seconds"] for e in saved),
        "held": statistics.median(e["blocked_seconds"] for e in saved),
    }


async def main(sizes: list[int], saves: int) -> None:
    print(f"TensorFlow {tf.__version__}, {os.cpu_count()} cores; medians of {saves} saves per row")
    header = (
        f"{'state':>8} {'disk MB/s':>10} {'sync save s':>12} {'async held s':>13} "
        f"{'held/sync':>10} {'async write s':>14}"
    )
    print(header)
    print("-" * len(header))
    for megabytes in sizes:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as scratch:
            bandwidth = disk_bandwidth(scratch, megabytes)
        sync = await measure(megabytes, False, saves, gap=1.0)
        gap = max(1.0, 3 * sync["save"])
        background = await measure(megabytes, True, saves, gap=gap)
        print(
            f"{megabytes:>6}MB {bandwidth:>10.0f} {sync['save']:>12.3f} "
            f"{background['held']:>13.4f} {background['held'] / sync['save']:>9.1%} "
            f"{background['save']:>14.3f}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1024])
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    anyio.run(main, args.sizes_mb, args.saves)
