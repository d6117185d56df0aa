"""What a checkpoint costs training, against the disk's floor and TensorFlow's own savers.

    python benchmarks/checkpoint_stall.py                 # 10 MB, 100 MB and 1 GB of variables
    python benchmarks/checkpoint_stall.py --sizes-mb 100 --saves 5

For each state size one model trains whose step updates a tenth of the state in
place (every snapshot is soon shared with an update: copy-on-write's worst case), and
every saver below checkpoints it in the same process, saves interleaved round by
round so that the machine's drift falls on all of them alike:

- ``floor``: the same bytes written by plain Python into one file and fsynced;
- ``tf sync``: ``tf.train.CheckpointManager.save`` (TF does not fsync);
- ``tf async``: the same with ``CheckpointOptions(enable_async=True)`` (no fsync);
- ``asv sync`` / ``asv async``: a supervised session's ``save_checkpoint()``,
  fsynced, without and with ``async_checkpoint=True``.

Each save is followed by a window of steps longer than any write, and a window
without a save measures the steps' own time. Reported, as medians over the saves:

- write s: the save's wall time until its files are on disk (async: the
  ``checkpoint.saved`` event's ``seconds``), and its ratio to the floor;
- held s: how long the training thread was held (async: the snapshot);
- lost s: the training time one checkpoint cost: held, plus the extra time of
  the steps in the window against the same steps with no save;
- peak +MB: what the saves add to the run's peak RSS (``VmHWM``), measured for each
  saver in a process of its own (an allocator reuses memory other savers freed):
  the peak after steps with saves minus the peak after as many without; once with
  TensorFlow's default CPU allocator, which on x86 is oneDNN's pool and keeps all it
  ever held, and once with allocators that give freed memory back
  (``TF_ENABLE_ONEDNN_OPTS=0 MALLOC_MMAP_THRESHOLD_=1048576``), which shows what the
  saver itself holds at its peak.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from _results import write as write_results

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import anyio
import structlog
import tensorflow as tf

import asupervisor as asv

X = "\N{MULTIPLICATION SIGN}"


class Big(tf.Module):
    """``megabytes`` of variables in ``parts``; each step updates one part in place.

    The update is sparse (one element), so a step allocates nothing: the run's memory
    is the state's, and a part whose buffer a snapshot shares is copied whole before
    the update (copy-on-write's worst case: within ``parts`` steps, all of it).
    """

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
                part.scatter_nd_add([[0]], [1.0])
        self.turn.assign_add(1)
        return tf.constant(0.0)


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def floor_write(big: Big, directory: str) -> float:
    """Seconds to write the state's bytes into one file with plain Python and fsync it."""
    arrays = [p.numpy() for p in big.parts]
    path = os.path.join(directory, "floor.bin")
    started = time.perf_counter()
    with open(path, "wb") as f:
        for array in arrays:
            f.write(memoryview(array).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    os.remove(path)
    return seconds


class Saver:
    """One way of checkpointing ``big``: ``save()`` returns when training may go on;
    ``written()`` is the seconds from the save's start until its files were complete
    (``None`` while it is still being written), ``held()`` how long the save held the
    training thread (asked once the files are complete)."""

    name = ""

    def __init__(self, big: Big, directory: str) -> None:
        self.big, self.directory = big, directory

    async def step(self) -> None:
        self.big.step()

    async def save(self) -> None:
        raise NotImplementedError

    def written(self) -> float | None:
        raise NotImplementedError

    def held(self) -> float:
        raise NotImplementedError


class TFSaver(Saver):
    def __init__(self, big: Big, directory: str, async_write: bool) -> None:
        super().__init__(big, directory)
        self.name = "tf async" if async_write else "tf sync"
        self.checkpoint = tf.train.Checkpoint(big=big)
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=2)
        self.options = tf.train.CheckpointOptions(enable_async=async_write)
        self.async_write = async_write
        self.started = 0.0
        self.hold = 0.0
        self.done: float | None = None

    async def save(self) -> None:
        self.started = time.perf_counter()
        self.done = None
        self.manager.save(options=self.options)
        self.hold = time.perf_counter() - self.started
        if not self.async_write:
            self.done = self.hold

    def held(self) -> float:
        return self.hold

    def written(self) -> float | None:
        if self.done is None:
            # TF's writer thread marks each save done on its queue (no public probe);
            # polled between steps, so this is late by at most one step.
            if self.checkpoint._async_checkpointer()._queue.unfinished_tasks == 0:
                self.done = time.perf_counter() - self.started
        return self.done


class AsvSaver(Saver):
    """A supervised session; steps and saves go through it as a user's do, and the
    times come from its ``checkpoint.saved`` events."""

    def __init__(self, big: Big, directory: str, async_write: bool, events: list[Any]) -> None:
        super().__init__(big, directory)
        self.name = "asv async" if async_write else "asv sync"
        self.supervisor = asv.Supervisor(
            directory,
            checkpoint={"big": big},
            save_model_secs=3600,
            max_to_keep=2,
            async_checkpoint=async_write,
            save_summaries_secs=0,
            handle_signals=False,
        )
        self.events = events
        self.seen = 0
        self.sess: asv.ManagedSession | None = None

    def _saved(self) -> list[dict[str, Any]]:
        saved = [e for e in self.events[self.seen :] if e["event"] == "checkpoint.saved"]
        return [e for e in saved if e["path"].startswith(self.directory)]

    async def step(self) -> None:
        assert self.sess is not None
        await self.sess.run(self.big.step)

    async def save(self) -> None:
        assert self.sess is not None
        self.seen = len(self.events)
        await self.sess.save_checkpoint()

    def held(self) -> float:
        """The training thread's own figure, without the round trip to it."""
        return float(self._saved()[0]["blocked_seconds"])

    def written(self) -> float | None:
        saved = self._saved()
        return float(saved[0]["seconds"]) if saved else None


async def window(saver: Saver, seconds: float, save: bool) -> tuple[float, list[float]]:
    """Steps for ``seconds`` (and on, until a save made at its start is on disk):
    the save's hold and each step's time."""
    if save:
        await saver.save()
    times: list[float] = []
    until = time.perf_counter() + seconds
    while True:
        on_disk = not save or saver.written() is not None  # polled every step
        if on_disk and time.perf_counter() >= until:
            break
        if time.perf_counter() > until + 600:
            raise RuntimeError(f"{saver.name}: the save was not on disk after 10 minutes")
        started = time.perf_counter()
        await saver.step()
        times.append(time.perf_counter() - started)
    return (saver.held() if save else 0.0), times


def lost_time(held: float, times: list[float], base: list[float]) -> float:
    """Held, plus what the window's steps took beyond as many unhindered steps."""
    return held + max(0.0, sum(times) - len(times) * statistics.median(base))


SAVERS = ("tf sync", "tf async", "asv sync", "asv async")


@contextlib.asynccontextmanager
async def savers(big: Big, root: str, names: Sequence[str]) -> AsyncIterator[list[Saver]]:
    """The savers named, each over its own directory; the supervised ones in a session."""
    made: list[Saver] = []
    logging.getLogger("asupervisor").setLevel(logging.INFO)  # checkpoint.saved is read below
    with structlog.testing.capture_logs() as events:
        async with contextlib.AsyncExitStack() as stack:
            for name in names:
                directory = os.path.join(root, name.replace(" ", "-"))
                if name.startswith("tf"):
                    made.append(TFSaver(big, directory, async_write=name == "tf async"))
                else:
                    saver = AsvSaver(big, directory, name == "asv async", events)
                    saver.sess = await stack.enter_async_context(saver.supervisor.session())
                    made.append(saver)
            yield made


# Allocators that give freed memory back: plain malloc instead of oneDNN's pool, and
# mmap for every large buffer (glibc otherwise raises that threshold as buffers are freed).
RETURNING = {"TF_ENABLE_ONEDNN_OPTS": "0", "MALLOC_MMAP_THRESHOLD_": str(1024 * 1024)}


def peak_rss(
    megabytes: int, name: str, saves: int, seconds: float, env: dict[str, str] | None = None
) -> float:
    """MB that ``name``'s saves add to the peak RSS of a run, measured in a process of its
    own (an allocator reuses what other savers freed): the process's high-water mark
    after steps with saves, minus the mark after as many steps before any saver."""
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--peak-of",
            name,
            "--sizes-mb",
            str(megabytes),
            "--saves",
            str(saves),
            "--window",
            str(seconds),
        ],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    ).stdout
    return float(out.split()[-1])


