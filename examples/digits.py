"""Train a digit classifier under asupervisor; run it again and it resumes.

    python examples/digits.py --logdir runs/digits          # trains to step 3000
    python examples/digits.py --logdir runs/digits --steps 6000   # resumes, on to 6000
    python -m tensorboard.main --logdir runs/digits         # loss, accuracy, steps/s

``--steps`` is the step the run trains to, not a count per start: a run stopped or
killed part-way (or restarted by ``asupervisor run``) resumes and still ends there.

The data set is scikit-learn's 8x8 digits (shipped inside the package: no
download). The checkpoint holds the model, the optimizer and the input
pipeline's position, so a resumed run continues the same data stream.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from typing import Any


def import_tensorflow_quietly() -> Any:
    """Import TensorFlow with its start-up chatter hidden (the demo's choice, not the library's)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    # absl prints some lines before TF_CPP_MIN_LOG_LEVEL applies, and a machine
    # without a GPU reports a failed cuInit when devices are first listed.
    os.dup2(devnull, 2)
    try:
        import tensorflow as tf

        tf.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)
    return tf


def tensorboard_command(logdir: str) -> str:
    """The command that starts TensorBoard with the Python that runs this demo."""
    script = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    if os.path.exists(script):
        return f"{os.path.relpath(script)} --logdir {logdir}"
    return f"{sys.executable} -m tensorboard.main --logdir {logdir}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train an MLP on scikit-learn's digits under asupervisor. "
        "Run it again with the same --logdir and it resumes where it stopped.",
    )
    parser.add_argument(
        "--logdir",
        default="runs/digits",
        help="checkpoints and TensorBoard events (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=3000,
        help="train until the global step reaches this; a resumed or restarted run keeps "
        "the same limit (default: %(default)s)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument(
        "--save-secs",
        type=float,
        default=1.0,
        help="seconds between checkpoints (default: %(default)s)",
    )
    parser.add_argument(
        "--summary-secs",
        type=float,
        default=0.5,
        help="seconds between TensorBoard summaries (default: %(default)s)",
    )
    parser.add_argument(
        "--eval-secs",
        type=float,
        default=2.0,
        help="seconds between evaluations (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.steps <= 0 or args.batch_size <= 0:
        parser.error("--steps and --batch-size must be positive")
    return args


def configure_logging() -> None:
    """The application decides where the library's events go: here, short lines on stdout."""
    import structlog

    render = structlog.dev.ConsoleRenderer(colors=False)
    # On a terminal, clear the progress line before a log line is printed over it.
    clear = "\r\x1b[K" if sys.stdout.isatty() else ""

    def render_line(logger: Any, name: str, event: Any) -> str:
        return clear + str(render(logger, name, event))

    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            render_line,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(20),  # info and above
    )
    logging.getLogger("asupervisor").setLevel(logging.INFO)  # the library's level decides


def load_data(tf: Any, batch_size: int) -> tuple[Any, tuple[Any, Any]]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    split = 1500
    train = (
        tf.data.Dataset.from_tensor_slices((x[:split], y[:split]))
        .shuffle(split, seed=0)
        .repeat()
        .batch(batch_size)
    )
    return train, (x[split:], y[split:])


async def main(args: argparse.Namespace) -> None:
    tf = import_tensorflow_quietly()  # after the arguments: --help answers at once
    import keras

    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook
    from asupervisor.services import ProgressService

    train, (x_test, y_test) = load_data(tf, args.batch_size)
    batches = iter(train)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_loss = keras.metrics.Mean()
    train_acc = keras.metrics.SparseCategoricalAccuracy()

    @tf.function
    def train_step() -> dict[str, Any]:
        x, y = next(batches)
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        train_loss.update_state(loss)
        train_acc.update_state(y, logits)
        return {"loss": loss}

    def summaries() -> dict[str, Any]:
        values = {"loss": train_loss.result(), "accuracy": train_acc.result()}
        train_loss.reset_state()
        train_acc.reset_state()
        return values

    sv = asv.Supervisor(
        args.logdir,
        checkpoint={"model": model, "optimizer": optimizer, "data": batches},
        global_step=optimizer.iterations,
        save_model_secs=args.save_secs,
        save_summaries_secs=args.summary_secs,
        summary_fn=summaries,
        # A limit on the global step, not on this start's steps: restarts end at it too.
        hooks=[stop_hook := StopAtStepHook(last_step=args.steps)],
        stop_grace_secs=10,
    )

    def evaluate() -> float:
        logits = model(x_test, training=False)
        return float(tf.reduce_mean(tf.cast(tf.argmax(logits, 1) == y_test, tf.float32)))

    @sv.service
    async def evaluation(sess: asv.ManagedSession) -> None:
        """A user service: test accuracy every few seconds, at a step boundary."""
        while not await sess.sleep_until_stop(args.eval_secs):
            accuracy = await sess.call(evaluate)  # on the training thread, between steps
            sess.summary_computed({"test_accuracy": accuracy})
            say(f"  eval  step {sess.global_step:6d}  test accuracy {accuracy:.3f}")

    # On a terminal, a live progress line; in a pipe or a log file, a line every half second.
    on_terminal = sys.stdout.isatty()

    def say(text: str) -> None:
        print(("\r\x1b[K" if on_terminal else "") + text, flush=True)

    async with sv.session() as sess:
        sess.start_service(ProgressService(stream=sys.stdout, total_steps=stop_hook.last_step))
        report = sess.restore_report
        first = report.step
        if report.source == "checkpoint":
            print(f"resumed from {report.path} at step {first}", flush=True)
        else:
            print(f"fresh start in {args.logdir}", flush=True)
        started, last_print = time.monotonic(), 0.0
        while not sess.should_stop():
            result = await sess.run(train_step)
            now = time.monotonic()
            if not on_terminal and now - last_print >= 0.5:
                rate = (sess.global_step - first) / max(now - started, 1e-9)
                print(
                    f"  train step {sess.global_step:6d}  "
                    f"loss {float(result['loss']):.4f}  {rate:7.0f} steps/s",
                    flush=True,
                )
                last_print = now
    accuracy = evaluate()
    print(
        f"stopped at step {sess.global_step} ({sess.stop_reason}); test accuracy {accuracy:.3f}\n"
        f"latest checkpoint: {tf.train.latest_checkpoint(args.logdir)}\n"
        f"TensorBoard: {tensorboard_command(args.logdir)}",
        flush=True,
    )


if __name__ == "__main__":
    arguments = parse_args()
    import asupervisor as asv

    configure_logging()
    # The exit status says how training ended: 0 done, 42 preempted (a SIGTERM or Ctrl-C:
    # saved, run it again to go on), 1 failed... (see the README's "Exit statuses").
    status = asv.run(main, arguments)
    # Everything is saved and closed: skip the interpreter's final garbage collection
    # over TensorFlow's ~300k objects (0.9 s of a 1 s exit here; gc.freeze: 0.1 s).
    gc.freeze()
    sys.exit(status)
