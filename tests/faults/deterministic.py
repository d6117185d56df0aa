"""A deterministic supervised run, to be interrupted and compared with itself left alone.

    python tests/faults/deterministic.py LOGDIR --mode train|fit [--epochs N]
        [--save-steps N] [--async] [--backend asyncio|trio] [--record FILE] [--final FILE]
        [--per-call K]

Everything that could differ between two runs is seeded: Keras' and TF's seeds, op
determinism, Dropout (a Keras ``SeedGenerator``), a shuffled ``tf.data`` pipeline (a
function of the epoch, as the docs' recipe says), Adam. ``--mode train`` is a custom
step under ``sess.train(step, data, epochs=)`` with a learning-rate schedule and a hook
that keeps ``state()``; ``--mode fit`` is ``sess.fit`` with validation data,
EarlyStopping, ReduceLROnPlateau and ModelCheckpoint(save_best_only). ``--per-call K``
runs K steps in one call: ``sess.train(steps_per_loop=K)``, or fit's
``compile(steps_per_execution=K)``.

Each example carries its id in its last column; every batch a step trains appends
``<step> <ids...>`` to ``--record`` (the step is the optimizer's iterations before the
batch) and each session appends ``restored <step>``: the batches a run trained, in
order, are what a reader keeps of that file (``trained`` below). A run that ends (not
stopped by a signal) writes its final state to ``--final`` (an ``.npz``).

It prints ``restored STEP``, ``step STEP`` after each batch, ``saved STEP``, ``epoch
E`` and ``validating`` (fit), ``finished`` or ``stopped STEP REASON``.

With ``TF_CONFIG`` set (``--mode train`` only), it is one worker of a
``MultiWorkerMirroredStrategy`` job: the step runs under the strategy, the data is
``strategy.experimental_distribute_dataset`` of the same pipeline (auto-sharded), each
worker records its own examples in ``--record`` + ``.<worker>``, and the chief writes
the final state.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

EXAMPLES = 640  # 20 batches of 32 an epoch
BATCH = 32
FEATURES = 8


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir")
    parser.add_argument("--mode", choices=("train", "fit"), default="train")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=7)
    parser.add_argument("--async", dest="async_checkpoint", action="store_true")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--record", default=None)
    parser.add_argument("--final", default=None)
    parser.add_argument("--local-dir", default=None, help="save into a local tier there")
    parser.add_argument("--per-call", type=int, default=1)
    parser.add_argument("--faults", default=None, help="a JSON file: faults at given steps")
    parser.add_argument("--step-timeout", type=float, default=None)
    parser.add_argument(
        "--stop-signals", default=None, help="the session's stop signals: SIGTERM,SIGUSR1,..."
    )
    return parser.parse_args(argv)


def fault_plan(path: str | None) -> Any:
    """``--faults``' plan: what to do at which step, for the tests of a job SLURM runs.

    The file holds ``{"marks": DIR, "plan": [FAULT, ...]}``; a FAULT is ``{"do": "kill" |
    "hang" | "crash" | "slow", "step": S}`` and, optionally, the ``worker``, ``attempt``
    (``ASUPERVISOR_ATTEMPT``) and ``restart`` (``SLURM_RESTART_COUNT``) it is for (any,
    if left out). At the step it applies to (``slow``: every step from it on, a pause of
    ``secs``), before the batch trains, the worker writes ``DIR/<do>-<restart>-<worker>-
    <step>`` (the fact a test waits for) and then: SIGKILLs itself, hangs (a training
    step that never ends), raises, or sleeps; each but ``slow`` once (a restart that
    trains the step again goes on), unless ``"again": true`` (``crash``: at every start).
    Returns ``fault(step, worker)``."""
    if path is None:
        return lambda step, worker: None
    import time

    spec = json.loads(Path(path).read_text())
    here = {
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "attempt": int(os.environ.get("ASUPERVISOR_ATTEMPT", "1") or 1),
    }

    def fault(step: int, worker: int) -> None:
        for f in spec["plan"]:
            mine = all(f.get(k, v) == v for k, v in {**here, "worker": worker}.items())
            due = step >= f["step"] if f["do"] == "slow" else step == f["step"]
            if not (mine and due):
                continue
            mark = Path(spec["marks"], f"{f['do']}-{here['restart']}-{worker}-{f['step']}")
            if mark.exists() and f["do"] != "slow" and not f.get("again"):
                continue  # once: a restart that trains this step again goes on
            mark.touch()
            if f["do"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f["do"] == "hang":
                while True:
                    time.sleep(1)
            elif f["do"] == "crash":
                raise RuntimeError(f"a fault at step {step}")
            elif f["do"] == "slow":
                time.sleep(float(f.get("secs", 0.1)))

    return fault


def trained(record: str) -> list[tuple[int, tuple[int, ...]]]:
    """The batches the runs recorded in ``record`` trained, as ``(step, ids)`` in order:
    a session restored at step ``s`` undoes what earlier sessions trained from ``s`` on
    (a kill loses what no checkpoint held; the resumed run trains it again). The records
    of a multi-worker job's workers (``record.<worker>``) are merged: a step's ids are
    every worker's."""
    paths = sorted(Path(record).parent.glob(Path(record).name + ".*")) or [Path(record)]
    merged: dict[int, tuple[int, ...]] = {}
    for path in paths:
        by_step: dict[int, tuple[int, ...]] = {}
        for line in path.read_text().splitlines():
            word, *rest = line.split()
            if word == "restored":
                at = int(rest[0])
                by_step = {s: ids for s, ids in by_step.items() if s < at}
            elif rest:
                by_step[int(word)] = tuple(int(i) for i in rest)
        for step, ids in by_step.items():
            merged[step] = tuple(sorted(merged.get(step, ()) + ids)) if len(paths) > 1 else ids
    return sorted(merged.items())


