"""The suite's smallest training state: two variables that one step advances."""

from __future__ import annotations

import tensorflow as tf


class Pair(tf.Module):
    """Two variables that one step advances one after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.a = tf.Variable(0.0)
        self.b = tf.Variable(0.0)

    @tf.function
    def step(self) -> dict[str, tf.Tensor]:
        self.a.assign_add(1.0)
        self.b.assign_add(1.0)
        return {"loss": self.a}
