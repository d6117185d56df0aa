"""The trainer that benchmarks/goodput.py runs and breaks: one model, three ways to train it.

    python benchmarks/goodput_trainer.py {asv,loop,fit} WORKDIR --steps N --save-steps S \
        [--logdir PATH]

- ``asv``: ``sess.train`` under a Supervisor (meant to run under ``asupervisor run``);
- ``loop``: a hand-written loop with ``tf.train.CheckpointManager`` (meant for a shell
  ``until`` loop);
- ``fit``: Keras ``fit`` with ``BackupAndRestore(save_freq=S)`` (the same ``until`` loop);
- ``asv-mw``: ``sess.train`` in one worker of a MultiWorkerMirroredStrategy job (its
  ``TF_CONFIG`` from ``asupervisor run --slurm``), the same model and global batch.

Each trains until the optimizer has taken ``N`` steps, saving every ``S`` steps, and
writes ``WORKDIR/done`` when it has. Faults are injected the same way into all three:
SIGUSR2 makes the next step raise, SIGRTMIN+1 makes the next step sleep forever (a hang).
The trainer writes its pid into ``WORKDIR/pid`` (``pid-<rank>`` for a worker of a job)
at its first step: the harness sends its
faults to a process that trains. Each process also writes ``WORKDIR/start-<pid>``: when
its script began, when its imports were done, when its state was restored (and from which
step), and when its first step began, so that the harness can say what each fault cost.
``asv`` also writes the session's own events (``checkpoint.saved``, the restore, the local
tier's) as JSON lines into ``WORKDIR/events-<pid>``: what a save held the training, and
where each restore came from. The checkpoints go to ``--logdir`` (``WORKDIR/logdir`` by
default; ``gs://...`` too); ``asupervisor run --local-dir`` turns on the local tier.
"""

from __future__ import annotations

import signal
import sys
import time

BEGUN = time.time()  # the script's first line (in a warm standby: once handed the command)
FAULT = {"crash": False, "hang": False}
RECORD_EVERY = 20  # steps between two records of the step log
HANG = signal.SIGRTMIN + 1


def _crash(signum: int, frame: object) -> None:
    FAULT["crash"] = True


def _hang(signum: int, frame: object) -> None:
    FAULT["hang"] = True


# First: a fault that comes during the imports acts at the first step, not as a death.
signal.signal(signal.SIGUSR2, _crash)
signal.signal(HANG, _hang)

import argparse  # noqa: E402
import os  # noqa: E402
from typing import Any  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=("asv", "loop", "fit", "asv-mw"))
    parser.add_argument("workdir")
    parser.add_argument("--steps", type=int, default=30000)
    parser.add_argument("--save-steps", type=int, default=200)
    parser.add_argument("--steps-per-epoch", type=int, default=1000, help="(fit)")
    parser.add_argument("--logdir", default=None, help="(default: WORKDIR/logdir)")
    args = parser.parse_args()
    args.logdir = args.logdir or os.path.join(args.workdir, "logdir")
    return args


def record_events(workdir: str) -> None:
    """The session's events, one JSON line each, into ``WORKDIR/events-<pid>``."""
    import json
    import logging

    path = os.path.join(workdir, f"events-{os.getpid()}")

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            event = getattr(record, "asupervisor_event", None)
            if event is None:
                return
            fields = getattr(record, "asupervisor_fields", {})
            line = {"at": record.created, "event": event, **fields}
            with open(path, "a") as f:
                f.write(json.dumps(line, default=str) + "\n")

    logger = logging.getLogger("asupervisor")
    logger.addHandler(Record())
    logger.setLevel(logging.INFO)


class Faults:
    """Called at the start of every step, in every system. It also records this process's
    steps: ``WORKDIR/steps-<pid>`` gets ``time steps global_step`` every ``every`` steps,
    from which the harness reads how fast the machine trained during the very run it
    measures, and where each process was when a fault came."""

    def __init__(self, workdir: str, every: int, pid_name: str = "pid") -> None:
        self.workdir = workdir
        self.pid_name = pid_name
        self.every = every
        self.steps = 0
        self.log = os.path.join(workdir, f"steps-{os.getpid()}")
        self.imported: float | None = None
        self.restored: tuple[float, int] | None = None  # (when, from which step)

    def __call__(self) -> None:
        if self.steps == 0:
            now = time.time()
            imported = self.imported or now
            restored_at, restored_step = self.restored or (now, -1)
            with open(os.path.join(self.workdir, f"start-{os.getpid()}"), "w") as f:
                f.write(f"{BEGUN} {imported} {restored_at} {restored_step} {now}\n")
            path = os.path.join(self.workdir, self.pid_name)
            with open(path + ".tmp", "w") as f:
                f.write(f"{os.getpid()} {now}\n")
            os.replace(path + ".tmp", path)
        if self.steps % self.every == 0:
            base = max(self.restored[1], 0) if self.restored else 0
            with open(self.log, "a") as f:  # time, this process's steps, the global step
                f.write(f"{time.time()} {self.steps} {base + self.steps}\n")
        self.steps += 1
        if FAULT["crash"]:
            raise RuntimeError("injected: a bug in the step")
        if FAULT["hang"]:
            time.sleep(10**9)  # a step that never ends


