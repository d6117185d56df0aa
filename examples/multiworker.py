"""The digits example on several workers: tf.distribute.MultiWorkerMirroredStrategy.

On this machine, two workers on loopback ports (this script starts them):

    python examples/multiworker.py --workers 2 --logdir runs/multiworker

On a real cluster, run it once per host, each with its own TF_CONFIG (the same
cluster, its own task index) and a logdir every host reads at the same path:

    TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]},
                "task": {"type": "worker", "index": 0}}' \\
        python examples/multiworker.py --logdir /shared/runs/multiworker

Worker 0 is the chief: it alone writes checkpoints and TensorBoard events into
the logdir. SIGTERM to any worker stops every worker at the same step with one
final checkpoint; a worker that dies ends the others with an error, and running
the job again resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train the digits MLP with MultiWorkerMirroredStrategy under asupervisor. "
        "With --workers N, start N workers on this machine; without it, run one worker "
        "as TF_CONFIG says. Run it again with the same --logdir and it resumes.",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="start this many local workers on loopback ports (default: be one worker "
        "of the job in TF_CONFIG)",
    )
    parser.add_argument(
        "--logdir",
        default="runs/multiworker",
        help="checkpoints and TensorBoard events, written by the chief (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=2000,
        help="train until the global step reaches this; a resumed or restarted job keeps "
        "the same limit (default: %(default)s)",
    )
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=32,
        help="examples per step over all workers (default: %(default)s)",
    )
    parser.add_argument(
        "--save-secs",
        type=float,
        default=10.0,
        help="seconds between checkpoints, on the chief's clock (default: %(default)s)",
    )
    parser.add_argument(
        "--summary-secs",
        type=float,
        default=5.0,
        help="seconds between TensorBoard summaries (default: %(default)s)",
    )
    parser.add_argument(
        "--stop-after-first-save",
        action="store_true",
        help="ask for a stop from an after_save hook, which runs on the chief only: shows "
        "that a stop asked on one worker stops every worker after the same step",
    )
    args = parser.parse_args(argv)
    if args.steps <= 0 or args.global_batch_size <= 0:
        parser.error("--steps and --global-batch-size must be positive")
    if args.workers is not None and args.workers <= 0:
        parser.error("--workers must be positive")
    if args.workers is None and "TF_CONFIG" not in os.environ:
        parser.error("give --workers N to start local workers, or set TF_CONFIG")
    return args


# -- the launcher: N local workers ---------------------------------------------


def local_tf_configs(count: int) -> list[str]:
    """One TF_CONFIG per worker of a job on free loopback ports of this machine."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    cluster = {"worker": [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]}
    for s in sockets:
        s.close()
    return [
        json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        for index in range(count)
    ]


