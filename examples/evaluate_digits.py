"""Test accuracy of the digits demo, beside training (the sidecar evaluator).

    .venv/bin/asupervisor evaluate runs/digits --script examples/evaluate_digits.py --idle-secs 30

Run it while ``make demo`` trains, or after: it evaluates every checkpoint the demo
committed, once, writes ``eval/accuracy`` into ``runs/digits/eval`` (TensorBoard shows
it beside training), and ends once no new checkpoint has come for 30 s. Run it again and
it goes on where it stopped.
"""

from __future__ import annotations

from typing import Any


def make_evaluator() -> tuple[dict[str, Any], Any]:
    """What the evaluator restores into (the model alone: the trainer's checkpoint also
    holds its optimizer and data position), and what it runs after each restore."""
    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = tf.constant((digits.data[1500:] / 16.0).astype("float32"))  # the demo's test split
    y = tf.constant(digits.target[1500:].astype("int64"))
    model = keras.Sequential(  # as examples/digits.py builds it: built, so it can be restored
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def eval_fn() -> dict[str, Any]:
        logits = model(x, training=False)
        accuracy = tf.reduce_mean(tf.cast(tf.argmax(logits, 1) == y, tf.float32))
        return {"accuracy": accuracy, "loss": loss_fn(y, logits)}

    return {"model": model}, eval_fn