def model_and_optimizer() -> tuple[Any, Any]:
    """The benchmark's model (784-512-512-10) and Adam, one worker's or every worker's
    (made in the strategy's scope)."""
    import keras

    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    return model, keras.optimizers.Adam(1e-3)


def build() -> tuple[Any, Any, Any, Any]:
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model, optimizer = model_and_optimizer()
    x = tf.random.stateless_normal((8192, 784), seed=(1, 2))
    y = tf.random.stateless_uniform((8192,), (3, 4), maxval=10, dtype=tf.int64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(128)
    return tf, model, optimizer, data


def train_step(tf: Any, model: Any, optimizer: Any) -> Any:
    import keras

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return {"loss": loss}

    return step


def run_asv(args: argparse.Namespace, faults: Faults) -> int:
    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook

    record_events(args.workdir)
    tf, model, optimizer, data = build()
    faults.imported = time.time()
    step = train_step(tf, model, optimizer)

    def faulty_step(x: Any, y: Any) -> Any:
        faults()
        return step(x, y)

    async def main() -> None:
        sv = asv.Supervisor(
            args.logdir,
            checkpoint={"model": model, "optimizer": optimizer},
            global_step=optimizer.iterations,
            save_model_secs=0,
            save_model_steps=args.save_steps,
            save_summaries_secs=0,
            max_to_keep=3,
            stop_grace_secs=10,  # a step on a loaded machine may outlast 2 s
            heartbeat_secs=0.5,
            hooks=[StopAtStepHook(last_step=args.steps)],
        )
        async with sv.session() as sess:
            faults.restored = (time.time(), sess.restore_report.step)
            await sess.train(faulty_step, data)
        if sess.global_step >= args.steps:
            open(os.path.join(args.workdir, "done"), "w").close()

    return asv.run(main)


def run_multiworker(args: argparse.Namespace, faults: Faults) -> int:
    """One worker of a MultiWorkerMirroredStrategy job: the same model, its global batch
    of 128 split between the workers, each on data of its own."""
    import json

    import keras
    import tensorflow as tf

    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook

    rank = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    faults.pid_name = f"pid-{rank}"
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model, optimizer = model_and_optimizer()
    x = tf.random.stateless_normal((8192, 784), seed=(1, 2 + rank))
    y = tf.random.stateless_uniform((8192,), (3, 4 + rank), maxval=10, dtype=tf.int64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(128 // workers)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    faults.imported = time.time()

    @tf.function
    def step(xb: Any, yb: Any) -> Any:
        def replica(xb: Any, yb: Any) -> Any:
            with tf.GradientTape() as tape:
                per_example = loss_fn(yb, model(xb, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=128)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return {"loss": strategy.reduce("SUM", strategy.run(replica, args=(xb, yb)), axis=None)}

    def faulty_step(xb: Any, yb: Any) -> Any:
        faults()
        return step(xb, yb)

    async def main() -> None:
        sv = asv.Supervisor(
            os.path.join(args.workdir, "logdir"),
            checkpoint={"model": model, "optimizer": optimizer},
            global_step=optimizer.iterations,
            strategy=strategy,
            is_chief=None,
            save_model_secs=0,
            save_model_steps=args.save_steps,
            save_summaries_secs=0,
            max_to_keep=3,
            stop_grace_secs=10,
            heartbeat_secs=0.5,
            hooks=[StopAtStepHook(last_step=args.steps)],
        )
        async with sv.session() as sess:
            faults.restored = (time.time(), sess.restore_report.step)
            await sess.train(faulty_step, data)
        if sv.is_chief and sess.global_step >= args.steps:
            open(os.path.join(args.workdir, "done"), "w").close()

    return asv.run(main)


def run_loop(args: argparse.Namespace, faults: Faults) -> int:
    tf, model, optimizer, data = build()
    faults.imported = time.time()
    step = train_step(tf, model, optimizer)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, args.logdir, 3)
    checkpoint.restore(manager.latest_checkpoint)
    done = int(optimizer.iterations.numpy())
    faults.restored = (time.time(), done)
    for x, y in data:
        if done >= args.steps:
            break
        faults()
        step(x, y)
        done += 1
        if done % args.save_steps == 0:
            manager.save(checkpoint_number=done)
    open(os.path.join(args.workdir, "done"), "w").close()
    return 0


def run_fit(args: argparse.Namespace, faults: Faults) -> int:
    import keras

    _, model, optimizer, data = build()
    faults.imported = time.time()  # BackupAndRestore restores inside fit
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    class Inject(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            faults()

    backup = keras.callbacks.BackupAndRestore(
        os.path.join(args.workdir, "backup"), save_freq=args.save_steps
    )
    epochs = -(-args.steps // args.steps_per_epoch)
    model.fit(
        data,
        epochs=epochs,
        steps_per_epoch=args.steps_per_epoch,
        callbacks=[backup, Inject()],
        verbose=0,
    )
    open(os.path.join(args.workdir, "done"), "w").close()
    return 0


if __name__ == "__main__":
    arguments = parse()
    injector = Faults(arguments.workdir, RECORD_EVERY)
    runner = {"asv": run_asv, "loop": run_loop, "fit": run_fit, "asv-mw": run_multiworker}[
        arguments.system
    ]
    status = runner(arguments, injector)
    import gc

    gc.freeze()  # a quick exit (the examples do the same)
    sys.exit(status)
