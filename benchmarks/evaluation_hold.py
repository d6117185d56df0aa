"""How much training time evaluation holds: in-process (the README's rule) vs the sidecar.

One trainer process trains a 784-512-512-10 MLP (``sess.train``, a checkpoint every
``--every`` seconds) for ``--seconds`` per part, in this order:

- no evaluation (the baseline, again between the kinds and at the end);
- in-process: ``sess.loop(every, evaluate)``, where ``evaluate`` runs ``eval_fn`` on the
  training thread with ``sess.call`` (what the README's rule says);
- sidecar: the same training, and ``asupervisor evaluate`` in a process of its own on
  the same logdir (this file is its ``--script``), evaluating each checkpoint.

``eval_fn`` takes ``--eval-secs``, of one of two kinds: ``wait`` sleeps (an evaluation
bound by something else: a remote service, an accelerator, I/O) and ``compute`` runs the
model over an evaluation set sized to take that long on this machine (it competes for
the cores with training wherever it runs). The held fraction is 1 - steps/s with
evaluation / steps/s of the baselines on either side.

    python benchmarks/evaluation_hold.py [--seconds 20] [--eval-secs 1] [--every 2]
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
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

EVAL_BATCH = 1024


def build(tf: Any, keras: Any) -> tuple[Any, Any]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    return model, keras.optimizers.Adam(1e-3)


def make_eval_fn(tf: Any, model: Any, kind: str, seconds: float, batches: int) -> Any:
    """``eval_fn`` of the given kind: a sleep, or ``batches`` forward passes."""
    x = tf.random.normal((EVAL_BATCH, 784), seed=1)
    y = tf.random.uniform((EVAL_BATCH,), maxval=10, dtype=tf.int64, seed=2)

    @tf.function
    def accuracy() -> Any:
        right = tf.constant(0, tf.int64)
        for _ in tf.range(batches):
            right += tf.reduce_sum(tf.cast(tf.argmax(model(x), -1) == y, tf.int64))
        return tf.cast(right, tf.float32) / float(batches * EVAL_BATCH)

    def eval_fn() -> dict[str, Any]:
        if kind == "wait":
            time.sleep(seconds)
            return {"waited": seconds}
        return {"accuracy": accuracy()}

    return eval_fn


def make_evaluator() -> tuple[Any, Any]:
    """The sidecar's factory (``asupervisor evaluate --script`` this file)."""
    import keras
    import tensorflow as tf

    model, _ = build(tf, keras)
    eval_fn = make_eval_fn(
        tf,
        model,
        os.environ["ASV_BENCH_KIND"],
        float(os.environ["ASV_BENCH_EVAL_SECS"]),
        int(os.environ["ASV_BENCH_BATCHES"]),
    )
    eval_fn()  # traced before the trainer starts its clock
    Path(os.environ["ASV_BENCH_READY"]).write_text("ready")
    return {"model": model}, eval_fn


def calibrate(tf: Any, keras: Any, seconds: float) -> int:
    """Forward passes of one evaluation batch that take ``seconds`` here, idle."""
    model, _ = build(tf, keras)
    one = make_eval_fn(tf, model, "compute", 0, 1)
    one()
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < 1.0:
        one()
        n += 1
    return max(1, round(seconds / ((time.perf_counter() - started) / n)))