def launch(args: argparse.Namespace) -> int:
    """Start the workers; forward SIGTERM/SIGINT to all of them; exit with the worst code."""
    configs = local_tf_configs(args.workers)
    passed = [a for a in sys.argv[1:] if not a.startswith("--workers=")]
    if "--workers" in passed:
        i = passed.index("--workers")
        del passed[i : i + 2]
    children = []
    for config in configs:
        env = {**os.environ, "TF_CONFIG": config}
        # A session of its own: a Ctrl-C reaches the launcher only, which stops the
        # workers with one SIGTERM each (they agree on the step among themselves).
        children.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *passed],
                env=env,
                start_new_session=True,
            )
        )
    addresses = json.loads(configs[0])["cluster"]["worker"]
    print(f"started {args.workers} workers at {addresses}; logdir {args.logdir}", flush=True)

    def forward(signum: int, frame: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    print(f"workers exited with {codes}", flush=True)
    # The worst status: a failure (1) before a preemption (42) before done (0).
    return max(codes, key=lambda code: (code not in (0, 42), code == 42, abs(code)))


# -- one worker ------------------------------------------------------------------


def import_tensorflow_quietly() -> Any:
    """Import TensorFlow with its start-up chatter hidden (the demo's choice, not the library's)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        import tensorflow as tf

        tf.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)
    return tf


def configure_logging(worker: str) -> None:
    """Short lines on stdout, each naming the worker that wrote it."""
    import structlog

    render = structlog.dev.ConsoleRenderer(colors=False)

    def render_line(logger: Any, name: str, event: Any) -> str:
        return f"[{worker}] {render(logger, name, event)}"

    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            render_line,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(20),  # info and above
    )
    logging.getLogger("asupervisor").setLevel(logging.INFO)  # the library's level decides


class Training:
    """The model, its distributed step and its data: everything but the supervision
    (benchmarks/multiworker.py runs the same step without a supervisor)."""

    def __init__(self, tf: Any, strategy: Any, global_batch_size: int) -> None:
        import keras
        from sklearn.datasets import load_digits

        self.tf, self.strategy = tf, strategy
        self.workers = strategy.num_replicas_in_sync
        self.rank = strategy.cluster_resolver.task_id or 0
        self.batch = global_batch_size // self.workers
        digits = load_digits()
        x = (digits.data / 16.0).astype("float32")
        y = digits.target.astype("int64")
        self.train_xy, self.test_xy = (x[:1500], y[:1500]), (x[1500:], y[1500:])
        with strategy.scope():
            self.model = keras.Sequential(
                [
                    keras.Input((64,)),
                    keras.layers.Dense(64, activation="relu"),
                    keras.layers.Dense(10),
                ]
            )
            self.optimizer = keras.optimizers.Adam(1e-3)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        model, optimizer = self.model, self.optimizer
        # Plain variables, outside the strategy: reading them needs no collective, so
        # the chief alone can write summaries.
        self.loss_sum = loss_sum = tf.Variable(0.0, trainable=False)
        self.loss_count = loss_count = tf.Variable(0.0, trainable=False)

        @tf.function
        def train_step(xb: Any, yb: Any) -> dict[str, Any]:
            def replica_step(xb: Any, yb: Any) -> Any:
                with tf.GradientTape() as tape:
                    per_example = loss_fn(yb, model(xb, training=True))
                    loss = tf.nn.compute_average_loss(
                        per_example, global_batch_size=global_batch_size
                    )
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return loss

            loss = strategy.reduce("SUM", strategy.run(replica_step, args=(xb, yb)), axis=None)
            loss_sum.assign_add(loss)
            loss_count.assign_add(1.0)
            return {"loss": loss}

        self.train_step = train_step

    def data(self, start: int) -> Any:
        """This worker's shard, from the position of step ``start`` on: the input stream
        follows from the restored step, so a resumed run continues it."""
        return (
            self.tf.data.Dataset.from_tensor_slices(self.train_xy)
            .shard(self.workers, self.rank)
            .shuffle(1500, seed=0)
            .repeat()
            .batch(self.batch, drop_remainder=True)
            .skip(start)
        )

    def summaries(self) -> dict[str, Any]:
        mean = self.loss_sum / self.tf.maximum(self.loss_count, 1.0)
        self.loss_sum.assign(0.0)
        self.loss_count.assign(0.0)
        return {"loss": mean}

    def accuracy(self) -> float:
        tf, (x_test, y_test) = self.tf, self.test_xy
        logits = self.model(x_test, training=False)
        return float(tf.reduce_mean(tf.cast(tf.argmax(logits, 1) == y_test, tf.float32)))


async def train(args: argparse.Namespace, tf: Any) -> int:
    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook

    # MWMS must exist before any other TensorFlow work: it starts this worker's server.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    worker = f"{resolver.task_type or 'worker'}:{resolver.task_id or 0}"
    configure_logging(worker)
    training = Training(tf, strategy, args.global_batch_size)

    class StopAfterFirstSave(asv.Hook):
        def after_save(self, session: asv.ManagedSession, step: int, path: str) -> bool:
            return step > session.restore_report.step  # the first save after the start

    stop_after_first_save = [StopAfterFirstSave()] if args.stop_after_first_save else []

    sv = asv.Supervisor(
        args.logdir,
        checkpoint={"model": training.model, "optimizer": training.optimizer},
        strategy=strategy,
        is_chief=None,  # from TF_CONFIG: worker 0 is the chief
        save_model_secs=args.save_secs,
        save_summaries_secs=args.summary_secs,
        summary_fn=training.summaries,
        # A limit on the global step, not on this start's steps: restarts end at it too.
        hooks=[StopAtStepHook(last_step=args.steps), *stop_after_first_save],
        stop_grace_secs=30,
    )

    @sv.service
    async def report(sess: asv.ManagedSession) -> None:
        """Progress every 5 s, from the chief only: the workers step together."""
        if not sv.is_chief:
            return
        first, started = sess.global_step, time.monotonic()
        while not await sess.sleep_until_stop(5.0):
            rate = (sess.global_step - first) / (time.monotonic() - started)
            print(f"[{worker}] step {sess.global_step:6d}  {rate:7.1f} steps/s", flush=True)

    async with sv.session() as sess:
        start = sess.restore_report.step
        source = sess.restore_report.path or sess.restore_report.source
        print(
            f"[{worker}] {'chief' if sv.is_chief else 'worker'} of {training.workers}, "
            f"starting at step {start} ({source})",
            flush=True,
        )
        began = time.monotonic()
        await sess.train(training.train_step, training.data(start))
        seconds = time.monotonic() - began
    steps = sess.global_step - start
    print(
        f"[{worker}] stopped at step {sess.global_step} ({sess.stop_reason}); "
        f"{steps} steps in {seconds:.1f} s = {steps / max(seconds, 1e-9):.1f} steps/s; "
        f"test accuracy {training.accuracy():.3f}",
        flush=True,
    )
    if sv.is_chief:
        latest = tf.train.latest_checkpoint(args.logdir)
        print(f"[{worker}] latest checkpoint: {latest}", flush=True)
    return 0


def main() -> int:
    args = parse_args()
    if args.workers is not None:
        return launch(args)
    tf = import_tensorflow_quietly()
    import asupervisor as asv

    async def train_or_explain(args: argparse.Namespace, tf: Any) -> int:
        try:
            return await train(args, tf)
        except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError):
            # Another worker is gone: this one stopped without a final save (that would
            # need every worker). Start the whole job again and it resumes.
            print(
                "a worker of this job was lost; run the job again to resume from the last "
                "checkpoint",
                flush=True,
            )
            raise

    # The exit status says how training ended: 0 done, 42 preempted, 1 failed (a lost
    # worker)... (see the README's "Exit statuses").
    status = asv.run(train_or_explain, args, tf)
    # Everything is saved and closed: skip the interpreter's final garbage collection
    # over TensorFlow's ~300k objects (0.9 s of a 1 s exit here; gc.freeze: 0.1 s).
    gc.freeze()
    return status


if __name__ == "__main__":
    sys.exit(main())
