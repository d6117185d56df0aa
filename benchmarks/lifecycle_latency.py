"""How long a session takes to start and to stop.

    python benchmarks/lifecycle_latency.py
    python benchmarks/lifecycle_latency.py --megabytes 100 --trials 5

Start: from entering ``sv.session()`` to the first step, in a fresh logdir and
in one with a checkpoint to restore, beside a bare ``Checkpoint.restore`` of
the same checkpoint. TensorFlow is imported before timing starts.

Stop: a trainer subprocess gets SIGTERM mid-training; the time to its exit is
split, from the library's own events, into finishing the step in flight, the
final checkpoint, and the rest (services, closing files, interpreter exit); once
as the trainer ends by default, once with ``gc.freeze()`` after the session (as the
examples do: the interpreter's final garbage collection is most of its exit).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import anyio
import structlog
import tensorflow as tf
from _results import write

import asupervisor as asv


def make_state(megabytes: int) -> tf.Module:
    module = tf.Module()
    module.w = tf.Variable(tf.zeros([megabytes * 1024 * 1024 // 4]))
    return module


async def start_latency(megabytes: int, logdir: str) -> float:
    state = make_state(megabytes)
    sv = asv.Supervisor(
        logdir,
        checkpoint={"state": state},
        save_model_secs=3600,
        save_summaries_secs=0,
        handle_signals=False,
    )
    first: list[float] = []
    started = time.perf_counter()
    async with sv.session() as sess:
        await sess.run(lambda: first.append(time.perf_counter()))
    return first[0] - started


def bare_restore(megabytes: int, logdir: str) -> float:
    state = make_state(megabytes)
    checkpoint = tf.train.Checkpoint(state=state)
    path = tf.train.latest_checkpoint(logdir)
    started = time.perf_counter()
    checkpoint.restore(path).expect_partial()
    return time.perf_counter() - started


STOP_TRAINER = textwrap.dedent(
    """
    import logging, sys, time, anyio, structlog, tensorflow as tf
    import asupervisor as asv
    structlog.configure(processors=[structlog.processors.TimeStamper(fmt=None),
                                    structlog.processors.JSONRenderer()],
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    logging.getLogger("asupervisor").setLevel(logging.INFO)
    w = tf.Variable(tf.zeros([int(sys.argv[2]) * 262144]))

    @tf.function
    def step():
        w.assign_add(tf.ones_like(w))

    async def main():
        sv = asv.Supervisor(sys.argv[1], checkpoint={"w": w}, save_model_secs=3600,
                            save_summaries_secs=1, stop_grace_secs=30)
        async with sv.session() as sess:
            print("ready", flush=True)
            while not sess.should_stop():
                await sess.run(step)

    anyio.run(main)
    if sys.argv[3] == "freeze":
        import gc
        gc.freeze()
    """
)


def stop_latency(megabytes: int, ending: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as scratch:
        script = os.path.join(scratch, "trainer.py")
        with open(script, "w") as f:
            f.write(STOP_TRAINER)
        proc = subprocess.Popen(
            [sys.executable, script, os.path.join(scratch, "run"), str(megabytes), ending],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        _, errors = proc.communicate(timeout=120)
        exited = time.time()
    events: dict[str, list[Any]] = {}
    for line in errors.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            events.setdefault(event["event"], []).append(event)
    final = events["checkpoint.saved"][-1]
    save_started = final["timestamp"] - final["seconds"]
    stopped = events["session.stopped"][-1]["timestamp"]
    return {
        "total": exited - sent,
        "step": save_started - sent,
        "save": final["seconds"],
        "session": stopped - final["timestamp"],
        "exit": exited - stopped,
    }


async def main(megabytes: int, trials: int) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    print(
        f"TensorFlow {tf.__version__}, {os.cpu_count()} cores; {megabytes} MB of variables; "
        f"medians of {trials}"
    )
    fresh, restored, bare = [], [], []
    for _ in range(trials):
        with tempfile.TemporaryDirectory() as logdir:
            fresh.append(await start_latency(megabytes, logdir))
            restored.append(await start_latency(megabytes, logdir))
            bare.append(bare_restore(megabytes, logdir))
    print("| start | session() entry to the first step |")
    print("|---|---|")
    print(f"| fresh logdir (includes the first save) | {statistics.median(fresh):.3f} s |")
    print(f"| restore (verify every tensor, then restore) | {statistics.median(restored):.3f} s |")
    bare_s = statistics.median(bare)
    print(f"| bare `Checkpoint.restore` of the same checkpoint | {bare_s:.3f} s |")
    overhead = statistics.median(restored) - bare_s
    print(f"| overhead beyond the bare restore | {overhead:.3f} s |")
    rows: list[dict[str, object]] = [
        {
            "measure": "start: fresh logdir (includes the first save)",
            "seconds": statistics.median(fresh),
        },
        {
            "measure": "start: restore (verify every tensor, then restore)",
            "seconds": statistics.median(restored),
        },
        {"measure": "start: bare Checkpoint.restore of the same checkpoint", "seconds": bare_s},
        {"measure": "start: overhead beyond the bare restore", "seconds": overhead},
    ]
    stops: dict[str, list[dict[str, float]]] = {"default": [], "freeze": []}
    for _ in range(trials):
        for ending, runs in stops.items():
            runs.append(stop_latency(megabytes, ending))
    print()
    print("| stop: SIGTERM to process exit | seconds | with `gc.freeze()` before exit |")
    print("|---|---|---|")
    for part, label in (
        ("total", "total"),
        ("step", "finish the step in flight"),
        ("save", "final checkpoint"),
        ("session", "services, events file, training thread"),
        ("exit", "interpreter and TensorFlow shutdown"),
    ):
        default, frozen = (statistics.median(s[part] for s in stops[e]) for e in stops)
        print(f"| {label} | {default:.3f} | {frozen:.3f} |")
        rows.append({"measure": f"stop: {label}", "seconds": default, "with gc.freeze() s": frozen})
    write("lifecycle_latency", rows, megabytes=megabytes, trials=trials)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    anyio.run(main, args.megabytes, args.trials)