async def train(args: argparse.Namespace, mode: str, kind: str, batches: int) -> dict[str, Any]:
    """One part: ``seconds`` of training; steps/s and the evaluations done meanwhile."""
    import anyio
    import keras
    import tensorflow as tf

    import asupervisor as asv

    model, opt = build(tf, keras)
    data = (
        tf.data.Dataset.from_tensor_slices(
            (tf.random.normal((8192, 784)), tf.random.uniform((8192,), maxval=10, dtype=tf.int64))
        )
        .batch(128)
        .repeat()
        .prefetch(2)
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_weights)
        opt.apply_gradients(zip(grads, model.trainable_weights, strict=True))
        return loss

    logdir = tempfile.mkdtemp(prefix=f"evaluation_hold_{mode}_")
    sidecar, evaluated = None, [0]
    if mode == "sidecar":
        sidecar = start_sidecar(args, logdir, kind, batches)
    eval_fn = make_eval_fn(tf, model, kind, args.eval_secs, batches)
    if mode == "in-process":
        eval_fn()  # traced before the clock starts, as the sidecar's is

    sv = asv.Supervisor(
        logdir,
        checkpoint={"model": model, "optimizer": opt},
        global_step=opt.iterations,
        save_model_secs=args.every,
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        await sess.train(step, data, max_steps=20)  # traced
        if mode == "in-process":

            async def evaluate() -> None:
                await sess.call(eval_fn)  # on the training thread: training waits
                evaluated[0] += 1

            sess.loop(args.every, evaluate)
        started, steps = time.perf_counter(), 0
        while time.perf_counter() - started < args.seconds:
            steps += await sess.train(step, data, max_steps=50)
        rate = steps / (time.perf_counter() - started)
        sess.request_stop()
    if sidecar is not None:
        await anyio.to_thread.run_sync(stop_sidecar, sidecar)
        results = Path(logdir) / "eval" / ".asupervisor.evaluated"
        evaluated[0] = len(json.loads(results.read_text())) if results.exists() else 0
    return {"mode": mode, "kind": kind, "rate": rate, "evaluated": evaluated[0]}


def start_sidecar(args: argparse.Namespace, logdir: str, kind: str, batches: int) -> Any:
    ready = Path(logdir).parent / f"{Path(logdir).name}.ready"
    env = {
        **os.environ,
        "ASV_BENCH_KIND": kind,
        "ASV_BENCH_EVAL_SECS": str(args.eval_secs),
        "ASV_BENCH_BATCHES": str(batches),
        "ASV_BENCH_READY": str(ready),
    }
    command = [sys.executable, "-m", "asupervisor", "evaluate", logdir, "--script", __file__]
    proc = subprocess.Popen([*command, "--poll-secs", "0.2"], env=env, stderr=subprocess.DEVNULL)
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the sidecar exited with {proc.returncode} before it was ready")
        time.sleep(0.1)
    time.sleep(1.0)  # its start-up's last work settles before the trainer's clock
    return proc


def stop_sidecar(proc: Any) -> None:
    proc.send_signal(signal.SIGTERM)  # after the evaluation in flight
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="training per part")
    parser.add_argument("--eval-secs", type=float, default=1.0, help="one evaluation")
    parser.add_argument("--every", type=float, default=2.0, help="evaluations and checkpoints")
    parser.add_argument("--kinds", default="wait,compute", help="wait, compute or both")
    args = parser.parse_args()
    import anyio
    import keras
    import tensorflow as tf

    batches = calibrate(tf, keras, args.eval_secs)
    kinds = args.kinds.split(",")
    parts: list[tuple[str, str]] = [("none", "-")]
    for kind in kinds:
        parts += [("in-process", kind), ("sidecar", kind), ("none", "-")]
    rows = []
    for mode, kind in parts:
        row = anyio.run(train, args, mode, kind, batches)
        rows.append(row)
        print(f"  {mode:<10} {kind:<8} {row['rate']:7.1f} steps/s", file=sys.stderr)

    print(
        f"\ntraining {args.seconds:.0f} s per part; an evaluation of {args.eval_secs:.1f} s "
        f"every {args.every:.1f} s (compute: {batches} batches of {EVAL_BATCH})\n"
    )
    print("| evaluation | kind | steps/s | baseline steps/s | training held | evaluations |")
    print("|---|---|---|---|---|---|")
    table: list[dict[str, object]] = []
    for i, row in enumerate(rows):
        if row["mode"] == "none":
            continue
        before = next(r for r in reversed(rows[:i]) if r["mode"] == "none")
        after = next(r for r in rows[i:] if r["mode"] == "none")
        base = statistics.mean([before["rate"], after["rate"]])
        held = 1 - row["rate"] / base
        print(
            f"| {row['mode']} | {row['kind']} | {row['rate']:.1f} | {base:.1f} "
            f"| **{held:.0%}** | {row['evaluated']} |"
        )
        table.append(
            {
                "evaluation": row["mode"],
                "kind": row["kind"],
                "steps/s": row["rate"],
                "baseline steps/s": base,
                "training held": held,
                "evaluations": row["evaluated"],
            }
        )
    baselines = [r["rate"] for r in rows if r["mode"] == "none"]
    print(f"\nbaselines (no evaluation): {', '.join(f'{r:.1f}' for r in baselines)} steps/s")
    from _results import write  # here: this file is also the evaluator's --script

    write("evaluation_hold", table, seconds_per_part=args.seconds, eval_secs=args.eval_secs)


if __name__ == "__main__":
    main()