def compare(left: Mapping[str, Any], right: Mapping[str, Any]) -> dict[str, Any]:
    """How two final states differ: the largest difference of any weight, and whether
    every other value (iterations, learning rate, RNG, callbacks' and hooks' state) is
    bitwise the same."""
    import numpy as np

    weights = sorted(k for k in left if k.startswith("weight"))
    assert weights == sorted(k for k in right if k.startswith("weight")), "other models"
    diff = max(float(np.max(np.abs(left[k] - right[k]))) for k in weights)
    others = sorted(set(left) | set(right))
    unequal = [
        k
        for k in others
        if not k.startswith("weight")
        and (k not in left or k not in right or not np.array_equal(left[k], right[k]))
    ]
    bitwise = all(np.array_equal(left[k], right[k]) for k in weights)
    return {"max_weight_difference": diff, "weights_bitwise": bitwise, "unequal": unequal}


def batch_differences(
    left: list[tuple[int, tuple[int, ...]]], right: list[tuple[int, tuple[int, ...]]]
) -> dict[str, int]:
    """Batches in another place than in the other run, and, epoch by epoch, the examples
    trained more (repeated) or fewer (skipped) times than there."""
    from collections import Counter

    moved = sum(a != b for a, b in zip(left, right, strict=False)) + abs(len(left) - len(right))
    repeated = skipped = 0
    per_epoch = EXAMPLES // BATCH
    for epoch in range(max(len(left), len(right)) // per_epoch + 1):
        part = slice(epoch * per_epoch, (epoch + 1) * per_epoch)
        lc = Counter(i for _, ids in left[part] for i in ids)
        rc = Counter(i for _, ids in right[part] for i in ids)
        repeated += sum((lc - rc).values())
        skipped += sum((rc - lc).values())
    return {"batches_moved": moved, "examples_repeated": repeated, "examples_skipped": skipped}


def main(args: argparse.Namespace) -> int:
    import tensorflow as tf

    # A multi-worker strategy first: it starts this worker's server before any TF work.
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if "TF_CONFIG" in os.environ else None
    import keras
    import numpy as np

    import asupervisor as asv

    worker = 0 if strategy is None else strategy.cluster_resolver.task_id or 0
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    rng = np.random.default_rng(0)
    features = rng.normal(size=(EXAMPLES + 128, FEATURES)).astype("float32")
    target = (features @ rng.normal(size=(FEATURES, 1)).astype("float32")).astype("float32")
    ids = np.arange(EXAMPLES + 128, dtype="float32")[:, None]
    x = np.concatenate([features, ids], axis=1)  # the id rides in the last column
    examples = tf.data.Dataset.from_tensor_slices((x[:EXAMPLES], target[:EXAMPLES]))
    validation = tf.data.Dataset.from_tensor_slices((x[EXAMPLES:], target[EXAMPLES:])).batch(64)

    def data(epoch: int) -> Any:
        batches = examples.shuffle(256, seed=1000 + epoch).batch(BATCH)
        return batches if strategy is None else strategy.experimental_distribute_dataset(batches)

    record_to = args.record if strategy is None or not args.record else f"{args.record}.{worker}"
    record_fd = (
        os.open(record_to, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if record_to else None
    )

    fault = fault_plan(args.faults)

    def record(step: Any, batch_ids: Any) -> Any:
        fault(int(step), worker)
        if record_fd is not None:
            line = " ".join([str(int(step)), *(str(int(i)) for i in batch_ids.numpy())])
            os.write(record_fd, (line + "\n").encode())
        return np.int64(0)

    def recorded(step: Any, x: Any) -> Any:
        """``x`` without its id column, once the batch's ids are in the record."""
        done = tf.py_function(record, [step, tf.cast(x[:, -1], tf.int64)], tf.int64)
        with tf.control_dependencies([done]):
            return tf.identity(x[:, :-1])

    class Model(keras.Sequential):
        def train_step(self, data: Any) -> Any:
            x, y = data
            return super().train_step((recorded(self.optimizer.iterations, x), y))

        def test_step(self, data: Any) -> Any:
            x, y = data
            return super().test_step((x[:, :-1], y))

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = Model(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dropout(0.3),
                keras.layers.Dense(1),
            ]
        )
        if args.mode == "train":
            schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.9)
            optimizer = keras.optimizers.Adam(schedule)
        else:
            optimizer = keras.optimizers.Adam(0.01)
        model.compile(
            optimizer=optimizer,
            loss="mse",
            jit_compile=False,
            steps_per_execution=args.per_call if args.mode == "fit" else 1,
        )
        model.optimizer.build(model.trainable_variables)
    seeds = [v for layer in model.layers for v in vars(layer).values()
             if isinstance(v, keras.random.SeedGenerator)]  # fmt: skip

    class Progress(asv.Hook):
        """Says where the run is, and keeps a state of its own across restarts."""

        def __init__(self) -> None:
            self.steps, self.loss_sum = 0, 0.0

        def after_run(self, ctx: asv.RunContext, result: Any) -> None:
            self.steps += 1
            self.loss_sum += float(result["loss"])
            print(f"step {int(model.optimizer.iterations.numpy())}", flush=True)

        def after_save(self, session: asv.ManagedSession, step: int, path: str) -> bool:
            print(f"saved {step}", flush=True)
            return False

        def state(self) -> dict[str, Any]:
            return {"steps": self.steps, "loss_sum": self.loss_sum}

        def restore(self, state: Mapping[str, Any]) -> None:
            self.steps, self.loss_sum = int(state["steps"]), float(state["loss_sum"])

    progress = Progress()
    sv = asv.Supervisor(
        args.logdir,
        checkpoint={"model": model, "optimizer": model.optimizer},
        global_step=model.optimizer.iterations,
        save_model_secs=0,
        save_model_steps=args.save_steps,
        save_summaries_secs=0,
        async_checkpoint=args.async_checkpoint,
        hooks=[progress],
        strategy=strategy,
        is_chief=None if strategy is not None else True,
        stop_grace_secs=60,
        local_tier=None
        if args.local_dir is None
        else asv.LocalTier(args.local_dir, save_secs=None, save_steps=args.save_steps),
        step_timeout_secs=args.step_timeout,
        **(
            {}
            if args.stop_signals is None
            else {"stop_signals": tuple(signal.Signals[n] for n in args.stop_signals.split(","))}
        ),
    )

    class Markers(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            print(f"epoch {epoch}", flush=True)

        def on_test_begin(self, logs: Any = None) -> None:
            print("validating", flush=True)

    callbacks = [
        keras.callbacks.EarlyStopping("val_loss", patience=2, min_delta=0.05),
        keras.callbacks.ReduceLROnPlateau("val_loss", patience=1, factor=0.5, min_delta=0.05),
        keras.callbacks.ModelCheckpoint(
            os.path.join(args.logdir, "best.weights.h5"),
            save_best_only=True,
            save_weights_only=True,
        ),
        Markers(),
    ]

    def replica_step(x: Any, y: Any) -> Any:
        x = recorded(model.optimizer.iterations, x)
        with tf.GradientTape() as tape:
            per_example = tf.reshape(tf.square(model(x, training=True) - y), [-1])
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def step(x: Any, y: Any) -> dict[str, Any]:
        if strategy is None:
            return {"loss": replica_step(x, y)}
        losses = strategy.run(replica_step, args=(x, y))
        return {"loss": strategy.reduce("SUM", losses, axis=None)}

    async def run() -> None:
        async with sv.session() as sess:
            at = int(model.optimizer.iterations.numpy())
            if record_fd is not None:
                os.write(record_fd, f"restored {at}\n".encode())
            print(f"restored {at}", flush=True)
            print(f"tier {sess.restore_report.tier}", flush=True)
            if args.mode == "train":
                await sess.train(step, data, epochs=args.epochs, steps_per_loop=args.per_call)
            else:
                await sess.fit(
                    model,
                    data,
                    epochs=args.epochs,
                    validation_data=validation,
                    callbacks=callbacks,
                    verbose=0,
                )
        if sess.stop_reason == asv.StopReason.SIGNAL:
            print(f"stopped {int(model.optimizer.iterations.numpy())} signal", flush=True)
            return
        if args.final and sv.is_chief:
            final: dict[str, Any] = {
                f"weight{i}": w.numpy() for i, w in enumerate(model.trainable_variables)
            }
            final["iterations"] = model.optimizer.iterations.numpy()
            final["learning_rate"] = np.asarray(model.optimizer.learning_rate.numpy())
            for i, generator in enumerate(seeds):
                final[f"seed{i}"] = generator.state.numpy()
            final["hook"] = np.asarray(json.dumps(progress.state()))
            if args.mode == "fit":
                kept = {
                    type(cb).__name__: {f: repr(getattr(cb, f, None)) for f in fields}
                    for cb in callbacks
                    for name, fields in asv_fields().items()
                    if type(cb).__name__ == name
                }
                final["callbacks"] = np.asarray(json.dumps(kept, sort_keys=True))
            final["position"] = np.asarray(sess.data_position)
            np.savez(args.final, **final)
        print("finished", flush=True)

    return asv.run(run, backend=args.backend)


def asv_fields() -> dict[str, tuple[str, ...]]:
    """The callbacks' fields Keras resets at each fit call (the ones a restart must keep)."""
    from asupervisor._training.kept_state import KERAS_FIELDS

    return KERAS_FIELDS


if __name__ == "__main__":
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    sys.exit(main(parse()))
