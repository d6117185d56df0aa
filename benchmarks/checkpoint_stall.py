"""What a checkpoint costs training: synchronous saves vs async_checkpoint=True.

    python benchmarks/checkpoint_stall.py                 # 10 MB, 100 MB and 1 GB of variables
    python benchmarks/checkpoint_stall.py --sizes-mb 100

For each state size a model trains whose step updates a tenth of the state
(every snapshot is soon shared with an update: copy-on-write's worst case).
Saves are spaced wider than a write takes, as in a real run. Reported, as
medians over the saves:

- held: how long the training thread was held (``blocked_seconds`` of the
  library's ``checkpoint.saved`` event): the whole save when synchronous;
- lost: the training time one checkpoint cost: held, plus (async) the extra
  time of the steps that ran while the write was in flight, against the step
  time with no write in flight;
- steps/s during the background write, against steps/s without one;
- peak RSS above the RSS before the save (``VmHWM`` reset per save);
- the physical limits, measured in the same run: the disk's write bandwidth
  (write + fsync) and the memory copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import anyio
import numpy as np
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
        i = self.turn % len(self.parts)
        for k, part in enumerate(self.parts):
            if tf.equal(i, k):
                part.assign_add(tf.ones_like(part))
        self.turn.assign_add(1)
        return tf.constant(0.0)


def disk_bandwidth(directory: str, megabytes: int) -> float:
    """MB/s writing and fsyncing ``megabytes`` in 8 MB blocks."""
    block = os.urandom(8 * 1024 * 1024)
    path = os.path.join(directory, "bandwidth.bin")
    blocks = max(1, megabytes // 8)
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(blocks):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    os.remove(path)
    return blocks * 8 / seconds


def copy_bandwidth(megabytes: int) -> float:
    """MB/s copying ``megabytes`` in memory (the floor of any snapshot that copies)."""
    source = np.ones(megabytes * 1024 * 1024 // 8)
    target = np.empty_like(source)
    np.copyto(target, source)
    started = time.perf_counter()
    np.copyto(target, source)
    return megabytes / (time.perf_counter() - started)


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


async def measure(megabytes: int, async_checkpoint: bool, saves: int) -> dict[str, float]:
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
        lost, rates_during, peaks, base_rates = [], [], [], []
        with structlog.testing.capture_logs() as events:
            async with sv.session() as sess:
                ckpt = sess._checkpointer
                assert ckpt is not None
                ckpt.wait_for_write()  # the session's first save
                for _ in range(saves):
                    base = await step_times(sess, big, seconds=1.0)
                    base_step = statistics.median(base)
                    base_rates.append(1 / base_step)
                    rss_before = rss_mb("VmRSS")
                    reset_peak_rss()
                    started = time.perf_counter()
                    await sess.call(sess._save_checkpoint)
                    held = time.perf_counter() - started
                    during: list[float] = []
                    while ckpt._writer is not None and ckpt._writer.is_alive():
                        during += await step_times(sess, big, steps=1)
                    ckpt.wait_for_write()
                    peaks.append(rss_mb("VmHWM") - rss_before)
                    extra = sum(during) - len(during) * base_step
                    lost.append(held + max(0.0, extra))
                    if during:
                        rates_during.append(len(during) / sum(during))
    saved = [e for e in events if e["event"] == "checkpoint.saved" and e["step"] > 0]
    return {
        "save": statistics.median(e["seconds"] for e in saved),
        "held": statistics.median(e["blocked_seconds"] for e in saved),
        "lost": statistics.median(lost),
        "rate": statistics.median(base_rates),
        "rate_during": statistics.median(rates_during) if rates_during else float("nan"),
        "peak": statistics.median(peaks),
    }


async def step_times(
    sess: asv.ManagedSession, big: Big, seconds: float = 0.0, steps: int = 0
) -> list[float]:
    times: list[float] = []
    until = time.perf_counter() + seconds
    while len(times) < steps or time.perf_counter() < until:
        started = time.perf_counter()
        await sess.run(big.step)
        times.append(time.perf_counter() - started)
    return times


async def main(sizes: list[int], saves: int) -> None:
    print(f"TensorFlow {tf.__version__}, {os.cpu_count()} cores; medians of {saves} saves per row")
    header = (
        "| state | mode | disk MB/s | copy MB/s | save s | held s | held/sync save | "
        "lost s | lost/sync save | steps/s | steps/s writing | peak RSS +MB | save MB/s / disk |"
    )
    print(header)
    print("|" + "|".join("---" for _ in header.split("|")[1:-1]) + "|")
    for megabytes in sizes:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as scratch:
            disk = disk_bandwidth(scratch, megabytes)
        copy = copy_bandwidth(megabytes)
        sync = await measure(megabytes, False, saves)
        for mode, r in (("sync", sync), ("async", await measure(megabytes, True, saves))):
            print(
                f"| {megabytes} MB | {mode} | {disk:.0f} | {copy:.0f} | {r['save']:.3f} | "
                f"{r['held']:.4f} | {r['held'] / sync['save']:.1%} | {r['lost']:.3f} | "
                f"{r['lost'] / sync['save']:.0%} | {r['rate']:.1f} | {r['rate_during']:.1f} | "
                f"{r['peak']:.0f} | {megabytes / r['save'] / disk:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100, 1024])
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    anyio.run(main, args.sizes_mb, args.saves)
