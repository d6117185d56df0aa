"""asupervisor against what a user would pick instead, with the services a real run has on.

    python benchmarks/peers.py                  # tiny and medium models, 3 rounds
    python benchmarks/peers.py --rounds 5 --models tiny
    python benchmarks/peers.py --models tiny medium --systems bare bare_k asv_train_k

Every system trains the same model on the same in-memory batches, each in its own
process (a fresh TensorFlow, no shared caches), in interleaved rounds (the order
rotates each round); the table gives the median steps per second over rounds and
ratios of time per step: against the bare TF2 loop, and against the system's own
bare loop (Keras' bare `fit` for the Keras rows, a plain graph-mode session loop
for MonitoredTrainingSession), from the medians over rounds. The last column is the
steady one on a machine whose speed drifts: each process also runs the system's own
bare loop (a model of its own) for half the steps just before and just after the
system, the ratio is taken inside the process, and the median over rounds is given.
"Services on" means what a real run has: a checkpoint every 2 s, summaries every
1 s and a step-rate counter; for Keras' callbacks, whose schedules count batches,
the same periods turned into batches from the run's own warm-up rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _results import write

SAVE_SECS, SUMMARY_SECS = 2.0, 1.0
# name: (inputs, hidden, outputs, batch, timed steps, timed steps of the K-step rows).
# The K-step rows of the tiny model time ten times the steps: at five thousand steps a
# second, 6,000 steps last about a second, where one save (every SAVE_SECS) more or less,
# or a call's set-up (a new iterator), weighs as much as the difference measured; a long
# run pays those at their rate in time, as the longer window does. The medium model's
# steps last long enough as they are.
MODELS = {
    "tiny": (64, [32], 10, 32, 6000, 60000),
    "medium": (784, [512, 512], 10, 128, 1500, 1500),
}
TIMES = "\u00d7"
WARMUP = 200  # steps before the clock starts: tracing, first saves' set-up
K = 100  # steps per call of the many-steps-per-call rows

# system: (label, its own bare loop)
SYSTEMS = {
    "bare": ("bare TF2 `tf.function` loop", "bare"),
    "manual": ("hand-written loop: `CheckpointManager` + `tf.summary`", "bare"),
    "manual_fsync": ("the same with fsync (durable like asupervisor)", "bare"),
    "asv_train": ("asupervisor `sess.train`, its own global step", "bare"),
    "asv_train_iterations": (
        "asupervisor `sess.train`, `global_step=optimizer.iterations`",
        "bare",
    ),
    "asv_train_off": ("asupervisor `sess.train`, no saves and no summaries", "bare"),
    "asv_run": ("asupervisor `sess.run`", "bare"),
    "bare_hop": (
        "bare TF2 loop, each step handed to a thread (`anyio.to_thread.run_sync`)",
        "bare",
    ),
    "bare_k": (f"bare TF2 loop, {K} steps per `tf.function` call", "bare_k"),
    "asv_train_k": (f"asupervisor `sess.train`, `steps_per_loop={K}`", "bare_k"),
    "asv_train_k_off": (
        f"asupervisor `sess.train`, `steps_per_loop={K}`, no saves and no summaries",
        "bare_k",
    ),
    "asv_train_k_async": (
        f"asupervisor `sess.train`, `steps_per_loop={K}`, `async_checkpoint=True`",
        "bare_k",
    ),
    "keras_fit": ("bare Keras `fit`", "keras_fit"),
    "asv_fit": ("asupervisor `sess.fit`", "keras_fit"),
    "keras_fit_k": (f"Keras `fit`, `steps_per_execution={K}`", "bare_k"),
    "asv_fit_k": (f"asupervisor `sess.fit`, `steps_per_execution={K}`", "keras_fit_k"),
    "keras_backup_tb": ("Keras `fit` + `BackupAndRestore` + `TensorBoard`", "keras_fit"),
    "keras_ckpt_tb_backup": (
        "Keras `fit` + `ModelCheckpoint` + `TensorBoard` + `BackupAndRestore`",
        "keras_fit",
    ),
    "tf1_bare": ("bare TF1 graph-mode `Session` loop", "tf1_bare"),
    "mts": ("TF1 `MonitoredTrainingSession` (graph mode, same ops)", "tf1_bare"),
}


# -- one system, in a child process ----------------------------------------------------


def data(tf: Any, model: str) -> Any:
    import numpy as np

    inputs, _, outputs, batch, _, _ = MODELS[model]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * 64, inputs)).astype("float32")
    y = rng.integers(0, outputs, size=batch * 64)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat().prefetch(4)


def keras_model(model: str, steps_per_execution: int = 1) -> Any:
    import keras

    inputs, hidden, outputs, _, _, _ = MODELS[model]
    layers = [keras.layers.Dense(h, activation="relu") for h in hidden]
    net = keras.Sequential([keras.Input((inputs,)), *layers, keras.layers.Dense(outputs)])
    net.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    return net


def tf2_step(tf: Any, net: Any) -> Callable[..., Any]:
    optimizer, loss_fn = net.optimizer, net.loss

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x, training=True))
        grads = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(grads, net.trainable_variables, strict=True))
        return loss

    return step


def timed(run: Callable[[int], object], steps: int) -> float:
    run(WARMUP)
    started = time.perf_counter()
    run(steps)
    return steps / (time.perf_counter() - started)


def hand_written(tf: Any, model: str, steps: int, logdir: str, fsync: bool) -> float:
    net = keras_model(model)
    step = tf2_step(tf, net)
    checkpoint = tf.train.Checkpoint(model=net, optimizer=net.optimizer)
    manager = tf.train.CheckpointManager(checkpoint, logdir, max_to_keep=5)
    writer = tf.summary.create_file_writer(logdir)
    it = iter(data(tf, model))
    marks = {"save": time.monotonic(), "summary": time.monotonic()}
    count = tf.Variable(0, dtype=tf.int64)

    def run(n: int) -> None:
        last = (int(count.numpy()), time.monotonic())
        for _ in range(n):
            loss = step(*next(it))
            count.assign_add(1)
            now = time.monotonic()
            if now - marks["summary"] >= SUMMARY_SECS:
                done = int(count.numpy())
                with writer.as_default(step=done):
                    tf.summary.scalar("loss", loss)
                    tf.summary.scalar("steps/sec", (done - last[0]) / (now - last[1]))
                last, marks["summary"] = (done, now), now
            if now - marks["save"] >= SAVE_SECS:
                path = manager.save(checkpoint_number=count)
                if fsync:
                    for name in [*tf.io.gfile.glob(path + ".*"), logdir + "/checkpoint", logdir]:
                        fd = os.open(name, os.O_RDONLY)
                        os.fsync(fd)
                        os.close(fd)
                marks["save"] = now

    return timed(run, steps)


def supervised(tf: Any, model: str, steps: int, logdir: str, how: str) -> float:
    import anyio

    import asupervisor as asv

    net = keras_model(model, K if how == "fit_k" else 1)
    step = tf2_step(tf, net)
    dataset = data(tf, model)
    gs = net.optimizer.iterations if how == "train_iterations" else None
    if gs is not None:
        net.optimizer.build(net.trainable_variables)
    sv = asv.Supervisor(
        logdir,
        checkpoint={"model": net, "optimizer": net.optimizer},
        global_step=gs,
        # ``_off``: the supervision alone (the stop check, the data's place, the step's
        # count, hooks, heartbeat), without the work a save or a summary is.
        save_model_secs=0 if how.endswith("_off") else SAVE_SECS,
        save_summaries_secs=0 if how.endswith("_off") else SUMMARY_SECS,
        async_checkpoint=how.endswith("_async"),  # the files written beside the steps
        handle_signals=False,
    )
    result: list[float] = []

    async def main() -> None:
        async with sv.session() as sess:
            if how.startswith("fit"):
                # take, not steps_per_epoch: over one stream, steps_per_epoch=steps would
                # put the second epoch at batch `steps`, reached by skipping the batches
                # between inside the timed window.
                await sess.fit(net, dataset.take(WARMUP), epochs=1, verbose=0)
                started = time.perf_counter()
                await sess.fit(net, dataset.take(steps), epochs=2, verbose=0)
            elif how == "run":
                it = iter(dataset)
                for _ in range(WARMUP):
                    await sess.run(step, *next(it))
                started = time.perf_counter()
                for _ in range(steps):
                    await sess.run(step, *next(it))
            else:
                # The bare loops' data as it is: ``max_steps``, not ``take`` (a
                # ``take`` costs its own, about 5% of a tiny step inside a K-step loop).
                per_loop = K if how.startswith("train_k") else 1
                await sess.train(step, dataset, max_steps=WARMUP, steps_per_loop=per_loop)
                started = time.perf_counter()
                await sess.train(step, dataset, max_steps=steps, steps_per_loop=per_loop)
            result.append(steps / (time.perf_counter() - started))

    anyio.run(main)
    return result[0]


def keras_fit(
    tf: Any, model: str, steps: int, logdir: str, callbacks: str, per_call: int = 1
) -> float:
    import keras

    net = keras_model(model, per_call)
    dataset = data(tf, model)
    started = time.perf_counter()
    net.fit(dataset, steps_per_epoch=WARMUP, epochs=1, verbose=0)
    every = max(1, int(WARMUP / (time.perf_counter() - started)))  # batches per second, about
    chosen: list[Any] = []
    if callbacks:
        chosen.append(keras.callbacks.BackupAndRestore(logdir + "/backup", save_freq=2 * every))
        chosen.append(keras.callbacks.TensorBoard(logdir + "/tb", update_freq=every))
    if callbacks == "ckpt":
        path = logdir + "/ckpt-{batch}.weights.h5"
        chosen.append(
            keras.callbacks.ModelCheckpoint(path, save_weights_only=True, save_freq=2 * every)
        )
    started = time.perf_counter()
    net.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=chosen)
    return steps / (time.perf_counter() - started)


def tf1(tf: Any, model: str, steps: int, logdir: str, monitored: bool) -> float:
    tf.compat.v1.disable_eager_execution()
    with tf.Graph().as_default():  # a graph of its own: a process may build it twice
        return tf1_graph(tf, model, steps, logdir, monitored)


def tf1_graph(tf: Any, model: str, steps: int, logdir: str, monitored: bool) -> float:
    v1 = tf.compat.v1
    inputs, hidden, outputs, _, _, _ = MODELS[model]
    x, y = v1.data.make_one_shot_iterator(data(tf, model)).get_next()
    h, width = x, inputs
    for i, units in enumerate([*hidden, outputs]):
        w = v1.get_variable(f"w{i}", (width, units), initializer=v1.glorot_uniform_initializer())
        b = v1.get_variable(f"b{i}", (units,), initializer=v1.zeros_initializer())
        h = tf.matmul(h, w) + b
        h, width = (tf.nn.relu(h) if i < len(hidden) else h), units
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
    global_step = v1.train.get_or_create_global_step()
    train_op = v1.train.AdamOptimizer(1e-3).minimize(loss, global_step=global_step)
    v1.summary.scalar("loss", loss)
    if not monitored:
        with v1.Session() as session:
            session.run(v1.global_variables_initializer())
            return timed(lambda n: [session.run(train_op) for _ in range(n)], steps)
    with v1.train.MonitoredTrainingSession(
        checkpoint_dir=logdir,
        save_checkpoint_secs=SAVE_SECS,
        save_summaries_secs=SUMMARY_SECS,
        log_step_count_steps=None,
    ) as session:
        return timed(lambda n: [session.run(train_op) for _ in range(n)], steps)


def child(system: str, model: str) -> None:
    """One system in this process, between two runs of its own bare loop (half the steps
    each, just before and just after): a reference the machine's drift falls on alike."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    steps = timed_steps(system, model)
    with tempfile.TemporaryDirectory() as logdir:
        runs: dict[str, Callable[[int], float]] = {
            "bare": lambda n: bare(tf, model, n),
            "manual": lambda n: hand_written(tf, model, n, logdir, fsync=False),
            "manual_fsync": lambda n: hand_written(tf, model, n, logdir, fsync=True),
            "asv_train": lambda n: supervised(tf, model, n, logdir, "train"),
            "asv_train_iterations": lambda n: supervised(tf, model, n, logdir, "train_iterations"),
            "asv_train_off": lambda n: supervised(tf, model, n, logdir, "train_off"),
            "asv_train_k_off": lambda n: supervised(tf, model, n, logdir, "train_k_off"),
            "asv_run": lambda n: supervised(tf, model, n, logdir, "run"),
            "bare_k": lambda n: bare_k(tf, model, n),
            "bare_hop": lambda n: bare_hop(tf, model, n),
            "asv_train_k": lambda n: supervised(tf, model, n, logdir, "train_k"),
            "asv_train_k_async": lambda n: supervised(tf, model, n, logdir, "train_k_async"),
            "keras_fit_k": lambda n: keras_fit(tf, model, n, logdir, "", K),
            "asv_fit": lambda n: supervised(tf, model, n, logdir, "fit"),
            "asv_fit_k": lambda n: supervised(tf, model, n, logdir, "fit_k"),
            "keras_fit": lambda n: keras_fit(tf, model, n, logdir, ""),
            "keras_backup_tb": lambda n: keras_fit(tf, model, n, logdir, "backup"),
            "keras_ckpt_tb_backup": lambda n: keras_fit(tf, model, n, logdir, "ckpt"),
            "tf1_bare": lambda n: tf1(tf, model, n, logdir + "/bare", monitored=False),
            "mts": lambda n: tf1(tf, model, n, logdir + "/mts", monitored=True),
        }
        own = SYSTEMS[system][1]
        paired = own != system
        before = runs[own](steps // 2) if paired else float("nan")
        rate = runs[system](steps)
        after = runs[own](steps // 2) if paired else float("nan")
    print(json.dumps({"steps_per_sec": rate, "reference": (before + after) / 2}))


def timed_steps(system: str, model: str) -> int:
    """How many steps ``system`` is timed over (its own bare loop over half as many,
    before and after): the K-step rows (and their references) their own number."""
    many = system.endswith(("_k", "_k_async", "_k_off"))
    *_, one_call, k_rows = MODELS[model]  # the steps timed: one call a step, K a call
    return k_rows if many else one_call


def bare(tf: Any, model: str, steps: int) -> float:
    net = keras_model(model)
    step = tf2_step(tf, net)
    it = iter(data(tf, model))
    return timed(lambda n: [step(*next(it)) for _ in range(n)], steps)


def bare_hop(tf: Any, model: str, steps: int) -> float:
    """The bare loop driven from an event loop, each step run on a worker thread: the
    hand-off ``sess.run`` makes per call, and nothing else."""
    import anyio

    net = keras_model(model)
    step = tf2_step(tf, net)
    it = iter(data(tf, model))

    def run(n: int) -> None:
        async def main() -> None:
            for _ in range(n):
                await anyio.to_thread.run_sync(step, *next(it))

        anyio.run(main)

    return timed(run, steps)


def bare_k(tf: Any, model: str, steps: int) -> float:
    """The bare loop with ``K`` steps inside each ``tf.function`` call."""
    net = keras_model(model)
    step = tf2_step(tf, net)
    it = iter(data(tf, model))

    @tf.function
    def loop(iterator: Any, n: Any) -> None:
        for _ in tf.range(n):
            step(*next(iterator))

    def run(n: int) -> None:
        for start in range(0, n, K):
            loop(it, tf.constant(min(K, n - start)))

    return timed(run, steps)


# -- the parent: interleaved rounds, medians, the table ------------------------------


def ratio(median: dict[str, float], base: str, system: str) -> str:
    """Time per step of ``system`` over that of ``base`` (rates inverted)."""
    return f"{median[base] / median[system]:.2f}{TIMES}" if base in median else "—"


def measure(system: str, model: str) -> tuple[float, float]:
    """``system``'s steps/s, and its own bare loop's in the same process (NaN for a bare loop)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", system, model],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{system} on {model} failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1])
    return float(result["steps_per_sec"]), float(result["reference"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--models", nargs="+", default=["tiny,medium"], help="tiny medium (or comma-separated)"
    )
    parser.add_argument("--systems", nargs="+", default=[",".join(SYSTEMS)], help="as --models")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    systems = [s for arg in args.systems for s in arg.split(",") if s]
    models = [m for arg in args.models for m in arg.split(",") if m]
    unknown = sorted(set(systems) - set(SYSTEMS)) + sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown system or model: {', '.join(unknown)}")
    load_before = os.getloadavg()[0]  # the machine's load: the figures' conditions
    table: list[dict[str, object]] = []
    for model in models:
        inputs, hidden, outputs, batch, steps, k_steps = MODELS[model]
        shape = "-".join(map(str, [inputs, *hidden, outputs]))
        rates: dict[str, list[float]] = {s: [] for s in systems}
        paired: dict[str, list[float]] = {s: [] for s in systems}  # own bare / system, per run
        for r in range(args.rounds):
            shift = r % len(systems)
            for system in systems[shift:] + systems[:shift]:
                rate, reference = measure(system, model)
                rates[system].append(rate)
                paired[system].append(reference / rate)
        median = {s: statistics.median(v) for s, v in rates.items()}
        print(
            f"\n{model} model {shape}, Adam, batch {batch}, {steps} timed steps ({K} steps "
            f"per call: {k_steps}), {args.rounds} "
            "rounds (median steps/s; time per step vs the bare loops):\n"
        )
        print(
            "| system | steps/s (rounds) | vs bare TF2 loop | vs its own bare loop | "
            "vs its own bare loop, same process (rounds) |"
        )
        print("|---|---|---|---|---|")
        for system in systems:
            label, own = SYSTEMS[system]
            spread = ", ".join(f"{v:.0f}" for v in rates[system])
            vs_bare = ratio(median, "bare", system)
            vs_own = ratio(median, own, system) if own != system else "—"
            same = "—"
            if own != system:
                each = ", ".join(f"{v:.2f}" for v in paired[system])
                same = f"**{statistics.median(paired[system]):.2f}{TIMES}** ({each})"
            print(f"| {label} | {median[system]:.0f} ({spread}) | {vs_bare} | {vs_own} | {same} |")
            table.append(
                {
                    "model": f"{model} {shape}, batch {batch}",
                    "system": label,
                    "steps/s": median[system],
                    "rounds": rates[system],
                    "vs bare TF2 loop": vs_bare,
                    "vs its own bare loop": vs_own,
                    "vs its own bare loop, same process": same,
                }
            )
        sys.stdout.flush()
    load_after = os.getloadavg()[0]
    load = f"1-minute load average {load_before:.1f} at the start, {load_after:.1f} at the end"
    print(f"\n{load} ({os.cpu_count()} cores)")
    write("peers", table, rounds=args.rounds, load=load)


if __name__ == "__main__":
    main()
