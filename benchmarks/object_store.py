"""What a logdir on gs:// costs against a local one, measured in one run, side by side.

    python benchmarks/object_store.py                   # 50 MB of variables, 3 rounds
    python benchmarks/object_store.py --megabytes 100 --rounds 5

gs:// is TensorFlow's own GCS client talking the real protocol to fake-gcs-server
through the TLS proxy of tests/gcs_fixture.py, all on 127.0.0.1: what it shows is the
protocol's cost (requests, uploads, server-side copies, TLS per request), not a real
bucket's latency or bandwidth, which only add to it. Each store gets the same work,
rounds interleaved, and medians are reported with gs:// as a ratio of local:

- save sync: a supervised session's save (``checkpoint.saved`` seconds);
- save async, held / written: ``async_checkpoint=True``, the time training is held
  (``blocked_seconds``) and the time until the files are committed (``seconds``);
- resume: ``session()`` entry to the first step, on a logdir holding one checkpoint
  (the lease or lock, the verification read, the restore);
- summary flush: one flush of the events file after every ``--points`` scalar points,
  first and last of ``--flushes``, as the file grows; and the bytes each store's
  client sent for the whole series (gs://: counted by the proxy);
- ``tf.summary.*`` inside steps on gs:// (points of 4 scalars) through TF's default
  writer, which flushes every 10 events, and through the writer the supervisor makes
  on an object store (``_summaries.writer_options``): the uploads, the bytes, the
  seconds.

The proxy counts gs://'s requests too: all, uploads, server-side copies (``rewriteTo``:
TF renames by copy and delete) and the bytes uploaded.

Two tiers (``asv.LocalTier``: the session saves to a directory of this host, a mirror
copies each save to the gs:// logdir behind the training), in the same rounds, against
gs:// alone (``save sync`` and ``resume`` above):

- local tier save, held / written: what a save holds the training (the snapshot) and
  until it is committed in the local tier;
- mirror: one copy into the logdir, and the lag from the local commit to the logdir's;
- resume on the same host: from the local tier;
- resume on a new host: the local tier's directory removed, from the logdir.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, MutableMapping
from functools import partial
from pathlib import Path
from typing import Any

from _results import write

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio
import structlog
import tensorflow as tf

import asupervisor as asv
from asupervisor._logdir.store import Store
from asupervisor._training.summaries import writer_options
from tests.gcs_fixture import FakeGcs

X = "\N{MULTIPLICATION SIGN}"


class Model(tf.Module):
    def __init__(self, megabytes: float) -> None:
        super().__init__()
        self.w = tf.Variable(tf.zeros([int(megabytes * 262144)]))
        self.steps = tf.Variable(0.0)

    def step(self) -> None:
        self.steps.assign_add(1.0)


def supervisor(logdir: str, model: Model, **kwargs: Any) -> asv.Supervisor:
    settings: dict[str, Any] = {
        "save_model_secs": 0,
        "save_model_steps": 1,
        "save_summaries_secs": 0,
        "max_to_keep": 2,
        "handle_signals": False,
    }
    return asv.Supervisor(logdir, checkpoint={"model": model}, **{**settings, **kwargs})


async def saves(logdir: str, megabytes: float, async_write: bool) -> list[MutableMapping[str, Any]]:
    """Two saves after the first (the session's own at its start): their events. Each
    is written before the next step, so that no save waits for the one before."""
    model = Model(megabytes)
    logging.getLogger("asupervisor").setLevel(logging.INFO)  # checkpoint.saved is read below
    with structlog.testing.capture_logs() as events:

        def saved() -> int:
            return sum(e["event"] == "checkpoint.saved" for e in events)

        sv = supervisor(logdir, model, async_checkpoint=async_write)
        async with sv.session() as sess:
            for expected in (2, 3):
                while saved() < expected - 1:
                    await anyio.sleep(0.01)
                await sess.run(model.step)
            while saved() < 3:
                await anyio.sleep(0.01)
    return [e for e in events if e["event"] == "checkpoint.saved"][1:3]


async def resume(
    logdir: str, megabytes: float, tier: str | None = None
) -> tuple[float, str | None]:
    """``session()`` entry to its body on a logdir holding a checkpoint; with ``tier``, a
    session with a local tier (under ``tier``) whose restore must come from ``expected``."""
    model = Model(megabytes)
    kwargs: dict[str, Any] = {"save_model_steps": 10**9}
    if tier is not None:
        kwargs["local_tier"] = asv.LocalTier(tier, save_secs=None, save_steps=10**9)
    started = time.perf_counter()
    async with supervisor(logdir, model, **kwargs).session() as sess:
        seconds = time.perf_counter() - started
        assert sess.restore_report.source == "checkpoint"
        where = getattr(sess.restore_report, "tier", None)
    return seconds, where


async def tier_saves(logdir: str, tier: str, megabytes: float) -> dict[str, list[float]]:
    """Two saves into the local tier after the session's first, each mirrored before the
    next step: what each held, how long until it was committed locally, the copy's
    seconds and the lag from the local commit to the logdir's (timed as seen here, within
    a few ms)."""
    model = Model(megabytes)
    logging.getLogger("asupervisor").setLevel(logging.INFO)
    local = asv.LocalTier(tier, save_secs=None, save_steps=1, keep=2)
    seen: dict[tuple[str, int], float] = {}
    with structlog.testing.capture_logs() as events:

        async def until(kind: str, step: int) -> None:
            deadline = time.monotonic() + 300
            while (kind, step) not in seen:
                for e in events:
                    key = (e["event"], e.get("step"))
                    if key not in seen and e["event"] in (
                        "checkpoint.saved",
                        "checkpoint.mirrored",
                    ):
                        seen[key] = time.perf_counter()  # type: ignore[index]
                assert time.monotonic() < deadline, f"no {kind} at step {step}"
                await anyio.sleep(0.002)

        async with supervisor(logdir, model, local_tier=local).session() as sess:
            for step in (0, 1, 2):
                await until("checkpoint.saved", step)
                await until("checkpoint.mirrored", step)
                if step < 2:
                    await sess.run(model.step)
    got: dict[str, list[float]] = {}
    for step in (1, 2):
        saved = next(e for e in events if e["event"] == "checkpoint.saved" and e["step"] == step)
        mirrored = next(
            e for e in events if e["event"] == "checkpoint.mirrored" and e["step"] == step
        )
        assert tier in saved["path"], saved  # the save went to the local tier
        got.setdefault("local tier save: held", []).append(saved["blocked_seconds"])
        got.setdefault("local tier save: written", []).append(saved["seconds"])
        got.setdefault("mirror: one copy", []).append(mirrored["seconds"])
        lag = seen[("checkpoint.mirrored", step)] - seen[("checkpoint.saved", step)]
        got.setdefault("mirror: lag (local commit to the logdir's)", []).append(lag)
    return got


def flushes(logdir: str, count: int, points: int) -> list[float]:
    """The time of each flush of an events file that grows by ``points`` scalars."""
    tf.io.gfile.makedirs(logdir)
    writer = tf.summary.create_file_writer(logdir, max_queue=10**6, flush_millis=10**9)
    seconds = []
    step = 0
    with writer.as_default():
        for _ in range(count):
            for _ in range(points):
                step += 1
                tf.summary.scalar("loss", 1.0 / step, step=step)
            started = time.perf_counter()
            writer.flush()
            seconds.append(time.perf_counter() - started)
    writer.close()
    return seconds


def points(logdir: str, count: int, tags: int, options: dict[str, int]) -> float:
    """``count`` summary points of ``tags`` scalars through a writer made with
    ``options``, closed at the end: the seconds the writes and the close took."""
    tf.io.gfile.makedirs(logdir)
    writer = tf.summary.create_file_writer(logdir, **options)
    started = time.perf_counter()
    with writer.as_default():
        for step in range(1, count + 1):
            for tag in range(tags):
                tf.summary.scalar(f"tag{tag}", 1.0 / step, step=step)
    writer.close()
    return time.perf_counter() - started


def counted(gcs: FakeGcs, fn: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """What ``fn`` returns, and the requests it made of the store, by kind."""
    before = len(gcs.requests_seen())
    result = fn()
    seen = gcs.requests_seen()[before:]
    sizes = [r.rsplit(" ", 1)[1] for r in seen if r.startswith(("PUT ", "POST /upload"))]
    uploaded = sum(int(size) for size in sizes if size.isdigit())
    return result, {
        "requests": len(seen),
        "uploads": sum(r.startswith("PUT ") for r in seen),
        "copies": sum("/rewriteTo/" in r for r in seen),
        "uploaded": uploaded,
    }


def row(name: str, local: float, gs: float, unit: str = "s") -> str:
    ratio = f"{gs / local:.1f}{X}" if local > 0 else "-"
    if unit == "s":
        return f"| {name} | {local:.3f} s | {gs:.3f} s | {ratio} |"
    return f"| {name} | {local / 1e6:.2f} MB | {gs / 1e6:.2f} MB | {ratio} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flushes", type=int, default=20)
    parser.add_argument("--points", type=int, default=500, help="scalar points per flush")
    parser.add_argument("--summary-points", type=int, default=200)
    args = parser.parse_args()
    local_root = tempfile.mkdtemp(prefix="object-store-bench-")
    results: dict[str, dict[str, list[float]]] = {"local": {}, "gs": {}}
    counts: dict[str, dict[str, int]] = {}
    summary_seconds: dict[str, float] = {}
    tiers: dict[str, list[float]] = {}
    gs_options = writer_options(Store("gs://bucket/run"))
    with FakeGcs() as gcs, structlog.testing.capture_logs():  # the sessions' log lines
        gcs.apply()
        for round_ in range(args.rounds):
            for store in ("local", "gs"):

                def where(name: str, store: str = store, round_: int = round_) -> str:
                    if store == "gs":
                        return gcs.new_path(name)
                    return os.path.join(local_root, f"{name}-{round_}")

                got = results[store]
                sync_dir = where("sync")
                events, count = counted(
                    gcs, partial(anyio.run, saves, sync_dir, args.megabytes, False)
                )
                got.setdefault("save sync", []).extend(e["seconds"] for e in events)
                if store == "gs":
                    counts["a session: start, 3 sync saves, close"] = count
                events = anyio.run(saves, where("async"), args.megabytes, True)
                got.setdefault("save async: held", []).extend(e["blocked_seconds"] for e in events)
                got.setdefault("save async: written", []).extend(e["seconds"] for e in events)
                (seconds, _), count = counted(
                    gcs, partial(anyio.run, resume, sync_dir, args.megabytes)
                )
                got.setdefault("resume", []).append(seconds)
                if store == "gs":
                    counts["a resume"] = count
                    two_tiers(gcs, args.megabytes, local_root, round_, tiers, counts)
                events_dir = where("events")
                seconds, count = counted(
                    gcs, partial(flushes, events_dir, args.flushes, args.points)
                )
                got.setdefault("summary flush: first", []).append(seconds[0])
                got.setdefault("summary flush: last", []).append(seconds[-1])
                got.setdefault("summary flush: all", []).append(sum(seconds))
                if store == "gs":
                    counts[f"{args.flushes} summary flushes"] = count
                    got.setdefault("uploaded by the flushes", []).append(count["uploaded"])
                else:
                    size = sum(
                        os.path.getsize(os.path.join(events_dir, n)) for n in os.listdir(events_dir)
                    )
                    got.setdefault("uploaded by the flushes", []).append(size)
        for name, options in (("TF's writer", {}), ("the object-store writer", gs_options)):
            seconds, count = counted(
                gcs, partial(points, gcs.new_path("points"), args.summary_points, 4, options)
            )
            counts[f"{args.summary_points} in-step points of 4 scalars, {name}"] = count
            summary_seconds[name] = seconds
    shutil.rmtree(local_root, ignore_errors=True)
    print(
        f"{args.megabytes:g} MB of variables, medians of {args.rounds} rounds "
        f"(saves: 2 a round); flushes: {args.flushes} of {args.points} points each\n"
    )
    print("| | local | gs:// | gs:// / local |\n|---|---|---|---|")
    table: list[dict[str, object]] = []
    for name in results["local"]:
        local = statistics.median(results["local"][name])
        gs = statistics.median(results["gs"][name])
        print(row(name, local, gs, "B" if name.startswith("uploaded") else "s"))
        unit = "bytes" if name.startswith("uploaded") else "s"
        table.append(
            {
                "measure": f"{name} ({unit})",
                "local": local,
                "gs://": gs,
                "gs:// / local": gs / local,
            }
        )
    print("\n| gs:// requests | requests | uploads | server-side copies | bytes uploaded |")
    print("|---|---|---|---|---|")
    for name, count in counts.items():
        print(
            f"| {name} | {count['requests']} | {count['uploads']} | {count['copies']} | "
            f"{count['uploaded'] / 1e6:.2f} MB |"
        )
    print()
    for name, seconds in summary_seconds.items():
        print(f"{args.summary_points} in-step points of 4 scalars, {name}: {seconds:.3f} s")
    for name, count in counts.items():
        table.append({"measure": f"gs:// requests: {name}", **count})
    for name, seconds in summary_seconds.items():
        table.append(
            {
                "measure": f"{args.summary_points} in-step points of 4 scalars, {name} (s)",
                "gs://": seconds,
            }
        )
    rows = tier_rows(tiers, results["gs"])
    print("\ntwo tiers (local tier on this host's disk, the logdir on gs://) against gs:// alone:")
    print("\n| | two tiers | gs:// alone | gs:// alone / two tiers |\n|---|---|---|---|")
    for entry in rows:
        alone = entry.get("gs:// alone (s)")
        print(
            f"| {entry['measure']} | {entry['two tiers (s)']:.3f} s | "
            + (f"{alone:.3f} s | {alone / entry['two tiers (s)']:.1f}{X} |" if alone else "| |")
        )
    write(
        "object_store",
        table,
        megabytes=args.megabytes,
        rounds=args.rounds,
        tables={"Two tiers (a local tier on the host's disk, the logdir on gs://) against "
                "gs:// alone, medians of the same rounds": rows},
    )  # fmt: skip


def two_tiers(
    gcs: FakeGcs,
    megabytes: float,
    root: str,
    round_: int,
    into: dict[str, list[float]],
    counts: dict[str, dict[str, int]],
) -> None:
    """One round of the two tiers: saves and their mirror, a resume on the same host, a
    resume on a new host (the local tier's directory removed)."""
    logdir, tier = gcs.new_path("tiers"), os.path.join(root, f"tier-{round_}")
    for name, values in anyio.run(tier_saves, logdir, tier, megabytes).items():
        into.setdefault(name, []).extend(values)
    (seconds, where), count = counted(gcs, lambda: anyio.run(resume, logdir, megabytes, tier))
    counts["a resume on the same host (local tier; start to close)"] = count
    assert where == "local", where
    into.setdefault("resume on the same host (local tier)", []).append(seconds)
    shutil.rmtree(tier)
    seconds, where = anyio.run(resume, logdir, megabytes, tier)
    assert where == "store", where
    into.setdefault("resume on a new host (the logdir)", []).append(seconds)


def tier_rows(tiers: dict[str, list[float]], gs: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The two tiers' medians, each beside what gs:// alone takes for the same."""
    alone = {
        "local tier save: held": "save sync",  # a sync save holds the training throughout
        "local tier save: written": "save sync",
        "resume on the same host (local tier)": "resume",
        "resume on a new host (the logdir)": "resume",
    }
    rows = []
    for name, values in tiers.items():
        entry: dict[str, Any] = {"measure": name, "two tiers (s)": statistics.median(values)}
        if name in alone:
            entry["gs:// alone (s)"] = statistics.median(gs[alone[name]])
            entry["gs:// alone / two tiers"] = entry["gs:// alone (s)"] / entry["two tiers (s)"]
        rows.append(entry)
    return rows


if __name__ == "__main__":
    main()
