"""Keras ``model.fit`` under asupervisor: checkpoints inside epochs, resume at the exact batch.

    python examples/fit.py --logdir runs/fit        # 5 epochs; Ctrl-C (or kill it) any time,
    python examples/fit.py --logdir runs/fit        # and it goes on at the batch it stopped at

The data set is scikit-learn's 8x8 digits (shipped inside the package: no download),
shuffled with the epoch as the seed, so that a resumed epoch sees the same order.
Keras' own callbacks work as with ``fit``; its logs (loss, accuracy) go to TensorBoard.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train an MLP on scikit-learn's digits with model.fit under asupervisor. "
        "Run it again with the same --logdir and it resumes at the batch where it stopped.",
    )
    parser.add_argument("--logdir", default="runs/fit", help="default: %(default)s")
    parser.add_argument("--epochs", type=int, default=5, help="default: %(default)s")
    parser.add_argument("--batch-size", type=int, default=32, help="default: %(default)s")
    parser.add_argument(
        "--save-secs", type=float, default=2.0, help="seconds between checkpoints (default: 2)"
    )
    parser.add_argument(
        "--save-steps", type=int, default=None, help="also save every N batches (default: off)"
    )
    args = parser.parse_args(argv)
    if args.epochs <= 0 or args.batch_size <= 0:
        parser.error("--epochs and --batch-size must be positive")
    return args


def import_tensorflow_quietly() -> Any:
    """Import TensorFlow with its start-up chatter hidden (the example's choice)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        import tensorflow as tf

        tf.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)
    return tf


async def main(args: argparse.Namespace) -> None:
    tf = import_tensorflow_quietly()
    import keras
    from sklearn.datasets import load_digits

    import asupervisor as asv

    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int64")
    train = tf.data.Dataset.from_tensor_slices((x[:1500], y[:1500]))

    def epoch_data(epoch: int) -> Any:
        """The same order for the same epoch, after a restart too."""
        return train.shuffle(1500, seed=epoch).batch(args.batch_size)

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    sv = asv.Supervisor(
        args.logdir,
        checkpoint={"model": model, "optimizer": model.optimizer},
        global_step=model.optimizer.iterations,
        save_model_secs=args.save_secs,
        save_model_steps=args.save_steps,
        save_summaries_secs=1,
    )

    class EpochLine(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            logs = logs or {}
            print(
                f"epoch {epoch} loss {logs.get('loss', 0):.4f} "
                f"accuracy {logs.get('accuracy', 0):.3f}",
                flush=True,
            )

    batches = int(epoch_data(0).cardinality())
    async with sv.session() as sess:
        epoch, batch = sess.data_position
        where = sess.restore_report.path or "a fresh start"
        print(
            f"{batches} batches per epoch; starting at epoch {epoch} batch {batch} "
            f"(step {sess.global_step}, {where})",
            flush=True,
        )
        await sess.fit(model, epoch_data, epochs=args.epochs, callbacks=[EpochLine()], verbose=0)
    epoch, batch = sess.data_position
    _, accuracy = model.evaluate(x[1500:], y[1500:], verbose=0)
    print(
        f"stopped at step {sess.global_step} ({sess.stop_reason}), epoch {epoch} batch "
        f"{batch}; test accuracy {accuracy:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    arguments = parse_args()
    import asupervisor as asv

    # The supervisor's events at INFO (checkpoints, start, stop); everything else at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("asupervisor").setLevel(logging.INFO)
    # The exit status says how training ended: 0 done, 42 preempted (a SIGTERM or Ctrl-C:
    # saved, run it again to go on), 1 failed... (see the README's "Exit statuses").
    status = asv.run(main, arguments)
    # Everything is saved and closed: skip the interpreter's final garbage collection
    # over TensorFlow's ~300k objects (0.9 s of a 1 s exit here; gc.freeze: 0.1 s).
    gc.freeze()
    sys.exit(status)