async def peak_run(megabytes: int, name: str, saves: int, seconds: float) -> None:
    big = Big(megabytes)
    big.step()
    root = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    until = time.perf_counter() + saves * seconds
    while time.perf_counter() < until:  # before any saver exists (a session saves at start)
        big.step()
    before = rss_mb("VmHWM")
    async with savers(big, root, [name]) as (saver,):
        for _ in range(saves):
            await saver.step()  # a save needs a step since the last one (the session's first)
            await window(saver, seconds, save=True)
        print(f"peak {rss_mb('VmHWM') - before:.1f}")
    shutil.rmtree(root, ignore_errors=True)


async def run_size(megabytes: int, saves: int, seconds: float) -> list[dict[str, object]]:
    big = Big(megabytes)
    big.step()  # trace outside the measurement
    root = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    floors: list[float] = []
    rows: dict[str, dict[str, list[float]]] = {
        n: {"write": [], "held": [], "lost": []} for n in SAVERS
    }
    async with savers(big, root, SAVERS) as made:
        for _ in range(saves):
            floors.append(floor_write(big, root))
            for saver in made:
                _, base = await window(saver, seconds, save=False)
                held, times = await window(saver, seconds, save=True)
                row = rows[saver.name]
                row["write"].append(saver.written() or float("nan"))
                row["held"].append(held)
                row["lost"].append(lost_time(held, times, base))
    shutil.rmtree(root, ignore_errors=True)
    del big
    floor = statistics.median(floors)
    sync_write = statistics.median(rows["asv sync"]["write"])
    print(f"| {megabytes} MB | plain write + fsync | {floor:.3f} | 1.00{X} | | | | | |")
    table: list[dict[str, object]] = [
        {
            "state MB": megabytes,
            "saver": "plain write + fsync",
            "write s": floor,
            "write / floor": 1.0,
        }
    ]
    for name, row in rows.items():
        write, lost = statistics.median(row["write"]), statistics.median(row["lost"])
        peak = await anyio.to_thread.run_sync(peak_rss, megabytes, name, 3, seconds)
        freed = await anyio.to_thread.run_sync(peak_rss, megabytes, name, 3, seconds, RETURNING)
        print(
            f"| {megabytes} MB | {name} | {write:.3f} | {write / floor:.2f}{X} | "
            f"{statistics.median(row['held']):.4f} | {lost:.3f} | {lost / sync_write:.0%} | "
            f"{peak:+.0f} ({peak / megabytes:.0%}) | {freed:+.0f} ({freed / megabytes:.0%}) |",
            flush=True,
        )
        table.append(
            {
                "state MB": megabytes,
                "saver": name,
                "write s": write,
                "write / floor": write / floor,
                "held s": statistics.median(row["held"]),
                "lost s": lost,
                "lost / asv sync": lost / sync_write,
                "peak RSS +MB": peak,
                "peak RSS +MB, freed memory returned": freed,
            }
        )
    return table


async def main(sizes: list[int], saves: int, seconds: float) -> None:
    print(
        f"TensorFlow {tf.__version__}, {os.cpu_count()} cores; medians of {saves} saves per "
        "row; lost/asv sync: the training time lost against the supervisor's synchronous save"
    )
    header = (
        "| state | saver | write s | write / floor | held s | lost s | lost / asv sync | "
        "peak RSS +MB (of state) | the same, freed memory returned |"
    )
    print(header)
    print("|" + "|".join("---" for _ in header.split("|")[1:-1]) + "|")
    table = []
    for megabytes in sizes:
        table += await run_size(megabytes, saves, seconds)
    write_results("checkpoint_stall", table, saves=saves)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100, 1024])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument(
        "--window", type=float, default=2.0, help="seconds of steps after each save (at least)"
    )
    parser.add_argument("--peak-of", choices=SAVERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_of:
        anyio.run(peak_run, args.sizes_mb[0], args.peak_of, args.saves, args.window)
    else:
        anyio.run(main, args.sizes_mb, args.saves, args.window)
